"""What a node says on the remote tier about an entry it fetched but could not load.

Why not withdraw it: the entry passed every checksum, so the bytes are the builder's; that
they do not load on this node may be this node's fault (another build of a library, a
missing kernel library). One node's word must not take a graph away from a fleet it serves
elsewhere. So the node withdraws its own local copy (compile/runtime.py), compiles the graph
for itself, and leaves a note on the remote, one per host
(``.load-failures/<key>/<host>.json``), which ``cache ls`` shows beside the entry: an
operator sees that three hosts could not load it and decides (``cache verify --load`` on a
node, ``cache prune``). A new publication of the key (a promotion after the old one was
pruned) forgets the notes, and ``cache gc`` collects a note older than its bound and at
least a week (`notes.LOAD_FAILURES`, `Expiry.FOR_OPERATORS`: as a quarantine note, it is for
the operators to read). Best-effort: a remote that refuses the note costs nothing but the
note. The error passes the secret redactor (`vllm_neuron.envs.redact_text`) and is capped at
`NOTE_TEXT_LIMIT` characters before it is written: the remote is shared.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time

from vllm_neuron.backends import Store, join
from vllm_neuron.backends.errors import ListingTooLarge
from vllm_neuron.backends.records import encode
from vllm_neuron.envs import redact_text

from .failure_notes import NOTE_TEXT_LIMIT
from .notes import LOAD_FAILURES, LOAD_NOTES_DIR, NOTES_READ_MAX, LoadFailureNote

__all__ = [
    "LOAD_NOTES_DIR",
    "LoadFailureNote",
    "forget_load_failures",
    "note_load_failure",
    "read_load_failures",
]

logger = logging.getLogger("vllm_neuron.compile")


def note_load_failure(remote: Store, key: str, error: str) -> None:
    """Leave this host's note on ``key`` in ``remote``; never raises."""
    host = socket.gethostname()
    note = LoadFailureNote(key=key, at=time.time(), host=host,
                           error=redact_text(error)[:NOTE_TEXT_LIMIT])  # fmt: skip
    try:
        remote.write(LOAD_FAILURES.path(key, host), encode(note))
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        logger.debug("compile cache: could not note on %s that %s does not load here: %s",
                     remote.url, key, exc)  # fmt: skip


def read_load_failures(store: Store) -> dict[str, list[LoadFailureNote]]:
    """Every host's note, by key, oldest first (a note that vanishes or does not read is
    skipped)."""
    return LOAD_FAILURES.read_all(store)


def forget_load_failures(store: Store, key: str) -> None:
    """Drop every host's note on ``key`` (best-effort). The folder is a shared tier's: one
    holding more than `NOTES_READ_MAX` names (planted) is left as it is, one warning."""
    with contextlib.suppress(Exception):
        try:
            names = store.list_dir(join(LOAD_NOTES_DIR, key), max_names=NOTES_READ_MAX)
        except ListingTooLarge as exc:
            logger.warning("compile cache: not forgetting the load-failure notes of %s: %s",
                           key, exc)  # fmt: skip
            return
        for name in names:
            store.delete(join(LOAD_NOTES_DIR, key, name))
