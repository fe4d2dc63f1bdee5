"""`cache prune`: which entries to withdraw by age, compatibility or size, then doing it.

A plan first (`plan_prune`: nothing is touched, so ``--dry-run`` prints exactly what would
go), then `PrunePlan.execute`, which withdraws each entry as the version planned and skips
one in use. The size policy is the local tier's eviction order (`eviction.py`: least
recently used first, pinned and kept entries never).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from vllm_neuron.backends import Store

from ..tiers.inventory import EntryInfo
from ..upkeep.eviction import (
    Candidate,
    Recency,
    eviction_order,
    pinned_keys,
    plan_to_fit,
    sized_entries,
    withdraw_entries,
)


@dataclass(frozen=True)
class PrunePlan:
    """Entries to delete; nothing happens until `execute()`.

    `delete` is what the plan expects to withdraw: every entry an age or compatibility
    policy names (`must`), then the least recently used (`lru`, in order) until the tier
    fits `max_size`. `execute` walks `lru` further when a planned entry turns out to be in
    use (`compile/upkeep/eviction.py`); `kept` names the entries a policy matched that a pin or
    `keep` saved.
    """

    store: Store
    delete: tuple[EntryInfo, ...]
    keep: tuple[EntryInfo, ...]
    reasons: dict[str, str] = field(default_factory=dict)
    must: tuple[EntryInfo, ...] = ()
    lru: tuple[Candidate, ...] = ()
    total: int = 0
    max_size: int | None = None
    kept: dict[str, str] = field(default_factory=dict)
    stayed: dict[str, str] = field(default_factory=dict)  # filled by `execute`

    @property
    def freed_bytes(self) -> int:
        return sum(e.size for e in self.delete)

    def execute(self, on_withdrawn: Callable[[EntryInfo, float, str], None] | None = None
                ) -> int:
        """Withdraw the planned entries; returns how many were withdrawn.

        Each as the version that was planned (an entry published again since stays), on a
        tier with kernel locks under its key's lock taken without waiting (an entry in use
        stays); `stayed` says why each that stayed did. `on_withdrawn(info, last_used,
        reason)` after each withdrawal.
        """
        def note(info: EntryInfo, last_used: float) -> None:
            if on_withdrawn is not None:
                on_withdrawn(info, last_used, self.reasons.get(info.key, "size"))

        done = withdraw_entries(self.store, must=self.must, lru=self.lru, total=self.total,
                                max_size=self.max_size, on_withdrawn=note)  # fmt: skip
        self.stayed.update(done.stayed)
        return len(done.withdrawn)


def plan_prune(
    store: Store,
    *,
    older_than: float | None = None,
    max_size: int | None = None,
    incompatible: Mapping[str, str] | None = None,
    keep: Collection[str] = (),
) -> PrunePlan:
    """Plan deleting entries older than `older_than` seconds and those `incompatible` names
    (key -> why), then the least recently used until the tier is at most `max_size` bytes.

    Recency is the tier's own events (`eviction.Recency`: hits, compiles, fetches), else an
    entry's creation time. Pinned entries (`eviction.pin`) and `keep` are never planned.
    """
    if older_than is None and max_size is None and incompatible is None:
        raise ValueError("prune needs --older-than, --max-size and/or --incompatible")
    entries = sized_entries(store)
    saved = pinned_keys(store) | set(keep)
    must: dict[str, EntryInfo] = {}
    reasons: dict[str, str] = {}
    kept: dict[str, str] = {}

    def choose(e: EntryInfo, reason: str) -> None:
        if e.key in saved:
            kept[e.key] = "pinned" if e.key not in keep else "kept (--keep-manifest)"
        elif e.key not in must:
            must[e.key] = e
            reasons[e.key] = reason

    for e in entries:
        if older_than is not None and e.age_seconds > older_than:
            choose(e, f"older than {older_than:g} s")
        if incompatible is not None and e.key in incompatible:
            choose(e, f"incompatible: {incompatible[e.key]}")
    total = sum(e.size for e in entries)
    lru: list[Candidate] = []
    planned: list[EntryInfo] = list(must.values())
    if max_size is not None:
        lru = eviction_order(entries, Recency(store).last_used(), pinned=saved,
                             protect=set(must))  # fmt: skip
        remaining = total - sum(e.size for e in must.values())
        for c in plan_to_fit(lru, remaining, max_size):
            planned.append(c.info)
            reasons[c.info.key] = f"least recently used; tier above {max_size} bytes"
    deleted = {e.key for e in planned}
    return PrunePlan(
        store,
        tuple(planned),
        tuple(e for e in entries if e.key not in deleted),
        reasons,
        must=tuple(must.values()),
        lru=tuple(lru),
        total=total,
        max_size=max_size,
        kept=kept,
    )
