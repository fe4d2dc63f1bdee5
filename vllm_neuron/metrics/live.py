"""The cache's series live in vLLM's ``/metrics``: every process writes, the API server serves.

vLLM compiles in its engine core and worker processes, while ``/metrics`` is served by its
API server process; prometheus_client's multiprocess mode is how such processes share
counters: each writes its own memory-mapped file (``counter_*.db``) in one directory, and a
``MultiProcessCollector`` over that directory sums the files at each scrape.

Which directory, in vLLM 0.32:

* With one API server (the default) vLLM does not use multiprocess mode: ``/metrics``
  serves prometheus_client's global ``REGISTRY`` of the API server process. There this
  package's general plugin, in vLLM's first process (no ``_VLLM_NEURON_METRICS_DIR``
  inherited), makes a private directory, hands it to the processes vLLM starts through
  ``_VLLM_NEURON_METRICS_DIR``, and registers a ``MultiProcessCollector`` over it in
  ``REGISTRY``. The directory is removed when that process exits.
* With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for ``--api-server-count`` > 1, or
  the user does), ``/metrics`` serves a collector over that directory: the files go there.

The files are written with prometheus_client's own ``MmapedDict`` and key format, and are
named ``counter_vllm-neuron-<pid>.db``, beside (never instead of) prometheus_client's
``counter_<pid>.db``. Setting ``PROMETHEUS_MULTIPROC_DIR`` ourselves would have switched
the whole process, vLLM's own metrics included, into multiprocess mode (prometheus_client
decides that once, at import): vLLM's single-server ``/metrics`` would then lose its own
series. A vLLM is never broken for metrics: anything failing here logs once and the
counters stop; the compile goes on.

Only in vLLM: :func:`install_in_vllm` does nothing outside a vLLM process (a plain
``torch.compile``, the CLI, tests) or without prometheus_client, so nothing is observed
and the cache's hot path pays one empty-list loop. Outside vLLM the same series come from
the event logs: ``vllm-neuron cache stats --prometheus``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any

from vllm_neuron.backends import Record
from vllm_neuron.compile.tiers.local import EVENT_OBSERVERS

# The handoff below is no setting (nobody configures it), but it is read like one: through
# envs' primitives (blank counts as unset), never os.environ (tests/test_single_reader.py).
from vllm_neuron.envs import load_metrics_settings

from .gauges import TierSampler
from .series import SERIES, Series, samples_of

__all__ = [
    "FILE_PREFIX",
    "METRICS_DIR_ENV",
    "LiveMetrics",
    "gauge_sampler",
    "install",
    "install_in_vllm",
    "uninstall",
]

logger = logging.getLogger("vllm_neuron.metrics")

METRICS_DIR_ENV = "_VLLM_NEURON_METRICS_DIR"  # envs/metrics.py
"""Set by vLLM's first process for the processes it starts: where their counters go."""
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FILE_PREFIX = "counter_vllm-neuron-"  # "counter" before the first "_": the collector's type

_installed: LiveMetrics | None = None
_sampler: TierSampler | None = None  # the first process's gauges (gauges.py)
_install_lock = threading.Lock()


