"""A defective remote entry is a detected problem, never a silent miss, and it is repaired.

On S3 (moto's real HTTP API) a commit record that does not read, or names a version whose
files are gone, used to read as "unpublished": `cache ls`/`verify` showed nothing, a
promotion answered "already in the remote tier" and every node recompiled without a word.
Now `ls` shows it, `verify` exits 1 naming it, a node compiles with one warning and its
promotion repairs the remote, and so do `save_cache` and `cache promote`. On a POSIX remote
the analogue is a published directory without a readable entry record. A withdrawal is
of the version judged: an entry another node has republished since stays.
"""

from __future__ import annotations

import json
import os

import pytest
from cache_workers import entry_is_right

from vllm_neuron.backends import Store, open_store
from vllm_neuron.cli import main
from vllm_neuron.compile import save_cache
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.inventory import list_entries, verify_entries
from vllm_neuron.compile.tiers.quarantine import quarantine_entry, read_quarantine_note

KEY = "0123456789abcdef0123456789abcdef"


@pytest.fixture(params=["s3", "posix"])
def remote(request, tmp_path) -> str:
    """A remote tier URL: S3 on moto, or a POSIX directory."""
    if request.param == "posix":
        return str(tmp_path / "remote")
    request.getfixturevalue("s3_env")
    return request.getfixturevalue("s3_store_url")


def _promoted(tmp_path, compile_fn, remote: str, name: str = "builder") -> str:
    builder = str(tmp_path / name)
    TwoTierCache(builder).get_or_compile(KEY, compile_fn(KEY))
    assert save_cache(builder, remote, KEY) is True
    return builder


def _break(store: Store, how: str) -> None:
    """Damage the published entry `KEY` as a torn or foreign write would."""
    found = store.publication(KEY)
    assert found.state == "published" and found.prefix is not None
    commit_records = not store.capabilities.atomic_rename
    if how == "garbage record":  # the publication's own record
        if commit_records:
            store.write(f"{KEY}/.commit", b"\x00{not a commit record")
        else:  # a directory's analogue: its entry record
            store.write(f"{found.prefix}/entry.json", b"\x00{not an entry record")
    elif how == "missing version":
        if commit_records:
            store.delete_tree(found.prefix)
        else:
            assert store.delete(f"{found.prefix}/entry.json")
    else:
        raise AssertionError(how)


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def _remote_serves(tmp_path, compile_fn, remote: str, name: str) -> None:
    consumer = TwoTierCache(str(tmp_path / name), remote=remote)
    result = consumer.get_or_compile(KEY, compile_fn(KEY, fail="must not compile"))
    assert result.source == "remote"
    assert entry_is_right(result.path, KEY) is None


@pytest.mark.parametrize("how", ["garbage record", "missing version"])
def test_ls_and_verify_report_a_broken_remote_entry(tmp_path, compile_fn, capsys, remote, how):
    _promoted(tmp_path, compile_fn, remote)
    _break(open_store(remote), how)
    code, out = run(capsys, "cache", "ls", remote, "--json")
    assert code == 0
    [entry] = json.loads(out)
    assert entry["key"] == KEY and entry["problem"], entry
    code, out = run(capsys, "cache", "ls", remote)
    assert code == 0 and KEY in out and "1 entries" in out
    code, out = run(capsys, "cache", "verify", remote, "--keep")
    assert code == 1
    assert f"CORRUPT {KEY}" in out and "1 corrupt (reported)" in out
    assert open_store(remote).publication(KEY).state != "absent"  # --keep: still there


def test_verify_quarantines_a_garbage_commit_record(tmp_path, compile_fn, capsys, remote):
    _promoted(tmp_path, compile_fn, remote)
    _break(open_store(remote), "garbage record")
    code, out = run(capsys, "cache", "verify", remote)
    assert code == 1 and f"CORRUPT {KEY}" in out and "(quarantined)" in out
    store = open_store(remote)
    assert store.publication(KEY).state == "absent"
    note = read_quarantine_note(store, KEY)
    assert note is not None and note.key == KEY
    assert run(capsys, "cache", "verify", remote)[0] == 0  # nothing left to complain about


