"""What a node says on the remote tier about an entry it fetched but could not load.

Why not withdraw it: the entry passed every checksum, so the bytes are the builder's; that
they do not load on this node may be this node's fault (another build of a library, a
missing kernel library). One node's word must not take a graph away from a fleet it serves
elsewhere. So the node withdraws its own local copy (compile/runtime.py), compiles the graph
for itself, and leaves a note on the remote, one per host
(``.load-failures/<key>/<host>.json``), which ``cache ls`` shows beside the entry: an
operator sees that three hosts could not load it and decides (``cache verify --load`` on a
node, ``cache prune``). A new publication of the key (a promotion after the old one was
pruned) forgets the notes. Best-effort: a remote that refuses the note costs nothing but
the note.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time

from vllm_neuron.backends import Store, join
from vllm_neuron.backends.records import Record, RecordCodec, encode

__all__ = [
    "LOAD_NOTES_DIR",
    "LoadFailureNote",
    "forget_load_failures",
    "note_load_failure",
    "read_load_failures",
]

logger = logging.getLogger("vllm_neuron.compile")

LOAD_NOTES_DIR = ".load-failures"


class LoadFailureNote(Record, frozen=True, tag="load-failure-note"):
    """Host ``host`` could not load entry ``key`` at ``at`` (epoch seconds): ``error``."""

    key: str
    at: float
    host: str
    error: str


LOAD_NOTES = RecordCodec(LoadFailureNote)


def note_load_failure(remote: Store, key: str, error: str) -> None:
    """Leave this host's note on ``key`` in ``remote``; never raises."""
    host = socket.gethostname()
    note = LoadFailureNote(key=key, at=time.time(), host=host, error=error[:2000])
    try:
        remote.write(join(LOAD_NOTES_DIR, key, f"{host}.json"), encode(note))
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        logger.debug("compile cache: could not note on %s that %s does not load here: %s",
                     remote.url, key, exc)  # fmt: skip


def read_load_failures(store: Store) -> dict[str, list[LoadFailureNote]]:
    """Every host's note, by key (a note that vanishes or does not read is skipped)."""
    out: dict[str, list[LoadFailureNote]] = {}
    for key in store.list_dir(LOAD_NOTES_DIR):
        for name in store.list_dir(join(LOAD_NOTES_DIR, key)):
            with contextlib.suppress(Exception):  # one bad note never hides the others
                note = LOAD_NOTES.read(store, join(LOAD_NOTES_DIR, key, name))
                if note is not None:
                    out.setdefault(key, []).append(note)
    return {k: sorted(v, key=lambda n: n.at) for k, v in out.items()}


def forget_load_failures(store: Store, key: str) -> None:
    """Drop every host's note on ``key`` (best-effort)."""
    with contextlib.suppress(Exception):
        for name in store.list_dir(join(LOAD_NOTES_DIR, key)):
            store.delete(join(LOAD_NOTES_DIR, key, name))
