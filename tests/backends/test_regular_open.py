"""`open_regular` (backends/regular.py) never opens what is not a regular file: on Linux an
``O_PATH`` handle tells the type first, so a device's driver is never called (a tty would
become the controlling terminal, a tape would rewind); a FIFO, a link, a device are refused
unopened, and a regular file is read through the very inode that was checked (issue 39)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron.backends import regular
from vllm_neuron.backends.errors import NotRegularFile

pytestmark = pytest.mark.skipif(not hasattr(os, "O_PATH"), reason="O_PATH is Linux's")


def _opens(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    real = os.open

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        calls.append((str(path), flags))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(regular.os, "open", spy)
    return calls


@pytest.mark.parametrize("what", ["fifo", "link-to-device"])
def test_what_is_not_a_regular_file_is_only_ever_opened_as_a_handle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str) -> None:  # fmt: skip
    path = str(tmp_path / "entry.json")
    if what == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/tty", path)
    calls = _opens(monkeypatch)
    with pytest.raises(NotRegularFile):
        regular.read_regular(path, 1 << 20)
    assert calls and all(flags & os.O_PATH for _, flags in calls), calls


def test_a_regular_file_is_read_through_the_inode_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    path = tmp_path / "entry.json"
    path.write_bytes(b"{}")
    calls = _opens(monkeypatch)
    assert regular.read_regular(str(path), 1 << 20) == b"{}"
    assert calls[0][1] & os.O_PATH and calls[1][0].startswith("/proc/self/fd/")
    assert calls[1][1] & os.O_NOCTTY and calls[1][1] & os.O_NONBLOCK
