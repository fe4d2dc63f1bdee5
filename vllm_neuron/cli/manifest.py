"""`vllm-neuron manifest show|diff|check`, each with ``--json`` (one document on stdout).

`check` exits 1 on a problem (a partial deployment, an artifact missing from the cache,
or with ``--remote`` a graph that would be compiled at start-up), 2 when the manifest or
a tier cannot be read.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir
from vllm_neuron.manifest.inspect import (
    check_manifest,
    check_startup,
    diff_manifests,
    load_manifest,
    snapshot_paths,
)
from vllm_neuron.manifest.pieces import extra_compiles, summarize_pieces
from vllm_neuron.manifest.schema import GraphEntry, Manifest
from vllm_neuron.manifest.snapshot_links import path_order

from .format import human_size, print_json, table
from .options import JSON_HELP


def register(sub: Any) -> None:
    parser = sub.add_parser("manifest", help="read, compare and check compile manifests")
    cmds = parser.add_subparsers(dest="manifest_command", required=True)

    show = cmds.add_parser("show", help="graphs, shapes, sizes, ranks and snapshot bundles of "
                           "a manifest")
    show.add_argument("location", help="manifest.json, an engine directory, or a URL")
    show.add_argument("--json", action="store_true", help=JSON_HELP)
    show.set_defaults(handler=cmd_show)

    diff = cmds.add_parser("diff", help="graphs added/removed/changed, config fields changed")
    diff.add_argument("a", help="the old manifest (file, engine directory or URL)")
    diff.add_argument("b", help="the new manifest (file, engine directory or URL)")
    diff.add_argument("--json", action="store_true", help=JSON_HELP)
    diff.set_defaults(handler=cmd_diff)

    check = cmds.add_parser(
        "check", help="exit 1 on a partial deployment or an artifact missing from the cache"
    )
    check.add_argument("location", help="manifest.json, an engine directory, or a URL")
    check.add_argument("--cache-dir", default=None,
                       help="compile cache root (default: $VLLM_CACHE_ROOT/neuron/compile_cache)")
    check.add_argument("--remote", default=None,
                       help="also the remote tier: would the deployment start without compiling")
    check.add_argument("--json", action="store_true", help=JSON_HELP)
    check.set_defaults(handler=cmd_check)


def cmd_show(args: argparse.Namespace) -> int:
    where, manifest = load_manifest(args.location)
    if args.json:
        # The per-piece summary recomputed from the graphs, the source of truth.
        summaries = summarize_pieces(manifest.graphs)
        print_json(msgspec.to_builtins(
            msgspec.structs.replace(manifest, pieces=summaries or msgspec.UNSET)))
        return 0
    cfg = manifest.config
    topo = cfg.topology
    print(f"manifest {where} (version {manifest.manifest_version})")
    print(f"model {cfg.model or '-'}  target {cfg.target or '-'}  dtype {cfg.dtype or '-'}  "
          f"world {topo.world_size} (tp {topo.tensor_parallel_size}, pp "
          f"{topo.pipeline_parallel_size}, dp {topo.data_parallel_size})")
    if any(g.traces for g in manifest.graphs):
        _show_pieces(manifest)
        return 0
    rows = [(g.graph_hash[:12], *_graph_cells(g, g.ranks)) for g in manifest.graphs]
    print(table(["GRAPH", "INPUTS", "OUTPUTS", "SIZE", "RANKS", "CREATED", "BUNDLES"], rows))
    print(f"{len(manifest.graphs)} graphs{_bundles_note(manifest)}")
    return 0


def _graph_cells(g: GraphEntry, ranks: list[int]) -> tuple[str, str, str, str, str, str]:
    """A graph's INPUTS, OUTPUTS, SIZE, RANKS, CREATED and BUNDLES cells."""
    return ("; ".join(g.input_shapes) or "-", "; ".join(g.output_shapes) or "-",
            human_size(g.neff_size) if g.neff_size is not None else "-",
            ",".join(map(str, ranks)), g.created_timestamp or "-", _bundles_cell(g))


def _bundles_cell(g: GraphEntry) -> str:
    """How many snapshot bundles the graph names: ``4``, or ``4 (3 with outputs)``."""
    bundles = len(snapshot_paths([g]))
    outputs = len(g.output_snapshot_paths)
    return str(bundles) if outputs == bundles else f"{bundles} ({outputs} with outputs)"


def _bundles_note(manifest: Manifest) -> str:
    """The bundles the graphs name, with the ranks that captured them (empty when none)."""
    paths = snapshot_paths(list(manifest.graphs))
    if not paths:
        return ""
    ranks = sorted({r for r, _, _ in map(path_order, paths) if r >= 0})
    graphs = sum(1 for g in manifest.graphs if snapshot_paths([g]))
    return (f"; {len(paths)} snapshot bundles for {graphs} of them, captured by ranks "
            f"{','.join(map(str, ranks)) or '-'} (replay: vllm-neuron snapshot replay "
            f"--manifest)")


