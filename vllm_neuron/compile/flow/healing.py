"""An entry that passed its checksums but will not load here: withdrawn from the local tier
and compiled again (`HealingFlow.heal_unloadable`, the runtime's call when a load fails).

Why a separate step: the checksums say the bytes are the ones published, not that this
node can run them (a library missing here, a package torch's loader refuses). Serving it
again would fail every start after this one; compiling it again under the key's lock
replaces it for every process of the node, and a fetched entry is not withdrawn from the
remote on one node's word - it gets this host's note (`load_notes.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from vllm_neuron.backends import Record, Store

from ..entry.events import LoadFailed
from ..entry.load_failure_notes import note_load_failure
from ..entry.outcomes import CacheResult, PrecompiledOnlyMiss
from ..entry.record import EntryProblem, EntryRecord
from ..tiers.build import CompileFn, Compiler
from ..tiers.health import LocalTierFault, tier_dir, unwritable_cause
from ..tiers.quarantine import quarantine_entry

__all__ = ["HealingFlow"]


class HealingFlow:
    """`heal_unloadable`, over the flow of `TwoTierCache` (its key lock, its compile)."""

    local: Store
    lease_duration: float
    timeout: float
    precompiled_only: bool
    _loaded: dict[str, CacheResult]
    _compiler: Compiler

    def _record(self, event: Record) -> None:
        raise NotImplementedError

    @property
    def remote(self) -> Store | None:
        raise NotImplementedError

    def read_entry(self, key: str) -> EntryRecord:
        raise NotImplementedError

    def lookup_local(self, key: str, *, quarantine: bool = True) -> CacheResult | None:
        raise NotImplementedError

    def _compile_here(self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
                      piece: str | None, wait: bool,
                      deadline: float) -> Callable[..., CacheResult]:  # fmt: skip
        raise NotImplementedError

    def heal_unloadable(
        self, result: CacheResult, error: str, compile_fn: CompileFn, *,
        components: Mapping[str, str], piece: str | None = None,
    ) -> CacheResult:
        """`result`'s entry passed its checksums but would not load here: record a
        `load_failed` event; withdraw it from the local tier (a quarantine note kept) unless
        another process replaced it meanwhile (then that one is served), and compile the
        graph again under the key's lock, not fetched again. A fetched entry is not withdrawn
        from the remote on this node's word alone: it gets this host's note
        (`load_notes`). Where the tier cannot withdraw it or take the lock, the graph is
        compiled and served from scratch; in pre-compiled-only mode `PrecompiledOnlyMiss`
        says why, and nothing is withdrawn."""
        key = result.key
        self._loaded.pop(key, None)
        self._record(LoadFailed(key=key, at=time.time(), source=result.source, error=error))
        if self.precompiled_only:
            raise PrecompiledOnlyMiss(
                f"the compile cache entry {key} does not load here ({error}), and "
                "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 forbids compiling at runtime"
            )
        remote = self.remote if result.source == "remote" else None
        if remote is not None:  # a note for the fleet's operators, not a withdrawal
            note_load_failure(remote, key, error)
        try:
            with self.local.lock(key, lease_duration=self.lease_duration, timeout=self.timeout):
                try:
                    current: EntryRecord | None = self.read_entry(key)
                except EntryProblem:
                    current = None
                if current == result.record:
                    if not quarantine_entry(self.local, key, f"does not load here: {error}",
                                            warn=False):  # fmt: skip
                        raise LocalTierFault(f"could not withdraw the entry {key}")
                    current = None
                replaced = None if current is None else self.lookup_local(key)
                healed = replaced or self._compile_here(
                    key, compile_fn, components, piece, True, time.monotonic() + self.timeout)()
        except (LocalTierFault, OSError) as exc:
            if isinstance(exc, OSError) and unwritable_cause(exc, tier_dir(self.local)) is None:
                raise
            out_dir, record, seconds = self._compiler.serve_from_scratch(
                key, compile_fn, components, piece, str(exc))
            healed = CacheResult(key, out_dir, record, "uncached", seconds, "")
        self._loaded[key] = healed
        return healed
