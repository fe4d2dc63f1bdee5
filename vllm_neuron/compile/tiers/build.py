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
import errno
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from vllm_neuron.backends import Record, Staging, Store, fault_point, open_store
from vllm_neuron.envs import redact_text

from ..entry.events import CacheMiss, Compiled, CompileFailed
from ..entry.failure_notes import (
    clear_failure_note,
    describe,
    forget_stopped,
    write_failure_note,
)
from ..entry.outcomes import CompileWorkerLost
from ..entry.record import ENTRY_RECORD, EntryRecord, build_record, encode_record
from ..trust.origin import seal
from ..trust.signing import SIGNATURE_FILE
from .health import (
    COMPILE_SPACE_RESERVE,
    LocalTierFault,
    free_bytes,
    mib,
    tier_dir,
    unwritable_cause,
    why_unwritable,
)

Signing = Callable[[EntryRecord], "bytes | None"]
"""An entry's ``entry.sig`` bytes for its record, or None (this process signs nothing)."""

logger = logging.getLogger("vllm_neuron.compile")

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
    sign: Signing | None = None,
) -> tuple[EntryRecord, float]:
    """Compile `key` into a staging area of `local` and publish it; (record, seconds).
    `sign` gives the entry's signature (`entry.sig`) for its record, when it has one.

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
            fault = unwritable_cause(exc, tier_dir(local))
            if fault is not None:  # the place's fault, not the graph's: no failure note
                raise LocalTierFault(_fault_reason(fault, local)) from exc
            if isinstance(exc, Exception) and not isinstance(exc, CompileWorkerLost):
                on_failure(exc)  # a lost worker is not the graph's failure: no note
            raise
        try:
            _write_signature(staging, record, sign)
            record = _compiled_here(local, record)
            staging.write(ENTRY_RECORD, encode_record(record))
            fault_point("compile.record-written")
            staging.commit()
        except OSError as exc:
            staging.abort()  # nothing half-written stays visible
            if unwritable_cause(exc, tier_dir(local)) is None:
                raise
            raise LocalTierFault(_fault_reason(exc, local)) from exc
        fault_point("compile.published")
    return record, seconds


def _compiled_here(local: Store, record: EntryRecord) -> EntryRecord:
    """The local tier's record of an entry this node compiled: ``compiled_on`` says it is
    this node's own code (docs/trust.md), sealed by the tier's node key so that nobody else
    can say so (`trust.origin`); both are stripped when the entry is promoted."""
    return seal(local, msgspec.structs.replace(record, compiled_on=socket.gethostname()))


def _write_signature(staging: Staging, record: EntryRecord, sign: Signing | None) -> None:
    signature = None if sign is None else sign(record)
    if signature is not None:
        staging.write(SIGNATURE_FILE, signature)


def _fault_reason(exc: OSError, local: Store) -> str:
    return why_unwritable(exc, tier_dir(local) or local.url) or str(exc)


def room_to_compile(path: str) -> str | None:
    """Why a compile must not write under ``path`` (too little space: see
    `COMPILE_SPACE_RESERVE`), or None."""
    free = free_bytes(path)
    if free is None or free >= COMPILE_SPACE_RESERVE:
        return None
    return f"no space left: {mib(free)} free, a compile needs {mib(COMPILE_SPACE_RESERVE)}"


def adopt_into_tier(local: Store, key: str, out_dir: str, record: EntryRecord,
                    sign: Signing | None = None) -> bool:  # fmt: skip
    """Publish a graph compiled outside the tier (in a scratch area) into it, as a compile
    there would have; False when another writer published the key first. Raises
    `LocalTierFault` when the tier cannot take it (nothing stays visible)."""
    with local.stage(key) as staging:
        try:
            for name in record.files:
                staging.put_file(name, os.path.join(out_dir, name))
            _write_signature(staging, record, sign)
            staging.write(ENTRY_RECORD, encode_record(_compiled_here(local, record)))
            return bool(staging.commit())
        except OSError as exc:
            staging.abort()
            if unwritable_cause(exc, tier_dir(local)) is None:
                raise
            raise LocalTierFault(_fault_reason(exc, local)) from exc


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
    try:
        scratch = uncached_scratch()
        out_dir = tempfile.mkdtemp(prefix=f"{key[:8]}_", dir=scratch)
    except OSError as exc:
        raise OSError(exc.errno, f"no writable place to compile graph {key}: the temporary "
                      f"directory {tempfile.gettempdir()} (TMPDIR): {exc.strerror}") from exc
    short = room_to_compile(scratch)
    if short is not None:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise OSError(errno.ENOSPC, f"no room to compile graph {key}: the temporary directory "
                      f"{scratch} (TMPDIR) has {short}")  # fmt: skip
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


class EntryBuilder:
    """Compiles keys for one cache tier and says what happened: a ``miss`` and a
    ``compile`` event per compile, a failure note and a ``compile_failed`` event per
    failed one (`failures.py`: the processes waiting on the key raise it at once)."""

    def __init__(
        self, local: Store, *, toolchain: str, target: str, record: Callable[[Record], None],
        sign: Signing | None = None,
    ) -> None:
        self.local = local
        self.toolchain = toolchain
        self.target = target
        self._record = record
        self._sign = sign
        self._bypass_said = False  # the tier's lack of room is said once per process

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
            target=self.target, on_failure=lambda exc: self._failed(key, exc, piece),
            sign=self._sign)
        clear_failure_note(self.local, key)
        forget_stopped(self.local, key)
        self._compiled(key, record, seconds, piece)
        return record, seconds

    def publish_where_room(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
        piece: str | None = None,
    ) -> tuple[str | None, EntryRecord, float]:
        """`publish`, unless the tier has no room for it: too little space to compile there
        (`room_to_compile`), or a write it refused (no space, read-only, no permission). Then
        the graph compiles in this process's scratch area, is adopted into the tier if it
        fits, and is served from the scratch area if not (`serve_from_scratch`): (the
        scratch directory, or None when published; record; seconds). Nothing half-written
        stays in the tier."""
        where = tier_dir(self.local)
        short = room_to_compile(where) if where else None
        if short is None:
            try:
                record, seconds = self.publish(key, compile_fn, components, piece)
                return None, record, seconds
            except LocalTierFault as exc:
                short = str(exc)
        else:
            self._record(CacheMiss(key=key, at=time.time()))
        out_dir, record, seconds = self._compile_in_scratch(key, compile_fn, components, piece)
        free = free_bytes(where) if where else None
        if free is not None and free >= record.total_size + (1 << 20):
            try:
                adopt_into_tier(self.local, key, out_dir, record, self._sign)
                shutil.rmtree(out_dir, ignore_errors=True)  # the tier's copy is the one used
                return None, record, seconds
            except LocalTierFault as exc:
                short = str(exc)
        elif free is not None:
            short = f"no space left: {mib(free)} free, the artifact is {mib(record.total_size)}"
        self.said_bypassed(short, key, out_dir)
        return out_dir, record, seconds

    def serve_from_scratch(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
        piece: str | None, reason: str,
    ) -> tuple[str, EntryRecord, float]:
        """The tier cannot be used for `key` at all (`reason`: a lock it cannot create, an
        entry it cannot withdraw): compiled in scratch and served from there, said once."""
        self._record(CacheMiss(key=key, at=time.time()))
        out_dir, record, seconds = self._compile_in_scratch(key, compile_fn, components, piece)
        self.said_bypassed(reason, key, out_dir)
        return out_dir, record, seconds

    def said_bypassed(self, reason: str, key: str, out_dir: str) -> None:
        if not self._bypass_said:  # once per process: a full disk would say it per graph
            self._bypass_said = True
            logger.warning(
                "vllm_neuron: VLLM_CACHE_ROOT (the local compile cache %s): %s; the tier is "
                "bypassed for graph %s (served from %s, not cached), and for any other graph "
                "it cannot take", self.local.url, reason, key, out_dir,
            )  # fmt: skip

    def _compile_in_scratch(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str], piece: str | None
    ) -> tuple[str, EntryRecord, float]:
        try:
            return self.uncached(key, compile_fn, components, piece)
        except CompileWorkerLost:
            raise  # not the graph's failure: compiled in place by the caller
        except Exception as exc:  # the graph's own failure: said to the waiters as usual
            self._failed(key, exc, piece)
            raise

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
        # The event log is a file of the tier, read by `cache stats` and the report: no
        # secret the error quotes (a token in a download's URL) goes into it.
        self._record(CompileFailed(key=key, at=time.time(), error=redact_text(message),
                                   piece=piece or ""))  # fmt: skip
        write_failure_note(self.local, key, message)
