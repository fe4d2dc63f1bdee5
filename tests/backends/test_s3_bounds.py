"""S3 stores fail fast and say why: an endpoint that never answers, a missing bucket, a refusal.

What a new user met: an endpoint that accepted connections and never answered cost one
lookup minutes (botocore's attempts times s3fs's retry loops times the read timeout), and
``s3://nosuchbucket/c`` read as an empty cache (``NoSuchBucket`` taken for "no such
key"). Every request is now bounded in total (``request_timeout``), a missing bucket is
`StoreMissing` and a refusal `StoreAccessDenied`, each naming the URL and S3's own error.

The silent endpoint is a real socket (tests/blackhole.py); the missing bucket and the
refusals are moto's real S3 API (tests/conftest.py), refusals through moto's IAM
simulation with a user whose policy allows reading only. Bounds are asserted generously
(a loaded machine makes the suite slower, never red) and each failure is checked to have
reached the endpoint, so a fast unrelated error cannot pass for the bound.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from blackhole import BlackHole  # tests/blackhole.py

from vllm_neuron.backends import (
    Store,
    StoreAccessDenied,
    StoreMissing,
    StoreUnavailable,
    open_store,
    probe_store,
)
from vllm_neuron.backends.digests import FileDigest
from vllm_neuron.backends.errors import RecordTooLarge
from vllm_neuron.backends.records import RECORD_MAX_BYTES

BOUND = 40.0
"""Seconds: what the default 10 s request bound must stay under, with room for a loaded
machine (it was 378 s before)."""


@pytest.fixture
def black_hole(s3_server: str) -> Iterator[BlackHole]:  # s3_server: test credentials
    with BlackHole() as hole:
        yield hole


def _operations(store: Store, tmp_path: Path) -> dict[str, Callable[[], Any]]:
    upload = tmp_path / "upload.bin"
    upload.write_bytes(b"u" * 1024)
    return {
        "probe": lambda: probe_store(store),
        "read": lambda: store.read("k"),
        "write": lambda: store.write("k", b"v"),
        "create": lambda: store.create("c", b"v"),
        "info": lambda: store.info("k"),
        "exists": lambda: store.exists("k"),
        "list": lambda: store.list(""),
        "list_dir": lambda: store.list_dir(""),
        "delete": lambda: store.delete("k"),
        "delete_tree": lambda: store.delete_tree("t"),
        "put_file": lambda: store.put_file("f", str(upload)),
        "open_read": lambda: store.open_read("k").read(),
        "published": lambda: store.published("entry"),
        "published_children": lambda: store.published_children(""),
        "check_sizes": lambda: store.check_sizes(
            "entry", {"a": FileDigest(1, "0" * 64), "b": FileDigest(1, "0" * 64)}
        ),
    }


def test_a_silent_endpoint_costs_one_bounded_request_with_the_defaults(
    black_hole: BlackHole,
) -> None:
    url = f"s3://bucket-{uuid.uuid4().hex[:8]}/cache"
    store = open_store(url, endpoint_url=black_hole.url)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        store.read("entry/entry.json")
    elapsed = time.monotonic() - start
    assert elapsed < BOUND, elapsed
    message = str(info.value)
    assert url in message and black_hole.url in message and "no answer" in message
    assert not isinstance(info.value, FileNotFoundError)  # never a silent miss
    assert black_hole.connections() >= 1  # the request did reach the endpoint


def test_every_store_operation_is_bounded(black_hole: BlackHole, tmp_path: Path) -> None:
    url = f"s3://bucket-{uuid.uuid4().hex[:8]}/cache"
    store = open_store(url, endpoint_url=black_hole.url, request_timeout=1)
    for name, operation in _operations(store, tmp_path).items():
        before = black_hole.connections()
        start = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            operation()
        elapsed = time.monotonic() - start
        assert elapsed < BOUND / 2, (name, elapsed)
        assert url in str(info.value), (name, info.value)
        assert black_hole.connections() > before, name


# ------------------------------------------------------------------ a slow, healthy endpoint


class _Dripping(BaseHTTPRequestHandler):
    """Answers every object request at once, then sends the body a chunk at a time."""

    body = bytes(range(256)) * 64  # 16 KiB
    chunks = 8
    pause = 0.25  # seconds between chunks: 2 s in all, twice the request bound below

    def _headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("Content-Type", "binary/octet-stream")
        self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
        self.send_header("Last-Modified", formatdate(usegmt=True))
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self._headers()

    def do_GET(self) -> None:  # noqa: N802
        self._headers()
        step = len(self.body) // self.chunks
        for i in range(self.chunks):
            self.wfile.write(self.body[i * step : (i + 1) * step])
            self.wfile.flush()
            time.sleep(self.pause)  # the server's pace, not a test waiting

    def log_message(self, *args: Any) -> None:
        pass


def test_a_download_longer_than_the_request_bound_is_not_cut(s3_server: str) -> None:
    """The bound ends when the response headers arrive; the body is bounded per socket read
    (``read_timeout``), so a large transfer from a healthy endpoint always completes."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dripping)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        store = open_store("s3://bucket/cache", endpoint_url=endpoint, request_timeout=1,
                           read_timeout=10)  # fmt: skip
        start = time.monotonic()
        assert store.read("big") == _Dripping.body
        assert time.monotonic() - start > 1  # it did outlast the request bound
    finally:
        server.shutdown()
        server.server_close()


