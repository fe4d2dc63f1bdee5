"""`vllm-neuron cache warm|compat|pin|unpin`: readying a node, upgrading, keeping entries.

* ``warm MANIFEST [--remote URL] [--jobs N] [--json]``: fetch every graph the manifest lists into
  the local tier (`compile/commands/warm.py`); exit 1 listing what the remote lacks (or holds
  defective), 2 for a remote that is malformed, missing or unreachable.
* ``bake MANIFEST... --into DIR [--from URL ...] [--jobs N] [--json]``: the same warm into
  a directory that will be a read-only (baked) tier, from each ``--from`` in turn (default:
  the local tier, where a start compiled, then ``$NEURON_LIBTORCH_REMOTE_CACHE``); every
  entry verified, judged by the trust policy, pre-unpacked; exit 1 naming what is missing
  or fails (docs/bake-an-image.md).
* ``compat [URL] [--json]``: per entry, would this environment hit it, and if not which
  key component differs (`compile/commands/compat.py`); exit 1 when any entry could never be hit.
* ``pin [KEY ...] [--manifest M] [--note TEXT] [--json]``,
  ``unpin (KEY ... | --manifest M | --all) [--json]``:
  entries that neither the size bound nor ``prune`` ever removes (`compile/upkeep/eviction.py`);
  ``pin`` alone lists the pins.

Registered by `cli/cache.py` (`register`), whose helpers (`_tier`, `_cache_dir`) they use.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import time
from typing import Any

from vllm_neuron.backends import (
    Record,
    Store,
    StoreError,
    check_location,
    check_remote_location,
    open_store,
    probe_store,
)
from vllm_neuron.compile.entry.events import EVENTS_STREAM
from vllm_neuron.envs import remote_cache_url

from .format import human_size, print_json, table
from .options import JSON_HELP, quiet_option
from .progress import ByteProgress
from .tiers import cache_dir, tier


def register(cmds: Any) -> None:
    warm = cmds.add_parser("warm", help="fetch every graph of a manifest into the local tier")
    warm.add_argument("manifest", help="manifest.json, an engine directory, or a URL")
    warm.add_argument("--remote", default=None,
                      help="the tier to fetch from (default: $NEURON_LIBTORCH_REMOTE_CACHE)")
    warm.add_argument("--jobs", type=int, default=None,
                      help="entries fetched at once (default: 4)")
    warm.add_argument("--json", action="store_true", help=JSON_HELP)
    quiet_option(warm)
    warm.set_defaults(handler=cmd_warm)

    bake = cmds.add_parser("bake", help="fill a directory to ship as a read-only tier")
    bake.add_argument("manifests", nargs="+", metavar="MANIFEST",
                      help="manifest.json, an engine directory, or a URL: whose graphs to bake")
    bake.add_argument("--into", required=True, help="the directory to fill")
    bake.add_argument("--from", dest="sources", action="append", default=[],
                      help="a tier to copy from, in order (repeatable; default: the local "
                           "tier, then $NEURON_LIBTORCH_REMOTE_CACHE)")
    bake.add_argument("--jobs", type=int, default=None, help="entries fetched at once")
    bake.add_argument("--json", action="store_true", help=JSON_HELP)
    quiet_option(bake)
    bake.set_defaults(handler=cmd_bake)

    compat = cmds.add_parser(
        "compat", help="would this environment hit each entry; which key component differs")
    compat.add_argument("url", nargs="?", help="a tier to check (default: the local cache)")
    compat.add_argument("--json", action="store_true", help=JSON_HELP)
    compat.set_defaults(handler=cmd_compat)

    pin = cmds.add_parser("pin", help="keep entries whatever the size bound; alone: list pins")
    pin.add_argument("keys", nargs="*", metavar="KEY", help="an entry to pin (none: list pins)")
    pin.add_argument("--manifest", action="append", default=[],
                     help="pin every graph this manifest lists (repeatable)")
    pin.add_argument("--note", default="", help="why (shown by `cache pin`)")
    pin.add_argument("--json", action="store_true", help=JSON_HELP)
    pin.set_defaults(handler=cmd_pin)

    unpin = cmds.add_parser("unpin", help="let pinned entries be evicted again")
    unpin.add_argument("keys", nargs="*", metavar="KEY", help="an entry to unpin")
    unpin.add_argument("--manifest", action="append", default=[],
                       help="unpin every graph this manifest lists (repeatable)")
    unpin.add_argument("--all", action="store_true", help="remove every pin")
    unpin.add_argument("--json", action="store_true", help=JSON_HELP)
    unpin.set_defaults(handler=cmd_unpin)


# ----------------------------------------------------------------- helpers
def open_remote(url: str, origin: str) -> Store:
    """A remote tier named on the command line (`origin` says where the URL came from):
    checked as every remote is (`check_remote_location`: a mangled URL, with the URL meant,
    or a relative path is a ValueError naming `origin`), opened without creating anything,
    probed (a missing bucket, refused access or no answer is a `StoreUnavailable`)."""
    check_remote_location(url, origin)
    try:
        store = open_store(url, create=False)
        probe_store(store)
    except (StoreError, OSError) as exc:  # exit 2, naming where the URL came from
        raise ValueError(f"{origin}: {exc}") from exc
    return store


def manifest_keys(locations: list[str]) -> list[str]:
    """The graph keys of every manifest in `locations`, in order, without repeats."""
    from vllm_neuron.manifest.inspect import load_manifest  # the manifest feature

    keys: dict[str, None] = {}
    for location in locations:
        _, manifest = load_manifest(location)
        keys.update(dict.fromkeys(g.graph_hash for g in manifest.graphs))
    return list(keys)


def event_recorder(store: Store) -> Any:
    """Append records to this process's segment of the tier's events (best-effort)."""
    log = store.log(EVENTS_STREAM, writer=f"{socket.gethostname()}-{os.getpid()}")

    def record(event: Record) -> None:
        with contextlib.suppress(Exception):  # statistics never fail a command
            log.append(event)

    return record


def evicted_event(record: Any) -> Any:
    """`PrunePlan.execute`'s callback: an ``evict`` event per entry withdrawn."""
    from vllm_neuron.compile.entry.events import Evicted

    def note(info: Any, last_used: float, reason: str) -> None:
        record(Evicted(key=info.key, at=time.time(), size=info.size, last_used=last_used,
                       reason=reason))

    return note


