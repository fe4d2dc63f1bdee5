"""The record phase: a compile-runtime listener that writes one ledger line per graph.

Installed only when VLLM_NEURON_MANIFEST_DIR is set, so with the feature off compilation
does no manifest work at all. It listens on the runtime's capture path, which both
toolchains share.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .ledger import LedgerWriter, input_shapes_of

if TYPE_CHECKING:
    from vllm_neuron.compile.runtime import CompiledGraph, CompileRuntime


def current_ranks() -> tuple[int, int | None]:
    """(TP-group-relative rank, global rank) of this process, as far as it can be known.

    Inside vLLM the TP group says; under torch.distributed alone the TP group is the world;
    otherwise the launcher's RANK variable, or 0 for a single process.
    """
    global_rank: int | None = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            global_rank = int(dist.get_rank())
    except Exception:  # noqa: BLE001 - torch may be absent or half-initialised
        global_rank = None
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group), global_rank
    except Exception:  # noqa: BLE001 - not inside vLLM, or its groups are not set up
        pass
    if global_rank is not None:
        return global_rank, global_rank
    rank = int(os.environ.get("RANK", "0") or 0) if os.environ.get("RANK", "").isdigit() else 0
    return rank, None


class ManifestRecorder:
    """Appends `{key, rank, input_shapes, compiler_flags}` for every graph captured."""

    def __init__(self, writer: LedgerWriter) -> None:
        self.writer = writer

    def __call__(self, graph: CompiledGraph) -> None:
        tp_rank, global_rank = current_ranks()
        self.writer.record(
            graph.key,
            rank=tp_rank,
            global_rank=global_rank,
            input_shapes=input_shapes_of(graph.example_inputs),
            compiler_flags=graph.compiler_flags,
        )


def install_recorder(runtime: CompileRuntime, manifest_dir: str | None) -> ManifestRecorder | None:
    """Listen on `runtime` when the feature is on (`manifest_dir` set); else do nothing."""
    if not manifest_dir:
        return None
    recorder = ManifestRecorder(LedgerWriter(manifest_dir))
    runtime.add_listener(recorder)
    return recorder
