"""The trust policy: which compile-cache entries this process loads or copies (docs/trust.md).

Why a policy object apart from the keys (:mod:`.signing`): every path that brings an entry
into this process - a local hit, a fetch, ``cache warm``, ``cache promote`` - asks the same
three questions (is it signed by a trusted key? may it be used anyway? may this process
publish to the fleet?) and must answer them the same way, with one warning per signer, not
one per graph.

- ``off``: signatures are not looked at (entries are still signed when a key is set);
- ``warn``: an untrusted entry is used, with one warning per signer and reason;
- ``require``: an untrusted entry is a miss: never loaded, never copied into the local tier.

A process with trusted keys but no signing key never publishes to the remote tier and never
takes a remote lease (what it published, nobody would trust); it compiles a graph nobody
trusted for itself.

A local tier's copy of a fetched entry records, in its ``entry.json`` (``fetched``), the key
id that verified it (or none, when it was fetched unsigned under ``off``/``warn``), so a
local hit of a fetched entry is judged again by key id alone - removing a key from the
trusted set revokes its entries on every node, at no cost to a hit. Entries this node
compiled itself say ``compiled_on``: they are this node's own code. Both count only under
this node's seal (:mod:`.origin`): a record anyone else wrote is of unknown origin, judged
by its signature.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec

from vllm_neuron.backends import Store, join
from vllm_neuron.backends.records import RECORD_MAX_BYTES, RecordError
from vllm_neuron.envs import ConfigError, TrustSettings, trust_settings
from vllm_neuron.envs.trust import (
    VLLM_NEURON_CACHE_SIGNING_KEY,
    VLLM_NEURON_CACHE_TRUST,
    VLLM_NEURON_CACHE_TRUSTED_KEYS,
    TrustMode,
)

from ..entry.check import KEY_RE, check_entry
from ..entry.record import (
    ENTRY_RECORD,
    EntryProblem,
    EntryRecord,
    FetchedFrom,
    decode_record,
)
from .origin import node_key
from .signing import (
    SIGNATURE_FILE,
    KeyProblem,
    Signer,
    TrustedKeys,
    Verdict,
    decode_signature,
    load_public_keys,
    load_signer,
)

__all__ = [
    "TrustPolicy",
    "UntrustedEntry",
    "fetched_from",
    "judge_tier",
    "load_trust_policy",
    "refusal",
    "sign_tier",
    "signer_of",
    "trust_policy",
    "trust_summary",
]

logger = logging.getLogger("vllm_neuron.compile")

def fetched_from(remote: str, verdict: Verdict | None) -> FetchedFrom:
    """What a fetched entry's local record says of its origin (`EntryRecord.fetched`)."""
    verified = verdict.key_id if verdict is not None and verdict.trusted else None
    return FetchedFrom(remote=remote, at=time.time(), verified_by=verified)


class UntrustedEntry(Exception):
    """An entry the policy refuses (``require``): a miss, never loaded nor copied."""

    def __init__(self, key: str, where: str, verdict: Verdict) -> None:
        super().__init__(f"compile cache entry {where}/{key} is untrusted: {verdict.reason}")
        self.key = key
        self.where = where
        self.verdict = verdict


