"""`vllm-neuron cache`: its parser, and `stats` (the other sub-commands live by concept:
`cache_entries.py` ls|verify|promote|prune|explain, `cache_warm.py` warm|compat|pin|unpin,
`cache_gc.py` gc, `cache_trust.py` keygen|sign).

Exit status (as every `vllm-neuron` command): 0 done, 1 a problem found (`verify`: a
corrupt entry), 2 bad usage or a tier that cannot be used - a malformed URL
(``s3:/bucket``), an unknown scheme, a missing local cache, a missing bucket, refused
access, an endpoint that does not answer - with the reason on stderr. A tier given on the
command line is probed before anything is read, so a missing bucket is never "0 entries".
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

from vllm_neuron.compile.commands.stats import tier_stats
from vllm_neuron.envs.compile_cache import VLLM_NEURON_CACHE_MAX_SIZE

from . import cache_entries, cache_gc, cache_trust, cache_warm
from .format import human_size, print_json, table
from .options import JSON_HELP
from .tiers import cache_dir


def register(sub: Any) -> None:
    parser = sub.add_parser("cache", help="inspect and maintain the compile cache")
    parser.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="local cache directory (default: $VLLM_CACHE_ROOT/neuron/compile_cache)",
    )
    cmds = parser.add_subparsers(dest="cache_command", required=True)

    cache_entries.register(cmds)  # ls, verify, promote, prune, explain

    stats = cmds.add_parser("stats", help="location, entries, size against the bound, hit "
                                          "rate, misses, compiles and time saved")
    stats_format = stats.add_mutually_exclusive_group()
    stats_format.add_argument("--json", action="store_true", help=JSON_HELP)
    stats_format.add_argument(
        "--prometheus", action="store_true",
        help="the series of vLLM's /metrics in the text format (a textfile collector's .prom)")
    stats.set_defaults(handler=cmd_stats)

    cache_warm.register(cmds)  # warm, compat, pin, unpin
    cache_gc.register(cmds)  # gc
    cache_trust.register(cmds)  # keygen, sign


def _size_against_bound(size: int, bound: int | None) -> str:
    if bound is None:
        return f"{human_size(size)} (no bound: {VLLM_NEURON_CACHE_MAX_SIZE} unset)"
    return f"{human_size(size)} of {human_size(bound)} ({size / bound:.0%} of the bound)"


def cmd_stats(args: argparse.Namespace) -> int:
    if args.prometheus:  # the live series' names and labels (vllm_neuron.metrics)
        try:
            from vllm_neuron.metrics import fold_events, render_text
        except ImportError as exc:
            raise RuntimeError(f"--prometheus needs prometheus_client: {exc}") from None
        print(render_text(fold_events(cache_dir(args))), end="")
        return 0
    stats = SimpleNamespace(**tier_stats(cache_dir(args)))  # the report's numbers too
    if args.json:
        print_json(vars(stats))
        return 0
    by_tier = ", ".join(f"{tier} {n}" for tier, n in sorted(stats.hits_by_tier.items()))
    rows = [
        ("location", stats.location),
        ("entries", stats.entries),
        ("size", _size_against_bound(stats.size_bytes, stats.max_size_bytes)),
        ("hit rate", "-" if stats.hit_rate is None else
         f"{stats.hit_rate:.1%} of {stats.hits + stats.misses} lookups"),
        ("hits", f"{stats.hits} ({by_tier})" if by_tier else stats.hits),
        ("misses", stats.misses),
        ("compiles", f"{stats.compiles} ({stats.compile_seconds:.1f} s)"),
        ("compile failures", stats.compile_failures),
        ("remote fetches", f"{stats.fetches} ({stats.fetch_seconds:.1f} s)"),
        ("promotions", stats.promotions),
        ("verification failures", stats.verification_failures),
        ("load failures", stats.load_failures),
        ("remote outages", stats.remote_outages),
        ("lock wait", f"{stats.lock_wait_seconds:.1f} s"),
        ("fleet lease waits", f"{stats.lease_waits} ({stats.lease_wait_seconds:.1f} s)"),
        ("lease takeovers", stats.lease_takeovers),
        ("deferred at trace", stats.deferred),
        ("evictions", f"{stats.evictions} ({human_size(stats.evicted_bytes)})"),
        ("time saved", f"{stats.time_saved_seconds:.1f} s"),
        # What tensor parallelism (any per-rank difference) cost: a piece's keys beyond one.
        ("per-rank variants", f"{stats.rank_specific_compiles} extra compile(s) over "
                              f"{stats.pieces_compiled} piece(s)"),
    ]
    print(table(["", "VALUE"], rows))
    if stats.skipped_lines:
        print(f"({stats.skipped_lines} undecodable event lines skipped)")
    return 0
