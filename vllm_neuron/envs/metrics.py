"""Where the cache's live metrics go inside vLLM (`vllm_neuron.metrics.live`).

``_VLLM_NEURON_METRICS_DIR`` is set by the package itself, in vLLM's first process, for the
processes it starts (each writes its counters there; the API server collects them).
``PROMETHEUS_MULTIPROC_DIR`` is prometheus_client's own, set by vLLM when it runs several
API servers; when set, it wins. Both are read at each use, never cached: the first process
sets the first one after its settings were loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ._parse import EnvVar, environ_or_default, raw

__all__ = [
    "PROMETHEUS_MULTIPROC_DIR",
    "VARIABLES",
    "VLLM_NEURON_METRICS_DIR",
    "MetricsSettings",
    "load_metrics_settings",
]

# An internal marker, not a setting: named outside vLLM's ``VLLM_*`` namespace (see host_mode).
VLLM_NEURON_METRICS_DIR = "_VLLM_NEURON_METRICS_DIR"
PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        VLLM_NEURON_METRICS_DIR,
        "(set by the plugin)",
        "metrics",
        "Set by the plugin in vLLM's first process for the processes it starts: where each "
        "writes its cache counters for vLLM's /metrics. Not meant to be set by hand.",
    ),
)


@dataclass(frozen=True)
class MetricsSettings:
    """The directory each process writes its counters into, and which variable said so."""

    metrics_dir: str | None
    multiproc_dir: str | None

    @property
    def directory(self) -> str | None:
        """Where vLLM's /metrics collects from: prometheus_client's own directory when vLLM
        set one, else the plugin's."""
        return self.multiproc_dir or self.metrics_dir


def load_metrics_settings(environ: Mapping[str, str] | None = None) -> MetricsSettings:
    env = environ_or_default(environ)
    return MetricsSettings(metrics_dir=raw(env, VLLM_NEURON_METRICS_DIR),
                           multiproc_dir=raw(env, PROMETHEUS_MULTIPROC_DIR))  # fmt: skip
