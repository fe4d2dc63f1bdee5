"""`vllm-neuron cache ls|stats|verify|promote|prune|explain`.

Exit status (as every `vllm-neuron` command): 0 done, 1 a problem found (`verify`: a
corrupt entry), 2 bad usage or a tier that cannot be used - a malformed URL
(``s3:/bucket``), an unknown scheme, a missing local cache, a missing bucket, refused
access, an endpoint that does not answer - with the reason on stderr. A tier given on the
command line is probed before anything is read, so a missing bucket is never "0 entries".
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_neuron.backends import (
    check_location,
    open_store,
    probe_store,
)
from vllm_neuron.compile.events import read_stats
from vllm_neuron.compile.gc import STAGING_MAX_AGE, plan_gc
from vllm_neuron.compile.inventory import (
    explain_keys,
    list_entries,
    parse_duration,
    parse_size,
    verify_entries,
    verify_entry,
)
from vllm_neuron.compile.promote import save_cache
from vllm_neuron.compile.prune import plan_prune
from vllm_neuron.compile.quarantine import quarantine_entry
from vllm_neuron.envs import remote_cache_url

from . import cache_gc, cache_warm
from .cache_warm import event_recorder, evicted_event, incompatible_here, manifest_keys
from .format import ProgressBar, human_age, human_size, print_json, table
from .tiers import cache_dir, tier


def register(sub: Any) -> None:
    parser = sub.add_parser("cache", help="inspect and maintain the compile cache")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="local cache directory (default: $VLLM_CACHE_ROOT/neuron/compile_cache)",
    )
    cmds = parser.add_subparsers(dest="cache_command", required=True)

    ls = cmds.add_parser("ls", help="list entries")
    ls.add_argument("url", nargs="?", help="a tier to list (default: the local cache)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_ls)

    stats = cmds.add_parser("stats", help="hits, misses, compiles and time saved")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(handler=cmd_stats)

    verify = cmds.add_parser("verify", help="check every checksum; exit 1 on any corrupt entry")
    verify.add_argument("url", nargs="?", help="a tier to verify (default: the local cache)")
    verify.add_argument("--keep", action="store_true", help="report only; do not quarantine")
    verify.add_argument("--json", action="store_true")
    verify.set_defaults(handler=cmd_verify)

    promote = cmds.add_parser("promote", help="copy entries to a remote tier (save_cache)")
    promote.add_argument("--to", dest="to", default=None,
                         help="remote tier URL (default: $NEURON_LIBTORCH_REMOTE_CACHE)")
    which = promote.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", action="append", help="an entry to promote (repeatable)")
    which.add_argument("--all", action="store_true", help="promote every local entry")
    promote.set_defaults(handler=cmd_promote)

    prune = cmds.add_parser("prune", help="delete old entries or shrink a tier")
    prune.add_argument("url", nargs="?", help="a tier to prune (default: the local cache)")
    prune.add_argument("--older-than", help="e.g. 30m, 12h, 7d")
    prune.add_argument("--max-size", help="least recently used first, e.g. 500M, 10G")
    prune.add_argument("--incompatible", action="store_true",
                       help="entries this environment could never hit (see `cache compat`)")
    prune.add_argument("--keep-manifest", action="append", default=[], metavar="MANIFEST",
                       help="never delete a graph this manifest lists (repeatable)")
    prune.add_argument("--dry-run", action="store_true", help="show the plan, delete nothing")
    prune.set_defaults(handler=cmd_prune)

    explain = cmds.add_parser("explain", help="which key components differ between two keys")
    explain.add_argument("key_a")
    explain.add_argument("key_b")
    explain.add_argument("url", nargs="?", help="the tier holding both (default: local)")
    explain.set_defaults(handler=cmd_explain)

    cache_warm.register(cmds)  # warm, compat, pin, unpin
    cache_gc.register(cmds)  # gc


def _promotion_target(args: argparse.Namespace) -> str:
    """`--to`, else NEURON_LIBTORCH_REMOTE_CACHE: checked and probed before any entry is
    copied, errors naming where the URL came from."""
    to = args.to or remote_cache_url()
    if not to:
        raise ValueError("promote needs --to URL (or NEURON_LIBTORCH_REMOTE_CACHE)")
    origin = f"--to {to}" if args.to else f"NEURON_LIBTORCH_REMOTE_CACHE={to!r}"
    try:
        check_location(to)
    except ValueError as exc:
        raise ValueError(f"promote {origin}: {exc}") from None
    probe_store(open_store(to))
    return to


def cmd_ls(args: argparse.Namespace) -> int:
    entries = list_entries(tier(args))
    if args.json:
        print_json([{**e.__dict__, "age_seconds": e.age_seconds} for e in entries])
        return 0
    rows = [
        (e.key, human_size(e.size), e.files, human_age(e.age_seconds), e.toolchain, e.target,
         f"{e.compile_seconds:.1f}s", e.problem or "")
        for e in entries
    ]
    print(table(["KEY", "SIZE", "FILES", "AGE", "TOOLCHAIN", "TARGET", "COMPILE", "PROBLEM"], rows))
    print(f"{len(entries)} entries, {human_size(sum(e.size for e in entries))}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    stats = read_stats(cache_dir(args))
    if args.json:
        print_json(stats)
        return 0
    by_tier = ", ".join(f"{tier} {n}" for tier, n in sorted(stats.hits_by_tier.items()))
    rows = [
        ("hits", f"{stats.hits} ({by_tier})" if by_tier else stats.hits),
        ("misses", stats.misses),
        ("compiles", f"{stats.compiles} ({stats.compile_seconds:.1f} s)"),
        ("compile failures", stats.compile_failures),
        ("remote fetches", f"{stats.fetches} ({stats.fetch_seconds:.1f} s)"),
        ("promotions", stats.promotions),
        ("verification failures", stats.verification_failures),
        ("remote outages", stats.remote_outages),
        ("lock wait", f"{stats.lock_wait_seconds:.1f} s"),
        ("fleet lease waits", f"{stats.lease_waits} ({stats.lease_wait_seconds:.1f} s)"),
        ("lease takeovers", stats.lease_takeovers),
        ("evictions", f"{stats.evictions} ({human_size(stats.evicted_bytes)})"),
        ("time saved", f"{stats.time_saved_seconds:.1f} s"),
    ]
    print(table(["", "VALUE"], rows))
    if stats.skipped_lines:
        print(f"({stats.skipped_lines} undecodable event lines skipped)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = tier(args)

    def quarantine(key: str, problem: str, version: str | None) -> None:
        if not store.capabilities.kernel_locks:
            # Only the version judged: one another node has published since stays.
            quarantine_entry(store, key, problem, version=version)
            return
        # A local tier: withdraw under the key's lock, after a re-check, so an entry that a
        # running process has just compiled in place of the corrupt one is never withdrawn.
        with store.lock(key, timeout=60.0):
            again = verify_entry(store, key)
            if again is not None:
                quarantine_entry(store, key, again)

    results = verify_entries(store, quarantine=None if args.keep else quarantine)
    bad = [r for r in results if not r.ok]
    if args.json:
        print_json(results)
    else:
        for r in results:
            print(f"{'ok     ' if r.ok else 'CORRUPT'} {r.key} {r.problem or ''}".rstrip())
        verb = "reported" if args.keep else "quarantined"
        print(f"{len(results)} entries checked, {len(bad)} corrupt" + (f" ({verb})" if bad else ""))
    return 1 if bad else 0


def cmd_promote(args: argparse.Namespace) -> int:
    to = _promotion_target(args)
    local = cache_dir(args)
    keys = args.key or [e.key for e in list_entries(tier(args)) if e.problem is None]
    promoted = 0
    for key in keys:
        published = save_cache(local, to, key, progress=ProgressBar(key[:12]))
        promoted += int(published)
        print(f"{key}: {'promoted' if published else 'already in the remote tier'}")
    print(f"{promoted} of {len(keys)} entries promoted to {to}")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    store = tier(args)
    plan = plan_prune(
        store,
        older_than=None if args.older_than is None else parse_duration(args.older_than),
        max_size=None if args.max_size is None else parse_size(args.max_size),
        incompatible=incompatible_here(store) if args.incompatible else None,
        keep=manifest_keys(args.keep_manifest),
    )
    # Always collected too: what processes killed mid-write left behind (invisible, but it
    # would pile up on a shared tier that no compiling process ever cleans): `cache gc`'s
    # plan with its default bounds (6 h), which never removes an entry.
    leftovers = plan_gc(store, older_than=STAGING_MAX_AGE)
    for e in plan.delete:
        print(f"{'would delete' if args.dry_run else 'delete'} {e.key} "
              f"{human_size(e.size)} ({plan.reasons[e.key]})")
    for left in leftovers.items:
        print(f"{'would remove' if args.dry_run else 'remove'} {left.what} {left.where} "
              f"{human_size(left.size)} ({human_age(left.age_seconds)} old)")
    for key, why in plan.kept.items():
        print(f"keep {key} ({why})")
    if args.dry_run:
        print(f"dry run: {len(plan.delete)} entries, {human_size(plan.freed_bytes)} would be freed"
              + (f"; {len(leftovers.items)} leftovers of killed processes"
                 if leftovers.items else ""))
        return 0
    removed = plan.execute(None if args.url else evicted_event(event_recorder(store)))
    for key, why in plan.stayed.items():
        print(f"kept {key} ({why})")
    swept = leftovers.execute()
    for item, error in swept.failed:
        print(f"could not remove {item.what} {item.where}: {error}")
    print(f"{removed} entries deleted, {human_size(plan.freed_bytes)} freed"
          + (f"; {len(swept.removed)} leftovers of killed processes removed"
             if swept.removed else ""))
    if swept.failed:
        return 1
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    diff = explain_keys(tier(args), args.key_a, args.key_b)
    if not diff:
        print("the two entries have identical key components")
        return 0
    print(table(["COMPONENT", args.key_a[:12], args.key_b[:12]],
                [(name, a[:16], b[:16]) for name, (a, b) in diff.items()]))
    return 0