def _show_pieces(manifest: Manifest) -> None:
    """One row per variant of each piece, the piece named on its first; a rank-specific
    variant (traced by fewer ranks than its piece) is marked; graphs naming no piece last."""
    graphs = {g.graph_hash: g for g in manifest.graphs}
    summaries = summarize_pieces(manifest.graphs)
    rows = []
    for summary in summaries:
        for i, variant in enumerate(summary.variants):
            rows.append((summary.piece.label() if i == 0 else "",
                         "rank-specific" if variant.rank_specific else "shared",
                         variant.graph_hash[:12],
                         *_graph_cells(graphs[variant.graph_hash], variant.ranks)))
    rows += [("-", "-", g.graph_hash[:12], *_graph_cells(g, g.ranks))
             for g in manifest.graphs if not g.traces]
    print(table(["PIECE", "VARIANT", "GRAPH", "INPUTS", "OUTPUTS", "SIZE", "RANKS",
                 "CREATED", "BUNDLES"], rows))
    specific = sum(1 for s in summaries if s.compiles > 1)
    print(f"{len(manifest.graphs)} graphs for {len(summaries)} pieces; {specific} pieces "
          f"rank-specific, costing {extra_compiles(summaries)} compiles beyond one per piece"
          f"{_bundles_note(manifest)}")


def cmd_diff(args: argparse.Namespace) -> int:
    _, a = load_manifest(args.a)
    _, b = load_manifest(args.b)
    diff = diff_manifests(a, b)
    if args.json:
        print_json(diff)
        return 0
    if diff.empty:
        print("manifests are identical")
        return 0
    for label in diff.pieces_added:
        print(f"+ piece {label}")
    for label in diff.pieces_removed:
        print(f"- piece {label}")
    for label, change in diff.pieces_changed.items():
        for key in change.added:
            print(f"~ piece {label}: + variant {key}")
        for key in change.removed:
            print(f"~ piece {label}: - variant {key}")
        for key, fields in change.changed.items():
            print(f"~ piece {label}: variant {key}: {', '.join(fields)}")
    for key in diff.added:
        print(f"+ graph {key}")
    for key in diff.removed:
        print(f"- graph {key}")
    for key, fields in diff.changed.items():
        print(f"~ graph {key}: {', '.join(fields)}")
    for path, (old, new) in diff.config_changed.items():
        print(f"~ config.{path}: {old!r} -> {new!r}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    cache_dir = args.cache_dir
    if cache_dir is None:
        cache_dir = get_neuron_compile_cache_dir()
    where, manifest = load_manifest(args.location)
    if args.remote:
        return _check_startup(args, where, manifest, cache_dir)
    problems = check_manifest(manifest, cache_dir)
    if args.json:
        print_json({"manifest": where, "ok": not problems, "problems": problems,
                    "graphs": len(manifest.graphs),
                    "world_size": manifest.config.topology.world_size})
        return 1 if problems else 0
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        print(f"{where}: {len(problems)} problem(s)")
        return 1
    print(f"{where}: ok ({len(manifest.graphs)} graphs, "
          f"world size {manifest.config.topology.world_size}){_pieces_note(manifest)}")
    return 0


def _pieces_note(manifest: Manifest) -> str:
    """What the per-piece judgement covered, when the manifest names pieces."""
    summaries = summarize_pieces(manifest.graphs)
    if not summaries:
        return ""
    specific = sum(1 for s in summaries if s.compiles > 1)
    return (f", every rank traced all {len(summaries)} pieces "
            f"({specific} with rank-specific variants)")


def _check_startup(args: argparse.Namespace, where: str, manifest: Manifest,
                   cache_dir: str) -> int:
    """`manifest check --remote URL`: partial deployments, and whether every graph is in the
    local tier or the remote (exit 1 naming the ones that would be compiled)."""
    from vllm_neuron.backends import local_root_missing, open_store

    from .cache_warm import open_remote

    remote = open_remote(args.remote, f"--remote {args.remote}")  # exit 2 when unusable
    local = None if local_root_missing(cache_dir) else open_store(cache_dir, create=False)
    problems = check_manifest(manifest, None)  # partial deployments (no artifact checks)
    found = check_startup(manifest, local, remote)
    problems += [f"graph {key}: {why}: it would be compiled at start-up"
                 for key, why in found.missing.items()]
    local_n = sum(1 for s in found.sources.values() if s == "local")
    remote_n = len(found.sources) - local_n
    if args.json:
        print_json({"manifest": where, "ok": not problems, "problems": problems,
                    "graphs": len(manifest.graphs),
                    "world_size": manifest.config.topology.world_size,
                    "remote": remote.url, "sources": dict(found.sources),
                    "missing": dict(found.missing)})
        return 1 if problems else 0
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        print(f"{where}: {len(problems)} problem(s); {local_n} graphs local, {remote_n} in "
              f"{remote.url}, {len(found.missing)} in neither")
        return 1
    print(f"{where}: would start without compiling ({local_n} graphs local, {remote_n} to "
          f"fetch from {remote.url})")
    return 0
