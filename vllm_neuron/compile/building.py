"""Building a cache entry: a toolchain's compile, digested, recorded and published.

A compile writes into the directory the storage layer hands it for that purpose
(`Staging.output_dir`: the staging directory itself on local disk). What it wrote is then
read back through the store only: its digests (`Staging.digests`) go into the commit
record, which is written last, and the staging area is published atomically (first
writer wins). Without a cache (`compile_uncached`) the output stays in a directory of its
own, digested the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vllm_neuron.backends import Record, Staging, Store, fault_point, open_store

from .entry import ENTRY_RECORD, EntryRecord, build_record, encode_record
from .events import CacheMiss, Compiled, CompileFailed
from .failures import clear_failure_note, describe, write_failure_note

CompileFn = Callable[[str], Mapping[str, Any]]
"""Compiles into the given empty directory; returns the toolchain's metadata (JSON-able)."""

STAGING_KEEPALIVE = 15 * 60.0
"""Seconds between refreshes of a compile's staging area while the compiler runs, well
inside the age at which gc collects a staging area (`gc.STAGING_MAX_AGE`, 6 h): a Neuron
compile can write nothing for hours, and must not look like a killed writer's leftovers."""


@contextlib.contextmanager
def _kept_alive(staging: Staging) -> Iterator[None]:
    """Refresh `staging` every `STAGING_KEEPALIVE` seconds for the duration of the block."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(STAGING_KEEPALIVE):
            with contextlib.suppress(OSError):  # a refresh is best-effort: the compile goes on
                staging.keep_alive()

    beater = threading.Thread(target=beat, daemon=True, name="vllm-neuron-staging-keepalive")
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join(timeout=60)  # a refresh stuck on a dead mount never holds the compile


def compile_and_publish(
    local: Store,
    key: str,
    compile_fn: CompileFn,
    *,
    components: Mapping[str, str],
    toolchain: str,
    target: str,
    on_failure: Callable[[Exception], None],
) -> tuple[EntryRecord, float]:
    """Compile `key` into a staging area of `local` and publish it; (record, seconds).

    `on_failure` is called with a compile's exception before it is raised (an interrupt is
    not the graph's fault and is raised as it is). Publication is first-writer-wins: if
    another writer published `key` first, its entry stands and this one is discarded.
    """
    start = time.perf_counter()
    with local.stage(key) as staging:  # left without a commit: nothing stays
        try:
            # The documented door (docs/storage.md): a toolchain writes its own output
            # files into this directory; nothing here reads or writes it.
            output_dir = staging.output_dir()
            with _kept_alive(staging):
                meta = dict(compile_fn(output_dir))
            seconds = time.perf_counter() - start
            record = build_record(key=key, components=components, toolchain=toolchain,
                                  target=target, compile_seconds=seconds,
                                  files=staging.digests(), meta=meta)
            fault_point("compile.staging-written")
        except BaseException as exc:
            staging.abort()
            if isinstance(exc, Exception):
                on_failure(exc)
            raise
        staging.write(ENTRY_RECORD, encode_record(record))
        fault_point("compile.record-written")
        staging.commit()
        fault_point("compile.published")
    return record, seconds


_SCRATCH: tuple[int, str] | None = None  # (the pid that made it, its path)
_SCRATCH_LOCK = threading.Lock()


def uncached_scratch() -> str:
    """This process's directory for compiles with the cache disabled, made at first use.

    With the cache disabled every graph compiles into a directory nobody else reads; a
    long-running server compiling each graph afresh would otherwise leave one in the temp
    directory per graph and per start. Removed at the process's normal exit, by the process
    that made it only: a forked child inherits the exit hook and the path, and makes its
    own (a SIGKILLed process leaves its directory, as any temp file).
    """
    global _SCRATCH
    pid = os.getpid()
    with _SCRATCH_LOCK:
        if _SCRATCH is None or _SCRATCH[0] != pid or not os.path.isdir(_SCRATCH[1]):
            path = tempfile.mkdtemp(prefix=f"vllm_neuron_uncached_{pid}_")
            _SCRATCH = (pid, path)
            atexit.register(_remove_scratch, pid, path)
        return _SCRATCH[1]


def _remove_scratch(pid: int, path: str) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def compile_uncached(
    key: str, compile_fn: CompileFn, *, components: Mapping[str, str], toolchain: str,
    target: str,
) -> tuple[str, EntryRecord, float]:
    """Compile `key` into a fresh directory of its own; (directory, record, seconds).

    The directory is the toolchain's to load from for as long as the process lives, under
    this process's scratch directory (`uncached_scratch`), removed when the process exits.
    """
    out_dir = tempfile.mkdtemp(prefix=f"{key[:8]}_", dir=uncached_scratch())
    start = time.perf_counter()
    try:
        meta = dict(compile_fn(out_dir))
        seconds = time.perf_counter() - start
        files = open_store(out_dir, profile="local", create=False).digest_tree("")
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    record = build_record(key=key, components=components, toolchain=toolchain, target=target,
                          compile_seconds=seconds, files=files, meta=meta)
    return out_dir, record, seconds


class Compiler:
    """Compiles keys for one cache tier and says what happened: a ``miss`` and a
    ``compile`` event per compile, a failure note and a ``compile_failed`` event per
    failed one (`failures.py`: the processes waiting on the key raise it at once)."""

    def __init__(
        self, local: Store, *, toolchain: str, target: str, record: Callable[[Record], None]
    ) -> None:
        self.local = local
        self.toolchain = toolchain
        self.target = target
        self._record = record

    def publish(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
        piece: str | None = None,
    ) -> tuple[EntryRecord, float]:
        """`compile_and_publish` into the tier; (record, seconds). `piece` names the piece of
        the model the graph is (vLLM's compiler adaptor), for the events only."""
        # A miss is a key that no tier could serve: counted here, when it is compiled, not
        # before a fetch or a wait for another node (those end as hits of the remote).
        self._record(CacheMiss(key=key, at=time.time()))
        record, seconds = compile_and_publish(
            self.local, key, compile_fn, components=components, toolchain=self.toolchain,
            target=self.target, on_failure=lambda exc: self._failed(key, exc, piece))
        clear_failure_note(self.local, key)
        self._compiled(key, record, seconds, piece)
        return record, seconds

    def uncached(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
        piece: str | None = None,
    ) -> tuple[str, EntryRecord, float]:
        """`compile_uncached`; (directory, record, seconds)."""
        out_dir, record, seconds = compile_uncached(
            key, compile_fn, components=components, toolchain=self.toolchain, target=self.target)
        self._compiled(key, record, seconds, piece)
        return out_dir, record, seconds

    def _compiled(self, key: str, record: EntryRecord, seconds: float, piece: str | None) -> None:
        self._record(Compiled(key=key, at=time.time(), seconds=seconds, toolchain=self.toolchain,
                              size=record.total_size, piece=piece or ""))  # fmt: skip

    def _failed(self, key: str, exc: BaseException, piece: str | None) -> None:
        message = describe(exc)
        self._record(CompileFailed(key=key, at=time.time(), error=message, piece=piece or ""))
        write_failure_note(self.local, key, message)
