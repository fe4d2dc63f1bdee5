"""Compile-cache events, and the statistics folded from them.

Each process appends what it did to its own segment of the ``.events`` stream in the local
cache; `cache stats` folds every segment. Recording is best-effort: a failing event write
never fails a compile.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field

from vllm_neuron.backends import Record, open_store

EVENTS_STREAM = ".events"
"""The local tier's event stream (one segment per process) that stats fold."""


class CacheHit(Record, frozen=True, tag="hit"):
    key: str
    at: float
    tier: str = "local"  # "local", or "memory" when already loaded in this process
    seconds: float = 0.0
    compile_seconds: float = 0.0  # what the entry cost to compile: the time this hit saved


class CacheMiss(Record, frozen=True, tag="miss"):
    key: str
    at: float


class LockWaited(Record, frozen=True, tag="lock_wait"):
    key: str
    at: float
    seconds: float


class Compiled(Record, frozen=True, tag="compile", omit_defaults=True):
    """A graph compiled here. ``piece`` is the piece of the model it is, as the command line
    names it (``[backbone] range 1-2048 subgraph 0``), when vLLM's compiler adaptor said:
    the stats count the graphs a piece took beyond one (per-rank variants, what tensor
    parallelism cost). Fields at their default are not written (a compile naming no piece
    writes the line it always wrote, minus ``v`` while it is 1), and a line written before
    pieces reads with ``piece`` empty."""

    key: str
    at: float
    seconds: float
    toolchain: str
    size: int
    piece: str = ""


class CompileFailed(Record, frozen=True, tag="compile_failed", omit_defaults=True):
    key: str
    at: float
    error: str
    piece: str = ""  # as on `Compiled`: which piece failed, when the compile named one


class Fetched(Record, frozen=True, tag="fetch"):
    key: str
    at: float
    seconds: float
    size: int
    remote: str
    compile_seconds: float = 0.0


class Promoted(Record, frozen=True, tag="promote"):
    key: str
    at: float
    remote: str
    published: bool
    size: int = 0


class VerificationFailed(Record, frozen=True, tag="verify_failed"):
    key: str
    at: float
    tier: str
    reason: str


class LoadFailed(Record, frozen=True, tag="load_failed"):
    """An entry that passed its checksums but that the toolchain could not load in this
    process: withdrawn from the local tier (a quarantine note kept) and compiled again.
    ``source`` is where the entry came from this time ("local", "remote": fetched)."""

    key: str
    at: float
    source: str
    error: str


class Untrusted(Record, frozen=True, tag="untrusted"):
    """An entry not signed by a trusted key (docs/trust.md). Under
    ``VLLM_NEURON_CACHE_TRUST=require`` it was a miss (``refused``): not loaded, not copied;
    under ``warn`` it was used. ``tier``: where it was ("local", "remote"); ``status``:
    unsigned, untrusted (a key not trusted here) or bad-signature; ``signer``: its key id."""

    key: str
    at: float
    tier: str
    status: str
    reason: str
    refused: bool
    signer: str | None = None


class LeaseWaited(Record, frozen=True, tag="lease_wait"):
    """This node waited on the fleet: another node held the key's remote lease."""

    key: str
    at: float
    seconds: float
    # "fetched", "acquired" (the lease came free: this process compiled), "failed-elsewhere",
    # "remote-down", "read-only", "timeout", "alone" (a node that may not lease found the
    # lease free, and compiled for itself)
    outcome: str


class LeaseTakenOver(Record, frozen=True, tag="lease_takeover"):
    """This process took a key's remote lease from a holder whose lease had expired."""

    key: str
    at: float
    previous_owner: str
    remote: str


class Evicted(Record, frozen=True, tag="evict"):
    """A local entry withdrawn to keep the tier within its bound (`compile/upkeep/eviction.py`)."""

    key: str
    at: float
    size: int
    last_used: float  # the recency it was chosen by (epoch seconds)
    reason: str = "size"  # "size" (VLLM_NEURON_CACHE_MAX_SIZE, prune --max-size)


class Deferred(Record, frozen=True, tag="deferred", omit_defaults=True):
    """A graph this process did not wait for when it was traced: another process held its
    compile (``reason`` "local-lock": a rank of this node; "remote-lease": another node), or
    every compile slot of the node was taken, or this process held its share of them
    ("no-slot"). It is waited for, loaded or taken over at its first call; tracing went on
    to the next graph meanwhile."""

    key: str
    at: float
    reason: str
    piece: str = ""


