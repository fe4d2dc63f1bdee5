"""The cache never takes a server down: a read-only cache root, an entry that verifies but
will not load, a fallback directory another user owns (vllm_neuron/compile/tiers/health.py,
runtime.py).

Real processes (tests/compile/helpers/serve_worker.py: a model served through
``torch.compile(backend="vllm_neuron")``) on real filesystems: a tmpfs mounted read-only as
``VLLM_CACHE_ROOT``. CI runs as root and can mount; a machine that cannot fails these tests
saying so, never skips them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import serve_worker  # tests/compile/helpers/serve_worker.py
from entry_faults import make_unloadable  # tests/entry_faults.py
from tmpfs_mounts import fill, remount  # tests/tmpfs_mounts.py (its `tmpfs` fixture: conftest)

from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.tiers.health import LocalTierUnusable, check_private_directory
from vllm_neuron.compile.tiers.location import resolve_local_tier, trusted_local_tier_dir

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
# Inductor's own cache, shared by every process of this module (it only makes the real
# compiles faster; where a graph comes from is this package's cache, which each test owns).
INDUCTOR = Path(tempfile.mkdtemp(prefix="vllm-neuron-tier-faults-inductor-"))


def serve(cache_root: Path, **env: str) -> tuple[int, dict[str, Any] | None, str]:
    """Run the serving worker; (exit status, its result or None, stderr)."""
    return serve_worker.serve(cache_root, INDUCTOR, **env)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A cache root where the model's graph was compiled once, and what that serve said;
    tests start from a copy (`copy_built`) instead of compiling it again."""
    root = tmp_path_factory.mktemp("built") / "cache"
    code, first, err = serve(root)
    assert code == 0 and first is not None, err[-3000:]
    assert first["matched"] and first["sources"] == ["compiled"], first
    return root, first


def copy_built(built: tuple[Path, dict[str, Any]], to: Path) -> dict[str, Any]:
    """``to`` becomes a copy of the built cache root; returns the build's result."""
    # The tier's entries, not the builder's node files (headers: a node's own, ~150 MB each).
    shutil.copytree(built[0], to, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".node"))
    return built[1]


def published_and_staged(cache_dir: Path) -> tuple[list[str], list[str]]:
    """Entries a reader sees, and what staging holds (a fault's leftovers, for gc)."""
    if not cache_dir.is_dir():
        return [], []
    entries = sorted(p.name for p in cache_dir.iterdir() if len(p.name) == 32)
    staging = cache_dir / ".staging"
    return entries, sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []


def test_a_full_cache_root_serves_the_graph_with_one_warning_and_caches_once_there_is_room(
    tmpfs: Path,
) -> None:
    remount(tmpfs, "size=256k")  # room for the tier's small files, not for a compile
    cache_dir = tmpfs / "neuron" / "compile_cache"
    # Its node files where this tier would keep them (not the session's shared ones): a tier
    # without room for a precompiled header must keep none, or the compile fails.
    code, result, err = serve(tmpfs, _VLLM_NEURON_SHARED_NODE_FILES="")
    assert code == 0 and result is not None, err[-3000:]  # no C++ abort, no traceback
    assert result["matched"] and result["sources"] == ["uncached"], result
    said = [w for w in result["warnings"] if "no space left" in w]
    assert len(said) == 1, result["warnings"]
    assert "VLLM_CACHE_ROOT" in said[0] and "MiB free" in said[0], said
    entries, _ = published_and_staged(cache_dir)
    assert entries == []  # nothing half-written is visible
    # A few MiB: too little to compile in (see COMPILE_SPACE_RESERVE), enough to keep the
    # artifact: compiled in scratch and adopted into the tier, silently.
    remount(tmpfs, "size=12m")
    code, adopted, err = serve(tmpfs)
    assert code == 0 and adopted is not None, err[-3000:]
    assert adopted["sources"] == ["compiled"] and adopted["warnings"] == [], adopted
    # The next start hits it, with no manual step.
    code, again, err = serve(tmpfs)
    assert code == 0 and again is not None, err[-3000:]
    assert again["sources"] == ["local"] and again["keys"] == adopted["keys"], again


