"""What a writer of the shared tier without a key leaves where a record should be can at
most make a node compile: never hang it, grow it, crash it, set the remote aside, or make
it write something node-local to the shared tier (issue 39, docs/trust.md).

Each case plants one thing in a real remote (a folder, or moto's S3) where a published
entry's ``entry.json`` or a failure note (``.failures/<key>.json``) should be: a FIFO, a
symbolic link to ``/dev/zero``, 3 MiB of JSON, JSON nested 10,000 deep. The graph is
compiled and served, within a time bound, another key is still fetched from the same
remote, and the remote is never set aside (no ``remote_unavailable`` event, `remote` still
there). A get that would block on a FIFO runs in a thread the test releases through the
FIFO's write end, so a missing protection fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from cache_workers import entry_is_right

from vllm_neuron.backends import join, open_store
from vllm_neuron.compile import save_cache
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.flow.cache import CacheResult, TwoTierCache

BOUND = 120.0  # seconds: a safety limit for a get that a FIFO would block forever
DEEP = b"[" * 10_000 + b"]" * 10_000
FOLDER_OPTIONS = {"lock": "lease"}  # as on NFS or FSx: nodes share no kernel


def _keys(n: int) -> list[str]:
    return [uuid.uuid5(uuid.NAMESPACE_URL, f"hostile-{i}").hex for i in range(n)]


def bounded(fn: Callable[[], Any], fifos: list[str]) -> Any:
    """`fn()` in a thread; fails (after releasing any reader blocked on `fifos`) when it
    has not returned within `BOUND` seconds."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    if thread.is_alive():
        for fifo in fifos:  # a writer appears and goes: the blocked read sees EOF
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(BOUND)
        raise AssertionError(f"a get stayed blocked for {BOUND} s (on a FIFO?)")
    if "error" in out:
        raise out["error"]
    return out["value"]


def _publish(tmp_path: Any, compile_fn: Any, remote: str, options: dict[str, Any],
             keys: list[str]) -> None:  # fmt: skip
    builder = str(tmp_path / "builder")
    for key in keys:
        TwoTierCache(builder).get_or_compile(key, compile_fn(key))
        assert save_cache(builder, remote, key, remote_options=options) is True


