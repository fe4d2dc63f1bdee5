"""The series in Prometheus's text format, from folded events (``cache stats --prometheus``).

For a node exporter's textfile collector, which reads ``*.prom`` files: the same families,
samples and help texts as the live series in vLLM's ``/metrics``, rendered by
prometheus_client itself (so the format is the one a scraper parses, escaping included).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .series import SeriesTotals

__all__ = ["render_text"]


class _TotalsCollector:
    """A prometheus_client custom collector over folded totals."""

    def __init__(self, totals: SeriesTotals) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        for series, values in self.totals.by_series():
            family = CounterMetricFamily(series.metric, series.help, labels=list(series.labels))
            for labels, value in values:
                family.add_metric(list(labels), value)
            yield family


def render_text(totals: SeriesTotals) -> str:
    """The text exposition format (version 0.0.4) of `totals`."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_TotalsCollector(totals))
    return generate_latest(registry).decode()
