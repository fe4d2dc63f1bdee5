"""A cold start in parallel: the ranks and nodes of a deployment share out its graphs.

Every "rank" is a real process (cache_workers.run_trace) that traces the same graphs in the
same order, as vLLM's piecewise backend does, handing each to the cache before calling any;
a graph whose compile another process holds is deferred to its first call. The compiles are
the test toolchain (bytes derived from the key, a marker per compile started); concurrency is
shown by a handshake (a compile waits until compiles of several graphs run at once, which
never happens if the ranks queue on each graph) and asserted from the events each process
recorded (compile spans of different graphs overlapping across processes), never from how
long anything took.
"""

from __future__ import annotations

import os
import posixpath
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cache_workers import (
    HELD,
    RESUME,
    SAFETY,
    finish_workers,
    release_barrier,
    wait_for,
    worker_command,
    worker_env,
)

from vllm_neuron.backends import RecordCodec, open_store
from vllm_neuron.compile.entry.events import CACHE_EVENTS, EVENTS_STREAM, Compiled, Deferred

REPORT_TESTS = Path(__file__).resolve().parents[2] / "report"
if str(REPORT_TESTS) not in sys.path:
    sys.path.insert(0, str(REPORT_TESTS))

from report_browser import parse, select  # noqa: E402

KEYS = [f"{i:02x}" * 16 for i in range(0xA0, 0xA8)]  # eight graphs
_EVENTS = RecordCodec(CACHE_EVENTS)


def _spawn(tmp_path: Any, *, nodes: int, ranks: int, fleet: dict[str, Any] | None = None,
           **args: Any) -> list[subprocess.Popen[str]]:
    procs = []
    for node in range(nodes):
        for _ in range(ranks):
            worker_args = {"keys": KEYS, "cache_dir": str(tmp_path / f"node{node}"),
                           "barrier_dir": str(tmp_path / "barrier"),
                           "marker_dir": str(tmp_path / "markers"), "timeout": SAFETY,
                           **(fleet or {}), **args}  # fmt: skip
            procs.append(subprocess.Popen(worker_command("trace", worker_args), env=worker_env(),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))  # fmt: skip
    release_barrier(str(tmp_path / "barrier"), len(procs), procs)
    return procs


def _events(tmp_path: Any, nodes: int) -> list[tuple[int, str, Any]]:
    """Every event of every node: (node, writer process, event)."""
    out = []
    for node in range(nodes):
        log = open_store(str(tmp_path / f"node{node}"), create=False).log(EVENTS_STREAM)
        for segment, data in log.segment_data():
            writer = posixpath.basename(segment).removesuffix(".jsonl")
            out.extend((node, writer, e) for e in _EVENTS.decode_lines(data).records)
    return out


def _spans(events: list[tuple[int, str, Any]]) -> list[tuple[int, str, str, float, float]]:
    """Each compile's (node, writer, key, start, end), from its `compile` event."""
    return [(n, w, e.key, e.at - e.seconds, e.at) for n, w, e in events if isinstance(e, Compiled)]


def _overlapping(spans: list[tuple[int, str, str, float, float]]) -> list[tuple[str, str]]:
    """Pairs of compiles of different graphs, in different processes, that ran at once."""
    return [(a[2], b[2]) for i, a in enumerate(spans) for b in spans[i + 1:]
            if a[1] != b[1] and a[2] != b[2] and a[3] < b[4] and b[3] < a[4]]


def _started(tmp_path: Any) -> int:
    path = tmp_path / "markers"
    return len([n for n in os.listdir(path) if n.startswith("started-")]) if path.exists() else 0


def _all_right(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert sorted(r["graphs"]) == sorted(KEYS), r
        for key, graph in r["graphs"].items():
            assert graph["ok"] and graph["wrong"] is None, (key, graph, r["stderr"][-2000:])


@pytest.mark.timeout(2 * SAFETY)
def test_four_ranks_of_one_node_share_out_eight_graphs(tmp_path):
    # Each compile waits until four graphs compile at once: only ranks that go on tracing
    # past a graph another rank holds ever get there.
    procs = _spawn(tmp_path, nodes=1, ranks=4, delay=0.2,
                   rendezvous_dir=str(tmp_path / "rendezvous"), rendezvous=4)
    results = finish_workers(procs)

    _all_right(results)
    assert _started(tmp_path) == 8  # every graph compiled once on the node
    events = _events(tmp_path, 1)
    spans = _spans(events)
    assert sorted(s[2] for s in spans) == sorted(KEYS)
    assert len({s[1] for s in spans}) == 4, spans  # every rank compiled some of them
    assert _overlapping(spans), spans
    deferred = [e for _, _, e in events if isinstance(e, Deferred)]
    assert deferred and {e.reason for e in deferred} == {"local-lock"}
    # A graph deferred by a rank was loaded from what its holder published.
    sources = {g["source"] for r in results for g in r["graphs"].values() if g["deferred"]}
    assert sources <= {"local", "local-after-wait"}, sources  # never compiled twice
    # The report's timeline shows it: compile bars of different graphs, in the rows of
    # different processes, over the same stretch of time.
    page = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "report", "--cache-dir",
                           str(tmp_path / "node0"), "-o", str(page)],
                          capture_output=True, text=True, timeout=SAFETY)  # fmt: skip
    assert done.returncode == 0, done.stderr
    bars = [(b.attrs["data-row"], b.attrs["data-key"], float(b.attrs["data-start"]),
             float(b.attrs["data-end"])) for b in select(parse(page.read_text()), "rect",
                                                         data_kind="compile")]  # fmt: skip
    assert sorted(b[1] for b in bars) == sorted(KEYS)
    assert [(a, b) for i, a in enumerate(bars) for b in bars[i + 1:]
            if a[0] != b[0] and a[1] != b[1] and a[2] < b[3] and b[2] < a[3]], bars


