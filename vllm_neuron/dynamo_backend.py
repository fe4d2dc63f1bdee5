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
from vllm_neuron.compile.toolchains.torch_internals import resolve

BACKEND_NAME = "vllm_neuron"


def vllm_neuron_backend(
    gm: Any, example_inputs: Sequence[Any], **_options: Any
) -> Callable[..., Any]:
    """The dynamo backend: key the graph, fetch or compile it through the cache, load it."""
    return get_runtime().compile_graph(gm, list(example_inputs))


def register_backend() -> bool:
    """Register the backend with dynamo under `BACKEND_NAME` (idempotent); False when
    dynamo's registry is not laid out as expected (torch's private names, fenced: warned
    once, naming the name; ``torch.compile(backend="vllm_neuron")`` then fails with
    dynamo's unknown-backend error).

    Leaves it to dynamo when dynamo has discovered our entry point but not loaded it yet:
    that is also the state while dynamo itself is importing this module to resolve the
    entry point, and registering here would make dynamo's own registration, right after,
    fail with "duplicate name".
    """
    registry = "torch._dynamo.backends.registry"
    compiler_fns = resolve(f"{registry}._COMPILER_FNS")
    backends = resolve(f"{registry}._BACKENDS")
    register = resolve(f"{registry}.register_backend")
    if compiler_fns is None or backends is None or register is None:
        return False
    current = compiler_fns.get(BACKEND_NAME)
    if current is vllm_neuron_backend:
        return True
    if current is None and backends.get(BACKEND_NAME) is not None:
        return True  # an entry point dynamo resolves (to this very function) on first lookup
    compiler_fns.pop(BACKEND_NAME, None)
    register(compiler_fn=vllm_neuron_backend, name=BACKEND_NAME)
    return True
