"""Files named by path, read through the store of the directory holding them.

The run record names every artifact by absolute path (readers take paths from it, never
from a guess), and traces arrive as paths. The storage layer is the only door to bytes
(docs/storage.md), so such a file is read as the key of its name in a store opened on its
directory, as `vllm_neuron.manifest.inspect` reads a manifest named by path: the same
bytes, and an error still names the path.
"""

from __future__ import annotations

import os

from vllm_neuron.backends import Store, open_store


def file_store(path: str, *, create: bool = False) -> tuple[Store, str]:
    """The store of the directory holding `path` and the file's key in it.

    Nothing is created unless `create` (a writer's directory is made, as for a log).
    """
    directory, name = os.path.split(os.path.abspath(path))
    return open_store(directory, create=create), name


def file_size(path: str) -> int | None:
    """The size of the regular file at `path`; None when there is no such file."""
    store, key = file_store(path)
    info = store.info(key)
    return None if info is None else info.size
