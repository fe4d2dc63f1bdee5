"""Withdrawing a defective entry from service, with a record of why.

A quarantined entry is unpublished (atomically: it is a miss from then on) and a note
``.quarantine/<key>.json`` says when and why, so an operator can tell a recompile caused by
corruption from one caused by a new key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

from vllm_neuron.backends import Store, join

logger = logging.getLogger("vllm_neuron.compile")

QUARANTINE_DIR = ".quarantine"


def quarantine_entry(store: Store, key: str, reason: str) -> bool:
    """Unpublish `key` from `store` and note why; True if this call withdrew it."""
    logger.warning(
        "compile cache entry %s/%s failed verification (%s); quarantined, treating as a miss",
        store.url,
        key,
        reason,
    )
    with contextlib.suppress(Exception):
        store.write(
            join(QUARANTINE_DIR, f"{key}.json"),
            json.dumps({"key": key, "at": time.time(), "reason": reason}).encode(),
        )
    try:
        return store.unpublish(key)
    except Exception as exc:  # noqa: BLE001 - a failed withdrawal is reported, not fatal
        logger.warning("compile cache: could not withdraw %s/%s: %s", store.url, key, exc)
        return False
