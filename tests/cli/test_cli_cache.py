"""`vllm-neuron cache ls|stats|verify|promote|prune|explain`, in process and as installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from cache_workers import entry_is_right

from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.compile.flow.cache import TwoTierCache

KEY_A = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa1"
KEY_B = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb2"
COMPONENTS_A = {"graph": "g" * 32, "inputs": "i" * 32, "versions": "v" * 32}
COMPONENTS_B = {"graph": "h" * 32, "inputs": "j" * 32, "versions": "v" * 32}


@pytest.fixture
def cache_dir(tmp_path, compile_fn) -> str:
    """A local cache with two entries whose keys differ in `graph` and `inputs`."""
    d = str(tmp_path / "cache")
    cache = TwoTierCache(d)
    cache.get_or_compile(KEY_A, compile_fn(KEY_A), components=COMPONENTS_A)
    cache.get_or_compile(KEY_B, compile_fn(KEY_B), components=COMPONENTS_B)
    TwoTierCache(d).get_or_compile(KEY_A, compile_fn(KEY_A))  # a hit, for stats
    return d


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def alter(path: str) -> None:
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def test_ls_json_parses_and_lists_every_entry(capsys, cache_dir):
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "ls", "--json")
    assert code == 0
    entries = json.loads(out)
    assert sorted(e["key"] for e in entries) == [KEY_A, KEY_B]
    for e in entries:
        assert e["size"] == 4 * 4096 and e["files"] == 4
        assert e["toolchain"] == "host" and e["problem"] is None
        assert 0 <= e["age_seconds"] < 600


def test_ls_table(capsys, cache_dir):
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "ls")
    assert code == 0
    assert KEY_A in out and KEY_B in out
    assert "TOOLCHAIN" in out.splitlines()[0]
    assert "2 entries, 32.0 KiB" in out


def test_stats_folds_the_events(capsys, cache_dir):
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "stats", "--json")
    assert code == 0
    stats = json.loads(out)
    assert (stats["compiles"], stats["misses"], stats["hits"]) == (2, 2, 1)
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "stats")
    assert code == 0 and "compiles" in out and "time saved" in out


def test_stats_show_location_entries_size_against_the_bound_and_hit_rate(
    capsys, cache_dir, monkeypatch
):
    monkeypatch.setenv("VLLM_NEURON_CACHE_MAX_SIZE", "1M")
    code, out, _ = run(capsys, "cache", "stats", "--cache-dir", cache_dir, "--json")
    stats = json.loads(out)
    assert code == 0 and stats["location"] == open_store(cache_dir).url
    assert (stats["entries"], stats["size_bytes"]) == (2, 2 * 4 * 4096)  # two 16 KiB entries
    assert stats["max_size_bytes"] == 1 << 20 and stats["hit_rate"] == 1 / 3  # 1 hit, 2 misses
    code, out, _ = run(capsys, "cache", "stats", "--cache-dir", cache_dir)
    assert code == 0 and cache_dir in out
    assert "32.0 KiB of 1.0 MiB (3% of the bound)" in out and "33.3% of 3 lookups" in out
    monkeypatch.delenv("VLLM_NEURON_CACHE_MAX_SIZE")
    code, out, _ = run(capsys, "cache", "stats", "--cache-dir", cache_dir)
    assert "32.0 KiB (no bound: VLLM_NEURON_CACHE_MAX_SIZE unset)" in out


def test_stats_count_hits_by_tier_and_a_fetch_is_a_remote_hit(capsys, tmp_path, compile_fn):
    remote, node = str(tmp_path / "remote"), str(tmp_path / "node")
    TwoTierCache(str(tmp_path / "builder"), remote=remote).get_or_compile(
        KEY_A, compile_fn(KEY_A))  # compiled there, promoted to the remote (auto)
    first = TwoTierCache(node, remote=remote)
    assert first.get_or_compile(KEY_A, compile_fn(KEY_A)).source == "remote"
    assert first.get_or_compile(KEY_A, compile_fn(KEY_A)).source == "memory"
    assert TwoTierCache(node).get_or_compile(KEY_A, compile_fn(KEY_A)).source == "local"

    code, out, _ = run(capsys, "cache", "--cache-dir", node, "stats", "--json")
    stats = json.loads(out)
    assert code == 0
    assert stats["hits_by_tier"] == {"remote": 1, "memory": 1, "local": 1}
    assert (stats["hits"], stats["misses"], stats["compiles"], stats["fetches"]) == (3, 0, 0, 1)
    assert (stats["lease_waits"], stats["lease_takeovers"]) == (0, 0)
    code, out, _ = run(capsys, "cache", "--cache-dir", node, "stats")
    assert code == 0
    assert "3 (local 1, memory 1, remote 1)" in out
    assert "fleet lease waits" in out and "lease takeovers" in out


def test_verify_exit_status_and_quarantine(capsys, cache_dir):
    assert run(capsys, "cache", "--cache-dir", cache_dir, "verify")[0] == 0
    alter(os.path.join(cache_dir, KEY_B, "graph.bin"))

    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "verify", "--keep")
    assert code == 1
    assert f"CORRUPT {KEY_B}" in out and "graph.bin" in out
    assert "1 corrupt (reported)" in out
    assert os.path.isdir(os.path.join(cache_dir, KEY_B))  # --keep: reported only

    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "verify", "--json")
    assert code == 1
    results = {r["key"]: r for r in json.loads(out)}
    assert results[KEY_A]["ok"] and not results[KEY_B]["ok"]
    assert not os.path.exists(os.path.join(cache_dir, KEY_B))  # quarantined
    assert run(capsys, "cache", "--cache-dir", cache_dir, "verify")[0] == 0


def test_verify_catches_a_wrong_sha256_even_when_blake3_matches(capsys, cache_dir, tmp_path):
    """A fetch checks BLAKE3 only; `cache verify` still checks every SHA-256."""
    import msgspec

    from vllm_neuron.compile.entry.record import ENTRY_RECORD, decode_record, encode_record

    remote = str(tmp_path / "remote")
    assert run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", remote,
               "--key", KEY_B)[0] == 0
    path = os.path.join(remote, KEY_B, ENTRY_RECORD)
    with open(path, "rb") as f:
        record = decode_record(f.read())
    files = dict(record.files)
    files["graph.bin"] = msgspec.structs.replace(files["graph.bin"], sha256="f" * 64)
    with open(path, "wb") as f:
        f.write(encode_record(msgspec.structs.replace(record, files=files)))

    node = str(tmp_path / "node")
    fetched = TwoTierCache(node, remote=remote).fetch_remote(KEY_B)
    assert fetched is not None  # BLAKE3 matches: the fetch accepts it
    code, out, _ = run(capsys, "cache", "--cache-dir", node, "verify", "--keep")
    assert code == 1
    assert f"CORRUPT {KEY_B}" in out and "graph.bin fails its SHA-256 check" in out
    code, out, _ = run(capsys, "cache", "verify", remote, "--keep")
    assert code == 1 and "graph.bin fails its SHA-256 check" in out


def test_verify_a_remote_url(capsys, cache_dir, tmp_path):
    remote = str(tmp_path / "remote")
    assert run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", remote,
               "--all")[0] == 0
    assert run(capsys, "cache", "verify", remote)[0] == 0
    with open(os.path.join(remote, KEY_A, "weights", "w1.bin"), "ab") as f:
        f.write(b"x")
    code, out, _ = run(capsys, "cache", "verify", remote)
    assert code == 1 and KEY_A in out and "w1.bin" in out


def test_verify_an_s3_remote(capsys, cache_dir, s3_env, s3_store_url):
    assert run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", s3_store_url,
               "--key", KEY_A)[0] == 0
    assert run(capsys, "cache", "verify", s3_store_url)[0] == 0
    store = open_store(s3_store_url)
    prefix = store.published(KEY_A)
    assert prefix is not None
    store.write(f"{prefix}/meta.txt", b"not the bytes it was")
    code, out, _ = run(capsys, "cache", "verify", s3_store_url, "--keep")
    assert code == 1 and KEY_A in out


def test_promote_key_then_all(capsys, cache_dir, tmp_path):
    remote = str(tmp_path / "remote")
    code, out, err = run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", remote,
                         "--key", KEY_A)
    assert code == 0
    assert f"{KEY_A}: promoted" in out and "1 of 1 entries promoted" in out
    assert err == ""  # stderr is no terminal here: no progress bar (tests/cli: a pty gets one)
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", remote,
                       "--all")
    assert code == 0
    assert f"{KEY_A}: already in the remote tier" in out and f"{KEY_B}: promoted" in out
    assert "1 of 2 entries promoted" in out
    for key in (KEY_A, KEY_B):
        assert entry_is_right(os.path.join(remote, key), key) is None


def test_promote_without_a_destination_is_an_error(capsys, cache_dir, monkeypatch):
    monkeypatch.delenv("NEURON_LIBTORCH_REMOTE_CACHE", raising=False)
    code, _, err = run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--all")
    assert code == 2 and "--to" in err


def test_prune_dry_run_deletes_nothing_then_prune_does(capsys, cache_dir):
    before = sorted(os.listdir(cache_dir))
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "prune", "--max-size", "20K",
                       "--dry-run")
    assert code == 0
    # The least recently used goes first: B, compiled after A, but A was hit since.
    assert f"would delete {KEY_B}" in out
    assert KEY_A not in out
    assert "dry run: 1 entries" in out
    assert sorted(os.listdir(cache_dir)) == before

    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "prune", "--max-size", "20K")
    assert code == 0 and "1 entries deleted" in out
    assert not os.path.exists(os.path.join(cache_dir, KEY_B))
    assert entry_is_right(os.path.join(cache_dir, KEY_A), KEY_A) is None

    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "prune", "--older-than", "0s",
                       "--dry-run")
    assert code == 0 and f"would delete {KEY_A}" in out
    assert os.path.isdir(os.path.join(cache_dir, KEY_A))


def test_prune_needs_a_policy_and_parses_its_values(capsys, cache_dir):
    assert run(capsys, "cache", "--cache-dir", cache_dir, "prune")[0] == 2
    code, _, err = run(capsys, "cache", "--cache-dir", cache_dir, "prune", "--older-than",
                       "soon")
    assert code == 2 and "--older-than" in err


def test_explain_names_the_differing_components(capsys, cache_dir):
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "explain", KEY_A, KEY_B)
    assert code == 0
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows == ["graph", "inputs"]  # "versions" is the same in both
    code, out, _ = run(capsys, "cache", "--cache-dir", cache_dir, "explain", KEY_A, KEY_A)
    assert code == 0 and "identical" in out
    code, _, err = run(capsys, "cache", "--cache-dir", cache_dir, "explain", KEY_A,
                       "c" * 32)
    assert code == 2 and "c" * 32 in err


def test_a_missing_cache_directory_is_a_clear_error(capsys, tmp_path):
    code, _, err = run(capsys, "cache", "--cache-dir", str(tmp_path / "none"), "ls")
    assert code == 2 and "no compile cache" in err


def test_installed_console_script(cache_dir, tmp_path):
    script = shutil.which("vllm-neuron", path=os.path.dirname(sys.executable))
    assert script is not None, "the vllm-neuron console script is not installed"
    # The default cache directory comes from VLLM_CACHE_ROOT.
    root = tmp_path / "root"
    shutil.copytree(cache_dir, root / "neuron" / "compile_cache")
    env = {**os.environ, "VLLM_CACHE_ROOT": str(root)}

    proc = subprocess.run([script, "cache", "verify"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 entries checked, 0 corrupt" in proc.stdout

    alter(os.path.join(root, "neuron", "compile_cache", KEY_A, "weights", "w0.bin"))
    proc = subprocess.run([script, "cache", "verify"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert f"CORRUPT {KEY_A}" in proc.stdout

    proc = subprocess.run([script, "cache", "ls", "--json"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    assert [e["key"] for e in json.loads(proc.stdout)] == [KEY_B]


def test_prune_sweeps_abandoned_staging_on_a_posix_tier(capsys, cache_dir, tmp_path):
    remote = str(tmp_path / "remote")
    assert run(capsys, "cache", "--cache-dir", cache_dir, "promote", "--to", remote,
               "--all")[0] == 0
    old_dir = os.path.join(remote, ".staging", "deadbeef")
    fresh_dir = os.path.join(remote, ".staging", "f00d")
    for d in (old_dir, fresh_dir):
        os.makedirs(os.path.join(d, "weights"))
        with open(os.path.join(d, "weights", "w0.bin"), "wb") as f:
            f.write(b"half a file")
    past = time.time() - 7 * 3600
    for path in (old_dir, os.path.join(old_dir, "weights"),
                 os.path.join(old_dir, "weights", "w0.bin")):
        os.utime(path, (past, past))

    code, out, _ = run(capsys, "cache", "prune", remote, "--max-size", "1T", "--dry-run")
    assert code == 0
    assert "would remove abandoned staging .staging/deadbeef" in out and "f00d" not in out
    assert os.path.isdir(old_dir)
    code, out, _ = run(capsys, "cache", "prune", remote, "--max-size", "1T")
    assert code == 0 and "1 leftovers of killed processes removed" in out
    assert not os.path.exists(old_dir) and os.path.isdir(fresh_dir)
    assert sorted(open_store(remote).published_children("")) == [KEY_A, KEY_B]


def test_prune_sweeps_uncommitted_versions_on_a_commit_record_tier(capsys, cache_dir):
    import uuid

    from vllm_neuron.compile.tiers.promote import promote_entry

    url = f"memory://prune-{uuid.uuid4().hex}"
    store = open_store(url)
    assert promote_entry(open_store(cache_dir), store, KEY_A)
    abandoned = store.stage(KEY_A)  # a promoter that died mid-upload
    abandoned.write("graph.bin", b"half")
    other = store.stage(KEY_B)  # and one for a key that was never published
    other.write("graph.bin", b"half")
    for key in store.list(""):
        if key.startswith((abandoned.prefix, other.prefix)):
            store.set_mtime(key, time.time() - 7 * 3600)  # type: ignore[attr-defined]

    code, out, _ = run(capsys, "cache", "prune", url, "--max-size", "1T")
    assert code == 0 and "2 leftovers of killed processes removed" in out
    assert store.list(abandoned.prefix) == [] and store.list(other.prefix) == []
    assert store.published(KEY_A) is not None
    assert run(capsys, "cache", "verify", url)[0] == 0


def test_the_report_takes_its_stats_from_the_function_not_the_commands_output(
    capsys, cache_dir, tmp_path, monkeypatch
):
    """The report ran `cache stats --json` and parsed what it printed; now both call
    `tier_stats`, so the command's printing is not on the report's path at all."""
    from vllm_neuron.cli import cache as cache_cli
    from vllm_neuron.compile.commands.stats import tier_stats

    def not_called(args):
        raise AssertionError("the report ran the cache stats command")

    monkeypatch.setattr(cache_cli, "cmd_stats", not_called)
    page = tmp_path / "r.html"
    code, _, err = run(capsys, "report", "--cache-dir", cache_dir, "-o", str(page))
    assert code == 0, err
    html = page.read_text()
    expected = tier_stats(cache_dir)
    for name in ("entries", "size_bytes", "hit_rate", "compiles", "misses"):
        assert f'data-stat="{name}" data-value="{json.dumps(expected[name])}"' in html, name
