"""Tensor-parallel captures: what a bundle records for a collective replay, and how replay
pairs the ranks' bundles or refuses one whose other rank is missing.

The replay of a real TP=2 capture (one process per rank, vLLM's shared-memory all-reduce)
is tested against a real `vllm serve` in tests/plugin/test_vllm_serve_tp.py; here the
records and the plan, without vLLM.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from snapshot_helpers import ctx, make_config

from vllm_neuron.backends import Store, open_store
from vllm_neuron.identity import RankInfo, tensor_parallel_size
from vllm_neuron.snapshot import forward_context
from vllm_neuron.snapshot.bundles import load_bundle
from vllm_neuron.snapshot.collectives import collective_ops
from vllm_neuron.snapshot.meta import CallMeta, InputSpec, read_call_meta, write_call_meta
from vllm_neuron.snapshot.replay import replay, replay_bundle
from vllm_neuron.snapshot.tp_replay import needs_group, plan_groups

OP = "_C::shm_allreduce"


def test_collective_ops_are_read_from_the_traced_graph() -> None:
    def row_parallel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.ops._c10d_functional.all_reduce(x @ w, "sum", "0")
        return torch.ops._c10d_functional.wait_tensor(y) + 1

    def local(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w)

    assert collective_ops(torch.fx.symbolic_trace(row_parallel)) == [
        "_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"]  # fmt: skip
    assert collective_ops(torch.fx.symbolic_trace(local)) == []
    assert collective_ops(object()) == []  # no graph to read
    assert tensor_parallel_size() == 1  # one process, no group


def test_each_bundle_records_its_position_in_the_forward(
    memory_root: str, capturer_for: Any
) -> None:
    """Position among the forward's graph calls: the same on every rank, so it pairs the
    ranks' bundles of one call even where their graphs (hashes) differ."""
    cfg = make_config(memory_root, CAPTURE_AT_CALL="-1", MAX_CAPTURES="8")
    first = capturer_for(cfg, compilation_hash="a" * 32, rank=RankInfo())
    second = capturer_for(cfg, compilation_hash="b" * 32, rank=RankInfo())
    fns = [c.wrap(lambda x: x * 2) for c in (first, second)]
    for step in (0, 1):
        with forward_context(ctx(step, config=cfg)):
            for fn in fns:
                fn(torch.ones(2))
    store = open_store(memory_root, create=False)
    for capturer, position in ((first, 0), (second, 1)):
        for call in (0, 1):
            meta = read_call_meta(store, capturer.spec.call_prefix(call))
            assert meta is not None and meta.global_step == call
            assert meta.forward_call == position
            assert meta.tp_size == 1 and meta.collectives is None  # no graph to read
            assert not needs_group(meta)


def write_bundle(store: Store, hash_: str, rank: int, step: int, position: int,
                 collectives: Sequence[str] | None = (OP,), tp_size: int = 2) -> str:  # fmt: skip
    prefix = f"{hash_}/rank{rank}/call{step}"
    store.write(f"{prefix}/tensor0.pt", b"")
    write_call_meta(store, prefix, CallMeta(
        compilation_hash=hash_, format="pt", global_rank=rank, tp_rank=rank, dp_rank=0,
        call_index=step, selected_by=["request"],
        inputs=[InputSpec(index=0, kind="tensor", file="tensor0.pt", dtype="float32",
                          shape=[1])],
        outputs=[InputSpec(index=0, kind="tensor", file="output0.pt", dtype="float32",
                           shape=[1])],
        global_step=step, is_prompt=False, forward_call=position, tp_size=tp_size,
        collectives=None if collectives is None else list(collectives),
    ))  # fmt: skip
    return prefix


def test_ranks_pair_by_forward_position_across_rank_specific_graphs() -> None:
    store = open_store(f"memory://tp-{uuid.uuid4().hex[:12]}")
    # The first piece: a graph per rank (the vocab-parallel embedding); the second: shared.
    a0 = write_bundle(store, "a" * 32, 0, 7, 0)
    b1 = write_bundle(store, "b" * 32, 1, 7, 0)
    s0 = write_bundle(store, "c" * 32, 0, 7, 1)
    s1 = write_bundle(store, "c" * 32, 1, 7, 1)
    alone = write_bundle(store, "d" * 32, 0, 7, 2, collectives=[], tp_size=2)
    single = write_bundle(store, "e" * 32, 0, 3, 0, collectives=None, tp_size=1)
    # Asking for rank 0's variant of the first piece finds rank 1's under the other hash.
    plan = plan_groups(store, [load_bundle(store, a0)])
    assert [g.members for g in plan.groups] == [(a0, b1)] and not plan.refused
    plan = plan_groups(store, [load_bundle(store, p) for p in (a0, b1, s0, s1, alone, single)])
    assert [g.members for g in plan.groups] == [(a0, b1), (s0, s1)]
    assert [b.prefix for b in plan.alone] == [alone, single]  # no collective, or one rank
    assert not plan.refused


def test_a_collective_without_its_other_rank_is_refused_saying_which() -> None:
    store = open_store(f"memory://tp-{uuid.uuid4().hex[:12]}")
    lonely = write_bundle(store, "a" * 32, 0, 9, 0)
    write_bundle(store, "b" * 32, 1, 9, 1)  # rank 1's bundle of another call
    reports = list(replay(store, "a" * 32).values())  # refused before any process is started
    assert len(reports) == 1 and not reports[0].passed
    problem = reports[0].problem or ""
    assert reports[0].bundle.endswith(lonely) and reports[0].tp_rank == 0
    assert f"calls {OP}" in problem and "no bundle of rank 1" in problem
    assert "step 9, call 0 of the forward" in problem
    assert "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_RANKS" in problem


def test_a_collective_bundle_is_never_run_alone_in_one_process() -> None:
    """`replay_bundle` (one bundle, this process; what the deployment report calls) would
    leave the all-reduce waiting for the other rank: it says how to replay it instead."""
    store = open_store(f"memory://tp-{uuid.uuid4().hex[:12]}")
    prefix = write_bundle(store, "a" * 32, 0, 9, 0)
    write_bundle(store, "b" * 32, 1, 9, 0)
    report = replay_bundle(load_bundle(store, prefix))
    assert not report.passed and report.outputs == ()
    assert f"calls {OP}" in (report.problem or "") and "snapshot replay" in (report.problem or "")


@pytest.mark.skipif(find_spec("vllm") is not None, reason="needs a Python without vLLM")
def test_without_vllm_a_collective_group_reports_what_it_needs(tmp_path: Path) -> None:
    """The rank processes really start (one per rank) and fail to join the group; every
    bundle of the group says why, with the rank and its exit status."""
    store = open_store(str(tmp_path / "snapshots"))
    pair = [write_bundle(store, "a" * 32, 0, 4, 0), write_bundle(store, "b" * 32, 1, 4, 0)]
    reports = list(replay(store, "").values())
    assert sorted(r.bundle.removeprefix(store.url.rstrip("/") + "/") for r in reports) == pair
    assert sorted(r.tp_rank for r in reports) == [0, 1]
    for report in reports:
        assert not report.passed
        problem = report.problem or ""
        assert "the replay processes of its tensor-parallel group failed" in problem
        assert "exited with status 2" in problem and "vLLM's distributed runtime" in problem
