"""The host toolchain's node files in the local tier (toolchains/node_files.py): counted by
the size bound, collected by ``cache gc``, never while a live process uses them; what a
killed header build leaves is swept. Real files, real kernel locks, a real second process;
no compile (the probe test in tests/compile/workers/test_head_start.py compiles for real)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_neuron.backends import encode, open_store
from vllm_neuron.compile.toolchains import node_files
from vllm_neuron.compile.toolchains.node_files import (
    NODE_DIR,
    OWNER,
    NodeFilesOwner,
    node_groups,
    sweep_header_debris,
)
from vllm_neuron.compile.upkeep.collect import plan_gc
from vllm_neuron.compile.upkeep.eviction import Evictor

HOLD = """
import sys
from vllm_neuron.compile.toolchains import node_files
print(node_files.group_dir(), flush=True)
sys.stdin.read()  # in use until the test closes our input
"""


def _group(local: Path, name: str, *, interpreter: str, size: int, used: float) -> Path:
    """A group as a process of `interpreter` left it: a header of `size` bytes, its owner."""
    group = local / NODE_DIR / name
    (group / "headers").mkdir(parents=True, mode=0o700)
    (group / "headers" / "h.h.gch").write_bytes(b"\0" * size)
    owner = NodeFilesOwner(interpreter=interpreter, torch_dir=str(Path(os.__file__).parent),
                           torch_version="2.x", used=used)  # fmt: skip
    (group / OWNER).write_bytes(encode(owner))
    os.utime(group / OWNER, (used, used))
    return group


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A real process whose group of node files is in the tier at tmp_path/tier, in use."""
    local = tmp_path / "tier"
    local.mkdir(mode=0o700)
    monkeypatch.setenv("_VLLM_NEURON_NODE_FILES", str(local / NODE_DIR))
    monkeypatch.delenv("_VLLM_NEURON_SHARED_NODE_FILES", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None
    group = Path(holder.stdout.readline().strip())
    assert group.parent == local / NODE_DIR, group
    (group / "headers" / "live.h.gch").write_bytes(b"\0" * 4096)
    yield local, group
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(timeout=60)


def test_gc_collects_the_node_files_of_a_gone_interpreter_and_keeps_the_live_ones(live):
    local, live_group = live
    now = time.time()
    gone = _group(local, "gone", interpreter="/nonexistent/python3.9", size=1000, used=now)
    idle = _group(local, "idle", interpreter=sys.executable, size=1000, used=now - 30 * 86400)
    recent = _group(local, "recent", interpreter=sys.executable, size=1000, used=now)
    store = open_store(str(local), create=False)
    plan = plan_gc(store)
    planned = {i.where: i.reason for i in plan.items if i.kind == "node-files"}
    assert set(planned) == {f"{NODE_DIR}/gone", f"{NODE_DIR}/idle"}, plan
    assert "no longer exists" in planned[f"{NODE_DIR}/gone"]
    outcome = plan.execute()
    assert not outcome.failed and not outcome.stayed, outcome
    assert not gone.exists() and not idle.exists()
    assert recent.exists() and (live_group / "headers" / "live.h.gch").exists()
    # A live process's group stays, whatever its record says (it is in use).
    (live_group / OWNER).write_bytes(b"not a record")
    plan = plan_gc(store)
    assert not [i for i in plan.items if i.kind == "node-files"], plan.items
    assert any(k.reason == "in use by a live process" for k in plan.kept)


def test_idle_node_files_count_toward_the_bound_and_go_first(live):
    local, live_group = live
    now = time.time()
    old = _group(local, "old", interpreter=sys.executable, size=100_000, used=now - 100)
    new = _group(local, "new", interpreter=sys.executable, size=100_000, used=now)
    store = open_store(str(local), create=False)
    # A live process's group is its working set (as the entries it loaded): not counted, so
    # a running server's Inductor cache never withdraws entries; idle groups are.
    (live_group / "inductor" / "big.so").write_bytes(b"\0" * 1_000_000)
    done = Evictor(store, 150_000, recent_use_seconds=0).run()
    assert done is not None
    assert not old.exists() and new.exists()  # least recently used first, to the bound
    assert done.total == sum(g.size for g in node_groups(str(local)) if g.name == "new")
    Evictor(store, 1, recent_use_seconds=0).run()
    assert not new.exists()
    assert (live_group / "headers" / "live.h.gch").exists()  # in use: never removed


def test_a_killed_header_builds_staged_file_is_swept(tmp_path: Path) -> None:
    headers = tmp_path / "headers"
    headers.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    gone = headers / f"a.h.gch.{dead}.140.tmp"
    mine = headers / f"b.h.gch.{os.getpid()}.140.tmp"  # its writer is alive and writing
    old = headers / f"c.h.gch.{os.getpid()}.141.tmp"
    for path in (gone, mine, old, headers / "d.h.gch"):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert sweep_header_debris(str(headers)) == 2
    assert sorted(p.name for p in headers.iterdir()) == ["b.h.gch." + f"{os.getpid()}.140.tmp",
                                                         "d.h.gch"]  # fmt: skip


def test_without_a_tier_the_group_is_a_throwaway_removed_at_exit(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir(mode=0o700)
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": os.getcwd()}
    env.pop("_VLLM_NEURON_NODE_FILES", None)
    env.pop("_VLLM_NEURON_SHARED_NODE_FILES", None)
    code = "from vllm_neuron.compile.toolchains import node_files; print(node_files.group_dir())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert Path(done.stdout.strip()).parent.name.startswith(node_files.THROWAWAY_PREFIX)
    assert not any(temp.iterdir()), sorted(temp.rglob("*"))


def test_a_process_that_finds_its_group_again_keeps_it_in_the_tier(tmp_path, monkeypatch):
    # A pytest process resets its group (group_dir.cache_clear) to find it anew: its own
    # user lock, already held, is no reason to fall back to a throwaway group.
    from vllm_neuron.compile.toolchains.node_files import group_dir, node_groups

    local = tmp_path / "tier"
    local.mkdir(mode=0o700)
    monkeypatch.setenv("_VLLM_NEURON_NODE_FILES", str(local / NODE_DIR))
    monkeypatch.delenv("_VLLM_NEURON_SHARED_NODE_FILES", raising=False)
    group_dir.cache_clear()
    try:
        first = group_dir()
        group_dir.cache_clear()
        assert group_dir() == first and Path(first).parent == local / NODE_DIR, first
        assert [g.in_use for g in node_groups(str(local))] == [True]
    finally:
        group_dir.cache_clear()
