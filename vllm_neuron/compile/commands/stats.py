"""`vllm-neuron cache stats`'s document: what a local tier holds and what its processes did.

Why a function here and not in the CLI: the HTML report shows the same numbers
(`vllm_neuron.report`), and used to get them by running the command and capturing its
standard output. Both now call `tier_stats`, so the page and the command agree without
either parsing the other's text.

The document: ``location`` (the tier's URL), ``entries`` and ``size_bytes`` (every entry's
recorded files and unpacked copies, what the bound counts: `upkeep.eviction.sized_entries`),
``max_size_bytes`` (VLLM_NEURON_CACHE_MAX_SIZE; null: no bound), ``hit_rate`` (hits over
hits and misses; null before any lookup), then every counter folded from the tier's events
(`entry.events.CacheStats`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from vllm_neuron.backends import open_store
from vllm_neuron.envs.compile_cache import cache_max_size

from ..entry.events import read_stats
from ..upkeep.eviction import sized_entries

__all__ = ["tier_stats"]


def tier_stats(cache_dir: str) -> dict[str, Any]:
    """The `cache stats --json` document of the local tier at ``cache_dir`` (module doc).

    A malformed VLLM_NEURON_CACHE_MAX_SIZE is a ConfigError naming it."""
    bound = cache_max_size()
    counters = read_stats(cache_dir)
    store = open_store(cache_dir, create=False)
    entries = sized_entries(store)
    lookups = counters.hits + counters.misses
    return {
        "location": store.url,
        "entries": len(entries),
        "size_bytes": sum(e.size for e in entries),
        "max_size_bytes": bound,
        "hit_rate": counters.hits / lookups if lookups else None,
        **asdict(counters),
    }
