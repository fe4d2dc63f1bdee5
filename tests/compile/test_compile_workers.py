"""A process's own compiles run in compile workers while it traces on (compile_workers.py).

Real processes, real TorchInductor: each hands two graphs to the runtime under a piece name,
as vLLM's piecewise backend does, before calling either. Asserted from the events: both were
handed to a worker (`deferred`, reason ``worker``) before either compile was done, and the
compiles ran at once; a worker that dies (SIGKILL at a fault point) is no failure of the
graph: it is compiled in the process at its first call, and no failure note is left.
"""

from __future__ import annotations

import posixpath
import subprocess
from typing import Any

import pytest
from cache_workers import SAFETY, finish_workers, worker_command, worker_env

from vllm_neuron.backends import RecordCodec, open_store
from vllm_neuron.compile.events import (
    CACHE_EVENTS,
    EVENTS_STREAM,
    Compiled,
    CompileFailed,
    Deferred,
)
from vllm_neuron.compile.failures import FAILURES_DIR

_EVENTS = RecordCodec(CACHE_EVENTS)


def _run(tmp_path: Any, widths: list[int], **env: str) -> tuple[dict[str, Any], list[Any], Any]:
    root = tmp_path / "root"
    proc = subprocess.Popen(
        worker_command("pieces", {"widths": widths}),
        env=worker_env(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_TOOLCHAIN="host", **env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (result,) = finish_workers([proc], timeout=SAFETY)
    tier = open_store(str(root / "neuron" / "compile_cache"), create=False)
    events = []
    for segment, data in tier.log(EVENTS_STREAM).segment_data():
        if posixpath.basename(segment).removesuffix(".jsonl") == result["writer"]:
            events.extend(_EVENTS.decode_lines(data).records)
    return result, events, tier


@pytest.mark.timeout(2 * SAFETY)
def test_a_process_compiles_its_own_pieces_in_workers_at_once(tmp_path):
    result, events, _ = _run(tmp_path, [16, 24], VLLM_NEURON_COMPILE_WORKERS="2")

    assert result["matches"] == [True, True], result
    assert result["sources"] == ["compiled", "compiled"]
    handed = {e.key: e.at for e in events if isinstance(e, Deferred) and e.reason == "worker"}
    compiled = {e.key: (e.at - e.seconds, e.at) for e in events if isinstance(e, Compiled)}
    assert set(handed) == set(compiled) == set(result["keys"]), events
    first, second = result["keys"]
    assert handed[second] < compiled[first][1]  # traced on while the first one compiled
    (a0, a1), (b0, b1) = compiled[first], compiled[second]
    assert a0 < b1 and b0 < a1, compiled  # the two compiles ran at once


@pytest.mark.timeout(2 * SAFETY)
def test_a_worker_that_dies_is_not_the_graphs_failure(tmp_path):
    result, events, tier = _run(tmp_path, [16], VLLM_NEURON_FAULT="worker.started")

    assert result["matches"] == [True], result
    assert result["sources"] == ["compiled"]  # in the process, at the first call
    assert "the compile worker exited with status -9" in result["stderr"]
    assert not [e for e in events if isinstance(e, CompileFailed)]
    assert not tier.list(FAILURES_DIR)  # nobody is told the graph failed
    assert sum(isinstance(e, Compiled) for e in events) == 1
