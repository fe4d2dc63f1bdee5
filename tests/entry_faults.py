"""Entries that verify but will not load, made on purpose (tests of the healing in
vllm_neuron/compile/runtime.py; shared by tests/compile and tests/plugin)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from vllm_neuron.backends import encode, join, open_store
from vllm_neuron.compile.entry import ENTRY_RECORD, read_record


def make_unloadable(cache_dir: Path, key: str) -> None:
    """Replace ``key``'s artifact by bytes that are no AOTInductor package, and record their
    sizes and digests in entry.json: the entry passes every checksum, but will not load."""
    store = open_store(str(cache_dir), create=False)
    prefix = store.published(key)
    assert prefix is not None, f"{cache_dir} has no entry {key}"
    record = read_record(store, prefix)
    (artifact,) = [name for name in record.files if name.endswith(".pt2")]
    path = Path(store.local_dir_of(prefix) or "") / artifact
    path.write_bytes(b"PK not a package at all " * 64)
    files = {name: store.digest(join(prefix, name)) for name in record.files}
    (path.parent / ENTRY_RECORD).write_bytes(encode(msgspec.structs.replace(record, files=files)))
