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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_neuron.backends import Store, join

from .bundles import Bundle, ReplayError, find_bundles, load_bundle
from .compare import OutputComparison, compare_outputs
from .meta import GRAPH_FILE, META_FILE
from .runners import resolve_runner

__all__ = ["ReplayReport", "replay", "replay_bundle"]


@dataclass(frozen=True)
class ReplayReport:
    """The replay of one bundle."""

    bundle: str
    runner: str
    outputs: tuple[OutputComparison, ...] = ()
    problem: str | None = None
    global_rank: int = 0
    call_index: int = 0

    @property
    def passed(self) -> bool:
        return self.problem is None and all(o.passed for o in self.outputs)


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
    cache_dir: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    runners: dict[tuple[str, str], tuple[str, Callable[..., Any]]] | None = None,
) -> ReplayReport:
    """Run ``bundle``'s inputs through its graph and compare with its captured outputs."""
    # Heavy optional dependency: imported only once a bundle is actually run.
    import torch
    import torch.utils._pytree as pytree

    meta = bundle.meta

    def report(runner_name: str, outputs: Sequence[OutputComparison] = (),
               problem: str | None = None) -> ReplayReport:  # fmt: skip
        return ReplayReport(bundle.location, runner_name, tuple(outputs), problem,
                            meta.global_rank, meta.call_index)  # fmt: skip

    if not meta.outputs:
        return report(runner, problem=_no_reference(bundle))
    cache_key = (meta.compilation_hash, runner)
    if runners is not None and cache_key in runners:
        name, fn = runners[cache_key]
    else:
        name, fn = resolve_runner(bundle, runner, cache_dir)
        if runners is not None:
            runners[cache_key] = (name, fn)
    inputs = bundle.load_inputs()
    expected = bundle.load_outputs()
    with torch.no_grad():
        result = fn(*inputs)
    actual = list(pytree.tree_leaves(result))
    try:
        return report(name, compare_outputs(actual, expected, atol=atol, rtol=rtol))
    except ReplayError as exc:
        return report(name, problem=str(exc))


def replay(
    store: Store,
    prefix: str,
    *,
    runner: str = "auto",
    cache_dir: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> list[ReplayReport]:
    """Replay every bundle at or under ``prefix`` (all ranks of a tensor-parallel capture)."""
    prefixes = find_bundles(store, prefix)
    if not prefixes:
        raise ReplayError(f"no snapshot bundle at {store.url.rstrip('/')}/{prefix}".rstrip("/"))
    runners: dict[tuple[str, str], tuple[str, Callable[..., Any]]] = {}
    return [
        replay_bundle(load_bundle(store, p), runner=runner, cache_dir=cache_dir, atol=atol,
                      rtol=rtol, runners=runners)  # fmt: skip
        for p in prefixes
    ]
