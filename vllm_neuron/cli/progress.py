"""Progress by bytes on stderr (rich), for the commands that copy: promote, warm, demo.

Shown only when stderr is a terminal and the command was not asked for ``--json``: a
script reading the output, a log file or a CI job never gets carriage-return bars. When
nothing is shown the callbacks are None, so the storage layer takes its plain copy path
and counts nothing (`backends.transfer.Progress`).

The bar is redrawn when its whole percentage changes (at most about a hundred times per
task), not on a timer: the copies report every few MiB from their own threads, and a
redraw per whole percent keeps a 1.4 GiB file visibly moving without costing the copy.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import Any

from vllm_neuron.backends import Progress


def terminal(stream: Any = None) -> bool:
    """Whether `stream` (default stderr) is a terminal a person is watching."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ByteProgress:
    """One rich progress display with a task per copy (`task`), or nothing at all."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.shown = enabled and terminal()
        self._bar: Any = None
        self._lock = threading.Lock()

    def __enter__(self) -> ByteProgress:
        if self.shown:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TaskProgressColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                "{task.description}", BarColumn(), TaskProgressColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(),
                console=Console(stderr=True), auto_refresh=False, transient=False,
            )
            self._bar.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.refresh()
            self._bar.__exit__(kind, exc, tb)
            self._bar = None

    def task(self, label: str) -> Task | None:
        """A bar labelled `label`, drawn from the first bytes reported (a copy that never
        starts, of an entry already there, leaves no empty bar); None when nothing is shown
        (pass None on as the storage layer's callback)."""
        if self._bar is None:
            return None
        return Task(self, label)

    def _update(self, task: Task, *, completed: int | None = None, advance: int = 0,
                total: int | None = None) -> None:
        with self._lock:
            bar = self._bar
            if bar is None:
                return
            if task.id is None:
                task.id = bar.add_task(task.label, total=total)
            state = next(t for t in bar.tasks if t.id == task.id)
            before = (state.total, int(state.percentage) if state.total else -1)
            if total is not None and total != state.total:
                bar.update(task.id, total=total)
            if completed is not None:
                bar.update(task.id, completed=completed)
            if advance:
                bar.advance(task.id, advance)
            if (state.total, int(state.percentage) if state.total else -1) != before:
                bar.refresh()


class Task:
    """One bar: `progress` is the storage layer's `Progress` (done, total); `total` and
    `advance` suit a caller that knows the total first and counts pieces after."""

    def __init__(self, owner: ByteProgress, label: str) -> None:
        self._owner, self.label = owner, label
        self.id: Any = None  # rich's task id, from the first report on

    def progress(self, done: int, total: int) -> None:
        self._owner._update(self, completed=done, total=total)

    def total(self, n: int) -> None:
        self._owner._update(self, total=n)

    def advance(self, n: int) -> None:
        self._owner._update(self, advance=n)


def callback(task: Task | None) -> Progress | None:
    """`task`'s `Progress` callback, or None (no bar: the copies count nothing)."""
    return None if task is None else task.progress
