"""The host toolchain on what vLLM's piecewise compiler hands over: symbolic inputs.

vLLM compiles each piece once for a range of token counts, with fake tensors whose token
dimension is a symbol and that symbol as an integer input; the pieces read parameters
through ``param.data`` and allocate the attention output with ``torch.empty``. This builds
such a graph with dynamo (no vLLM needed) and checks the compiled program against eager at
several sizes. One AOTInductor compile (tens of seconds on 2 cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_neuron.compile.toolchains.host import HostToolchain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


class Piece(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: Any) -> Any:
        n = x.shape[0]
        h = self.proj(x) * self.scale.data  # vLLM's layernorm reads weight.data
        out = torch.empty((n, 8), dtype=x.dtype)  # vLLM's attention output buffer
        return h.view(n, 2, 4).sum(-1), out.view(n, 2, 4)


def test_symbolic_piece_compiles_once_and_runs_at_every_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Piece().eval()
    seen: dict[str, Any] = {}
    toolchain = HostToolchain()

    def backend(gm: Any, example_inputs: Any) -> Any:
        fake = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        assert any(isinstance(v, torch.SymInt) for v in fake)  # what vLLM passes
        artifact = toolchain.compile(gm, fake, str(tmp_path))
        seen["artifact"] = artifact
        seen["graph"] = gm
        return toolchain.load(str(tmp_path), artifact)

    x = torch.randn(6, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        compiled(x)
        artifact = seen["artifact"]
        assert artifact.num_inputs == len(list(seen["graph"].graph.find_nodes(op="placeholder")))
        assert len(artifact.derived_inputs) == 1  # the token count, read from x instead
        assert "s" in artifact.output_shapes[0]  # a dynamic program, not one size
        for n in (2, 5, 33):
            x = torch.randn(n, 8)
            got_sum, got_buf = compiled(x)
            want_sum, _ = model(x)
            torch.testing.assert_close(got_sum, want_sum)
            assert got_buf.shape == (n, 2, 4)
            assert torch.count_nonzero(got_buf) == 0  # empty -> zeros: deterministic
    # The caller's graph is left as it was (vLLM keeps it for other ranges).
    targets = {n.target for n in seen["graph"].graph.nodes if n.op == "call_function"}
    assert torch.empty in targets and torch._C._autograd._get_data_attr in targets


def test_ledger_shapes_of_symbolic_inputs_do_not_specialise_them() -> None:
    """Recording a graph for the manifest must not evaluate its symbolic sizes: vLLM's
    dynamo trace would then be specialised to one token count and fail its guards."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from vllm_neuron.manifest.ledger import input_shapes_of

    env = ShapeEnv()
    sym = env.create_symintnode(
        env.create_symbol(2048, ConstantSource("tokens")), hint=2048
    )
    fake = type("FakeInput", (), {"shape": (sym, 128)})()
    assert input_shapes_of([fake, 3]) == [f"{sym}, 128", ""]
    assert env.guards == []  # nothing was evaluated
