"""Where a local entry came from, bound to this node: the node key and an entry's seal.

Why: a local record's ``compiled_on`` ("this node compiled it") and ``fetched.verified_by``
("a trusted key verified it when it was fetched") are what lets a local hit skip the
signature check, and what lets a builder sign an entry for the fleet. They are plain fields
of ``entry.json``: anyone who can put a directory into the tier - a stranger's tier copied
in, a backup restored, another node's tier on a shared folder - could write them. So they
count only when the record carries this node's seal (``EntryRecord.sealed``): an HMAC-SHA256,
under a key only this node holds, of the record's canonical bytes (every field but the seal,
sorted keys; :func:`origin_payload`). A record whose seal does not verify - planted, another
node's, written before seals - is of *unknown origin*: judged by its signature, as a remote
entry is (docs/trust.md).

The node key (:func:`node_key`) is 32 random bytes in a file beside the tier, never in it:
``<tier>.node-key`` (``$VLLM_CACHE_ROOT/neuron/compile_cache.node-key`` by default), created
``0600`` exclusively on first use by a process that writes an entry. A key file that is not
a regular file of this user's, or that group or others may read or write, is refused with
one warning: this process seals with a key of its own then (what it compiles serves it),
and every other entry of the tier is of unknown origin. Deleting
the file costs only re-verification (entries are judged by their signature, and under
``require`` unsigned ones of this node are compiled again); it is never needed elsewhere.
A tier that is not a directory (a memory store in tests, a bypassed tier) uses a key that
lives only in this process, as such a tier does.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading

import msgspec

from vllm_neuron.backends import Store
from vllm_neuron.backends.errors import NotRegularFile
from vllm_neuron.backends.regular import open_regular

from ..entry.record import EntryRecord

__all__ = ["NODE_KEY_SUFFIX", "NodeKey", "forget_node_keys", "node_key", "node_key_path",
           "origin_payload", "seal"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

NODE_KEY_SUFFIX = ".node-key"
SEAL_DOMAIN = b"vllm-neuron local entry origin v1\n"
_KEY_BYTES = 32


def origin_payload(record: EntryRecord) -> bytes:
    """The bytes a seal covers: a fixed domain and the whole record but its seal, canonical
    (sorted keys, no whitespace), so a changed field - a file, ``fetched``, ``compiled_on``
    - breaks it."""
    unsealed = msgspec.structs.replace(record, sealed=msgspec.UNSET)
    return SEAL_DOMAIN + msgspec.json.encode(unsealed, order="sorted")


class NodeKey:
    """This node's secret for one tier: seals records, and says whether a record's seal is
    its own (remembered by the record's bytes: a hit pays one HMAC per new entry)."""

    def __init__(self, secret: bytes, path: str | None) -> None:
        self._secret = secret
        self.path = path
        self._known: dict[bytes, bool] = {}

    def seal(self, record: EntryRecord) -> str:
        return hmac.new(self._secret, origin_payload(record), hashlib.sha256).hexdigest()

    def vouches(self, record: EntryRecord, record_bytes: bytes) -> bool:
        """Whether ``record`` (decoded from ``record_bytes``) carries this key's seal."""
        known = self._known.get(record_bytes)
        if known is None:
            sealed = record.sealed
            known = isinstance(sealed, str) and hmac.compare_digest(sealed, self.seal(record))
            self._known[record_bytes] = known
        return known


_PROCESS_KEY = NodeKey(secrets.token_bytes(_KEY_BYTES), None)  # tiers that are not directories
_KEYS: dict[str, NodeKey] = {}  # store URL -> its key (the process's: its file refused)
_LOCK = threading.Lock()


def forget_node_keys() -> None:
    """Read the key files again at next use (tests that delete or replace one)."""
    with _LOCK:
        _KEYS.clear()


def node_key_path(store: Store) -> str | None:
    """Where the key of ``store``'s tier lives (beside the tier, never in it), or None for
    a tier that is not a directory."""
    staging = store.local_dir_of(".staging")
    if staging is None:
        return None
    tier = os.path.normpath(os.path.dirname(staging))
    return tier + NODE_KEY_SUFFIX


def node_key(store: Store, *, create: bool = False) -> NodeKey | None:
    """The key of ``store``'s tier; None when there is none yet (``create``: made now, by a
    process about to write an entry). A key file that is refused or cannot be made or read
    is said once per tier, and this process's own key stands in for it: what the process
    seals it trusts itself (its compiles serve), and every other process judges by
    signature - the cache never fails for it."""
    url = store.url
    known = _KEYS.get(url)
    if known is not None:
        return known
    path = node_key_path(store)
    if path is None:
        return _PROCESS_KEY
    try:
        secret = _read_or_create_key(path) if create else _read_key(path)
    except (_Refused, OSError) as exc:
        why = f"it is refused: {exc}" if isinstance(exc, _Refused) else (
            f"it cannot be {'made' if create else 'read'}: {exc.strerror or exc}")
        with _LOCK:
            _KEYS[url] = _PROCESS_KEY
        logger.warning("compile cache: the node key %s: %s; what this process puts in %s is "
                       "trusted by this process only, every other entry there is of unknown "
                       "origin (judged by its signature); remove or fix the file (that costs "
                       "only re-verification)", path, why, url)  # fmt: skip
        return _PROCESS_KEY
    if secret is None:
        return None  # not made yet (not memoised: a writer makes it): nothing carries its seal
    key = NodeKey(secret, path)
    with _LOCK:
        key = _KEYS.setdefault(url, key)
    return key


class _Refused(Exception):
    """A key file this process must not use: the message says why."""


def _read_key(path: str) -> bytes | None:
    """The secret in ``path``, None when there is no such file; `_Refused` when it is not
    this user's private regular file or does not hold a key."""
    try:  # as a tier's files are: never through a link, never blocking on a FIFO, a
        # device's driver never called (`open_regular`)
        fd, _size = open_regular(path)
    except FileNotFoundError:
        return None
    except NotRegularFile as exc:
        raise _Refused(f"it {exc.problem}") from None
    except IsADirectoryError:
        raise _Refused("it is a directory") from None
    except OSError as exc:
        if exc.filename is None:
            exc.filename = path
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise _Refused(f"it belongs to uid {info.st_uid}, not to this user "
                           f"(uid {os.getuid()})")  # fmt: skip
        if info.st_mode & 0o077:
            raise _Refused(f"group or others may read or write it (mode "
                           f"{stat.S_IMODE(info.st_mode):04o}; it must be 0600)")  # fmt: skip
        data = os.read(fd, 4 * _KEY_BYTES + 1)
    finally:
        os.close(fd)
    try:
        secret = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != _KEY_BYTES:
        raise _Refused(f"it does not hold a key ({_KEY_BYTES * 2} hex digits)")
    return secret


def _read_or_create_key(path: str) -> bytes:
    """The secret in ``path``, made now when there is none: written whole to a private
    temporary file, then linked into place (a concurrent maker's key wins, and nobody
    ever reads half a key)."""
    secret = _read_key(path)
    if secret is not None:
        return secret
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(_KEY_BYTES).hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # made first by another: the node's key
            os.link(temporary, path)
    finally:
        os.unlink(temporary)
    secret = _read_key(path)
    if secret is None:  # removed the moment it was made: nothing sealed can be trusted
        raise FileNotFoundError(f"{path} vanished as it was made")
    return secret


def seal(store: Store, record: EntryRecord) -> EntryRecord:
    """``record`` sealed by the node key of ``store``'s tier (made if need be): what this node
    writes there as its own compile or its own verified fetch (`node_key`: a key file that
    cannot be used is said once, and the process's own key seals)."""
    key = node_key(store, create=True)
    unsealed = msgspec.structs.replace(record, sealed=msgspec.UNSET)
    if key is None:  # pragma: no cover - create=True always gives a key
        return unsealed
    return msgspec.structs.replace(unsealed, sealed=key.seal(unsealed))
