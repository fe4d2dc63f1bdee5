"""Whether a tier's entries load on this node: ``vllm-neuron cache verify --load``.

Why: checksums prove that an entry's bytes are the ones its builder recorded, not that this
node can load them (an artifact built against another build of a library, a package a
checksum-recomputing writer truncated). A serving process heals such an entry when it meets
it (compile/runtime.py); an operator asks before the fleet does. Loading runs the artifact's
own toolchain in this Python, exactly as a serving process would, from a local directory:
an entry of a remote tier is first fetched, verified, into a temporary local tier.
"""

from __future__ import annotations

import tempfile

from vllm_neuron.backends import Store, open_store

from .entry import read_record
from .remote_tier import fetch_entry
from .toolchains.base import ARTIFACTS
from .toolchains.select import select_toolchain

__all__ = ["load_problem"]


def _load(store: Store, key: str) -> None:
    prefix = store.published(key)
    if prefix is None:
        raise FileNotFoundError(f"{store.url}: no entry {key}")
    record = read_record(store, prefix)
    artifact = ARTIFACTS.convert(record.meta, source=f"{store.url}/{key} meta")
    directory = store.local_dir_of(prefix)
    if directory is None:
        raise RuntimeError(f"{store.url} is not on local disk")
    toolchain = select_toolchain(artifact.toolchain)  # type: ignore[arg-type]
    toolchain.load(directory, artifact)


def load_problem(store: Store, key: str) -> str | None:
    """Why entry ``key`` of ``store`` does not load in this process, or None when it does."""
    try:
        if store.local_dir_of(".staging") is not None:
            _load(store, key)
            return None
        with tempfile.TemporaryDirectory(prefix="vllm-neuron-load-check-") as tmp:
            local = open_store(tmp)
            if fetch_entry(store, key, local) is None:
                return f"{store.url}: no entry {key}"
            _load(local, key)
    except Exception as exc:  # noqa: BLE001 - whatever stops the load is the answer
        return f"does not load here: {type(exc).__name__}: {exc}"
    return None
