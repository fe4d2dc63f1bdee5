"""What runs a bundle's graph on replay: the compile-cache entry or the exported graph.

Why two runners: a bundle names its graph by compilation hash, and the artifact behind that
hash may or may not be runnable where the replay happens.

- ``cache``: the compile-cache entry named by the bundle's hash, loaded with the host
  toolchain (TorchInductor) - the same artifact, re-run on the host;
- ``eager``: the graph the capturer exported once per hash (``<hash>/graph.pt2``,
  ``torch.export``), run by PyTorch eagerly - the reference semantics, and the only option
  for a NEFF captured on Trainium and replayed on a laptop.

``auto`` takes the cache entry when it exists and the host can load it, else the graph.
A graph traced inside vLLM calls vLLM's CPU kernels; their library is loaded on demand.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from vllm_neuron.backends import join, local_root_missing, open_store
from vllm_neuron.compile.entry.outcomes import CacheResult
from vllm_neuron.compile.entry.record import read_record
from vllm_neuron.compile.tiers.health import LocalTierUnusable
from vllm_neuron.compile.tiers.location import trusted_local_tier_dir
from vllm_neuron.compile.tiers.unpacked import load_entry
from vllm_neuron.compile.toolchains.base import ARTIFACTS
from vllm_neuron.compile.toolchains.op_libraries import load_for_missing_schema
from vllm_neuron.compile.toolchains.select import select_toolchain

from .bundles import Bundle, ReplayError
from .meta import GRAPH_FILE

__all__ = ["RUNNERS", "resolve_runner"]

RUNNERS = ("auto", "cache", "eager")


def _cache_runner(compilation_hash: str, cache_dir: str | None) -> Callable[..., Any]:
    if cache_dir is None:
        try:  # what this process will load from: never a fallback another user made
            cache_dir = trusted_local_tier_dir()
        except LocalTierUnusable as exc:
            raise ReplayError(str(exc)) from None
    if local_root_missing(cache_dir):
        raise ReplayError(f"no compile cache at {cache_dir}")
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
    data = bundle.store.read(key)
    if data is None:
        raise ReplayError(
            f"no exported graph {key} next to {bundle.location} (the capture could not save "
            "it); replay with the compile-cache runner instead"
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

    try:
        return torch.export.load(io.BytesIO(data))
    except Exception as exc:
        if not load_for_missing_schema(exc, what):
            raise
    return torch.export.load(io.BytesIO(data))


def resolve_runner(
    bundle: Bundle, runner: str = "auto", cache_dir: str | None = None
) -> tuple[str, Callable[..., Any]]:
    """(runner name, callable) for ``bundle``; see the module docstring for the choice."""
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}; use one of {', '.join(RUNNERS)}")
    if runner == "cache":
        return "cache", _cache_runner(bundle.meta.compilation_hash, cache_dir)
    if runner == "eager":
        return "eager", _eager_runner(bundle)
    try:
        return "cache", _cache_runner(bundle.meta.compilation_hash, cache_dir)
    except Exception as cache_exc:  # noqa: BLE001 - fall back to the exported graph
        try:
            return "eager", _eager_runner(bundle)
        except ReplayError as eager_exc:
            raise ReplayError(f"{cache_exc}; and {eager_exc}") from eager_exc