def _plant(path: str, what: str, target: str = "/dev/zero") -> None:
    """Replace the file at `path` (or create it) with a hostile writer's `what`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    if what == "fifo":
        os.mkfifo(path)
    elif what == "link":
        os.symlink(target, path)
    elif what == "huge":
        with open(path, "wb") as f:
            f.write(b'{"schema": "' + b"x" * (3 << 20) + b'"}')
    elif what == "deep":
        with open(path, "wb") as f:
            f.write(DEEP)
    else:  # pragma: no cover
        raise ValueError(what)


def _assert_served(node: TwoTierCache, result: CacheResult, key: str) -> None:
    assert result.source == "compiled", result.source
    assert entry_is_right(result.path, key) is None


def _assert_remote_kept(node: TwoTierCache, other: str, compile_fn: Any,
                        fifos: list[str]) -> None:  # fmt: skip
    """Another key is still fetched from the same remote, and it was never set aside."""
    again = bounded(lambda: node.get_or_compile(other, compile_fn(other)), fifos)
    assert again.source == "remote" and entry_is_right(again.path, other) is None
    assert node.remote is not None and node._remote.set_aside_seconds == 0
    assert read_stats(node.local_dir).remote_outages == 0


@pytest.mark.parametrize("what", ["fifo", "link", "huge", "deep"])
def test_a_hostile_remote_entry_record_costs_a_compile_only(
        tmp_path, compile_fn, cache_warnings, what) -> None:  # fmt: skip
    remote = str(tmp_path / "remote")
    bad, good = _keys(2)
    _publish(tmp_path, compile_fn, remote, FOLDER_OPTIONS, [bad, good])
    record = os.path.join(remote, bad, "entry.json")
    assert os.path.isfile(record)
    _plant(record, what)
    fifos = [record] if what == "fifo" else []

    node = TwoTierCache(str(tmp_path / "node"), remote=remote, remote_options=FOLDER_OPTIONS)
    result = bounded(lambda: node.get_or_compile(bad, compile_fn(bad)), fifos)
    _assert_served(node, result, bad)
    _assert_remote_kept(node, good, compile_fn, fifos)
    warnings = cache_warnings()
    assert not any("NEURON_LIBTORCH_REMOTE_CACHE) failed" in w for w in warnings), warnings
    assert any(bad in w for w in warnings), warnings  # the defect is said, once per key


@pytest.mark.parametrize("what", ["fifo", "deep", "huge", "link"])
def test_a_hostile_failure_note_costs_nothing(tmp_path, compile_fn, what) -> None:
    """A failure note that is a FIFO, a link, too large or too deep - in the node's own tier
    (read under the key's local lock) and on the remote (read by the fleet's claim) - says
    nothing about this compile: the graph compiles."""
    remote = str(tmp_path / "remote")
    key, good = _keys(2)
    _publish(tmp_path, compile_fn, remote, FOLDER_OPTIONS, [good])
    node_dir = str(tmp_path / "node")
    notes = [os.path.join(node_dir, ".failures", f"{key}.json"),
             os.path.join(remote, ".failures", f"{key}.json")]  # fmt: skip
    node = TwoTierCache(node_dir, remote=remote, remote_options=FOLDER_OPTIONS)
    for note in notes:
        _plant(note, what)
    fifos = notes if what == "fifo" else []
    result = bounded(lambda: node.get_or_compile(key, compile_fn(key)), fifos)
    _assert_served(node, result, key)
    _assert_remote_kept(node, good, compile_fn, fifos)


def test_a_linked_artifact_never_puts_a_node_local_size_on_the_remote(
        tmp_path, compile_fn) -> None:  # fmt: skip
    """An artifact of a remote entry replaced by a link to a node-local file: the fetch
    refuses it unread, and the quarantine note written to the shared tier says so without
    the linked file's size (a link followed once wrote it there)."""
    remote = str(tmp_path / "remote")
    bad, good = _keys(2)
    _publish(tmp_path, compile_fn, remote, FOLDER_OPTIONS, [bad, good])
    secret = tmp_path / "node-local-secret"
    secret.write_bytes(b"s" * 123_457)
    _plant(os.path.join(remote, bad, "graph.bin"), "link", target=str(secret))

    node = TwoTierCache(str(tmp_path / "node"), remote=remote, remote_options=FOLDER_OPTIONS)
    result = bounded(lambda: node.get_or_compile(bad, compile_fn(bad)), [])
    _assert_served(node, result, bad)
    _assert_remote_kept(node, good, compile_fn, [])
    shared = open_store(remote)
    notes = b"".join(shared.read(k) or b"" for k in shared.list(".quarantine"))
    assert b"not a regular file" in notes, notes
    assert b"123457" not in notes and str(secret).encode() not in notes


def test_an_oversize_record_on_s3_is_never_downloaded_whole(
        tmp_path, compile_fn, cache_warnings, s3_env, s3_store_url) -> None:  # fmt: skip
    remote = s3_store_url
    bad, good = _keys(2)
    _publish(tmp_path, compile_fn, remote, {}, [bad, good])
    store = open_store(remote)
    prefix = store.published(bad)
    assert prefix is not None
    store.write(join(prefix, "entry.json"), b'{"schema": "' + b"x" * (3 << 20) + b'"}')

    node = TwoTierCache(str(tmp_path / "node"), remote=remote)
    result = bounded(lambda: node.get_or_compile(bad, compile_fn(bad)), [])
    _assert_served(node, result, bad)  # the ranged GET: tests/backends/test_s3_bounds.py
    _assert_remote_kept(node, good, compile_fn, [])
    warnings = cache_warnings()
    assert not any("NEURON_LIBTORCH_REMOTE_CACHE) failed" in w for w in warnings), warnings


@pytest.mark.parametrize("what", ["fifo", "link", "huge", "deep"])
def test_a_hostile_local_entry_record_is_a_miss(tmp_path, compile_fn, what) -> None:
    """The same in the node's own tier (its lookup runs on every hit, unlocked first):
    a miss and a quarantine, the graph compiled again, never an exception or a hang."""
    node_dir = str(tmp_path / "node")
    key = _keys(1)[0]
    TwoTierCache(node_dir).get_or_compile(key, compile_fn(key))
    node = TwoTierCache(node_dir)
    prefix = node.local.published(key)
    assert prefix is not None
    record = node.local.local_path(join(prefix, "entry.json"))
    assert record is not None
    _plant(record, what)
    result = bounded(lambda: node.get_or_compile(key, compile_fn(key)),
                     [record] if what == "fifo" else [])  # fmt: skip
    _assert_served(node, result, key)


