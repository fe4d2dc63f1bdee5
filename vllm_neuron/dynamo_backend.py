"""`torch.compile(model, backend="vllm_neuron")`.

Registered by name when `vllm_neuron` is imported with torch loaded (and by vLLM's
general plugin), and through the ``torch_dynamo_backends`` entry point, so an installed
package works without an import. Every graph dynamo hands over goes through the
process's `CompileRuntime`, built by the assembly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm_neuron.assembly import get_runtime

BACKEND_NAME = "vllm_neuron"


def vllm_neuron_backend(
    gm: Any, example_inputs: Sequence[Any], **_options: Any
) -> Callable[..., Any]:
    """The dynamo backend: key the graph, fetch or compile it through the cache, load it."""
    return get_runtime().compile_graph(gm, list(example_inputs))


def register_backend() -> None:
    """Register the backend with dynamo under `BACKEND_NAME` (idempotent).

    Leaves it to dynamo when dynamo has discovered our entry point but not loaded it yet:
    that is also the state while dynamo itself is importing this module to resolve the
    entry point, and registering here would make dynamo's own registration, right after,
    fail with "duplicate name".
    """
    # Lazy: torch is heavy and optional; only this path needs it.
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    current = _COMPILER_FNS.get(BACKEND_NAME)
    if current is vllm_neuron_backend:
        return
    if current is None and _BACKENDS.get(BACKEND_NAME) is not None:
        return  # an entry point dynamo resolves (to this very function) on first lookup
    _COMPILER_FNS.pop(BACKEND_NAME, None)
    register_backend(compiler_fn=vllm_neuron_backend, name=BACKEND_NAME)
