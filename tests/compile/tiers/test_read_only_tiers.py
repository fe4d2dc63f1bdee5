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
from vllm_neuron.compile.trust.origin import NODE_KEY_SUFFIX
from vllm_neuron.compile.trust.signing import generate_key_pair

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


def no_node_key(into: Path) -> bool:
    """Whether no node key (trust/origin.py's per-node secret) is beside or inside `into`."""
    return not list(into.parent.glob("*" + NODE_KEY_SUFFIX)) and not list(
        into.rglob("*" + NODE_KEY_SUFFIX))


def bake(manifest_keys: list[str], into: Path, tmp: Path, *sources: Path, json_out: bool = True,
         **env: str) -> subprocess.CompletedProcess[str]:
    """`vllm-neuron cache bake` of a manifest listing `manifest_keys` from `sources`."""
    manifest = tmp / "manifest.json"
    manifest.write_text(json.dumps({
        "manifest_version": "1", "config": {"topology": {"world_size": 1}},
        "graphs": [{"graph_hash": k, "ranks": [0]} for k in manifest_keys]}))
    froms = [arg for source in sources for arg in ("--from", str(source))]
    return subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "cache", "bake", str(manifest),
         "--into", str(into), *froms, *(["--json"] if json_out else [])],
        env=worker_env(PYTHONPATH=str(ROOT), **env), capture_output=True, text=True,
        timeout=600)  # fmt: skip


@pytest.fixture
def signing(tmp_path: Path) -> dict[str, str]:
    """A builder's key pair: the builder's environment and a serving node's (require)."""
    private, public, _ = generate_key_pair(str(tmp_path / "keys"), "builder")
    return {"builder": json.dumps({"VLLM_NEURON_CACHE_SIGNING_KEY": private,
                                   "VLLM_NEURON_CACHE_TRUSTED_KEYS": public}),
            "require": json.dumps({"VLLM_NEURON_CACHE_TRUSTED_KEYS": public,
                                   "VLLM_NEURON_CACHE_TRUST": "require"})}


def plant_sealed(key: str, into: Path, tmp: Path, *, with_key: bool = True) -> None:
    """Put into `into` an unsigned entry of `key` sealed by a node key, and (`with_key`)
    that key beside `into` (as a bake that sealed would have shipped it): a tier that
    trusted the seal would load it as this node's own compile."""
    root = tmp / f"sealer-{key[:4]}"
    assembled([key], tmp / f"seal-{key[:4]}", VLLM_CACHE_ROOT=str(root))
    tier = root / "neuron" / "compile_cache"
    shutil.copytree(tier / key, into / key)
    if with_key:
        shutil.copy2(str(tier) + NODE_KEY_SUFFIX, str(into) + NODE_KEY_SUFFIX)


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
    assert no_node_key(into), "a bake made a node key that the image would ship"
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


def test_cache_bake_refuses_a_defective_and_an_untrusted_entry_and_never_reads_a_node_key(
    tmp_path: Path, signing: dict[str, str],
) -> None:
    remote = tmp_path / "remote"
    builder, require = json.loads(signing["builder"]), json.loads(signing["require"])
    assembled([K1, K3], tmp_path / "a", VLLM_CACHE_ROOT=str(tmp_path / "builder"),
              NEURON_LIBTORCH_REMOTE_CACHE=str(remote), **builder)  # signed, promoted
    assembled([K2], tmp_path / "b", VLLM_CACHE_ROOT=str(tmp_path / "stranger"),
              NEURON_LIBTORCH_REMOTE_CACHE=str(remote))  # promoted unsigned
    torn = remote / K3 / "graph.bin"
    torn.write_bytes(torn.read_bytes()[:100])  # signed, but fails its size check
    into = tmp_path / "image" / "baked"
    into.mkdir(parents=True)
    # A sealed entry already in DIR, and a key file beside DIR that a reader would refuse
    # out loud (group-readable): a bake that read DIR's node key to judge it would say so.
    plant_sealed(K4, into, tmp_path, with_key=False)
    planted = Path(str(into) + NODE_KEY_SUFFIX)
    planted.write_text("0" * 64 + "\n")
    planted.chmod(0o644)
    done = bake([K1, K2, K3, K4], into, tmp_path, remote, **require)
    assert done.returncode == 1, done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["sources"] == {K1: str(remote)} and out["missing"] == [K4], out
    assert sorted(out["failed"]) == sorted([K2, K3]), out
    assert "untrusted" in out["failed"][K2] and "defective" in out["failed"][K3], out
    assert json.loads((into / BAKE_RECORD).read_text())["keys"] == [K1]
    assert (into / K1).is_dir() and not any((into / k).exists() for k in (K2, K3, K4))
    # Again, into the same DIR (K1 present now: judged by its signature), as text.
    text = bake([K1, K2, K3], into, tmp_path, remote, json_out=False, **require)
    assert text.returncode == 1, text.stdout + text.stderr
    named = [line for line in text.stdout.splitlines() if line.startswith("FAILED")]
    assert len(named) == 2 and K2 in named[0] + named[1] and K3 in named[0] + named[1], text
    assert json.loads((into / BAKE_RECORD).read_text())["keys"] == [K1]
    assert "node key" not in done.stderr + text.stderr, done.stderr + text.stderr  # never read
    planted.unlink()
    assert no_node_key(into) and no_node_key(remote)  # nor made, for DIR or the source