def test_a_read_only_cache_root_serves_its_graph_in_place_with_one_info_line(
    tmpfs: Path, built: tuple[Path, dict[str, Any]], tmp_path: Path,
) -> None:
    first = copy_built(built, tmpfs)  # a tier that holds the graph (and its unpacked copy)
    remount(tmpfs, "ro")
    try:
        # A real load from the read-only tier (compile/tiers/baked.py): no compile, no warning.
        code, result, err = serve(tmpfs, TMPDIR=str(tmp_path))
        assert code == 0 and result is not None, err[-3000:]
        assert result["matched"] and result["sources"] == ["baked"], result
        assert result["keys"] == first["keys"] and result["warnings"] == [], result
        assert result["local_dir"].startswith(str(tmp_path)), result  # the stand-in
        assert "Traceback" not in err
        # Pre-compiled only: served the same way.
        code, result, err = serve(tmpfs, TMPDIR=str(tmp_path),
                                  VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")
        assert code == 0 and result is not None, err[-3000:]
        assert result["sources"] == ["baked"], result
    finally:
        remount(tmpfs, "rw")
    # Writable again: the next start hits the entry compiled before, no manual step.
    code, again, err = serve(tmpfs)
    assert code == 0 and again is not None, err[-3000:]
    assert again["matched"] and again["sources"] == ["local"], again
    assert again["keys"] == first["keys"] and again["warnings"] == []


def test_an_entry_that_verifies_but_will_not_load_is_healed(
    tmp_path: Path, built: tuple[Path, dict[str, Any]]
) -> None:
    cache_root = tmp_path / "cache"
    first = copy_built(built, cache_root)
    cache_dir = cache_root / "neuron" / "compile_cache"
    (key,) = first["keys"]
    make_unloadable(cache_dir, key)
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir",
                           str(cache_dir), "verify"], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr  # its checksums are right
    # Whether the tier's entries load on this node: the operator's question, answered.
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir",
                           str(cache_dir), "verify", "--load"], capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"NO-LOAD {key} does not load here" in done.stdout, done.stdout
    assert "1 do not load here" in done.stdout and (cache_dir / key).is_dir()  # not withdrawn
    code, healed, err = serve(cache_root)
    assert code == 0 and healed is not None, err[-3000:]
    assert healed["matched"] and healed["sources"] == ["compiled"], healed
    said = [w for w in healed["warnings"] if "does not load here" in w]
    assert len(said) == 1 and key in said[0], healed["warnings"]
    stats = read_stats(str(cache_dir))
    assert stats.load_failures == 1 and stats.compiles == 2
    notes = list((cache_dir / ".quarantine").glob(f"{key}*"))
    assert notes, "the withdrawn entry leaves its quarantine note"
    # The next start hits the recompiled entry.
    code, again, err = serve(cache_root)
    assert code == 0 and again is not None, err[-3000:]
    assert again["sources"] == ["local"] and again["matched"], again
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir",
                           str(cache_dir), "verify", "--load", "--json"],
                          capture_output=True, text=True)  # fmt: skip
    (checked,) = json.loads(done.stdout)
    assert done.returncode == 0 and checked["ok"] and checked["loads"], done.stdout + done.stderr
    # Pre-compiled only: the unloadable entry is a PrecompiledOnlyMiss saying why.
    make_unloadable(cache_dir, key)
    code, result, err = serve(cache_root, VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")
    assert code != 0 and result is None
    assert "PrecompiledOnlyMiss" in err and f"entry {key} does not load here" in err, err[-3000:]
    assert (cache_dir / key).is_dir()  # refused, not withdrawn: its cause may be this process


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_neuron.cli", *args],
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_a_fetched_entry_that_will_not_load_is_noted_on_the_remote_never_withdrawn(
    tmp_path: Path, built: tuple[Path, dict[str, Any]]
) -> None:
    node_a, node_b, remote = tmp_path / "a", tmp_path / "b", tmp_path / "remote"
    (key,) = copy_built(built, node_a)["keys"]
    done = cli("cache", "--cache-dir", str(node_a / "neuron" / "compile_cache"), "promote",
               "--all", "--to", str(remote))  # fmt: skip
    assert done.returncode == 0, done.stderr
    make_unloadable(remote, key)  # verifies everywhere, loads nowhere
    code, healed, err = serve(node_b, NEURON_LIBTORCH_REMOTE_CACHE=str(remote))
    assert code == 0 and healed is not None, err[-3000:]
    # Fetched, did not load, compiled here (not fetched again); served right.
    assert healed["matched"] and healed["sources"] == ["compiled"], healed
    stats = read_stats(str(node_b / "neuron" / "compile_cache"))
    assert (stats.fetches, stats.load_failures, stats.compiles) == (1, 1, 1)
    # The remote keeps it (this node's word alone), with this host's note beside it.
    listing = cli("cache", "ls", str(remote), "--json")
    assert listing.returncode == 0, listing.stderr
    (entry,) = json.loads(listing.stdout)
    assert entry["key"] == key and entry["problem"] is None
    (note,) = entry["load_failures"]
    assert note["host"] == socket.gethostname() and "cannot load" in note["error"]
    table = cli("cache", "ls", str(remote))
    assert f"did not load on {socket.gethostname()}" in table.stdout, table.stdout
    # The operator prunes it; a good build promoted in its place starts without notes.
    assert cli("cache", "prune", str(remote), "--max-size", "1").returncode == 0
    done = cli("cache", "--cache-dir", str(node_b / "neuron" / "compile_cache"), "promote",
               "--all", "--to", str(remote))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(cli("cache", "ls", str(remote), "--json").stdout)
    assert entry["key"] == key and entry["load_failures"] == []


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every user may create things in, as /tmp is (pytest's own is private)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="vllm-neuron-shared-"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def squat(path: Path, mode: str = "0700") -> None:
    """``mkdir`` as another user (uid 65534), the way a stranger gets there first."""
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "mkdir", "-m", mode, str(path)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"this test needs setpriv, as root: {done.stderr.strip()}")


def test_a_private_directory_is_made_0700_and_a_shared_or_squatted_one_refused(
    shared_tmp: Path,
) -> None:
    mine = shared_tmp / "mine"
    assert check_private_directory(str(mine)) == str(mine)
    assert (mine.stat().st_mode & 0o777) == 0o700
    open_to_all = shared_tmp / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(LocalTierUnusable, match=r"writable by other users \(mode 0777\)"):
        check_private_directory(str(open_to_all))
    squatted = shared_tmp / "squatted"
    squat(squatted)
    with pytest.raises(LocalTierUnusable, match=r"belongs to uid 65534"):
        check_private_directory(str(squatted))
    link = shared_tmp / "link"
    link.symlink_to(mine)
    with pytest.raises(LocalTierUnusable, match="not a directory of its own"):
        check_private_directory(str(link))


NFS_HOME = "server:/export/home /home nfs4 rw 0 0\n"


def test_the_nfs_fallback_squatted_by_another_user_bypasses_the_cache(tmp_path: Path) -> None:
    user = f"vn-test-{uuid.uuid4().hex[:8]}"
    fallback = Path("/tmp") / f"vllm_neuron_wdir_{user}"
    environ = {"HOME": "/home/alice", "USER": user}
    try:
        squat(fallback)
        local_dir, bypassed = resolve_local_tier(environ=environ, mounts_text=NFS_HOME)
        assert bypassed is not None and "refused the fallback directory" in bypassed
        assert str(fallback) in bypassed and "uid 65534" in bypassed
        with pytest.raises(LocalTierUnusable):
            trusted_local_tier_dir(environ=environ, mounts_text=NFS_HOME)
    finally:
        shutil.rmtree(fallback, ignore_errors=True)
    # Not there yet: this user's own, made 0700, used.
    try:
        local_dir, bypassed = resolve_local_tier(environ=environ, mounts_text=NFS_HOME)
        assert bypassed is None and local_dir.startswith(str(fallback))
        assert fallback.stat().st_uid == os.getuid()
        assert (fallback.stat().st_mode & 0o777) == 0o700
    finally:
        shutil.rmtree(fallback, ignore_errors=True)


def test_a_full_manifest_directory_costs_the_manifest_one_warning_not_the_graph(
    tmpfs: Path, tmp_path: Path, built: tuple[Path, dict[str, Any]]
) -> None:
    copy_built(built, tmp_path / "cache")
    manifests = tmpfs / "manifests"
    manifests.mkdir()
    remount(tmpfs, "size=64k")
    fill(tmpfs)
    code, result, err = serve(tmp_path / "cache", VLLM_NEURON_MANIFEST_DIR=str(manifests))
    assert code == 0 and result is not None, err[-3000:]
    assert result["matched"] and result["sources"] == ["local"], result
    said = [w for w in result["warnings"] if "VLLM_NEURON_MANIFEST_DIR" in w]
    assert len(said) == 1 and "No space left" in said[0], result["warnings"]


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_snapshot_root_that_cannot_take_files_costs_the_bundles_one_warning_not_a_forward(
    fault: str, tmpfs: Path, tmp_path: Path, built: tuple[Path, dict[str, Any]]
) -> None:
    copy_built(built, tmp_path / "cache")
    snapshots = tmpfs / "snapshots"
    snapshots.mkdir()
    capture = {"VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE": "1",
               "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR": str(snapshots),
               "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_CAPTURE_AT_CALL": "-1"}  # fmt: skip
    if fault == "full":
        remount(tmpfs, "size=64k")
        fill(tmpfs)
    else:
        remount(tmpfs, "ro")
    try:
        code, result, err = serve(tmp_path / "cache", **capture)
    finally:
        remount(tmpfs, "rw,size=96m")
    assert code == 0 and result is not None, err[-3000:]  # every forward was served
    assert result["matched"] and result["sources"] == ["local"], result
    said = [w for w in result["warnings"] if "snapshots are bypassed" in w]
    assert len(said) == 1, result["warnings"]
    reason = "no space left" if fault == "full" else "read-only file system"
    assert "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR" in said[0] and reason in said[0], said
    assert "Traceback" not in err
    # Nothing half-written: no file (an empty <hash> directory may stay; it holds no bundle).
    assert [p for p in snapshots.rglob("*") if not p.is_dir()] == []
    # With room, the same start captures its forwards.
    (tmpfs / "ballast").unlink(missing_ok=True)
    code, result, err = serve(tmp_path / "cache", **capture)
    assert code == 0 and result is not None and result["warnings"] == [], err[-3000:]
    assert len(list(snapshots.rglob("meta.json"))) == 3
