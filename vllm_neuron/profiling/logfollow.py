"""Follow a growing log file line by line (``tail -f`` without a subprocess)."""

from __future__ import annotations

import os

from vllm_neuron.backends import Store


class LogFollower:
    """Returns the complete lines appended to `key` of `store` since the last call.

    Starts at the current end of the file (``from_start=False``), so a follower created
    when a workload begins sees only what the server logged from then on. Each read opens
    the key afresh and seeks to where the last one stopped: the server appends to the file
    (and a decode fallback moves it aside), so no handle is kept across reads.
    """

    def __init__(self, store: Store, key: str, *, from_start: bool = False) -> None:
        self.store = store
        self.key = key
        self._offset = 0 if from_start else self._size()
        self._partial = b""

    def _size(self) -> int:
        try:
            info = self.store.info(self.key)
        except OSError:
            return 0
        return 0 if info is None else info.size

    def read_lines(self, max_bytes: int = 1 << 20) -> list[str]:
        try:
            with self.store.open_read(self.key) as f:
                f.seek(self._offset, os.SEEK_SET)
                chunk = f.read(max_bytes)
        except OSError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [line.decode("utf-8", "replace") for line in lines]
