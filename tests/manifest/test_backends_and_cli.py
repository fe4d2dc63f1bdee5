"""The manifest through every backend, and the `vllm-neuron manifest` command."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
from manifest_fixtures import SEED_KEY

from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.manifest import (
    LedgerWriter,
    ManifestConfig,
    Topology,
    decode_manifest,
    emit_manifest,
)
from vllm_neuron.manifest.schema import ManifestError

CONFIG = ManifestConfig(model="m", target="trn2", topology=Topology(world_size=2,
                                                                     tensor_parallel_size=2))


def _emit_through(store, cache_root):
    for rank in (0, 1):
        LedgerWriter(store).record(SEED_KEY, rank=rank, global_rank=rank, input_shapes=["4,"],
                                   compiler_flags="--target trn2")
    return emit_manifest(store, CONFIG, cache_root=cache_root, prefix="nodev", environment={})


def test_memory_backend(cache_root):
    store = open_store("memory://")
    manifest = _emit_through(store, cache_root)
    assert decode_manifest(store.read("nodev/manifest.json") or b"") == manifest
    assert manifest.graphs[0].ranks == [0, 1] and manifest.graphs[0].neff_size
    assert store.list("ledger") == []


def test_s3_backend(cache_root, s3_server, s3_store_url):
    store = open_store(s3_store_url, endpoint_url=s3_server)
    manifest = _emit_through(store, cache_root)
    fresh = open_store(s3_store_url, endpoint_url=s3_server)  # another reader
    assert decode_manifest(fresh.read("nodev/manifest.json") or b"") == manifest
    assert fresh.list("ledger") == []


def test_reader_refuses_other_versions():
    with pytest.raises(ManifestError, match="manifest_version '2' is not supported"):
        decode_manifest(b'{"manifest_version": "2", "graphs": []}')


def _write(tmp_path, name, manifest):
    path = tmp_path / name / "manifest.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(msgspec.json.encode(manifest))
    return str(path)


def test_show_table_and_json(tmp_path, cache_root, capsys):
    store = open_store(str(tmp_path / "m"))
    _emit_through(store, cache_root)
    assert main(["manifest", "show", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert SEED_KEY[:12] in out and "0,1" in out and "4, 49152" in out
    assert main(["manifest", "show", str(tmp_path / "m" / "nodev"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["graphs"][0]["graph_hash"] == SEED_KEY


def test_check_passes_then_flags_partial_deployment_and_missing_artifact(
    tmp_path, cache_root, capsys
):
    store = open_store(str(tmp_path / "m"))
    manifest = _emit_through(store, cache_root)
    ok = _write(tmp_path, "ok", manifest)
    assert main(["manifest", "check", ok, "--cache-dir", cache_root]) == 0
    partial = msgspec.structs.replace(
        manifest, graphs=[msgspec.structs.replace(manifest.graphs[0], ranks=[0])]
    )
    assert main(["manifest", "check", _write(tmp_path, "partial", partial),
                 "--cache-dir", cache_root]) == 1
    assert "traced by 1 of 2 ranks" in capsys.readouterr().out
    assert main(["manifest", "check", ok, "--cache-dir", str(tmp_path / "empty-cache")]) == 1
    assert "is missing from" in capsys.readouterr().out


def test_diff_reports_graphs_and_config(tmp_path, cache_root, capsys):
    store = open_store(str(tmp_path / "m"))
    a = _emit_through(store, cache_root)
    extra = msgspec.structs.replace(a.graphs[0], graph_hash="e" * 32)
    changed = msgspec.structs.replace(a.graphs[0], ranks=[0])
    b = msgspec.structs.replace(
        a, graphs=[changed, extra], config=msgspec.structs.replace(a.config, model="other")
    )
    assert main(["manifest", "diff", _write(tmp_path, "a", a), _write(tmp_path, "b", b)]) == 0
    out = capsys.readouterr().out
    assert f"+ graph {'e' * 32}" in out
    assert f"~ graph {SEED_KEY}: ranks" in out
    assert "~ config.model: 'm' -> 'other'" in out


def test_console_script_runs(tmp_path, cache_root):
    store = open_store(str(tmp_path / "m"))
    _emit_through(store, cache_root)
    bindir = sys.executable.rsplit("/", 1)[0]
    proc = subprocess.run([f"{bindir}/vllm-neuron", "manifest", "check", str(tmp_path / "m"),
                           "--cache-dir", cache_root], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ok (1 graphs, world size 2)" in proc.stdout
