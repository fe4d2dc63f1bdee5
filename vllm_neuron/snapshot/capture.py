"""Per-executable capture: which forward, which rank, where, and the write itself.

A :class:`SnapshotCapturer` wraps each loaded executable (installed through
``CompileRuntime.add_wrapper`` by :func:`install_snapshot_capture`, and only when capture
is enabled, so a disabled feature leaves the raw callable on the execute path); the
executables of one compilation hash share one capturer and one call counter. Per call:

1. no published forward context (warm-up): call through; nothing is counted;
2. the call gets its graph's next post-warm-up call index;
3. call-index rule OR the forward's token/request verdict; not selected: call through;
4. the process-global budget is reserved (one unit per forward);
5. the writer writes ``tensor{i}.{fmt}`` for every positional input, the executable runs,
   its outputs are written as ``output{j}.{fmt}`` (the replay reference), and
   ``meta.json`` is written last, atomically: that write is what makes the bundle exist;
6. any failure deletes what was written, gives the budget unit back and raises
   (:class:`SnapshotCaptureError`), aborting the forward.

The device-to-host write sits behind :class:`SnapshotWriter`. The default writer
(:class:`HostTensorWriter`) copies tensors to the host with torch and encodes them itself;
:class:`NeuronRuntimeWriter` hands the vector to the Neuron runtime's serialize op and is
chosen automatically when that op is registered (on Trainium with the runtime that has it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vllm_neuron.backends import Store, join, open_store, validate_key
from vllm_neuron.identity import RankInfo, detect_ranks

from . import context as _context
from .config import RULE_CALL, RULE_ORDER, SnapshotConfig, snapshot_config
from .context import CaptureBudget, SnapshotForwardContext, get_capture_budget
from .encoding import (
    SnapshotFormat,
    check_encodable,
    dtype_name,
    file_name,
    write_tensor,
)
from .kernel_handles import (
    HandleSource,
    KernelHandle,
    KernelHandleError,
    handle_input_indices,
    resolve_handles,
)
from .meta import GRAPH_FILE, META_FILE, CallMeta, InputSpec, MatchRecord, write_call_meta

if TYPE_CHECKING:
    from vllm_neuron.compile.runtime import CompiledGraph, CompileRuntime

__all__ = [
    "CaptureSpec",
    "HostTensorWriter",
    "NeuronRuntimeWriter",
    "RankInfo",
    "SnapshotCaptureError",
    "SnapshotCapturer",
    "SnapshotWriter",
    "build_capturer",
    "default_writer",
    "detect_ranks",
    "install_snapshot_capture",
    "neuron_serialize_op",
    "resolve_capture_spec",
]

logger = logging.getLogger("vllm_neuron.snapshot")

# The Neuron runtime's standalone serialize op: torch.ops.neuron.<name>(tensors, call_dir,
# format, file_names) copies each tensor device->host and writes it under call_dir.
# Off-device this module only detects it; the call follows the runtime's documented
# contract and is unverified here (there is no Trainium in CI).
NEURON_OP_NAMESPACE = "neuron"
NEURON_OP_NAME = "serialize_tensors"


class SnapshotCaptureError(RuntimeError):
    """A selected forward could not be captured; the forward was aborted, no bundle left."""


# Ranks --------------------------------------------------------------------------------------


# Writers ------------------------------------------------------------------------------------


class SnapshotWriter(Protocol):
    """Writes named tensors under ``prefix`` of ``store``; raises on any failure."""

    name: str

    def write(
        self, store: Store, prefix: str, items: Sequence[tuple[str, Any]], fmt: SnapshotFormat
    ) -> None: ...


class HostTensorWriter:
    """The default writer: torch copies each tensor to the host, encoding writes the file.

    Each file is streamed into the store (`Store.open_write`): on local disk straight into
    a file beside its final name (no in-memory copy of the encoded tensor; fsynced when the
    store is durable), elsewhere encoded in memory and written as one object. Atomicity per
    file is a by-product: the bundle only exists once meta.json is written.
    """

    name = "host"

    def write(
        self, store: Store, prefix: str, items: Sequence[tuple[str, Any]], fmt: SnapshotFormat
    ) -> None:
        for name, tensor in items:
            with store.open_write(join(prefix, name)) as f:
                write_tensor(tensor, fmt, f)


def neuron_serialize_op() -> Callable[..., Any] | None:
    """The Neuron runtime's serialize op when it is registered, else None."""
    try:
        import torch

        return getattr(getattr(torch.ops, NEURON_OP_NAMESPACE), NEURON_OP_NAME)
    except (ImportError, AttributeError, RuntimeError):
        return None


