"""`compile/upkeep/collect.py` and `vllm-neuron cache gc`: what killed writers left is planned and
removed, what a live process holds never is, on a local folder, a folder with the NFS
profile (leases), the memory store and S3 on moto's server.

Debris is built through the store's own API (a staging area never committed, a lease
whose holder stopped beating, notes with their time in the past) or by a real SIGKILL
(tests/compile/upkeep/test_gc_fleet.py). Ages: on local disk and in memory the files' times are
set back; S3 keeps its own times, so there a plan is asked as of a later `now` instead.
Every wait is for an observable fact (a lease record's expiry), never a pause.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any

import pytest

from vllm_neuron.backends import FileDigest, LeaseLock, Staging, join, open_store
from vllm_neuron.backends._local import LocalStore
from vllm_neuron.backends.records import encode
from vllm_neuron.backends.testing.handshakes import HANG, lease_record
from vllm_neuron.cli import main
from vllm_neuron.compile.entry.failure_notes import FailureNote
from vllm_neuron.compile.entry.load_failure_notes import read_load_failures
from vllm_neuron.compile.entry.notes import (
    LOAD_FAILURES,
    NOTE_KINDS,
    TAG_DIGITS,
    Expiry,
    Layout,
    LoadFailureNote,
    NoteKind,
    OwedPromotion,
    Pin,
    QuarantineNote,
    StoppedNote,
    UnpackedRecord,
    kind_named,
)
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.inventory import verify_entries
from vllm_neuron.compile.tiers.promote import promote_entry
from vllm_neuron.compile.upkeep.collect import plan_gc
from vllm_neuron.manifest.schema import GraphEntry, Manifest, encode_manifest

KEY_A = "9c000000000000000000000000000a0a"
KEY_B = "9c000000000000000000000000000b0b"
KEY_C = "9c000000000000000000000000000c0c"
KEY_D = "9c000000000000000000000000000d0d"
HOURS = 3600.0
DAYS = 86400.0


@pytest.fixture(params=["local", "nfs", "memory", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A fresh tier of each kind, opened as a process of the fleet would."""
    if request.param == "local":
        return open_store(str(tmp_path / "tier"))
    if request.param == "nfs":
        store = open_store(str(tmp_path / "tier"), profile="nfs")
        assert not store.capabilities.kernel_locks
        return store
    if request.param == "memory":
        return open_store(f"memory://gc-{uuid.uuid4().hex}")
    request.getfixturevalue("s3_env")
    return open_store(request.getfixturevalue("s3_store_url"))


@pytest.fixture
def source(tmp_path: Any, compile_fn: Any) -> Any:
    """A local cache holding KEY_A..KEY_D, to publish them in a tier under test."""
    cache = TwoTierCache(str(tmp_path / "source"))
    for key in (KEY_A, KEY_B, KEY_C, KEY_D):
        cache.get_or_compile(key, compile_fn(key))
    return cache.local


def can_age(store: Any) -> bool:
    """Whether a test can set a file's time back (local disk, memory; not S3)."""
    return store.capabilities.local_paths or store.capabilities.profile == "memory"


def age(store: Any, prefix: str, seconds: float) -> None:
    """Set the time of everything under `prefix` (files and directories) `seconds` back."""
    past = time.time() - seconds
    if store.capabilities.local_paths:
        top = store.local_path(prefix)
        paths = [top] if os.path.isfile(top) else []
        for dirpath, dirs, files in os.walk(top):
            paths += [dirpath] + [os.path.join(dirpath, n) for n in dirs + files]
        for path in paths:
            os.utime(path, (past, past))
        return
    keys = [prefix] if store.exists(prefix) else store.list(prefix)
    for key in keys:
        store.set_mtime(key, past)


def dead_lease(store: Any, name: str) -> LeaseLock:
    """A lease whose holder stopped beating (as if killed), waited out to its expiry (read
    from its own record, on the store's clock)."""
    lease = LeaseLock(store, join(".locks", name), lease_duration=0.3)
    lease.acquire()
    lease._stop.set()  # the heartbeat stops, as when its process dies
    assert lease._heartbeat is not None
    lease._heartbeat.join()
    deadline = time.monotonic() + HANG
    while lease_record(lease)["expires"] >= time.time():
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    return lease


def note(store: Any, directory: str, key: str, at: float) -> str:
    where = join(directory, f"{key}.json")
    if directory == ".failures":
        record: Any = FailureNote(at=at, error="ValueError: boom", pid=1, host="h")
    else:
        record = QuarantineNote(key=key, at=at, reason="a test")
    store.write(where, encode(record))
    return where


def kinds(items: Any) -> list[tuple[str, str]]:
    return sorted((i.kind, i.where) for i in items)


def staged(store: Any, final: str, data: bytes = b"half a file") -> str:
    """A staging area never committed (its writer died); its prefix."""
    staging = store.stage(final)
    staging.write("graph.bin", data)
    return staging.prefix


