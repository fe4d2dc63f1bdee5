"""Warming a node before it serves: every graph a manifest lists, fetched into the local tier.

`warm_keys` takes the keys (a manifest's ``graph_hash`` values are cache keys) and, in
`jobs` threads, fetches each one the local tier does not hold from the remote exactly as
the cache's own fetch does (`remote_tier.fetch_entry`: every file verified as it is
copied, the record written last, published atomically), under the key's local lock, so a
process of the node compiling or fetching the same key at the same time is waited for,
not raced. A local entry that fails its size check is quarantined and fetched again.

Nothing is written to the remote: a defective remote entry is reported, not withdrawn
(`vllm-neuron cache verify URL` does that). Each fetch is a ``fetch`` event in the local
tier, so `cache stats` counts it and eviction sees it as a use.

`bake_keys` is the same warm into a directory that will be a read-only tier (an image's,
docs/bake-an-image.md), from one or more sources, with every entry then verified in full,
judged by the trust policy, its package pre-unpacked, and a record of what was baked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_neuron.backends import Record, Store, join
from vllm_neuron.backends.records import RECORD_MAX_BYTES, encode

from ..entry.check import KEY_RE, check_entry, verify_entry
from ..entry.events import Fetched
from ..entry.record import ENTRY_RECORD, EntryProblem, decode_record, read_record
from ..tiers.quarantine import quarantine_entry
from ..tiers.remote import fetch_entry
from ..tiers.unpacked import copy_name, unpacked_dir
from ..toolchains.base import ARTIFACTS, Toolchain
from ..trust.policy import TrustPolicy, UntrustedEntry, refusal, trust_policy

DEFAULT_JOBS = 4
"""Entries fetched at once by `vllm-neuron cache warm` (each copies its files in parallel
too)."""


@dataclass
class WarmResult:
    """What a warm did, per key: already local, fetched, missing from the remote (or not a
    key), defective on the remote, untrusted (not signed by a key this process trusts,
    under ``VLLM_NEURON_CACHE_TRUST=require``: never copied), or failed (an I/O error, the
    remote unreachable)."""

    present: list[str] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    defective: dict[str, str] = field(default_factory=dict)
    untrusted: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    fetched_bytes: int = 0
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every key is in the local tier now."""
        return not (self.missing or self.defective or self.untrusted or self.errors)


def unique_keys(keys: Sequence[str]) -> list[str]:
    """`keys` without repeats, in order."""
    return list(dict.fromkeys(keys))


def warm_keys(
    local: Store,
    remote: Store,
    keys: Sequence[str],
    *,
    jobs: int = DEFAULT_JOBS,
    lock_timeout: float = 600.0,
    on_total: Callable[[int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    record: Callable[[Record], None] | None = None,
    policy: TrustPolicy | None = None,
    own_tier: bool = True,
) -> WarmResult:
    """Fetch every one of `keys` that `local` lacks from `remote`, `jobs` at a time.

    `on_total(bytes)` once, with what the fetches will copy (read from the remote
    records first), then `on_bytes(n)` as the bytes land, within each file. `record` gets
    a `Fetched` event per entry fetched. `policy` (default: the process's trust policy)
    judges every entry before it is copied (docs/trust.md).

    ``own_tier=False``: `local` is not this node's own tier (a directory being baked into an
    image): its node key (`trust.origin`, ``<local>.node-key``) is never made nor read - a
    secret made there would ship in the image, shared by every pod - so what it holds is
    judged by signature alone and what is copied into it is not sealed.
    """
    policy = trust_policy() if policy is None else policy
    if jobs < 1:
        raise ValueError(f"--jobs must be 1 or more, got {jobs}")
    start = time.perf_counter()
    result = WarmResult()
    guard = threading.Lock()
    wanted = []
    for key in unique_keys(keys):
        if not KEY_RE.fullmatch(key):
            result.missing.append(key)  # never a cache key: no tier can hold it
        elif check_entry(local, key, full=False).ok and refusal(policy, local, key,
                                                                  own_tier=own_tier) is None:
            result.present.append(key)
        else:
            wanted.append(key)

    def size_of(key: str) -> int:
        """What fetching `key` copies (0 when the remote lacks it or it does not read)."""
        try:
            prefix = remote.published(key)
            data = None if prefix is None else remote.read(join(prefix, ENTRY_RECORD),
                                                            max_size=RECORD_MAX_BYTES)
            return 0 if data is None else decode_record(data).total_size
        except Exception:  # noqa: BLE001 - the fetch itself reports what is wrong
            return 0

    def one(key: str) -> None:
        t0 = time.perf_counter()
        counted = [0]  # bytes of this key told to on_bytes so far
        count_guard = threading.Lock()

        def landed(done: int, total: int) -> None:  # from the copying threads
            assert on_bytes is not None
            with count_guard:
                step, counted[0] = done - counted[0], max(done, counted[0])
            if step > 0:
                on_bytes(step)

        try:
            with local.lock(key, timeout=lock_timeout):
                judged = check_entry(local, key, full=False)
                refused = refusal(policy, local, key, own_tier=own_tier) if judged.ok else None
                if judged.ok and refused is None:  # another process fetched or compiled it
                    with guard:
                        result.present.append(key)
                    return
                if local.publication(key).state != "absent":  # defective or untrusted
                    why = f"untrusted: {refused}" if judged.ok else str(judged.problem)
                    quarantine_entry(local, key, why, version=judged.version)
                entry = fetch_entry(remote, key, local, policy=policy, sealed=own_tier,
                                    progress=None if on_bytes is None else landed)
        except UntrustedEntry as exc:
            with guard:
                result.untrusted[key] = exc.verdict.reason
            return
        except (EntryProblem, FileNotFoundError) as exc:  # PublicationProblem included
            with guard:
                result.defective[key] = str(exc)
            return
        except Exception as exc:  # noqa: BLE001 - reported per key; the CLI exits 2
            with guard:
                result.errors[key] = f"{type(exc).__name__}: {exc}"
            return
        if entry is None:
            with guard:
                result.missing.append(key)
            return
        seconds = time.perf_counter() - t0
        with guard:
            result.fetched.append(key)
            result.fetched_bytes += entry.total_size
        if record is not None:
            record(Fetched(key=key, at=time.time(), seconds=seconds, size=entry.total_size,
                           remote=remote.url, compile_seconds=entry.compile_seconds))
        if on_bytes is not None and entry.total_size > counted[0]:
            on_bytes(entry.total_size - counted[0])  # what the copy did not report

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="cache-warm") as pool:
        if on_total is not None:
            on_total(sum(pool.map(size_of, wanted)))
        list(pool.map(one, wanted))
    order = {key: i for i, key in enumerate(keys)}
    for found in (result.present, result.fetched, result.missing):
        found.sort(key=lambda k: order.get(k, 0))
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------ bake
BAKE_RECORD = "baked.json"
"""``<DIR>/baked.json``: what `bake_keys` baked into a directory (`BakeRecord`)."""


class BakeRecord(Record, frozen=True, kw_only=True, tag="bake"):
    """What a baked tier holds and where it came from: read by people and tools (an image's
    provenance), never by the cache, which judges every entry itself at every hit."""

    at: float
    keys: list[str]
    sources: dict[str, str]  # key -> the tier it was fetched from ("present": was there)
    unpacked: list[str]  # keys whose package was unpacked beside the entry
    toolchain: str


@dataclass
class BakeResult:
    """`bake_keys`' outcome: the warm per source, and what the final checks found."""

    warms: list[tuple[str, WarmResult]] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # no source holds it (or could copy it)
    failed: dict[str, str] = field(default_factory=dict)  # not baked: why (defective, untrusted)
    unpacked: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.failed)


