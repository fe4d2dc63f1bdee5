"""Withdrawing a defective entry from service, with a record of why.

A quarantined entry is unpublished (atomically: it is a miss from then on) and a note
``.quarantine/<key>.json`` (`QuarantineNote`, declared with every per-key note in
`entry/notes.py`: `QUARANTINE`) says when and why, so an operator can tell a recompile
caused by corruption from one caused by a new key. Notes written before records were
tagged read as version 1.

The withdrawal is of the publication that was judged: whoever found the defect passes its
version (`Publication.version`, carried by a `PublicationProblem`), and an entry another
node has published in its place meanwhile stays (the storage layer's conditional
`Store.unpublish`). Only a caller holding the key's lock, which nobody can publish past,
may leave the version out.

The reason passes the secret redactor (`vllm_neuron.envs.redact_text`) before it is written:
a quarantine note may sit on the shared remote, and a reason quotes an error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from vllm_neuron.backends import Store
from vllm_neuron.backends.records import encode
from vllm_neuron.envs import redact_text

from ..entry.notes import QUARANTINE, QUARANTINE_DIR, QUARANTINE_NOTES, QuarantineNote
from ..entry.record import EntryProblem
from .unpacked import drop_unpacked

__all__ = ["QUARANTINE_DIR", "QUARANTINE_NOTES", "PublicationProblem", "QuarantineNote",
           "quarantine_entry", "read_quarantine_note"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")


class PublicationProblem(EntryProblem):
    """An `EntryProblem` of one publication of an entry: `version` is the one judged
    (`Publication.version`), the one a quarantine withdraws; None when unknown."""

    def __init__(self, message: str, *, version: str | None) -> None:
        super().__init__(message)
        self.version = version

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_problem, (str(self), self.version)


def _rebuild_problem(message: str, version: str | None) -> PublicationProblem:
    return PublicationProblem(message, version=version)


def quarantine_entry(
    store: Store, key: str, reason: str, *, version: str | None = None, warn: bool = True
) -> bool:
    """Unpublish `key` from `store` and note why; True if this call withdrew it.

    `version`: the publication judged (`Publication.version`); one published in its place
    since is left alone (False). None withdraws whatever is published (a caller under the
    key's lock). `warn=False`: the caller has said why already (one warning per fault).
    """
    if warn:
        logger.warning(
            "compile cache entry %s/%s failed verification (%s); quarantined, treating as "
            "a miss", store.url, key, reason,
        )  # fmt: skip
    with contextlib.suppress(Exception):
        note = QuarantineNote(key=key, at=time.time(), reason=redact_text(reason))
        store.write(QUARANTINE.path(key), encode(note))
    try:
        withdrawn = store.unpublish(key, version=version)
    except Exception as exc:  # noqa: BLE001 - a failed withdrawal is reported, not fatal
        logger.warning("compile cache: could not withdraw %s/%s: %s", store.url, key, exc)
        return False
    if withdrawn:
        drop_unpacked(store, key)  # its package's unpacked copy goes with it
    return withdrawn


def read_quarantine_note(store: Store, key: str) -> QuarantineNote | None:
    """The note on why `key` was withdrawn from `store`; None when there is none."""
    return QUARANTINE_NOTES.read(store, QUARANTINE.path(key))
