"""A key this process won, compiled: the last step of the flow (`cache.py`), apart from the
decision that led to it.

Winning (the key's local lock held, and the fleet's lease, or alone) settles *who* compiles;
what is left is *how*, and none of it chooses between tiers: a compile slot of the node (or,
for `begin`, the graph prepared for a worker, handed back as `Wait("worker", prepared)`), the
compile into a staging directory with its commit record written last and published
atomically (`tiers/build.py`), then the promotion to the remote while the lease holds - or
the failure noted there for every node's waiters - and the lease let go whatever happens.

A promotion is best-effort (the local entry serves this node whatever happens), and a failure
met while the remote still takes writes is that key's defect, not the remote's outage
(`tiers/remote.py` `RemoteTier.key_failed`). Where the tier cannot be used at all, the graph
is compiled and served from scratch (`from_scratch`).
"""

from __future__ import annotations

from vllm_neuron.backends import Store

from ..entry.failure_notes import clear_failure_note
from ..entry.outcomes import (
    CacheResult,
    CompileError,
    CompileSlotTimeout,
    CompileWorkerLost,
    Wait,
    Won,
)
from ..tiers.build import EntryBuilder
from ..tiers.local import LocalTier
from ..tiers.promote import promote_entry
from ..tiers.remote import RemoteTier
from ..trust.policy import TrustPolicy
from ..upkeep.background import TierUpkeep
from ..workers.slots import CompileSlots
from .ask import Ask
from .fleet import RemoteSingleFlight

__all__ = ["KeyCompiler"]


class KeyCompiler:
    """Compiles, publishes and promotes the keys one cache won."""

    def __init__(self, local: Store, local_tier: LocalTier, builder: EntryBuilder, *,
                 slots: CompileSlots | None, upkeep: TierUpkeep, fleet: RemoteSingleFlight,
                 remote_tier: RemoteTier, trust: TrustPolicy) -> None:  # fmt: skip
        self.local = local
        self.local_dir = local.url  # for messages
        self.local_tier = local_tier
        self._builder = builder
        self._slots = slots
        self._upkeep = upkeep
        self._fleet = fleet
        self._remote = remote_tier
        self.trust = trust

    def won(self, ask: Ask, won: Won, deadline: float) -> CacheResult | Wait:
        """Compile a key this process won: promote it while the fleet's lease holds, or note
        its failure there for every node's waiters; the lease is let go whatever happens."""
        try:
            try:
                outcome = self.compile(ask, deadline=deadline, owes=won.owes)
            except (CompileWorkerLost, CompileSlotTimeout):
                raise  # no worker, or no slot: not the graph's failure; the lease comes free
            except Exception as exc:
                self._fleet.note_failure(won, ask.key, exc)
                raise
            if isinstance(outcome, CacheResult) and won.remote is not None \
                    and self._fleet.still_holds(won, ask.key):  # fmt: skip
                self._promote(won.remote, ask.key)
            return outcome
        finally:
            self._fleet.let_go(won)

    def compile(self, ask: Ask, *, deadline: float, owes: bool = False) -> CacheResult | Wait:
        """Compile a key this process has won, in one of the node's compile slots: without
        `wait`, `Wait("no-slot")` when none is free, or - with a `worker` - the graph
        prepared for a background compile (`Wait("worker", prepared)`: `begin` hands it to
        a worker); with `owes`, the promotion to the remote is owed first (settled by it, or
        by a later start)."""
        if ask.worker is not None and not ask.wait:
            # Prepared here, under the key's lock (and lease): a rank that traces the graph
            # meanwhile defers to this one instead of preparing it too.
            prepared = ask.worker()
            if prepared is not None:
                return Wait("worker", prepared)
            # no worker for this graph: compiled here, now, if a slot is free
        if self._slots is None or ask.have_slot:  # no bound, or the caller holds a slot
            return self._publish(ask, owes)
        with self._slots.held(wait=ask.wait, deadline=deadline, what=ask.what) as held:
            if not held:
                return Wait("no-slot")
            return self._publish(ask, owes)

    def _publish(self, ask: Ask, owes: bool) -> CacheResult:
        if owes:
            self._upkeep.owe(ask.key)
        scratch, record, seconds = self._builder.publish_where_room(
            ask.key, ask.compile_fn, ask.components, ask.piece)
        if scratch is not None:  # the tier had no room: served from the scratch area
            return CacheResult(ask.key, scratch, record, "uncached", seconds, "")
        published = self.local_tier.lookup(ask.key)
        if published is None:
            raise CompileError(
                f"compiled {ask.key} but its entry in {self.local_dir} is not readable")
        return self.local_tier.result(ask.key, published.prefix, published.record, "compiled",
                                      seconds)  # fmt: skip

    def _promote(self, remote: Store, key: str) -> None:
        """Promote what this process compiled for the fleet, and clear the key's failure
        note there; best-effort (the local entry serves this node anyway)."""
        try:
            if self.local.published(key) is not None:
                promote_entry(self.local, remote, key, policy=self.trust)
            # else: served from scratch (the tier had no room): nothing to promote; the
            # lease comes free and another node compiles it.
            self._upkeep.settled(key)
            clear_failure_note(remote, key)
        except Exception as exc:  # noqa: BLE001 - the remote is best-effort
            # Leased, so the remote takes writes: a refusal here (that key's folder made
            # unreadable), a record that does not read, a publication stuck are that key's
            # defects while the remote still answers a probe; only then its outage.
            self._remote.key_failed(key, exc)

    def from_scratch(self, ask: Ask, reason: str) -> CacheResult:
        """The tier cannot be used for this key at all (`reason`): compiled in scratch and
        served from there, said once."""
        out_dir, record, seconds = self._builder.serve_from_scratch(
            ask.key, ask.compile_fn, ask.components, ask.piece, reason)
        return CacheResult(ask.key, out_dir, record, "uncached", seconds, "")
