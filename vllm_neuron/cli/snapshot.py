"""`vllm-neuron snapshot ls|show|replay`: inspect input snapshots and replay them.

    vllm-neuron snapshot ls [ROOT] [--json]
    vllm-neuron snapshot show BUNDLE [--json]
    vllm-neuron snapshot replay BUNDLE [--runner auto|cache|eager] [--atol A] [--rtol R]
    vllm-neuron snapshot replay --manifest MANIFEST [--graph HASH] [--root R] ...

ROOT defaults to the configured snapshot root ($VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR, else
$VLLM_CACHE_ROOT/neuron/snapshots). BUNDLE is a path or URL of a call directory, or a hash or
rank directory (every bundle below it: all ranks of a tensor-parallel capture), or such a
``<hash>[/rank<N>[/call<K>]]`` relative to --root. `replay` exits 1 when any output fails;
its report is per bundle and per rank. A bundle whose graph calls a collective is replayed
together with the other ranks' bundles of the same call, one process per rank (or refused,
saying which rank's bundle is missing; see `vllm_neuron.snapshot.tp_replay`). With
``--manifest`` it replays every bundle an engine's manifest names on its graphs (or on the
one ``--graph`` names): a path relative to the snapshot root (``--root``, default the
configured one), or a URL.

Bundles written by AWS's Neuron plugin (``meta.json`` without our record tag; see
`vllm_neuron.snapshot.meta`) are listed and shown like ours, with ``-`` for what the plugin
does not record (step, phase, age). They hold inputs only, so `replay` reports, per bundle,
that there is nothing to run and compare against, and exits 1.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

from vllm_neuron.backends import is_url, join
from vllm_neuron.compile.entry.text import printable
from vllm_neuron.manifest.inspect import load_manifest, select_graphs, snapshot_paths
from vllm_neuron.manifest.schema import Locations
from vllm_neuron.manifest.snapshot_links import path_order
from vllm_neuron.snapshot.bundles import (
    ReplayError,
    find_bundles,
    list_bundles,
    load_bundle,
    locate,
    open_snapshot_root,
)
from vllm_neuron.snapshot.config import load_snapshot_config
from vllm_neuron.snapshot.meta import META_FILE
from vllm_neuron.snapshot.replay import CacheChoice, ReplayReport, replay, replay_prefixes

from .format import human_age, human_size, print_json, table
from .options import JSON_HELP


def register(sub: Any) -> None:
    parser = sub.add_parser("snapshot", help="inspect and replay input snapshots")
    cmds = parser.add_subparsers(dest="snapshot_command", required=True)

    ls = cmds.add_parser("ls", help="list bundles: hash, rank, call, selected_by, size")
    ls.add_argument("root", nargs="?", help="snapshot root (default: the configured one)")
    ls.add_argument("--json", action="store_true", help=JSON_HELP)
    ls.set_defaults(handler=cmd_ls)

    show = cmds.add_parser("show", help="a bundle's identity, inputs and outputs")
    show.add_argument("bundle", help="path/URL of a call directory, or <hash>/rank<N>/call<K>")
    show.add_argument("--root", help="snapshot root for a relative BUNDLE")
    show.add_argument("--json", action="store_true", help=JSON_HELP)
    show.set_defaults(handler=cmd_show)

    replay = cmds.add_parser(
        "replay", help="run a bundle's inputs through its graph and compare the outputs"
    )
    replay.add_argument("bundle", nargs="?",
                        help="a call directory, or a hash/rank directory (all below)")
    replay.add_argument("--manifest", help="instead of BUNDLE: every bundle this engine "
                        "manifest names (manifest.json, an engine directory, or a URL)")
    replay.add_argument("--graph", help="with --manifest: only this graph's bundles (its hash "
                        "or a prefix of it)")
    replay.add_argument("--root", help="snapshot root for a relative BUNDLE or manifest path")
    replay.add_argument(
        "--runner",
        choices=("auto", "cache", "eager"),
        default="auto",
        help="cache: the compile-cache entry on the host toolchain; eager: the exported "
        "graph; auto: cache when it can run here, else eager (default)",
    )
    replay.add_argument(
        "--cache-dir", help="local compile cache (default: $VLLM_CACHE_ROOT/neuron/compile_cache)"
    )
    replay.add_argument("--atol", type=float, help="absolute tolerance (default: per dtype)")
    replay.add_argument("--rtol", type=float, help="relative tolerance (default: per dtype)")
    replay.add_argument("--json", action="store_true", help=JSON_HELP)
    replay.set_defaults(handler=cmd_replay)


def _root(arg: str | None) -> Any:
    return open_snapshot_root(arg or load_snapshot_config().root)


def cmd_ls(args: argparse.Namespace) -> int:
    listing = list_bundles(_root(args.root))
    if args.json:
        print_json(listing)
        return 0
    now = time.time()
    rows = [
        (b.compilation_hash[:12], b.global_rank, b.tp_rank, b.call_index, _step(b.global_step),
         _phase(b.is_prompt), ",".join(b.selected_by), b.format, f"{b.inputs}/{b.outputs}",
         human_size(b.size), human_age(max(0.0, now - b.created)) if b.created else "-")
        for b in listing.bundles
    ]  # fmt: skip
    headers = ["HASH", "RANK", "TP", "CALL", "STEP", "PHASE", "SELECTED_BY", "FORMAT",
               "IN/OUT", "SIZE", "AGE"]  # fmt: skip
    print(table(headers, rows))
    print(f"{len(listing.bundles)} bundles, {human_size(listing.size)} in {listing.root}")
    for prefix in listing.incomplete:
        print(f"incomplete (no meta.json, not a bundle): {prefix}")
    for prefix in listing.unreadable:
        print(f"unreadable meta.json: {prefix}")
    return 0


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _phase(is_prompt: bool | None) -> str:
    """A Neuron plugin bundle captured without a forward context records no phase."""
    return "-" if is_prompt is None else ("prefill" if is_prompt else "decode")


def cmd_show(args: argparse.Namespace) -> int:
    store, prefix = locate(args.bundle, args.root)
    prefixes = find_bundles(store, prefix)
    if not prefixes:
        raise ValueError(f"no snapshot bundle at {args.bundle}")
    bundles = [load_bundle(store, p) for p in prefixes]
    if args.json:
        print_json([{"bundle": b.location, **msgspec.to_builtins(b.meta)} for b in bundles])
        return 0
    for n, bundle in enumerate(bundles):
        m = bundle.meta
        if n:
            print()
        print(f"bundle        {bundle.location}")
        print(f"hash          {m.compilation_hash}")
        print(f"ranks         global {m.global_rank}, tp {m.tp_rank}, dp {m.dp_rank}")
        print(f"call          {m.call_index} (step {_step(m.global_step)}, "
              f"{_phase(m.is_prompt)})")  # fmt: skip
        print(f"selected by   {', '.join(m.selected_by)}")
        print(f"format        {m.format} (writer: {m.writer})")
        if m.toolchain:
            print(f"compiled by   {m.toolchain}/{m.target}")
        if m.from_plugin:
            print("graph         none: written by the Neuron plugin, which stores inputs only "
                  "(no outputs or graph to replay with)")  # fmt: skip
        else:
            print(f"graph         {m.graph or _unsaved(m.graph_error)}")
        print(f"requests      {', '.join(m.req_ids) or '-'}")
        print(f"positions     {', '.join(str(p) for p in m.positions) or '-'}")
        for match in m.matches:
            detail = (f"target {match.target} (offset {match.offset})" if match.rule == "token"
                      else f"request {match.request}")  # fmt: skip
            print(f"match         {match.rule}: row {match.row} {match.req_id} "
                  f"@{match.position} {detail}")  # fmt: skip
        for title, specs in (("INPUT", m.inputs), ("OUTPUT", m.outputs)):
            rows = [
                (s.index, s.file or "-", s.dtype or type(s.value).__name__,
                 ("x".join(str(d) for d in s.shape) or "scalar") if s.shape is not None else "-",
                 human_size(s.nbytes) if s.kind == "tensor" else repr(s.value))
                for s in specs
            ]  # fmt: skip
            print(table([title, "FILE", "DTYPE", "SHAPE", "SIZE/VALUE"], rows))
    return 0


def _unsaved(reason: str | None) -> str:
    """The ``graph`` line of a bundle whose graph was not saved: why, when the capture said."""
    why = f": {printable(reason)}" if reason else ""  # meta.json is anyone's file
    return f"(not saved{why}; replay needs the compile cache)"


def _fmt(x: float) -> str:
    return f"{x:.3e}" if x not in (0.0, float("inf")) else ("0" if x == 0.0 else "inf")


def cmd_replay(args: argparse.Namespace) -> int:
    if args.manifest is not None:
        if args.bundle is not None:
            raise ValueError(f"give BUNDLE ({args.bundle!r}) or --manifest "
                             f"({args.manifest!r}), not both")
        return print_replay(replay_manifest(args), args.json)
    if args.graph is not None:
        raise ValueError(f"--graph {args.graph!r} needs --manifest")
    if args.bundle is None:
        raise ValueError("give the BUNDLE to replay, or --manifest MANIFEST")
    store, prefix = locate(args.bundle, args.root)
    return print_replay(list(replay(
        store, prefix, runner=args.runner, cache_dir=args.cache_dir, atol=args.atol,
        rtol=args.rtol,
    ).values()), args.json)  # fmt: skip


def replay_manifest(args: argparse.Namespace) -> list[ReplayReport]:
    """`replay --manifest`: every bundle the manifest's graphs (or ``--graph``'s) name,
    grouped by snapshot root, each root's bundles replayed together (a tensor-parallel
    call's ranks as one group). A bundle named but not there is a failed report of its own;
    when none is there, the root is the problem (exit 2, naming it)."""
    where, manifest = load_manifest(args.manifest)
    recorded = manifest.locations if manifest.locations is not msgspec.UNSET else Locations()
    graphs = select_graphs(manifest, where, args.graph)
    paths = snapshot_paths(graphs)
    if not paths:
        what = f"graph {graphs[0].graph_hash} of {where}" if args.graph else where
        raise ValueError(
            f"{what} names no snapshot bundle (empty input_snapshot_paths): the engine ran "
            "without VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE=1, captured nothing for it, or "
            "predates graphs listing their bundles")  # fmt: skip
    # The snapshot root and compile cache: the options, else where the manifest says the
    # engine had them, else this process's configured ones.
    root, root_from = (args.root, "--root") if args.root else (
        (recorded.snapshot_root, f"the snapshot root {where} records")
        if recorded.snapshot_root else (None, "the configured snapshot root"))  # fmt: skip
    cache: CacheChoice | None = (
        CacheChoice(args.cache_dir) if args.cache_dir else
        CacheChoice(recorded.compile_cache, "manifest") if recorded.compile_cache else None)
    roots: dict[str, tuple[Any, list[str]]] = {}
    local = None
    for path in paths:
        if is_url(path):
            store, prefix = locate(path)
        else:
            local = local or _manifest_root(root, root_from, where)
            store, prefix = local, path.strip("/")
        roots.setdefault(store.url, (store, []))[1].append(prefix)
    found = {(url, p) for url, (store, prefixes) in roots.items() for p in prefixes
             if store.exists(join(p, META_FILE))}  # fmt: skip
    if not found:
        url, (_, prefixes) = next(iter(roots.items()))
        raise ValueError(
            f"none of the {len(paths)} bundles {where} names is there (the first: "
            f"{url.rstrip('/')}/{prefixes[0]}, under {root_from}): pass the snapshot root "
            "they were captured under (or a copy of it) as --root")  # fmt: skip
    by_path: dict[tuple[str, str], ReplayReport] = {}
    for url, (store, prefixes) in roots.items():
        here = [p for p in prefixes if (url, p) in found]
        if here:
            for prefix, report in replay_prefixes(
                store, here, runner=args.runner, cache_dir=cache, atol=args.atol,
                rtol=args.rtol,
            ).items():  # fmt: skip
                by_path[url, prefix] = report
        for prefix in (p for p in prefixes if (url, p) not in found):
            rank, call, _ = path_order(prefix)
            by_path[url, prefix] = ReplayReport(
                f"{url.rstrip('/')}/{prefix}", args.runner, global_rank=max(rank, 0),
                call_index=max(call, 0), missing=True,
                problem=f"missing: {where} names this bundle, but it is not there (no "
                        f"{META_FILE}): removed since, or captured under another snapshot "
                        "root (--root)")  # fmt: skip
    return [by_path[url, p] for url, (_, prefixes) in roots.items() for p in prefixes]


def _manifest_root(root: str | None, root_from: str, where: str) -> Any:
    """The snapshot root a manifest's relative bundle paths are under, or an error that says
    which root was tried and why (the manifest's recorded one is gone on another host)."""
    try:
        return _root(root)
    except ReplayError as exc:
        raise ReplayError(
            f"{exc} ({root_from}): the bundles {where} names are relative to it; pass the "
            "snapshot root they were captured under (or a copy of it) as --root") from None


def print_replay(reports: list[ReplayReport], as_json: bool) -> int:
    """The replay report (per bundle, then per rank), or its JSON; 1 when any failed.

    A bundle that could not be run, or is missing, is counted as such, never as a mismatch:
    a summary says "none of the N bundles was replayed" rather than "0 of N match"."""
    failed = [r for r in reports if not r.passed]
    if as_json:
        print_json([{**r.__dict__, "passed": r.passed, "ran": r.ran} for r in reports])
        return 1 if failed else 0
    notes: set[str] = set()
    for n, report in enumerate(reports):
        if n:
            print()
        print(f"{report.bundle}  (rank {report.global_rank}, call {report.call_index}, tp rank "
              f"{report.tp_rank}, runner: {report.runner})")  # fmt: skip
        if report.runner_note and report.runner_note not in notes:
            notes.add(report.runner_note)
            print(f"runner {report.runner}: {report.runner_note}")
        if report.peers:
            print(f"replayed with {', '.join(report.peers)}  "
                  f"(collective: {', '.join(report.collectives)})")  # fmt: skip
        if report.problem:
            print(f"{'MISSING' if report.missing else 'NOT RUN'}: {report.problem}")
            continue
        rows = [
            (o.index, o.dtype, "x".join(str(d) for d in o.shape) or "scalar",
             _fmt(o.max_abs_err), _fmt(o.max_rel_err), f"{o.cosine:.6f}",
             f"{o.atol:g}", f"{o.rtol:g}",
             "pass" if o.passed else f"FAIL ({o.mismatched} elements)" + (
                 f": {o.problem}" if o.problem else ""))
            for o in report.outputs
        ]  # fmt: skip
        print(table(["OUTPUT", "DTYPE", "SHAPE", "MAX_ABS_ERR", "MAX_REL_ERR", "COSINE",
                     "ATOL", "RTOL", "RESULT"], rows))  # fmt: skip
    print()
    for rank in sorted({r.global_rank for r in reports}):
        print(f"rank {rank}: {_tally([r for r in reports if r.global_rank == rank])}")
    ran = [r for r in reports if r.ran]
    if ran:
        names = sorted({r.runner for r in ran})
        print("runners: " + ", ".join(f"{n} for {sum(r.runner == n for r in ran)}" for n in names))
    if not failed:
        print(f"PASS: {len(reports)} of {len(reports)} bundles match their captured outputs")
    elif not ran:
        print(f"FAIL: none of the {len(reports)} bundles was replayed, so nothing was "
              f"compared ({_not_run(reports)})")  # fmt: skip
    else:
        matched = sum(r.passed for r in reports)
        print(f"FAIL: {matched} of {len(reports)} bundles match their captured outputs "
              f"({_not_run(reports, differ=True)})")  # fmt: skip
    return 1 if failed else 0


def _not_run(reports: list[ReplayReport], differ: bool = False) -> str:
    """How the bundles that did not match split: differ / could not be replayed / missing."""
    counts = [
        (sum(r.ran and not r.passed for r in reports), "differ from their captured outputs"),
        (sum(not r.ran and not r.missing for r in reports), "could not be replayed"),
        (sum(r.missing for r in reports), "missing"),
    ]
    return ", ".join(f"{n} {what}" for i, (n, what) in enumerate(counts)
                     if n and (differ or i > 0))  # fmt: skip


def _tally(mine: list[ReplayReport]) -> str:
    """One rank's line: how many matched and the largest error, or that none was run."""
    ran = [r for r in mine if r.ran]
    if not ran:
        return f"none of {len(mine)} bundles was replayed ({_not_run(mine)})"
    worst = max((o.max_abs_err for r in ran for o in r.outputs), default=0.0)
    rest = _not_run(mine)
    return (f"{sum(r.passed for r in mine)} of {len(mine)} bundles match (largest absolute "
            f"error {_fmt(worst)})" + (f"; {rest}" if rest else ""))
