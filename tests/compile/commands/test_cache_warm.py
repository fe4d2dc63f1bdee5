"""`vllm-neuron cache warm`, `manifest check --remote`, `cache compat` and `prune --incompatible`.

Real tiers: local directories, a folder remote, S3 through the moto server.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from typing import Any

import pytest
from cache_workers import entry_is_right

from vllm_neuron import envs
from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.compile.commands.compat import current_toolchain, environment_of
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.inventory import list_entries
from vllm_neuron.compile.upkeep import eviction

KEYS = [f"{i:x}" * 32 for i in range(1, 7)]
ENTRY = 4 * 4096


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def present(location: str) -> list[str]:
    return sorted(e.key for e in list_entries(open_store(location)))


def manifest(tmp_path: Any, keys: list[str], *, world: int = 1, name: str = "m") -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({
        "manifest_version": "1",
        "config": {"topology": {"world_size": world}},
        "graphs": [{"graph_hash": k, "ranks": list(range(world))} for k in keys],
    }))
    return str(path)


@pytest.fixture
def remote(tmp_path: Any, compile_fn: Any) -> str:
    """A folder remote holding KEYS[0..3], compiled on another node and promoted."""
    url = str(tmp_path / "remote")
    builder = TwoTierCache(str(tmp_path / "builder"), remote=url)
    for key in KEYS[:4]:
        builder.get_or_compile(key, compile_fn(key))
    assert present(url) == sorted(KEYS[:4])
    return url


@pytest.fixture
def no_remote_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_LIBTORCH_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("VLLM_NEURON_CACHE_MAX_SIZE", raising=False)


# ------------------------------------------------------------------------ warm
def test_warm_fetches_every_graph_of_the_manifest(tmp_path, capsys, remote, no_remote_env):
    node = str(tmp_path / "node")
    m = manifest(tmp_path, KEYS[:4])
    code, out, err = run(capsys, "cache", "--cache-dir", node, "warm", m, "--remote", remote,
                         "--jobs", "3")
    assert code == 0, out + err
    assert "4 graphs: 4 fetched (64.0 KiB" in out and "0 missing" in out
    assert err == ""  # no progress bar: stderr is not a terminal
    for key in KEYS[:4]:
        assert entry_is_right(os.path.join(node, key), key) is None
    stats = read_stats(node)
    assert (stats.fetches, stats.hits_by_tier.get("remote")) == (4, 4)

    code, out, _ = run(capsys, "cache", "--cache-dir", node, "warm", m, "--remote", remote)
    assert code == 0 and "0 fetched" in out and "4 already local" in out
    # The node now serves every graph from its local tier, without the remote.
    cache = TwoTierCache(node, precompiled_only=True)
    assert {cache.get_or_compile(k, lambda out: {}).source for k in KEYS[:4]} == {"local"}


def test_warm_lists_what_the_remote_lacks_and_exits_1(tmp_path, capsys, remote, no_remote_env):
    node = str(tmp_path / "node")
    m = manifest(tmp_path, [KEYS[0], KEYS[5], KEYS[1], "not-a-key"])
    code, out, _ = run(capsys, "cache", "--cache-dir", node, "warm", m, "--remote", remote)
    assert code == 1
    assert f"MISSING   {KEYS[5]}" in out and "MISSING   not-a-key" in out
    assert "2 fetched" in out and "2 missing" in out
    assert present(node) == sorted(KEYS[:2])


def test_warm_reports_a_defective_remote_entry_and_leaves_the_remote_alone(
        tmp_path, capsys, remote, no_remote_env):
    victim = os.path.join(remote, KEYS[1], "weights", "w0.bin")
    with open(victim, "r+b") as f:  # same size, one byte changed: only a checksum sees it
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    node = str(tmp_path / "node")
    code, out, _ = run(capsys, "cache", "--cache-dir", node, "warm",
                       manifest(tmp_path, KEYS[:3]), "--remote", remote)
    assert code == 1 and f"DEFECTIVE {KEYS[1]}" in out and "w0.bin" in out
    assert present(node) == [KEYS[0], KEYS[2]]  # never half of the defective one
    assert os.path.exists(victim)  # reported only: `cache verify URL` quarantines


def test_warm_replaces_a_defective_local_entry(tmp_path, capsys, remote, compile_fn,
                                               no_remote_env):
    node = str(tmp_path / "node")
    TwoTierCache(node).get_or_compile(KEYS[0], compile_fn(KEYS[0]))
    with open(os.path.join(node, KEYS[0], "graph.bin"), "r+b") as f:
        f.truncate(10)
    code, out, _ = run(capsys, "cache", "--cache-dir", node, "warm",
                       manifest(tmp_path, KEYS[:1]), "--remote", remote)
    assert code == 0 and "1 fetched" in out
    assert entry_is_right(os.path.join(node, KEYS[0]), KEYS[0]) is None


@pytest.mark.parametrize(("remote_arg", "message"), [
    ("s3:/bucket/cache", "did you mean s3://bucket/cache"),
    ("bogus://x", "bogus"),
    ("missing-folder", "missing-folder"),
])
def test_warm_from_a_bad_remote_exits_2(tmp_path, capsys, remote_arg, message, no_remote_env):
    target = remote_arg if "://" in remote_arg or ":" in remote_arg else str(
        tmp_path / remote_arg)
    code, _, err = run(capsys, "cache", "--cache-dir", str(tmp_path / "node"), "warm",
                       manifest(tmp_path, KEYS[:1]), "--remote", target)
    assert code == 2 and message in err and "--remote" in err


def test_warm_needs_a_remote_and_a_sane_job_count(tmp_path, capsys, remote, no_remote_env,
                                                   monkeypatch):
    node, m = str(tmp_path / "node"), manifest(tmp_path, KEYS[:1])
    code, _, err = run(capsys, "cache", "--cache-dir", node, "warm", m)
    assert code == 2 and "--remote" in err
    assert run(capsys, "cache", "--cache-dir", node, "warm", m, "--remote", remote,
               "--jobs", "0")[0] == 2
    monkeypatch.setenv("NEURON_LIBTORCH_REMOTE_CACHE", remote)  # the default remote
    assert run(capsys, "cache", "--cache-dir", node, "warm", m)[0] == 0
    monkeypatch.setenv("VLLM_NEURON_CACHE_MAX_SIZE", "lots")
    code, _, err = run(capsys, "cache", "--cache-dir", node, "warm", m)
    assert code == 2 and "VLLM_NEURON_CACHE_MAX_SIZE='lots'" in err


def test_warm_from_s3(tmp_path, capsys, compile_fn, s3_env, s3_store_url, no_remote_env):
    builder = TwoTierCache(str(tmp_path / "builder"), remote=s3_store_url)
    for key in KEYS[:3]:
        builder.get_or_compile(key, compile_fn(key))
    node = str(tmp_path / "node")
    code, out, _ = run(capsys, "cache", "--cache-dir", node, "warm",
                       manifest(tmp_path, KEYS[:4]), "--remote", s3_store_url, "--jobs", "2")
    assert code == 1 and f"MISSING   {KEYS[3]}" in out and "3 fetched" in out
    for key in KEYS[:3]:
        assert entry_is_right(os.path.join(node, key), key) is None
    missing_bucket = f"s3://no-such-bucket-{time.time_ns()}/cache"
    code, _, err = run(capsys, "cache", "--cache-dir", node, "warm",
                       manifest(tmp_path, KEYS[:1]), "--remote", missing_bucket)
    assert code == 2 and "no-such-bucket" in err


def test_warm_keeps_the_node_within_its_bound_and_keeps_the_warmed_graphs(
        tmp_path, capsys, remote, compile_fn, monkeypatch, no_remote_env):
    node = str(tmp_path / "node")
    old = TwoTierCache(node)
    for key in KEYS[4:6]:  # graphs of the model this node served before
        old.get_or_compile(key, compile_fn(key))
    monkeypatch.setattr(eviction, "RECENT_USE_SECONDS", 0.0)
    monkeypatch.setenv("VLLM_NEURON_CACHE_MAX_SIZE", str(3 * ENTRY))
    code, out, _ = run(capsys, "cache", "--cache-dir", node, "warm",
                       manifest(tmp_path, KEYS[:3]), "--remote", remote)
    assert code == 0
    assert present(node) == sorted(KEYS[:3])
    assert read_stats(node).evictions == 2


def test_warm_shows_a_progress_bar_on_a_terminal(tmp_path, remote, no_remote_env):
    node, m = str(tmp_path / "node"), manifest(tmp_path, KEYS[:4])
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir", node, "warm", m,
         "--remote", remote], stdout=subprocess.PIPE, stderr=secondary)
    os.close(secondary)
    seen = b""
    # poll, not select: in a long suite the descriptor may be above select()'s FD_SETSIZE.
    poller = select.poll()
    poller.register(primary, select.POLLIN)
    while True:
        if not poller.poll(120_000):
            break
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(primary)
    assert proc.returncode == 0, out
    assert b"warm 4 graphs" in seen and b"65.5/65.5 kB" in seen  # bytes, decimal units


# ---------------------------------------------------- manifest check --remote
def test_manifest_check_remote_says_whether_a_deployment_starts_without_compiling(
        tmp_path, capsys, remote, compile_fn, no_remote_env):
    node = str(tmp_path / "node")
    TwoTierCache(node).get_or_compile(KEYS[5], compile_fn(KEYS[5]))
    ok = manifest(tmp_path, [KEYS[5], KEYS[0], KEYS[1]], name="ok")
    code, out, _ = run(capsys, "manifest", "check", ok, "--cache-dir", node, "--remote", remote)
    assert code == 0
    assert "would start without compiling (1 graphs local, 2 to fetch" in out

    lacking = manifest(tmp_path, [KEYS[5], KEYS[4]], name="lacking")
    code, out, _ = run(capsys, "manifest", "check", lacking, "--cache-dir", node,
                       "--remote", remote)
    assert code == 1 and f"FAIL graph {KEYS[4]}: in neither the local tier or the remote" in out
    # A node with no local tier at all is served by the remote alone.
    code, out, _ = run(capsys, "manifest", "check", manifest(tmp_path, KEYS[:2], name="r"),
                       "--cache-dir", str(tmp_path / "fresh"), "--remote", remote)
    assert code == 0 and "0 graphs local, 2 to fetch" in out
    code, out, _ = run(capsys, "manifest", "check", manifest(tmp_path, KEYS[:1], world=2,
                                                             name="w"),
                       "--cache-dir", node, "--remote", remote)
    assert code == 0  # every rank traced it
    code, _, err = run(capsys, "manifest", "check", ok, "--cache-dir", node,
                       "--remote", "s3:/x/y")
    assert code == 2 and "did you mean" in err


def test_manifest_check_remote_on_s3(tmp_path, capsys, compile_fn, s3_env, s3_store_url,
                                     no_remote_env):
    TwoTierCache(str(tmp_path / "b"), remote=s3_store_url).get_or_compile(
        KEYS[0], compile_fn(KEYS[0]))
    node = str(tmp_path / "node")
    assert run(capsys, "manifest", "check", manifest(tmp_path, KEYS[:1]), "--cache-dir", node,
               "--remote", s3_store_url)[0] == 0
    assert run(capsys, "manifest", "check", manifest(tmp_path, KEYS[:2], name="two"),
               "--cache-dir", node, "--remote", s3_store_url)[0] == 1


# --------------------------------------------------------------------- compat
@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This environment (the host toolchain), keyed as the runtime keys it."""
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.delenv("VLLM_NEURON_HOST_MODE", raising=False)
    envs.reset_for_tests()
    yield environment_of(current_toolchain())
    monkeypatch.undo()
    envs.reset_for_tests()