@pytest.mark.timeout(2 * SAFETY)
def test_four_nodes_of_two_ranks_share_out_eight_graphs_once_each(tmp_path, shared_remote):
    procs = _spawn(tmp_path, nodes=4, ranks=2, fleet=shared_remote, delay=0.2,
                   rendezvous_dir=str(tmp_path / "rendezvous"), rendezvous=8)
    results = finish_workers(procs)

    _all_right(results)
    assert _started(tmp_path) == 8  # once per fleet
    events = _events(tmp_path, 4)
    spans = _spans(events)
    assert sorted(s[2] for s in spans) == sorted(KEYS)
    assert len({s[0] for s in spans}) == 4, spans  # every node compiled some
    assert _overlapping(spans)
    reasons = {e.reason for _, _, e in events if isinstance(e, Deferred)}
    assert "remote-lease" in reasons, reasons
    remote = open_store(shared_remote["remote"], create=False)
    assert all(remote.published(k) is not None for k in KEYS)


@pytest.mark.timeout(2 * SAFETY)
def test_one_compile_slot_never_runs_two_compiles_at_once_on_the_node(tmp_path):
    procs = _spawn(tmp_path, nodes=1, ranks=4, delay=0.1, compile_workers=1)
    results = finish_workers(procs)

    _all_right(results)
    assert _started(tmp_path) == 8
    events = _events(tmp_path, 1)
    spans = sorted(_spans(events), key=lambda s: s[3])
    assert len(spans) == 8
    for before, after in zip(spans, spans[1:], strict=False):
        assert before[4] <= after[3], (before, after)  # one at a time
    reasons = {e.reason for _, _, e in events if isinstance(e, Deferred)}
    assert "no-slot" in reasons or "local-lock" in reasons, reasons


def _deferred_by(tmp_path: Any, nodes: int, key: str) -> set[str]:
    return {w for _, w, e in _events(tmp_path, nodes) if isinstance(e, Deferred) and e.key == key}


@pytest.mark.timeout(2 * SAFETY)
def test_a_failed_compile_is_raised_at_the_first_call_of_every_rank_that_deferred_it(tmp_path):
    hold = tmp_path / "hold"
    procs = _spawn(tmp_path, nodes=1, ranks=3, fail_key=KEYS[0], hold_key=KEYS[0],
                   hold_dir=str(hold))
    # The failing compile stops half-way until both other ranks have deferred its graph.
    wait_for(lambda: (hold / HELD).exists(), "the held compile", procs)
    wait_for(lambda: len(_deferred_by(tmp_path, 1, KEYS[0])) == 2, "two deferrals", procs)
    (hold / RESUME).touch()
    results = finish_workers(procs)

    holder = int((hold / HELD).read_text())
    for r in results:
        failed = r["graphs"][KEYS[0]]
        assert not failed["ok"] and "the compiler rejects this graph" in failed["error"], failed
        if r["pid"] != holder:  # the holder's failure, raised where the graph is first called
            assert failed["error_type"] == "CompileError", failed
            assert KEYS[0] in failed["error"] and f"process {holder}" in failed["error"]
        assert all(r["graphs"][k]["ok"] for k in KEYS[1:]), r
    assert _started(tmp_path) == 8  # the failing graph was tried once, by its holder


@pytest.mark.timeout(2 * SAFETY)
def test_a_killed_holder_is_taken_over_and_its_deferrers_load_the_takers_result(
        tmp_path, shared_remote):
    hold = tmp_path / "hold"
    procs = _spawn(tmp_path, nodes=2, ranks=2, fleet=shared_remote, hold_key=KEYS[0],
                   hold_dir=str(hold), remote_lease_seconds=2)
    wait_for(lambda: (hold / HELD).exists(), "the held compile", procs)
    wait_for(lambda: len(_deferred_by(tmp_path, 2, KEYS[0])) == 3, "three deferrals", procs)
    holder = int((hold / HELD).read_text())
    victim = next(p for p in procs if p.pid == holder)
    victim.kill()
    victim.wait()
    results = finish_workers([p for p in procs if p is not victim])

    _all_right(results)
    assert _started(tmp_path) == 9  # the killed compile and the taker's
    events = _events(tmp_path, 2)
    assert sum(1 for _, _, e in events if isinstance(e, Compiled) and e.key == KEYS[0]) == 1
    assert victim.returncode == -signal.SIGKILL


@pytest.mark.timeout(2 * SAFETY)
def test_defer_compiles_off_waits_in_place(tmp_path):
    procs = _spawn(tmp_path, nodes=1, ranks=2, delay=0.05, defer=False)
    results = finish_workers(procs)

    _all_right(results)
    assert _started(tmp_path) == 8
    events = _events(tmp_path, 1)
    assert not [e for _, _, e in events if isinstance(e, Deferred)]
    assert all(not g["deferred"] for r in results for g in r["graphs"].values())
