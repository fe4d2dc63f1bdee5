"""`vllm-neuron cache gc [URL] [--dry-run] [--json] [--older-than D] [--lease-grace D]
[--keep-manifest M ...]`: remove what no process will use again (`compile/upkeep/collect.py`).

A plan table (what, where, age, size, why) first, then what was removed, what stayed
because it changed since the plan (in use again), and what could not be removed. Exit
status: 0 done (also when some items stayed), 1 when something could not be removed, 2 a
bad or unreachable tier, a bad duration, a manifest that does not load, or
`--keep-manifest` without `--older-than`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm_neuron.compile.entry.notes import NOTE_KINDS
from vllm_neuron.compile.tiers.inventory import parse_duration
from vllm_neuron.compile.upkeep.collect import LEASE_GRACE, GcItem, GcOutcome, GcPlan, plan_gc
from vllm_neuron.envs import compile_cache_settings
from vllm_neuron.manifest.inspect import load_manifest

from .format import human_age, human_size, print_json, table
from .options import quiet_option
from .tiers import tier

KEPT = {
    "staging": "staging areas", "trash": "withdrawn directories",
    "orphan-version": "uncommitted versions", "tombstone": "withdrawal tombstones",
    "upload": "multipart uploads", "partial": "temp files", "lease": "leases",
    **{kind.name: kind.plural for kind in NOTE_KINDS}, "entry": "entries",
}  # fmt: skip
"""How the summary names what was looked at and kept, by kind (a note's as the registry of
per-key notes, `compile/entry/notes.py`, says)."""


def register(cmds: Any) -> None:
    gc = cmds.add_parser(
        "gc",
        help="remove what killed processes left behind (and, with --keep-manifest, "
             "entries no live deployment uses)",
        description="Remove abandoned staging areas, uncommitted versions, unfinished "
                    "uploads, expired leases, expired failure notes, withdrawal tombstones, "
                    "old quarantine and load-failure notes, promotion notes and unpacked "
                    "copies without their entry; never anything a live process holds.",
    )  # fmt: skip
    gc.add_argument("url", nargs="?", help="a tier to collect (default: the local cache)")
    gc.add_argument("--dry-run", action="store_true", help="show the plan, remove nothing")
    gc.add_argument("--json", action="store_true", help="the plan and the outcome as JSON")
    gc.add_argument("--older-than", metavar="AGE",
                    help="remove nothing younger than this (default 6h; required with "
                         "--keep-manifest), e.g. 12h, 30d")  # fmt: skip
    gc.add_argument("--lease-grace", metavar="AGE", default=None,
                    help="keep a lease's records this long after its release or expiry "
                         "(default 10m)")  # fmt: skip
    gc.add_argument("--keep-manifest", action="append", default=[], metavar="MANIFEST",
                    help="also remove every entry no such manifest names, published longer "
                         "than --older-than ago (repeatable: one per live deployment)")  # fmt: skip
    quiet_option(gc)
    gc.set_defaults(handler=cmd_gc)


def referenced_keys(manifests: list[str]) -> set[str]:
    """The graph hashes every manifest names; a manifest that does not load, or a set of
    manifests naming no graph at all, is an error (never "nothing is referenced")."""
    keys: set[str] = set()
    for location in manifests:
        where, manifest = load_manifest(location)
        if not manifest.graphs:
            print(f"vllm-neuron: warning: {where} names no graph", file=sys.stderr)
        keys.update(g.graph_hash for g in manifest.graphs)
    if not keys:
        raise ValueError("the manifests given name no graph: refusing to treat every entry "
                         "as unreferenced")  # fmt: skip
    return keys


def cmd_gc(args: argparse.Namespace) -> int:
    if args.keep_manifest and args.older_than is None:
        raise ValueError("--keep-manifest removes entries: say how old they must be, "
                         "e.g. --older-than 30d")  # fmt: skip
    older_than = None if args.older_than is None else parse_duration(args.older_than)
    grace = LEASE_GRACE if args.lease_grace is None else parse_duration(args.lease_grace)
    keep = referenced_keys(args.keep_manifest) if args.keep_manifest else None
    retry_after = compile_cache_settings().compile_retry_after
    store = tier(args)
    plan = plan_gc(store, older_than=older_than, lease_grace=grace,
                   failure_max_age=retry_after, keep=keep)  # fmt: skip
    outcome = None if args.dry_run else plan.execute()
    if args.json:
        print_json(_as_json(plan, outcome, dry_run=args.dry_run))
    else:
        _print(plan, outcome)
    return 1 if outcome is not None and outcome.failed else 0


def _rows(items: list[GcItem] | tuple[GcItem, ...]) -> list[tuple[str, ...]]:
    return [(i.what, i.where, human_age(i.age_seconds), human_size(i.size), i.reason)
            for i in items]  # fmt: skip


def _print(plan: GcPlan, outcome: GcOutcome | None) -> None:
    print(f"cache gc of {plan.store.url}: nothing younger than "
          f"{human_age(plan.bounds['older_than'])}; leases {human_age(plan.bounds['lease_grace'])} "
          f"after release or expiry; failure notes after "
          f"{human_age(plan.bounds['failure_notes'])}")  # fmt: skip
    if plan.items:
        print(table(["WHAT", "WHERE", "AGE", "SIZE", "WHY"], _rows(plan.items)))
    kept: dict[str, int] = {}
    for item in plan.kept:
        label = f"{KEPT.get(item.kind, item.kind)} ({item.reason})"
        kept[label] = kept.get(label, 0) + 1
    if kept:
        print("kept: " + "; ".join(f"{n} {label}" for label, n in sorted(kept.items())))
    for key in plan.missing:
        print(f"note: a manifest names {key}, which this tier does not hold")
    if outcome is None:
        print(f"dry run: {len(plan.items)} items, {human_size(plan.planned_bytes)} would be "
              "removed")  # fmt: skip
        return
    for item in outcome.removed:
        print(f"removed {item.where} ({item.what}, {human_size(item.size)})")
    for item, why in outcome.stayed:
        print(f"stayed  {item.where} ({why})")
    for item, error in outcome.failed:
        print(f"FAILED  {item.where}: {error}")
    print(f"removed {len(outcome.removed)} of {len(plan.items)} items, "
          f"{human_size(outcome.freed_bytes)} freed"
          + (f"; {len(outcome.stayed)} stayed (changed since the plan)" if outcome.stayed else "")
          + (f"; {len(outcome.failed)} could not be removed" if outcome.failed else ""))


def _as_json(plan: GcPlan, outcome: GcOutcome | None, *, dry_run: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "url": plan.store.url,
        "dry_run": dry_run,
        "bounds": plan.bounds,
        "plan": [i.as_dict() for i in plan.items],
        "kept": [{k: v for k, v in i.as_dict().items() if k != "what"} for i in plan.kept],
        "missing": list(plan.missing),
        "planned_bytes": plan.planned_bytes,
    }
    if outcome is not None:
        out["removed"] = [i.as_dict() for i in outcome.removed]
        out["stayed"] = [{**i.as_dict(), "why": why} for i, why in outcome.stayed]
        out["failed"] = [{**i.as_dict(), "error": err} for i, err in outcome.failed]
        out["freed_bytes"] = outcome.freed_bytes
    return out