def test_a_baked_tier_under_require_serves_signed_entries_and_skips_unsigned_ones(
    read_only: Path, tmp_path: Path, signing: dict[str, str],
) -> None:
    remote = tmp_path / "remote"
    builder, require = json.loads(signing["builder"]), json.loads(signing["require"])
    assembled([K1], tmp_path / "a", VLLM_CACHE_ROOT=str(tmp_path / "builder"),
              NEURON_LIBTORCH_REMOTE_CACHE=str(remote), **builder)
    into = read_only / "baked"
    done = bake([K1], into, tmp_path, remote, **require)
    assert done.returncode == 0, done.stdout + done.stderr
    # Planted after the bake: an unsigned entry, and one sealed by a node key beside DIR.
    assembled([K2], tmp_path / "b", VLLM_CACHE_ROOT=str(tmp_path / "stranger"))
    shutil.copytree(tmp_path / "stranger" / "neuron" / "compile_cache" / K2, into / K2)
    plant_sealed(K3, into, tmp_path)
    remount(read_only, "ro")
    before = listing(read_only)
    got = assembled([K1, K2, K3], tmp_path / "pod", VLLM_CACHE_ROOT=str(tmp_path / "pod-root"),
                    NEURON_LIBTORCH_BAKED_CACHE=str(into), **require)
    assert got["sources"] == {K1: "baked", K2: "compiled", K3: "compiled"}, got
    assert got["compiles"] == 2 and not any(got["wrong"].values()), got
    assert all(str(got["paths"][k]).startswith(got["local_dir"]) for k in (K2, K3)), got
    warned = [s for s in got["said"] if s.startswith("WARNING")]
    assert len(warned) == 2, got["said"]  # one per planted entry
    assert [k for k in (K2, K3) if any("skipping entry " + k in w for w in warned)] == [K2, K3]
    assert listing(read_only) == before


def test_a_signed_baked_entry_with_a_file_replaced_by_one_of_the_same_size_is_skipped(
    read_only: Path, tmp_path: Path, signing: dict[str, str],
) -> None:
    """A signature covers the record; a hit checks sizes only - so every file of a read-only
    tier's entry is checked against the record's digests before its first use."""
    remote = tmp_path / "remote"
    builder, require = json.loads(signing["builder"]), json.loads(signing["require"])
    assembled([K1, K2], tmp_path / "a", VLLM_CACHE_ROOT=str(tmp_path / "builder"),
              NEURON_LIBTORCH_REMOTE_CACHE=str(remote), **builder)
    into = read_only / "baked"
    assert bake([K1, K2], into, tmp_path, remote, **require).returncode == 0
    victim = into / K1 / "graph.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a checksum tells
    victim.write_bytes(bytes(data))
    remount(read_only, "ro")
    got = assembled([K1, K2], tmp_path / "pod", VLLM_CACHE_ROOT=str(tmp_path / "pod-root"),
                    NEURON_LIBTORCH_BAKED_CACHE=str(into), **require)
    assert got["sources"] == {K1: "compiled", K2: "baked"}, got
    assert got["compiles"] == 1 and not any(got["wrong"].values()), got
    warned = [s for s in got["said"] if s.startswith("WARNING")]
    assert len(warned) == 1 and "skipping entry " + K1 in warned[0], got["said"]
    assert "graph.bin fails its" in warned[0], warned


