"""A host entry loads from a verified, unpacked copy of its package, kept beside the entry.

Why: torch's AOTInductor loader, handed a ``.pt2`` package, unpacks every member into a new
``$TMPDIR/aotinductor_*`` directory on each load and removes it only when the loaded model is
destroyed, which a serving process never does before it exits (a killed one never at all):
about 1.5 MB per graph per process start, never collected. Handed a directory holding the
package's members, the same loader (``AOTIModelPackageLoader``, torch 2.13) opens the shared
object where it is and writes nothing. So each entry's package is unpacked once per node,
into the local tier, and every later load is a verification and a ``dlopen``.

Layout, in the local tier (a name with a dot is never listed as an entry)::

    .unpacked/<key>-<tag>/     one package unpacked, published atomically (staged, then
                               renamed into place, as an entry is). <tag>: the first 32 hex
                               digits of the package's BLAKE3 as the entry records it
                               (SHA-256 for a record without BLAKE3)
      unpacked.json            `UnpackedRecord`, staged last: the key, the package's name
                               and recorded digests, every member's size, SHA-256, BLAKE3
      <member> ...             the package's members, named as in the archive

The entry is never touched: it stays immutable, checksummed and signed as published, and
promotes as it is. The copy is named by the package's content, so a path never holds two
contents (the dynamic loader reuses a library already loaded from a path), and an entry
compiled again into other bytes gets a copy of its own.

**Nothing unverified is loaded.** A copy is made only from a package that matches its
entry's record (size and both digests, one read); each member is checked against the
archive's CRC as it is read, and its name as a store key (no ``..``, no absolute path).
Before every load the copy's record must name this key and this package's recorded
digests, the directory must hold exactly the recorded files, and each must match its size
and BLAKE3 (one read each, through the store: well under 1 ms for a vLLM piece). A copy that
fails (torn by a crash, changed, a file too many) is withdrawn and made again, never loaded.

**Collected with its entry.** Every withdrawal of an entry (a quarantine, an eviction,
``cache prune``, ``cache gc --keep-manifest``) withdraws its copies (`drop_unpacked`); one
whose entry is gone anyway (a process killed between the two, a load racing a withdrawal)
is collected by ``cache gc`` and the background pass (`upkeep/collect.py`, kind
``unpacked``: `entry/notes.py` declares the copies' directory, record and age rule with
every other per-key note's, `UNPACKED`).

**Never fatal.** A tier that cannot take the copy (full, read-only) costs one warning per
process, and its graphs load from their packages, each unpacked into a job directory of
``$TMPDIR`` removed once loaded (`_load_package`); so does a package this code cannot unpack
into the tier. A package that does not match its entry's record
is the entry's fault: a `ToolchainError`, which the runtime heals (withdraw, compile).

**A read-only tier's entry** (`tiers/baked.py`) loads from the copy baked beside it
(`vllm-neuron cache bake` makes them; a local tier turned read-only has those it made):
verified as above, and nothing is written there - a copy that is absent or unsound is
neither made nor withdrawn; the graph then loads from its package through a private job
directory of ``$TMPDIR``, removed once loaded (`_load_package`; an unsound one is said once).
Only with the trust policy ``off``: a copy's ``unpacked.json`` is the copy's own claim,
signed by no one, so under ``warn`` or ``require`` a baked copy is never loaded - the graph
loads from its package, whose bytes the tier's lookup checked against the signed record
(docs/trust.md, "Read-only and baked tiers").
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable
from typing import Any

from vllm_neuron.backends import (
    FileDigest,
    IntegrityError,
    Store,
    fault_point,
    join,
)
from vllm_neuron.backends import validate_key as valid_member
from vllm_neuron.backends.digests import digest_stream, mismatch
from vllm_neuron.backends.errors import ListingTooLarge
from vllm_neuron.backends.records import RecordError, encode
from vllm_neuron.backends.verified_copy import check_verified

from ..entry.notes import (
    TAG_DIGITS,
    UNPACKED_DIR,
    UNPACKED_RECORDS,
    UnpackedRecord,
    copy_key,
)
from ..entry.outcomes import CacheResult
from ..entry.text import printable
from ..toolchains.base import CompiledArtifact, Toolchain, ToolchainError
from ..toolchains.op_libraries import MissingOpLibrary
from ..workers.job_dirs import PreparedJob, owned_job_dir
from .health import tier_dir, unwritable_cause, why_unwritable

__all__ = ["UNPACKED_DIR", "UNPACKED_RECORD", "UNPACKED_RECORDS", "PackageMismatch",
           "UnpackedRecord", "copy_key", "copy_name", "drop_unpacked", "load_entry",
           "unpacked_dir"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

UNPACKED_RECORD = "unpacked.json"


class PackageMismatch(Exception):
    """The package does not match its entry's record: the entry's fault, not the copy's."""