def all_verify(store: Any, keys: list[str]) -> None:
    results = verify_entries(store)
    assert sorted((r.key, r.ok) for r in results) == [(k, True) for k in sorted(keys)], results


# ----------------------------------------------------------------- plan and removal
def test_what_killed_writers_left_goes_and_what_is_live_stays(tier, source):
    assert promote_entry(source, tier, KEY_A)
    old_staging = staged(tier, KEY_A)  # a second promoter of A, killed mid-upload
    young_staging = staged(tier, KEY_B)  # a live promoter of B
    if can_age(tier):
        age(tier, old_staging, 7 * HOURS)
    dead = dead_lease(tier, KEY_C)
    held = LeaseLock(tier, join(".locks", KEY_D), lease_duration=30.0)
    held.acquire()
    try:
        now = time.time()
        old_failure = note(tier, ".failures", KEY_B, now - 400)
        young_failure = note(tier, ".failures", KEY_C, now - 10)
        old_quarantine = note(tier, ".quarantine", KEY_C, now - 8 * DAYS)
        young_quarantine = note(tier, ".quarantine", KEY_D, now - 1 * DAYS)

        plan = plan_gc(tier, lease_grace=0.0, failure_max_age=300.0)
        planned = kinds(plan.items)
        staging_kind = "staging" if tier.capabilities.atomic_rename else "orphan-version"
        expected = [("failure-note", old_failure), ("lease", f".locks/{KEY_C}"),
                    ("quarantine-note", old_quarantine)]
        if can_age(tier):
            expected.append((staging_kind, old_staging))
        assert planned == sorted(expected)
        kept = kinds(plan.kept)
        assert (staging_kind, young_staging) in kept
        assert ("lease", f".locks/{KEY_D}") in kept  # held: never planned
        assert ("failure-note", young_failure) in kept
        assert ("quarantine-note", young_quarantine) in kept
        assert [i.reason for i in plan.kept if i.where == f".locks/{KEY_D}"][0].startswith(
            "held by ")

        outcome = plan.execute()
        assert kinds(outcome.removed) == planned and not outcome.failed and not outcome.stayed
        assert tier.exists(young_failure) and not tier.exists(old_failure)
        assert tier.list(young_staging)
        assert bool(tier.list(old_staging)) is not can_age(tier)
        assert not tier.list_dir(f".locks/{KEY_C}")
        held.check()  # the live holder still holds its lease
        assert dead.store.read(join(".locks", KEY_D, "000000000001")) is not None
        # Nothing else changed: the published entry is whole.
        all_verify(tier, [KEY_A])
        assert entry_is_right_in(tier, KEY_A)
    finally:
        held.release()


def entry_is_right_in(store: Any, key: str) -> bool:
    """The published entry's bytes are the fake compile's (read through the store)."""
    from cache_workers import expected_files

    prefix = store.published(key)
    return prefix is not None and all(
        store.read(join(prefix, name)) == data for name, data in expected_files(key).items()
    )


def test_everything_old_is_removed_and_nothing_published(tier, source):
    """As of seven hours later, every kind of debris is planned; the entries all stay."""
    assert promote_entry(source, tier, KEY_A)
    assert promote_entry(source, tier, KEY_B)
    debris = {staged(tier, KEY_A), staged(tier, KEY_C)}
    if tier.capabilities.atomic_rename:
        tier.write(".trash/0123456789abcdef0123456789abcdef/graph.bin", b"withdrawn")
        debris.add(".trash/0123456789abcdef0123456789abcdef")
    else:  # a withdrawal killed while it held B's version
        version = tier.publication(KEY_B).version
        tomb = join(KEY_B, ".v", f"withdraw-{version}")
        assert tier.create(join(tomb, "owner"), b"h:1 at 0")
        debris.add(tomb)
    if tier.capabilities.local_paths:  # a writer killed between its temp file and rename
        tmp = f".failures/{KEY_D}.json.{uuid.uuid4().hex}.partial"
        os.makedirs(os.path.dirname(tier.local_path(tmp)))
        with open(tier.local_path(tmp), "wb") as f:
            f.write(b"{")
        debris.add(tmp)
    released = LeaseLock(tier, join(".locks", KEY_A), lease_duration=30.0)
    released.acquire()
    released.release()

    plan = plan_gc(tier, now=time.time() + 7 * HOURS)
    assert {i.where for i in plan.items} == debris | {f".locks/{KEY_A}"}
    assert not plan.missing and not [i for i in plan.kept if i.kind != "entry"]
    outcome = plan.execute()
    assert len(outcome.removed) == len(plan.items) and not outcome.failed
    after = tier.survey(older_than=0.0, lease_grace=0.0, now=time.time() + 7 * HOURS)
    assert after.debris == [] and after.kept == []
    assert sorted(after.published) == [KEY_A, KEY_B]
    all_verify(tier, [KEY_A, KEY_B])
    # The withdrawal the tombstone held can happen again.
    assert tier.unpublish(KEY_B, version=tier.publication(KEY_B).version)


