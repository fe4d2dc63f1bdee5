"""moto's S3 HTTP API on loopback, for tests and benchmarks that need a real S3 endpoint.

moto 5.2.5 (`S3Response.put_object`) checks ``If-None-Match: *`` / ``If-Match`` and stores
the object later in the same handler, with no lock in between, and its server runs one
thread per request: two racing creates can both pass the check. Real S3 decides
conditional writes atomically; without `conditional_puts_made_atomic`, a race on moto could
see two winners that S3 would never produce. moto is imported only when a server starts.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["conditional_puts_made_atomic", "free_port", "moto_s3_server"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_patch_lock = threading.Lock()
_patch_users = 0
_original_put: Any = None


@contextmanager
def conditional_puts_made_atomic() -> Iterator[None]:
    """Serialise moto's conditional PUTs while the block runs (nesting is fine)."""
    global _patch_users, _original_put
    # Lazy: moto is a test dependency, needed only where a server is started.
    from moto.s3.responses import S3Response

    with _patch_lock:
        if _patch_users == 0:
            _original_put = S3Response.put_object
            original, serialise = _original_put, threading.Lock()

            def put_object(self: Any) -> Any:
                if "If-None-Match" in self.headers or "If-Match" in self.headers:
                    with serialise:
                        return original(self)
                return original(self)

            S3Response.put_object = put_object  # type: ignore[method-assign]
        _patch_users += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                S3Response.put_object = _original_put  # type: ignore[method-assign]


@contextmanager
def moto_s3_server(*, on_request: Callable[[], object] | None = None) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 in this process's threads; yields its endpoint URL.

    `on_request` is called for every request the server handles (a benchmark counts them).
    """
    # Lazy: moto is a test dependency, needed only where a server is started.
    from moto.server import DomainDispatcherApplication, ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    dispatch = DomainDispatcherApplication.__call__
    if on_request is not None:

        def counted(self: Any, environ: Any, start_response: Any) -> Any:
            on_request()
            return dispatch(self, environ, start_response)

        DomainDispatcherApplication.__call__ = counted  # type: ignore[method-assign]
    try:
        with conditional_puts_made_atomic():
            port = free_port()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            try:
                yield f"http://127.0.0.1:{port}"
            finally:
                server.stop()
    finally:
        DomainDispatcherApplication.__call__ = dispatch  # type: ignore[method-assign]
