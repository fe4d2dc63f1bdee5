"""A miss fetched from the remote tier, and who this process lets in: the flow's two
questions about other builders' entries, apart from the decision (`cache.py`) that asks them.

`RemoteFetch.fetch` copies one key into the local tier (`tiers/remote.py` `fetch_entry`
verifies every checksum and the signature) and sorts what can go wrong by whose fault it is:
an untrusted entry is a miss, a defective one is withdrawn (that version only when the
publication was judged), a vanished one is a miss, this node's full or read-only disk is no
remote outage (the graph compiles here), and anything else is the key's defect or the
remote's outage (`RemoteTier.key_failed`). Every outcome but a copy is None: the flow goes on
to compile.

`Admission.admitted` is the trust policy's word on one entry (docs/trust.md), asked by every
tier that reads one; an entry not trusted is said once per key and process (an `untrusted`
event), and its reason is kept for the pre-compiled-only miss's message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from vllm_neuron.backends import Record, Store

from ..entry.events import Fetched, Untrusted
from ..entry.failure_notes import forget_stopped
from ..entry.outcomes import CacheResult
from ..entry.record import EntryProblem
from ..tiers.health import LOCAL_DISK_FULL_OR_READ_ONLY, unwritable_cause
from ..tiers.local import LocalTier
from ..tiers.quarantine import PublicationProblem
from ..tiers.remote import RemoteTier, fetch_entry
from ..trust.policy import TrustPolicy, UntrustedEntry
from ..trust.signing import Verdict

__all__ = ["Admission", "RemoteFetch"]

logger = logging.getLogger("vllm_neuron.compile")


class Admission:
    """Whether the trust policy lets this process use an entry, said once per key."""

    def __init__(self, trust: TrustPolicy, *, local_dir: str, remote_url: str | None,
                 record: Callable[[Record], None]) -> None:  # fmt: skip
        self.trust = trust
        self.local_dir = local_dir
        self.remote_url = remote_url
        self._record = record
        self.untrusted: dict[str, str] = {}  # key -> why its entry is not trusted

    def admitted(self, key: str, tier: str, verdict: Verdict) -> bool:
        """Whether the policy lets this process use an entry with `verdict` (one warning
        per signer); an `untrusted` event when it is not trusted."""
        where = self.local_dir if tier == "local" else str(self.remote_url)
        admitted = self.trust.admits(key, where, verdict)
        if not verdict.trusted and key not in self.untrusted:
            self._record(Untrusted(key=key, at=time.time(), tier=tier, status=verdict.status,
                                   reason=verdict.reason, refused=not admitted,
                                   signer=verdict.key_id))  # fmt: skip
            self.untrusted[key] = verdict.reason  # one event per entry and process
        return admitted


class RemoteFetch:
    """Copies a key from the remote tier into this node's local tier."""

    def __init__(self, local: Store, local_tier: LocalTier, remote_tier: RemoteTier, *,
                 admission: Admission, record: Callable[[Record], None]) -> None:  # fmt: skip
        self.local = local
        self.local_tier = local_tier
        self.remote_tier = remote_tier
        self.admission = admission
        self._record = record

    def fetch(self, remote: Store, key: str) -> CacheResult | None:
        """Copy `key` from `remote` into the local tier, verifying every checksum; None
        when it is not copied (each cause said where it is met)."""
        start = time.perf_counter()
        try:
            record = fetch_entry(remote, key, self.local, policy=self.admission.trust,
                                 admit=lambda v: self.admission.admitted(key, "remote", v))
        except UntrustedEntry:  # refused (and said) by the policy: a miss, nothing copied
            return None
        except PublicationProblem as exc:  # judged: withdraw that version only
            self.local_tier.withdraw(remote, key, str(exc), tier="remote", version=exc.version)
            return None
        except EntryProblem as exc:
            self.local_tier.withdraw(remote, key, str(exc), tier="remote")
            return None
        except FileNotFoundError as exc:
            logger.warning("compile cache: remote entry %s/%s vanished while fetching: %s",
                           remote.url, key, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the remote is best-effort
            fault = unwritable_cause(exc)
            if fault is not None and fault.errno in LOCAL_DISK_FULL_OR_READ_ONLY:
                # This node's disk refused the copy: no remote outage. The graph compiles,
                # and is served from scratch if the tier still has no room.
                logger.warning("compile cache: fetching %s into %s failed: %s; compiling it "
                               "here instead", key, self.admission.local_dir, fault)  # fmt: skip
                return None
            self.remote_tier.key_failed(key, exc)
            return None
        local = None if record is None else self.local_tier.lookup(key)
        if record is None or local is None:
            return None
        seconds = time.perf_counter() - start
        forget_stopped(self.local, key)
        self._record(Fetched(key=key, at=time.time(), seconds=seconds, size=record.total_size,
                             remote=str(self.admission.remote_url),
                             compile_seconds=record.compile_seconds))
        return self.local_tier.result(key, local.prefix, local.record, "remote", seconds)
