"""The host-mode worker: vLLM's CPU worker plus this package's runner and warm-up hooks."""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_neuron.envs import host_mode_settings

from .hooks import ArtifactWorkerHooks

__all__ = ["NeuronHostWorker"]

logger = logging.getLogger("vllm_neuron.plugin")


class NeuronHostWorker(ArtifactWorkerHooks, CPUWorker):
    """``CPUWorker`` that publishes the snapshot forward context and emits the manifest.

    Before anything builds the model, it has vLLM build the vocab-parallel embedding whose
    piece is one graph on every tensor-parallel rank (`vocab_embedding.py`), unless
    VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING=0.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if host_mode_settings().rank_independent_embedding:
            _install_rank_independent_embedding()
        super().__init__(*args, **kwargs)


def _install_rank_independent_embedding() -> None:
    try:
        # Lazy: it imports vLLM's layer internals; a vLLM that moved them keeps its layer.
        from .vocab_embedding import install_rank_independent_embedding
    except ImportError as exc:
        logger.warning(
            "vllm_neuron: vLLM's vocab-parallel embedding is not the layer this package "
            "knows (%s): kept as is, its piece compiles once per rank", exc,
        )  # fmt: skip
        return
    install_rank_independent_embedding()