class _Unsound(Exception):
    """A copy that must not be loaded (the message says why)."""


def copy_name(key: str, source: FileDigest) -> str:
    """Where the copy of a package with recorded digests `source` lives in the tier."""
    return join(UNPACKED_DIR, f"{key}-{(source.blake3 or source.sha256)[:TAG_DIGITS]}")


def unpacked_sizes(store: Store) -> dict[str, int]:
    """The bytes of each key's unpacked copies in the tier (a listing of `UNPACKED_DIR` and
    a stat per file): what the size bound counts beside each entry's recorded files."""
    sizes: dict[str, int] = {}
    for info in store.iter_files(UNPACKED_DIR):
        name = info.key.removeprefix(UNPACKED_DIR + "/").split("/", 1)[0]
        key = copy_key(name)
        if key is not None:
            sizes[key] = sizes.get(key, 0) + info.size
    return sizes


# -------------------------------------------------------------------- the copy
def unpacked_dir(store: Store, key: str, prefix: str, package: str, source: FileDigest, *,
                 made: Callable[[], None] | None = None) -> str:  # fmt: skip
    """The local directory of a verified copy of entry `key`'s `package` (its files under
    `prefix`; `source`: its recorded digests), made, or made again, when needed (then
    `made()` is called: the tier grew).

    `PackageMismatch` when the package does not match `source`; an `OSError` when the tier
    cannot take the copy; anything else: the package cannot be unpacked here."""
    name = copy_name(key, source)
    why = ""
    for _ in range(2):  # a copy found unsound (or lost to a racing withdrawal) is made again
        version = store.publication(name).version
        try:
            found = _sound(store, name, key, package, source)
        except _Unsound as exc:
            logger.info("compile cache: %s; unpacking the package again", exc)
            store.unpublish(name, version=version)  # exactly the copy judged
            found, why = None, str(exc)
        if found is None:
            try:
                found = _unpack(store, name, key, join(prefix, package), package, source)
            except _Unsound as exc:
                found, why = None, str(exc)
            if found is not None and made is not None:
                made()
        if found is not None:
            directory = store.local_dir_of(found)
            if directory is None:
                raise _Unsound(f"{store.url} is not on local disk")
            return directory
    raise _Unsound(why)


def _sound(store: Store, name: str, key: str, package: str, source: FileDigest) -> str | None:
    """The prefix of copy `name` when it is sound, None when there is none; `_Unsound` when
    it is there but must not be loaded."""
    try:  # bounded, regular files only: too large or a FIFO is an unsound copy
        found = store.read_published(name, UNPACKED_RECORD)
    except RecordError as exc:
        raise _Unsound(f"{exc.source} does not read: {exc.problem}") from None
    if found is None:
        return None
    prefix, data = found
    where = f"{store.url}/{name}"
    if data is None:
        raise _Unsound(f"{where}: {UNPACKED_RECORD} is missing")
    try:
        record = UNPACKED_RECORDS.decode(data, source=f"{where}/{UNPACKED_RECORD}")
    except RecordError as exc:
        raise _Unsound(f"{exc.source} does not read: {exc.problem}") from None
    if (record.key, record.package, record.source) != (key, package, source):
        raise _Unsound(f"{where}: its record names another package "
                       f"({printable(record.key, 100)}/{printable(record.package, 200)}, "
                       f"{record.source.size} bytes)")  # fmt: skip
    expected = {join(prefix, rel) for rel in record.files}
    present = set(store.list(prefix)) - {join(prefix, UNPACKED_RECORD)}
    if present != expected:
        extra, lost = sorted(present - expected), sorted(expected - present)
        raise _Unsound(f"{where}: files differ from its record (missing {lost}, extra {extra})")
    try:
        check_verified(store, prefix, record.files)  # size, then BLAKE3: one read each
    except IntegrityError as exc:
        raise _Unsound(str(exc)) from None
    return prefix


