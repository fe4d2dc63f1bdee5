"""`vllm-neuron snapshot ls|show|replay`: inspect input snapshots and replay them.

    vllm-neuron snapshot ls [ROOT] [--json]
    vllm-neuron snapshot show BUNDLE [--json]
    vllm-neuron snapshot replay BUNDLE [--runner auto|cache|eager] [--atol A] [--rtol R]

ROOT defaults to the configured snapshot root ($VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR, else
$VLLM_CACHE_ROOT/neuron/snapshots). BUNDLE is a path or URL of a call directory, or a hash or
rank directory (every bundle below it: all ranks of a tensor-parallel capture), or such a
``<hash>[/rank<N>[/call<K>]]`` relative to --root. `replay` exits 1 when any output fails;
its report is per bundle and per rank. A bundle whose graph calls a collective is replayed
together with the other ranks' bundles of the same call, one process per rank (or refused,
saying which rank's bundle is missing; see `vllm_neuron.snapshot.tp_replay`).

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

from vllm_neuron.snapshot.bundles import (
    find_bundles,
    list_bundles,
    load_bundle,
    locate,
    open_snapshot_root,
)
from vllm_neuron.snapshot.config import load_snapshot_config
from vllm_neuron.snapshot.replay import replay

from .format import human_age, human_size, print_json, table


def register(sub: Any) -> None:
    parser = sub.add_parser("snapshot", help="inspect and replay input snapshots")
    cmds = parser.add_subparsers(dest="snapshot_command", required=True)

    ls = cmds.add_parser("ls", help="list bundles: hash, rank, call, selected_by, size")
    ls.add_argument("root", nargs="?", help="snapshot root (default: the configured one)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_ls)

    show = cmds.add_parser("show", help="a bundle's identity, inputs and outputs")
    show.add_argument("bundle", help="path/URL of a call directory, or <hash>/rank<N>/call<K>")
    show.add_argument("--root", help="snapshot root for a relative BUNDLE")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cmd_show)

    replay = cmds.add_parser(
        "replay", help="run a bundle's inputs through its graph and compare the outputs"
    )
    replay.add_argument("bundle", help="a call directory, or a hash/rank directory (all below)")
    replay.add_argument("--root", help="snapshot root for a relative BUNDLE")
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
    replay.add_argument("--json", action="store_true")
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
            print(f"graph         {m.graph or '(not saved: replay needs the compile cache)'}")
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


def _fmt(x: float) -> str:
    return f"{x:.3e}" if x not in (0.0, float("inf")) else ("0" if x == 0.0 else "inf")


def cmd_replay(args: argparse.Namespace) -> int:
    store, prefix = locate(args.bundle, args.root)
    reports = list(replay(
        store, prefix, runner=args.runner, cache_dir=args.cache_dir, atol=args.atol,
        rtol=args.rtol,
    ).values())  # fmt: skip
    failed = [r for r in reports if not r.passed]
    if args.json:
        print_json([{**r.__dict__, "passed": r.passed} for r in reports])
        return 1 if failed else 0
    for n, report in enumerate(reports):
        if n:
            print()
        print(f"{report.bundle}  (rank {report.global_rank}, call {report.call_index}, tp rank "
              f"{report.tp_rank}, runner: {report.runner})")  # fmt: skip
        if report.peers:
            print(f"replayed with {', '.join(report.peers)}  "
                  f"(collective: {', '.join(report.collectives)})")  # fmt: skip
        if report.problem:
            print(f"FAIL: {report.problem}")
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
        mine = [r for r in reports if r.global_rank == rank]
        worst = max((o.max_abs_err for r in mine for o in r.outputs), default=0.0)
        print(f"rank {rank}: {sum(r.passed for r in mine)} of {len(mine)} bundles match "
              f"(largest absolute error {_fmt(worst)})")  # fmt: skip
    verdict = "FAIL" if failed else "PASS"
    print(f"{verdict}: {len(reports) - len(failed)} of {len(reports)} bundles match "
          "their captured outputs")  # fmt: skip
    return 1 if failed else 0
