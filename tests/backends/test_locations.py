"""`check_location`: a location `open_store` would refuse is refused before anything opens.

Why: ``s3:/bucket/cache`` (one slash) is a legal relative path, and opened as one it made
a local folder ``./s3:/bucket/cache`` that every node "shared" alone, while the user was
told the entries were promoted. A registered scheme's name followed by ``:`` without
``//`` is a mangled URL, refused with the URL probably meant; an unregistered
``scheme://`` stays `UnknownScheme`; and `probe_store` says whether an opened store can
serve (here: local and memory stores; S3 in test_s3_bounds.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron.backends import (
    InvalidLocation,
    StoreAccessDenied,
    StoreError,
    StoreMissing,
    StoreUnavailable,
    UnknownScheme,
    check_location,
    check_remote_location,
    local_path_of,
    local_root_missing,
    normalize_location,
    open_store,
    probe_store,
    register_scheme,
    registered_schemes,
    unregister_scheme,
)
from vllm_neuron.backends._memory import MemoryStore

MANGLED = [
    ("s3:/bucket/cache", "s3://bucket/cache"),
    ("s3:bucket", "s3://bucket"),
    ("S3:/bucket/x", "s3://bucket/x"),
    ("s3:\\bucket\\x", "s3://bucket/x"),
    ("s3:", "s3://..."),
    ("file:/srv/cache", "file:///srv/cache"),
    ("memory:name", "memory://name"),
    ("s3//bucket/x", "s3://bucket/x"),  # the colon missing: was ./s3/bucket/x
    ("S3//bucket", "s3://bucket"),
    ("file//srv/x", "file:///srv/x"),
]


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty current directory: what a refused location must leave empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.mark.parametrize("location,meant", MANGLED)
def test_a_mangled_url_is_refused_with_the_url_meant(location: str, meant: str) -> None:
    with pytest.raises(InvalidLocation) as info:
        check_location(location)
    message = str(info.value)
    assert repr(location) in message
    assert f"did you mean {meant}?" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, StoreError)


@pytest.mark.parametrize("location,meant", MANGLED)
def test_no_helper_reads_a_mangled_url_as_a_directory(
    elsewhere: Path, location: str, meant: str
) -> None:
    for helper in (open_store, normalize_location, local_path_of, local_root_missing):
        with pytest.raises(InvalidLocation, match=re.escape(meant)):
            helper(location)
    with pytest.raises(InvalidLocation):
        open_store(location, create=True)
    assert os.listdir(elsewhere) == []  # no ./s3: folder


@pytest.mark.parametrize(
    "location",
    ["/abs/dir", "rel/dir", "./s3:/bucket", "dir/s3:/x", "C:/x", "bogus:x", "file:///abs",
     "s3://bucket", "s3://bucket/prefix", "memory://m", "memory://"],
)  # fmt: skip
def test_paths_and_well_formed_urls_are_accepted_as_given(location: str) -> None:
    assert check_location(location) == location


def test_an_unregistered_scheme_stays_unknown_scheme_listing_the_known_ones() -> None:
    with pytest.raises(UnknownScheme) as info:
        check_location("bogus://x")
    assert "'bogus'" in str(info.value) and "s3" in str(info.value)
    assert not isinstance(info.value, InvalidLocation)
    # normalize_location leaves it to check_location/open_store, as it always did.
    assert normalize_location("bogus://x") == "bogus://x"


@pytest.mark.parametrize(
    "url,meant", [("s3://", "s3://bucket/prefix"), ("s3:///bucket/x", "s3://bucket/x")]
)
def test_an_s3_url_without_a_bucket_is_refused_before_any_backend_loads(
    url: str, meant: str
) -> None:
    with pytest.raises(InvalidLocation, match=re.escape(f"did you mean {meant}?")):
        check_location(url)
    with pytest.raises(InvalidLocation):
        open_store(url)


def test_empty_and_nul_are_value_errors() -> None:
    for location in ("", "a\x00b"):
        with pytest.raises(ValueError):
            check_location(location)


@pytest.fixture
def scheme_name() -> Iterator[str]:
    name = f"toy{uuid.uuid4().hex[:8]}"
    yield name
    if name in registered_schemes():
        unregister_scheme(name)


def test_what_is_mangled_follows_the_registry(scheme_name: str, elsewhere: Path) -> None:
    location = f"{scheme_name}:/x"
    assert check_location(location) == location  # unregistered: a directory name
    checked: list[tuple[str, str]] = []

    def check(url: str, rest: str) -> None:
        checked.append((url, rest))
        if not rest:
            raise InvalidLocation(f"{url} needs a name")

    register_scheme(scheme_name, lambda *a, **k: open_store("memory://"), check=check)
    with pytest.raises(InvalidLocation, match=re.escape(f"did you mean {scheme_name}://x?")):
        check_location(location)
    # The scheme's own check runs in check_location and in open_store, before the opener.
    with pytest.raises(InvalidLocation, match="needs a name"):
        open_store(f"{scheme_name}://")
    open_store(f"{scheme_name}://n")
    assert checked == [(f"{scheme_name}://", ""), (f"{scheme_name}://n", "n")]
    unregister_scheme(scheme_name)
    assert check_location(location) == location
    assert os.listdir(elsewhere) == []


# ------------------------------------------------------------------ probe_store


def test_a_local_reader_probe_tells_a_missing_root_from_an_empty_one(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    probe_store(open_store(str(empty), create=False))  # empty is fine
    missing = str(tmp_path / "missing")
    store = open_store(missing, create=False)
    with pytest.raises(StoreMissing) as info:
        probe_store(store)
    assert missing in str(info.value)
    assert not isinstance(info.value, FileNotFoundError)  # never read as "no such key"
    assert isinstance(info.value, StoreUnavailable)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StoreMissing):
        probe_store(open_store(str(tmp_path / "file"), create=False))


_PROBE_LOCKED = """
import sys
from vllm_neuron.backends import StoreAccessDenied, open_store, probe_store
try:
    probe_store(open_store(sys.argv[1], create=False))
