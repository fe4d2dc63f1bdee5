"""`save_cache`: promote a locally compiled entry to the shared remote tier.

Stage, then publish atomically, first writer wins: on a POSIX remote the staged directory
is renamed into place; on S3 a commit record is created with If-None-Match. Another node
having promoted the same key already is a no-op, so every node of a fleet may call it.
An entry is checked in full (every checksum) before it leaves the node: a corrupt local
entry must not become everybody's corrupt entry.

A remote entry that is there but defective - a broken publication (a commit record that
does not read, or names a version without files), or an entry record that is missing, does
not read or names another key - is not "already promoted": it is quarantined (withdrawn
as the version judged, with a note and a warning) and this promotion publishes in its
place. A valid entry is never replaced, whoever published it.

`save_cache` takes the documented arguments (a local directory, a remote path or URL, a
key; docs/compile-cache.md);
`promote_entry` is the same protocol between any two stores (tests drive it with memory
stores standing in for the nodes of a fleet).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from vllm_neuron.backends import (
    Progress,
    Publication,
    Store,
    copy_tree,
    fault_point,
    join,
    open_store,
    validate_hex,
)
from vllm_neuron.backends.records import RECORD_MAX_BYTES, RecordError
from vllm_neuron.envs.trust import VLLM_NEURON_CACHE_SIGNING_KEY, VLLM_NEURON_CACHE_TRUSTED_KEYS

from ..entry.events import EVENTS_STREAM, Promoted
from ..entry.load_failure_notes import forget_load_failures
from ..entry.record import (
    ENTRY_RECORD,
    EntryProblem,
    EntryRecord,
    FetchedFrom,
    check_checksums,
    decode_record,
    encode_record,
    read_record,
)
from ..entry.text import printable
from ..trust.policy import TrustPolicy, trust_policy
from ..trust.signing import SIGNATURE_FILE
from .quarantine import quarantine_entry

logger = logging.getLogger("vllm_neuron.compile")


class LocalEntryProblem(RuntimeError):
    """The local entry to promote is missing, incomplete or corrupt: nothing to share."""


def _checked_entry(local: Store, hash_key: str) -> tuple[str, EntryRecord]:
    """The published prefix and record of `hash_key`, every checksum verified."""
    prefix = local.published(hash_key)
    if prefix is None:
        raise LocalEntryProblem(f"local cache entry {local.url}/{hash_key} does not exist")
    try:
        record = read_record(local, prefix)
        if record.key != hash_key:
            raise EntryProblem(f"{local.url}/{hash_key}: record names key "
                                       f"{printable(record.key, 100)}")
        check_checksums(local, prefix, record)
    except EntryProblem as exc:
        raise LocalEntryProblem(f"local cache entry is incomplete or corrupt: {exc}") from exc
    return prefix, record


class CannotSign(RuntimeError):
    """This process may not publish the entry to the remote tier: it cannot sign it, or the
    entry is another builder's that it does not trust (docs/trust.md)."""