def test_a_large_round_trip_with_a_short_request_bound(s3_server: str, s3_store_url: str) -> None:
    # A body's upload time is added to its request's bound (64 KiB/s floor).
    store = open_store(s3_store_url, endpoint_url=s3_server, request_timeout=1)
    data = uuid.uuid4().bytes * (1 << 19)  # 8 MiB
    store.write("big", data)
    assert store.read("big") == data


# ------------------------------------------------------------------ a missing bucket


def test_a_missing_bucket_is_store_missing_from_every_operation(
    s3_server: str, tmp_path: Path
) -> None:
    bucket = f"nosuchbucket-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}/c"
    store = open_store(url, endpoint_url=s3_server)
    for name, operation in _operations(store, tmp_path).items():
        if name in ("delete", "exists", "info", "published"):
            continue  # HEAD-only paths: S3 answers a bare 404 (see below)
        with pytest.raises(StoreMissing) as info:
            operation()
        message = str(info.value)
        assert url in message and "NoSuchBucket" in message and bucket in message, name
        assert not isinstance(info.value, FileNotFoundError), name


def test_head_requests_cannot_tell_a_missing_bucket_so_the_probe_does(s3_server: str) -> None:
    # A HEAD of a key in a missing bucket is a bare 404, like a missing key: callers that
    # must not mistake one for the other probe first (the remote tier, the CLI).
    url = f"s3://nosuchbucket-{uuid.uuid4().hex[:8]}/c"
    store = open_store(url, endpoint_url=s3_server)
    with pytest.raises(StoreMissing, match="NoSuchBucket"):
        probe_store(store)


def test_the_probe_of_a_healthy_store_is_quiet(s3_server: str, s3_store_url: str) -> None:
    probe_store(open_store(s3_store_url, endpoint_url=s3_server))  # empty prefix: fine


# ------------------------------------------------------------------ refusals


def _iam_user(endpoint: str, bucket: str, actions: list[str]) -> dict[str, str]:
    """A moto IAM user allowed ``actions`` on ``bucket`` and its objects: its credentials."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint)
    name = f"user-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=name)
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": actions,
        "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}  # fmt: skip
    if actions:
        iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


def test_a_read_only_user_reads_and_is_refused_writes(
    s3_server: str, s3_admin: Any, s3_bucket: str, tmp_path: Path
) -> None:
    s3_admin.put_object(Bucket=s3_bucket, Key="c/x", Body=b"hello")
    reader = _iam_user(s3_server, s3_bucket, ["s3:GetObject", "s3:ListBucket"])
    url = f"s3://{s3_bucket}/c"
    from moto.core.authorization import enable_iam_authentication

    with enable_iam_authentication():
        store = open_store(url, endpoint_url=s3_server, **reader)
        probe_store(store)  # reading is allowed: the probe cannot tell a read-only user
        assert store.read("x") == b"hello"
        assert store.read("absent") is None
        for write in (lambda: store.write("y", b"1"), lambda: store.create("z", b"1"),
                      lambda: store.put_file("f", __file__)):  # fmt: skip
            with pytest.raises(StoreAccessDenied) as info:
                write()
            assert isinstance(info.value, PermissionError)  # what a caller catches
            assert url in str(info.value) and "AccessDenied" in str(info.value)


def test_a_user_who_may_not_list_is_refused_by_the_probe(
    s3_server: str, s3_bucket: str
) -> None:
    nobody = _iam_user(s3_server, s3_bucket, [])
    url = f"s3://{s3_bucket}/c"
    from moto.core.authorization import enable_iam_authentication

    with enable_iam_authentication():
        store = open_store(url, endpoint_url=s3_server, **nobody)
        with pytest.raises(StoreAccessDenied) as info:
            probe_store(store)
        assert url in str(info.value) and "AccessDenied" in str(info.value)
        with pytest.raises(StoreAccessDenied):
            store.list("")


def test_a_record_read_never_downloads_an_oversize_object_whole(
        s3_server: str, s3_store_url: str) -> None:  # fmt: skip
    """A record read is one GET ranged to the bound plus one byte: an 8 MiB object (it could
    be many GiB) costs that much download and a `RecordTooLarge`; an empty object (a range
    S3 cannot satisfy) reads as empty, never as an outage."""
    store = open_store(s3_store_url, endpoint_url=s3_server)
    store.write("r/huge", b"x" * (8 << 20))
    store.write("r/empty", b"")
    asked: list[dict[str, Any]] = []
    real_call = store.fs._call_s3

    async def spying(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object":
            asked.append(kwargs)
        return await real_call(method, *args, **kwargs)

    store.fs._call_s3 = spying
    with pytest.raises(RecordTooLarge):
        store.read("r/huge", max_size=RECORD_MAX_BYTES)
    assert [a.get("Range") for a in asked] == [f"bytes=0-{RECORD_MAX_BYTES}"], asked
    assert store.read("r/empty", max_size=RECORD_MAX_BYTES) == b""
    assert store.read("r/none", max_size=RECORD_MAX_BYTES) is None
