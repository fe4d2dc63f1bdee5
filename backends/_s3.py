"""S3 store through s3fs.

S3 has no directory rename and no append, so publication is the commit-record protocol
(upload under ``<final>/.v/<uuid>/``, then create ``<final>/.commit`` with
``If-None-Match: *``), log segments are rewritten whole by their single writer, and locks
are leases. Exclusive creates always go through `pipe_file(mode="create")`: s3fs's
``open(p, "xb")`` skips the condition and silently overwrites when it writes zero bytes.

Every request is bounded in total, whatever the endpoint does (`_BoundedS3` over s3fs's
one door to botocore, ``_call_s3``): an endpoint that accepts connections and never answers
costs one ``request_timeout`` (10 s by default) per store operation, not the product of
botocore's attempts, s3fs's own retry loops and the read timeout (which made one operation
take minutes). A request carrying a body gets its upload time on top, at a floor of
64 KiB/s, so a slow link still uploads; a download's body is bounded per socket read
(``read_timeout``), so large transfers are never cut. Inside the bound botocore still
retries what it retries (throttling, 5xx, dropped connections).

Failures are told apart and name the URL: no answer or a transport error is
`StoreUnavailable`, a missing bucket (``NoSuchBucket``) `StoreMissing` - never a
`FileNotFoundError`, which would read as a missing key and make every lookup a silent miss
- and ``AccessDenied`` (any 403) `StoreAccessDenied`, also a `PermissionError`. `probe`
is the one request that checks a store can serve (a one-key listing of its prefix).
"""

from __future__ import annotations

import builtins
import errno
import os
import time
from collections.abc import Mapping
from datetime import datetime
from typing import IO, Any

from . import operations
from ._s3_client import (
    _SESSION_OPTIONS,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
    _bounded_fs_class,
    _shared_session,
    _translated,
)
from .base import Appender, Capabilities, FileInfo, SegmentAppender
from .debris import Seen, Upload
from .digests import Expected
from .errors import MissingDependency, RecordTooLarge, too_many_names
from .keys import validate_key, validate_prefix
from .store import Store


