"""Read-only tiers: a cache baked into an image, or a local tier this process cannot write.

Why: fleets ship the compile cache inside the container image (or a volume mounted
read-only) so that a scaled-out pod starts without compiling. Such a tier is consulted
after the writable local tier and before the remote (docs/compile-cache.md): a hit loads in
place, from the entry's own directory, exactly as a local hit does (same lookup: one record
read and one stat per file, same trust judgement), and nothing is ever written into it - no
lock, no event, no failure note, no unpacked copy, no withdrawal. A defective or untrusted
entry there is skipped with one warning (`LocalTier.skip`) and the graph is fetched or
compiled into the writable local tier, which is where everything this process writes goes.

The tiers are named by ``NEURON_LIBTORCH_BAKED_CACHE`` (comma-separated directories or
``file://`` URLs; `vllm-neuron cache bake` makes one), and a local tier that cannot be
written becomes the first of them (`vllm_neuron.assembly`). They must be on local disk: an
entry is loaded from its directory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_neuron.backends import Record, Store, open_store

from ..entry.outcomes import CacheResult
from ..trust.policy import TrustPolicy
from .local import Admit, LocalTier

__all__ = ["BAKED_SOURCE", "ReadOnlyTiers", "open_read_only_tier"]

BAKED_SOURCE = "baked"
"""`CacheResult.source` of a hit served from a read-only tier."""


def open_read_only_tier(location: str) -> Store:
    """The store of a read-only tier at `location`, opened without creating anything;
    ValueError when it is not on local disk (its entries could not load in place)."""
    store = open_store(location, create=False)
    if not store.capabilities.local_paths:
        raise ValueError(f"{location}: a read-only (baked) compile cache must be a directory on "
                         "this machine, whose entries load in place; a shared tier elsewhere "
                         "is NEURON_LIBTORCH_REMOTE_CACHE's job")  # fmt: skip
    return store


class ReadOnlyTiers:
    """The read-only tiers of one cache, in the order they are consulted."""

    def __init__(self, stores: Sequence[Store], *, trust: TrustPolicy, admit: Admit,
                 record: Callable[[Record], None]) -> None:  # fmt: skip
        # Every one judged alike, this user's own root turned read-only included: by
        # signature alone (its node key never read), its files checksummed once per process
        # (tiers/local.py). A read-only root may be an image layer prepared elsewhere,
        # node key and all.
        self.tiers = [
            LocalTier(store, trust=trust, lease_duration=0.0, timeout=0.0, admit=admit,
                      forget=lambda key: None, read_only=True, record=record)
            for store in stores
        ]  # fmt: skip
        # Whether an entry's baked unpacked copy may be loaded: only with trust off. Nothing
        # signs a copy (its unpacked.json is the copy's own claim), so under warn or require
        # the graph loads from its verified package instead (tiers/unpacked.py).
        self.copies_usable = trust.mode == "off"

    @property
    def urls(self) -> list[str]:
        return [tier.url for tier in self.tiers]

    def lookup(self, key: str) -> CacheResult | None:
        """The first read-only tier's sound, trusted entry for `key` (source ``baked``), or
        None; what is defective or untrusted is skipped (said once), never changed."""
        for tier in self.tiers:
            hit = tier.lookup(key, quarantine=False)
            if hit is not None:
                return CacheResult(key, hit.path, hit.record, BAKED_SOURCE, hit.seconds,
                                   hit.prefix)  # fmt: skip
        return None

    def holding(self, result: CacheResult) -> Store | None:
        """The read-only tier whose entry `result` is (its files are in that directory), or
        None: it is the writable local tier's, or a scratch compile's."""
        if not result.prefix or result.path is None:
            return None
        for tier in self.tiers:
            if tier.store.local_dir_of(result.prefix) == result.path:
                return tier.store
        return None
