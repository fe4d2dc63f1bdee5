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


def test_a_secret_in_a_compiler_flag_is_not_recorded(tmp_path, monkeypatch):
    """The recorded key inputs go into a record that is signed and published to the shared
    tier: a compiler flag carrying a token (here an Inductor option whose value is the
    environment's HF_TOKEN) is recorded redacted, while the key still covers it."""
    canary = "hf_canaryTOKEN0123456789"
    monkeypatch.setenv("HF_TOKEN", canary)
    toolchain = HostToolchain(inductor_configs={"cpp.cxx": ("g++", canary)})  # g++ is used
    runtime = CompileRuntime(TwoTierCache(str(tmp_path)), toolchain)
    _, compiled = runtime.compile(torch.fx.symbolic_trace(Scale()), [torch.zeros(2, 3)])
    record = runtime.cache.local_tier.read_entry(compiled.key)
    assert canary not in str(record.meta["key_inputs"]), record.meta["key_inputs"]
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    leaked = [str(p) for p in files if canary.encode() in p.read_bytes()]
    assert not leaked, leaked
    plain = CompileRuntime(TwoTierCache(str(tmp_path / "plain")), HostToolchain())
    _, other = plain.compile(torch.fx.symbolic_trace(Scale()), [torch.zeros(2, 3)])
    assert other.key != compiled.key  # the flag is in the key, as given
