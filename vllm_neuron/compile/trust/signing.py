"""Signed entries: who built a compile-cache entry (docs/trust.md).

Why: checksums prove that bytes arrived intact, not who produced them, and a compiled
artifact is code (a shared object the loader maps into the serving process). Anyone who can
write the remote tier could otherwise replace an artifact, recompute the digests the record
lists, and run code in every node that fetches it. An Ed25519 signature by a builder's
private key, checked against public keys the serving node trusts, lets a node verify but
never forge.

What is signed (:func:`signed_payload`): a fixed domain string, the signer's key id, and the
entry record's identity - key, component hashes, toolchain, target, toolchain metadata and
every file's name, size and digests - encoded canonically (sorted keys, no whitespace). So a
signature cannot be moved to another key or another signer, and does not survive a changed
file or record. ``created`` and ``compile_seconds`` are left out: they say nothing about
what is loaded.

The signature lives beside the record, in ``entry.sig`` (:class:`EntrySignature`), so
records written before signing (and by AWS's plugin) read unchanged, as unsigned.

Key files are PEM: a PKCS#8 private key (``0600``) and a SubjectPublicKeyInfo public key
(``*.pub``), as ``vllm-neuron cache keygen`` writes them and ``openssl genpkey -algorithm
ed25519`` does. A key's id is the first 16 hex digits of the SHA-256 of its raw public bytes.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from vllm_neuron.backends.records import Document, RecordCodec, RecordError, encode

from ..entry.record import EntryRecord
from ..entry.text import printable

__all__ = [
    "SIGNATURE_FILE",
    "EntrySignature",
    "KeyProblem",
    "Signer",
    "TrustedKeys",
    "Verdict",
    "decode_signature",
    "generate_key_pair",
    "judge_note",
    "key_id_of",
    "load_public_keys",
    "load_signer",
    "sign_note",
    "signed_payload",
]

SIGNATURE_FILE = "entry.sig"
SIGNATURE_TAG = "compile-entry-signature"
SIGNATURE_DOMAIN = "vllm-neuron compile-cache entry signature v1"
ALGORITHM = "ed25519"
PUBLIC_KEY_SUFFIXES = (".pub", ".pem")


class KeyProblem(ValueError):
    """A key file that cannot be used; the message names the file and why."""


class EntrySignature(Document, frozen=True, kw_only=True):
    """``entry.sig``: one Ed25519 signature over an entry's :func:`signed_payload`."""

    record_tag = SIGNATURE_TAG
    version_field = "schema"
    missing_version = 1

    schema: int = 1
    algorithm: str = ALGORITHM
    key_id: str
    signature: str  # hex
    signed_at: float = 0.0


SIGNATURES = RecordCodec(EntrySignature)


def decode_signature(data: bytes, *, source: str = SIGNATURE_FILE) -> EntrySignature:
    """``data`` as a signature record; `RecordError` naming ``source`` when it does not read."""
    return SIGNATURES.decode(data, source=source)


def signed_payload(record: EntryRecord, key_id: str) -> bytes:
    """The canonical bytes a signature covers (see the module docstring)."""
    identity = {
        "domain": SIGNATURE_DOMAIN,
        "key_id": key_id,
        "key": record.key,
        "components": record.components,
        "toolchain": record.toolchain,
        "target": record.target,
        "meta": record.meta,
        "files": record.files,
    }
    return msgspec.json.encode(identity, order="sorted")


def _raw_public(public_key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )


def key_id_of(public_key: object) -> str:
    """The id of an Ed25519 public key: 16 hex digits of the SHA-256 of its raw bytes."""
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


class Signer:
    """A builder's private key: signs entry records."""

    def __init__(self, private_key: object, path: str = "") -> None:
        self._key = private_key
        self.path = path
        self.public_key: object = private_key.public_key()  # type: ignore[attr-defined]
        self.key_id = key_id_of(self.public_key)

    def sign(self, record: EntryRecord) -> EntrySignature:
        signature = self._key.sign(signed_payload(record, self.key_id))  # type: ignore[attr-defined]
        return EntrySignature(key_id=self.key_id, signature=signature.hex(),
                              signed_at=time.time())  # fmt: skip

    def sign_bytes(self, record: EntryRecord) -> bytes:
        """``entry.sig``'s bytes for ``record``."""
        return encode(self.sign(record))


Status = Literal["trusted", "unsigned", "untrusted", "bad-signature"]


@dataclass(frozen=True)
class Verdict:
    """Whether an entry was built by a trusted key: ``status``, the signer's key id when
    signed, and a reason a message can quote."""

    status: Status
    key_id: str | None = None
    reason: str = ""

    @property
    def trusted(self) -> bool:
        return self.status == "trusted"


KEY_ID_LIMIT = 100
"""Characters of a key id read from a tier that a verdict's reason quotes."""