def test_what_changed_since_the_plan_stays(tier, source):
    """A staging area written to, or committed, after the plan; a lease taken again."""
    assert promote_entry(source, tier, KEY_A)
    staging = tier.stage(KEY_B)
    staging.write("graph.bin", b"slow writer")
    dead_lease(tier, KEY_C)
    if can_age(tier):
        age(tier, staging.prefix, 7 * HOURS)
    plan = plan_gc(tier, lease_grace=0.0, now=time.time() + (0 if can_age(tier) else 7 * HOURS))
    assert kinds(plan.items) == sorted([
        ("staging" if tier.capabilities.atomic_rename else "orphan-version", staging.prefix),
        ("lease", f".locks/{KEY_C}")])

    taker = LeaseLock(tier, join(".locks", KEY_C), lease_duration=30.0)
    taker.acquire(timeout=HANG)  # the expired lease is taken over meanwhile
    try:
        if tier.capabilities.atomic_rename:
            staging.write("more.bin", b"the writer was alive")  # a new file: touched
        else:
            staging.write("more.bin", b"the writer was alive")
            assert staging.commit()  # ... and committed its version
        outcome = plan.execute()
        assert not outcome.removed and not outcome.failed
        assert sorted(i.where for i, _ in outcome.stayed) == sorted(
            [staging.prefix, f".locks/{KEY_C}"])
        taker.check()  # the new holder's generation is untouched
        assert lease_record(taker)["generation"] == 2
    finally:
        taker.release()
    if not tier.capabilities.atomic_rename:
        assert tier.read(join(tier.published(KEY_B), "more.bin")) == b"the writer was alive"


def test_an_unfinished_multipart_upload_is_aborted(s3_env, s3_store_url, s3_admin):
    tier = open_store(s3_store_url)
    bucket, _, prefix = s3_store_url[len("s3://"):].partition("/")
    key = f"{prefix}/{KEY_A}/.v/{'1' * 32}/graph.neff"
    upload = s3_admin.create_multipart_upload(Bucket=bucket, Key=key)
    s3_admin.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1,
                         Body=b"x" * 1024)
    # Now: a part just arrived, so the upload (and the version it writes) is live.
    plan = plan_gc(tier)
    assert plan.items == ()
    assert ("upload", f"{KEY_A}/.v/{'1' * 32}/graph.neff") in kinds(plan.kept)
    # Seven hours on, it is abandoned.
    plan = plan_gc(tier, now=time.time() + 7 * HOURS)
    assert kinds(plan.items) == [("upload", f"{KEY_A}/.v/{'1' * 32}/graph.neff")]
    assert plan.execute().removed
    assert s3_admin.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_young_upload_keeps_the_version_it_writes_into(s3_env, s3_store_url, s3_admin):
    """A version whose visible files are old but whose multipart upload is still sending
    parts is being written: not an orphan."""
    tier = open_store(s3_store_url)
    version = staged(tier, KEY_A)
    bucket, _, prefix = s3_store_url[len("s3://"):].partition("/")
    key = f"{prefix}/{version}/graph.neff"
    upload = s3_admin.create_multipart_upload(Bucket=bucket, Key=key)
    s3_admin.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1,
                         Body=b"x" * 1024)
    plan = plan_gc(tier, older_than=3600.0, now=time.time() + 1800.0)
    assert plan.items == ()
    assert [i.reason for i in plan.kept if i.where == version] == [
        "a multipart upload is writing into it"]


# ------------------------------------------------------------------- reachability
def test_keep_removes_only_unreferenced_entries_older_than_the_bound(tier, source):
    for key in (KEY_A, KEY_B, KEY_C):
        assert promote_entry(source, tier, key)
    young = plan_gc(tier, older_than=30 * DAYS, keep={KEY_A, KEY_D})
    assert young.items == () and young.missing == (KEY_D,)
    plan = plan_gc(tier, older_than=30 * DAYS, keep={KEY_A, KEY_D},
                   now=time.time() + 31 * DAYS)
    assert kinds(plan.items) == [("entry", KEY_B), ("entry", KEY_C)]
    assert [(i.where, i.reason) for i in plan.kept if i.kind == "entry"] == [
        (KEY_A, "referenced by a manifest")]
    outcome = plan.execute()
    assert kinds(outcome.removed) == [("entry", KEY_B), ("entry", KEY_C)]
    assert sorted(tier.published_children("")) == [KEY_A]
    all_verify(tier, [KEY_A])


def test_an_entry_republished_since_the_plan_stays(tier, source):
    assert promote_entry(source, tier, KEY_B)
    plan = plan_gc(tier, older_than=1.0, keep={KEY_A}, now=time.time() + 10)
    assert kinds(plan.items) == [("entry", KEY_B)]
    assert tier.unpublish(KEY_B)  # withdrawn (say, quarantined) and published again
    assert promote_entry(source, tier, KEY_B)
    outcome = plan.execute()
    assert [why for _, why in outcome.stayed] == ["withdrawn or republished since the plan"]
    all_verify(tier, [KEY_B])