def _compat_tier(directory: str, env: Any, compile_fn: Any) -> dict[str, str]:
    model = {"graph": "g" * 32, "inputs": "i" * 32, "replica_groups": "r" * 32}
    same = {**model, **env.components}
    made = {
        KEYS[0]: same,
        KEYS[1]: {**same, "graph": "h" * 32},  # another model, same environment: a hit
        KEYS[2]: {**same, "versions": "0" * 32},  # an older toolchain
        KEYS[3]: {**same, "target": "1" * 32, "compiler_args": "2" * 32},
        KEYS[4]: {"graph": "g" * 32},  # recorded without its environment's components
    }
    cache = TwoTierCache(directory)
    for key, components in made.items():
        cache.get_or_compile(key, compile_fn(key), components=components)
    return made


def test_compat_tells_per_entry_which_component_differs(tmp_path, capsys, compile_fn, here):
    d = str(tmp_path / "cache")
    _compat_tier(d, here, compile_fn)
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "compat", "--json")
    assert code == 1  # some entries could never be hit here
    report = json.loads(out)
    assert report["environment"]["toolchain"] == "host"
    by_key = {e["key"]: e for e in report["entries"]}
    assert [by_key[k]["compatible"] for k in KEYS[:5]] == [True, True, False, False, None]
    assert by_key[KEYS[2]]["differs"] == ["versions"]
    assert by_key[KEYS[3]]["differs"] == ["compiler_args", "target"]
    assert "versions" in by_key[KEYS[4]]["problem"]

    code, out, _ = run(capsys, "cache", "--cache-dir", d, "compat")
    assert code == 1 and "toolchain host, target cpu-inductor" in out
    assert "differs in versions" in out and "NEVER" in out
    assert "5 entries: 3 usable here, 2 never hit here (32.0 KiB)" in out


