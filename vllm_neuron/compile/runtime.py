"""The compile runtime: toolchain + two-tier cache, and the hooks features plug into.

`torch.compile(backend="vllm_neuron")` and vLLM's compiler adapter both come here: key
the graph, get its artifacts through the two-tier cache, load them, and tell whoever
listens what was compiled. Who listens is not this package's business: the assembly
(`vllm_neuron.assembly`) builds the process's runtime and plugs the features in
(the manifest recorder as a listener, the snapshot capturer as a wrapper).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .cache import CacheResult, TwoTierCache
from .tier_health import unwritable_cause
from .toolchains.base import (
    ARTIFACTS,
    CompiledArtifact,
    Toolchain,
    ToolchainError,
    ToolchainUnavailable,
)
from .toolchains.op_libraries import MissingOpLibrary

logger = logging.getLogger("vllm_neuron.compile")


@dataclass(frozen=True)
class CompiledGraph:
    """What one `compile_graph` call produced, for listeners."""

    key: str
    components: dict[str, str]
    result: CacheResult
    artifact: CompiledArtifact
    gm: Any
    example_inputs: Sequence[Any]
    compiler_flags: list[str]
    toolchain: Toolchain
    piece: str | None = None  # the piece of the model it is, when the caller named one


GraphListener = Callable[[CompiledGraph], None]
ExecutableWrapper = Callable[[CompiledGraph, Callable[..., Any]], Callable[..., Any]]
"""Wraps a loaded executable (e.g. the snapshot capturer around each forward)."""


class CompileRuntime:
    """Keys, caches, loads; one per process (see `get_runtime`)."""

    def __init__(
        self,
        cache: TwoTierCache,
        toolchain: Toolchain,
        *,
        replica_groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.cache = cache
        self.toolchain = toolchain
        self.replica_groups = replica_groups
        self._listeners: list[GraphListener] = []
        self._wrappers: list[ExecutableWrapper] = []
        self.history: list[CompiledGraph] = []

    def add_listener(self, listener: GraphListener) -> None:
        """Call `listener` after every graph is compiled or loaded (best-effort)."""
        self._listeners.append(listener)

    def add_wrapper(self, wrapper: ExecutableWrapper) -> None:
        """Wrap every executable loaded from now on with `wrapper(graph, fn) -> fn`.

        Wrappers are how per-forward features (snapshot capture) sit on the execute path
        without the toolchains knowing about them; with none installed the loaded
        callable is returned as is, so a disabled feature costs nothing per forward.
        """
        self._wrappers.append(wrapper)

    def compile_graph(self, gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Artifacts for `gm` from the cache (compiling on a miss), loaded as a callable."""
        return self.compile(gm, example_inputs)[0]

    def compile(
        self, gm: Any, example_inputs: Sequence[Any], *, piece: str | None = None
    ) -> tuple[Callable[..., Any], CompiledGraph]:
        """`compile_graph`, plus the record of what happened (key, cache source, artifact).

        `piece` is the piece of the model the graph is, as the command line names it
        (vLLM's compiler adaptor passes ``Piece.label()``; this layer knows no manifest): it
        goes on the cache's compile events, so `cache stats` can count what tensor
        parallelism cost (a piece compiled to several keys), and on the `CompiledGraph`."""
        from .key import compute_cache_key  # lazy: imports torch.fx, only when compiling

        toolchain = self.toolchain
        flags = toolchain.compiler_args()
        key = compute_cache_key(
            gm,
            example_inputs,
            toolchain_versions=toolchain.versions(),
            compiler_args=flags,
            target=toolchain.target,
            replica_groups=self.replica_groups,
        )

        def compile_into(out_dir: str) -> dict[str, Any]:
            artifact = toolchain.compile(gm, example_inputs, out_dir)
            meta: dict[str, Any] = msgspec.to_builtins(artifact)
            # What the key was made of (cache explain); readers of the artifact ignore it.
            meta["key_inputs"] = msgspec.to_builtins(key.inputs)
            return meta

        result = self.cache.get_or_compile(key.key, compile_into, components=key.components,
                                           piece=piece)
        try:
            artifact, compiled = self._load(result)
        except ToolchainError as exc:
            if not _entry_at_fault(result, exc):
                raise
            # An entry that verified but will not load (another build of a library, a
            # truncated artifact with the right checksum...): healed, never fatal.
            _warn_once(f"vllm_neuron: compile cache entry {key.key} ({result.source}) does not "
                       f"load here ({exc}); withdrawn, compiling the graph again")  # fmt: skip
            result = self.cache.heal_unloadable(result, str(exc), compile_into,
                                                components=key.components, piece=piece)
            artifact, compiled = self._load(result)
        event = CompiledGraph(
            key=key.key,
            components=dict(key.components),
            result=result,
            artifact=artifact,
            gm=gm,
            example_inputs=example_inputs,
            compiler_flags=flags,
            toolchain=toolchain,
            piece=piece,
        )
        self.history.append(event)
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception as exc:  # noqa: BLE001 - listeners are best-effort features
                logger.warning("vllm_neuron: graph listener %r failed: %s", listener, exc)
        for wrapper in self._wrappers:
            compiled = wrapper(event, compiled)
        return compiled, event

    def _load(self, result: CacheResult) -> tuple[CompiledArtifact, Callable[..., Any]]:
        artifact = ARTIFACTS.convert(
            result.record.meta, source=f"{self.cache.local_dir}/{result.key}/entry.json meta"
        )
        if result.path is None:
            raise RuntimeError(
                f"the local compile cache {self.cache.local_dir} is not on local disk; "
                "compiled artifacts can only be loaded from a local directory"
            )
        return artifact, self.toolchain.load(result.path, artifact)


def _entry_at_fault(result: CacheResult, exc: ToolchainError) -> bool:
    """Whether a load failure is the entry's (healed by compiling again) rather than this
    process's: a graph compiled just now, a toolchain or kernel library this Python lacks,
    or a full or read-only disk where the loader unpacks are raised as they are."""
    if result.source in ("compiled", "uncached") or isinstance(exc, ToolchainUnavailable):
        return False
    return not isinstance(exc.__cause__, MissingOpLibrary) and unwritable_cause(exc) is None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)
