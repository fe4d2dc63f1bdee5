"""vLLM's compiler adaptor names each piece twice: the structured `Piece` to the manifest
recorder (a context variable), and its label to the compile itself, so the cache's events
carry it and `cache stats` can count per-rank variants.

Runs without vLLM: the adaptor needs only vLLM's `CompilerInterface` to inherit from, so
when vLLM is not installed (the project venv) a bare stand-in of that one base class is
put in its place for this test; everything the adaptor calls (the runtime, the host
toolchain's compile, the two-tier cache, the event log) is real.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_neuron.plugin
from vllm_neuron.assembly import reset_runtime
from vllm_neuron.compile.cache import TwoTierCache
from vllm_neuron.compile.events import read_stats
from vllm_neuron.compile.runtime import CompiledGraph, CompileRuntime
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.manifest.recorder import current_piece
from vllm_neuron.manifest.schema import Piece


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


@pytest.fixture
def adaptor_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`vllm_neuron.plugin.compiler`, imported against vLLM or, without it, against a bare
    `CompilerInterface` base class (dropped again afterwards)."""
    try:
        import vllm.compilation.compiler_interface  # noqa: F401 - the real one, if installed
    except ImportError:
        interface = types.ModuleType("vllm.compilation.compiler_interface")
        setattr(interface, "CompilerInterface", type("CompilerInterface", (), {}))  # noqa: B010
        for name in ("vllm", "vllm.compilation"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, interface.__name__, interface)
    monkeypatch.delitem(sys.modules, "vllm_neuron.plugin.compiler", raising=False)
    yield importlib.import_module("vllm_neuron.plugin.compiler")
    sys.modules.pop("vllm_neuron.plugin.compiler", None)
    if hasattr(vllm_neuron.plugin, "compiler"):
        delattr(vllm_neuron.plugin, "compiler")


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[CompileRuntime]:
    """The process's runtime for the test: a fresh local tier, the host toolchain."""
    built = CompileRuntime(TwoTierCache(str(tmp_path / "cache")), HostToolchain())
    reset_runtime(built)
    yield built
    reset_runtime()


def test_the_adaptor_passes_the_piece_label_to_the_compile(
    adaptor_module: Any, runtime: CompileRuntime, tmp_path: Path
) -> None:
    seen: list[tuple[Piece | None, str | None]] = []

    def listener(graph: CompiledGraph) -> None:  # what the manifest recorder reads, and ours
        seen.append((current_piece(), graph.piece))

    runtime.add_listener(listener)
    compiler = adaptor_module.NeuronCompilerAdaptor()
    compiler.initialize_cache(str(tmp_path / "vllm"), prefix="backbone")
    gm, x = torch.fx.symbolic_trace(Scale()), [torch.zeros(4, 8)]

    fn, handle = compiler.compile(gm, x, {}, 8, key="artifact_compile_range_8_8_subgraph_0")
    torch.testing.assert_close(fn(*x), Scale()(*x))
    first = Piece(model="backbone", start=8, end=8, subgraph=0)
    assert first.label() == "[backbone] range 8-8 subgraph 0"
    assert seen == [(first, first.label())]
    assert runtime.history[-1].result.source == "compiled"

    # A warm restart's load names the piece by its graph_index argument (a memory hit here).
    compiler.load(handle, gm, x, 3, 8)
    third = Piece(model="backbone", start=8, end=8, subgraph=3)
    assert seen[-1] == (third, third.label()) and runtime.history[-1].result.source == "memory"

    # vLLM did not name the subgraph: no piece anywhere.
    compiler.compile(gm, x, {}, 8, key=None)
    assert seen[-1] == (None, None)

    stats = read_stats(str(tmp_path / "cache"))  # one compile, of the first piece
    assert stats.compiles == 1 and stats.keys_by_piece == {first.label(): [handle[0]]}
    assert (stats.pieces_compiled, stats.rank_specific_compiles) == (1, 0)
