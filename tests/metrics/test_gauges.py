"""The tier gauges in a real process: the local tier's size against its bound, remote up/down.

A subprocess plays vLLM's first process (metrics installed as the general plugin does,
gauges on) with the cache's settings in its environment; what its registry serves is what
vLLM's ``/metrics`` serves. The local tier is filled beforehand by a real cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from metrics_worker import small_compile
from test_live import samples

from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir
from vllm_neuron.metrics import METRICS_DIR_ENV

HERE = Path(__file__).resolve().parent
SIZE = ("vllm_neuron_cache_tier_size_bytes", (("tier", "local"),))
BOUND = ("vllm_neuron_cache_tier_bound_bytes", (("tier", "local"),))
REMOTE_UP = ("vllm_neuron_cache_remote_up", ())
KEYS = [f"{i:031x}c" for i in range(1, 3)]


def first_process(env: dict[str, str]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    environ = {k: v for k, v in os.environ.items() if k != METRICS_DIR_ENV}
    done = subprocess.run([sys.executable, str(HERE / "gauges_worker.py")],
                          env={**environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return samples(done.stdout)


def test_the_first_process_serves_tier_size_bound_and_remote_up(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "root"), "VLLM_NEURON_CACHE_MAX_SIZE": "1000000",
           "NEURON_LIBTORCH_REMOTE_CACHE": str(remote)}
    cache = TwoTierCache(get_neuron_compile_cache_dir(environ=env))
    for key in KEYS:
        cache.get_or_compile(key, small_compile)  # 512 bytes each
    found = first_process(env)
    assert found[SIZE] == 2 * 512
    assert found[BOUND] == 1_000_000
    assert found[REMOTE_UP] == 1


def test_a_remote_that_does_not_answer_is_down_and_no_bound_is_no_series(
    tmp_path: Path,
) -> None:
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "root"),
           "NEURON_LIBTORCH_REMOTE_CACHE": str(tmp_path / "no-such-remote")}
    found = first_process(env)
    assert found[SIZE] == 0  # the tier not made yet holds nothing
    assert found[REMOTE_UP] == 0
    assert BOUND not in found  # unbounded: no bound of 0 that would read as "over"


def test_without_a_remote_there_is_no_remote_series(tmp_path: Path) -> None:
    found = first_process({"VLLM_CACHE_ROOT": str(tmp_path / "root"),
                           "NEURON_LIBTORCH_REMOTE_CACHE": ""})
    assert REMOTE_UP not in found and SIZE in found


def test_a_sample_cut_short_by_the_exit_says_nothing(tmp_path: Path, caplog) -> None:
    """At exit the first process removes the metrics directory while the sampler may be
    mid-sample (a short-lived process exits right after its first one): once stopped, its
    failing write is no warning; before, the same failure warns once."""
    from vllm_neuron.metrics import TierSampler

    env = {"VLLM_CACHE_ROOT": str(tmp_path / "root"), "NEURON_LIBTORCH_REMOTE_CACHE": ""}
    gone = tmp_path / "removed-metrics-dir"  # never made: the write fails
    live = TierSampler(str(gone), env)
    live.sample()
    assert [r.getMessage() for r in caplog.records if "not sampled" in r.getMessage()]
    caplog.clear()
    exiting = TierSampler(str(gone), env)
    exiting.stop()  # what the exit does first (registered by start())
    exiting.sample()
    assert not [r for r in caplog.records if "not sampled" in r.getMessage()]


def test_a_stopped_sampler_makes_no_file_and_leaves_no_sample_running(tmp_path: Path) -> None:
    """At exit the sampler is stopped, then the first process removes the metrics directory:
    a sample in progress is waited for, and no sample after the stop makes the gauge file
    (one made while the directory goes would keep it in $TMPDIR)."""
    from vllm_neuron.metrics import TierSampler

    env = {"VLLM_CACHE_ROOT": str(tmp_path / "root"), "NEURON_LIBTORCH_REMOTE_CACHE": ""}
    running_dir, exiting_dir = tmp_path / "running", tmp_path / "exiting"
    running_dir.mkdir()
    exiting_dir.mkdir()
    running = TierSampler(str(running_dir), env, interval=3600.0)
    running.start()
    assert running.sampled.wait(60)
    running.stop()
    assert running._thread is not None and not running._thread.is_alive()
    assert len(list(running_dir.iterdir())) == 1  # its gauge file, made before the stop

    exiting = TierSampler(str(exiting_dir), env)
    exiting.stop()
    assert exiting.sample()  # measured all the same, for a caller that asks
    assert list(exiting_dir.iterdir()) == []