def _signature_to_publish(local: Store, prefix: str, record: EntryRecord, key: str,
                          policy: TrustPolicy) -> bytes | None:  # fmt: skip
    """The ``entry.sig`` the remote copy gets: this process's own, made now, when it signs;
    else the local entry's as it is (None: unsigned, the trust policy being off).

    A process signs only what it compiled itself or verified against a key it trusts,
    whatever its policy (``warn`` too): this node's seal must vouch for the local record's
    origin (`TrustPolicy.origin_of`) and, for a fetched entry, the key that verified it must
    be trusted still; an entry of unknown origin (no seal, or not this node's - whatever its
    ``compiled_on`` or ``fetched`` say) is signed only when a trusted key signed it already.
    Else `CannotSign`; `LocalEntryProblem` when the ``entry.sig`` or ``entry.json`` does not
    read within `RECORD_MAX_BYTES` (the local tier is this node's, but what is in it may have
    been put there by another local process before a check of the root sets it aside)."""
    try:
        existing = local.read(join(prefix, SIGNATURE_FILE), max_size=RECORD_MAX_BYTES)
        if policy.signer is None:
            return existing
        record_bytes = local.read(join(prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES) or b""
    except RecordError as exc:
        raise LocalEntryProblem(f"local cache entry is incomplete or corrupt: {exc}") from exc
    origin = policy.origin_of(record, record_bytes, local)
    fetched = record.fetched
    if origin == "fetched" and isinstance(fetched, FetchedFrom):
        if fetched.verified_by not in policy.keys.keys:
            raise CannotSign(f"not promoting {key}: it was fetched from {fetched.remote} "
                             "without a signature this process trusts; it signs only what it "
                             "built or trusts")  # fmt: skip
    elif origin is None:
        # Neither compiled nor fetched by this node, as far as its seal says: trusted only
        # by its signature.
        verdict = policy.judge(record_bytes, existing)
        if not verdict.trusted:
            raise CannotSign(f"not promoting {key}: the local entry's origin is unknown (no "
                             "seal of this node's) and it is not signed by a trusted key "
                             f"({verdict.reason}); it signs only what it built or trusts")
    return policy.signer.sign_bytes(record)


def _remote_problem(remote: Store, hash_key: str, there: Publication,
                    policy: TrustPolicy) -> str | None:  # fmt: skip
    """Why the remote's publication of `hash_key` is defective; None when it is absent or
    its record reads and names the key (its files are checked by every fetch). For a
    process that signs under a trust policy, an entry not signed by a trusted key is
    defective too: nobody who requires trust would load it, so a builder replaces it."""
    if there.state == "absent":
        return None
    if there.problem is not None or there.prefix is None:
        return str(there.problem)
    try:  # read once, bounded: judged as read
        record_bytes = remote.read(join(there.prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES)
        signature = None if not (policy.checking and policy.signer is not None) else \
            remote.read(join(there.prefix, SIGNATURE_FILE), max_size=RECORD_MAX_BYTES)
    except RecordError as exc:  # too large, or not a regular file: a defect of this entry
        return f"{remote.url}/{hash_key}: {exc}"
    if record_bytes is None:
        return f"{remote.url}/{hash_key}: {ENTRY_RECORD} is missing"
    try:
        found = decode_record(record_bytes, source=f"{remote.url}/{hash_key}/{ENTRY_RECORD}")
    except RecordError as exc:
        return f"{exc.source} is unreadable: {exc.problem}"
    if found.key != hash_key:
        return f"{remote.url}/{hash_key}: record names key {printable(found.key, 100)}"
    if policy.checking and policy.signer is not None:
        verdict = policy.judge(record_bytes, signature)
        if not verdict.trusted:
            return f"{remote.url}/{hash_key}: untrusted: {verdict.reason}"
    return None


def promote_entry(
    local: Store,
    remote: Store,
    hash_key: str,
    *,
    progress: Progress | None = None,
    policy: TrustPolicy | None = None,
) -> bool:
    """Publish `hash_key` from the `local` store's cache in the `remote` store.

    True if this call published it, False if the remote already had it (or another
    promoter won the race); a defective remote entry is replaced. `RuntimeError` if the
    local entry is missing or corrupt.

    Trust (`policy`, default the process's; docs/trust.md): a process with trusted keys but
    no signing key publishes nothing (`CannotSign`); one with a key publishes the entry
    signed (its own signature is added when the local entry has none, or one by another
    key); an entry this node fetched from a signer it does not trust is never re-signed
    (`CannotSign`).
    """
    validate_hex(hash_key, length=32, what="hash_key")
    policy = trust_policy() if policy is None else policy
    if not policy.may_publish_remote:
        raise CannotSign(f"not promoting {hash_key}: with {VLLM_NEURON_CACHE_TRUSTED_KEYS} set, "
                         f"only a process with {VLLM_NEURON_CACHE_SIGNING_KEY} publishes to "
                         "the remote tier (what it shared unsigned, nobody would trust)")
    prefix, record = _checked_entry(local, hash_key)
    signature = _signature_to_publish(local, prefix, record, hash_key, policy)
    there = remote.publication(hash_key)
    problem = _remote_problem(remote, hash_key, there, policy)
    if there.state == "published" and problem is None:
        logger.info("compile cache: %s already in %s; nothing to promote", hash_key, remote.url)
        published = False
    else:
        if problem is not None:  # defective: withdrawn as judged, then replaced
            quarantine_entry(remote, hash_key, problem, version=there.version)
        with remote.stage(hash_key) as staging:
            if signature is not None:
                staging.write(SIGNATURE_FILE, signature)
            # The local record's notes of where the entry came from (fetched, compiled_on, sealed)
            # are this node's own: the remote gets the record without them.
            copy_tree(local, prefix, staging, keys=[*record.files, ENTRY_RECORD],
                      progress=progress)
            shared = msgspec.structs.replace(record, fetched=msgspec.UNSET,
                                             compiled_on=msgspec.UNSET,
                                             sealed=msgspec.UNSET)  # fmt: skip
            if shared != record:
                staging.write(ENTRY_RECORD, encode_record(shared))
            fault_point("promote.uploaded")
            published = staging.commit()
        fault_point("promote.committed")
        if published:  # a new publication: hosts' notes on a former one no longer apply
            forget_load_failures(remote, hash_key)
    event = Promoted(key=hash_key, at=time.time(), remote=remote.url,
                     published=published, size=record.total_size)
    try:
        local.log(EVENTS_STREAM, writer=f"{socket.gethostname()}-{os.getpid()}").append(event)
    except Exception as exc:  # noqa: BLE001 - statistics never fail a promotion
        logger.warning("compile cache: cannot record the promotion event: %s", exc)
    return published


def save_cache(
    local_cache_dir: str,
    remote_cache_dir: str,
    hash_key: str,
    *,
    progress: Progress | None = None,
    remote_options: Mapping[str, Any] | None = None,
) -> bool:
    """Promote `hash_key` from the local cache to `remote_cache_dir` (a path or store URL).

    Returns True if this call published the entry, False if the remote already had it.
    Raises `RuntimeError` if the local entry is missing, incomplete or corrupt.
    """
    validate_hex(hash_key, length=32, what="hash_key")
    local = open_store(os.fspath(local_cache_dir), create=False)
    if local.published(hash_key) is None:  # checked before the remote is opened (or made)
        raise RuntimeError(f"local cache entry {local.url}/{hash_key} does not exist")
    remote = open_store(os.fspath(remote_cache_dir), **dict(remote_options or {}))
    return promote_entry(local, remote, hash_key, progress=progress)
