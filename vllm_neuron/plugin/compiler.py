"""vLLM's ``CompilerInterface`` for this package: every piecewise graph goes through the cache.

vLLM splits the model at its attention ops and hands each piece to the platform's compiler
(``get_compile_backend()``). :class:`NeuronCompilerAdaptor` sends each one to the process's
:class:`~vllm_neuron.compile.runtime.CompileRuntime`: key the graph, get its artifact from
the local tier, the remote tier or a compile, load it, and let the listeners (manifest
ledger) and wrappers (snapshot capture) see it.

vLLM keeps its own per-model cache of *handles*: ``compile()`` returns
``(callable, handle)`` and on a warm restart vLLM calls ``load(handle, graph, ...)`` instead.
The handle is ``(cache_key, toolchain)``, two strings as vLLM's cache file requires (vLLM
reads it back with ``ast.literal_eval``). ``load()`` recomputes the key from the graph it is
given and fetches through the same two-tier cache: a warm restart is a local hit, and a handle
left by another version of the graph cannot load a stale artifact. (vLLM's own AOT
artifact, which would skip both calls, is turned off in host mode by the general plugin.)

Each compile or load names the piece it is (vLLM's model tag, compile range and subgraph
index) to the manifest recorder, so the manifest can tell which graphs are variants of one
piece (docs/manifest.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from vllm_neuron.assembly import get_runtime
from vllm_neuron.compile.key.cache_key import KEY_SCHEMA_VERSION
from vllm_neuron.manifest.recorder import tracing_piece
from vllm_neuron.manifest.schema import Piece
from vllm_neuron.version import __version__
from vllm_neuron.vllm_internals import require

__all__ = ["NeuronCompilerAdaptor"]

logger = logging.getLogger("vllm_neuron.plugin")


# Named by the host platform only when it is as fenced (platform.adaptor_usable).
CompilerInterface: Any = require("vllm.compilation.compiler_interface.CompilerInterface")

_SUBGRAPH = re.compile(r"_subgraph_(\d+)$")


def piece_of(model: str, compile_range: Any, graph_index: int | None) -> Piece | None:
    """The piece vLLM is compiling: its model tag, compile range (``Range``: ``start`` and
    ``end``; an int is a single size) and subgraph index; None when vLLM did not say."""
    start, end = getattr(compile_range, "start", compile_range), getattr(
        compile_range, "end", compile_range)
    if graph_index is None or not isinstance(start, int) or not isinstance(end, int):
        return None
    return Piece(model=model, start=start, end=end, subgraph=graph_index)


def _toolchain_id() -> str:
    toolchain = get_runtime().toolchain
    return f"vllm_neuron/{toolchain.name}/{toolchain.target}"


class NeuronCompilerAdaptor(CompilerInterface):
    """Compiles and loads vLLM's piecewise graphs through this package's two-tier cache."""

    name = "vllm_neuron"

    def __init__(self) -> None:
        self.cache_dir: str | None = None
        self.prefix = ""
        self.calls = 0
        self.engine = ""  # vLLM's configuration hash (`compute_hash`): whose pieces these are

    def initialize_cache(
        self, cache_dir: str, disable_cache: bool = False, prefix: str = ""
    ) -> None:
        # vLLM's directory holds only its handle file; the artifacts live in this
        # package's cache, whose location is VLLM_CACHE_ROOT/neuron/compile_cache.
        self.cache_dir = cache_dir
        self.prefix = prefix

    def compute_hash(self, vllm_config: Any) -> str:
        """What decides this compiler's output beyond vLLM's own hash: package, key schema,
        toolchain, target, versions and flags (part of vLLM's cache directory name)."""
        try:
            # vLLM's own configuration hash (the same on every rank; vLLM names its cache
            # directory by it): a piece's name is only unique within one configuration.
            self.engine = str(vllm_config.compute_hash())[:10]
        except Exception:  # noqa: BLE001 - only the stats' grouping of pieces needs it
            self.engine = ""
        toolchain = get_runtime().toolchain
        material = {
            "package": __version__,
            "key_schema": KEY_SCHEMA_VERSION,
            "toolchain": toolchain.name,
            "target": toolchain.target,
            "versions": toolchain.versions(),
            "flags": toolchain.compiler_args(),
        }
        blob = json.dumps(material, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:10]

    def _through_cache(self, what: str, graph: Any, example_inputs: list[Any],
                       label: str, piece: Piece | None) -> tuple[Callable[..., Any], str]:
        self.calls += 1
        # The recorder reads the structured piece from the context; the cache's events get
        # its label, and the engine configuration's, so `cache stats` can count per-rank
        # variants without the manifest, and never takes another model's piece for one.
        named = None
        if piece is not None:
            named = piece.label() + (f" of engine {self.engine}" if self.engine else "")
        with tracing_piece(piece):
            fn, compiled = get_runtime().compile(graph, example_inputs, piece=named)
        result = getattr(compiled, "result", None)  # None: deferred to its first call
        if result is None:
            logger.info("vllm_neuron: vLLM %s() %s -> graph %s from deferred in 0.00 s "
                        "(another process compiles it, or no compile slot was free: loaded "
                        "at its first call)", what, label, compiled.key)
        else:
            logger.info("vllm_neuron: vLLM %s() %s -> graph %s from %s in %.2f s",
                        what, label, compiled.key, result.source, result.seconds)
        return fn, compiled.key

    def compile(
        self,
        graph: Any,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        compile_range: Any,
        key: str | None = None,
    ) -> tuple[Callable[..., Any] | None, Any | None]:
        label = f"{self.prefix + ' ' if self.prefix else ''}{key or ''} range {compile_range}"
        # vLLM names the subgraph only in the key: artifact_compile_range_<s>_<e>_subgraph_<i>
        index = _SUBGRAPH.search(key or "")
        piece = piece_of(self.prefix, compile_range, int(index.group(1)) if index else None)
        fn, cache_key = self._through_cache("compile", graph, example_inputs, label.strip(),
                                            piece)
        return fn, (cache_key, _toolchain_id())

    def load(
        self,
        handle: Any,
        graph: Any,
        example_inputs: list[Any],
        graph_index: int,
        compile_range: Any,
    ) -> Callable[..., Any]:
        if not (
            isinstance(handle, tuple)
            and len(handle) == 2
            and all(isinstance(h, str) for h in handle)
        ):
            raise ValueError(f"vllm_neuron: not a handle of this compiler: {handle!r}")
        handle_key, toolchain = handle
        current = _toolchain_id()
        if toolchain != current:
            raise ValueError(
                f"vllm_neuron: handle {handle!r} was made by {toolchain}, this process "
                f"compiles with {current}"
            )
        label = f"{self.prefix + ' ' if self.prefix else ''}subgraph {graph_index} " \
                f"range {compile_range}"
        fn, cache_key = self._through_cache("load", graph, example_inputs, label.strip(),
                                            piece_of(self.prefix, compile_range, graph_index))
        if cache_key != handle_key:
            logger.warning(
                "vllm_neuron: vLLM's handle names graph %s but the graph it passed is %s; "
                "used %s", handle_key, cache_key, cache_key,
            )
        return fn