class TrustedKeys:
    """The public keys whose signatures this process accepts, by key id."""

    def __init__(self, keys: Mapping[str, object] | None = None) -> None:
        self.keys: dict[str, object] = dict(keys or {})

    def __bool__(self) -> bool:
        return bool(self.keys)

    def judge(self, record: EntryRecord, signature: bytes | None, *, source: str = "") -> Verdict:
        """The verdict on ``record`` given its ``entry.sig`` bytes (None: there is none)."""
        if signature is None:
            return Verdict("unsigned", reason="the entry is not signed")
        try:
            sig = decode_signature(signature, source=source or SIGNATURE_FILE)
        except RecordError as exc:
            return Verdict("bad-signature", reason=f"{SIGNATURE_FILE} is unreadable: "
                                                   f"{exc.problem}")  # fmt: skip
        if sig.algorithm != ALGORITHM:
            return Verdict("bad-signature", sig.key_id,
                           f"signature algorithm {printable(repr(sig.algorithm), 100)} is not "
                           f"{ALGORITHM}")  # fmt: skip
        public = self.keys.get(sig.key_id)
        named = printable(sig.key_id, KEY_ID_LIMIT)  # a tier's text: capped and escaped
        if public is None:
            return Verdict("untrusted", sig.key_id, f"signed by key {named}, which is not "
                                                    "trusted here")  # fmt: skip
        from cryptography.exceptions import InvalidSignature

        try:
            public.verify(bytes.fromhex(sig.signature),  # type: ignore[attr-defined]
                          signed_payload(record, sig.key_id))  # fmt: skip
        except (InvalidSignature, ValueError):
            return Verdict("bad-signature", sig.key_id, f"the signature by key {named} "
                           "does not verify (the entry or its signature was changed)")  # fmt: skip
        return Verdict("trusted", sig.key_id, f"signed by trusted key {named}")


# Notes ----------------------------------------------------------------------------------------


def sign_note(signer: Signer, payload: bytes) -> str:
    """`signer`'s signature (hex) over a note's canonical `payload` (a failure note:
    `entry/failure_notes.note_payload`, which names the signer's key id and a domain string
    other than an entry's, so neither signature can pass for the other)."""
    return str(signer._key.sign(payload).hex())  # type: ignore[attr-defined]


def judge_note(keys: TrustedKeys, key_id: str, signature: str, payload: bytes) -> Verdict:
    """Whether a note's `signature` (hex) by `key_id` over `payload` is a trusted key's."""
    if not key_id or not signature:
        return Verdict("unsigned", reason="the note is not signed")
    public = keys.keys.get(key_id)
    if public is None:
        return Verdict("untrusted", key_id, f"signed by key {key_id[:16]!r}, which is not "
                                            "trusted here")  # fmt: skip
    from cryptography.exceptions import InvalidSignature

    try:
        public.verify(bytes.fromhex(signature), payload)  # type: ignore[attr-defined]
    except (InvalidSignature, ValueError):
        return Verdict("bad-signature", key_id, f"the signature by key {key_id} does not "
                                                "verify (the note was changed)")  # fmt: skip
    return Verdict("trusted", key_id, f"signed by trusted key {key_id}")


# Key files ------------------------------------------------------------------------------------


def _read_key_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise KeyProblem(f"{path}: cannot read it ({exc.strerror or exc})") from None


def load_signer(path: str) -> Signer:
    """The Ed25519 private key in the PEM file ``path``; `KeyProblem` saying why not."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    data = _read_key_file(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyProblem(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyProblem(f"{path}: a {type(key).__name__}, not an Ed25519 private key")
    return Signer(key, path)


def _load_public_key(path: str) -> object:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    data = _read_key_file(path)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise KeyProblem(f"{path}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyProblem(f"{path}: a {type(key).__name__}, not an Ed25519 public key")
    return key


def load_public_keys(paths: Iterable[str]) -> TrustedKeys:
    """The public keys in ``paths``: files, or directories whose ``*.pub``/``*.pem`` files are
    keys. `KeyProblem` for a path that is missing or a file that is not a key; a directory
    with no key in it is one too (a typo must not trust nobody silently)."""
    keys: dict[str, object] = {}
    for path in paths:
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path) if n.endswith(PUBLIC_KEY_SUFFIXES))
            if not names:
                wanted = ", ".join("*" + s for s in PUBLIC_KEY_SUFFIXES)
                raise KeyProblem(f"{path}: a directory with no public key file ({wanted})")
            files = [os.path.join(path, n) for n in names]
        else:
            files = [path]
        for file in files:
            key = _load_public_key(file)
            keys[key_id_of(key)] = key
    return TrustedKeys(keys)


def generate_key_pair(directory: str, name: str = "cache-signing") -> tuple[str, str, str]:
    """A new Ed25519 key pair in ``directory``: (private key path, public key path, key id).

    The private key is created ``0600`` (never readable by another user, even for a moment);
    existing files are never overwritten."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    os.makedirs(directory, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private_path = os.path.join(directory, f"{name}.key")
    public_path = os.path.join(directory, f"{name}.pub")
    private_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())  # fmt: skip
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    for path, data, mode in ((private_path, private_pem, 0o600), (public_path, public_pem, 0o644)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    return private_path, public_path, key_id_of(key.public_key())
