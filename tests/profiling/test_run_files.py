"""A profile run's files go through the storage layer: discovery, the server's log, the
windows set aside, the process group's members.

The capture tests drive these end to end; here each piece is pinned on its own, including
what the move to the store must not change (discovery's order, NEFF hashes read once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from profiling_support import wait_until

from vllm_neuron.backends import open_store
from vllm_neuron.profiling.artifacts import collect
from vllm_neuron.profiling.layout import OUTPUT_DIR
from vllm_neuron.profiling.lifecycle import group_members
from vllm_neuron.profiling.logfollow import LogFollower
from vllm_neuron.profiling.windows import Windows


def neuron_session(out: Path, session: str, neff_hash: str) -> None:
    """One Neuron profiler session's files, as `artifacts` documents them."""
    directory = out / session
    (directory / "neffs").mkdir(parents=True)
    (directory / "device.ntff").write_bytes(b"n" * 10)
    (directory / "system.pb").write_bytes(b"s")
    (directory / "trace_info.pb").write_bytes(b"t")
    (directory / "neffs" / f"graph_{neff_hash}.neff").write_bytes(b"f")


def test_neff_hashes_are_listed_once_and_never_encoded(tmp_path: Path) -> None:
    neuron_session(tmp_path, "s", "8f3a2b1c9d0e")
    found = collect(str(tmp_path), "neuron")
    assert found.neff_hashes == ["8f3a2b1c9d0e"]
    for neff in (tmp_path / "s" / "neffs").iterdir():
        neff.unlink()
    assert found.neff_hashes == ["8f3a2b1c9d0e"]  # kept: the disk is not read again
    assert collect(str(tmp_path), "neuron").neff_hashes == []
    encoded = msgspec.json.decode(msgspec.json.encode(found))
    assert "neff_hashes" not in encoded
    assert msgspec.json.decode(msgspec.json.encode(found), type=type(found)) == found


def test_discovery_keeps_the_order_of_a_walk(tmp_path: Path) -> None:
    """Two sessions with a trace_info.pb each: the one a top-down walk visits last (files
    of a directory before its subdirectories) is named, as before discovery listed through
    the store; plain key order would name the other one."""
    (tmp_path / "trace_info.pb").write_bytes(b"top")
    neuron_session(tmp_path, "a", "aaaaaaaa")
    found = collect(str(tmp_path), "neuron")
    assert found.trace_info_pb == str(tmp_path / "a" / "trace_info.pb")
    assert found.device_trace == str(tmp_path / "a" / "device.ntff")
    assert [t.size for t in found.traces] == [10]


def test_the_log_is_followed_through_the_store(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    follower = LogFollower(store, "logs/serve.log")  # before the file exists
    assert follower.read_lines() == []
    store.write("logs/serve.log", b"one\ntw")
    assert follower.read_lines() == ["one"]
    store.write("logs/serve.log", b"one\ntwo\nthree\n")
    assert follower.read_lines() == ["two", "three"]
    late = LogFollower(store, "logs/serve.log")  # starts at the end
    store.write("logs/serve.log", b"one\ntwo\nthree\nfour\n")
    assert late.read_lines() == ["four"]
    assert LogFollower(store, "logs/serve.log", from_start=True).read_lines()[0] == "one"


def test_a_rejected_window_is_set_aside_and_output_cleared(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    with store.local_output(OUTPUT_DIR) as output_dir:
        windows = Windows(store, str(tmp_path), output_dir, profiler="torch",
                          phase="prefill", limit=2, log=lambda _: None)
        store.write("output/rank0.1.pt.trace.json.gz", b"x")
        store.write("output/session/nested.pb", b"y")
        moved = windows.set_aside("windows/attempt1-window1",
                                  [os.path.join(output_dir, "rank0.1.pt.trace.json.gz")])
        assert moved == [str(tmp_path / "windows/attempt1-window1/rank0.1.pt.trace.json.gz")]
        assert store.list("windows") == ["windows/attempt1-window1/rank0.1.pt.trace.json.gz",
                                          "windows/attempt1-window1/session/nested.pb"]
        assert store.list_dir(OUTPUT_DIR) == []
        store.write("output/a.json", b"1")
        store.write("output/d/b.json", b"2")
        windows.clear()
        assert store.list_dir(OUTPUT_DIR) == [] and os.path.isdir(output_dir)


@pytest.mark.parametrize("url", ["local", "memory://"])
def test_rename_moves_files_and_trees(tmp_path: Path, url: str) -> None:
    """`Store.rename`, as the capture uses it: one rename(2) on local disk, a copy and a
    delete elsewhere (the generic version)."""
    store = open_store(str(tmp_path) if url == "local" else url)
    store.write("logs/serve.log", b"first launch")
    assert store.rename("logs/serve.log", "logs/serve.attempt1.log")
    assert store.read("logs/serve.attempt1.log") == b"first launch"
    assert not store.exists("logs/serve.log")
    assert not store.rename("logs/serve.log", "logs/serve.attempt2.log")  # nothing there
    store.write("output/s/x.pb", b"x")
    store.write("output/y.ntff", b"y")
    assert store.rename("output/s", "windows/w1/s")
    assert store.list("windows") == ["windows/w1/s/x.pb"]
    assert store.list("output") == ["output/y.ntff"]


def test_group_members_tells_zombies_apart() -> None:
    # A group of its own (pgid == pid), in a session of its own too: nothing else is in it.
    # The child lives until its stdin closes: the test decides when it exits, not a clock.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE, start_new_session=True)
    try:
        assert group_members(child.pid) == [child.pid]
        assert child.stdin is not None
        child.stdin.close()
        # Exited but not reaped: a zombie, a member only when zombies are asked for.
        assert wait_until(lambda: group_members(child.pid) == [], 600)  # 600: a hang only
        assert group_members(child.pid, include_zombies=True) == [child.pid]
    finally:
        child.wait()
    assert group_members(child.pid, include_zombies=True) == []