def test_prune_incompatible_removes_only_what_could_never_hit_here(tmp_path, capsys,
                                                                   compile_fn, here):
    d = str(tmp_path / "cache")
    _compat_tier(d, here, compile_fn)
    assert run(capsys, "cache", "--cache-dir", d, "pin", KEYS[3])[0] == 0
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--incompatible",
                       "--dry-run")
    assert code == 0 and f"would delete {KEYS[2]}" in out and "incompatible: differs in" in out
    assert f"keep {KEYS[3]} (pinned)" in out
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--incompatible")
    assert code == 0 and "1 entries deleted" in out
    assert present(d) == [KEYS[0], KEYS[1], KEYS[3], KEYS[4]]
    assert read_stats(d).evictions == 1  # recorded, with its reason


def test_compat_of_an_s3_tier(tmp_path, capsys, compile_fn, here, s3_env, s3_store_url):
    d = str(tmp_path / "cache")
    _compat_tier(d, here, compile_fn)
    assert run(capsys, "cache", "--cache-dir", d, "promote", "--to", s3_store_url,
               "--key", KEYS[0], "--key", KEYS[2])[0] == 0
    code, out, _ = run(capsys, "cache", "compat", s3_store_url, "--json")
    assert code == 1
    verdicts = {e["key"]: e["compatible"] for e in json.loads(out)["entries"]}
    assert verdicts == {KEYS[0]: True, KEYS[2]: False}
    code, out, _ = run(capsys, "cache", "prune", s3_store_url, "--incompatible")
    assert code == 0 and present(s3_store_url) == [KEYS[0]]
