"""`vllm-neuron cache ls|verify|promote|prune|explain`: the entries of one tier.

Every one takes ``--json``: one JSON document on stdout holding what the table shows
(progress bars, warnings and errors go to stderr, and no bar is drawn under ``--json``).
Exit status as every command: 0 done, 1 a problem found (`verify`: a corrupt entry;
`promote`: an entry that could not be promoted; `prune`: a leftover that could not be
removed), 2 bad usage or a tier that cannot be used.

Registered by `cli/cache.py` (`register`), whose ``--cache-dir`` they read.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from vllm_neuron.backends import check_remote_location, open_store, probe_store
from vllm_neuron.compile.commands.load_check import LoadCheck, check_loads, is_own_tier
from vllm_neuron.compile.commands.prune import plan_prune
from vllm_neuron.compile.entry.check import verify_entry
from vllm_neuron.compile.entry.load_failure_notes import read_load_failures
from vllm_neuron.compile.entry.notes import LoadFailureNote
from vllm_neuron.compile.tiers.inventory import (
    EntryInfo,
    explain_entries,
    list_entries,
    parse_duration,
    parse_size,
    verify_entries,
)
from vllm_neuron.compile.tiers.promote import save_cache
from vllm_neuron.compile.tiers.quarantine import quarantine_entry
from vllm_neuron.compile.tiers.unpacked import unpacked_sizes
from vllm_neuron.compile.trust.policy import signer_of
from vllm_neuron.compile.upkeep.collect import STAGING_MAX_AGE, plan_gc
from vllm_neuron.envs import compile_cache_settings, remote_cache_url

from .cache_trust import load_policy, trust_check, trusted_keys_option
from .cache_warm import event_recorder, evicted_event, incompatible_here, manifest_keys
from .format import human_age, human_size, print_json, table
from .options import JSON_HELP, quiet_option
from .progress import ByteProgress, callback
from .tiers import cache_dir, tier


def register(cmds: Any) -> None:
    ls = cmds.add_parser("ls", help="list entries (a record that does not read, or a file "
                                    "of the wrong size, is named under PROBLEM)")
    ls.add_argument("url", nargs="?", help="a tier to list (default: the local cache)")
    ls.add_argument("--json", action="store_true", help=JSON_HELP)
    ls.set_defaults(handler=cmd_ls)

    verify = cmds.add_parser("verify", help="check every checksum; exit 1 on any corrupt entry")
    verify.add_argument("url", nargs="?", help="a tier to verify (default: the local cache)")
    verify.add_argument("--keep", action="store_true", help="report only; do not quarantine")
    verify.add_argument("--load", action="store_true",
                        help="also load every sound entry with its toolchain, in this Python: "
                        "exit 1 naming each that does not load on this node (never withdrawn "
                        "for it)")  # fmt: skip
    verify.add_argument("--json", action="store_true", help=JSON_HELP)
    trusted_keys_option(verify)
    quiet_option(verify)
    verify.set_defaults(handler=cmd_verify)

    promote = cmds.add_parser("promote", help="copy entries to a remote tier (save_cache)")
    promote.add_argument("--to", dest="to", default=None,
                         help="remote tier URL (default: $NEURON_LIBTORCH_REMOTE_CACHE)")
    which = promote.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", action="append", help="an entry to promote (repeatable)")
    which.add_argument("--all", action="store_true", help="promote every local entry")
    promote.add_argument("--json", action="store_true", help=JSON_HELP)
    quiet_option(promote)
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
    prune.add_argument("--json", action="store_true", help=JSON_HELP)
    quiet_option(prune)
    prune.set_defaults(handler=cmd_prune)

    explain = cmds.add_parser(
        "explain", help="which key components differ between two keys, and the values "
                        "behind them where the entries record them")
    explain.add_argument("key_a", help="an entry's key")
    explain.add_argument("key_b", help="the key to compare it with")
    explain.add_argument("url", nargs="?", help="the tier holding both (default: local)")
    explain.add_argument("--json", action="store_true", help=JSON_HELP)
    explain.set_defaults(handler=cmd_explain)


# --------------------------------------------------------------------- ls
def entry_json(e: EntryInfo, notes: Sequence[LoadFailureNote] = (),
               signer: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One `cache ls --json` row: the entry, with ``age_seconds`` null when unknown, the
    key id its signature names (``signer``, null: unsigned), and the hosts that fetched it
    but could not load it (``load_failures``)."""
    return {**e.__dict__, "age_seconds": e.known_age, "signer": signer,
            "load_failures": [{"host": n.host, "at": n.at, "error": n.error} for n in notes]}


