"""The cache's state as gauges: the local tier's size against its bound, the remote up/down.

The counters (:mod:`.series`) say what happened; an operator also asks what *is*: how full
the local tier is against ``VLLM_NEURON_CACHE_MAX_SIZE`` (alert before evictions churn) and
whether this node reaches the remote tier now (``NEURON_LIBTORCH_REMOTE_CACHE``). Neither is
an event, so these are sampled: one thread in vLLM's first process (the one that made the
metrics directory, :func:`.live.install`) measures every :data:`SAMPLE_SECONDS` and writes
the values into a prometheus_client multiprocess file of its own,
``gauge_mostrecent_vllm-neuron-<pid>.db``, in the directory the counters go to. So the
gauges reach ``/metrics`` by the same collector as the counters, with one API server or
several (``PROMETHEUS_MULTIPROC_DIR``); ``mostrecent`` makes a newer sample win over a file
an earlier server left. A scrape never waits on a listing or a remote request.

Exported only when they mean something: the bound only when one is set (a bound of 0 would
read as "over"), remote up/down only when a remote tier is set. Sampling that fails (a
malformed setting, an unreadable tier) logs once and leaves the gauge as it was; the
engine processes report such settings themselves.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_neuron.backends import Store, open_store, probe_store
from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir
from vllm_neuron.compile.upkeep.eviction import sized_entries
from vllm_neuron.envs import load_compile_cache_settings

__all__ = ["GAUGES", "GAUGE_FILE_PREFIX", "SAMPLE_SECONDS", "Gauge", "TierSampler"]

logger = logging.getLogger("vllm_neuron.metrics")

GAUGE_FILE_PREFIX = "gauge_mostrecent_vllm-neuron-"  # type, then mode: the collector's parse
SAMPLE_SECONDS = 30.0
"""How often the sampler measures: about a scrape interval, and a listing of the local tier
(one record read per entry) costs little at that rate."""
# How long stopping waits for a sample in progress (an exit waits this at most; a remote's
# probe is bounded by the store's own timeouts, longer than this on a hung mount).
STOP_WAIT_SECONDS = 2.0


@dataclass(frozen=True, eq=False)
class Gauge:
    """One gauge family; its one sample has the family's name (no suffix)."""

    metric: str
    help: str
    labels: tuple[str, ...] = ()


TIER_SIZE = Gauge("vllm_neuron_cache_tier_size_bytes", "Bytes a tier holds (entries and "
                  "their unpacked copies), sampled: the local tier.", ("tier",))
TIER_BOUND = Gauge("vllm_neuron_cache_tier_bound_bytes", "A tier's size bound: the local "
                   "tier's VLLM_NEURON_CACHE_MAX_SIZE; absent when unbounded.", ("tier",))
REMOTE_UP = Gauge("vllm_neuron_cache_remote_up", "1 when the remote tier "
                  "(NEURON_LIBTORCH_REMOTE_CACHE) answered the last probe from this node, 0 "
                  "when not; absent without a remote tier.")

GAUGES: tuple[Gauge, ...] = (TIER_SIZE, TIER_BOUND, REMOTE_UP)


class TierSampler:
    """Measures the gauges and writes them into this process's gauge file.

    :meth:`sample` is one measurement (the thread's loop, or a caller that wants one now);
    :meth:`start` runs it every `interval` seconds in a daemon thread; :attr:`sampled` is
    set after the first measurement, the handshake a reader waits on.
    """

    def __init__(self, directory: str, environ: Mapping[str, str] | None = None,
                 interval: float = SAMPLE_SECONDS) -> None:  # fmt: skip
        self.directory = directory
        self.interval = interval
        self.sampled = threading.Event()
        self._environ = environ
        self._stop = threading.Event()
        self._file: Any = None
        self._remote: Store | None = None
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # Stopped at exit before the metrics directory goes (atexit runs the handlers
        # registered later first): a sample cut short by the exit says nothing.
        atexit.register(self.stop)
        self._thread = threading.Thread(target=self._loop, name="vllm-neuron-gauges",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        """No sample after this one makes the gauge file, and one in progress is waited
        for (up to `STOP_WAIT_SECONDS`: a probe of a remote that hangs is not): at exit the
        metrics directory is removed next, and a file made while it goes would keep it."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=STOP_WAIT_SECONDS)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> dict[tuple[Gauge, tuple[str, ...]], float]:
        """Measure once and write what was measured; returns it (tests, logs)."""
        values: dict[tuple[Gauge, tuple[str, ...]], float] = {}
        try:
            settings = load_compile_cache_settings(self._environ)
            if settings.cache_max_size is not None:
                values[(TIER_BOUND, ("local",))] = float(settings.cache_max_size)
            local_dir = get_neuron_compile_cache_dir(settings, environ=self._environ)
            if os.path.isdir(local_dir):  # not made yet: nothing held
                local = open_store(local_dir, create=False)
                values[(TIER_SIZE, ("local",))] = float(sum(e.size for e in sized_entries(local)))
            else:
                values[(TIER_SIZE, ("local",))] = 0.0
            if settings.remote_cache:
                values[(REMOTE_UP, ())] = 1.0 if self._remote_answers(settings.remote_cache) \
                    else 0.0
            self._write(values)
        except Exception as exc:  # noqa: BLE001 - metrics never break a vLLM
            if not self._stop.is_set():  # at exit its directory may be gone: no news
                self._warn_once("sample", f"vllm_neuron: cache gauges not sampled: {exc}")
        finally:
            self.sampled.set()
        return values

    def _remote_answers(self, url: str) -> bool:
        try:
            if self._remote is None:
                self._remote = open_store(url, create=False)  # a probe makes nothing
            probe_store(self._remote)
            return True
        except Exception as exc:  # noqa: BLE001 - down is the answer, said once
            self._remote = None  # opened again at the next probe
            self._warn_once("remote", f"vllm_neuron: remote tier {url} does not answer the "
                            f"gauge's probe: {exc}")  # fmt: skip
            return False

    def _write(self, values: Mapping[tuple[Gauge, tuple[str, ...]], float]) -> None:
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        if self._file is None:
            if self._stop.is_set():  # stopped: the directory may be going (see stop)
                return
            path = os.path.join(self.directory, f"{GAUGE_FILE_PREFIX}{os.getpid()}.db")
            self._file = MmapedDict(path)
        now = time.time()
        for (gauge, labels), value in values.items():
            key = mmap_key(gauge.metric, gauge.metric, list(gauge.labels), list(labels),
                           gauge.help)  # fmt: skip
            self._file.write_value(key, value, now)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message)
