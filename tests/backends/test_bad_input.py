"""Bad input gets a clear error (naming what was wrong) or a counted skip, never a hang."""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron.backends import (
    InvalidKey,
    MissingDependency,
    Record,
    RecordCodec,
    StoreUnavailable,
    UnknownScheme,
    open_store,
    register_upcaster,
    validate_hex,
    validate_key,
)
from vllm_neuron.backends import mounts as mounts_module
from vllm_neuron.backends.mounts import parse_mounts, profile_for


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ keys


@pytest.mark.parametrize(
    "key",
    ["../x", "a/../../x", "..", "/etc/passwd", "a//b", "", "a\x00b", "a/", "./a", "a\\..\\b",
     "file:///etc/passwd"],
    ids=repr,
)
def test_traversal_and_malformed_keys_are_refused(key: str) -> None:
    with pytest.raises(InvalidKey) as info:
        validate_key(key)
    assert isinstance(info.value, ValueError)
    assert repr(key) in str(info.value) or key == ""


@pytest.mark.parametrize("key", ["a", "a/b/c", "a..b", ".hidden/x", "x-1_2.tar.gz"])
def test_ordinary_keys_pass(key: str) -> None:
    assert validate_key(key) == key


def test_non_string_key_is_refused() -> None:
    with pytest.raises(InvalidKey, match="must be a str"):
        validate_key(b"bytes")  # type: ignore[arg-type]