@dataclass
class TrustPolicy:
    """This process's answer to "may I use, copy or publish this entry?"."""

    mode: TrustMode = "off"
    keys: TrustedKeys = field(default_factory=TrustedKeys)
    signer: Signer | None = None
    _warned: set[tuple[str, str | None]] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _verified: dict[tuple[bytes, bytes], Verdict] = field(default_factory=dict, repr=False)

    @property
    def checking(self) -> bool:
        return self.mode != "off"

    @property
    def requires(self) -> bool:
        return self.mode == "require"

    @property
    def may_publish_remote(self) -> bool:
        """Whether this process may promote and take remote leases: always with ``off``;
        with trusted keys only when it can sign (else nobody would trust what it shared)."""
        return self.mode == "off" or self.signer is not None

    def signature_for(self, record: EntryRecord) -> bytes | None:
        """``entry.sig``'s bytes for an entry this process publishes, or None (no key)."""
        return None if self.signer is None else self.signer.sign_bytes(record)

    def judge(self, record_bytes: bytes, signature: bytes | None, *, source: str = ""
              ) -> Verdict:  # fmt: skip
        """The verdict on the entry whose ``entry.json`` is ``record_bytes`` (decoded here,
        so what is judged is exactly what is remembered: the same bytes are verified once
        per process). A record that does not read is a bad signature's equal: untrusted."""
        cache_key = (record_bytes, signature or b"")
        known = self._verified.get(cache_key)
        if known is not None:
            return known
        try:
            record = decode_record(record_bytes, source=source or ENTRY_RECORD)
        except RecordError as exc:
            return Verdict("bad-signature", None, f"{ENTRY_RECORD} does not read: {exc.problem}")
        verdict = self.keys.judge(record, signature, source=source)
        with self._lock:
            self._verified[cache_key] = verdict
        return verdict

    def admits(self, key: str, where: str, verdict: Verdict, *, action: str = "load") -> bool:
        """Whether an entry with ``verdict`` may be used; warns once per signer and reason."""
        if verdict.trusted or not self.checking:
            return True
        refused = self.requires
        with self._lock:
            first = (verdict.status, verdict.key_id) not in self._warned
            self._warned.add((verdict.status, verdict.key_id))
        if first:
            then = (f"not {action}ed; this node compiles it for itself" if refused
                    else f"{action}ed anyway ({VLLM_NEURON_CACHE_TRUST}=warn)")  # fmt: skip
            logger.warning("compile cache: entry %s in %s is untrusted: %s; %s (said once per "
                           "signer)", key, where, verdict.reason, then)  # fmt: skip
        return not refused

    def judge_local(self, record: EntryRecord, record_bytes: bytes, store: Store,
                    prefix: str) -> Verdict | None:  # fmt: skip
        """Why a local entry is not trusted, or None when it is or needs no verdict.

        - the policy is off: None;
        - sealed by this node (`origin.NodeKey.vouches`: its record carries the HMAC of the
          tier's node key, which only this node holds) and compiled here (``compiled_on``):
          this node's own code;
        - sealed and fetched (``fetched``): judged by the key that verified it then, by key
          id alone - still trusted, or not (revoked, or never);
        - anything else - no seal (written before seals, by another tool, or planted), or a
          seal that does not verify (another node's, or forged): of unknown origin, judged
          by its signature (``entry.sig`` under ``prefix`` in ``store``), as a remote one.
        A hit of an entry seen before is a dict lookup and a set lookup, no file read; a new
        entry costs one HMAC of its record per process."""
        if self.mode == "off":
            return None
        if self.origin_of(record, record_bytes, store) is not None:
            fetched = record.fetched
            if fetched.__class__ is not FetchedFrom:
                return None  # this node's own compile
            key_id = fetched.verified_by
            if key_id in self.keys.keys:
                return None
            if key_id is None:
                return Verdict("unsigned", None, f"it was fetched from {fetched.remote} "
                               "without a trusted signature")  # fmt: skip
            return Verdict("untrusted", key_id, f"signed by key {key_id}, which is no "
                           "longer trusted here")  # fmt: skip
        return self.judge_signed(record_bytes, store, prefix)  # of unknown origin: signed?

    def judge_signed(self, record_bytes: bytes, store: Store, prefix: str) -> Verdict | None:
        """Why the entry at ``prefix`` in ``store`` is not signed by a trusted key, or None:
        how an entry of a tier that is not this node's own (a baked image's) is judged -
        whatever seal its record carries, no node key is read for that tier."""
        if self.mode == "off":
            return None
        signature = store.read(join(prefix, SIGNATURE_FILE), max_size=RECORD_MAX_BYTES)
        verdict = self.judge(record_bytes, signature)
        return None if verdict.trusted else verdict

    @staticmethod
    def origin_of(record: EntryRecord, record_bytes: bytes, store: Store) -> str | None:
        """What this node's seal says of a local entry of ``store``: ``"compiled"`` (here),
        ``"fetched"`` (by this node, ``fetched.verified_by`` as it verified it), or None -
        of unknown origin (no seal, or not this node's)."""
        if not isinstance(record.sealed, str):
            return None
        key = node_key(store)
        if key is None or not key.vouches(record, record_bytes):
            return None
        if record.fetched.__class__ is FetchedFrom:
            return "fetched"
        return None if isinstance(record.compiled_on, msgspec.UnsetType) else "compiled"


