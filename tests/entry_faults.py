"""Entries that verify but will not load, made on purpose (tests of the healing in
vllm_neuron/compile/runtime.py; shared by tests/compile and tests/plugin)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from vllm_neuron.backends import encode, join, open_store
from vllm_neuron.compile.entry.record import ENTRY_RECORD, read_record


def _forge_artifact(store_dir: Path, key: str, rewrite: Callable[[Path], None]) -> None:
    """Rewrite ``key``'s AOTInductor package in place (``rewrite(path)``) and record the new
    sizes and digests in entry.json: the forged entry passes every checksum."""
    store = open_store(str(store_dir), create=False)
    prefix = store.published(key)
    assert prefix is not None, f"{store_dir} has no entry {key}"
    record = read_record(store, prefix)
    (artifact,) = [name for name in record.files if name.endswith(".pt2")]
    path = Path(store.local_dir_of(prefix) or "") / artifact
    rewrite(path)
    files = {name: store.digest(join(prefix, name)) for name in record.files}
    (path.parent / ENTRY_RECORD).write_bytes(encode(msgspec.structs.replace(record, files=files)))


def make_unloadable(cache_dir: Path, key: str) -> None:
    """Replace ``key``'s artifact by bytes that are no AOTInductor package: the entry passes
    every checksum, but will not load."""
    _forge_artifact(cache_dir, key, lambda path: path.write_bytes(b"PK not a package at all " * 64))


CANARY_SOURCE = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void canary(void) {
    int fd = open("%s", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, "ran\n", 4); close(fd); }
}
"""


def make_code_running(store_dir: Path, key: str, canary: Path, workdir: Path) -> None:
    """Replace the shared object inside ``key``'s AOTInductor package by one whose
    constructor appends to ``canary`` the moment it is loaded, and record the new sizes and
    digests in entry.json: what a writer to the tier without the builder's key could do.
    The entry passes every checksum; only a signature can tell."""
    import subprocess
    import zipfile

    source = workdir / "canary.c"
    source.write_text(CANARY_SOURCE % canary)
    shared = workdir / "canary.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shared), str(source)], check=True)

    def swap(path: Path) -> None:
        rebuilt = workdir / "rebuilt.pt2"
        with zipfile.ZipFile(path) as old, zipfile.ZipFile(rebuilt, "w") as new:
            swapped = 0
            for info in old.infolist():
                data = old.read(info)
                if info.filename.endswith(".so"):
                    data, swapped = shared.read_bytes(), swapped + 1
                new.writestr(info, data)
        assert swapped, f"{path} holds no shared object"
        path.write_bytes(rebuilt.read_bytes())

    _forge_artifact(store_dir, key, swap)