class NeuronRuntimeWriter:
    """Delegates the device-to-host write to the Neuron runtime's serialize op.

    The op writes files into a directory it is handed, so it gets one from the store
    (`Store.local_output`, the documented door for tools that write their own output: the
    bundle directory itself on local disk, a scratch directory uploaded afterwards on S3
    or memory). Every file the op was asked for must then be in the store, or the write
    counts as failed.
    """

    name = "neuron-runtime"

    def __init__(self, op: Callable[..., Any]) -> None:
        self.op = op

    def write(
        self, store: Store, prefix: str, items: Sequence[tuple[str, Any]], fmt: SnapshotFormat
    ) -> None:
        names = [name for name, _ in items]
        with store.local_output(prefix) as directory:
            self.op([t for _, t in items], directory, fmt, names)
        missing = [n for n in names if not store.exists(join(prefix, n))]
        if missing:
            raise SnapshotCaptureError(
                f"the Neuron runtime serialize op did not write {', '.join(missing)}"
            )


def default_writer() -> SnapshotWriter:
    """The Neuron runtime writer when its op exists, else the host (torch) writer."""
    op = neuron_serialize_op()
    return HostTensorWriter() if op is None else NeuronRuntimeWriter(op)


# Spec ---------------------------------------------------------------------------------------

_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def _open_root(root: str) -> Store:
    """The bundle root as a store (cached per URL; local roots are created on first use)."""
    with _STORES_LOCK:
        store = _STORES.get(root)
        if store is None:
            store = _STORES[root] = open_store(root)
        return store


@dataclass(frozen=True)
class CaptureSpec:
    """Everything one executable needs to capture: identity, rules, budget, destination."""

    compilation_hash: str
    config: SnapshotConfig
    ranks: RankInfo
    budget: CaptureBudget

    @property
    def format(self) -> SnapshotFormat:
        return self.config.format

    @property
    def root(self) -> str:
        return self.config.root

    def call_prefix(self, call_index: int) -> str:
        """``<hash>/rank<global_rank>/call<call_index>`` relative to the snapshot root."""
        return join(self.compilation_hash, f"rank{self.ranks.global_rank}", f"call{call_index}")

    def store(self) -> Store:
        try:
            return _open_root(self.config.root)
        except Exception as exc:
            raise SnapshotCaptureError(
                f"cannot open the snapshot directory {self.config.root!r} "
                f"(VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR / VLLM_CACHE_ROOT): {exc}"
            ) from exc


def resolve_capture_spec(
    compilation_hash: str,
    *,
    config: SnapshotConfig | None = None,
    ranks: RankInfo | None = None,
    budget: CaptureBudget | None = None,
) -> CaptureSpec | None:
    """The capture spec for one executable, or None when this process never captures it
    (capture disabled, or this tp rank is filtered out by ``..._RANKS``)."""
    cfg = snapshot_config() if config is None else config
    if not cfg.enabled:
        return None
    validate_key(compilation_hash)
    if "/" in compilation_hash:
        raise ValueError(f"compilation hash {compilation_hash!r} must be one path segment")
    info = detect_ranks() if ranks is None else ranks
    if not cfg.captures_rank(info.tp_rank):
        return None
    return CaptureSpec(
        compilation_hash=compilation_hash,
        config=cfg,
        ranks=info,
        budget=get_capture_budget() if budget is None else budget,
    )


