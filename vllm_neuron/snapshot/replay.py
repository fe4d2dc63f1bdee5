"""Replay a captured forward off the device and report, per bundle, whether it matches.

Why: a bundle holds the inputs of one call and the reference the capturer stored next to
them (``output{j}.{fmt}``: what the executable returned on the device for exactly those
inputs), so a divergence can be reproduced and measured without the device or the server.
Replay loads a bundle's inputs (:mod:`.bundles`), runs its graph with the chosen runner
(:mod:`.runners`), compares every output with its reference (:mod:`.compare`), and turns the
result into one :class:`ReplayReport` per bundle; every bundle at or under a hash or rank
directory is replayed, so all ranks of a tensor-parallel capture are checked together.

A bundle without captured outputs (one written by the Neuron plugin holds inputs only) is
not run: its report says what it lacks.

A bundle whose graph calls a collective (a tensor-parallel capture: ``meta.json`` records
the ops and the group's size) cannot run alone: it is replayed together with the other
ranks' bundles of the same call, one process per rank (:mod:`.tp_replay`), each rank with
its own artifact, or refused with a report that says which rank's bundle is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_neuron.backends import Store, join
from vllm_neuron.compile.toolchains.base import require_torch

from .bundles import Bundle, ReplayError, find_bundles, load_bundle
from .collectives import needs_group
from .compare import OutputComparison, compare_outputs
from .meta import GRAPH_FILE, META_FILE
from .replay_report import ReplayReport, report_of
from .runners import CacheChoice, ResolvedRunner, resolve_runner
from .tp_replay import plan_groups, replay_groups

__all__ = ["CacheChoice", "PreparedReplay", "ReplayReport", "prepare_bundle", "replay",
           "RunnerKey", "replay_bundle", "replay_prefixes", "report_of", "run_failed"]


RunnerKey = tuple[str, str, str | None]  # (hash, runner asked for, the bundle's graph)


def _no_reference(bundle: Bundle) -> str:
    """Why ``bundle``, which holds no captured outputs, cannot be replayed.

    A bundle from the Neuron plugin holds the call's inputs and ``meta.json`` only, so the
    message names the bundle and everything replay would need from it; its inputs are still
    loaded, so a bad tensor file is reported rather than hidden behind the missing outputs.
    """
    meta = bundle.meta
    if not meta.from_plugin:
        return "the bundle has no captured outputs to compare against"
    graph_key = meta.graph or join(meta.compilation_hash, GRAPH_FILE)
    missing = [f"no captured outputs (output<j>.{meta.format}, listed as outputs in "
               f"{META_FILE}) to compare a replay against"]  # fmt: skip
    if not bundle.store.exists(graph_key):
        missing.append(f"no exported graph ({graph_key}) to run it with")
    loaded = f"its {len(meta.inputs)} inputs load"
    for spec in meta.inputs:
        try:
            bundle._load(spec)
        except (ReplayError, ValueError) as exc:  # SnapshotEncodingError is a ValueError
            where = "" if spec.file is None or spec.file in str(exc) else f"{spec.file}: "
            loaded = f"its inputs do not load either: {where}{exc}"
            break
    return (
        f"cannot replay {bundle.location}: it was written by the Neuron plugin, which stores "
        f"a call's inputs (tensor<i>.{meta.format}) and {META_FILE} only, so it has no "
        f"artifact replay can use: {'; and '.join(missing)} ({loaded})"
    )


def replay_bundle(
    bundle: Bundle,
    *,
    runner: str = "auto",
    cache_dir: CacheChoice | str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    runners: dict[RunnerKey, ResolvedRunner] | None = None,
) -> ReplayReport:
    """Run ``bundle``'s inputs through its graph and compare with its captured outputs.

    A bundle whose graph calls a collective is not run here (in this one process its
    all-reduce would wait for ranks that never come): its report says to replay it with
    :func:`replay`, which runs every rank of the call together."""
    # Heavy optional dependency: imported only once a bundle is actually run.
    import torch

    tree_leaves = require_torch("torch.utils._pytree.tree_leaves")
    if needs_group(bundle.meta):
        meta = bundle.meta
        return report_of(bundle, runner, problem=(
            f"its graph calls {', '.join(meta.collectives or ()) or 'collectives'} across "
            f"the {meta.tp_size} ranks of its tensor-parallel group, so it replays only "
            "together with the other ranks' bundles of the same call: use `vllm-neuron "
            "snapshot replay` on the snapshot root (one process per rank)"))  # fmt: skip
    try:
        prepared = prepare_bundle(bundle, runner=runner, cache_dir=cache_dir, runners=runners)
    except ReplayError as exc:  # no runner can run it here: this bundle's report, not a stop
        return report_of(bundle, runner, problem=str(exc))
    if isinstance(prepared, ReplayReport):
        return prepared
    try:
        with torch.no_grad():
            result = prepared.fn(*prepared.inputs)
    except Exception as exc:  # noqa: BLE001 - this bundle's report; the others still run
        return prepared.report(problem=run_failed(prepared.runner, exc))
    actual = list(tree_leaves(result))
    try:
        return prepared.report(compare_outputs(actual, prepared.expected, atol=atol, rtol=rtol,
                                               reference=prepared.runner == "eager"))
    except ReplayError as exc:
        return prepared.report(problem=str(exc))


def run_failed(runner: str, exc: Exception) -> str:
    """A bundle whose run raised: said as such (not a mismatch), with the error, one line."""
    first = str(exc).strip().splitlines()
    return (f"running it with the {runner} runner failed: {type(exc).__name__}"
            + (f": {first[0]}" if first else ""))


@dataclass
class PreparedReplay:
    """A bundle ready to run: its runner, inputs and captured outputs, all loaded.

    Apart from the run itself so the ranks of a collective replay can all load first and
    agree on what runs (a rank that fails to load must not leave the others waiting in
    a collective)."""

    bundle: Bundle
    runner: str
    fn: Callable[..., Any]
    inputs: list[Any]
    expected: list[Any]
    runner_note: str | None = None

    def report(self, outputs: Sequence[OutputComparison] = (),
               problem: str | None = None) -> ReplayReport:  # fmt: skip
        return report_of(self.bundle, self.runner, outputs, problem, self.runner_note)


def prepare_bundle(
    bundle: Bundle,
    *,
    runner: str = "auto",
    cache_dir: CacheChoice | str | None = None,
    runners: dict[RunnerKey, ResolvedRunner] | None = None,
) -> PreparedReplay | ReplayReport:
    """Load what replaying ``bundle`` needs, or the report of why it cannot be replayed
    (no captured outputs). A runner that cannot be resolved raises ``ReplayError``."""
    meta = bundle.meta
    if not meta.outputs:
        return report_of(bundle, runner, problem=_no_reference(bundle))
    # The compile-cache entry is one per hash; the eager runner's program is specialised to
    # its bundles' signature, so it is remembered per graph.
    per_hash = (meta.compilation_hash, runner, None)
    per_graph = (meta.compilation_hash, runner, meta.graph)
    runners = {} if runners is None else runners
    resolved = runners.get(per_hash) or runners.get(per_graph)
    if resolved is None:
        resolved = resolve_runner(bundle, runner, cache_dir)
        runners[per_hash if resolved.name == "cache" else per_graph] = resolved
    return PreparedReplay(bundle, resolved.name, resolved.fn, bundle.load_inputs(),
                          bundle.load_outputs(), resolved.note)  # fmt: skip


def replay(
    store: Store,
    prefix: str,
    *,
    runner: str = "auto",
    cache_dir: CacheChoice | str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> dict[str, ReplayReport]:
    """Replay every bundle at or under ``prefix`` (all ranks of a tensor-parallel capture);
    bundles with a collective run with their ranks (:mod:`.tp_replay`). Each report under
    its bundle's prefix, in the order found."""
    prefixes = find_bundles(store, prefix)
    if not prefixes:
        raise ReplayError(f"no snapshot bundle at {store.url.rstrip('/')}/{prefix}".rstrip("/"))
    return replay_prefixes(store, prefixes, runner=runner, cache_dir=cache_dir, atol=atol,
                           rtol=rtol)  # fmt: skip


def replay_prefixes(
    store: Store,
    prefixes: Sequence[str],
    *,
    runner: str = "auto",
    cache_dir: CacheChoice | str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> dict[str, ReplayReport]:
    """Replay the bundles at ``prefixes`` (call directories under ``store``), as `replay`
    does: each report under its prefix, in the order given. A bundle that does not load
    raises ``ReplayError``."""
    prefixes = list(dict.fromkeys(prefixes))
    bundles = [load_bundle(store, p) for p in prefixes]
    plan = plan_groups(store, bundles)
    reports: dict[str, ReplayReport] = dict(plan.refused)
    reports.update(replay_groups(store, plan.groups, runner=runner, cache_dir=cache_dir,
                                 atol=atol, rtol=rtol))  # fmt: skip
    runners: dict[RunnerKey, ResolvedRunner] = {}
    for bundle in plan.alone:
        reports[bundle.prefix] = replay_bundle(bundle, runner=runner, cache_dir=cache_dir,
                                               atol=atol, rtol=rtol, runners=runners)  # fmt: skip
    return {p: reports[p] for p in prefixes}
