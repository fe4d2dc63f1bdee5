"""The documented TP=2 example, end to end: two real writer processes, a real cache entry."""

from __future__ import annotations

import json
import multiprocessing
import os
from datetime import datetime

import pytest
from manifest_fixtures import SEED_KEY, SEED_NEFF_SIZE

from vllm_neuron.manifest import LedgerWriter, ManifestConfig, Topology, emit_manifest

FLAGS = "--framework XLA --target trn2 --auto-cast=none --logfile /home/me/run/log.txt"


def _write_rank(manifest_dir: str, devices: str, rank: int, key: str) -> None:
    os.environ["NEURON_VISIBLE_DEVICES"] = devices
    writer = LedgerWriter(manifest_dir)
    assert writer.record(key, rank=rank, input_shapes=["4,", "4,"], compiler_flags=FLAGS)


def run_ranks(manifest_dir: str, devices: str, ranks: list[int], key: str = SEED_KEY) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_rank, args=(manifest_dir, devices, r, key)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0


SEED_CONFIG = ManifestConfig(
    model="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    target="trn2",
    dtype="torch.bfloat16",
    max_num_seqs=4,
    max_model_len=256,
    topology=Topology(world_size=2, tensor_parallel_size=2, data_parallel_size=1, ep_degree=1,
                      has_collectives=True),
    neuron_config={"sequence_parallel_enabled": False},
    vllm_config={"model_config": {"model": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}},
)


def test_seed_tp2_example_field_by_field(tmp_path, cache_root, monkeypatch):
    manifest_dir = str(tmp_path / "manifests")
    run_ranks(manifest_dir, "0-7", [0, 1])
    ledger = tmp_path / "manifests" / "ledger" / "dev0_7"
    assert len(list(ledger.glob("*/*.jsonl"))) == 2  # one file per writer process

    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "0-7")
    emit_manifest(manifest_dir, SEED_CONFIG, cache_root=cache_root,
                  environment={"python": "3.13.7", "torch": "2.11.0", "vllm": "0.24.0"})

    written = json.loads((tmp_path / "manifests" / "dev0_7" / "manifest.json").read_bytes())
    # The seed's fields in the seed's order; then ours: where the compile cache was (no
    # snapshot root: capture was off), so a replay or check needs no other option.
    assert list(written) == ["manifest_version", "config", "graphs", "environment", "locations"]
    assert written["locations"] == {"compile_cache": os.path.abspath(cache_root)}
    assert written["manifest_version"] == "1"
    assert written["config"] == {
        "model": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        "target": "trn2",
        "dtype": "torch.bfloat16",
        "max_num_seqs": 4,
        "max_model_len": 256,
        "topology": {
            "world_size": 2,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "attention_dp_size": 1,
            "ep_degree": 1,
            "decode_context_parallel_size": 1,
            "has_collectives": True,
        },
        "neuron_config": {"sequence_parallel_enabled": False},
        "vllm_config": {"model_config": {"model": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}},
    }
    (graph,) = written["graphs"]
    neff = os.path.join(cache_root, SEED_KEY, f"graph_{SEED_KEY}.neff")
    st = os.stat(neff)
    created = graph.pop("created_timestamp")
    assert datetime.fromisoformat(created).timestamp() == pytest.approx(st.st_mtime, abs=1e-5)
    assert created.endswith("+00:00")
    assert graph == {
        "graph_hash": SEED_KEY,
        "hlo_path": f"{SEED_KEY}/graph.hlo",
        "neff_path": f"{SEED_KEY}/graph_{SEED_KEY}.neff",
        "neff_size": SEED_NEFF_SIZE,
        "input_shapes": ["4,", "4,"],
        "output_shapes": ["4", "4, 49152"],
        "compiler_flags": "--framework XLA --target trn2 --auto-cast=none",
        "ranks": [0, 1],
        "input_snapshot_paths": [],
        "output_snapshot_paths": [],
    }
    assert written["environment"] == {"python": "3.13.7", "torch": "2.11.0", "vllm": "0.24.0"}
    # The engine's ledger is gone, the shared ledger root stays.
    assert not ledger.exists()
    assert (tmp_path / "manifests" / "ledger").is_dir()


def test_two_engines_emit_and_clean_independently(tmp_path, cache_root, monkeypatch):
    manifest_dir = str(tmp_path / "m")
    other_key = "ab" * 16
    run_ranks(manifest_dir, "0-7", [0, 1])
    run_ranks(manifest_dir, "8-15", [0, 1], key=other_key)

    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "0-7")
    first = emit_manifest(manifest_dir, SEED_CONFIG, cache_root=cache_root, environment={})
    assert [g.graph_hash for g in first.graphs] == [SEED_KEY]
    assert not (tmp_path / "m" / "ledger" / "dev0_7").exists()
    assert len(list((tmp_path / "m" / "ledger" / "dev8_15").glob("*/*.jsonl"))) == 2

    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    second = emit_manifest(manifest_dir, SEED_CONFIG, cache_root=cache_root, environment={})
    assert [g.graph_hash for g in second.graphs] == [other_key]
    assert second.graphs[0].neff_path is None  # not in the cache: listed, not enriched
    assert (tmp_path / "m" / "dev0_7" / "manifest.json").is_file()
    assert (tmp_path / "m" / "dev8_15" / "manifest.json").is_file()
    assert list((tmp_path / "m" / "ledger").iterdir()) == []


def test_relaunch_overwrites_the_manifest(tmp_path, cache_root):
    manifest_dir = str(tmp_path / "m")
    run_ranks(manifest_dir, "", [0])
    emit_manifest(manifest_dir, SEED_CONFIG, cache_root=cache_root, environment={})
    emit_manifest(manifest_dir, SEED_CONFIG, cache_root=cache_root, environment={})
    written = json.loads((tmp_path / "m" / "nodev" / "manifest.json").read_bytes())
    assert written["graphs"] == []  # the second emit found an empty ledger
    assert sorted(os.listdir(tmp_path / "m" / "nodev")) == ["manifest.json"]
