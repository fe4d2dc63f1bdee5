"""Runs: a manifest lists what its own run compiled, never a crashed earlier run's graphs.

Every process of one engine run writes under ``ledger/<prefix>/<run>/`` (the run id is
inherited from the run's first process); the emit folds that directory only.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from manifest_fixtures import SEED_KEY
from test_manifest_e2e import SEED_CONFIG, run_ranks

from vllm_neuron import envs
from vllm_neuron.backends import open_store
from vllm_neuron.manifest import LedgerWriter, ManifestConfig, emit_manifest
from vllm_neuron.manifest.fold import fold_ledger

OLD_KEY = "0dd" + "0" * 29

# A server's first process as the general plugin leaves it (run id fixed before any engine
# process starts), two rank processes started by spawn like vLLM's workers, then a warm-up
# that never ends: the test kills it with SIGKILL, so it never emits.
EARLIER_SERVER = textwrap.dedent("""
    import multiprocessing
    import sys

    from vllm_neuron import envs
    from vllm_neuron.manifest import LedgerWriter


    def rank(manifest_dir: str, r: int) -> None:
        assert LedgerWriter(manifest_dir).record(sys.argv[2], rank=r, input_shapes=["8,"],
                                                 compiler_flags="--old")


    if __name__ == "__main__":
        print(envs.run_id(), flush=True)
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=rank, args=(sys.argv[1], r)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            assert p.exitcode == 0
        print("compiled", flush=True)
        sys.stdin.read()
""")


def start_earlier_server(tmp_path, manifest_dir: str) -> tuple[subprocess.Popen[str], str]:
    script = tmp_path / "earlier_server.py"
    script.write_text(EARLIER_SERVER)
    # A new server starts from a shell that never had a run id.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_RUN_ID"}
    env["NEURON_VISIBLE_DEVICES"] = "0-7"
    proc = subprocess.Popen([sys.executable, str(script), manifest_dir, OLD_KEY], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    run = proc.stdout.readline().strip()
    assert proc.stdout.readline().strip() == "compiled", "the earlier server failed"
    return proc, run


def test_emit_leaves_out_and_removes_a_killed_earlier_server_s_segments(
    tmp_path, cache_root, monkeypatch, caplog, engine_run
):
    manifest_dir = str(tmp_path / "manifests")
    ledger = tmp_path / "manifests" / "ledger" / "dev0_7"
    earlier, old_run = start_earlier_server(tmp_path, manifest_dir)
    earlier.kill()  # SIGKILL during warm-up: its manifest is never emitted
    assert earlier.wait() == -9
    for pipe in (earlier.stdin, earlier.stdout):
        assert pipe is not None
        pipe.close()
    assert old_run != engine_run
    # Both of its ranks (other processes, other pids) wrote into its one run directory.
    old_segments = sorted(p.name for p in (ledger / old_run).glob("*.jsonl"))
    assert len(old_segments) == 2 and f"{os.getpid()}.jsonl" not in old_segments

    # This run: two rank processes (spawned, inheriting this run's id) and the emitter.
    run_ranks(manifest_dir, "0-7", [0, 1])
    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "0-7")
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.manifest"):
        manifest = emit_manifest(manifest_dir, SEED_CONFIG, cache_root=cache_root,
                                 environment={})

    assert [(g.graph_hash, g.ranks) for g in manifest.graphs] == [(SEED_KEY, [0, 1])]
    written = json.loads((tmp_path / "manifests" / "dev0_7" / "manifest.json").read_bytes())
    assert [g["graph_hash"] for g in written["graphs"]] == [SEED_KEY]
    assert "left out 2 ledger segment(s) of dev0_7" in caplog.text
    assert old_run in caplog.text and ", removed" in caplog.text
    assert not ledger.exists()  # the crashed run's segments are gone with this run's


def test_fold_reads_one_run_and_names_every_other_segment(tmp_path, monkeypatch, caplog):
    store = open_store(str(tmp_path))
    monkeypatch.delenv("NEURON_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "earlier")
    LedgerWriter(store).record(OLD_KEY, rank=0, input_shapes=[], compiler_flags="")
    # A segment of a version of this package without run ids: of no run of ours.
    store.write("ledger/nodev/4242.jsonl", (tmp_path / "ledger" / "nodev" / "earlier"
                                            / f"{os.getpid()}.jsonl").read_bytes())
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "current")
    for rank in (0, 1):  # a new writer resolves its segment in the current run
        LedgerWriter(store).record(SEED_KEY, rank=rank, global_rank=rank, input_shapes=[],
                                   compiler_flags="")

    fold = fold_ledger(store, "nodev")
    assert {k: g.ranks for k, g in fold.graphs().items()} == {SEED_KEY: [0, 1]}
    assert fold.stale == ["ledger/nodev/4242.jsonl", f"ledger/nodev/earlier/{os.getpid()}.jsonl"]
    assert list(fold_ledger(store, "nodev", run="earlier").graphs()) == [OLD_KEY]

    with caplog.at_level(logging.WARNING, logger="vllm_neuron.manifest"):
        kept = emit_manifest(store, ManifestConfig(), cache_root=None, prefix="nodev",
                             environment={}, cleanup=False)
    assert [g.graph_hash for g in kept.graphs] == [SEED_KEY]
    assert "left out 2 ledger segment(s) of nodev" in caplog.text
    assert len(store.list("ledger/nodev")) == 3  # without cleanup nothing is removed
    emit_manifest(store, ManifestConfig(), cache_root=None, prefix="nodev", environment={})
    assert store.list("ledger") == []


def test_a_forked_compile_worker_writes_into_its_parent_s_run(tmp_path, engine_run):
    store = open_store(str(tmp_path))
    writer = LedgerWriter(store)
    writer.record(SEED_KEY, rank=0, input_shapes=[], compiler_flags="")
    pid = os.fork()
    if pid == 0:
        writer.record(OLD_KEY, rank=0, input_shapes=[], compiler_flags="")
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert sorted(fold_ledger(store, "nodev").graphs()) == sorted([SEED_KEY, OLD_KEY])
    assert store.read(f"ledger/nodev/{engine_run}/{pid}.jsonl")


def test_the_first_process_of_a_run_creates_the_id_and_exports_it(monkeypatch):
    monkeypatch.delenv("VLLM_NEURON_RUN_ID")
    first = envs.run_id()
    assert os.environ["VLLM_NEURON_RUN_ID"] == first == envs.run_id()
    assert envs.load_run_id({"VLLM_NEURON_RUN_ID": first}) == first
    child = subprocess.run(
        [sys.executable, "-c", "from vllm_neuron import envs; print(envs.run_id())"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert child.stdout.strip() == first  # inherited, not created again


def test_a_malformed_run_id_stops_the_compile_naming_it(tmp_path, monkeypatch):
    from vllm_neuron.manifest.recorder import install_recorder

    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "../other")
    with pytest.raises(envs.ConfigError, match=r"VLLM_NEURON_RUN_ID='\.\./other'"):
        install_recorder(object(), str(tmp_path))  # type: ignore[arg-type]  # raises first
