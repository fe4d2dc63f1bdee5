"""A TCP endpoint that accepts connections and never answers: the stalled S3 endpoint.

The kernel completes every handshake (the socket listens), a thread accepts each
connection and holds it, and nothing is ever read or written: a client's request goes out
and no response ever comes back, which is what a hung proxy or a wrong port on a
firewalled host looks like. Tests count the connections it got without sleeping: a
sentinel connection (`connections`) is accepted after every connection made before it,
because the listen queue is first in, first out.
"""

from __future__ import annotations

import contextlib
import socket
import threading

HANG = 300.0
"""Seconds. A safety limit only: what takes this long is hung, not slow."""


class BlackHole:
    """Accepts on 127.0.0.1, never answers. Use as a context manager; `url` for clients."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        host, port = self._sock.getsockname()
        self.address = (host, port)
        self.url = f"http://{host}:{port}"
        self._held: list[socket.socket] = []
        self._peers: list[tuple[str, int]] = []
        self._sentinels: set[tuple[str, int]] = set()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="black-hole", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:  # closed
                return
            with self._changed:
                self._held.append(conn)
                self._peers.append(peer)
                self._changed.notify_all()

    def connections(self) -> int:
        """How many connections clients made so far (sentinels not counted).

        Opens a sentinel connection and waits until it is accepted: every connection a
        client made before this call is then accepted and counted too.
        """
        sentinel = socket.create_connection(self.address, timeout=HANG)
        me = sentinel.getsockname()
        with self._changed:
            self._sentinels.add(me)
            if not self._changed.wait_for(lambda: me in self._peers, timeout=HANG):
                raise AssertionError(f"the black hole did not accept a connection in {HANG} s")
            count = sum(1 for p in self._peers if p not in self._sentinels)
        sentinel.close()
        return count

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._sock.close()
        self._thread.join(timeout=HANG)
        with self._changed:
            for conn in self._held:
                conn.close()

    def __enter__(self) -> BlackHole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
