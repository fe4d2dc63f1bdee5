"""The scheme registry behind `open_store`, the one meaning of ``create``, and the location
helpers (`is_url`, `local_path_of`, `normalize_location`) callers use instead of sniffing.

Why these matter: a caller that sniffs ``"://"`` and disagrees with `open_store` about what
a location is ends up creating a directory named ``gs:`` or treating ``file://`` as remote;
and a read-only caller that may not pass ``create=False`` to every scheme has to sniff.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_neuron.backends import (
    InvalidLocation,
    MissingDependency,
    Store,
    StoreMissing,
    UnknownScheme,
    is_url,
    local_path_of,
    local_root_missing,
    normalize_location,
    open_store,
    register_scheme,
    registered_schemes,
    unregister_scheme,
)

# ------------------------------------------------------------------ the registry


class Calls:
    """What a test opener was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any], bool]] = []

    def opener(self, url: str, location: str, options: dict[str, Any], *, create: bool) -> Store:
        self.calls.append((url, location, dict(options), create))
        return open_store("memory://")


@pytest.fixture
def scheme_name() -> Iterator[str]:
    """A fresh scheme name, unregistered after the test whatever it registered."""
    name = f"toy{uuid.uuid4().hex[:8]}"
    yield name
    if name in registered_schemes():
        unregister_scheme(name)


def test_the_built_in_schemes_are_registered() -> None:
    assert {"file", "s3", "memory"} <= set(registered_schemes())


def test_a_registered_scheme_opens_through_open_store(scheme_name: str) -> None:
    calls = Calls()
    register_scheme(scheme_name, calls.opener, options={"flavour"})
    store = open_store(f"{scheme_name}://bucket/a/b", flavour="mint")
    assert store.capabilities.profile == "memory"
    assert calls.calls == [(f"{scheme_name}://bucket/a/b", "bucket/a/b", {"flavour": "mint"}, True)]
    # Scheme names are case-insensitive, as RFC 3986 says; `create` always reaches the opener.
    open_store(f"{scheme_name.upper()}://x", create=False)
    assert calls.calls[-1][1:] == ("x", {}, False)


def test_a_registered_scheme_keeps_the_option_errors(scheme_name: str) -> None:
    calls = Calls()
    register_scheme(scheme_name, calls.opener, options={"flavour"})
    with pytest.raises(TypeError, match=r"colour.*accepted: create, flavour"):
        open_store(f"{scheme_name}://x", colour="red")
    with pytest.raises(TypeError, match="create must be True or False"):
        open_store(f"{scheme_name}://x", create="no")
    assert calls.calls == []


def test_registration_is_listed_in_unknown_scheme_errors_until_unregistered(
    scheme_name: str,
) -> None:
    register_scheme(scheme_name, Calls().opener, label=f"{scheme_name} (a toy)")
    with pytest.raises(UnknownScheme, match=rf"supported: .*{scheme_name} \(a toy\)"):
        open_store("gs://bucket/x")
    unregister_scheme(scheme_name)
    with pytest.raises(UnknownScheme, match=f"'{scheme_name}'"):
        open_store(f"{scheme_name}://x")


def test_registering_twice_needs_replace(scheme_name: str) -> None:
    first, second = Calls(), Calls()
    register_scheme(scheme_name, first.opener)
    with pytest.raises(ValueError, match="already registered"):
        register_scheme(scheme_name, second.opener)
    register_scheme(scheme_name, second.opener, replace=True)
    open_store(f"{scheme_name}://x")
    assert (len(first.calls), len(second.calls)) == (0, 1)


@pytest.mark.parametrize("name", ["", "1abc", "a b", "a/b", "s3://"])
def test_scheme_names_must_be_scheme_names(name: str) -> None:
    with pytest.raises(ValueError, match="not a URL scheme name"):
        register_scheme(name, Calls().opener)


def _write_module(directory: Path, name: str, body: str) -> None:
    (directory / f"{name}.py").write_text(body)


OPENER_MODULE = """
from vllm_neuron.backends import open_store

def open_it(url, location, options, *, create):
    return open_store("memory://" + location, **options, create=create)
"""


