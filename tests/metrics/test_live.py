"""The live counters across real processes, as inside vLLM (without vLLM: see
tests/plugin/test_vllm_serve.py for the real server).

The test process plays vLLM's first process (the API server): it installs, which makes the
directory and registers the collector in a registry of its own. Engine processes are real
subprocesses that inherit ``_VLLM_NEURON_METRICS_DIR``, install, and use a real cache. What
the registry then shows is exactly what ``cache stats --prometheus`` folds from the events
those processes wrote.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from metrics_worker import small_compile
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.local import EVENT_OBSERVERS
from vllm_neuron.metrics import METRICS_DIR_ENV, fold_events, install, install_in_vllm
from vllm_neuron.metrics.exposition import render_text

HERE = Path(__file__).resolve().parent
KEYS = [f"{i:031x}b" for i in range(1, 4)]
HITS = "vllm_neuron_cache_hits_total"
COMPILES = "vllm_neuron_cache_compiles_total"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def engine_process(cache_dir: str, keys: list[str], env: dict[str, str]) -> str:
    """A process vLLM would have started: installs from the inherited directory, compiles."""
    done = subprocess.run([sys.executable, str(HERE / "metrics_worker.py"), cache_dir, *keys],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_engine_processes_counters_reach_the_first_process_registry(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    registry = CollectorRegistry()
    live = install(environ, registry)
    assert live is not None and live.observe in EVENT_OBSERVERS
    directory = environ[METRICS_DIR_ENV]
    assert os.path.isdir(directory)
    # Before any engine process: every series at 0 (this process's own file).
    before = samples(generate_latest(registry).decode())
    assert before[(COMPILES, ())] == 0 and before[(HITS, (("tier", "local"),))] == 0
    cache_dir = str(tmp_path / "cache")
    env = {**os.environ, **environ}
    cold = engine_process(cache_dir, KEYS, env)  # 3 compiles
    warm = engine_process(cache_dir, [*KEYS, KEYS[0]], env)  # 3 local hits, 1 memory hit
    assert {os.path.basename(p) for p in (cold, warm)} < set(os.listdir(directory))
    assert os.path.dirname(cold) == directory
    scraped = generate_latest(registry).decode()
    found = samples(scraped)
    assert found[(COMPILES, ())] == 3
    assert found[(HITS, (("tier", "local"),))] == 3
    assert found[(HITS, (("tier", "memory"),))] == 1
    # The same names, labels and values as the event logs give `cache stats --prometheus`.
    assert found == samples(render_text(fold_events(cache_dir)))


def _forked_child(cache_dir: str) -> None:
    TwoTierCache(cache_dir).get_or_compile(KEYS[0], small_compile)


def test_a_forked_process_counts_in_a_file_of_its_own(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    registry = CollectorRegistry()
    live = install(environ, registry)
    assert live is not None
    parent_file = live.path
    cache_dir = str(tmp_path / "cache")
    TwoTierCache(cache_dir).get_or_compile(KEYS[1], small_compile)  # the parent: 1 compile
    child = multiprocessing.get_context("fork").Process(target=_forked_child, args=(cache_dir,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    files = sorted(os.listdir(environ[METRICS_DIR_ENV]))
    assert len(files) == 2 and os.path.basename(parent_file) in files
    assert live.path == parent_file  # the parent still writes its own file
    found = samples(generate_latest(registry).decode())
    assert found[(COMPILES, ())] == 2  # one each, neither lost nor counted twice


def test_nothing_is_observed_outside_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)
    before = list(EVENT_OBSERVERS)
    assert install_in_vllm() is None
    assert before == EVENT_OBSERVERS and METRICS_DIR_ENV not in os.environ


def test_a_failing_metrics_file_never_fails_a_compile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    environ = {METRICS_DIR_ENV: str(blocker)}  # inherited, but unusable
    caplog.set_level(logging.WARNING, logger="vllm_neuron.metrics")
    live = install(environ, CollectorRegistry())
    assert live is not None and live.broken
    assert [r.getMessage() for r in caplog.records if "cache metrics off" in r.getMessage()]
    result = TwoTierCache(str(tmp_path / "cache")).get_or_compile(KEYS[2], small_compile)
    assert result.source == "compiled"
    assert fold_events(str(tmp_path / "cache")).values  # the event log still has it