def _unpack(store: Store, name: str, key: str, src: str, package: str,
            source: FileDigest) -> str | None:  # fmt: skip
    """Unpack the package at `src` into a new copy `name`, published atomically; its prefix
    (this one's, or a sound one another process published first), or None."""
    with store.open_read(src) as raw:
        actual = digest_stream(raw)
        failed = "size" if actual.size != source.size else mismatch(source, actual)
        if failed is not None:
            raise PackageMismatch(f"{store.url}/{src} fails its {failed} check against its "
                                  "entry's record")  # fmt: skip
        raw.seek(0)
        with store.stage(name) as staging, zipfile.ZipFile(raw) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            for n, member in enumerate(members):
                rel = valid_member(member.filename)  # InvalidKey: an unsafe name
                if rel == UNPACKED_RECORD:
                    raise _Unsound(f"{store.url}/{src} holds a member named {UNPACKED_RECORD}")
                with archive.open(member) as reader:  # BadZipFile when its CRC fails
                    staging.write_from(rel, reader)
                if n == 0:
                    fault_point("unpack.mid-copy")  # crash tests: one member staged
            files = staging.digests()
            if {rel: d.size for rel, d in files.items()} != {
                    m.filename: m.file_size for m in members}:  # fmt: skip
                raise _Unsound(f"{store.url}/{src}: its members did not unpack whole")
            record = UnpackedRecord(key=key, package=package, source=source, files=files,
                                    at=time.time())  # fmt: skip
            staging.write(UNPACKED_RECORD, encode(record))
            fault_point("unpack.staged")  # crash tests: staged whole, not published
            if staging.commit():
                return store.published(name)
    return _sound(store, name, key, package, source)  # another process published first


UNPACKED_LIST_MAX = 100_000
"""The most names `drop_unpacked` lists in `UNPACKED_DIR`: a folder remote quarantines
through it too, and its ``.unpacked/`` may hold millions of planted names (a local tier
holds a few copies per entry loaded)."""


def drop_unpacked(store: Store, key: str) -> None:
    """Withdraw every copy of entry `key`'s packages (its entry was just withdrawn).
    Best-effort: what stays (a failure, a load racing the withdrawal) `cache gc` collects;
    a folder of more than `UNPACKED_LIST_MAX` names is left as it is, one warning."""
    if not store.capabilities.local_paths:
        return  # copies are only made where entries are loaded: local disk
    try:
        names = store.list_dir(UNPACKED_DIR, max_names=UNPACKED_LIST_MAX)
    except ListingTooLarge as exc:
        logger.warning("compile cache: not withdrawing the unpacked copies of %s: %s", key, exc)
        return
    except Exception as exc:  # noqa: BLE001 - as below
        logger.debug("compile cache: could not list the copies of %s in %s: %s", key,
                     store.url, exc)  # fmt: skip
        return
    try:
        for name in names:
            if copy_key(name) == key:
                store.unpublish(join(UNPACKED_DIR, name))
    except Exception as exc:  # noqa: BLE001 - the entry is withdrawn; this is its shadow
        logger.debug("compile cache: could not withdraw the copies of %s in %s: %s",
                     key, store.url, exc)  # fmt: skip


# ------------------------------------------------------------------ loading
_NO_ROOM: set[str] = set()  # tiers that refused a copy in this process (said once)
_WARNED: set[str] = set()


def load_entry(toolchain: Toolchain, store: Store, result: CacheResult,
               artifact: CompiledArtifact, *, grew: Callable[[], None] | None = None,
               read_only: Store | None = None,
               baked_copies: bool = True) -> Callable[..., Any]:  # fmt: skip
    """Load `result`'s artifact: from the verified copy of its package in `store` (the local
    tier) when the toolchain loads one, else, or when that cannot be, as `toolchain.load`
    does. A package that fails its entry's record is a `ToolchainError` (the entry's
    fault); what fails only in the copy costs a warning, never the load. `grew()` is called
    once a copy is made (the size bound counts copies). `read_only`: the read-only tier
    the entry is in (see the module doc); nothing is written there. `baked_copies`: whether
    that tier's unpacked copies may be loaded (only with trust off: nothing signs them)."""
    path, package = result.path, toolchain.package_of(artifact)
    if path is None:
        raise RuntimeError(f"{store.url} is not on local disk: {result.key} cannot be loaded")
    if package is None:
        return toolchain.load(path, artifact)  # a toolchain whose artifact is no package
    source = result.record.files.get(package)
    if source is None or not result.prefix or store.url in _NO_ROOM:
        return _load_package(toolchain, path, package, artifact)  # a scratch compile, no room
    if read_only is not None:
        if not baked_copies:  # the package its lookup checksummed against the signed record
            return _load_package(toolchain, path, package, artifact)
        return _load_baked(toolchain, read_only, result, package, source, artifact)
    try:
        directory = unpacked_dir(store, result.key, result.prefix, package, source, made=grew)
    except PackageMismatch as exc:
        raise ToolchainError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the copy is an optimisation; load as before
        fault = unwritable_cause(exc, tier_dir(store))
        if fault is None:
            return _package_instead(toolchain, path, package, artifact, "unpack",
                                    f"{type(exc).__name__}: {exc}")  # fmt: skip
        _NO_ROOM.add(store.url)
        where = tier_dir(store) or store.url
        logger.warning(
            "vllm_neuron: the local compile cache %s cannot take unpacked packages (%s); its "
            "graphs load from their packages in this process, each unpacked into %s on "
            "every load (removed once loaded)", where,
            why_unwritable(fault, where) or fault, tempfile.gettempdir())  # fmt: skip
        return _load_package(toolchain, path, package, artifact)
    try:
        return toolchain.load_unpacked(directory, artifact)
    except ToolchainError as exc:
        if isinstance(exc.__cause__, MissingOpLibrary):
            raise  # this Python lacks a kernel library: the package would not load either
        return _package_instead(toolchain, path, package, artifact, "load", str(exc))


