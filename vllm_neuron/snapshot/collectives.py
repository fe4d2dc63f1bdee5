"""What a captured graph needs from the other ranks: its collectives and its group.

Why recorded at capture time: a piece that calls a collective (vLLM's all-reduce after a
row-parallel layer or the vocab-parallel embedding) cannot be replayed by one rank alone:
its call waits for, and sums with, the other ranks of the tensor-parallel group. Replay has
to know, per bundle, whether that is so (:func:`collective_ops`, read from the graph the
capturer wraps: the exported graph is often missing and the compiled artifact is opaque)
and how many ranks the group has (`vllm_neuron.identity.tensor_parallel_size`). Which
bundle of another rank is the same call is the call's position in its forward
(``context.next_forward_call``), the same on every rank even where the graph differs by
rank, as the vocab-parallel embedding's does.

On vLLM's CPU platform the all-reduce is traced as ``_C::shm_allreduce(handle, x)``: the
handle is the index of the process's shared-memory group, the tensor-parallel group's
first (0). Other platforms trace ``vllm::all_reduce(x, group_name)`` or torch's functional
collectives (``_c10d_functional::all_reduce(x, op, group)``). All of them are found here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .meta import CallMeta

__all__ = ["collective_ops", "needs_group"]

# Namespaces whose every op is a collective, and collective op names in any namespace.
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")
_COLLECTIVE_NAME = re.compile(
    r"^(shm_\w+|all_reduce\w*|allreduce\w*|all_gather\w*|reduce_scatter\w*|all_to_all\w*"
    r"|broadcast\w*|wait_tensor)$"
)


def _op_name(target: Any) -> str | None:
    """``namespace::name`` of an op overload/packet (``_C.shm_allreduce.default``), a
    ``torch.distributed`` function's dotted name, or None."""
    text = str(target)
    module = getattr(target, "__module__", None) or ""
    if module.startswith("torch.distributed") and callable(target):
        return f"torch.distributed.{getattr(target, '__name__', text)}"
    parts = text.split(".")
    if len(parts) < 2 or not all(parts):
        return None
    namespace, name = parts[0], parts[1]
    return f"{namespace}::{name}"


def collective_ops(gm: Any) -> list[str]:
    """The collective ops ``gm``'s graph calls, sorted, each once (``[]``: none)."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return []
    found: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
        if name is None:
            continue
        if name.startswith("torch.distributed."):
            found.add(name)
            continue
        namespace, _, op = name.partition("::")
        if namespace in _COLLECTIVE_NAMESPACES or _COLLECTIVE_NAME.match(op):
            found.add(name)
    return sorted(found)


def needs_group(meta: CallMeta) -> bool:
    """Whether ``meta``'s call can only be replayed together with its other ranks: its graph
    calls a collective, or (a bundle that does not record its collectives) its group has
    more than one rank."""
    if meta.collectives:
        return meta.tp_size > 1
    return meta.collectives is None and meta.tp_size > 1
