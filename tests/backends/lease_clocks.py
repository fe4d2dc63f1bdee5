"""Clocks a lease test controls: `Clocks` stands in for the `time` module of backends/locks.py.

`monotonic()` is the test's own counter (moved by `advance`, and by the lock's retry loop
through `sleep`, which only moves it), so "one lease period later" is a number, not a wait.
`time()` is the true wall clock plus `offset` (or `frozen`, a clock standing still), so a
test says whose wall clock is wrong by setting it around that party's calls. The fixture
`clocks` (tests/backends/conftest.py) puts one in place for a test.
"""

from __future__ import annotations

import time as real_time
from collections.abc import Iterator
from contextlib import contextmanager


class Clocks:
    def __init__(self) -> None:
        self.mono = 10_000.0
        self.offset = 0.0
        self.frozen: float | None = None

    # the `time` module's functions that locks.py calls
    def time(self) -> float:
        return self.frozen if self.frozen is not None else real_time.time() + self.offset

    def monotonic(self) -> float:
        return self.mono

    def sleep(self, seconds: float) -> None:
        self.mono += seconds

    # for the test
    def advance(self, seconds: float) -> None:
        self.mono += seconds

    @contextmanager
    def wall(self, offset: float = 0.0, *, frozen: float | None = None) -> Iterator[None]:
        """The wall clock `offset` seconds off (or standing still at `frozen`) meanwhile."""
        saved = self.offset, self.frozen
        self.offset, self.frozen = offset, frozen
        try:
            yield
        finally:
            self.offset, self.frozen = saved
