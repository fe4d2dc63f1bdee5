"""The host-mode worker: vLLM's CPU worker plus this package's runner and warm-up hooks."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_neuron.envs import host_mode_settings

from .hooks import ArtifactWorkerHooks
from .vocab_embedding import install_rank_independent_embedding

__all__ = ["NeuronHostWorker"]


class NeuronHostWorker(ArtifactWorkerHooks, CPUWorker):
    """``CPUWorker`` that publishes the snapshot forward context and emits the manifest.

    Before anything builds the model, it has vLLM build the vocab-parallel embedding whose
    piece is one graph on every tensor-parallel rank (`vocab_embedding.py`), unless
    VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING=0.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if host_mode_settings().rank_independent_embedding:
            install_rank_independent_embedding()
        super().__init__(*args, **kwargs)