def incompatible_here(store: Store) -> dict[str, str]:
    """{key: why} of the entries of `store` this environment could never hit."""
    from vllm_neuron.compile.commands.compat import (
        current_toolchain,
        environment_of,
        incompatible_entries,
    )

    return incompatible_entries(store, environment_of(current_toolchain()))


# ------------------------------------------------------------------- warm
def cmd_warm(args: argparse.Namespace) -> int:
    from vllm_neuron.compile.commands.warm import DEFAULT_JOBS, warm_keys
    from vllm_neuron.compile.upkeep.eviction import Evictor
    from vllm_neuron.envs.compile_cache import cache_max_size


    jobs = DEFAULT_JOBS if args.jobs is None else args.jobs
    if jobs < 1:
        raise ValueError(f"--jobs must be 1 or more, got {jobs}")
    url = args.remote or remote_cache_url()
    if not url:
        raise ValueError("warm needs --remote URL (or NEURON_LIBTORCH_REMOTE_CACHE)")
    origin = f"--remote {url}" if args.remote else f"NEURON_LIBTORCH_REMOTE_CACHE={url!r}"
    keys = manifest_keys([args.manifest])
    bound = cache_max_size()  # a malformed VLLM_NEURON_CACHE_MAX_SIZE: exit 2, named
    remote = open_remote(url, origin)
    local = open_store(cache_dir(args))
    record = event_recorder(local)
    with ByteProgress(enabled=not (args.json or args.quiet)) as bars:
        bar = bars.task(f"warm {len(keys)} graphs")
        result = warm_keys(local, remote, keys, jobs=jobs,
                           on_total=None if bar is None else bar.total,
                           on_bytes=None if bar is None else bar.advance, record=record)
    if bound is not None:  # the warmed graphs are what this node is about to serve
        Evictor(local, bound, record=record).run(protect=set(keys))
    code = 2 if result.errors else (0 if result.complete else 1)
    if args.json:
        print_json({
            "remote": remote.url, "graphs": len(keys), "fetched": result.fetched,
            "fetched_bytes": result.fetched_bytes, "seconds": result.seconds,
            "present": result.present, "missing": result.missing,
            "defective": result.defective, "untrusted": result.untrusted,
            "errors": result.errors,
        })  # fmt: skip
        return code
    for key in result.missing:
        print(f"MISSING   {key} (not in {remote.url})")
    for key, why in result.defective.items():
        print(f"DEFECTIVE {key}: {why}")
    for key, why in result.untrusted.items():
        print(f"untrusted {key}: {why} (not copied)")
    for key, why in result.errors.items():
        print(f"FAILED    {key}: {why}")
    print(f"{len(keys)} graphs: {len(result.fetched)} fetched "
          f"({human_size(result.fetched_bytes)} in {result.seconds:.1f} s), "
          f"{len(result.present)} already local, {len(result.missing)} missing, "
          f"{len(result.defective)} defective, "
          + (f"{len(result.untrusted)} untrusted, " if result.untrusted else "")
          + f"{len(result.errors)} failed")
    return code