def _load_baked(toolchain: Toolchain, tier: Store, result: CacheResult, package: str,
                source: FileDigest, artifact: CompiledArtifact) -> Callable[..., Any]:  # fmt: skip
    """A read-only tier's entry: loaded in place from its baked copy when that is sound,
    else from its package through a private job directory; the tier is never written."""
    path = result.path
    assert path is not None
    name = copy_name(result.key, source)
    try:
        found = _sound(tier, name, result.key, package, source)
    except _Unsound as exc:
        found = None
        if "baked-copy" not in _WARNED:
            _WARNED.add("baked-copy")
            logger.warning("vllm_neuron: %s; the copy is skipped (the read-only tier %s is "
                           "left as it is): the graph loads from its package", exc, tier.url)
    directory = None if found is None else tier.local_dir_of(found)
    if directory is None:
        return _load_package(toolchain, path, package, artifact)
    try:
        return toolchain.load_unpacked(directory, artifact)
    except ToolchainError as exc:
        if isinstance(exc.__cause__, MissingOpLibrary):
            raise
        return _package_instead(toolchain, path, package, artifact, "load", str(exc))


def _package_instead(toolchain: Toolchain, path: str, package: str, artifact: CompiledArtifact,
                     step: str, why: str) -> Callable[..., Any]:  # fmt: skip
    """The package itself loaded, after its copy failed at `step`. When the package loads,
    this code could not use a good package: one warning per step and process; when it does
    not either, its error is the one raised (the entry's fault)."""
    loaded = _load_package(toolchain, path, package, artifact)
    if step not in _WARNED:
        _WARNED.add(step)
        logger.warning("vllm_neuron: %s loads from its package, not from an unpacked copy "
                       "(%s); it is unpacked into %s on every load (removed once loaded)",
                       path, why, tempfile.gettempdir())  # fmt: skip
    return loaded


def _load_package(toolchain: Toolchain, path: str, package: str,
                  artifact: CompiledArtifact) -> Callable[..., Any]:  # fmt: skip
    """The entry's `package` loaded without a copy in the tier, and without what torch's own
    loader leaves: handed a package, it unpacks it into a new ``$TMPDIR/aotinductor_*`` that
    it removes only when the model is destroyed (never, in a server). Here the members are
    unpacked into a job directory of this process (swept if the process dies mid-way),
    loaded from there and removed at once: the opened shared object needs no file.

    `toolchain.load` as it is when that cannot be: no job directory can be made, members
    that do not unpack or do not load from there. Its error is
    then the package's own (the entry's fault), unless unpacking met a full or read-only
    disk: that error is chained to it, so the entry is not blamed for this node's disk."""
    try:
        job_dir, owner = owned_job_dir(keep_free=False)  # held for a moment only
    except OSError as exc:
        return _torch_load(toolchain, path, artifact, exc)
    job, why = PreparedJob(job_dir, owner), None
    try:
        members = os.path.join(job_dir, "package")
        try:
            with zipfile.ZipFile(os.path.join(path, package)) as archive:
                archive.extractall(members)  # names outside `members` are made inside it
            return toolchain.load_unpacked(members, artifact)
        except ToolchainError as exc:
            if isinstance(exc.__cause__, MissingOpLibrary):
                raise
        except Exception as exc:  # noqa: BLE001 - no room, or the entry's fault: torch says
            why = exc
    finally:
        job.discard()  # before torch's loader unpacks its own copy into the same place
    return _torch_load(toolchain, path, artifact, why)


def _torch_load(toolchain: Toolchain, path: str, artifact: CompiledArtifact,
                unpacking: BaseException | None) -> Callable[..., Any]:  # fmt: skip
    """`toolchain.load`; when it fails after `unpacking` met a full or read-only disk, its
    error chained to that one (`runtime._entry_at_fault` then spares the entry)."""
    try:
        return toolchain.load(path, artifact)
    except ToolchainError as exc:
        where = tempfile.gettempdir()
        fault = None if unpacking is None else unwritable_cause(unpacking, where)
        if fault is None or isinstance(exc.__cause__, MissingOpLibrary):
            raise
        raise ToolchainError(f"{exc} (unpacking it first met: {fault})") from fault