def bake_keys(into: Store, sources: Sequence[Store], keys: Sequence[str], *,
              toolchain: Toolchain, jobs: int = DEFAULT_JOBS,
              policy: TrustPolicy | None = None) -> BakeResult:  # fmt: skip
    """Fill `into` (a directory that will be a read-only tier, docs/bake-an-image.md) with
    every one of `keys`: from the first of `sources` that holds it - a remote, or a local
    tier where a start compiled them - exactly as `warm_keys` fetches (each file verified
    as it is copied, judged by `policy` first). Then every entry is verified in full and
    judged as a read-only tier's entry will be at each hit (`refusal`, not this node's own
    tier), what `toolchain` loads from an unpacked copy is unpacked beside it, anew from the
    verified package (`tiers/unpacked.py`: nothing to write at a hit; a copy already there
    is replaced, never trusted), and `BAKE_RECORD` says what was baked."""
    policy = trust_policy() if policy is None else policy
    result = BakeResult()
    wanted = unique_keys(keys)
    left = list(wanted)
    refused: dict[str, str] = {}  # key -> why the first source holding it could not give it
    for source in sources:
        if not left:
            break
        # Never sealed, never judged by a node key: `into` ships to other machines.
        warmed = warm_keys(into, source, left, jobs=jobs, policy=policy, own_tier=False)
        result.warms.append((source.url, warmed))
        for key in warmed.fetched:
            result.sources[key] = source.url
        for key in warmed.present:
            result.sources.setdefault(key, "present")
        for key, why in warmed.defective.items():
            refused.setdefault(key, f"defective in {source.url}: {why}")
        for key, why in warmed.untrusted.items():
            refused.setdefault(key, f"untrusted in {source.url}: {why} (not copied)")
        left = [k for k in left if k not in result.sources]
    # A key a source held but could not give (defective, untrusted) failed; one no source
    # held is missing.
    result.failed.update({k: refused[k] for k in left if k in refused})
    result.missing = [k for k in left if k not in refused]
    for key in wanted:
        if key in left:
            continue
        problem = verify_entry(into, key) or refusal(policy, into, key, own_tier=False)
        if problem is None:
            try:
                if _unpack_for(into, key, toolchain):
                    result.unpacked.append(key)
            except Exception as exc:  # noqa: BLE001 - reported per key; the CLI exits 1
                problem = f"cannot unpack its package: {type(exc).__name__}: {exc}"
        if problem is not None:
            result.failed[key] = problem
    baked = [k for k in wanted if k not in left and k not in result.failed]
    into.write(BAKE_RECORD, encode(BakeRecord(
        at=time.time(), keys=baked, sources={k: result.sources[k] for k in baked},
        unpacked=result.unpacked, toolchain=toolchain.name)))  # fmt: skip
    return result


def _unpack_for(store: Store, key: str, toolchain: Toolchain) -> bool:
    """Unpack entry `key`'s package beside it when `toolchain` loads one; whether it did."""
    prefix = store.published(key)
    if prefix is None:
        return False
    record = read_record(store, prefix)
    try:
        artifact = ARTIFACTS.convert(record.meta, source=f"{store.url}/{key}/{ENTRY_RECORD}")
    except ValueError:
        return False  # not an artifact this toolchain loads: nothing of it to unpack
    package = toolchain.package_of(artifact)
    source = None if package is None else record.files.get(package)
    if package is None or source is None:
        return False
    # A copy already in DIR (planted, or left by an older bake) is never kept on its own
    # record's word - nothing signs it: withdrawn, then made again from the verified package.
    name = copy_name(key, source)
    store.unpublish(name)
    if store.published(name) is not None:
        raise OSError(f"{store.url}/{name}: the copy already there cannot be replaced")
    unpacked_dir(store, key, prefix, package, source)
    return True