# Capturer -----------------------------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _describe(
    values: Sequence[Any],
    stem: str,
    fmt: SnapshotFormat,
    handles: Mapping[int, HandleSource] | None = None,
) -> list[InputSpec]:
    """Specs of the positional values; raises before anything is written if one cannot be
    stored (an unsupported dtype, or a value that is neither a tensor nor a number).

    A kernel-handle input (``handles``) is described by the weight stored in its place."""
    specs: list[InputSpec] = []
    for i, value in enumerate(values):
        source = handles.get(i) if handles else None
        if source is not None:
            specs.append(_tensor_spec(i, source.weight, stem, fmt, source.handle))
        elif _is_tensor(value):
            specs.append(_tensor_spec(i, value, stem, fmt))
        elif value is None or isinstance(value, bool | int | float):
            specs.append(InputSpec(index=i, kind="scalar", value=value))
        else:
            raise SnapshotCaptureError(
                f"{stem}{i} is a {type(value).__name__}; snapshots hold tensors and numbers"
            )
    return specs


def _tensor_spec(
    index: int, tensor: Any, stem: str, fmt: SnapshotFormat, handle: KernelHandle | None = None
) -> InputSpec:
    """The spec of a tensor stored as ``<stem><index>``: the value itself, or the weight
    standing in for a kernel handle."""
    check_encodable(tensor.dtype, fmt, what=f"{stem}{index}")
    return InputSpec(
        index=index,
        kind="tensor" if handle is None else "kernel-handle",
        file=file_name(f"{stem}{index}", fmt),
        dtype=dtype_name(tensor.dtype),
        shape=[int(d) for d in tensor.shape],
        stride=[int(s) for s in tensor.stride()],
        nbytes=int(tensor.numel() * tensor.element_size()),
        device=str(tensor.device),
        handle=handle,
    )


def _flatten_outputs(out: Any) -> list[Any]:
    import torch.utils._pytree as pytree

    return list(pytree.tree_leaves(out))