def _problem(e: EntryInfo, notes: Sequence[LoadFailureNote]) -> str:
    said = [e.problem] if e.problem else []
    if notes:
        hosts = ", ".join(sorted({n.host for n in notes}))
        said.append(f"did not load on {hosts}: {notes[-1].error[:120]}")
    return "; ".join(said)


def cmd_ls(args: argparse.Namespace) -> int:
    store = tier(args)
    entries = list_entries(store, sizes=True)
    notes = read_load_failures(store)
    signers = {e.key: signer_of(store, e.key) for e in entries}
    # A local tier's unpacked copies of host packages go with their entries (and count
    # against VLLM_NEURON_CACHE_MAX_SIZE): said beside the recorded files' bytes.
    try:
        copies = unpacked_sizes(store)
    except OSError:
        copies = {}
    if args.json:
        print_json([{**entry_json(e, notes.get(e.key, ()), signers[e.key]),
                     "unpacked_size": copies.get(e.key, 0)} for e in entries])  # fmt: skip
        return 0
    rows = [
        (e.key, human_size(e.size), e.files,
         "-" if e.known_age is None else human_age(e.known_age), e.toolchain, e.target,
         f"{e.compile_seconds:.1f}s", signers[e.key] or "unsigned",
         _problem(e, notes.get(e.key, ())))
        for e in entries
    ]  # fmt: skip
    print(table(["KEY", "SIZE", "FILES", "AGE", "TOOLCHAIN", "TARGET", "COMPILE", "SIGNER",
                 "PROBLEM"], rows))  # fmt: skip
    bad = sum(1 for e in entries if e.problem)
    copied = sum(copies.get(e.key, 0) for e in entries)
    print(f"{len(entries)} entries, {human_size(sum(e.size for e in entries))}"
          + (f" (and {human_size(copied)} of unpacked copies)" if copied else "")
          + (f", {bad} with a problem" if bad else ""))
    return 0


# ----------------------------------------------------------------- verify
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
    loads: dict[str, LoadCheck] = {}
    if args.load:  # this node's word only: reported, never quarantined for it
        policy = load_policy(args)
        own = is_own_tier(store)  # by the filesystem, not by which option named the tier
        never_here = incompatible_here(store)  # another target or CPU: not this node's to say
        for r in results:
            if not r.ok:
                continue
            why = never_here.get(r.key)
            loads[r.key] = (LoadCheck(None, f"cannot check here: {why}") if why
                            else check_loads(store, r.key, policy=policy,
                                             own_tier=own))  # fmt: skip
    unloadable = [k for k, c in loads.items() if c.loads is False]
    trust = trust_check(args, store)
    untrusted = [] if trust is None else [r.key for r in results
                                          if r.ok and r.key in trust and not trust[r.key].trusted]
    if args.json:
        print_json([{**asdict(r), **({"loads": loads[r.key].loads, "load_detail":
                     loads[r.key].detail} if r.key in loads else {}),
                     **({"trust": trust[r.key].status, "signer": trust[r.key].key_id,
                         "trust_detail": trust[r.key].reason}
                        if trust is not None and r.key in trust else {})}
                    for r in results])  # fmt: skip
    else:
        for r in results:
            check = loads.get(r.key)
            if r.key in untrusted and trust is not None:
                print(f"{trust[r.key].status.upper():7} {r.key} {trust[r.key].reason}")
            elif check is not None and check.loads is not True:
                label = "NO-LOAD" if check.loads is False else "ok?    "
                print(f"{label} {r.key} {check.detail}")
            else:
                print(f"{'ok     ' if r.ok else 'CORRUPT'} {r.key} {r.problem or ''}".rstrip())
        verb = "reported" if args.keep else "quarantined"
        print(f"{len(results)} entries checked, {len(bad)} corrupt" + (f" ({verb})" if bad else "")
              + (f", {len(unloadable)} do not load here" if args.load else "")
              + (f", {len(untrusted)} not signed by a trusted key" if trust is not None
                 else ""))  # fmt: skip
    return 1 if bad or unloadable or untrusted else 0


# ---------------------------------------------------------------- promote
def _promotion_target(args: argparse.Namespace) -> str:
    """`--to`, else NEURON_LIBTORCH_REMOTE_CACHE: checked and probed before any entry is
    copied, errors naming where the URL came from."""
    to = args.to or remote_cache_url()
    if not to:
        raise ValueError("promote needs --to URL (or NEURON_LIBTORCH_REMOTE_CACHE)")
    origin = f"--to {to}" if args.to else f"NEURON_LIBTORCH_REMOTE_CACHE={to!r}"
    check_remote_location(to, f"promote {origin}")  # s3//x: "did you mean s3://x?"
    probe_store(open_store(to))
    return to


