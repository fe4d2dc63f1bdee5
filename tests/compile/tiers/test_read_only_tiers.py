"""Read-only tiers (vllm_neuron/compile/tiers/baked.py, assembly.py, commands/warm.py's bake):
a local tier on a read-only mount serves its hits in place and is never written; a baked tier
named by NEURON_LIBTORCH_BAKED_CACHE sits between the local tier and the remote; `cache bake`
fills one, after which a strict (pre-compiled-only) start compiles nothing.

Real processes (tests/compile/helpers/cache_workers.py ``assembled``: the cache built from the
environment, as a server's is, with the test toolchain's fake compile) on a real tmpfs
remounted read-only (root ignores permission bits: a chmod would prove nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cache_workers import HERE, parse_result, worker_env
from tmpfs_mounts import remount  # tests/tmpfs_mounts.py (its `tmpfs` fixture: conftest)

from vllm_neuron.compile.commands.warm import BAKE_RECORD
from vllm_neuron.compile.entry.events import read_stats

ROOT = Path(__file__).resolve().parents[3]
K1, K2, K3, K4 = (f"{i:x}" * 32 for i in range(10, 14))


def assembled(keys: list[str], tmp: Path, **env: str) -> dict[str, Any]:
    """Run one process whose cache comes from `env` (TMPDIR: `tmp`, the stand-in's home);
    its result, with the number of compiles it started (``compiles``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    markers = tmp / "markers"
    markers.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "cache_workers.py"), "assembled",
         json.dumps({"keys": keys, "marker_dir": str(markers)})],
        env=worker_env(PYTHONPATH=str(ROOT), TMPDIR=str(tmp), **env),
        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = parse_result(done.stdout)
    result["compiles"] = len(list(markers.iterdir()))
    return result


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `root`: (size, mtime in ns) - what "nothing written"
    is compared on."""
    found = {}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            info = os.lstat(path)
            found[os.path.relpath(path, root)] = (info.st_size, info.st_mtime_ns)
    return found


@pytest.fixture
def read_only(tmpfs: Path) -> Iterator[Path]:
    """The tmpfs, to be filled then remounted read-only; writable again afterwards."""
    try:
        yield tmpfs
    finally:
        remount(tmpfs, "rw")


def test_a_read_only_local_tier_serves_its_hits_in_place_and_is_never_written(
    read_only: Path, tmp_path: Path,
) -> None:
    root = {"VLLM_CACHE_ROOT": str(read_only)}
    filled = assembled([K1, K2], tmp_path / "fill", **root)
    assert filled["sources"] == {K1: "compiled", K2: "compiled"}, filled
    tier = read_only / "neuron" / "compile_cache"
    remount(read_only, "ro")
    before = listing(read_only)

    got = assembled([K1, K2, K3], tmp_path / "run", **root)
    assert got["sources"] == {K1: "baked", K2: "baked", K3: "compiled"}, got
    assert got["compiles"] == 1 and not any(got["wrong"].values()), got  # K3 alone
    assert all(str(got["paths"][k]).startswith(str(tier)) for k in (K1, K2))  # in place
    stand_in = got["local_dir"]
    assert stand_in.startswith(str(tmp_path / "run")), stand_in  # under TMPDIR
    said = [s for s in got["said"] if "read-only for this process" in s]
    assert len(said) == 1 and said[0].startswith("INFO"), got["said"]
    assert not [s for s in got["said"] if s.startswith("WARNING")], got["said"]
    # The process's events went to the stand-in: the report and `cache stats` see them.
    stats = read_stats(stand_in)
    assert stats.hits_by_tier.get("baked") == 2 and stats.compiles == 1, stats

    strict = assembled([K1, K2, K4], tmp_path / "strict", **root,
                       VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")
    assert strict["sources"] == {K1: "baked", K2: "baked"} and strict["compiles"] == 0, strict
    assert "PrecompiledOnlyMiss" in strict["errors"][K4], strict
    assert str(tier) in strict["errors"][K4]  # the miss names the read-only tier it looked in
    assert listing(read_only) == before  # no lock, event, marker or copy written into it


def test_a_defective_entry_of_a_read_only_tier_is_skipped_never_repaired(
    read_only: Path, tmp_path: Path,
) -> None:
    root = {"VLLM_CACHE_ROOT": str(read_only)}
    assembled([K1, K2], tmp_path / "fill", **root)
    victim = read_only / "neuron" / "compile_cache" / K1 / "graph.bin"
    victim.write_bytes(victim.read_bytes()[:100])  # torn: fails its size check
    remount(read_only, "ro")
    before = listing(read_only)
    got = assembled([K1, K2], tmp_path / "run", **root)
    assert got["sources"] == {K1: "compiled", K2: "baked"}, got
    assert got["compiles"] == 1 and not any(got["wrong"].values()), got
    warned = [s for s in got["said"] if s.startswith("WARNING")]
    assert len(warned) == 1 and "skipping entry " + K1 in warned[0], got["said"]
    assert listing(read_only) == before  # not withdrawn, not quarantined, not replaced


def test_a_baked_tier_beside_a_writable_local_tier_and_a_remote(
    read_only: Path, tmp_path: Path,
) -> None:
    assembled([K1], tmp_path / "bake", VLLM_CACHE_ROOT=str(read_only))
    baked = read_only / "neuron" / "compile_cache"
    remount(read_only, "ro")
    before = listing(read_only)
    local_root, remote = tmp_path / "pod", tmp_path / "remote"
    got = assembled([K1, K2], tmp_path / "run", VLLM_CACHE_ROOT=str(local_root),
                    NEURON_LIBTORCH_BAKED_CACHE=f"{baked},{tmp_path / 'absent'}",
                    NEURON_LIBTORCH_REMOTE_CACHE=str(remote))
    assert got["sources"] == {K1: "baked", K2: "compiled"} and got["compiles"] == 1, got
    local = local_root / "neuron" / "compile_cache"
    assert got["local_dir"] == str(local)
    assert (local / K2).is_dir() and not (local / K1).exists()  # compiled into the local tier
    assert (remote / K2).is_dir() and not (remote / K1).exists()  # and promoted
    assert listing(read_only) == before


def test_cache_bake_from_a_remote_and_a_compiling_start_then_a_strict_start(
    read_only: Path, tmp_path: Path,
) -> None:
    remote = tmp_path / "remote"
    assembled([K1, K2], tmp_path / "a", VLLM_CACHE_ROOT=str(tmp_path / "builder"),
              NEURON_LIBTORCH_REMOTE_CACHE=str(remote))  # compiled elsewhere, promoted
    compiled_here = tmp_path / "build-stage"
    assembled([K3], tmp_path / "b", VLLM_CACHE_ROOT=str(compiled_here))  # a compiling start
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({
        "manifest_version": "1", "config": {"topology": {"world_size": 1}},
        "graphs": [{"graph_hash": k, "ranks": [0]} for k in (K1, K2, K3)]}))
    into = read_only / "baked"
    done = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "cache", "bake", str(manifest),
         "--into", str(into), "--from", str(remote),
         "--from", str(compiled_here / "neuron" / "compile_cache"), "--json"],
        env=worker_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["sources"] == {K1: str(remote), K2: str(remote),
                              K3: str(compiled_here / "neuron" / "compile_cache")}, out
    record = json.loads((into / BAKE_RECORD).read_text())
    assert sorted(record["keys"]) == sorted([K1, K2, K3]), record
    remount(read_only, "ro")
    before = listing(read_only)
    strict = {"VLLM_CACHE_ROOT": str(tmp_path / "image-root"),
              "NEURON_LIBTORCH_BAKED_CACHE": str(into),
              "VLLM_NEURON_DISABLE_WARMUP_COMPILE": "1"}
    got = assembled([K1, K2, K3], tmp_path / "start", **strict)
    assert got["sources"] == dict.fromkeys((K1, K2, K3), "baked"), got
    assert got["compiles"] == 0 and not got["errors"], got
    # A graph the image lacks fails the strict start (the image build's check).
    lacking = assembled([K1, K4], tmp_path / "start2", **strict)
    assert "PrecompiledOnlyMiss" in lacking["errors"][K4] and lacking["compiles"] == 0
    assert listing(read_only) == before
    shutil.rmtree(tmp_path / "image-root", ignore_errors=True)