def test_traversal_never_touches_the_filesystem_outside_the_root(tmp_path: Path) -> None:
    store = open_store(tmp_path / "root")
    for key in ("../outside", "../../outside", "a/../../outside", "/tmp/outside-abs"):
        with pytest.raises(InvalidKey):
            store.write(key, b"x")
        with pytest.raises(InvalidKey):
            store.create(key, b"x")
        with pytest.raises(InvalidKey):
            store.delete_tree(key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    assert not os.path.exists("/tmp/outside-abs")


@pytest.mark.parametrize(
    ("value", "length", "ok"),
    [("0123abcdef", None, True), ("ABCDEF", None, False), ("abc", 4, False), ("", None, False),
     ("../aa", None, False), ("ab12", 4, True)],
)
def test_validate_hex(value: str, length: int | None, ok: bool) -> None:
    if ok:
        assert validate_hex(value, length=length) == value
    else:
        with pytest.raises(InvalidKey, match="hex"):
            validate_hex(value, length=length, what="cache key")


# ------------------------------------------------------------- open_store


@pytest.mark.parametrize("url", ["gs://bucket/x", "foo://bar", "http://example.com/x", "hdfs://n/p"])
def test_unknown_scheme_names_the_scheme(url: str) -> None:
    scheme = url.split("://")[0]
    with pytest.raises(UnknownScheme) as info:
        open_store(url)
    assert f"'{scheme}'" in str(info.value)
    assert url in str(info.value)
    assert "s3" in str(info.value)  # and says what is supported


def test_missing_optional_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "s3fs" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(MissingDependency, match=r"pip install 'vllm-neuron\[s3\]'"):
        open_store("s3://bucket/prefix")


@pytest.mark.parametrize(
    ("url", "options", "named"),
    [
        ("memory://", {"profile": "nfs"}, ["profile"]),
        ("LOCAL", {"bogus": 1, "also_bogus": 2}, ["also_bogus", "bogus"]),
        ("LOCAL", {"endpoint_url": "http://x"}, ["endpoint_url"]),
        ("s3://bucket/p", {"bogus_option": 1}, ["bogus_option"]),
        ("s3://bucket/p", {"storage_options": {"endpoint": "http://x"}}, ["endpoint"]),
        ("s3://bucket/p", {"skip_instance_cache": False}, ["skip_instance_cache"]),
    ],
)
def test_unknown_options_are_a_type_error_naming_them(
    tmp_path: Path, url: str, options: dict[str, Any], named: list[str]
) -> None:
    url = str(tmp_path) if url == "LOCAL" else url
    with pytest.raises(TypeError) as info:
        open_store(url, **options)
    for name in named:
        assert name in str(info.value)


def test_known_s3_options_are_accepted() -> None:
    store = open_store(
        "s3://bucket/p",
        endpoint_url="http://127.0.0.1:1",
        key="k",
        secret="s",
        connect_timeout=1,
        retries=1,
        storage_options={"anon": False, "requester_pays": False},
    )
    assert store.capabilities.profile == "s3"


def test_s3_stores_share_one_session_unless_given_their_own() -> None:
    first = open_store("s3://bucket/a", endpoint_url="http://127.0.0.1:1")
    second = open_store("s3://bucket/b", endpoint_url="http://127.0.0.1:1")
    assert first.fs.session is not None and first.fs.session is second.fs.session
    # s3fs hands `profile` to the session it creates: such a store gets its own.
    with_profile = open_store("s3://bucket/c", endpoint_url="http://127.0.0.1:1", profile="x")
    assert with_profile.fs.session is not first.fs.session


@pytest.mark.parametrize(
    ("options", "match"),
    [({"profile": "zfs"}, "'zfs'"), ({"lock": "maybe"}, "'maybe'")],
)
def test_bad_local_option_values_name_the_value(
    tmp_path: Path, options: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        open_store(tmp_path, **options)


@pytest.mark.parametrize("url", ["", "s3://", "s3:///", "/tmp/a\x00b"], ids=repr)
def test_malformed_urls(url: str) -> None:
    with pytest.raises(ValueError):
        open_store(url)


def test_file_url_and_plain_path_are_the_same_store(tmp_path: Path) -> None:
    by_url = open_store(f"file://{tmp_path}/s")
    by_path = open_store(tmp_path / "s")
    by_url.write("k", b"v")
    assert by_path.read("k") == b"v"
    assert by_url.local_path("k") == str(tmp_path / "s" / "k")


# ------------------------------------------------------ unreachable S3


@pytest.mark.timeout(60)
def test_unreachable_s3_endpoint_is_store_unavailable_quickly(s3_server: str) -> None:
    # s3_server only supplies test credentials; nothing listens on this port.
    endpoint = f"http://127.0.0.1:{closed_port()}"
    store = open_store("s3://bucket/prefix", endpoint_url=endpoint)
    operations = {
        "read": lambda: store.read("k"),
        "write": lambda: store.write("k", b"v"),
        "list": lambda: store.list(""),
    }
    for name, operation in operations.items():
        start = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            operation()
        elapsed = time.monotonic() - start
        assert elapsed < 20, f"{name} took {elapsed:.1f} s to fail"
        assert "s3://bucket/prefix" in str(info.value)
        assert isinstance(info.value, OSError)


@pytest.mark.timeout(90)
def test_s3_endpoint_that_never_answers_is_bounded_by_read_timeout(s3_server: str) -> None:
    # A socket that accepts connections (the kernel completes the handshake from the
    # backlog) but never answers: only the read timeout can end the wait.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        store = open_store("s3://bucket/prefix", endpoint_url=endpoint, read_timeout=1, retries=1)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="s3://bucket/prefix"):
            store.read("k")
        assert time.monotonic() - start < 20


# --------------------------------------------------------- event records


class Shape(Record, tag="shape", frozen=True):
    key: str
    rank: int
    shape: tuple[int, ...] = ()


class Renamed(Record, tag="renamed", frozen=True, kw_only=True):
    v: int = 2
    name: str


@register_upcaster("renamed", 1)
def _renamed_v1(raw: dict[str, Any]) -> dict[str, Any]:
    raw["name"] = raw.pop("old_name")
    return raw


def test_undecodable_lines_are_skipped_and_counted() -> None:
    codec = RecordCodec([Shape, Renamed])
    blob = b"\n".join(
        [
            b'{"type":"shape","v":1,"key":"a","rank":0,"shape":[1,2]}',
            b'{"type":"shape","v":1,"key":"torn","ra',  # torn JSON
            b"\xff\xfe\xfd\x00\x01",  # garbage bytes
            b'{"type":"shape","v":1,"key":"b","rank":"zero"}',  # wrong field type
            b'{"type":"shape","v":1,"rank":0}',  # missing field
            b'{"type":"nobody-knows","v":1}',  # unknown tag
            b'"just a string"',  # not a record
            b"",
            b'{"type":"renamed","v":1,"old_name":"upcast me"}',  # old version: upcast
            b'{"type":"renamed","v":2,"name":"current"}',
            b'{"type":"shape","v":1,"key":"c","rank":3}',
        ]
    )
    decoded = codec.decode_lines(blob)
    assert decoded.records == [
        Shape(key="a", rank=0, shape=(1, 2)),
        Renamed(name="upcast me"),
        Renamed(name="current"),
        Shape(key="c", rank=3),
    ]
    assert decoded.skipped == 6
    assert len(decoded.errors) == 6
    assert any("rank" in e for e in decoded.errors)  # errors say what was wrong
    # Line iterables decode the same way as blobs.
    assert codec.decode_lines(blob.split(b"\n")).skipped == 6


def test_a_clean_stream_decodes_completely() -> None:
    codec = RecordCodec([Shape])
    records = [Shape(key=f"k{i}", rank=i, shape=(i,)) for i in range(50)]
    from vllm_neuron.backends import encode_line

    decoded = codec.decode_lines(b"".join(encode_line(r) for r in records))
    assert (decoded.records, decoded.skipped) == (records, 0)


def test_error_list_is_capped_but_the_count_is_not() -> None:
    decoded = RecordCodec([Shape]).decode_lines(b"garbage\n" * 500)
    assert decoded.skipped == 500
    assert len(decoded.errors) == 20


def test_event_log_survives_a_segment_of_pure_garbage() -> None:
    store = open_store("memory://")
    log = store.log("s", writer="good")
    log.append(Shape(key="k", rank=1))
    store.write("s/bad.jsonl", os.urandom(4096).replace(b"\n", b"\x00"))
    decoded = log.read([Shape])
    assert decoded.records == [Shape(key="k", rank=1)]
    assert decoded.skipped == 1


# ------------------------------------------------------------ /proc/mounts

MOUNTS = r"""/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid 0 0
fs-1.fsx.us-east-1.amazonaws.com@tcp:/abc /fsx lustre rw,flock,lazystatfs 0 0
fs-2.fsx.us-east-1.amazonaws.com@tcp:/def /fsx-local lustre rw,localflock 0 0
fs-3@tcp:/ghi /fsx-none lustre rw,lazystatfs 0 0
10.0.0.1:/export /mnt/nfs nfs4 rw,vers=4.1,hard 0 0
tmpfs /mnt/nfs/scratch tmpfs rw 0 0
server:/e /mnt/with\040space\011tab nfs rw,vers=3 0 0
server:/b /mnt/back\134slash nfs4 rw 0 0
garbage line
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/fsx/cache/x", ("lustre", True)),  # flock: cluster-wide kernel locks
        ("/fsx", ("lustre", True)),
        ("/fsx-local/cache", ("lustre", False)),  # localflock is node-local only
        ("/fsx-none/cache", ("lustre", False)),
        ("/mnt/nfs/cache", ("nfs", False)),
        ("/mnt/nfs/scratch/x", ("local", True)),  # a local mount inside the NFS one
        ("/mnt/nfsother/x", ("local", True)),  # a prefix, not a parent directory
        ("/mnt/with space\ttab/cache", ("nfs", False)),  # octal-escaped mount point
        ("/mnt/back\\slash/x", ("nfs", False)),
        ("/home/user", ("local", True)),
    ],
)
def test_profile_from_proc_mounts(path: str, expected: tuple[str, bool]) -> None:
    assert profile_for(path, MOUNTS) == expected


def test_parse_mounts_unescapes_and_skips_garbage() -> None:
    mounts = parse_mounts(MOUNTS)
    points = [m.point for m in mounts]
    assert "/mnt/with space\ttab" in points and "/mnt/back\\slash" in points
    assert len(mounts) == 9
    fsx = next(m for m in mounts if m.point == "/fsx")
    assert fsx.fstype == "lustre" and "flock" in fsx.options


def test_no_mount_table_means_local() -> None:
    assert profile_for("/anything", "") == ("local", True)


def test_a_later_mount_on_the_same_point_wins() -> None:
    text = "a /data ext4 rw 0 0\nb:/x /data nfs4 rw 0 0\n"
    assert profile_for("/data/x", text) == ("nfs", False)


@pytest.mark.parametrize(
    ("fstype", "options", "profile", "kernel_locks"),
    [("nfs4", "rw", "nfs", False), ("lustre", "rw,flock", "lustre", True),
     ("lustre", "rw,localflock", "lustre", False), ("xfs", "rw", "local", True)],
)
def test_open_store_picks_the_profile_from_the_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    fstype: str, options: str, profile: str, kernel_locks: bool,
) -> None:
    mount_point = os.path.realpath(tmp_path)
    fake = f"/dev/vda / ext4 rw 0 0\nsrv:/x {mount_point} {fstype} {options} 0 0\n"
    monkeypatch.setattr(mounts_module, "_read_mounts", lambda: fake)
    store = open_store(tmp_path / "not" / "yet" / "created")
    assert store.capabilities.profile == profile
    assert store.capabilities.kernel_locks is kernel_locks
    # An explicit option overrides the mount.
    forced = open_store(tmp_path / "forced", profile="local")
    assert forced.capabilities.kernel_locks is True
    assert open_store(tmp_path / "lease", lock="lease").capabilities.kernel_locks is False


def test_profile_follows_a_symlink_into_the_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    fake = f"/dev/vda / ext4 rw 0 0\nsrv:/x {os.path.realpath(real)} nfs4 rw 0 0\n"
    monkeypatch.setattr(mounts_module, "_read_mounts", lambda: fake)
    assert open_store(tmp_path / "link" / "store").capabilities.profile == "nfs"
