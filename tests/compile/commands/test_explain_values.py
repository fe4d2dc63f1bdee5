"""`cache explain` says what changed, not only that something did: every entry compiled
through the runtime records the canonical values its key was made of (``meta.key_inputs``:
input shapes and dtypes, toolchain versions, compiler flags, target, replica groups)."""

from __future__ import annotations

import torch

from vllm_neuron.backends import open_store
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.runtime import CompileRuntime
from vllm_neuron.compile.tiers.inventory import explain_entries
from vllm_neuron.compile.toolchains.host import HostToolchain


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def test_explain_names_the_input_shapes_that_changed(tmp_path):
    runtime = CompileRuntime(TwoTierCache(str(tmp_path)), HostToolchain())
    gm = torch.fx.symbolic_trace(Scale())
    _, small = runtime.compile(gm, [torch.zeros(2, 3)])
    _, large = runtime.compile(gm, [torch.zeros(4, 3)])
    assert small.key != large.key

    [diff] = explain_entries(open_store(str(tmp_path)), small.key, large.key)
    assert diff.name == "inputs"
    before, after = diff.values["inputs"]
    assert "2" in str(before) and "4" in str(after) and before != after
    record = runtime.cache.local_tier.read_entry(small.key)
    recorded = record.meta["key_inputs"]
    assert recorded["target"] == HostToolchain().target
    assert recorded["versions"] == HostToolchain().versions()