def test_a_string_opener_is_imported_on_first_open(
    scheme_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"lazy_backend_{scheme_name}"
    _write_module(tmp_path, module, OPENER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    register_scheme(scheme_name, f"{module}:open_it")
    assert module not in sys.modules  # registering costs nothing
    store = open_store(f"{scheme_name}://lazy-{scheme_name}")
    assert module in sys.modules
    store.write("k", b"v")
    assert open_store(f"memory://lazy-{scheme_name}").read("k") == b"v"


def test_a_missing_dependency_names_the_install_command_before_importing_anything(
    scheme_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"needs_pkg_{scheme_name}"
    _write_module(tmp_path, module, "raise AssertionError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def options() -> set[str]:
        raise AssertionError("options computed")

    absent = f"no_such_package_{scheme_name}"
    register_scheme(
        scheme_name, f"{module}:open_it", options=options, requires=(absent,),
        install_hint="pip install 'vllm-neuron[toy]'",
    )  # fmt: skip
    with pytest.raises(MissingDependency) as info:
        open_store(f"{scheme_name}://x")
    message = str(info.value)
    assert absent in message and "pip install 'vllm-neuron[toy]'" in message
    assert f"{scheme_name}://x" in message
    assert isinstance(info.value, ImportError)
    # Without a hint of its own, the command installs the missing package.
    register_scheme(scheme_name, f"{module}:open_it", requires=(absent,), replace=True)
    with pytest.raises(MissingDependency, match=f"pip install {absent}"):
        open_store(f"{scheme_name}://x")


def test_a_dependency_missing_at_import_time_is_a_missing_dependency(
    scheme_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The required package is found, but importing the backend fails on a package it needs
    # in turn (a broken install): still the install hint, naming what is missing.
    dependency = f"present_dep_{scheme_name}"
    _write_module(tmp_path, dependency, "")
    module = f"uses_dep_{scheme_name}"
    _write_module(tmp_path, module, f"import {dependency}\nimport {dependency}_transitive\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_scheme(scheme_name, f"{module}:open_it", requires=(dependency,), install_hint="fix")
    with pytest.raises(MissingDependency, match=f"{dependency}_transitive package: fix"):
        open_store(f"{scheme_name}://x")


def test_s3_without_s3fs_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "s3fs" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(MissingDependency, match=r"s3fs package: pip install 'vllm-neuron\[s3\]'"):
        open_store("s3://bucket/prefix", create=False)


# ------------------------------------------------------------------ create=False


def test_create_false_creates_no_local_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "cache"
    for location in (str(target), f"file://{target}", target):
        store = open_store(location, create=False)
        assert store.local_path("") == str(target)
        assert store.read("k") is None and store.list("") == []
    assert list(tmp_path.iterdir()) == []
    open_store(f"file://{target}")  # the default may create it
    assert target.is_dir()


def test_create_false_is_accepted_by_memory() -> None:
    name = f"memory://create-{uuid.uuid4().hex[:8]}"
    open_store(name).write("k", b"v")
    assert open_store(name, create=False).read("k") == b"v"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_create_false_is_accepted_by_s3_without_a_request() -> None:
    # Opening S3 is lazy: nothing listens on this port, yet the open succeeds.
    store = open_store(
        "s3://bucket/prefix", endpoint_url=f"http://127.0.0.1:{_closed_port()}", create=False
    )
    assert store.capabilities.profile == "s3"
    with pytest.raises(TypeError, match="create"):
        open_store("s3://bucket/p", storage_options={"create": False})


def test_s3_create_makes_no_bucket(s3_server: str, s3_admin: Any) -> None:
    bucket = f"absent-{uuid.uuid4().hex[:12]}"
    for create in (False, True):
        store = open_store(f"s3://{bucket}/p", endpoint_url=s3_server, create=create)
        with pytest.raises(StoreMissing, match=bucket):  # never a silent "no such key"
            store.read("k")
    names = [b["Name"] for b in s3_admin.list_buckets().get("Buckets", [])]
    assert bucket not in names


# ------------------------------------------------------------------ location helpers

SCHEME = st.from_regex(r"[A-Za-z][A-Za-z0-9+.-]{0,7}", fullmatch=True)
SEGMENT = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00/"),
    min_size=1, max_size=8,
).filter(lambda s: s not in (".", ".."))  # fmt: skip
REL_PATH = st.lists(SEGMENT, min_size=1, max_size=4).map("/".join)
PLAIN = st.one_of(REL_PATH, REL_PATH.map(lambda p: "/" + p), REL_PATH.map(lambda p: "~/" + p))
LOCATION = st.one_of(
    PLAIN,
    st.tuples(SCHEME, st.text(max_size=12).filter(lambda s: "\x00" not in s)).map(
        lambda t: f"{t[0]}://{t[1]}"
    ),
    PLAIN.map(lambda p: "file://" + p),
    st.text(min_size=1, max_size=16).filter(lambda s: "\x00" not in s),
)


@settings(max_examples=300)
@given(SCHEME, st.text(max_size=12))
def test_is_url_means_scheme_colon_slash_slash_at_the_start(scheme: str, rest: str) -> None:
    assert is_url(f"{scheme}://{rest}")
    assert not is_url(f"/{scheme}://{rest}")  # "://" later in a path is a path
    assert not is_url(f"{scheme}:/_{rest}")


@settings(max_examples=300)
@given(LOCATION)
def test_normalize_location_properties(location: str) -> None:
    scheme = location.split(":", 1)[0].lower() if ":" in location else None
    if scheme in registered_schemes() and not location.split(":", 1)[1].startswith("//"):
        with pytest.raises(InvalidLocation, match="did you mean"):  # s3:/b, FILE:x
            normalize_location(location)
        return
    normal = normalize_location(location)
    assert normalize_location(normal) == normal  # idempotent
    assert is_url(normal) == is_url(location)
    assert local_path_of(normal) == local_path_of(location)
    local = local_path_of(location)
    if local is None:
        assert normal == location  # remote URLs are left as they are
    else:
        assert os.path.isabs(local)
        assert normal == (("file://" + local) if is_url(location) else local)


@settings(max_examples=100)
@given(REL_PATH, st.sampled_from(["", "file://", "~/", "file://~/"]))
def test_open_store_opens_where_local_path_of_says(
    tmp_path_factory: pytest.TempPathFactory, rel: str, form: str
) -> None:
    base = tmp_path_factory.getbasetemp()
    home = str(base / "home")
    location = f"{form}{rel}" if "~" in form else f"{form}{base}/{rel}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", home)
        expected = local_path_of(location)
        assert expected is not None and expected.startswith(str(base) + "/")
        for candidate in (location, normalize_location(location)):
            assert open_store(candidate, create=False).local_path("") == expected
    assert not os.path.exists(expected)


def test_home_overrides_the_process_home(tmp_path: Path) -> None:
    # What envs.py needs: "~" expanded with the HOME of the environment being parsed.
    home = str(tmp_path / "h")
    assert normalize_location("~/a/b", home=home) == f"{home}/a/b"
    assert normalize_location("file://~", home=home) == f"file://{home}"
    assert local_path_of("~", home=home) == home
    assert normalize_location("s3://b/~", home=home) == "s3://b/~"


@pytest.mark.parametrize("location", ["", "a\x00b", "s3://b\x00"], ids=repr)
def test_helpers_refuse_what_open_store_refuses(location: str) -> None:
    for helper in (normalize_location, local_path_of, open_store):
        with pytest.raises(ValueError):
            helper(location)


@pytest.mark.parametrize("url", ["gs://b/x", "memory://m", "s3://b/p", "HTTP://h/x"])
def test_remote_urls_have_no_local_path(url: str) -> None:
    assert is_url(url) and local_path_of(url) is None


def test_local_root_missing_says_whether_a_reader_would_find_a_directory(tmp_path: Path) -> None:
    """Readers ask this before opening with create=False; only a local directory answers."""
    there, file = tmp_path / "cache", tmp_path / "file"
    there.mkdir()
    file.write_bytes(b"x")
    assert not local_root_missing(str(there))
    assert not local_root_missing(f"file://{there}")
    assert local_root_missing(str(tmp_path / "nothing"))
    assert local_root_missing(f"file://{tmp_path}/nothing")
    assert local_root_missing(str(file))  # a file is not a tier
    # Other schemes cannot say without a read; asking makes no request and creates nothing.
    assert not local_root_missing("memory://never-named")
    assert not local_root_missing("s3://no-such-bucket/prefix")
    assert not (tmp_path / "nothing").exists()
