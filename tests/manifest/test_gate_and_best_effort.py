"""The gate, and best-effort behaviour, through a real torch.compile on the host toolchain."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from vllm_neuron import envs
from vllm_neuron.assembly import get_runtime, reset_runtime
from vllm_neuron.manifest import ManifestConfig, emit_for_this_engine
from vllm_neuron.manifest.recorder import tracing_piece
from vllm_neuron.manifest.schema import Piece, PieceSummary, PieceTrace, PieceVariant


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("vllm-cache"))


@pytest.fixture
def configure(cache_root: str, tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Point the process at a shared cache root (compiled once per module) and env vars."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", cache_root)
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root, "inductor"))
    monkeypatch.delenv("NEURON_VISIBLE_DEVICES", raising=False)

    def apply(**env: str | None) -> None:
        for name, value in env.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        envs.reset_for_tests()
        reset_runtime()

    yield apply
    envs.reset_for_tests()
    reset_runtime()


def run_model() -> torch.Tensor:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 4)
    out = torch.compile(model, backend="vllm_neuron")(x)
    torch.testing.assert_close(out, model(x))
    return out


def test_gate_off_writes_nothing_and_adds_no_listener(configure, tmp_path):
    configure(VLLM_NEURON_MANIFEST_DIR="")
    run_model()
    assert get_runtime()._listeners == []
    assert emit_for_this_engine(ManifestConfig()) is None
    assert os.listdir(tmp_path) == []


def test_gate_on_records_and_emits_with_host_enrichment(configure, tmp_path, cache_root):
    manifest_dir = tmp_path / "manifests"
    configure(VLLM_NEURON_MANIFEST_DIR=str(manifest_dir), NEURON_VISIBLE_DEVICES="0-1")
    run_model()
    (graph_event,) = get_runtime().history
    manifest = emit_for_this_engine(ManifestConfig(target="cpu"))
    assert manifest is not None
    written = json.loads((manifest_dir / "dev0_1" / "manifest.json").read_bytes())
    (graph,) = written["graphs"]
    assert graph["graph_hash"] == graph_event.key
    assert graph["ranks"] == [0]
    # dynamo lifts the parameters into graph inputs: weight, bias, then x
    assert graph["input_shapes"] == ["3, 4", "3,", "2, 4"]
    assert graph["output_shapes"] == ["2, 3"]  # from the host artifact's output metadata
    assert graph["hlo_path"] is None
    artifact = os.path.join(cache_root, "neuron", "compile_cache", graph["neff_path"])
    assert os.path.getsize(artifact) == graph["neff_size"] > 0
    assert not (manifest_dir / "ledger" / "dev0_1").exists()
    assert "pieces" not in graph and "pieces" not in written  # outside vLLM: no piece


def test_the_piece_named_around_a_compile_reaches_the_manifest(configure, tmp_path):
    # What vLLM's compiler adaptor does (plugin/compiler.py): name the piece, then compile
    # through the runtime; the recorder, a listener of the runtime, writes it on the line.
    manifest_dir = tmp_path / "manifests"
    configure(VLLM_NEURON_MANIFEST_DIR=str(manifest_dir))
    piece = Piece(model="backbone", start=1, end=2048, subgraph=0)
    with tracing_piece(piece):
        run_model()
    run_model()  # the same graph again, outside the block: a line naming no piece
    manifest = emit_for_this_engine(ManifestConfig())
    assert manifest is not None
    (graph,) = manifest.graphs
    assert graph.traces == [PieceTrace(piece=piece, ranks=[0])]
    assert manifest.pieces == [PieceSummary(piece=piece, compiles=1, ranks=[0], variants=[
        PieceVariant(graph_hash=graph.graph_hash, ranks=[0])])]


def test_manifest_dir_that_breaks_after_start_up_never_breaks_compilation(
    configure, tmp_path, caplog
):
    # Valid when the settings were resolved; a regular file takes its place afterwards (a
    # failure at run time, not a setting to refuse): the ledger is best-effort.
    manifest_dir = tmp_path / "manifests"
    configure(VLLM_NEURON_MANIFEST_DIR=str(manifest_dir))
    get_runtime()
    manifest_dir.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        run_model()  # compiles (from the cache) and runs despite the broken ledger
        assert emit_for_this_engine(ManifestConfig()) is None
    assert "cannot write the compile ledger" in caplog.text
    assert "emit to" in caplog.text


def test_missing_cache_entry_is_logged_and_the_graph_still_listed(configure, tmp_path, caplog):
    manifest_dir = tmp_path / "m"
    configure(VLLM_NEURON_MANIFEST_DIR=str(manifest_dir))
    from vllm_neuron.manifest import LedgerWriter

    LedgerWriter(str(manifest_dir)).record("9" * 32, rank=0, input_shapes=[], compiler_flags="")
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.manifest"):
        manifest = emit_for_this_engine(ManifestConfig())
    assert manifest is not None and manifest.graphs[0].neff_path is None
    assert "could not enrich 1 graph" in caplog.text
