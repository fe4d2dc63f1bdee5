"""Progress by bytes: per chunk from the copies, on a terminal only.

A one-file entry must move its bar within the file (a 1.4 GiB NEFF that sits at 0 % and
then jumps to 100 % tells nobody anything): the storage layer's copies call `Progress`
as chunks land, and the CLI draws a rich bar only when stderr is a terminal.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron.backends import copy_tree, copy_verified, open_store
from vllm_neuron.compile.commands.warm import warm_keys
from vllm_neuron.compile.entry.record import read_record
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.promote import save_cache

BIG = 40 << 20  # five 8 MiB chunks
KEY = "c" * 32


def one_big_file(out: str) -> dict[str, Any]:
    with open(os.path.join(out, "model.neff"), "wb") as f:
        f.write(os.urandom(1 << 20) * (BIG >> 20))
    return {}


@pytest.fixture
def big_entry(tmp_path: Path) -> str:
    """A local tier whose one entry is a single 40 MiB file."""
    local = str(tmp_path / "cache")
    TwoTierCache(local).get_or_compile(KEY, one_big_file)
    return local


def calls_within_the_file(calls: list[tuple[int, int]], total: int) -> list[int]:
    assert calls and calls[-1] == (total, total)
    dones = [done for done, _ in calls]
    assert dones == sorted(dones)
    return [d for d in dones if 0 < d < total]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_verified_copy_reports_bytes_within_one_large_file(big_entry, tmp_path, workers):
    src, dst = open_store(big_entry), open_store(str(tmp_path / "dst"))
    record = read_record(src, str(src.published(KEY)))
    calls: list[tuple[int, int]] = []
    with dst.stage(KEY) as staging:
        copy_verified(src, str(src.published(KEY)), staging, record.files, workers=workers,
                      progress=lambda done, total: calls.append((done, total)))
    total = record.total_size
    assert len(calls_within_the_file(calls, total)) >= 3  # 8 MiB steps of a 40 MiB file


def test_a_streamed_verified_copy_reports_each_chunk(big_entry, tmp_path):
    """SHA-256 only (a record from before BLAKE3): the streaming path, chunk by chunk."""
    import msgspec

    src, dst = open_store(big_entry), open_store(str(tmp_path / "dst"))
    record = read_record(src, str(src.published(KEY)))
    files = {rel: msgspec.structs.replace(d, blake3=None) for rel, d in record.files.items()}
    calls: list[tuple[int, int]] = []
    with dst.stage(KEY) as staging:
        copy_verified(src, str(src.published(KEY)), staging, files, workers=1,
                      progress=lambda done, total: calls.append((done, total)))
    assert len(calls_within_the_file(calls, record.total_size)) >= 3


def test_copy_tree_reports_bytes_within_one_large_file(big_entry, tmp_path):
    src = open_store(big_entry)
    dst = open_store(str(tmp_path / "remote"))
    calls: list[tuple[int, int]] = []
    with dst.stage(KEY) as staging:
        copy_tree(src, str(src.published(KEY)), staging, keys=["model.neff"],
                  progress=lambda done, total: calls.append((done, total)))
        assert staging.commit()
    assert len(calls_within_the_file(calls, BIG)) >= 3
    landed = dst.read(f"{dst.published(KEY)}/model.neff")
    assert landed == src.read(f"{src.published(KEY)}/model.neff")


def promote_argv(local: str, remote: str) -> list[str]:
    return [sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir", local, "promote",
            "--to", remote, "--all"]


def test_no_bar_when_stderr_is_not_a_terminal(big_entry, tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_LIBTORCH_REMOTE_CACHE", raising=False)
    proc = subprocess.run(promote_argv(big_entry, str(tmp_path / "remote")),
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b""
    assert f"{KEY}: promoted".encode() in proc.stdout and b"\r" not in proc.stdout


def on_a_terminal(argv: list[str]) -> tuple[int, bytes, str]:
    """Run `argv` with stderr on a pseudo-terminal: (exit status, stdout, what the
    terminal got)."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=secondary,
                            env={**os.environ, "COLUMNS": "160"})
    os.close(secondary)
    seen = b""
    # poll, not select: in a long suite the descriptor may be above select()'s FD_SETSIZE.
    poller = select.poll()
    poller.register(primary, select.POLLIN)
    while poller.poll(120_000):
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(primary)
    return proc.returncode, out, seen.decode(errors="replace")


def test_a_terminal_gets_a_bar_that_moves_within_the_file(big_entry, tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_LIBTORCH_REMOTE_CACHE", raising=False)
    argv = promote_argv(big_entry, str(tmp_path / "remote"))
    code, out, text = on_a_terminal(argv)
    assert code == 0, out
    assert f"promote {KEY[:12]}" in text
    percents = {int(p) for p in re.findall(r"(\d+)%", text)}
    assert 100 in percents
    assert {p for p in percents if 0 < p < 100}, text  # it moved within the one file
    # Again: the remote holds it, nothing is copied, and no empty bar is left behind.
    code, out, text = on_a_terminal(argv)
    assert code == 0 and b"already in the remote tier" in out
    assert f"promote {KEY[:12]}" not in text and "%" not in text


def test_a_promotion_to_s3_counts_each_file_once_it_is_up(big_entry, s3_server, s3_store_url):
    """Into an object store the copy stays put_file (a multipart upload from disk, never
    the whole file in memory): the count moves per file and reaches the total."""
    src = open_store(big_entry)
    dst = open_store(s3_store_url, endpoint_url=s3_server)
    calls: list[tuple[int, int]] = []
    with dst.stage(KEY) as staging:
        copy_tree(src, str(src.published(KEY)), staging, keys=["model.neff"],
                  progress=lambda done, total: calls.append((done, total)))
        assert staging.commit()
    assert calls == [(BIG, BIG)]
    assert dst.info(f"{dst.published(KEY)}/model.neff").size == BIG


def test_warm_counts_bytes_within_one_large_file(big_entry, tmp_path):
    """`cache warm`'s bar is fed by `warm_keys(on_bytes=)`: for a one-file entry it must
    move before the file is done, and add up to the entry's size."""
    remote = str(tmp_path / "remote")
    assert save_cache(big_entry, remote, KEY)
    steps: list[int] = []
    result = warm_keys(open_store(str(tmp_path / "node")), open_store(remote), [KEY],
                       jobs=1, on_bytes=steps.append)  # fmt: skip
    assert result.fetched == [KEY]
    assert sum(steps) == result.fetched_bytes and len(steps) > 1, steps
    assert all(step > 0 for step in steps)
