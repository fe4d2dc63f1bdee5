"""An entry that verified but will not load here, withdrawn and compiled again under the
key's lock (`TwoTierCache.heal_unloadable`, the runtime's call when loading fails).

Apart from the decision (`cache.py`) because it starts where the decision ended - with a
result already served - and must not go back through it: the flow would fetch or serve the
same entry again, and every start after this one would fail the same way. So the entry is
withdrawn from the local tier (a quarantine note kept) unless another process replaced it
meanwhile (then that one is served), and the graph compiled, never fetched. A fetched entry
is not withdrawn from the remote on this node's word alone: it gets this host's note
(`entry/load_failure_notes.py`). Where the tier cannot withdraw it or take the lock, the
graph is compiled and served from scratch; in pre-compiled-only mode `PrecompiledOnlyMiss`
says why, and nothing is withdrawn.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm_neuron.backends import Record, Store
from vllm_neuron.envs import redact_text

from ..entry.events import LoadFailed
from ..entry.load_failure_notes import note_load_failure
from ..entry.outcomes import CacheResult, PrecompiledOnlyMiss, Wait
from ..entry.record import EntryProblem, EntryRecord
from ..tiers.health import LocalTierFault, tier_dir, unwritable_cause
from ..tiers.local import LocalTier
from ..tiers.quarantine import quarantine_entry

__all__ = ["heal_unloadable"]


def heal_unloadable(
    result: CacheResult, error: str, *, local: Store, local_tier: LocalTier,
    lease_duration: float, timeout: float, precompiled_only: bool,
    remote: Callable[[], Store | None], record: Callable[[Record], None],
    compile_again: Callable[[], CacheResult | Wait], from_scratch: Callable[[str], CacheResult],
) -> CacheResult:
    """What serves `result`'s key now that its entry will not load (`error`): a
    `load_failed` event, the remote's note (`remote()` is asked only for a fetched entry),
    then, under the key's lock, the entry that replaced it or `compile_again()`; `from_scratch(why)`
    where the tier cannot be used."""
    key = result.key
    record(LoadFailed(key=key, at=time.time(), source=result.source,
                      error=redact_text(error)))  # a file of the tier: no secret
    if precompiled_only:
        raise PrecompiledOnlyMiss(
            f"the compile cache entry {key} does not load here ({error}), and "
            "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 forbids compiling at runtime"
        )
    fetched_from = remote() if result.source == "remote" else None
    if fetched_from is not None:  # a note for the fleet's operators, not a withdrawal
        note_load_failure(fetched_from, key, error)
    try:
        with local.lock(key, lease_duration=lease_duration, timeout=timeout):
            try:
                current: EntryRecord | None = local_tier.read_entry(key)
            except EntryProblem:
                current = None
            if current == result.record:
                if not quarantine_entry(local, key, f"does not load here: {error}",
                                        warn=False):  # fmt: skip
                    raise LocalTierFault(f"could not withdraw the entry {key}")
                current = None
            replaced = None if current is None else local_tier.lookup(key)
            healed = replaced or _compiled(compile_again())
    except (LocalTierFault, OSError) as exc:
        if isinstance(exc, OSError) and unwritable_cause(exc, tier_dir(local)) is None:
            raise
        healed = from_scratch(str(exc))
    return healed


def _compiled(outcome: CacheResult | Wait) -> CacheResult:
    if isinstance(outcome, Wait):  # pragma: no cover - a waiting compile never defers
        raise AssertionError(f"a waiting compile deferred ({outcome.reason})")
    return outcome
