"""What runs a bundle's graph on replay: the compile-cache entry or the exported graph.

Why two runners: a bundle names its graph by compilation hash, and the artifact behind that
hash may or may not be runnable where the replay happens.

- ``cache``: the compile-cache entry named by the bundle's hash, loaded with the host
  toolchain (TorchInductor) - the same artifact, re-run on the host;
- ``eager``: the graph the capturer exported once per hash (``<hash>/graph.pt2``,
  ``torch.export``), run by PyTorch eagerly - the reference semantics, and the only option
  for a NEFF captured on Trainium and replayed on a laptop.

``auto`` takes the cache entry when it exists and the host can load it, else the graph, and
says why the cache entry could not run (the report's ``runner_note``). A graph traced inside
vLLM calls vLLM's CPU kernels; their library is loaded on demand.

A compile cache named by a manifest (rather than by ``--cache-dir``) is loaded only when it
is this user's own (owned by them, writable by no one else): loading an entry runs its
native code, and a manifest is a file that travels.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm_neuron.backends import join, local_root_missing, open_store
from vllm_neuron.compile.entry.outcomes import CacheResult
from vllm_neuron.compile.entry.record import read_record
from vllm_neuron.compile.entry.text import printable
from vllm_neuron.compile.tiers.health import LocalTierUnusable, not_own_tier
from vllm_neuron.compile.tiers.location import trusted_local_tier_dir
from vllm_neuron.compile.tiers.unpacked import load_entry
from vllm_neuron.compile.toolchains.base import ARTIFACTS
from vllm_neuron.compile.toolchains.op_libraries import load_for_missing_schema, load_namespaces
from vllm_neuron.compile.toolchains.select import select_toolchain

from .bundles import Bundle, ReplayError
from .meta import GRAPH_FILE

__all__ = ["RUNNERS", "CacheChoice", "ResolvedRunner", "resolve_runner"]

RUNNERS = ("auto", "cache", "eager")


@dataclass(frozen=True)
class CacheChoice:
    """Which compile cache the cache runner loads from, and who named it: ``--cache-dir``
    (``"option"``), a manifest (``"manifest"``: only this user's own is loaded), or None
    for this process's own local tier."""

    path: str | None = None
    named_by: str = "option"


@dataclass(frozen=True)
class ResolvedRunner:
    """The runner that will run a bundle: its name, the callable, and with ``auto`` why the
    cache entry was not used when the graph runs instead (None otherwise)."""

    name: str
    fn: Callable[..., Any]
    note: str | None = None


def _cache_dir(choice: CacheChoice | str | None) -> str:
    if not isinstance(choice, CacheChoice):
        choice = CacheChoice(choice)
    if choice.path is None:
        try:  # what this process will load from: never a fallback another user made
            return trusted_local_tier_dir()
        except LocalTierUnusable as exc:
            raise ReplayError(str(exc)) from None
    if local_root_missing(choice.path):
        raise ReplayError(f"no compile cache at {choice.path}")
    if choice.named_by == "manifest" and (problem := not_own_tier(choice.path)) is not None:
        raise ReplayError(
            f"the compile cache the manifest names ({choice.path}) is not this user's own "
            f"({problem}), so nothing is loaded from it; pass --cache-dir to load from a "
            "cache you trust")  # fmt: skip
    return choice.path


def _cache_runner(compilation_hash: str, choice: CacheChoice | str | None) -> Callable[..., Any]:
    cache_dir = _cache_dir(choice)
    store = open_store(cache_dir, create=False)
    content = store.published(compilation_hash)
    if content is None:
        raise ReplayError(f"the compile cache {cache_dir} has no entry {compilation_hash}")
    entry_dir = store.local_dir_of(content)  # the documented door for loading an entry
    if entry_dir is None:
        raise ReplayError(f"the compile cache {cache_dir} is not on local disk")
    record = read_record(store, content)
    artifact = ARTIFACTS.convert(record.meta, source=f"{cache_dir}/{content} meta")
    toolchain = select_toolchain("host")
    if artifact.toolchain != toolchain.name:
        raise ReplayError(
            f"entry {compilation_hash} was built by the {artifact.toolchain} toolchain "
            f"({artifact.target}); the host cannot run it - use the eager runner"
        )
    # As a serving process loads it (compile/tiers/unpacked.py): from the verified unpacked copy
    # of its package, never leaving a directory of torch's in $TMPDIR per replay.
    result = CacheResult(compilation_hash, entry_dir, record, "local", 0.0, content)
    return load_entry(toolchain, store, result, artifact)


def _eager_runner(bundle: Bundle) -> Callable[..., Any]:
    key = bundle.meta.graph or join(bundle.meta.compilation_hash, GRAPH_FILE)
    if bundle.meta.graph is None and bundle.meta.graph_error is not None:
        raise ReplayError(
            f"the capture could not save the graph of {bundle.location} for the eager "
            f"runner: {printable(bundle.meta.graph_error)}; replay it with the compile-cache "
            "runner")
    data = bundle.store.read(key)
    if data is None:
        raise ReplayError(
            f"no exported graph {key} next to {bundle.location} (the capture could not save "
            "it, or it was removed since); replay with the compile-cache runner instead"
        )
    try:
        program = _load_exported(data, f"the exported graph {key}")
    except Exception as exc:  # MissingOpLibrary says which kernel library and how to get it
        raise ReplayError(f"cannot load the exported graph {key}: {exc}") from exc
    module = program.module()

    def run(*args: Any) -> Any:
        return module(*args)

    return run


def _load_exported(data: bytes, what: str) -> Any:
    """``torch.export.load``, loading the kernel library the graph calls when it is missing
    (a graph traced inside vLLM calls vLLM's CPU kernels)."""
    import torch  # heavy optional dependency: only when an exported graph is run

    load_namespaces(_archive_namespaces(data), what)
    try:
        with _quiet_torch_export():
            return torch.export.load(io.BytesIO(data))
    except Exception as exc:
        if not load_for_missing_schema(exc, what):
            raise
    return torch.export.load(io.BytesIO(data))


PROGRAM_JSON_MAX = 256 << 20  # bytes of an archive's program description read for its ops


def _archive_namespaces(data: bytes) -> set[str]:
    """The ``torch.ops`` namespaces the exported program in ``data`` calls, read from its
    description (``models/*.json`` in the archive), so their kernel libraries are loaded
    before torch reads it: torch's reader does not say which op it could not resolve. An
    archive this cannot read yields none (torch's own error then stands)."""
    found: set[str] = set()
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                if "/models/" in f"/{info.filename}" and info.filename.endswith(".json") and (
                        info.file_size <= PROGRAM_JSON_MAX):
                    text = archive.read(info)[:PROGRAM_JSON_MAX]
                    found.update(m.decode() for m in _OP_NAMESPACE.findall(text))
    except (zipfile.BadZipFile, OSError, ValueError):
        return set()
    return found


_OP_NAMESPACE = re.compile(rb"torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.")


@contextlib.contextmanager
def _quiet_torch_export() -> Iterator[None]:
    """torch.export.load logs a traceback before it raises (a kernel library not loaded
    yet); the failure is ours to report, once, with the fix, so its warning is held back."""
    torch_export = logging.getLogger("torch.export")
    level = torch_export.level
    torch_export.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_export.setLevel(level)


def resolve_runner(
    bundle: Bundle, runner: str = "auto", cache_dir: CacheChoice | str | None = None
) -> ResolvedRunner:
    """The runner for ``bundle``; see the module docstring for the choice."""
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}; use one of {', '.join(RUNNERS)}")
    if runner == "cache":
        return ResolvedRunner("cache", _cache_runner(bundle.meta.compilation_hash, cache_dir))
    if runner == "eager":
        return ResolvedRunner("eager", _eager_runner(bundle))
    try:
        return ResolvedRunner("cache", _cache_runner(bundle.meta.compilation_hash, cache_dir))
    except Exception as cache_exc:  # noqa: BLE001 - fall back to the exported graph
        try:
            fn = _eager_runner(bundle)
        except ReplayError as eager_exc:
            raise ReplayError(f"{cache_exc}; and {eager_exc}") from eager_exc
        return ResolvedRunner("eager", fn, note=f"the cache runner cannot run here: {cache_exc}")