def test_an_entry_in_use_on_a_local_tier_stays(tmp_path, source):
    tier = open_store(str(tmp_path / "tier"))
    assert promote_entry(source, tier, KEY_B)
    plan = plan_gc(tier, older_than=1.0, keep={KEY_A}, now=time.time() + 10)
    user = tier.lock(KEY_B)  # a process compiling, fetching or verifying it
    user.acquire()
    try:
        outcome = plan.execute()
    finally:
        user.release()
    assert [why for _, why in outcome.stayed] == ["in use (its lock is held)"]
    assert plan.execute().removed  # once free, it goes
    assert tier.published(KEY_B) is None


def test_a_note_whose_key_is_in_use_on_a_local_tier_stays(tmp_path):
    """Whoever rewrites a note on a local tier holds its key's lock (a compile writing its
    failure note): gc compares and removes under that lock, so a rewrite never falls between
    its comparison and its removal; a held lock keeps the note for the next pass."""
    tier = open_store(str(tmp_path / "tier"))
    where = note(tier, ".failures", KEY_C, time.time() - 2 * DAYS)
    plan = plan_gc(tier, failure_max_age=HOURS)
    assert kinds(plan.items) == [("failure-note", where)]
    user = tier.lock(KEY_C)  # a process compiling the key again
    user.acquire()
    try:
        outcome = plan.execute()
    finally:
        user.release()
    assert [why for _, why in outcome.stayed] == ["in use (its key's lock is held)"]
    assert tier.exists(where)
    assert plan.execute().removed and not tier.exists(where)


def test_a_compile_silent_for_hours_keeps_its_staging_area(tmp_path, monkeypatch):
    """A compiler that writes nothing for longer than gc's staging bound (a long Neuron
    compile): the compile refreshes its staging area while it runs, so a starting cache's
    pass never takes it for a killed writer's leftovers."""
    from vllm_neuron.compile.tiers import build as building

    monkeypatch.setattr(building, "STAGING_KEEPALIVE", 0.01)
    refreshed = threading.Event()  # set after each refresh: what the compile waits on
    keep_alive = Staging.keep_alive

    def refresh_and_tell(staging: Staging) -> None:
        keep_alive(staging)
        refreshed.set()

    monkeypatch.setattr(Staging, "keep_alive", refresh_and_tell)
    tier = open_store(str(tmp_path / "tier"))
    planned: list[Any] = []

    def silent_compile(out_dir: str) -> dict[str, Any]:
        with open(os.path.join(out_dir, "graph.bin"), "wb") as f:
            f.write(b"half a graph")
        (prefix,) = [d.prefix for d in tier.survey(older_than=0.0, lease_grace=600.0).debris]
        age(tier, prefix, 7 * HOURS)  # seven hours without a write
        while time.time() - os.stat(out_dir).st_mtime > HOURS:  # until the compile says alive
            refreshed.clear()
            assert refreshed.wait(HANG), "the staging area was never refreshed"
        planned.extend(plan_gc(tier).items)  # a cache starting on the tier now
        return {}

    cache = TwoTierCache(str(tmp_path / "tier"))
    assert cache.wait_for_upkeep()  # its own start's pass is over: the plan below is the one
    result = cache.get_or_compile(KEY_D, silent_compile)
    assert result.source == "compiled"
    assert planned == []
    assert tier.read(join(tier.published(KEY_D), "graph.bin")) == b"half a graph"


def test_a_staging_area_refreshed_after_the_plan_stays(tmp_path):
    """Planned while its compile was silent, executed after the compile said alive."""
    tier = open_store(str(tmp_path / "tier"))
    with tier.stage(KEY_D) as staging:
        with open(os.path.join(staging.output_dir(), "graph.bin"), "wb") as f:
            f.write(b"half a graph")
        age(tier, staging.prefix, 7 * HOURS)
        plan = plan_gc(tier)
        assert kinds(plan.items) == [("staging", staging.prefix)]
        staging.keep_alive()
        outcome = plan.execute()
        assert not outcome.removed and [i.where for i, _ in outcome.stayed] == [staging.prefix]
        assert os.path.isfile(os.path.join(staging.output_dir(), "graph.bin"))


def test_keep_needs_an_age_bound(tier):
    with pytest.raises(ValueError, match="--older-than"):
        plan_gc(tier, keep={KEY_A})


# ------------------------------------------------------------------------- the CLI
def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_manifest(path: Any, keys: list[str]) -> str:
    manifest = Manifest(graphs=[GraphEntry(graph_hash=k) for k in keys])
    path.write_bytes(encode_manifest(manifest))
    return str(path)


@pytest.fixture
def local_tier(tmp_path: Any, source: Any) -> str:
    """A folder tier with KEY_A..KEY_C and an abandoned staging area (seven hours old)."""
    tier = open_store(str(tmp_path / "remote"))
    for key in (KEY_A, KEY_B, KEY_C):
        assert promote_entry(source, tier, key)
    age(tier, staged(tier, KEY_D), 7 * HOURS)
    return str(tmp_path / "remote")