def refusal(policy: TrustPolicy, store: Store, key: str, *, own_tier: bool) -> str | None:
    """Why ``policy`` forbids loading ``store``'s published entry ``key`` (``require``, and
    not signed by a trusted key), or None. ``own_tier``: ``store`` is this node's local tier,
    whose own compiles need no signature (`TrustPolicy.judge_local`)."""
    prefix = store.published(key)
    if not policy.requires or prefix is None:
        return None
    try:  # bounded, regular files only: a hostile record is a refusal, never a crash
        data = store.read(join(prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES)
        if data is None:
            return None
        if own_tier:
            verdict = policy.judge_local(decode_record(data), data, store, prefix)
        else:
            verdict = policy.judge(data, store.read(join(prefix, SIGNATURE_FILE),
                                                    max_size=RECORD_MAX_BYTES))  # fmt: skip
    except RecordError as exc:
        return f"{ENTRY_RECORD} or {SIGNATURE_FILE} does not read: {exc.problem}"
    return None if verdict is None or verdict.trusted else verdict.reason


def load_trust_policy(settings: TrustSettings) -> TrustPolicy:
    """The policy of ``settings``, its keys read; a key that cannot be used is a ConfigError
    naming the variable."""
    signer = None
    if settings.signing_key is not None:
        try:
            signer = load_signer(settings.signing_key)
        except KeyProblem as exc:
            raise ConfigError(f"{VLLM_NEURON_CACHE_SIGNING_KEY}: {exc}") from None
    try:
        keys = load_public_keys(settings.trusted_keys)
    except KeyProblem as exc:
        raise ConfigError(f"{VLLM_NEURON_CACHE_TRUSTED_KEYS}: {exc}") from None
    if signer is not None and signer.key_id not in keys.keys:
        keys.keys[signer.key_id] = signer.public_key  # a builder trusts what it signs
    return TrustPolicy(mode=settings.mode, keys=keys, signer=signer)


_POLICY: TrustPolicy | None = None
_POLICY_LOCK = threading.Lock()


def trust_policy() -> TrustPolicy:
    """The process's policy, read from its environment once."""
    global _POLICY
    with _POLICY_LOCK:
        if _POLICY is None:
            _POLICY = load_trust_policy(trust_settings())
        return _POLICY


def forget_trust_policy() -> None:
    """Read the policy again at next use (tests, after changing the environment)."""
    global _POLICY
    with _POLICY_LOCK:
        _POLICY = None


# Whole tiers (`vllm-neuron cache ls|verify|sign`) --------------------------------------------


def _read_bounded(store: Store, key: str) -> bytes | None:
    """A record file of an entry as every reader of a tier reads it: at most
    `RECORD_MAX_BYTES`, a regular file (`RecordError` otherwise: a defect of that entry)."""
    return store.read(key, max_size=RECORD_MAX_BYTES)


def signer_of(store: Store, key: str) -> str | None:
    """The key id an entry's ``entry.sig`` names (not verified: `judge_tier` does), or None
    when it has none or it does not read."""
    prefix = store.published(key)
    try:  # bounded, regular files only: a hostile entry.sig is "no signer", never a crash
        data = None if prefix is None else store.read(join(prefix, SIGNATURE_FILE),
                                                      max_size=RECORD_MAX_BYTES)  # fmt: skip
        return None if data is None else decode_signature(data).key_id
    except RecordError:
        return None


def judge_tier(store: Store, keys: TrustedKeys, *, own_tier: bool = False
               ) -> list[tuple[str, Verdict]]:  # fmt: skip
    """Every published entry of ``store`` whose record reads, judged by ``keys``: by its
    signature, or - ``own_tier``, this node's local tier - as a hit judges it
    (`TrustPolicy.judge_local`: its own compiles need no signature)."""
    local = TrustPolicy(mode="require", keys=keys) if own_tier else None
    out = []
    for key in store.published_children(""):
        prefix = store.published(key) if KEY_RE.fullmatch(key) else None
        try:  # bounded, regular files only (`_read_bounded`): a defect of that entry
            data = None if prefix is None else _read_bounded(store, join(prefix, ENTRY_RECORD))
            if prefix is None or data is None:
                continue
            record = decode_record(data)
        except RecordError:
            continue  # `cache verify` reports it as corrupt
        try:
            signature = _read_bounded(store, join(prefix, SIGNATURE_FILE))
        except RecordError as exc:
            out.append((key, Verdict("bad-signature", None, f"{SIGNATURE_FILE} does not "
                                     f"read: {exc.problem}")))  # fmt: skip
            continue
        signed = keys.judge(record, signature, source=f"{store.url}/{key}")
        if local is not None:
            verdict = local.judge_local(record, data, store, prefix)
            if verdict is None and not signed.trusted:  # trusted as this node's, unsigned
                verdict = Verdict("trusted", None, "this node's own (compiled, or fetched "
                                  "verified, here)")  # fmt: skip
            out.append((key, verdict or signed))
            continue
        out.append((key, signed))
    return out


def trust_summary(store: Store, keys: TrustedKeys | None) -> dict[str, int]:
    """How a tier's entries are signed, for a report: entries per verdict (``trusted``,
    ``unsigned``, ``untrusted``, ``bad-signature``) when ``keys`` judge them, else entries
    per signer (``signed by <key id>``, ``unsigned``)."""
    counts: dict[str, int] = {}
    if keys:
        for _, verdict in judge_tier(store, keys):
            counts[verdict.status] = counts.get(verdict.status, 0) + 1
        return counts
    for key in store.published_children(""):
        if KEY_RE.fullmatch(key):
            signer = signer_of(store, key)
            label = "unsigned" if signer is None else f"signed by {signer}"
            counts[label] = counts.get(label, 0) + 1
    return counts


def sign_tier(store: Store, signer: Signer, keys: list[str] | None = None, *,
              trusted: TrustedKeys | None = None,
              own_tier: bool = False) -> list[tuple[str, str]]:  # fmt: skip
    """Sign the published entries of ``store`` (``keys``, default all) whose every checksum
    verifies and whose origin this node vouches for: compiled here, or fetched verified by
    a key of ``trusted`` (or the signer's own), as this node's seal on the record says
    (`TrustPolicy.origin_of`, asked only of ``own_tier``, a tier of this node's own: the
    node key beside a shared folder is anyone's who writes there); or already signed by
    such a key. An entry of unknown origin - no seal of this node's (a remote tier's
    entries, a planted or copied-in one) and no trusted signature - is never signed,
    whatever its record says. Each record is read once (bounded), and what is judged is
    what is signed. (key, outcome): "signed", "already signed" (by this key, and it
    verifies) or the problem that kept it unsigned."""
    own = TrustedKeys({signer.key_id: signer.public_key})
    vouching = TrustedKeys({**(trusted.keys if trusted is not None else {}), **own.keys})
    out = []
    for key in keys if keys is not None else sorted(store.published_children("")):
        if not KEY_RE.fullmatch(key):
            continue
        checked = check_entry(store, key)
        prefix = store.published(key)
        if not checked.ok or prefix is None:
            out.append((key, f"not signed: {checked.problem or 'withdrawn'}"))
            continue
        try:  # bounded, regular files only, each read once: a hostile record is not
            # signed, never a crash
            record_bytes = _read_bounded(store, join(prefix, ENTRY_RECORD)) or b""
            record = decode_record(record_bytes, source=f"{store.url}/{key}")
            existing = _read_bounded(store, join(prefix, SIGNATURE_FILE))
        except (RecordError, EntryProblem) as exc:
            out.append((key, f"not signed: {exc}"))
            continue
        if own.judge(record, existing).trusted:
            out.append((key, "already signed"))
            continue
        origin = TrustPolicy.origin_of(record, record_bytes or b"", store) if own_tier else None
        fetched = record.fetched
        if origin == "fetched" and isinstance(fetched, FetchedFrom):
            if fetched.verified_by not in vouching.keys:
                out.append((key, f"not signed: it was fetched from {fetched.remote} without "
                                 "a trusted signature"))  # fmt: skip
                continue
        elif origin is None and not vouching.judge(record, existing).trusted:
            out.append((key, "not signed: its origin is unknown (no seal of this node's: "
                             "not compiled or fetched here) and no trusted key signed it"))
            continue
        store.write(join(prefix, SIGNATURE_FILE), signer.sign_bytes(record))
        out.append((key, "signed"))
    return out
