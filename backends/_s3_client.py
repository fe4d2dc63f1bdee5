"""The S3 client under `S3Store`: s3fs made bounded, errors made ours, options checked.

Every request goes through one s3fs call (`_call_s3`), wrapped here with a deadline
(`request_timeout`, all retries included), so an endpoint that accepts connections and
never answers is a `StoreUnavailable` naming the URL within seconds; missing buckets and
refusals become `StoreMissing` / `StoreAccessDenied`, never a silent "no such key".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import StoreAccessDenied, StoreMissing, StoreUnavailable

F = TypeVar("F", bound=Callable[..., Any])

_PASSTHROUGH = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


def _translated(method: F) -> F:
    """Turn transport errors into `StoreUnavailable`; keep the errors callers branch on."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except _PASSTHROUGH:
            raise
        except StoreUnavailable:
            raise
        except Exception as exc:
            if _is_transport_error(exc) or isinstance(exc, (OSError, PermissionError)):
                raise StoreUnavailable(
                    f"S3 store {self.url} is unavailable ({type(exc).__name__}: {exc})"
                ) from exc
            raise

    return wrapper  # type: ignore[return-value]


def _is_transport_error(exc: BaseException) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ClientError",
            "NoCredentialsError",
            "BotoCoreError",
            "ClientOSError",
            "ServerDisconnectedError",
        }
    )


# Options of our own, consumed before s3fs sees the rest.
_OWN_OPTIONS = frozenset(
    {"endpoint_url", "connect_timeout", "read_timeout", "request_timeout", "retries"}
)
DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds to open a TCP connection (an endpoint that drops SYNs)."""
DEFAULT_READ_TIMEOUT = 15.0
"""Seconds one socket read may wait: a stalled download stream, once its headers came."""
DEFAULT_REQUEST_TIMEOUT = 10.0
"""Seconds one request may take in total, botocore's and s3fs's retries included, until
its response headers arrive (plus its upload at `MIN_UPLOAD_RATE`)."""
MIN_UPLOAD_RATE = 64 * 1024
"""Bytes per second: a request's body adds ``len(body) / MIN_UPLOAD_RATE`` to its bound."""
# Accepted by fsspec's base classes through s3fs's **kwargs.
_FSSPEC_OPTIONS = frozenset({"batch_size", "listings_expiry_time", "max_paths"})
# Handed by s3fs to the botocore session it creates (through its **kwargs).
_SESSION_OPTIONS = frozenset({"profile"})
# Set by us; a caller's value would clash with them.
_FIXED_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache"})


def accepted_options() -> frozenset[str]:
    """Every option `open_store("s3://...", **options)` accepts.

    s3fs hands unknown keyword arguments to fsspec, which ignores them; we refuse them
    instead, so a misspelt option is a `TypeError` rather than silence.
    """
    # Lazy: s3fs is heavy and optional; only this path needs it.
    import s3fs

    params = inspect.signature(s3fs.S3FileSystem.__init__).parameters
    named = {
        n
        for n, p in params.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    return frozenset((named | _OWN_OPTIONS | _FSSPEC_OPTIONS | _SESSION_OPTIONS) - _FIXED_OPTIONS)


_session: Any = None
_session_lock = threading.Lock()


def _shared_session() -> Any:
    """One botocore session per process, shared by every S3 store that does not bring its own.

    A session caches the service models and the resolved credentials; with a fresh one per
    store, opening a store and making its first request took ~0.25 s, with the shared one
    ~0.02 s. Explicit ``key``/``secret``/``token`` options still apply per store; a store
    given ``profile`` or ``session`` gets its own session.
    """
    global _session
    with _session_lock:
        if _session is None:
            # Lazy: aiobotocore (s3fs's) is heavy and optional; only this path needs it.
            import aiobotocore.session

            _session = aiobotocore.session.AioSession()
        return _session


def _request_limit(base: float, body: Any) -> float | None:
    """The total seconds a request may take: ``base``, plus its body's upload time at the
    floor rate; None (unbounded) for a body of unknown size, which s3fs never sends."""
    if body is None:
        return base
    if isinstance(body, (bytes, bytearray, memoryview)):
        return base + len(body) / MIN_UPLOAD_RATE
    return None


def _s3_error(exc: BaseException) -> tuple[str, str]:
    """(code, message) of the S3 error behind an exception s3fs translated, else ("", str)."""
    response = getattr(exc.__cause__, "response", None)
    error = response.get("Error", {}) if isinstance(response, dict) else {}
    return str(error.get("Code") or ""), str(error.get("Message") or exc)


def _refusal(url: str, method: str, bucket: Any, exc: BaseException) -> StoreUnavailable | None:
    """The storage layer's error for a refusal s3fs reported as FileNotFound/Permission."""
    code, message = _s3_error(exc)
    if code == "NoSuchBucket":
        return StoreMissing(
            f"S3 store {url} is unavailable: bucket {bucket!r} does not exist "
            f"(NoSuchBucket: {message})"
        )
    if isinstance(exc, PermissionError):
        return StoreAccessDenied(
            f"S3 store {url} refused {method} ({code or type(exc).__name__}: {message})"
        )
    return None


@functools.cache
def _bounded_fs_class() -> type:
    """`s3fs.S3FileSystem` with every request bounded and the bucket's errors kept apart.

    Built on first use (s3fs is optional). Every S3 request of s3fs - its async methods,
    its files' reads and writes, its listings page by page - goes through ``_call_s3``;
    the sync ``call_s3`` is rebuilt here because s3fs binds it to its own ``_call_s3``.
    """
    # Lazy: s3fs is heavy and optional; only this path needs it.
    import s3fs
    from fsspec.asyn import sync_wrapper

    class BoundedS3FileSystem(s3fs.S3FileSystem):
        store_url = "s3://"
        endpoint = "the S3 endpoint"
        request_timeout = DEFAULT_REQUEST_TIMEOUT

        async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
            limit = _request_limit(self.request_timeout, kwargs.get("Body"))
            try:
                return await asyncio.wait_for(
                    super()._call_s3(method, *akwarglist, **kwargs), limit
                )
            except asyncio.TimeoutError:
                raise StoreUnavailable(
                    f"S3 store {self.store_url} is unavailable: no answer from "
                    f"{self.endpoint} to {method} within {limit:g} s"
                ) from None
            except (FileNotFoundError, PermissionError) as exc:
                refused = _refusal(self.store_url, method, kwargs.get("Bucket"), exc)
                if refused is None:
                    raise
                raise refused from exc

        call_s3 = sync_wrapper(_call_s3)

    return BoundedS3FileSystem