class LiveMetrics:
    """This process's counters, in a prometheus_client multiprocess file.

    :meth:`observe` is the cache's event observer: it runs on every event the process
    records, a hit in memory included, so it does a dict lookup, an add and one 16-byte
    write into the mapped file per increment, under a lock (the file is not thread-safe).
    A forked child gets a file of its own (the parent's counts stay in the parent's file)
    and a new lock (one a parent thread held at the fork would never be released).
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ  # None: the process's, read when the file is opened
        self._lock = threading.Lock()
        self._pid = -1
        self._file: Any = None
        self._values: dict[str, float] = {}
        self._keys: dict[tuple[Series, tuple[str, ...]], str] = {}
        self.broken = False
        self.path = ""
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._file = None  # the next event opens this process's own file

    def directory(self) -> str:
        """Where vLLM's ``/metrics`` collects from (see the module's docstring)."""
        directory = load_metrics_settings(self._environ).directory
        if directory is None:
            raise RuntimeError(f"neither {MULTIPROC_ENV} nor {METRICS_DIR_ENV} is set")
        return directory

    def observe(self, event: Record) -> None:
        samples = samples_of(event)
        if not samples or self.broken:
            return
        try:
            with self._lock:
                if self._file is None:
                    self._open()
                for series, labels, amount in samples:
                    if not amount:  # e.g. a memory hit's time saved: every series is at 0
                        continue
                    key = self._keys.get((series, labels)) or self._key(series, labels)
                    value = self._values[key] + amount
                    self._values[key] = value
                    self._file.write_value(key, value, 0.0)
        except Exception as exc:  # noqa: BLE001 - metrics never break a compile
            self.broken = True
            logger.warning("vllm_neuron: cache metrics stopped in pid %d: %s", os.getpid(), exc)

    def open(self) -> None:
        """Open this process's file now (every series appears at 0); best-effort."""
        try:
            with self._lock:
                self._open()
        except Exception as exc:  # noqa: BLE001 - metrics never break a vLLM
            self.broken = True
            logger.warning("vllm_neuron: cache metrics off in pid %d: %s", os.getpid(), exc)

    def _open(self) -> None:
        from prometheus_client.mmap_dict import MmapedDict

        pid = os.getpid()
        if self._file is not None and self._pid == pid:
            return
        self._pid = pid  # a forked child never writes into its parent's mapping
        self._values.clear()
        self.path = os.path.join(self.directory(), f"{FILE_PREFIX}{pid}.db")
        self._file = MmapedDict(self.path)
        for series in SERIES:
            for labels in series.zero:
                self._key(series, labels)

    def _key(self, series: Series, labels: tuple[str, ...]) -> str:
        from prometheus_client.mmap_dict import mmap_key

        key = self._keys.get((series, labels))
        if key is None:
            key = mmap_key(series.metric, series.sample, list(series.labels), list(labels),
                           series.help)
            self._keys[(series, labels)] = key
        if key not in self._values:  # a file left by an earlier process with this pid
            self._values[key] = self._file.read_value(key)[0]
        return key


def _collector_dir(environ: MutableMapping[str, str] | None) -> str:
    """vLLM's first process: a private directory for the processes it starts."""
    directory = tempfile.mkdtemp(prefix="vllm-neuron-metrics-")
    if environ is None:
        os.environ[METRICS_DIR_ENV] = directory  # inherited by every process started now
    else:
        environ[METRICS_DIR_ENV] = directory
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # never from a forked child that exits normally
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
    return directory


def install(
    environ: MutableMapping[str, str] | None = None, registry: Any = None,
    *, gauges: bool = False,
) -> LiveMetrics | None:
    """Observe every cache event of this process into the live series (once per process).

    In the first process (no ``_VLLM_NEURON_METRICS_DIR``) also makes the directory and
    registers a collector over it in `registry` (default prometheus_client's ``REGISTRY``,
    what vLLM's single API server serves), and with `gauges` starts the sampler of the
    tier gauges there (:mod:`.gauges`). None when prometheus_client is missing.
    """
    global _installed, _sampler
    with _install_lock:
        if _installed is not None:
            return _installed
        try:
            import prometheus_client
            from prometheus_client.multiprocess import MultiProcessCollector
        except ImportError as exc:
            logger.info("vllm_neuron: no cache metrics in /metrics (%s)", exc)
            return None
        first = load_metrics_settings(environ).metrics_dir is None
        if first:
            directory = _collector_dir(environ)
            target = prometheus_client.REGISTRY if registry is None else registry
            target.register(MultiProcessCollector(None, path=directory))
        live = LiveMetrics(environ)
        live.open()
        EVENT_OBSERVERS.append(live.observe)
        _installed = live
        if first and gauges and not live.broken:  # one sampler per server, not per engine
            _sampler = TierSampler(live.directory(), environ)
            _sampler.start()
        return live


def install_in_vllm() -> LiveMetrics | None:
    """The general plugin's call: live series only in a process vLLM runs (it imported
    itself before calling its plugins), so a plain ``torch.compile`` observes nothing."""
    if "vllm" not in sys.modules:
        return None
    return install(gauges=True)


def gauge_sampler() -> TierSampler | None:
    """The sampler `install` started in this process, if any (its ``sampled`` handshake)."""
    return _sampler


def uninstall() -> None:
    """Stop observing (tests): the observer leaves the cache; files and collector stay."""
    global _installed, _sampler
    with _install_lock:
        if _installed is not None:
            EVENT_OBSERVERS[:] = [o for o in EVENT_OBSERVERS if o != _installed.observe]
        if _sampler is not None:
            _sampler.stop()
        _installed = _sampler = None
