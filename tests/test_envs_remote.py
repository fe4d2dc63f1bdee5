"""The remote tier's settings: a malformed remote is a start-up error, and the fleet knobs.

``NEURON_LIBTORCH_REMOTE_CACHE=bogus://x`` only warned at run time and ``s3:/bucket/cache``
became a local folder; both are now a ConfigError naming the variable when the settings
are parsed. ``VLLM_NEURON_REMOTE_WRITE``, ``VLLM_NEURON_REMOTE_LEASE_SECONDS`` and
``VLLM_NEURON_COMPILE_RETRY_AFTER`` are parsed and validated here, and documented.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_neuron import envs
from vllm_neuron.envs import ConfigError, load_compile_cache_settings
from vllm_neuron.envs import compile_cache as cc

HOME_ENV = {"HOME": "/home/alice", "USER": "alice"}
REMOTE = "NEURON_LIBTORCH_REMOTE_CACHE"
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value,reason", [
    ("s3:/bucket/cache", "did you mean s3://bucket/cache?"),
    ("S3:bucket", "did you mean s3://bucket?"),
    ("file:/srv/cache", "did you mean file:///srv/cache?"),
    ("s3://", "needs a bucket"),
    ("s3:///bucket/x", "did you mean s3://bucket/x?"),
    ("bogus://x", "no store backend for scheme 'bogus'"),
    ("s3//bucket/cache", "did you mean s3://bucket/cache?"),
    ("file//srv/cache", "did you mean file:///srv/cache?"),
    ("cache/shared", "is a relative path; a remote tier must be an absolute path or a URL"),
    ("./s3:/bucket", "is a relative path"),
])  # fmt: skip
def test_a_malformed_remote_is_refused_naming_the_variable(value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_compile_cache_settings({**HOME_ENV, REMOTE: f" {value} "})
    message = str(info.value)
    assert f"{REMOTE}={f' {value} '!r}" in message and reason in message


@pytest.mark.parametrize("value", ["s3://bucket/prefix", "memory://x", "/mnt/fsx/cache",
                                   "/srv/s3:/bucket", "file:///srv/cache", "~/shared"])  # fmt: skip
def test_well_formed_remotes_are_kept_as_given(value: str) -> None:
    assert load_compile_cache_settings({**HOME_ENV, REMOTE: value}).remote_cache == value


def test_a_mangled_url_in_any_location_variable_names_it() -> None:
    # Every group that normalizes a location goes through the same helper.
    with pytest.raises(ConfigError, match=re.escape("VLLM_NEURON_MANIFEST_DIR='s3:/b/m'")):
        envs.load_manifest_settings({"VLLM_NEURON_MANIFEST_DIR": "s3:/b/m"})


def test_the_fleet_settings_default() -> None:
    s = load_compile_cache_settings(HOME_ENV)
    assert (s.remote_write, s.remote_lease_seconds, s.compile_retry_after) == ("auto", 30.0, 300.0)
    blank = {**HOME_ENV, "VLLM_NEURON_REMOTE_WRITE": " ",
             "VLLM_NEURON_REMOTE_LEASE_SECONDS": "", "VLLM_NEURON_COMPILE_RETRY_AFTER": ""}
    assert load_compile_cache_settings(blank) == s  # fmt: skip


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("OFF", "off"), (" Auto ", "auto"),
                                            ("off", "off")])  # fmt: skip
def test_remote_write_is_auto_or_off_in_any_case(value: str, expected: str) -> None:
    env = {**HOME_ENV, "VLLM_NEURON_REMOTE_WRITE": value}
    assert load_compile_cache_settings(env).remote_write == expected


@pytest.mark.parametrize("value", ["on", "1", "readonly", "false"])
def test_a_bad_remote_write_names_the_variable_value_and_choices(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_compile_cache_settings({**HOME_ENV, "VLLM_NEURON_REMOTE_WRITE": value})
    message = str(info.value)
    assert f"VLLM_NEURON_REMOTE_WRITE={value!r}" in message and "auto, off" in message


@pytest.mark.parametrize("name,field", [
    ("VLLM_NEURON_REMOTE_LEASE_SECONDS", "remote_lease_seconds"),
    ("VLLM_NEURON_COMPILE_RETRY_AFTER", "compile_retry_after"),
])  # fmt: skip
def test_the_fleet_durations_are_positive_seconds(name: str, field: str) -> None:
    assert getattr(load_compile_cache_settings({**HOME_ENV, name: " 12.5 "}), field) == 12.5
    for bad in ("0", "-1", "nan", "inf", "30s", "abc"):
        with pytest.raises(ConfigError) as info:
            load_compile_cache_settings({**HOME_ENV, name: bad})
        assert f"{name}={bad!r}" in str(info.value)


def test_every_compile_cache_variable_is_listed_and_in_the_docs_table() -> None:
    names = {v.name for v in cc.VARIABLES}
    assert {"VLLM_NEURON_REMOTE_WRITE", "VLLM_NEURON_REMOTE_LEASE_SECONDS",
            "VLLM_NEURON_COMPILE_RETRY_AFTER"} <= names  # fmt: skip
    assert names <= {v.name for v in envs.ENVIRONMENT_VARIABLES}
    doc = (ROOT / "docs" / "compile-cache.md").read_text()
    table = doc[doc.index("## Environment variables"):]
    table = table[: table.index("\n## ", 1)]
    for name in names:
        assert f"| `{name}` |" in table, name