class RemoteUnavailable(Record, frozen=True, tag="remote_unavailable"):
    at: float
    remote: str
    reason: str


CACHE_EVENTS: tuple[type[Record], ...] = (
    CacheHit,
    CacheMiss,
    LockWaited,
    Compiled,
    CompileFailed,
    Fetched,
    Promoted,
    VerificationFailed,
    LoadFailed,
    Untrusted,
    RemoteUnavailable,
    LeaseWaited,
    LeaseTakenOver,
    Evicted,
    Deferred,
)


@dataclass
class CacheStats:
    """What the cache did, folded from its events.

    ``hits`` counts every graph served without compiling here, by tier in
    ``hits_by_tier``: "memory" (already loaded in the process), "local", and "remote" (a
    fetch). A miss is a graph that no tier held when this process looked (it compiled it,
    or failed).

    Per piece of the model (compiles that named one, ``Compiled.piece``), the distinct keys
    compiled for it, sorted, in ``keys_by_piece``: under tensor parallelism a piece may be a
    different graph on each rank, and each graph beyond the first is a compile TP cost.
    ``pieces_compiled`` counts the pieces, ``rank_specific_compiles`` the keys beyond one per
    piece (the manifest's ``compiles - 1``, summed, but for everything this cache compiled).
    A key compiled again (after an eviction) is counted once; compiles naming no piece
    (plain ``torch.compile``) count in neither.
    """

    hits: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    compiles: int = 0
    compile_failures: int = 0
    fetches: int = 0
    promotions: int = 0
    verification_failures: int = 0
    load_failures: int = 0
    untrusted: int = 0
    remote_outages: int = 0
    compile_seconds: float = 0.0
    lock_wait_seconds: float = 0.0
    lease_waits: int = 0
    lease_wait_seconds: float = 0.0
    lease_takeovers: int = 0
    deferred: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    fetch_seconds: float = 0.0
    time_saved_seconds: float = 0.0
    pieces_compiled: int = 0
    rank_specific_compiles: int = 0
    keys_by_piece: dict[str, list[str]] = field(default_factory=dict)
    skipped_lines: int = 0

    def apply(self, event: Record) -> CacheStats:
        if isinstance(event, CacheHit):
            self._hit(event.tier)
            self.time_saved_seconds += event.compile_seconds
        elif isinstance(event, CacheMiss):
            self.misses += 1
        elif isinstance(event, Compiled):
            self.compiles += 1
            self.compile_seconds += event.seconds
            if event.piece:
                self._piece_compiled(event.piece, event.key)
        elif isinstance(event, CompileFailed):
            self.compile_failures += 1
        elif isinstance(event, Fetched):
            self._hit("remote")
            self.fetches += 1
            self.fetch_seconds += event.seconds
            self.time_saved_seconds += max(0.0, event.compile_seconds - event.seconds)
        elif isinstance(event, LockWaited):
            self.lock_wait_seconds += event.seconds
        elif isinstance(event, Promoted):
            self.promotions += int(event.published)
        elif isinstance(event, VerificationFailed):
            self.verification_failures += 1
        elif isinstance(event, LoadFailed):
            self.load_failures += 1
        elif isinstance(event, Untrusted):
            self.untrusted += 1
        elif isinstance(event, RemoteUnavailable):
            self.remote_outages += 1
        elif isinstance(event, LeaseWaited):
            self.lease_waits += 1
            self.lease_wait_seconds += event.seconds
        elif isinstance(event, LeaseTakenOver):
            self.lease_takeovers += 1
        elif isinstance(event, Deferred):
            self.deferred += 1
        elif isinstance(event, Evicted):
            self.evictions += 1
            self.evicted_bytes += event.size
        return self

    def _piece_compiled(self, piece: str, key: str) -> None:
        keys = self.keys_by_piece.get(piece)
        if keys is None:
            self.keys_by_piece[piece] = [key]
            self.pieces_compiled += 1
        elif key not in keys:  # a handful of keys per piece (one per rank at most)
            insort(keys, key)
            self.rank_specific_compiles += 1

    def _hit(self, tier: str) -> None:
        self.hits += 1
        self.hits_by_tier[tier] = self.hits_by_tier.get(tier, 0) + 1


def read_stats(cache_dir: str) -> CacheStats:
    """Fold every process's event segment of the local cache at `cache_dir`."""
    log = open_store(cache_dir, create=False).log(EVENTS_STREAM)
    stats, skipped = log.fold(CACHE_EVENTS, lambda s, e: s.apply(e), CacheStats())
    stats.skipped_lines = skipped
    return stats