# ------------------------------------------------------------------- bake
def cmd_bake(args: argparse.Namespace) -> int:
    from vllm_neuron.backends import local_root_missing
    from vllm_neuron.compile.commands.compat import current_toolchain
    from vllm_neuron.compile.commands.warm import DEFAULT_JOBS, bake_keys

    jobs = DEFAULT_JOBS if args.jobs is None else args.jobs
    if jobs < 1:
        raise ValueError(f"--jobs must be 1 or more, got {jobs}")
    named = [(url, f"--from {url}") for url in args.sources]
    if not named:
        local = cache_dir(args)
        if not local_root_missing(check_location(local)):
            named.append((local, f"the local compile cache {local}"))
        remote_url = remote_cache_url()
        if remote_url:
            named.append((remote_url, f"NEURON_LIBTORCH_REMOTE_CACHE={remote_url!r}"))
    if not named:
        raise ValueError("bake needs --from URL (no local tier here, no "
                         "NEURON_LIBTORCH_REMOTE_CACHE)")
    sources = [open_remote(url, origin) for url, origin in named]
    keys = manifest_keys(args.manifests)
    into = open_store(check_location(args.into))
    result = bake_keys(into, sources, keys, toolchain=current_toolchain(), jobs=jobs)
    errors = {k: v for _, w in result.warms for k, v in w.errors.items()}
    code = 2 if errors and result.missing else (0 if result.complete else 1)
    if args.json:
        print_json({"into": into.url, "graphs": len(keys), "sources": result.sources,
                    "missing": result.missing, "failed": result.failed,
                    "unpacked": result.unpacked, "errors": errors})
        return code
    for key in result.missing:
        print(f"MISSING   {key} (in none of {', '.join(s.url for s in sources)})"
              + (f": {errors[key]}" if key in errors else ""))
    for key, why in result.failed.items():
        print(f"FAILED    {key}: {why}")
    print(f"{len(keys)} graphs baked into {into.url}: {len(result.sources)} copied or present, "
          f"{len(result.unpacked)} unpacked, {len(result.missing)} missing, "
          f"{len(result.failed)} failed")
    return code


# ----------------------------------------------------------------- compat
def cmd_compat(args: argparse.Namespace) -> int:
    from vllm_neuron.compile.commands.compat import check_compat, current_toolchain, environment_of


    store = tier(args)
    env = environment_of(current_toolchain())
    results = check_compat(store, env)
    if args.json:
        print_json({
            "environment": env,
            "entries": [{**r.__dict__, "reason": r.reason} for r in results],
        })
    else:
        print(f"this environment: toolchain {env.toolchain}, target {env.target}, "
              f"versions {', '.join(f'{k}={v}' for k, v in sorted(env.versions.items()))}"
              + (f", flags {' '.join(env.compiler_args)}" if env.compiler_args else ""))
        word = {True: "hit", False: "NEVER", None: "unknown"}
        rows = [(r.key, word[r.compatible], r.toolchain, r.target, human_size(r.size), r.reason)
                for r in results]
        print(table(["KEY", "HIT", "TOOLCHAIN", "TARGET", "SIZE", "WHY NOT"], rows))
        never = [r for r in results if r.compatible is False]
        print(f"{len(results)} entries: {len(results) - len(never)} usable here, "
              f"{len(never)} never hit here ({human_size(sum(r.size for r in never))})")
    return 1 if any(r.compatible is False for r in results) else 0


# -------------------------------------------------------------------- pins
def _pin_tier(args: argparse.Namespace, *, create: bool) -> Store:
    """The tier the pins are in (`--cache-dir`, default the local tier); created only to
    write a pin (a deployment's graphs may be pinned before the node has a cache)."""
    from vllm_neuron.backends import local_root_missing


    url = check_location(cache_dir(args))
    if not create and local_root_missing(url):
        raise ValueError(f"no compile cache at {url}")
    return open_store(url, create=create)


def cmd_pin(args: argparse.Namespace) -> int:
    from vllm_neuron.compile.upkeep.eviction import pin, read_pins

    keys = list(dict.fromkeys([*args.keys, *manifest_keys(args.manifest)]))
    store = _pin_tier(args, create=bool(keys))
    if not keys:
        pins = read_pins(store)
        if args.json:
            print_json({"url": store.url, "pins": [
                {"key": key, "by": None if p is None else p.by,
                 "note": None if p is None else p.note,
                 "in_tier": store.published(key) is not None} for key, p in pins.items()]})
            return 0
        rows = [(key, "?" if p is None else p.by, "?" if p is None else p.note,
                 "yes" if store.published(key) is not None else "no")
                for key, p in pins.items()]
        print(table(["KEY", "BY", "NOTE", "IN TIER"], rows))
        print(f"{len(pins)} pinned entries in {store.url}")
        return 0
    done = [{"key": key, "new": pin(store, key, note=args.note),
             "in_tier": store.published(key) is not None} for key in keys]
    if args.json:
        print_json({"url": store.url, "pinned": done})
        return 0
    for d in done:
        here = "" if d["in_tier"] else " (not in the tier yet)"
        print(f"{'pinned' if d['new'] else 'already pinned'} {d['key']}{here}")
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    from vllm_neuron.compile.upkeep.eviction import pinned_keys, unpin

    store = _pin_tier(args, create=False)
    keys = list(dict.fromkeys([*args.keys, *manifest_keys(args.manifest)]))
    if args.all:
        keys = sorted(pinned_keys(store))
    elif not keys:
        raise ValueError("unpin needs KEY ..., --manifest M or --all")
    removed = [key for key in keys if unpin(store, key)]
    if args.json:
        print_json({"url": store.url, "removed": removed,
                    "not_pinned": [k for k in keys if k not in removed]})
        return 0
    print(f"{len(removed)} of {len(keys)} pins removed")
    return 0