def test_cli_dry_run_then_gc(capsys, local_tier):
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--dry-run")
    assert code == 0
    assert "WHAT" in out and "abandoned staging" in out and "untouched for 7.0h" in out
    assert "dry run: 1 items" in out
    assert open_store(local_tier).list_dir(".staging")
    code, out, _ = run(capsys, "cache", "gc", local_tier)
    assert code == 0 and "removed 1 of 1 items" in out
    assert "removed .staging/" in out and "(abandoned staging, 11 B)" in out
    assert open_store(local_tier).list_dir(".staging") == []
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"] == [] and data["removed"] == [] and data["failed"] == []
    assert data["bounds"]["older_than"] == 6 * HOURS
    assert data["bounds"]["failure_notes"] == 300.0


def test_cli_json_of_the_plan(capsys, local_tier):
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--dry-run", "--json")
    data = json.loads(out)
    assert code == 0 and data["dry_run"] is True and "removed" not in data
    [item] = data["plan"]
    assert item["kind"] == "staging" and item["what"] == "abandoned staging"
    assert item["where"].startswith(".staging/") and item["size"] == len(b"half a file")
    assert 7 * HOURS - 60 < item["age_seconds"] < 7 * HOURS + 60


def test_cli_reads_the_retry_cool_down_from_the_environment(capsys, local_tier, monkeypatch):
    from vllm_neuron.envs import forget_parsed_groups

    note(open_store(local_tier), ".failures", KEY_D, time.time() - 120)
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--dry-run", "--json")
    assert [i["kind"] for i in json.loads(out)["plan"]] == ["staging"]  # 120 s < 300 s
    monkeypatch.setenv("VLLM_NEURON_COMPILE_RETRY_AFTER", "60")
    forget_parsed_groups()
    try:
        code, out, _ = run(capsys, "cache", "gc", local_tier, "--dry-run", "--json")
        assert sorted(i["kind"] for i in json.loads(out)["plan"]) == ["failure-note", "staging"]
        monkeypatch.setenv("VLLM_NEURON_COMPILE_RETRY_AFTER", "soon")
        forget_parsed_groups()
        code, _, err = run(capsys, "cache", "gc", local_tier, "--dry-run")
        assert code == 2 and "VLLM_NEURON_COMPILE_RETRY_AFTER" in err
    finally:
        monkeypatch.delenv("VLLM_NEURON_COMPILE_RETRY_AFTER")
        forget_parsed_groups()


def test_cli_keep_manifest(capsys, local_tier, tmp_path):
    manifest = write_manifest(tmp_path / "live.json", [KEY_A, KEY_D])
    code, _, err = run(capsys, "cache", "gc", local_tier, "--keep-manifest", manifest)
    assert code == 2 and "--older-than" in err  # removing entries needs a stated bound
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--keep-manifest", manifest,
                       "--older-than", "30d", "--dry-run")
    assert code == 0 and "unreferenced entry" not in out  # all younger than 30 days
    assert f"a manifest names {KEY_D}, which this tier does not hold" in out
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--keep-manifest", manifest,
                       "--older-than", "0s", "--dry-run", "--json")
    assert sorted(i["where"] for i in json.loads(out)["plan"] if i["kind"] == "entry") == [
        KEY_B, KEY_C]
    other = write_manifest(tmp_path / "other.json", [KEY_B])
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--keep-manifest", manifest,
                       "--keep-manifest", other, "--older-than", "0s")
    assert code == 0
    assert sorted(open_store(local_tier).published_children("")) == [KEY_A, KEY_B]
    all_verify(open_store(local_tier), [KEY_A, KEY_B])


def test_cli_refuses_manifests_that_name_nothing_or_do_not_load(capsys, local_tier, tmp_path):
    empty = write_manifest(tmp_path / "empty.json", [])
    code, _, err = run(capsys, "cache", "gc", local_tier, "--keep-manifest", empty,
                       "--older-than", "0s")
    assert code == 2 and "name no graph" in err
    code, _, err = run(capsys, "cache", "gc", local_tier, "--keep-manifest",
                       str(tmp_path / "typo.json"), "--older-than", "0s")
    assert code == 2 and "typo.json" in err
    (tmp_path / "garbage.json").write_text("{not json")
    code, _, err = run(capsys, "cache", "gc", local_tier, "--keep-manifest",
                       str(tmp_path / "garbage.json"), "--older-than", "0s")
    assert code == 2
    assert sorted(open_store(local_tier).published_children("")) == [KEY_A, KEY_B, KEY_C]


def test_cli_bad_tiers_and_durations_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "cache", "gc", "s3:/bucket/cache")
    assert code == 2 and "did you mean s3://bucket/cache" in err
    code, _, err = run(capsys, "cache", "gc", str(tmp_path / "nowhere"))
    assert code == 2 and "no compile cache" in err
    code, _, err = run(capsys, "cache", "--cache-dir", str(tmp_path / "nowhere"), "gc")
    assert code == 2
    os.makedirs(tmp_path / "tier")
    code, _, err = run(capsys, "cache", "gc", str(tmp_path / "tier"), "--older-than", "soon")
    assert code == 2 and "cannot parse duration" in err


