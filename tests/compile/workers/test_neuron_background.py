"""The Neuron toolchain compiles a process's graphs side by side while it traces on: each
graph is lowered to HLO in the tracing thread and ``neuronx-cc`` - a process of its own - runs
from a thread of the cache, within the node's compile slots
(compile/workers/job_dirs.py LoweredJob).

The Neuron stack exists only on Trainium; these tests run the toolchain's own code on a fake
of it (tests/compile/helpers/fake_neuron: a lowering that writes the graph's code as its
"HLO", and a
``neuronx-cc`` executable whose NEFF is a digest of it). Concurrency is asserted by a
handshake, never a clock: the fake compiler does not finish until two compiles have started,
so compiles run one after another would fail; and from the cache's events.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from cache_workers import SAFETY, wait_until_gone, worker_env
from fake_neuron import HERE as FAKE_NEURON
from fake_neuron import installed

from vllm_neuron.backends import RecordCodec, open_store
from vllm_neuron.compile.entry.events import (
    CACHE_EVENTS,
    EVENTS_STREAM,
    Compiled,
    CompileFailed,
    Deferred,
)
from vllm_neuron.compile.entry.failure_notes import FAILURES_DIR
from vllm_neuron.compile.toolchains.neuron import (
    HLO_NAME,
    METANEFF_NAME,
    NEFF_NAME,
    NeuronToolchain,
)

_EVENTS = RecordCodec(CACHE_EVENTS)


def _engine(tmp_path: Path, widths: list[int], **env: str) -> tuple[dict[str, Any], list[Any]]:
    """One process compiling `widths` graphs as pieces on the fake Neuron stack: its
    result and its cache events."""
    root = tmp_path / "root"
    proc = subprocess.run(
        [sys.executable, os.path.join(FAKE_NEURON, "pieces.py"), json.dumps(widths),
         str(tmp_path / "bin")],
        env=worker_env(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_TOOLCHAIN="neuron", **env),
        capture_output=True, text=True, timeout=SAFETY)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    tier = open_store(str(root / "neuron" / "compile_cache"), create=False)
    events = []
    for segment, data in tier.log(EVENTS_STREAM).segment_data():
        if posixpath.basename(segment).removesuffix(".jsonl") == result["writer"]:
            events.extend(_EVENTS.decode_lines(data).records)
    result["entries"] = {g["key"]: tier.local_path(g["key"]) for g in result["graphs"]}
    return result, events


def _neff_of(hlo: bytes) -> str:
    return "NEFF " + hashlib.sha256(hlo).hexdigest()


@pytest.mark.timeout(2 * SAFETY)
def test_a_neuron_engine_compiles_its_graphs_two_at_a_time_while_it_traces_on(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    result, events = _engine(tmp_path, [16, 24, 32, 40], VLLM_NEURON_COMPILE_WORKERS="2",
                             FAKE_NEURONX_CC_TOGETHER=f"{meet}:2")

    graphs = result["graphs"]
    assert len({g["key"] for g in graphs}) == 4
    assert all(g["deferred"] for g in graphs), graphs  # traced on: none compiled in place
    for g in graphs:  # every first call ran what the compiler made of that graph's HLO
        entry = Path(result["entries"][g["key"]])
        assert "error" not in g, g
        assert sorted(os.listdir(entry)) == sorted([HLO_NAME, METANEFF_NAME, NEFF_NAME,
                                                    "entry.json"]), os.listdir(entry)
        assert g["output"] == _neff_of((entry / HLO_NAME).read_bytes())
    handed = {e.key for e in events if isinstance(e, Deferred) and e.reason == "worker"}
    spans = sorted((e.at - e.seconds, e.at) for e in events if isinstance(e, Compiled))
    assert handed == {g["key"] for g in graphs} and len(spans) == 4, events
    (a0, a1), (b0, b1) = spans[:2]
    assert b0 < a1, spans  # the first two compiles ran at once (the handshake says so too)
    assert len([t for t in os.listdir(meet) if t.startswith("ticket")]) == 4  # once each


@pytest.mark.timeout(2 * SAFETY)
def test_with_one_slot_neuron_compiles_still_run_while_the_engine_traces_on(tmp_path):
    # A share of one slot compiles host pieces in place (no worker's start-up to save here:
    # neuronx-cc is a process of its own, minutes a graph): Neuron's stay in the background.
    result, events = _engine(tmp_path, [16, 24], VLLM_NEURON_COMPILE_WORKERS="1")

    graphs = result["graphs"]
    assert all(g["deferred"] and "error" not in g for g in graphs), graphs
    handed = {e.key for e in events if isinstance(e, Deferred) and e.reason == "worker"}
    assert handed == {g["key"] for g in graphs}, events
    for g in graphs:
        entry = Path(result["entries"][g["key"]])
        assert g["output"] == _neff_of((entry / HLO_NAME).read_bytes())


@pytest.mark.timeout(2 * SAFETY)
def test_a_graph_the_neuron_compiler_rejects_fails_at_its_first_call_and_no_other(tmp_path):
    result, events = _engine(tmp_path, [16, 24, 32], VLLM_NEURON_COMPILE_WORKERS="2",
                             FAKE_NEURONX_CC_REJECT="inputs 4x24")

    by_width = dict(zip([16, 24, 32], result["graphs"], strict=True))
    rejected = by_width.pop(24)
    assert rejected["deferred"], rejected
    assert "CompileError" in rejected["error"] and rejected["key"] in rejected["error"]
    assert "piece 24" in rejected["error"] and "rejects this graph" in rejected["error"]
    for g in by_width.values():
        assert g["output"].startswith("NEFF "), g
    assert sum(isinstance(e, Compiled) for e in events) == 2


@pytest.mark.timeout(2 * SAFETY)
def test_a_neuron_compiler_killed_by_a_signal_is_no_failure_of_the_graph(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    result, events = _engine(tmp_path, [16], FAKE_NEURONX_CC_KILLED_ONCE=str(marks))

    (graph,) = result["graphs"]
    assert graph["deferred"] and "error" not in graph, graph  # compiled again, in place
    entry = Path(result["entries"][graph["key"]])
    assert graph["output"] == _neff_of((entry / HLO_NAME).read_bytes())
    assert (marks / "killed").exists()  # the background compile was the one killed
    assert not [e for e in events if isinstance(e, CompileFailed)], events
    tier = open_store(str(tmp_path / "root" / "neuron" / "compile_cache"), create=False)
    assert not tier.list(FAILURES_DIR)  # no failure note: other processes compile it


@pytest.mark.timeout(2 * SAFETY)
def test_a_process_that_exits_during_a_background_compile_stops_the_compiler(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    # The compile waits for a second one that never comes; the process exits meanwhile.
    os.mkfifo(meet / "started")
    _engine(tmp_path, [16], FAKE_NEURONX_CC_TOGETHER=f"{meet}:2",
            FAKE_NEURONX_CC_PATIENCE=str(10 * SAFETY),
            FAKE_NEURONX_CC_STARTED=str(meet / "started"),
            FAKE_PIECES_EXIT_WHEN_STARTED=str(meet / "started"))

    (pid,) = (int((meet / t).read_text()) for t in os.listdir(meet) if t.startswith("ticket"))
    wait_until_gone([pid], "neuronx-cc outlived its process")  # killed at its exit


def test_lowering_here_and_compiling_in_another_thread_makes_the_in_place_entry(
        tmp_path, monkeypatch):  # fmt: skip
    import torch

    with installed(monkeypatch, str(tmp_path / "bin")):
        toolchain = NeuronToolchain()
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
        gm, inputs = torch.fx.symbolic_trace(model), [torch.randn(2, 8)]
        in_place = toolchain.compile(gm, inputs, str(tmp_path / "in_place"))

        lowered = toolchain.lower(gm, inputs, str(tmp_path / "work"))
        assert sorted(os.listdir(tmp_path / "work")) == [HLO_NAME, METANEFF_NAME, "model"]
        outcome: list[Any] = []
        thread = threading.Thread(target=lambda: outcome.append(
            lowered.compile(str(tmp_path / "background"))))
        thread.start()
        thread.join()

    assert outcome == [in_place]
    assert in_place.output_shapes == ("2, 4",) and in_place.files == (NEFF_NAME, METANEFF_NAME)
    for name in (HLO_NAME, METANEFF_NAME, NEFF_NAME):
        assert ((tmp_path / "background" / name).read_bytes()
                == (tmp_path / "in_place" / name).read_bytes()), name
