"""Real filesystems that fill up and refuse writes, for the fault tests: a tmpfs mounted in a
test's directory, remounted read-only or tiny, filled with a ballast file.

CI runs as root and can mount; a machine that cannot fails these tests saying so, never
skips them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["fill", "mount", "remount", "tmpfs"]


def mount(args: list[str], target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"this test needs to mount a tmpfs (as root, as CI runs): mount {args} "
                    f"{target} failed: {done.stderr.strip()}")  # fmt: skip


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs (96 MiB: room to compile), unmounted after the test."""
    target = tmp_path / "tmpfs"
    mount(["-t", "tmpfs", "-o", "size=96m", "tmpfs"], target)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def remount(target: Path, mode: str) -> None:
    mount(["-o", f"remount,{mode}"], target)


def fill(tmpfs: Path) -> None:
    """Fill ``tmpfs`` with a ballast file: every further write there is ENOSPC."""
    fd = os.open(tmpfs / "ballast", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