def test_cli_a_missing_bucket_exits_2(capsys, s3_env):
    code, _, err = run(capsys, "cache", "gc", f"s3://no-such-{uuid.uuid4().hex[:12]}/cache")
    assert code == 2 and "NoSuchBucket" in err


def test_cli_exit_1_when_something_cannot_be_removed(capsys, local_tier, monkeypatch):
    def refuse(self: Any, prefix: str) -> int:
        raise PermissionError(f"cannot delete {prefix}")

    monkeypatch.setattr(LocalStore, "delete_tree", refuse)
    code, out, _ = run(capsys, "cache", "gc", local_tier)
    assert code == 1
    assert "FAILED  .staging/" in out and "1 could not be removed" in out


def test_cli_on_s3(capsys, s3_env, s3_store_url, source, s3_admin):
    tier = open_store(s3_store_url)
    for key in (KEY_A, KEY_B):
        assert promote_entry(source, tier, key)
    orphan = staged(tier, KEY_C)
    dead_lease(tier, KEY_D)
    bucket, _, prefix = s3_store_url[len("s3://"):].partition("/")
    upload = s3_admin.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{orphan}/big.bin")
    s3_admin.upload_part(Bucket=bucket, Key=f"{prefix}/{orphan}/big.bin",
                         UploadId=upload["UploadId"], PartNumber=1, Body=b"x")
    code, out, _ = run(capsys, "cache", "gc", s3_store_url, "--lease-grace", "0s", "--json")
    data = json.loads(out)
    assert code == 0 and [i["where"] for i in data["removed"]] == [f".locks/{KEY_D}"]
    assert {i["where"] for i in data["kept"]} == {orphan, f"{orphan}/big.bin"}
    code, out, _ = run(capsys, "cache", "gc", s3_store_url, "--older-than", "0s")
    assert code == 0 and "removed 2 of 2 items" in out
    assert s3_admin.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert tier.list(orphan) == []
    manifest = Manifest(graphs=[GraphEntry(graph_hash=KEY_A)])
    tier.write("manifests/live/manifest.json", encode_manifest(manifest))
    code, out, _ = run(capsys, "cache", "gc", s3_store_url, "--older-than", "0s",
                       "--keep-manifest", f"{s3_store_url}/manifests/live/manifest.json")
    assert code == 0 and "removed 1 of 1 items" in out, out
    assert tier.published_children("") == [KEY_A]
    all_verify(tier, [KEY_A])


def test_a_gc_killed_mid_delete_is_finished_by_the_next(tmp_path, local_tier):
    """SIGKILLed after its first removal (the `gc.mid-delete` fault point): what it did
    not remove is still debris, nothing published was touched, and the next gc finishes."""
    import subprocess
    import sys

    tier = open_store(local_tier)
    for key in (KEY_A, KEY_B):
        age(tier, staged(tier, key), 7 * HOURS)
    env = dict(os.environ, VLLM_NEURON_FAULT="gc.mid-delete")
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "gc", local_tier],
                          env=env, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == -9, done.stderr
    left = tier.survey(older_than=6 * HOURS, lease_grace=600.0).debris
    assert len(left) == 2 and {d.kind for d in left} == {"staging"}
    all_verify(tier, [KEY_A, KEY_B, KEY_C])
    code = main(["cache", "gc", local_tier])
    assert code == 0
    assert tier.survey(older_than=6 * HOURS, lease_grace=600.0).debris == []
    all_verify(tier, [KEY_A, KEY_B, KEY_C])


def test_keep_never_removes_a_pinned_entry(tier, source):
    from vllm_neuron.compile.upkeep.eviction import pin

    for key in (KEY_B, KEY_C):
        assert promote_entry(source, tier, key)
    assert pin(tier, KEY_C)
    plan = plan_gc(tier, older_than=1.0, keep={KEY_A}, now=time.time() + 10)
    assert kinds(plan.items) == [("entry", KEY_B)]
    assert [(i.where, i.reason) for i in plan.kept] == [(KEY_C, "pinned")]


@pytest.mark.parametrize("profile", ["local", "nfs"])
def test_a_temp_file_being_written_keeps_its_staging_area(tmp_path, profile):
    """A writer copying a big file into a staging area writes a temp file there first:
    the area is in use while that file grows, however old the others are."""
    tier = open_store(str(tmp_path / "tier"), profile=profile)
    prefix = staged(tier, KEY_A)
    tmp = tier.local_path(join(prefix, f"graph.neff.{uuid.uuid4().hex}.partial"))
    with open(tmp, "wb") as f:
        f.write(b"growing")
    past = time.time() - 7 * HOURS
    for path in (tier.local_path(prefix), tier.local_path(join(prefix, "graph.bin"))):
        os.utime(path, (past, past))  # only the temp file is young
    plan = plan_gc(tier)
    assert plan.items == ()
    assert kinds(plan.kept) == [("staging", prefix)]


