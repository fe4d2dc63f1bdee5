"""`vllm-neuron cache` on a URL it cannot use: exit 2 with the reason, never a silent answer.

Exit status, as every `vllm-neuron` command: 0 done, 1 a problem found, 2 bad usage or a
tier that cannot be used. What a new user met: ``cache ls s3://nosuchbucket/c`` said
"0 entries" with exit 0, and ``promote --to s3:/bucket/cache`` made a local folder
``./s3:/bucket/cache`` and printed "promoted".
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from blackhole import BlackHole  # tests/blackhole.py

from vllm_neuron.backends import register_scheme, unregister_scheme
from vllm_neuron.cli import main
from vllm_neuron.compile.flow.cache import TwoTierCache

KEY = "cccccccccccccccccccccccccccccc03"


@pytest.fixture
def cache_dir(tmp_path, compile_fn) -> str:
    d = str(tmp_path / "cache")
    TwoTierCache(d).get_or_compile(KEY, compile_fn(KEY))
    return d


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> str:
    """An empty current directory, which a refused URL must leave empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return str(cwd)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _commands(url: str) -> list[list[str]]:
    return [["ls", url], ["ls", url, "--json"], ["verify", url], ["verify", url, "--keep"],
            ["prune", url, "--older-than", "1d", "--dry-run"],
            ["explain", KEY, KEY, url]]  # fmt: skip


@pytest.mark.parametrize("url,reason", [
    ("s3:/bucket/cache", "did you mean s3://bucket/cache?"),
    ("S3:bucket", "did you mean s3://bucket?"),
    ("file:/srv/cache", "did you mean file:///srv/cache?"),
    ("bogus://x", "no store backend for scheme 'bogus'"),
    ("s3://", "needs a bucket"),
])  # fmt: skip
def test_a_malformed_url_exits_2_with_the_reason(capsys, cache_dir, elsewhere, url, reason):
    for command in _commands(url):
        code, out, err = run(capsys, "cache", "--cache-dir", cache_dir, *command)
        assert code == 2, (command, out, err)
        assert reason in err and out == "", (command, err)
    code, out, err = run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", url,
                         "--all")  # fmt: skip
    assert code == 2 and reason in err and "promoted" not in out
    assert os.listdir(elsewhere) == []  # no ./s3: folder


@pytest.mark.parametrize("option,url,reason", [
    ("--to", "s3//bucket/x", "did you mean s3://bucket/x?"),
    ("--to", "file//srv/cache", "did you mean file:///srv/cache?"),
    ("--to", "shared/cache", "'shared/cache' is a relative path"),
    ("--from", "s3//bucket/x", "did you mean s3://bucket/x?"),
    ("--from", "rel", "'rel' is a relative path"),
    ("--remote", "s3:bucket", "did you mean s3://bucket?"),
])  # fmt: skip
def test_a_remote_option_refuses_a_mistyped_scheme_or_a_relative_path(
    capsys, cache_dir, elsewhere, tmp_path, option, url, reason
):
    """``--to s3//bucket/x`` made ./s3/bucket/x and said "promoted"."""
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"manifest_version": "1", "graphs": []}')
    argv = {"--to": ["promote", "--all", "--to", url],
            "--from": ["bake", str(manifest), "--into", str(tmp_path / "baked"), "--from", url],
            "--remote": ["warm", str(manifest), "--remote", url]}[option]  # fmt: skip
    code, out, err = run(capsys, "cache", "--cache-dir", cache_dir, *argv)
    assert code == 2 and f"{option} {url}: " in err and reason in err, err
    assert "promoted" not in out and os.listdir(elsewhere) == []


def test_a_malformed_remote_from_the_environment_is_named(capsys, cache_dir, monkeypatch):
    monkeypatch.setenv("NEURON_LIBTORCH_REMOTE_CACHE", "s3:/bucket/cache")
    code, out, err = run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--all")
    assert code == 2
    assert "NEURON_LIBTORCH_REMOTE_CACHE='s3:/bucket/cache'" in err
    assert "did you mean s3://bucket/cache?" in err


def test_a_missing_bucket_exits_2_naming_it(capsys, cache_dir, s3_env):
    url = f"s3://nosuchbucket-{uuid.uuid4().hex[:8]}/c"
    for command in _commands(url):
        code, out, err = run(capsys, "cache", "--cache-dir", cache_dir, *command)
        assert code == 2, (command, out, err)
        assert url in err and "NoSuchBucket" in err and "0 entries" not in out, command
    code, out, err = run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", url,
                         "--all")  # fmt: skip
    assert code == 2 and url in err and "NoSuchBucket" in err and "promoted" not in out


def test_an_existing_empty_bucket_is_zero_entries(capsys, s3_env, s3_store_url):
    code, out, _ = run(capsys, "cache", "ls", s3_store_url)
    assert code == 0 and "0 entries" in out


def test_a_silent_endpoint_exits_2_within_the_bound(capsys, cache_dir, s3_env, monkeypatch):
    with BlackHole() as hole:
        monkeypatch.setenv("AWS_ENDPOINT_URL", hole.url)
        url = f"s3://bucket-{uuid.uuid4().hex[:8]}/c"
        start = time.monotonic()
        code, out, err = run(capsys, "cache", "ls", url)
        assert time.monotonic() - start < 40
        assert code == 2 and url in err and "no answer" in err
        assert hole.connections() >= 1


def test_a_missing_optional_package_exits_2_with_the_install_line(capsys):
    name = f"needs{uuid.uuid4().hex[:8]}"
    register_scheme(name, lambda *a, **k: None, requires=("no_such_package_for_tests",),
                    install_hint="pip install the-thing")  # fmt: skip
    try:
        code, _, err = run(capsys, "cache", "ls", f"{name}://x")
    finally:
        unregister_scheme(name)
    assert code == 2 and "pip install the-thing" in err