def test_a_read_only_own_root_with_its_node_key_is_judged_by_signature_alone(
    read_only: Path, tmp_path: Path, signing: dict[str, str],
) -> None:
    """An image layer holding a cache root and its node key, prepared elsewhere: its sealed
    entries are not this node's compiles, so under require an unsigned one is never loaded."""
    require = json.loads(signing["require"])
    root = {"VLLM_CACHE_ROOT": str(read_only)}
    filled = assembled([K1], tmp_path / "fill", **root, **require)  # sealed, unsigned
    assert filled["sources"] == {K1: "compiled"}, filled
    tier = read_only / "neuron" / "compile_cache"
    assert Path(str(tier) + NODE_KEY_SUFFIX).exists()  # the key is in the layer too
    remount(read_only, "ro")
    before = listing(read_only)
    got = assembled([K1], tmp_path / "run", **root, **require)
    assert got["sources"] == {K1: "compiled"} and got["compiles"] == 1, got
    assert str(got["paths"][K1]).startswith(got["local_dir"]), got
    warned = [s for s in got["said"] if s.startswith("WARNING")]
    assert len(warned) == 1 and "skipping entry " + K1 in warned[0], got["said"]
    assert "untrusted" in warned[0] and "node key" not in " ".join(got["said"]), got["said"]
    assert listing(read_only) == before


@pytest.mark.parametrize("temp", ["emptydir", "taken"])
def test_baked_tiers_serve_with_a_shared_temp_dir_or_the_stand_in_name_taken(
    read_only: Path, tmp_path: Path, temp: str,
) -> None:
    """TMPDIR writable by all and not sticky (a Kubernetes emptyDir), or the stand-in's
    usual name made first by another user: the stand-in is a private directory of this
    process, and the read-only tiers serve their hits."""
    root = {"VLLM_CACHE_ROOT": str(read_only)}
    assembled([K1], tmp_path / "fill", **root)
    remount(read_only, "ro")
    shared = tmp_path / "shared"
    shared.mkdir()
    if temp == "emptydir":
        shared.chmod(0o777)
    else:
        shared.chmod(0o1777)
        user = os.environ.get("USER") or __import__("getpass").getuser()
        taken = shared / f"vllm_neuron_wdir_{user}"
        taken.mkdir(mode=0o700)
        os.chown(taken, 4242, 4242)  # another user's (the tests run as root)
    got = assembled([K1, K2], shared, **root)
    assert got["sources"] == {K1: "baked", K2: "compiled"}, got
    stand_in = Path(got["local_dir"])
    assert stand_in.parts[:len(shared.parts)] == shared.parts, got
    made = stand_in.parents[1]  # <made>/neuron/compile_cache
    assert made.parent == shared and made.name.startswith("vllm_neuron_wdir_"), made
    assert made.name != f"vllm_neuron_wdir_{os.environ.get('USER', '')}", made
    assert not made.exists()  # removed when the process exited
    assert not [s for s in got["said"] if "bypassed" in s], got["said"]


def test_with_no_writable_place_the_read_only_tiers_still_serve_their_hits(
    read_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No usable temporary directory at all (gettempdir raises): the writes are bypassed with
    one warning, never a crash, and the read-only tiers (own root and baked) keep serving."""
    import tempfile

    from vllm_neuron.compile.flow.cache import TwoTierCache
    from vllm_neuron.compile.tiers.location import writable_stand_in
    from vllm_neuron.compile.trust.policy import TrustPolicy

    def no_temp_dir() -> str:
        raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", no_temp_dir)
    stand_in, why = writable_stand_in(environ={})
    assert stand_in is None and "No usable temporary directory" in str(why), why
    assembled([K1], tmp_path / "fill", VLLM_CACHE_ROOT=str(read_only))
    tier = read_only / "neuron" / "compile_cache"
    remount(read_only, "ro")
    cache = TwoTierCache("memory://bypassed", disabled=True, writes_bypassed=True,
                         read_only=[str(tier)], precompiled_only=True, trust=TrustPolicy())
    hit = cache.get_or_compile(K1, lambda d: pytest.fail("a hit compiled"))
    assert hit.source == "baked" and str(hit.path).startswith(str(tier)), hit
    with pytest.raises(Exception, match="PrecompiledOnlyMiss|forbids compiling"):
        cache.get_or_compile(K2, lambda d: pytest.fail("a strict start compiled"))