class S3Store(Store):
    """A store under ``s3://bucket/prefix``."""

    def __init__(self, url: str, bucket_and_prefix: str, options: Mapping[str, Any]) -> None:
        try:
            fs_class = _bounded_fs_class()
        except ImportError as exc:  # pragma: no cover - exercised without the extra
            raise MissingDependency(
                "the 's3' scheme needs s3fs: pip install 'vllm-neuron[s3]'"
            ) from exc
        opts = dict(options)
        endpoint = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or (
            os.environ.get("AWS_ENDPOINT_URL")
        )
        connect_timeout = float(opts.pop("connect_timeout", DEFAULT_CONNECT_TIMEOUT))
        read_timeout = float(opts.pop("read_timeout", DEFAULT_READ_TIMEOUT))
        request_timeout = float(opts.pop("request_timeout", DEFAULT_REQUEST_TIMEOUT))
        if not request_timeout > 0:
            raise ValueError(f"open_store: request_timeout must be > 0, got {request_timeout!r}")
        retries = int(opts.pop("retries", 2))
        client_kwargs = dict(opts.pop("client_kwargs", {}))
        if endpoint:
            client_kwargs.setdefault("endpoint_url", endpoint)
        config_kwargs = dict(opts.pop("config_kwargs", {}))
        config_kwargs.setdefault("connect_timeout", connect_timeout)
        config_kwargs.setdefault("read_timeout", read_timeout)
        config_kwargs.setdefault("retries", {"max_attempts": retries, "mode": "standard"})
        if "session" not in opts and not set(opts) & _SESSION_OPTIONS:
            opts["session"] = _shared_session()
        fs = fs_class(
            skip_instance_cache=True,
            use_listings_cache=False,
            client_kwargs=client_kwargs,
            config_kwargs=config_kwargs,
            **opts,
        )
        # s3fs's own retry loops (around each request, and again around each download)
        # only see what botocore gave up on; the request bound caps them with it.
        fs.retries = max(1, retries)
        fs.store_url = url
        fs.request_timeout = request_timeout
        if client_kwargs.get("endpoint_url"):
            fs.endpoint = str(client_kwargs["endpoint_url"])
        super().__init__(url, fs, bucket_and_prefix.strip("/"))
        self.capabilities = Capabilities(
            profile="s3",
            atomic_rename=False,
            kernel_locks=False,
            native_append=False,
            local_paths=False,
            durable=True,  # an acknowledged PUT is stored redundantly
        )

    @_translated
    def probe(self) -> None:
        """One request (a one-key listing of the prefix) that fails unless the store can
        serve: `StoreMissing` for a missing bucket, `StoreAccessDenied` when refused,
        `StoreUnavailable` when the endpoint does not answer within ``request_timeout``."""
        bucket, _, prefix = self.root.partition("/")
        self.fs.call_s3(
            "list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1
        )

    @_translated
    def read(self, key: str, *, max_size: int | None = None) -> bytes | None:
        # One GET: with max_concurrency > 1, s3fs first asks the size (a HEAD, plus a
        # LIST when the key is missing) to split big objects; whole-object reads are small
        # here (records, notes, commit records; artifacts are streamed with open_read).
        # With `max_size` (a record) the GET is ranged to the bound plus one byte, so an
        # object of many GiB costs one small download and a `RecordTooLarge`.
        path = self._path(validate_key(key))
        try:
            if max_size is None:
                return bytes(self.fs.cat_file(path, max_concurrency=1))
            data = self.fs.cat_file(path, start=0, end=max_size + 1, max_concurrency=1)
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as exc:
            if exc.errno != errno.EINVAL or "InvalidRange" not in f"{exc} {exc.__cause__}":
                raise
            return b""  # a range from byte 0 is unsatisfiable only for an empty object
        if len(data) > max_size:
            raise RecordTooLarge(f"{self.url}/{key}", f"is larger than the {max_size} bytes "
                                                      "a record may have; not read")  # fmt: skip
        return bytes(data)

    @_translated
    def write(self, key: str, data: bytes, *, mode: int | None = None) -> None:
        self.fs.pipe_file(self._path(validate_key(key)), bytes(data))

    @_translated
    def create(self, key: str, data: bytes) -> bool:
        path = self._path(validate_key(key))
        for attempt in range(5):
            try:
                self.fs.pipe_file(path, bytes(data), mode="create")
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                # AWS answers a create racing another create with 409
                # ConditionalRequestConflict, which s3fs does not map: retry.
                if "ConditionalRequestConflict" not in str(exc) or attempt == 4:
                    raise
                time.sleep(0.05 * (attempt + 1))
        return False  # pragma: no cover

    @_translated
    def info(self, key: str) -> FileInfo | None:
        try:
            details = self.fs.info(self._path(validate_key(key)))
        except FileNotFoundError:
            return None
        if details.get("type") != "file":
            return None
        modified = details.get("LastModified")
        mtime = modified.timestamp() if isinstance(modified, datetime) else 0.0
        return FileInfo(key, int(details.get("size", 0)), mtime)

    @_translated
    def list(self, prefix: str = "") -> list[str]:
        return super().list(prefix)

    @_translated
    def list_dir(self, prefix: str = "", *,
                 max_names: int | None = None) -> builtins.list[str]:  # fmt: skip
        if max_names is None:
            return super().list_dir(prefix)
        # Bounded: pages of at most the bound plus one name, no page past the bound (s3fs's
        # `ls` would list a folder of millions whole, a request per 1,000 names).
        bucket, _, path = self._path(prefix).partition("/")
        base = path.rstrip("/") + "/" if path else ""
        names: set[str] = set()
        token: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=base,
                                   Delimiter="/", MaxKeys=min(max_names + 1, 1000),
                                   **token)  # fmt: skip
            found = [o["Key"] for o in page.get("Contents", [])]
            found += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            names.update(n for n in (k[len(base):].rstrip("/") for k in found) if n)
            if len(names) > max_names:
                raise too_many_names(self.url, prefix, max_names)
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return sorted(names)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    @_translated
    def delete(self, key: str) -> bool:
        path = self._path(validate_key(key))
        # `exists` is also true for a pseudo-directory (a prefix of other keys), and S3
        # deletes a missing object without complaint: only a file counts as existing.
        try:
            if self.fs.info(path).get("type") != "file":
                return False
        except FileNotFoundError:
            return False
        self.fs.rm_file(path)
        return True

    @_translated
    def delete_tree(self, prefix: str) -> int:
        keys = self.list(validate_key(prefix))
        if keys:
            self.fs.rm([self._path(k) for k in keys])
        return len(keys)

    @_translated
    def put_file(self, key: str, local_path: str) -> None:
        self.fs.put_file(local_path, self._path(validate_key(key)))

    @_translated
    def open_read(self, key: str) -> IO[bytes]:
        return self.fs.open(self._path(validate_key(key)), "rb")

    def open_appender(self, key: str, *, truncate: bool) -> Appender:
        return SegmentAppender(self, validate_key(key), truncate)

    @_translated
    def check_sizes(self, prefix: str, files: Mapping[str, Expected]) -> None:
        """One listing of `prefix` (a request per 1,000 files) instead of one HEAD per file."""
        if len(files) <= 1:
            operations.check_sizes(self, prefix, files)
            return
        prefix = validate_prefix(prefix)
        base = self._path(prefix)
        try:
            found = self.fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            found = {}
        sizes = {}
        for path, details in found.items():
            if details.get("type", "file") == "file" and str(path).startswith(base + "/"):
                sizes[str(path)[len(base) + 1:]] = int(details.get("size", 0))
        operations.compare_sizes(self, prefix, files, sizes)

    @_translated
    def _walk(self, prefix: str = "") -> builtins.list[Seen]:
        """One paginated listing (a request per 1,000 keys), sizes and times included."""
        base = self._path(prefix)
        try:
            found = self.fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for path, details in found.items():
            rel = self._rel(path)
            if not rel or details.get("type", "file") != "file" or rel == prefix.strip("/"):
                continue
            modified = details.get("LastModified")
            mtime = modified.timestamp() if isinstance(modified, datetime) else 0.0
            out.append(Seen(rel, int(details.get("size", 0)), mtime))
        return out

    @_translated
    def _unfinished_uploads(self) -> builtins.list[Upload]:
        """The multipart uploads under the prefix (a request per 1,000); each one's time is
        its initiation or, when later, its newest part's (a request per upload listed), so
        a long upload still sending parts is active."""
        bucket, _, prefix = self.root.partition("/")
        ask: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{prefix}/" if prefix else ""}
        out = []
        while True:
            page = self.fs.call_s3("list_multipart_uploads", **ask)
            for upload in page.get("Uploads", []):
                key, upload_id = str(upload["Key"]), str(upload["UploadId"])
                started = upload.get("Initiated")
                active = started.timestamp() if isinstance(started, datetime) else 0.0
                try:
                    parts = self.fs.call_s3("list_parts", Bucket=bucket, Key=key,
                                            UploadId=upload_id)  # fmt: skip
                except FileNotFoundError:  # completed or aborted meanwhile
                    continue
                for part in parts.get("Parts", []):
                    modified = part.get("LastModified")
                    if isinstance(modified, datetime):
                        active = max(active, modified.timestamp())
                out.append(Upload(key[len(prefix) + 1:] if prefix else key, upload_id, active))
            if not page.get("IsTruncated"):
                return out
            ask["KeyMarker"] = page.get("NextKeyMarker", "")
            ask["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    @_translated
    def _abort_upload(self, key: str, upload_id: str) -> bool:
        """Abort an unfinished multipart upload; False when it is gone already."""
        bucket, _, path = self._path(validate_key(key)).partition("/")
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=path, UploadId=upload_id)
        except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile
            return False
        return True


def probe(store: Store) -> None:
    """The S3 scheme's probe (`router.probe_store`): `S3Store.probe`."""
    if not isinstance(store, S3Store):
        raise TypeError(f"{store!r} is not an S3 store")
    store.probe()