def test_prune_keeps_failure_notes_for_the_configured_cool_down(capsys, local_tier, monkeypatch):
    """`cache prune` sweeps what killed processes left as `cache gc` does, with the same
    cool-down: a failure note the fleet still raises (younger than the setting) stays."""
    from vllm_neuron.envs import forget_parsed_groups

    note(open_store(local_tier), ".failures", KEY_D, time.time() - 600)  # past the 300 s default
    monkeypatch.setenv("VLLM_NEURON_COMPILE_RETRY_AFTER", "3600")
    forget_parsed_groups()
    try:
        code, out, _ = run(capsys, "cache", "prune", local_tier, "--max-size", "1T", "--json")
        assert code == 0, out
        assert open_store(local_tier).exists(f".failures/{KEY_D}.json")
    finally:
        monkeypatch.delenv("VLLM_NEURON_COMPILE_RETRY_AFTER")
        forget_parsed_groups()
    code, out, _ = run(capsys, "cache", "prune", local_tier, "--max-size", "1T", "--json")
    assert code == 0 and not open_store(local_tier).exists(f".failures/{KEY_D}.json")


# ------------------------------------------------------------------ per-key notes
def load_note(store: Any, key: str, host: str, at: float) -> str:
    """The note host `host` leaves on a remote when it cannot load `key`, dated `at`."""
    where = LOAD_FAILURES.path(key, host)
    store.write(where, encode(LoadFailureNote(key=key, at=at, host=host, error="OSError: no")))
    return where


def test_old_load_failure_notes_on_a_remote_are_collected(tier, source):
    """``.load-failures/<key>/<host>.json`` (one per host that could not load a remote's
    entry) goes once older than the bound and at least a week, like a quarantine note (a
    note for the operators); a younger one stays, and so does the entry it is about."""
    assert promote_entry(source, tier, KEY_B)
    now = time.time()
    old = load_note(tier, KEY_B, "node-1", now - 8 * DAYS)
    young = load_note(tier, KEY_B, "node-2", now - 1 * DAYS)
    gone = load_note(tier, KEY_C, "node-1", now - 9 * DAYS)  # of an entry never published here

    def notes(items: Any) -> list[tuple[str, str]]:
        return [(kind, where) for kind, where in kinds(items) if kind == "load-failure-note"]

    assert notes(plan_gc(tier, older_than=10 * DAYS).items) == []  # a longer bound keeps all
    plan = plan_gc(tier)
    assert notes(plan.items) == sorted([("load-failure-note", old), ("load-failure-note", gone)])
    assert notes(plan.kept) == [("load-failure-note", young)]
    assert {i.what for i in plan.items if i.kind == "load-failure-note"} == {
        "old load-failure note"}
    outcome = plan.execute()
    assert not outcome.failed and not outcome.stayed
    assert not tier.exists(old) and not tier.exists(gone) and tier.exists(young)
    assert {k: [n.host for n in v] for k, v in read_load_failures(tier).items()} == {
        KEY_B: ["node-2"]}
    all_verify(tier, [KEY_B])


def test_cli_gc_of_a_folder_remote_removes_its_old_load_failure_notes(capsys, local_tier):
    tier = open_store(local_tier)
    old = load_note(tier, KEY_A, "node-1", time.time() - 8 * DAYS)
    young = load_note(tier, KEY_A, "node-2", time.time() - 60)
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--dry-run")
    assert code == 0 and f"old load-failure note  {old}" in out, out
    assert "1 load-failure notes (younger than 7.0d)" in out
    code, out, _ = run(capsys, "cache", "gc", local_tier, "--json")
    assert code == 0
    assert [i["where"] for i in json.loads(out)["removed"] if i["kind"] == "load-failure-note"
            ] == [old]  # fmt: skip
    assert not tier.exists(old) and tier.exists(young)


def test_a_load_failure_note_goes_though_its_key_is_in_use(tmp_path):
    """Hosts write their load-failure notes without the key's lock (a node says its word
    whatever the key's state), so gc does not wait for that lock: it compares and removes."""
    tier = open_store(str(tmp_path / "tier"))
    where = load_note(tier, KEY_C, "node-1", time.time() - 8 * DAYS)
    plan = plan_gc(tier)
    assert kinds(plan.items) == [("load-failure-note", where)]
    user = tier.lock(KEY_C)  # a process compiling the key
    user.acquire()
    try:
        outcome = plan.execute()
    finally:
        user.release()
    assert kinds(outcome.removed) == [("load-failure-note", where)] and not tier.exists(where)


