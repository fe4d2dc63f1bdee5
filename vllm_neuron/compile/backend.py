"""`torch.compile(model, backend="vllm_neuron")`.

Registered by name when `vllm_neuron.compile` is imported, and through the
``torch_dynamo_backends`` entry point, so an installed package works without an import.
Every graph dynamo hands over goes through the process's `CompileRuntime`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

BACKEND_NAME = "vllm_neuron"


def vllm_neuron_backend(gm: Any, example_inputs: Sequence[Any], **_options: Any) -> Callable[..., Any]:
    """The dynamo backend: key the graph, fetch or compile it through the cache, load it."""
    from .runtime import get_runtime

    return get_runtime().compile_graph(gm, list(example_inputs))


def register_backend() -> None:
    """Register the backend with dynamo under `BACKEND_NAME` (idempotent)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get(BACKEND_NAME) is not vllm_neuron_backend:
        _COMPILER_FNS.pop(BACKEND_NAME, None)
        register_backend(compiler_fn=vllm_neuron_backend, name=BACKEND_NAME)
