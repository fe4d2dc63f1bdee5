"""Withdrawing a defective entry from service, with a record of why.

A quarantined entry is unpublished (atomically: it is a miss from then on) and a note
``.quarantine/<key>.json`` (`QuarantineNote`, a record of the storage layer) says when and
why, so an operator can tell a recompile caused by corruption from one caused by a new key.
Notes written before records were tagged read as version 1.
"""

from __future__ import annotations

import contextlib
import logging
import time

from vllm_neuron.backends import Store, join
from vllm_neuron.backends.records import Record, RecordCodec, Untagged, encode

logger = logging.getLogger("vllm_neuron.compile")

QUARANTINE_DIR = ".quarantine"


class QuarantineNote(Record, frozen=True, tag="quarantine-note"):
    """Why `key` was withdrawn, and when (epoch seconds)."""

    key: str
    at: float
    reason: str


QUARANTINE_NOTES = RecordCodec(
    QuarantineNote,
    untagged=Untagged("quarantine-note", 1, "a quarantine note from before records had tags"),
)


def quarantine_entry(store: Store, key: str, reason: str) -> bool:
    """Unpublish `key` from `store` and note why; True if this call withdrew it."""
    logger.warning(
        "compile cache entry %s/%s failed verification (%s); quarantined, treating as a miss",
        store.url,
        key,
        reason,
    )
    with contextlib.suppress(Exception):
        note = QuarantineNote(key=key, at=time.time(), reason=reason)
        store.write(join(QUARANTINE_DIR, f"{key}.json"), encode(note))
    try:
        return store.unpublish(key)
    except Exception as exc:  # noqa: BLE001 - a failed withdrawal is reported, not fatal
        logger.warning("compile cache: could not withdraw %s/%s: %s", store.url, key, exc)
        return False


def read_quarantine_note(store: Store, key: str) -> QuarantineNote | None:
    """The note on why `key` was withdrawn from `store`; None when there is none."""
    return QUARANTINE_NOTES.read(store, join(QUARANTINE_DIR, f"{key}.json"))
