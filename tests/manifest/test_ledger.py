"""The ledger: durable lines, one file per writer, stale files truncated, torn lines skipped."""

from __future__ import annotations

import json
import logging
import os

import pytest

from vllm_neuron.backends import encode_line, open_store
from vllm_neuron.manifest import LedgerEntry, LedgerWriter, ManifestConfig, emit_manifest
from vllm_neuron.manifest.fold import fold_ledger
from vllm_neuron.manifest.ledger import format_shape, sanitize_compiler_flags

KEY_A, KEY_B = "a" * 32, "b" * 32


def test_line_survives_os_exit_in_a_forked_child(tmp_path, monkeypatch, engine_run):
    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "0-1")
    writer = LedgerWriter(str(tmp_path))
    pid = os.fork()
    if pid == 0:  # the child records and exits without flushing anything
        writer.record(KEY_A, rank=1, input_shapes=["2,"], compiler_flags="-O1")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    segment = tmp_path / "ledger" / "dev0_1" / engine_run / f"{pid}.jsonl"
    line = json.loads(segment.read_bytes())
    assert (line["key"], line["rank"], line["input_shapes"]) == (KEY_A, 1, ["2,"])
    # The parent never wrote, so it has no file of its own.
    assert not (segment.parent / f"{os.getpid()}.jsonl").exists()


def test_first_write_truncates_a_stale_same_pid_file(tmp_path, monkeypatch, engine_run):
    monkeypatch.delenv("NEURON_VISIBLE_DEVICES", raising=False)
    stale = tmp_path / "ledger" / "nodev" / engine_run / f"{os.getpid()}.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"type": "ledger", "key": KEY_B, "rank": 0, "input_shapes": [],
                                 "compiler_flags": ""}) + "\n")
    writer = LedgerWriter(str(tmp_path))
    writer.record(KEY_A, rank=0, input_shapes=[], compiler_flags="")
    writer.record(KEY_A, rank=0, input_shapes=[], compiler_flags="")  # later writes append
    keys = [json.loads(line)["key"] for line in stale.read_text().splitlines()]
    assert keys == [KEY_A, KEY_A]


def test_torn_last_line_is_skipped_and_counted(tmp_path, caplog):
    store = open_store(str(tmp_path))
    writer = LedgerWriter(store)
    writer.record(KEY_A, rank=0, input_shapes=["4,"], compiler_flags="")
    segment = store.log("ledger/nodev").segments()[0]
    path = store.local_path(segment)
    with open(path, "ab") as f:
        f.write(b'{"type":"ledger","key":"' + KEY_B.encode() + b'","ra')  # a crash mid-write
    fold = fold_ledger(store, "nodev")
    assert list(fold.graphs()) == [KEY_A] and fold.skipped == 1
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.manifest"):
        manifest = emit_manifest(store, ManifestConfig(), cache_root=None, prefix="nodev",
                                 environment={})
    assert [g.graph_hash for g in manifest.graphs] == [KEY_A]
    assert "skipped 1 undecodable ledger line" in caplog.text


def test_unwritable_ledger_is_logged_once_and_swallowed(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the manifest dir should be")
    writer = LedgerWriter(str(blocker))
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.manifest"):
        assert writer.record(KEY_A, rank=0, input_shapes=[], compiler_flags="") is False
        assert writer.record(KEY_B, rank=0, input_shapes=[], compiler_flags="") is False
    warnings = [r for r in caplog.records if "cannot write the compile ledger" in r.message]
    assert len(warnings) == 1 and "VLLM_NEURON_MANIFEST_DIR" in warnings[0].message


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((4,), "4,"), ((4, 8), "4, 8"), ((), ""), ((1, 2, 3), "1, 2, 3")],
)
def test_shape_strings_follow_the_seed(shape, expected):
    assert format_shape(shape) == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("--target trn2 --logfile /tmp/x.log -O1", "--target trn2 -O1"),
        ("--target=trn2 --workdir=/home/u/w --auto-cast=none", "--target=trn2 --auto-cast=none"),
        (["--framework", "XLA", "/abs/graph.hlo", "--cache_dir", "~/c"], "--framework XLA"),
        ("--model-type=transformer", "--model-type=transformer"),
    ],
)
def test_machine_specific_paths_are_removed_from_flags(flags, expected):
    assert sanitize_compiler_flags(flags) == expected


def test_ledger_entry_keeps_the_seed_fields(tmp_path):
    store = open_store(str(tmp_path))
    LedgerWriter(store).record(KEY_A, rank=3, input_shapes=["4,"], compiler_flags="--x 1")
    (segment,) = store.log("ledger/nodev").segments()
    line = json.loads(store.read(segment) or b"")
    assert line == {"type": "ledger", "key": KEY_A, "rank": 3, "input_shapes": ["4,"],
                    "compiler_flags": "--x 1"}
    decoded = store.log("ledger/nodev").read([LedgerEntry]).records
    assert decoded == [LedgerEntry(key=KEY_A, rank=3, input_shapes=["4,"],
                                   compiler_flags="--x 1")]


def test_a_line_without_v_is_version_1_and_a_global_rank_is_written():
    # Defaults are omitted from ledger lines, so "no v" must keep meaning version 1: a
    # version bump has to write v explicitly instead of changing the default.
    fields, defaults = LedgerEntry.__struct_fields__, LedgerEntry.__struct_defaults__
    assert dict(zip(fields[len(fields) - len(defaults):], defaults, strict=True))["v"] == 1
    line = json.loads(encode_line(LedgerEntry(key=KEY_A, rank=0, input_shapes=[],
                                              compiler_flags="", global_rank=7)))
    assert line["global_rank"] == 7 and "v" not in line


def test_threads_and_a_forked_child_each_write_whole_lines(tmp_path, engine_run):
    # The first recording thread owns the writer's fast path (a reused line buffer); other
    # threads must never share that buffer, and a forked child must write its own segment.
    import threading

    store = open_store(str(tmp_path))
    writer = LedgerWriter(store)
    per_thread = 2000

    def work(rank: int) -> None:
        for i in range(per_thread):
            writer.record(f"{i % 7:032x}", rank=rank, input_shapes=[f"{rank}, {i}"],
                          compiler_flags=f"--rank {rank}")

    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pid = os.fork()
    if pid == 0:  # the child: one line, then an exit that skips every flush
        writer.record(KEY_B, rank=9, input_shapes=[], compiler_flags="")
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    decoded = store.log("ledger/nodev").read([LedgerEntry])
    assert decoded.skipped == 0
    ours = [e for e in decoded.records if e.rank != 9]
    assert len(ours) == 4 * per_thread
    assert all(e.input_shapes[0].startswith(f"{e.rank}, ")
               and e.compiler_flags == f"--rank {e.rank}" for e in ours)
    segments = store.log("ledger/nodev").segments()
    run = f"ledger/nodev/{engine_run}"
    assert sorted(segments) == sorted([f"{run}/{os.getpid()}.jsonl", f"{run}/{pid}.jsonl"])
    child = store.read(f"{run}/{pid}.jsonl") or b""
    assert json.loads(child)["key"] == KEY_B