def cmd_promote(args: argparse.Namespace) -> int:
    """Each entry copied with a bar moving by bytes (on a terminal); an entry that cannot
    be promoted (missing or corrupt locally) is named and the others still go: exit 1."""
    to = _promotion_target(args)
    local = cache_dir(args)
    listed = {e.key: e for e in list_entries(tier(args))}
    keys = args.key or [k for k, e in listed.items() if e.problem is None]
    results: list[dict[str, Any]] = []
    with ByteProgress(enabled=not (args.json or args.quiet)) as bars:
        for key in keys:
            size = listed[key].size if key in listed else 0
            bar = bars.task(f"promote {key[:12]}")
            try:
                published = save_cache(local, to, key, progress=callback(bar))
            except RuntimeError as exc:  # the local entry is missing or corrupt
                results.append({"key": key, "outcome": "failed", "size": size,
                                "error": str(exc)})
                continue

            results.append({"key": key, "outcome": "promoted" if published else "present",
                            "size": size, "error": None})
    promoted = sum(1 for r in results if r["outcome"] == "promoted")
    failed = [r for r in results if r["outcome"] == "failed"]
    if args.json:
        print_json({"to": to, "entries": results, "promoted": promoted, "failed": len(failed)})
        return 1 if failed else 0
    words = {"promoted": "promoted", "present": "already in the remote tier"}
    for r in results:
        print(f"{r['key']}: " + (words[r["outcome"]] if r["error"] is None
                                 else f"FAILED: {r['error']}"))
    print(f"{promoted} of {len(keys)} entries promoted to {to}"
          + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


# ------------------------------------------------------------------ prune
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
    leftovers = plan_gc(store, older_than=STAGING_MAX_AGE,
                        failure_max_age=compile_cache_settings().compile_retry_after)
    out: dict[str, Any] = {
        "url": store.url, "dry_run": args.dry_run,
        "delete": [{"key": e.key, "size": e.size, "reason": plan.reasons[e.key]}
                   for e in plan.delete],
        "leftovers": [left.as_dict() for left in leftovers.items],
        "kept": dict(plan.kept), "freed_bytes": plan.freed_bytes,
    }  # fmt: skip
    if not args.json:
        for e in plan.delete:
            print(f"{'would delete' if args.dry_run else 'delete'} {e.key} "
                  f"{human_size(e.size)} ({plan.reasons[e.key]})")
        for left in leftovers.items:
            print(f"{'would remove' if args.dry_run else 'remove'} {left.what} {left.where} "
                  f"{human_size(left.size)} ({human_age(left.age_seconds)} old)")
        for key, why in plan.kept.items():
            print(f"keep {key} ({why})")
    if args.dry_run:
        if args.json:
            print_json(out)
            return 0
        print(f"dry run: {len(plan.delete)} entries, {human_size(plan.freed_bytes)} would be freed"
              + (f"; {len(leftovers.items)} leftovers of killed processes"
                 if leftovers.items else ""))
        return 0
    removed = plan.execute(None if args.url else evicted_event(event_recorder(store)))
    swept = leftovers.execute()
    out.update(deleted=removed, stayed=dict(plan.stayed),
               removed_leftovers=[item.as_dict() for item in swept.removed],
               failed=[{**item.as_dict(), "error": str(error)} for item, error in swept.failed])
    if args.json:
        print_json(out)
        return 1 if swept.failed else 0
    for key, why in plan.stayed.items():
        print(f"kept {key} ({why})")
    for item, error in swept.failed:
        print(f"could not remove {item.what} {item.where}: {error}")
    print(f"{removed} entries deleted, {human_size(plan.freed_bytes)} freed"
          + (f"; {len(swept.removed)} leftovers of killed processes removed"
             if swept.removed else ""))
    return 1 if swept.failed else 0


# ---------------------------------------------------------------- explain
def _value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return "; ".join(_value(v) if isinstance(v, (list, tuple, dict)) else str(v)
                         for v in value) or "(none)"
    return str(value)


def cmd_explain(args: argparse.Namespace) -> int:
    diffs = explain_entries(tier(args), args.key_a, args.key_b)
    if args.json:
        print_json({
            "key_a": args.key_a, "key_b": args.key_b, "identical": not diffs,
            "components": [{"name": d.name, "hash_a": d.hash_a, "hash_b": d.hash_b,
                            "values": {label: {"a": a, "b": b}
                                       for label, (a, b) in d.values.items()}}
                           for d in diffs],
        })  # fmt: skip
        return 0
    if not diffs:
        print("the two entries have identical key components")
        return 0
    rows = []
    for d in diffs:
        rows.append((d.name, d.hash_a[:16], d.hash_b[:16]))
        rows += [(f"  {label}", _value(a), _value(b)) for label, (a, b) in d.values.items()]
    print(table(["COMPONENT", args.key_a[:12], args.key_b[:12]], rows))
    return 0
