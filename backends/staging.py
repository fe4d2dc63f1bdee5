"""`Staging`: a directory being built for publication, invisible until `commit`."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import IO

from .digests import FileDigest
from .errors import StoreError
from .keys import join, validate_key
from .protocol import ByteStore


class Staging:
    """A directory being built for publication; visible to readers only after `commit`.

    Write files with `write`/`put_file`/`write_from` (keys relative to the staging root),
    or let a toolchain write into `output_dir()`, then call `commit()`, which returns True
    if this writer published `final` and False if another writer had already published it
    (first writer wins; the loser's files are removed). Leaving the context without
    committing removes the staged files.
    """

    def __init__(self, store: ByteStore, final: str, prefix: str) -> None:
        self.store = store
        self.final = final
        self.prefix = prefix
        self._done = False
        self._output: str | None = None
        self._scratch = False

    def key(self, rel: str) -> str:
        return join(self.prefix, validate_key(rel))

    def write(self, rel: str, data: bytes) -> None:
        self.store._write_unpublished(self.key(rel), data)

    def put_file(self, rel: str, local_path: str) -> None:
        self.store._put_file_unpublished(self.key(rel), local_path)

    def write_from(self, rel: str, reader: IO[bytes]) -> int:
        """Stream `reader` into the staged file `rel`; returns the bytes written."""
        return self.store._write_from_unpublished(self.key(rel), reader)

    def output_dir(self) -> str:
        """A real directory for a toolchain to write its compile output into.

        One of the two documented exceptions to "every byte goes through the store"
        (docs/storage.md): a compiler writes files, not store keys. On a store with local
        paths it is the staging directory itself, so nothing is copied; elsewhere it is a
        scratch directory on local disk whose files `digests()` moves into the staging
        area. The caller writes nothing else there and never reads it back: `digests()`
        (through the store) says what was written.
        """
        if self._output is None:
            local = self.store.local_path(self.prefix)
            self._scratch = local is None
            self._output = tempfile.mkdtemp(prefix="vn-staging-") if local is None else local
            os.makedirs(self._output, exist_ok=True)
        return self._output

    def keep_alive(self) -> None:
        """Say this staging area's writer is alive: collectors count a staging area's age
        from its newest file or directory, and a compile can write nothing for hours. On a
        store with local paths the directory's time is refreshed; a scratch `output_dir()`
        is not the store's and nothing collects it, so there is nothing to refresh."""
        if self._output is not None and not self._scratch:
            with contextlib.suppress(FileNotFoundError):  # aborted meanwhile: nothing to keep
                os.utime(self._output)

    def digests(self) -> dict[str, FileDigest]:
        """Size, SHA-256 and BLAKE3 of every staged file, by key relative to the staging root.

        A scratch `output_dir()` is moved in first (uploaded file by file, then removed).
        """
        self._move_scratch_in()
        return self.store.digest_tree(self.prefix)

    def _move_scratch_in(self) -> None:
        if not self._scratch or self._output is None:
            return
        scratch = self._output
        try:
            for dirpath, _dirs, files in os.walk(scratch):
                for name in files:
                    path = os.path.join(dirpath, name)
                    self.put_file(os.path.relpath(path, scratch).replace(os.sep, "/"), path)
        finally:
            self._drop_scratch()

    def commit(self) -> bool:
        if self._done:
            raise StoreError(f"staging for {self.final!r} was already committed or aborted")
        self._move_scratch_in()  # what a toolchain left in a scratch output_dir is staged
        self._done = True
        return self.store._commit_staged(self.final, self.prefix)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._drop_scratch()
            self.store.delete_tree(self.prefix)

    def _drop_scratch(self) -> None:
        if self._scratch and self._output is not None:
            shutil.rmtree(self._output, ignore_errors=True)
            self._output, self._scratch = None, False

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
