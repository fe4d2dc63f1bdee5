"""Host artifacts call collectives through Python (compile/toolchains/host_collectives.py).

The deadlock this guards against formed between two threads of one rank: the caller of a
loaded AOTInductor package (holding the GIL, waiting for gloo's queue lock) and gloo's
worker (holding that lock, waiting for the GIL to drop the previous call's output). It hung
warm TP=2 `vllm serve` starts on CPUs without AVX-512; two real processes calling a real
compiled all-reduce piece back to back hit it within seconds before the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx

from vllm_neuron.compile.toolchains.host_collectives import (
    calls_functional_collectives,
    route_collectives,
)

HERE = Path(__file__).resolve().parents[1] / "helpers"
CALLS = 4000  # the unrouted artifact hung within ~3000 calls on an idle 2-core machine
RANK_TIMEOUT = 900.0  # ~60 s idle; a bound, not a measurement


class _AllReduce(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops._c10d_functional.all_reduce(x * 2, "sum", "3")
        y = torch.ops._c10d_functional.wait_tensor(y)
        z = torch.ops._c10d_functional.all_gather_into_tensor(y, 2, "3")
        return torch.ops._c10d_functional.wait_tensor(z)


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_every_functional_collective_and_its_wait_become_one_python_op() -> None:
    gm = torch.fx.symbolic_trace(_AllReduce())
    assert calls_functional_collectives(gm)
    assert route_collectives(gm.graph) == 2
    gm.recompile()
    targets = _targets(gm)
    assert not calls_functional_collectives(gm), targets
    assert "vllm_neuron.all_reduce.default" in targets
    assert "vllm_neuron.all_gather_into_tensor.default" in targets
    assert not any("wait_tensor" in t for t in targets), targets
    # The group is still the one the graph was traced with.
    call = next(n for n in gm.graph.nodes if str(n.target) == "vllm_neuron.all_reduce.default")
    assert call.args[1:] == ("sum", "3")


def test_a_collective_that_cannot_be_routed_is_refused_by_name() -> None:
    class Coalesced(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return torch.ops._c10d_functional.all_reduce_coalesced([x], "sum", "3")

    gm = torch.fx.symbolic_trace(Coalesced())
    with pytest.raises(ValueError, match=r"_c10d_functional::all_reduce_coalesced.*deadlock"):
        route_collectives(gm.graph)


def test_a_graph_without_collectives_is_left_alone() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    before = _targets(gm)
    assert not calls_functional_collectives(gm)
    assert route_collectives(gm.graph) == 0
    assert _targets(gm) == before


def test_two_ranks_call_a_compiled_all_reduce_piece_thousands_of_times(tmp_path: Path) -> None:
    env_calls = {"COLLECTIVE_WORKER_CALLS": str(CALLS)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "collective_worker.py"), str(tmp_path), str(rank)],
            env={**os.environ, **env_calls},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs: list[str] = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=RANK_TIMEOUT)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"a rank did not finish {CALLS} calls in {RANK_TIMEOUT:.0f} s: the "
                            "collective deadlock (GIL vs gloo's queue lock) is back")  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, outputs[rank][-3000:]
        done = json.loads((tmp_path / f"done{rank}.json").read_text())
        assert done == {"calls": CALLS, "matched": True}


def test_each_routed_op_has_the_output_shape_of_the_collective_it_wraps() -> None:
    """What export sees of each op (its fake kernel), against torch's own collectives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vllm_neuron.compile.toolchains.host_collectives import register_collective_ops

    register_collective_ops()
    ours, theirs = torch.ops.vllm_neuron, torch.ops._c10d_functional
    calls = {
        "all_reduce": ("sum", "3"),
        "all_gather_into_tensor": (2, "3"),
        "reduce_scatter_tensor": ("sum", 2, "3"),
        "all_to_all_single": ([3, 5], [4, 4], "3"),
        "broadcast": (0, "3"),
    }
    with FakeTensorMode():
        x = torch.empty(8, 6)
        for name, args in calls.items():
            got = getattr(ours, name)(x, *args)
            want = getattr(theirs, name)(x, *args)
            assert got.shape == want.shape and got.dtype == want.dtype, name


def test_in_place_collectives_are_routed_and_copied_back() -> None:
    class InPlace(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.ops._c10d_functional.all_reduce_(x, "sum", "3")
            y = torch.ops._c10d_functional.broadcast_(x, 0, "3")
            return torch.ops._c10d_functional.wait_tensor(y)

    gm = torch.fx.symbolic_trace(InPlace())
    assert route_collectives(gm.graph) == 2
    targets = _targets(gm)
    assert not calls_functional_collectives(gm), targets
    assert targets.count("aten.copy_.default") == 2, targets
    assert "vllm_neuron.broadcast.default" in targets