@pytest.mark.parametrize("what", ["fifo", "link", "huge", "deep"])
def test_a_promotion_replaces_a_hostile_remote_entry_record(tmp_path, compile_fn, what) -> None:
    """A builder promoting a key whose remote publication has a hostile `entry.json`
    judges that publication defective and replaces it (never blocks, never raises the
    storage layer's error, which the flow would take for a remote outage)."""
    from vllm_neuron.compile.tiers.promote import promote_entry

    remote = str(tmp_path / "remote")
    (key,) = _keys(1)
    _publish(tmp_path, compile_fn, remote, FOLDER_OPTIONS, [key])
    record = os.path.join(remote, key, "entry.json")
    _plant(record, what)
    fifos = [record] if what == "fifo" else []
    builder = TwoTierCache(str(tmp_path / "second-builder"))
    builder.get_or_compile(key, compile_fn(key))
    remote_store = open_store(remote, lock="lease")
    assert bounded(lambda: promote_entry(builder.local, remote_store, key), fifos) is True
    assert os.path.isfile(record) and not os.path.islink(record)
    fetched = TwoTierCache(str(tmp_path / "node"), remote=remote, remote_options=FOLDER_OPTIONS)
    assert fetched.get_or_compile(key, compile_fn(key)).source == "remote"


@pytest.mark.parametrize("files", [{"../outside": 4}, {"/etc/passwd": 4}, {"graph.bin": -5}])
def test_an_unsigned_record_listing_unsound_files_costs_a_compile_only(
        tmp_path, compile_fn, files) -> None:  # fmt: skip
    """A writer without a key rewrites an entry's record (the trust policy off: nothing
    checks a signature) to list a file outside the entry or a negative size: the node
    judges that entry defective, compiles the graph, and still fetches other keys from the
    remote, which it never sets aside."""
    import json

    remote = str(tmp_path / "remote")
    bad, good = _keys(2)
    _publish(tmp_path, compile_fn, remote, FOLDER_OPTIONS, [bad, good])
    path = os.path.join(remote, bad, "entry.json")
    with open(path, "rb") as f:
        record = json.loads(f.read())
    some = next(iter(record["files"].values()))
    record["files"] = {name: {**some, "size": size} for name, size in files.items()}
    with open(path, "w") as f:
        json.dump(record, f)
    node = TwoTierCache(str(tmp_path / "node"), remote=remote, remote_options=FOLDER_OPTIONS)
    _assert_served(node, bounded(lambda: node.get_or_compile(bad, compile_fn(bad)), []), bad)
    _assert_remote_kept(node, good, compile_fn, [])


@pytest.mark.parametrize("planted", ["entry.sig", "entry.json"])
def test_a_promotion_reads_the_local_entrys_records_bounded(
        tmp_path, compile_fn, monkeypatch, planted) -> None:  # fmt: skip
    """A record in the node's own local tier grown to 3 MiB (by another local process,
    before a check of the root could set the tier aside; ``entry.json`` just after the
    checked read of it) is the local entry's defect: `LocalEntryProblem`, nothing read past
    `RECORD_MAX_BYTES` and nothing published - never shared to the fleet as it is."""
    from vllm_neuron.backends.records import RECORD_MAX_BYTES
    from vllm_neuron.compile.tiers import promote
    from vllm_neuron.compile.trust.policy import load_trust_policy
    from vllm_neuron.compile.trust.signing import generate_key_pair
    from vllm_neuron.envs.trust import load_trust_settings

    (key,) = _keys(1)
    builder = TwoTierCache(str(tmp_path / "builder"))
    builder.get_or_compile(key, compile_fn(key))
    prefix = builder.local.published(key)
    assert prefix is not None
    path = builder.local.local_path(join(prefix, planted))
    assert path is not None
    if planted == "entry.json":  # read bounded and checked first: grown just after that
        private, public, _ = generate_key_pair(str(tmp_path / "keys"), "builder")
        monkeypatch.setenv("VLLM_NEURON_CACHE_SIGNING_KEY", private)
        monkeypatch.setenv("VLLM_NEURON_CACHE_TRUSTED_KEYS", public)
        real = promote._checked_entry

        def then_grown(local: Any, hash_key: str) -> Any:
            out = real(local, hash_key)
            _plant(path, "huge")
            return out

        monkeypatch.setattr(promote, "_checked_entry", then_grown)
    else:
        _plant(path, "huge")
    policy = load_trust_policy(load_trust_settings())  # signing (entry.json), or off (entry.sig)
    remote = open_store(str(tmp_path / "remote"), lock="lease")
    with pytest.raises(promote.LocalEntryProblem, match="not read"):
        promote.promote_entry(builder.local, remote, key, policy=policy)
    assert os.path.getsize(path) > RECORD_MAX_BYTES
    assert remote.published(key) is None
