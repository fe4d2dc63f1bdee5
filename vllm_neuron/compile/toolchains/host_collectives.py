"""Collectives in host artifacts: called through Python, so the GIL is free while they run.

Why: a tensor-parallel piece traced where vLLM's CPU platform has no shared-memory
all-reduce (its AVX2 kernel library) calls torch's functional collectives on a gloo group
(``_c10d_functional::all_reduce`` + ``wait_tensor``). Compiled by AOTInductor, that call
goes from the package's C++ straight into ``ProcessGroupGloo::enqueue`` while the calling
thread still holds the GIL (the package runner is called from Python and never lets it
go). Gloo's worker thread, meanwhile, drops the previous call's finished work under its
queue lock; when that work holds a tensor Python also holds (the previous piece's output,
handed to vLLM), the drop needs the GIL. Main thread: GIL held, waiting for the queue lock;
worker: queue lock held, waiting for the GIL. A warm TP=2 server hung so, on its first
decode, in about one start of three; a loop of such calls hangs within seconds
(tests/compile/toolchains/test_host_collectives.py).

Inductor's own Python wrapper never hits it: every op it calls from Python releases the
GIL. So the host toolchain makes its artifacts do the same: before export, every functional
collective of the graph (with the ``wait_tensor`` that completes it) is replaced by one op
of this module's ``vllm_neuron`` library, whose kernel is Python calling the same
collective and waiting for it. AOTInductor calls such an op through its proxy executor;
the collective then runs behind a Python call and the GIL is released for its duration,
as in eager vLLM. The group is still resolved by the name the graph was traced with, in the
loading process, as torch's own collectives resolve it.

A functional collective this module does not route (coalesced, point-to-point) is refused
at compile time, naming it: a compile error is better than a server that hangs.
"""

from __future__ import annotations

from typing import Any

from vllm_neuron.compile.toolchains.torch_internals import resolve

__all__ = [
    "LIBRARY",
    "calls_functional_collectives",
    "register_collective_ops",
    "route_collectives",
]

LIBRARY = "vllm_neuron"
_FUNCTIONAL = "_c10d_functional"

# torch's functional collective -> (our op's schema, output shape from the input's).
_SCHEMAS = {
    "all_reduce": "all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor",
    "all_gather_into_tensor": (
        "all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor"
    ),
    "reduce_scatter_tensor": (
        "reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name)"
        " -> Tensor"
    ),
    "all_to_all_single": (
        "all_to_all_single(Tensor input, SymInt[] output_split_sizes, "
        "SymInt[] input_split_sizes, str group_name) -> Tensor"
    ),
    "broadcast": "broadcast(Tensor input, int src, str group_name) -> Tensor",
}
# In-place variants: the same collective, its result copied back into the input.
_IN_PLACE = {"all_reduce_": "all_reduce", "broadcast_": "broadcast"}

_registered: Any = None  # the torch.library.Library, kept alive for the process


def _fake_output(name: str, x: Any, args: tuple[Any, ...]) -> Any:
    rows = x.shape[0] if x.dim() else None
    if name == "all_gather_into_tensor":
        return x.new_empty((rows * args[0], *x.shape[1:]))
    if name == "reduce_scatter_tensor":
        return x.new_empty((rows // args[1], *x.shape[1:]))
    if name == "all_to_all_single":
        return x.new_empty((sum(args[0]), *x.shape[1:]))
    return x.new_empty(x.shape)


def register_collective_ops() -> None:
    """Define the ``vllm_neuron`` collective ops in this process (idempotent): needed where
    a host graph with collectives is exported, and wherever its artifact is loaded."""
    global _registered
    if _registered is not None:
        return
    # Lazy: torch is heavy and optional; only the host toolchain needs it.
    import torch

    functional = getattr(torch.ops, _FUNCTIONAL)
    library = torch.library.Library(LIBRARY, "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        library.define(schema)
        collective = getattr(functional, name).default

        def kernel(x: Any, *args: Any, _collective: Any = collective) -> Any:
            # Called from Python, so the dispatcher releases the GIL while gloo enqueues
            # and while this thread waits: the module docstring's deadlock cannot form.
            return functional.wait_tensor.default(_collective(x, *args))

        def fake(x: Any, *args: Any, _name: str = name) -> Any:
            return _fake_output(_name, x, args)

        library.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{LIBRARY}::{name}", fake, lib=library)
    _registered = library


def _op_of(target: Any, namespace: str) -> str | None:
    """``all_reduce`` for ``torch.ops.<namespace>.all_reduce`` (the packet or an overload,
    as a traced graph may hold either), else None."""
    ops = _op_classes()
    if not ops or not isinstance(target, ops):
        return None
    parts = str(target).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == namespace else None


def _op_classes() -> tuple[type, ...]:
    """torch's operator classes a traced graph's collectives are (``torch._ops``, fenced:
    without them no collective is recognised, and the host key says unknown)."""
    found = (resolve("torch._ops.OpOverload"), resolve("torch._ops.OpOverloadPacket"))
    return tuple(c for c in found if c is not None)


def _functional_name(target: Any) -> str | None:
    return _op_of(target, _FUNCTIONAL)


def calls_functional_collectives(gm: Any) -> bool:
    """Whether ``gm``'s graph calls one of torch's functional collectives."""
    graph = getattr(gm, "graph", None)
    return graph is not None and any(
        n.op == "call_function" and _functional_name(n.target) is not None for n in graph.nodes
    )


def route_collectives(graph: Any) -> int:
    """Replace every functional collective of ``graph`` (an FX graph the caller owns) and
    the ``wait_tensor`` after it by this module's op; returns how many were replaced.
    Raises ValueError naming a functional collective that cannot be routed."""
    # Lazy: torch is heavy and optional; only the host toolchain needs it.
    import torch

    found: list[tuple[Any, str]] = []
    for node in graph.nodes:
        name = _functional_name(node.target) if node.op == "call_function" else None
        if name is not None:
            found.append((node, name))
    if not found:
        return 0
    register_collective_ops()
    ours = getattr(torch.ops, LIBRARY)
    routed = 0
    for node, name in found:
        if name == "wait_tensor":
            continue
        base = _IN_PLACE.get(name, name)
        if base not in _SCHEMAS:
            raise ValueError(
                f"the graph calls {_FUNCTIONAL}::{name}, which the host toolchain cannot run "
                "inside an AOTInductor package without risking a deadlock with gloo's worker "
                f"threads (it routes {', '.join(sorted(_SCHEMAS))})"
            )
        with graph.inserting_after(node):
            call = graph.call_function(getattr(ours, base).default, node.args, node.kwargs)
        if base != name:  # in place: the result goes back into the input, as before
            with graph.inserting_after(call):
                graph.call_function(torch.ops.aten.copy_.default, (node.args[0], call))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        routed += 1
    for node in list(graph.nodes):
        if node.op == "call_function" and _functional_name(node.target) == "wait_tensor":
            source = node.args[0]
            if _op_of(getattr(source, "target", None), LIBRARY) is None:
                continue  # waits on something this module did not route: leave it
            node.replace_all_uses_with(source)
            graph.erase_node(node)
    return routed
