"""The compile cache's Prometheus series (docs/compile-cache.md, "Metrics").

Fed from the cache's one event path (``TwoTierCache._record`` tells the observers in
``compile.cache.EVENT_OBSERVERS``): :mod:`.series` maps each event record to counter
increments, once, for both outputs - live in vLLM's ``/metrics`` (:mod:`.live`, installed
by the general plugin in every vLLM process) and from the event logs in the text format
(:mod:`.exposition`, ``vllm-neuron cache stats --prometheus``). The state no event carries
(the local tier's size against its bound, the remote up/down) is sampled as gauges in
vLLM's first process (:mod:`.gauges`); live only.
"""

from __future__ import annotations

from .exposition import render_text
from .gauges import GAUGES, Gauge, TierSampler
from .live import (
    METRICS_DIR_ENV,
    LiveMetrics,
    gauge_sampler,
    install,
    install_in_vllm,
    uninstall,
)
from .series import SERIES, Series, SeriesTotals, fold_events, samples_of

__all__ = [
    "GAUGES",
    "METRICS_DIR_ENV",
    "SERIES",
    "Gauge",
    "LiveMetrics",
    "Series",
    "SeriesTotals",
    "TierSampler",
    "fold_events",
    "gauge_sampler",
    "install",
    "install_in_vllm",
    "render_text",
    "samples_of",
    "uninstall",
]