except StoreAccessDenied as exc:
    assert isinstance(exc, PermissionError) and sys.argv[1] in str(exc), exc
    print("denied")
"""


def test_a_local_root_that_cannot_be_read_is_access_denied(tmp_path: Path) -> None:
    """Root reads any directory, so as root (CI) the probe runs in a process without the
    capabilities that bypass permissions (util-linux ``setpriv``), where mode 0 refuses."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        if os.geteuid() != 0:
            with pytest.raises(StoreAccessDenied) as info:
                probe_store(open_store(str(locked), create=False))
            assert isinstance(info.value, PermissionError) and str(locked) in str(info.value)
            return
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is needed to drop root's DAC override"
        caps = "-dac_override,-dac_read_search"
        done = subprocess.run(
            [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", sys.executable, "-c",
             _PROBE_LOCKED, str(locked)],
            capture_output=True, text=True, timeout=120, check=False)
        assert (done.returncode, done.stdout.strip()) == (0, "denied"), done.stderr
    finally:
        locked.chmod(0o700)


def test_memory_has_nothing_to_probe() -> None:
    probe_store(open_store("memory://never-named"))


def test_a_scheme_registers_its_probe_by_name(scheme_name: str) -> None:
    asked: list[Any] = []

    def opener(url: str, location: str, options: dict[str, Any], *, create: bool) -> Any:
        return MemoryStore(url, location)

    register_scheme(scheme_name, opener, probe=lambda store: asked.append(store.url))
    probe_store(open_store(f"{scheme_name}://a"))
    assert asked == [f"{scheme_name}://a"]
    with pytest.raises(ValueError, match="module:function"):
        register_scheme(f"{scheme_name}x", opener, probe="not a reference")


@pytest.mark.parametrize("location", ["rel/dir", "s3/bucket/x", "./cache", "file://rel/x", "."])
def test_a_remote_must_be_absolute_or_a_url(location: str) -> None:
    with pytest.raises(InvalidLocation) as info:
        check_remote_location(location, f"--to {location}")
    assert str(info.value).startswith(f"--to {location}: {location!r} is a relative path")


@pytest.mark.parametrize("location,meant", MANGLED)
def test_a_mangled_remote_names_the_option_and_the_url_meant(location: str, meant: str) -> None:
    with pytest.raises(InvalidLocation) as info:
        check_remote_location(location, f"--from {location}")
    assert str(info.value).startswith(f"--from {location}: ")
    assert f"did you mean {meant}?" in str(info.value)


@pytest.mark.parametrize("location", ["/mnt/fsx/cache", "~/cache", "file:///srv/x",
                                      "s3://bucket/p", "memory://m"])  # fmt: skip
def test_absolute_paths_and_urls_are_remotes(location: str) -> None:
    assert check_remote_location(location, "--to") == location