@pytest.mark.parametrize("how", ["garbage record", "missing version"])
def test_a_node_compiles_with_one_warning_and_its_promotion_repairs_the_remote(
    tmp_path, compile_fn, cache_warnings, remote, how
):
    _promoted(tmp_path, compile_fn, remote)
    _break(open_store(remote), how)
    node = TwoTierCache(str(tmp_path / "node"), remote=remote)  # VLLM_NEURON_REMOTE_WRITE=auto
    result = node.get_or_compile(KEY, compile_fn(KEY))
    assert result.source == "compiled"
    assert entry_is_right(result.path, KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1, warnings
    assert KEY in warnings[0] and open_store(remote).url in warnings[0]
    store = open_store(remote)
    assert store.publication(KEY).state == "published"  # promoted after the compile
    assert [(r.key, r.ok) for r in verify_entries(store)] == [(KEY, True)]
    _remote_serves(tmp_path, compile_fn, remote, "consumer")


@pytest.mark.parametrize("how", ["garbage record", "missing version"])
def test_save_cache_repairs_a_broken_remote_entry(
    tmp_path, compile_fn, cache_warnings, remote, how
):
    builder = _promoted(tmp_path, compile_fn, remote)
    assert save_cache(builder, remote, KEY) is False  # sound: already there
    _break(open_store(remote), how)
    assert save_cache(builder, remote, KEY) is True  # not "already in the remote tier"
    [warning] = cache_warnings()
    assert KEY in warning
    assert [(e.key, e.problem) for e in list_entries(open_store(remote))] == [(KEY, None)]
    _remote_serves(tmp_path, compile_fn, remote, "consumer")


def test_cache_promote_repairs_a_garbage_commit_record(tmp_path, compile_fn, capsys, remote):
    builder = _promoted(tmp_path, compile_fn, remote)
    _break(open_store(remote), "garbage record")
    code, out = run(capsys, "cache", "--cache-dir", builder, "promote", "--to", remote,
                    "--key", KEY)  # fmt: skip
    assert code == 0 and f"{KEY}: promoted" in out
    assert run(capsys, "cache", "verify", remote)[0] == 0


def test_quarantine_of_a_stale_version_leaves_the_republished_entry(
    tmp_path, compile_fn, remote
):
    builder = _promoted(tmp_path, compile_fn, remote)
    store = open_store(remote)
    judged = store.publication(KEY).version  # a node judges this one corrupt ...
    assert store.unpublish(KEY) is True  # ... while another withdraws it and republishes
    assert save_cache(builder, remote, KEY) is True
    assert quarantine_entry(store, KEY, "stale judgement", version=judged) is False
    assert store.publication(KEY).state == "published"
    _remote_serves(tmp_path, compile_fn, remote, "consumer")
    assert quarantine_entry(store, KEY, "judged now", version=store.publication(KEY).version)
    assert store.publication(KEY).state == "absent"


def test_prune_withdraws_the_version_it_planned(tmp_path, compile_fn, capsys, remote):
    from vllm_neuron.compile.commands.prune import plan_prune

    builder = _promoted(tmp_path, compile_fn, remote)
    store = open_store(remote)
    plan = plan_prune(store, older_than=0.0)
    assert [e.key for e in plan.delete] == [KEY]
    assert store.unpublish(KEY) is True  # republished between the plan and its execution
    assert save_cache(builder, remote, KEY) is True
    assert plan.execute() == 0
    assert store.publication(KEY).state == "published"
    assert os.path.isdir(builder)


def test_verify_quarantines_the_version_it_judged(tmp_path, compile_fn, remote):
    builder = _promoted(tmp_path, compile_fn, remote)
    store = open_store(remote)
    _break(store, "garbage record")
    withdrawn: list[bool] = []

    def quarantine(key: str, problem: str, version: str | None) -> None:
        # Judged broken; meanwhile another node withdraws it and publishes a sound entry.
        assert store.unpublish(key) is True
        assert save_cache(builder, remote, key) is True
        withdrawn.append(quarantine_entry(store, key, problem, version=version))

    [result] = verify_entries(store, quarantine=quarantine)
    assert not result.ok and result.version is not None
    assert withdrawn == [False]  # the stale judgement withdrew nothing
    assert [(r.key, r.ok) for r in verify_entries(store)] == [(KEY, True)]
