"""What the stateful models of the cache share (tests/compile/flow/test_cache_stateful.py and
tests/compile/trust/test_cache_stateful_trust.py): the keys, the files of an entry and their
bytes, and where one example's stores live."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid

from vllm_neuron.backends import Store, open_store
from vllm_neuron.backends._memory import forget_memory_store

KEYS = [hashlib.md5(f"key-{i}".encode()).hexdigest() for i in range(3)]
FILES = ("graph.bin", "weights/w.bin")

def expected(key: str, name: str) -> bytes:
    return hashlib.sha256(f"{key}:{name}".encode()).digest() * (1 + len(name))


class Tiers:
    """Where one example's stores live: fresh ones for every example.

    `disk_root`: each node's local tier is a new directory under it (else a memory
    store); `remote_root`: the remote is a new prefix under that URL (else a memory store).
    """

    def __init__(self, disk_root: str | None = None, remote_root: str | None = None) -> None:
        self.disk_dir = tempfile.mkdtemp(prefix="example-", dir=disk_root) if disk_root else None
        self.memory_remote = None if remote_root else f"model-remote-{uuid.uuid4().hex}"
        self.remote_url = (f"{remote_root}/{uuid.uuid4().hex}" if remote_root
                           else f"memory://{self.memory_remote}")

    def local(self, node: int) -> Store:
        if self.disk_dir is None:
            return open_store("memory://")
        return open_store(os.path.join(self.disk_dir, f"node-{node}"))

    def close(self) -> None:
        if self.memory_remote is not None:
            forget_memory_store(self.memory_remote)
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir, ignore_errors=True)


