"""Follow a growing log file line by line (``tail -f`` without a subprocess)."""

from __future__ import annotations

import os


class LogFollower:
    """Returns the complete lines appended to `path` since the last call.

    Starts at the current end of the file (``from_start=False``), so a follower created
    when a workload begins sees only what the server logged from then on.
    """

    def __init__(self, path: str, *, from_start: bool = False) -> None:
        self.path = path
        self._offset = 0 if from_start else self._size()
        self._partial = b""

    def _size(self) -> int:
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def read_lines(self, max_bytes: int = 1 << 20) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(max_bytes)
        except OSError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [line.decode("utf-8", "replace") for line in lines]
