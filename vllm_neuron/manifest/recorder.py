"""The record phase: a compile-runtime listener that writes one ledger line per graph.

Installed only when VLLM_NEURON_MANIFEST_DIR is set, so with the feature off compilation
does no manifest work at all. It listens on the runtime's capture path, which both
toolchains share.

The runtime's event says which graph was compiled, not which piece of the model it is: that
only vLLM's compiler adaptor knows. The adaptor names it for the duration of the compile
(`tracing_piece`), and the recorder, called by the runtime in the same thread and context,
writes it on the line. A compile outside vLLM names no piece.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm_neuron.envs import run_id
from vllm_neuron.identity import detect_ranks

from .ledger import LedgerWriter, input_shapes_of
from .schema import Piece

if TYPE_CHECKING:
    from vllm_neuron.compile.runtime import CompileRuntime, TracedGraph


def current_ranks() -> tuple[int, int]:
    """(TP-group-relative rank, global rank) of this process (see `detect_ranks`)."""
    ranks = detect_ranks()
    return ranks.tp_rank, ranks.global_rank


_PIECE: contextvars.ContextVar[Piece | None] = contextvars.ContextVar(
    "vllm_neuron_manifest_piece", default=None
)


@contextlib.contextmanager
def tracing_piece(piece: Piece | None) -> Iterator[None]:
    """Name the piece every graph compiled inside the block is (vLLM's compiler adaptor
    wraps each compile or load in it); a context variable, so threads never mix pieces."""
    token = _PIECE.set(piece)
    try:
        yield
    finally:
        _PIECE.reset(token)


def current_piece() -> Piece | None:
    """The piece named by the innermost `tracing_piece`, or None."""
    return _PIECE.get()


class ManifestRecorder:
    """Appends `{key, rank, input_shapes, compiler_flags, piece}` for every graph captured."""

    def __init__(self, writer: LedgerWriter) -> None:
        self.writer = writer

    def __call__(self, graph: TracedGraph) -> None:
        tp_rank, global_rank = current_ranks()
        self.writer.record(
            graph.key,
            rank=tp_rank,
            global_rank=global_rank,
            input_shapes=input_shapes_of(graph.example_inputs),
            compiler_flags=graph.compiler_flags,
            piece=_PIECE.get(),
        )


def install_recorder(runtime: CompileRuntime, manifest_dir: str | None) -> ManifestRecorder | None:
    """Listen on `runtime` when the feature is on (`manifest_dir` set); else do nothing.

    Also fixes this process's run id (see `vllm_neuron.envs.run_id`) before anything is
    compiled, so the compile workers it starts inherit it, and a malformed
    VLLM_NEURON_RUN_ID stops the compile naming it instead of losing every ledger line.
    """
    if not manifest_dir:
        return None
    run_id()
    recorder = ManifestRecorder(LedgerWriter(manifest_dir))
    runtime.add_listener(recorder)
    return recorder
