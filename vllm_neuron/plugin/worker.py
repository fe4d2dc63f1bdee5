"""The host-mode worker: vLLM's CPU worker plus this package's runner and warm-up hooks."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from .hooks import ArtifactWorkerHooks

__all__ = ["NeuronHostWorker"]


class NeuronHostWorker(ArtifactWorkerHooks, CPUWorker):
    """``CPUWorker`` that publishes the snapshot forward context and emits the manifest."""