DIGEST = FileDigest(size=1, sha256="0" * 64, blake3="e" * 64)
SAMPLES: dict[type, Any] = {
    FailureNote: lambda key, at: FailureNote(at=at, error="ValueError: boom", pid=1, host="h"),
    QuarantineNote: lambda key, at: QuarantineNote(key=key, at=at, reason="a test"),
    OwedPromotion: lambda key, at: OwedPromotion(at=at, remote="s3://b/c", pid=1, host="h"),
    LoadFailureNote: lambda key, at: LoadFailureNote(key=key, at=at, host="h", error="no"),
    Pin: lambda key, at: Pin(key=key, at=at),
    StoppedNote: lambda key, at: StoppedNote(at=at, pid=1),
    UnpackedRecord: lambda key, at: UnpackedRecord(key=key, package="graph.pt2",
                                                   source=DIGEST, files={}, at=at),
}
"""A record of every kind of note: a kind added to the registry needs one here, and then
the test below holds it to its age rule."""


def plant(store: Any, kind: NoteKind[Any], key: str, at: float) -> str:
    """A note of `kind` on `key` (of a key without an entry), as its writer leaves it."""
    record = encode(SAMPLES[kind.record](key, at))
    if kind.layout is Layout.COPY:  # a published directory, its record inside
        staging = store.stage(join(kind.directory, f"{key}-{'e' * TAG_DIGITS}"))
        staging.write("graph/model.so", b"x")
        staging.write("unpacked.json", record)
        assert staging.commit()
        return str(staging.final)
    where = kind.path(key, "node-1")
    store.write(where, record)
    return where


def test_gc_collects_every_registered_kind_of_note_by_its_rule(tier):
    """Every kind `NOTE_KINDS` declares is known to gc: an old note of each (of a key with
    no entry) is planned and removed, but a pin (`Expiry.NEVER`); a young one stays."""
    assert set(SAMPLES) == {kind.record for kind in NOTE_KINDS}, "a new kind needs a sample"
    # Copies of packages are made where entries are loaded: local disk only.
    registered = [k for k in NOTE_KINDS
                  if k.layout is not Layout.COPY or tier.capabilities.local_paths]  # fmt: skip
    planted = {kind.name: plant(tier, kind, KEY_D, time.time()) for kind in registered}

    assert [i for i in plan_gc(tier).items if kind_named(i.kind)] == []  # all young
    plan = plan_gc(tier, now=time.time() + 30 * DAYS)
    collected = {k.name: planted[k.name] for k in registered if k.expiry is not Expiry.NEVER}
    assert {i.kind: i.where for i in plan.items if kind_named(i.kind)} == collected
    assert all(i.what != i.kind for i in plan.items)  # each named as the registry says
    outcome = plan.execute()
    assert not outcome.failed and not outcome.stayed
    left = {name for name, where in planted.items() if tier.exists(where) or tier.list(where)}
    assert left == {k.name for k in registered if k.expiry is Expiry.NEVER} == {"pin"}


def test_a_stopped_compile_note_is_kept_two_cool_downs(tmp_path):
    """``.stopped/<key>.json`` bounds how long failure notes stop a node across restarts;
    collected after one cool-down, a note still rewritten would stop the node anew at once.
    So gc keeps it two (`Expiry.TWO_COOL_DOWNS`)."""
    tier = open_store(str(tmp_path / "tier"))
    kind = kind_named("stopped-note")
    assert kind is not None and kind.expiry is Expiry.TWO_COOL_DOWNS
    now = time.time()
    where = plant(tier, kind, KEY_D, now - 150.0)
    assert not [i for i in plan_gc(tier, failure_max_age=100.0, now=now).items
                if i.kind == kind.name]  # 1.5 cool-downs: kept
    plan = plan_gc(tier, failure_max_age=100.0, now=now + 60.0)  # 2.1 cool-downs
    assert [i.where for i in plan.items if i.kind == kind.name] == [where]


def test_the_cli_names_every_kind_of_note_it_kept():
    from vllm_neuron.cli.cache_gc import KEPT
    from vllm_neuron.compile.upkeep.collect import WHAT

    for kind in NOTE_KINDS:
        assert KEPT[kind.name] == kind.plural and WHAT[kind.name] == kind.what


@pytest.mark.parametrize("junk", ["²", "٣", "000000000000", "notes.txt", "1e3"])
def test_junk_names_in_a_lease_folder_neither_crash_gc_nor_pass_for_records(tier, junk):
    """A writer without a key puts a file named like no lease record (a superscript or an
    Arabic-Indic digit, which `str.isdigit` accepts and `int` may refuse; zero; a note) in a
    key's lease folder: `cache gc` plans and executes without raising, and leaves the junk
    alone (no lease judged from it), while the key's real, released lease record is still
    collected once old."""
    lease = dead_lease(tier, "junk")
    folder = lease.directory
    tier.write(join(folder, junk), b"{}")
    plan = plan_gc(tier, lease_grace=0.0, now=time.time() + 3600)
    planned = {item.where for item in plan.items}
    assert join(folder, junk) not in planned
    assert any(item.kind == "lease" and item.where.startswith(folder) for item in plan.items), \
        plan.items
    outcome = plan.execute()
    assert not outcome.failed, outcome.failed
    assert tier.read(join(folder, junk)) == b"{}"
