"""Signals during a capture: SIGINT and SIGTERM interrupt it; a teardown is never cut short.

A capture owns a server process group (on Neuron: devices). Whatever interrupts it, the
capture still stops an owed profile, tears the server down and writes its manifest; a
second signal during that block is deferred, not obeyed, so a capture cannot leak a
device-holding server by being interrupted twice.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) arrived: stop the capture, but still tear down and record."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM raises `Interrupted` and SIGINT raises KeyboardInterrupt in the main thread.

    SIGINT is installed explicitly: a command started in the background by a
    non-interactive shell (``cmd &`` in a script, CI runners) inherits SIGINT *ignored*,
    and Python keeps it so; a capture that shrugs off ``kill -INT`` would leave its
    server running until the recipe ends.
    """
    if not main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, handler),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    try:
        yield
    finally:
        for signum, restored in previous.items():
            signal.signal(signum, restored)


@contextlib.contextmanager
def shielded(log: Callable[[str], None], *, reraise: bool = False) -> Iterator[None]:
    """Defer SIGINT/SIGTERM while a teardown runs: it must not be cut short.

    With ``reraise``, the first deferred signal is raised when the block ends (as
    KeyboardInterrupt or `Interrupted`); otherwise it is only logged.
    """
    if not main_thread():
        yield
        return
    pending: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)
        log(f"{signal.Signals(signum).name} deferred: tearing the server down, please wait")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if reraise and pending:
        if pending[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise Interrupted(pending[0])


def main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
