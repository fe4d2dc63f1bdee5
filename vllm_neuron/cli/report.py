"""`vllm-neuron report DIR|URL ... -o report.html`: one self-contained page for a deployment.

The library is `vllm_neuron.report` (docs/report.md); this module parses the arguments and
hands the report the statistics of each local tier from the function `vllm-neuron cache
stats --json` prints (`compile/commands/stats.py` `tier_stats`), so the page's numbers and
the command's never disagree, and neither parses the other's output.

Exit status: 0 the page was written; 2 bad usage - a root or option naming something
malformed, missing or unreachable (the message names the argument and its value), or an
output that cannot be written.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from vllm_neuron.backends import check_location, is_url, local_root_missing, open_store
from vllm_neuron.compile.commands.stats import tier_stats
from vllm_neuron.report.gather import gather
from vllm_neuron.report.page import render_page
from vllm_neuron.report.roots import (
    CACHE,
    MANIFESTS,
    PROFILES,
    REMOTE,
    SNAPSHOTS,
    resolve_sources,
)


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "report", help="one self-contained HTML page: manifests, cache timeline and stats, "
        "snapshot bundles, profile runs",
        description="Roots are looked at for neuron/compile_cache, neuron/snapshots (a "
        "VLLM_CACHE_ROOT), manifests, agent_artifacts/profiles (a project root), else for "
        "what they hold themselves (a tier: its event log or its entries), else for children "
        "that are either (a directory of nodes: the demo's output); an explicit option "
        "replaces what the roots give for its kind. A tier with an event log is local, one "
        "with entries and none is remote. Any root may be a URL (s3://...).",
    )  # fmt: skip
    parser.add_argument("roots", nargs="*", metavar="DIR|URL", help="deployment roots")
    parser.add_argument("-o", "--output", default="report.html",
                        help="the page to write (default: report.html; a URL works too)")
    for option, what in (("cache-dir", "a compile-cache tier, local or remote by what it "
                                       "holds"),
                         ("remote", "a remote compile-cache tier (read as one whatever it "
                                    "holds)"),
                         ("manifest-dir", "a manifest directory or one engine's"),
                         ("snapshot-dir", "a snapshot root"),
                         ("profile-dir", "a directory of profile runs, or one run")):
        parser.add_argument(f"--{option}", action="append", default=[], metavar="DIR|URL",
                            help=f"{what} (repeatable)")  # fmt: skip
    parser.add_argument("--replay", action="store_true",
                        help="replay every snapshot bundle (needs torch) and show the errors")
    parser.set_defaults(handler=cmd_report)


def _write(output: str, page: str) -> str:
    """Write the page atomically through the store of its directory; its location."""
    try:
        check_location(output)
    except ValueError as exc:
        raise ValueError(f"-o {output!r}: {exc}") from None
    if is_url(output):
        parent, _, name = output.rstrip("/").rpartition("/")
    else:
        parent, name = os.path.split(os.path.abspath(output))
        if local_root_missing(parent):
            raise ValueError(f"-o {output!r}: no directory {parent}")
    if not name:
        raise ValueError(f"-o {output!r}: not a file name")
    store = open_store(parent, create=False)
    store.write(name, page.encode("utf-8"))
    return f"{store.url.rstrip('/')}/{name}"


def cmd_report(args: argparse.Namespace) -> int:
    explicit = {CACHE: args.cache_dir, REMOTE: args.remote, MANIFESTS: args.manifest_dir,
                SNAPSHOTS: args.snapshot_dir, PROFILES: args.profile_dir}  # fmt: skip
    if not args.roots and not any(explicit.values()):
        raise ValueError("report: give at least one DIR|URL root (or --cache-dir, --remote, "
                         "--manifest-dir, --snapshot-dir, --profile-dir)")  # fmt: skip
    sources = resolve_sources(args.roots, explicit)
    report = gather(sources, stats_of=tier_stats, generated=time.time(),
                    replay=args.replay)  # fmt: skip
    where = _write(args.output, render_page(report))
    compiles = sum(int(c.stats.get("compiles", 0)) for c in report.caches)
    fetches = sum(int(c.stats.get("fetches", 0)) for c in report.caches)
    processes = sum(len(c.rows) for c in report.caches)
    remote = sum(c.remote for c in report.caches)
    entries = sum(len(c.entries.live) for c in report.caches if c.entries)
    print(f"wrote {where}: {len(report.engines)} engines, {processes} processes "
          f"({compiles} compiles, {fetches} fetches), "
          f"{sum(len(s.listing.bundles) for s in report.snapshots if s.listing)} snapshot "
          f"bundles, {len(report.profiles)} profile runs; {len(report.caches)} tiers "
          f"({len(report.caches) - remote} local, {remote} remote) holding {entries} "
          "entries")  # fmt: skip
    return 0