class SnapshotCapturer:
    """Owns the per-forward capture decision and the bundle writes for one executable."""

    def __init__(
        self,
        spec: CaptureSpec,
        *,
        writer: SnapshotWriter | None = None,
        graph: CompiledGraph | None = None,
    ) -> None:
        self.spec = spec
        self.writer = writer if writer is not None else default_writer()
        self.graph = graph
        self.calls = 0  # post-warm-up calls seen so far; the next call's index
        self.captured: list[str] = []  # call prefixes written by this capturer
        self._graph_key: str | None = None
        self._graph_tried = False
        self._handle_indices: dict[int, str] | None = None
        self._warned_budget = False
        selector = spec.config.selector
        self._all_calls = selector.all_calls
        self._at_calls = selector.at_calls or frozenset()
        self._forward_rules = selector.has_forward_rules

    # -- the execute path
    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with capture on its path: one global read when no forward is published."""
        ctx_module = _context
        run = self.run

        def snapshot_forward(*args: Any) -> Any:
            ctx = ctx_module._current
            if ctx is None:
                return fn(*args)
            return run(ctx, fn, args)

        snapshot_forward.__wrapped__ = fn  # type: ignore[attr-defined]
        snapshot_forward.capturer = self  # type: ignore[attr-defined]
        return snapshot_forward

    def select(self, ctx: SnapshotForwardContext, call_index: int) -> tuple[list[str], list[Any]]:
        """(rules that fired, row matches) for this executable's ``call_index``-th call."""
        selector = self.spec.config.selector
        verdict = ctx.verdict
        if verdict is None and selector.has_forward_rules:
            verdict = selector.evaluate_forward(
                ctx.req_ids, ctx.positions, ctx.is_decode, ctx.num_speculative_tokens
            )
        rules = set(verdict.selected_by) if verdict else set()
        if selector.selects_call(call_index):
            rules.add(RULE_CALL)
        matches = list(verdict.matches) if verdict else []
        return [r for r in RULE_ORDER if r in rules], matches

    def run(self, ctx: SnapshotForwardContext, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """One post-warm-up call: decide, and capture if selected."""
        call_index = self.calls
        self.calls = call_index + 1
        # Fast path for the common case (nothing selected), without building any record.
        verdict = ctx.verdict
        if (
            not self._all_calls
            and call_index not in self._at_calls
            and (not verdict.selected_by if verdict is not None else not self._forward_rules)
        ):
            return fn(*args)
        selected_by, matches = self.select(ctx, call_index)
        if not selected_by:
            return fn(*args)
        budget = self.spec.budget
        if not budget.reserve(ctx.step):
            if not self._warned_budget:
                self._warned_budget = True
                logger.info(
                    "vllm_neuron: snapshot budget of %d forwards used up; not capturing %s",
                    budget.max_captures,
                    self.spec.call_prefix(call_index),
                )
            return fn(*args)
        try:
            out = self.capture(ctx, call_index, selected_by, matches, fn, args)
        except BaseException:
            budget.release(ctx.step)
            raise
        budget.commit(ctx.step)
        return out

    # -- the capture itself
    def capture(
        self,
        ctx: SnapshotForwardContext,
        call_index: int,
        selected_by: list[str],
        matches: Sequence[Any],
        fn: Callable[..., Any],
        args: Sequence[Any],
    ) -> Any:
        """Write the bundle of this call around running ``fn``; see the module docstring."""
        spec = self.spec
        fmt = spec.format
        prefix = spec.call_prefix(call_index)
        try:
            handles = resolve_handles(args, self._graph_handles())
        except KernelHandleError as exc:
            raise SnapshotCaptureError(
                f"input snapshot of {prefix} is impossible: {exc}; the forward was aborted"
            ) from exc
        inputs = _describe(args, "tensor", fmt, handles)  # raises before anything is written
        store = spec.store()
        where = f"{store.url.rstrip('/')}/{prefix}"
        try:
            self._clear_previous(store, prefix)
            graph_key = self._ensure_graph(store)
            self.writer.write(
                store, prefix,
                [(s.file, handles[s.index].weight if s.index in handles else args[s.index])
                 for s in inputs if s.file],
                fmt,
            )
        except Exception as exc:
            self._cleanup(store, prefix)
            raise SnapshotCaptureError(
                f"input snapshot of {where} failed while writing the inputs: {exc}; "
                "the forward was aborted and no bundle was left"
            ) from exc
        except BaseException:
            self._cleanup(store, prefix)
            raise
        try:
            out = fn(*args)
        except BaseException:
            self._cleanup(store, prefix)
            raise
        try:
            leaves = _flatten_outputs(out)
            outputs = _describe(leaves, "output", fmt)
            HostTensorWriter().write(
                store, prefix, [(s.file, leaves[s.index]) for s in outputs if s.file], fmt
            )
            meta = CallMeta(
                compilation_hash=spec.compilation_hash,
                format=fmt,
                global_rank=spec.ranks.global_rank,
                tp_rank=spec.ranks.tp_rank,
                dp_rank=spec.ranks.dp_rank,
                call_index=call_index,
                selected_by=selected_by,
                inputs=inputs,
                outputs=outputs,
                global_step=ctx.step,
                is_prompt=ctx.is_prompt,
                req_ids=list(ctx.req_ids),
                positions=list(ctx.positions),
                matches=[MatchRecord(**dataclasses.asdict(m)) for m in matches],
                num_speculative_tokens=ctx.num_speculative_tokens,
                writer=self.writer.name,
                toolchain=None if self.graph is None else self.graph.artifact.toolchain,
                target=None if self.graph is None else self.graph.artifact.target,
                graph=graph_key,
                created=time.time(),
                pid=os.getpid(),
            )
            write_call_meta(store, prefix, meta)
        except Exception as exc:
            self._cleanup(store, prefix)
            raise SnapshotCaptureError(
                f"input snapshot of {where} failed while writing the outputs/meta.json: {exc}; "
                "the forward was aborted and no bundle was left"
            ) from exc
        except BaseException:
            self._cleanup(store, prefix)
            raise
        self.captured.append(prefix)
        logger.info("vllm_neuron: captured input snapshot %s (selected by %s)", where,
                    ", ".join(selected_by))  # fmt: skip
        return out

    def _graph_handles(self) -> dict[int, str]:
        """Inputs the graph hands to a kernel as a process-local handle (once per graph)."""
        if self._handle_indices is None:
            gm = None if self.graph is None else self.graph.gm
            self._handle_indices = handle_input_indices(gm)
        return self._handle_indices

    def _clear_previous(self, store: Store, prefix: str) -> None:
        """A bundle (or leftovers) from an earlier run at the same call index is replaced:
        its meta.json goes first, so it stops existing before any of its files change."""
        if not store.list(prefix):
            return
        logger.warning("vllm_neuron: replacing the earlier snapshot at %s/%s",
                       store.url.rstrip("/"), prefix)  # fmt: skip
        store.delete(join(prefix, META_FILE))
        store.delete_tree(prefix)

    def _cleanup(self, store: Store, prefix: str) -> None:
        try:
            store.delete(join(prefix, META_FILE))
            store.delete_tree(prefix)
        except Exception as exc:  # noqa: BLE001 - the original error is what matters
            logger.error("vllm_neuron: could not remove the failed snapshot %s/%s: %s",
                         store.url.rstrip("/"), prefix, exc)  # fmt: skip

    def _ensure_graph(self, store: Store) -> str | None:
        """Save the graph once per hash (``<hash>/graph.pt2``, a ``torch.export`` program)
        so a bundle can be replayed eagerly where the compiled artifact cannot run (a NEFF
        off the device). Best-effort: the inputs are what the capture promises."""
        if self._graph_tried:
            return self._graph_key
        self._graph_tried = True
        key = join(self.spec.compilation_hash, GRAPH_FILE)
        if store.exists(key):
            self._graph_key = key
            return key
        if self.graph is None:
            return None
        try:
            import io

            import torch

            ep = torch.export.export(self.graph.gm, tuple(self.graph.example_inputs))
            buf = io.BytesIO()
            torch.export.save(ep, buf)
            store.create(key, buf.getvalue())
            self._graph_key = key
        except Exception as exc:  # noqa: BLE001 - best-effort, see the docstring
            logger.warning(
                "vllm_neuron: could not save the graph of %s for eager replay (%s); "
                "replay will need its compile-cache entry",
                self.spec.compilation_hash,
                exc,
            )
        return self._graph_key


# Integration --------------------------------------------------------------------------------


def build_capturer(
    graph: CompiledGraph,
    *,
    config: SnapshotConfig | None = None,
    ranks: RankInfo | None = None,
    writer: SnapshotWriter | None = None,
) -> SnapshotCapturer | None:
    """The capturer of one compiled executable, or None when it never captures."""
    spec = resolve_capture_spec(graph.key, config=config, ranks=ranks)
    if spec is None:
        return None
    return SnapshotCapturer(spec, writer=writer, graph=graph)


def install_snapshot_capture(
    runtime: CompileRuntime, config: SnapshotConfig | None = None
) -> bool:
    """Wrap every executable ``runtime`` loads with a capturer, when capture is enabled.

    Disabled (the default), nothing is installed: executables are the raw callables.
    Called by ``build_runtime``; a malformed snapshot setting raises here, at start-up.
    """
    cfg = snapshot_config() if config is None else config
    if not cfg.enabled:
        return False
    # One capturer per compilation hash: identical graphs (the repeated layers of a
    # piecewise-compiled model) are one executable with one call counter, as one NEFF is
    # on the device, so their calls get distinct call indices instead of overwriting
    # each other's call<K> directory.
    capturers: dict[str, SnapshotCapturer | None] = {}
    lock = threading.Lock()

    def snapshot_wrapper(graph: CompiledGraph, fn: Callable[..., Any]) -> Callable[..., Any]:
        with lock:
            if graph.key not in capturers:
                capturers[graph.key] = build_capturer(graph, config=cfg)
            capturer = capturers[graph.key]
        return fn if capturer is None else capturer.wrap(fn)

    runtime.add_wrapper(snapshot_wrapper)
    return True
