"""Writing one selected call as a bundle: its inputs, the run, its outputs, ``meta.json``.

Why apart from the capturer (:mod:`.capture`): deciding *which* call to capture is on the
execute path of every forward and must stay cheap; writing a bundle happens for a handful
of selected calls and carries the whole fail-loud protocol:

1. every input is described (dtype, shape, kernel handle) before anything is written, so
   a value that cannot be stored fails the forward with nothing on disk;
2. an earlier bundle at the same call index is removed, ``meta.json`` first;
3. the writer (:mod:`.tensor_writers`) writes ``tensor{i}.{fmt}`` for every positional
   input, the executable runs, its outputs are written as ``output{j}.{fmt}`` (the replay
   reference), and ``meta.json`` is written last, atomically: that write is what makes the
   bundle exist;
4. any failure deletes what was written; a snapshot root that cannot take files (full,
   read-only, refused) stops capture for the process with one warning and the forward is
   served; any other failure raises (:class:`SnapshotCaptureError`).

The graph is exported so a bundle can be replayed eagerly where the compiled artifact cannot
run (a NEFF off the device): once per compilation hash and *input signature*
(``<hash>/graph-<signature>.pt2``), with the call's own values. vLLM's pieces take the batch
size as an input (a ``SymInt`` while tracing, an ``int`` at run time), which
``torch.export`` refuses as a symbolic example; exported with the captured call's concrete
values instead, every non-tensor input (ints, None, shapes) and every tensor shape is
specialised to the bundle's, so the program runs exactly the captured call. A graph that
cannot be exported is not silent: the reason is kept in the bundle's ``meta.json``
(``graph_error``) and named by ``snapshot show`` and ``snapshot replay``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_neuron.backends import Store, fault_point, join, local_path_of
from vllm_neuron.backends.writable import unwritable_cause, why_unwritable
from vllm_neuron.compile.entry.text import printable
from vllm_neuron.compile.toolchains.base import require_torch

from .capture_spec import CaptureSpec, SnapshotCaptureError
from .collectives import collective_ops
from .context import SnapshotForwardContext
from .encoding import SnapshotFormat, check_encodable, dtype_name, file_name
from .kernel_handles import (
    HandleSource,
    KernelHandle,
    KernelHandleError,
    handle_input_indices,
    resolve_handles,
)
from .meta import (
    GRAPH_ERROR_LIMIT,
    META_FILE,
    CallMeta,
    InputSpec,
    MatchRecord,
    graph_file,
    write_call_meta,
)
from .tensor_writers import HostTensorWriter, SnapshotWriter

if TYPE_CHECKING:
    from vllm_neuron.compile.runtime import CompiledGraph

__all__ = ["BundleWriter"]

logger = logging.getLogger("vllm_neuron.snapshot")


def _is_tensor(value: Any) -> bool:
    import torch  # heavy and optional: only once a selected call is written

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
        elif (container := _container(value)) is not None:
            specs.append(InputSpec(index=i, kind="sequence", value=list(value),
                                   container=container))  # fmt: skip
        else:
            raise SnapshotCaptureError(
                f"{stem}{i} is a {type(value).__name__}; snapshots hold tensors, numbers, "
                "None and flat tuples/lists of numbers (shapes)"
            )
    return specs


def _container(value: Any) -> str | None:
    """Which sequence a flat tuple, list or ``torch.Size`` of numbers is (None: another value;
    nested or non-number items are not stored)."""
    import torch  # heavy and optional: only once a selected call is written

    if isinstance(value, torch.Size):
        return "size"
    if not isinstance(value, tuple | list):
        return None
    if not all(v is None or isinstance(v, bool | int | float) for v in value):
        return None
    return "tuple" if isinstance(value, tuple) else "list"


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
    return list(require_torch("torch.utils._pytree.tree_leaves")(out))


class BundleWriter:
    """Writes the bundles of one executable; remembers what is shared by all its calls
    (the exported graph's key, which inputs are kernel handles)."""

    def __init__(
        self, spec: CaptureSpec, writer: SnapshotWriter, graph: CompiledGraph | None = None
    ) -> None:
        self.spec = spec
        self.writer = writer
        self.graph = graph
        # input signature -> (the exported graph's key, or why it could not be saved)
        self._graphs: dict[str, tuple[str | None, str | None]] = {}
        self._handle_indices: dict[int, str] | None = None
        self._collective_ops: list[str] | None = None

    def capture_call(
        self,
        ctx: SnapshotForwardContext,
        call_index: int,
        selected_by: list[str],
        matches: Sequence[Any],
        fn: Callable[..., Any],
        args: Sequence[Any],
        forward_call: int | None = None,
    ) -> tuple[Any, CallMeta | None]:
        """Write the bundle of this call around running ``fn``; see the module docstring.

        (``fn``'s result, the bundle's record: None when it was not written, the snapshot
        root could not take files). ``forward_call`` is the call's position among the
        forward's graph calls."""
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
        where = f"{spec.root.rstrip('/')}/{prefix}"
        store: Store | None = None
        try:
            store = spec.store()
            self._clear_previous(store, prefix)
            graph_key, graph_error = self._ensure_graph(store, args, inputs)
            self.writer.write(
                store, prefix,
                [(s.file, handles[s.index].weight if s.index in handles else args[s.index])
                 for s in inputs if s.file],
                fmt,
            )
        except Exception as exc:
            if store is not None:
                self._cleanup(store, prefix)
            if self._root_cannot_take_files(exc, where):
                return fn(*args), None
            raise SnapshotCaptureError(
                f"input snapshot of {where} failed while writing the inputs: {exc}; "
                "the forward was aborted and no bundle was left"
            ) from exc
        except BaseException:
            if store is not None:
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
                graph_error=graph_error,
                created=time.time(),
                pid=os.getpid(),
                forward_call=forward_call,
                tp_size=spec.tp_size,
                collectives=self._collectives(),
            )
            fault_point("snapshot.before-meta")
            write_call_meta(store, prefix, meta)
        except Exception as exc:
            self._cleanup(store, prefix)
            if self._root_cannot_take_files(exc, where):
                return out, None
            raise SnapshotCaptureError(
                f"input snapshot of {where} failed while writing the outputs/meta.json: {exc}; "
                "the forward was aborted and no bundle was left"
            ) from exc
        except BaseException:
            self._cleanup(store, prefix)
            raise
        logger.info("vllm_neuron: captured input snapshot %s (selected by %s)", where,
                    ", ".join(selected_by))  # fmt: skip
        return out, meta

    def _root_cannot_take_files(self, exc: Exception, where: str) -> bool:
        """True when ``exc`` says the snapshot root cannot take files (no space, read-only,
        refused): capture stops for the process, said once naming the setting, and the
        caller serves the forward without its bundle. A capture is a debugging aid: a full
        disk under it must not take the server down (a value that cannot be stored, the
        user's to fix, still aborts the forward)."""
        root_dir = local_path_of(self.spec.root)
        fault = unwritable_cause(exc, under=root_dir)
        if fault is None:
            return False
        reason = why_unwritable(fault, root_dir or "/") or str(fault)
        if self.spec.budget.stop(reason):
            logger.warning(
                "vllm_neuron: input snapshots are bypassed for the rest of this process: the "
                "snapshot directory %s (%s) cannot take files: %s (%s). The forward was served "
                "without its bundle %s, and nothing half-written was left",
                self.spec.root, self.spec.config.root_setting, reason, fault, where,
            )  # fmt: skip
        return True

    def _collectives(self) -> list[str] | None:
        """The collective ops of the graph (once per graph); None when there is no graph
        to read them from (a replay then judges the bundle by its group size alone)."""
        if self.graph is None:
            return None
        if self._collective_ops is None:
            self._collective_ops = collective_ops(self.graph.gm)
        return self._collective_ops

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

    def _ensure_graph(self, store: Store, args: Sequence[Any],
                      inputs: Sequence[InputSpec]) -> tuple[str | None, str | None]:  # fmt: skip
        """Save the graph once per input signature (``<hash>/graph-<signature>.pt2``, a
        ``torch.export`` program of this call's concrete values; see the module docstring).

        (its key, None), or (None, why it could not be saved): best-effort, the inputs are
        what the capture promises; the reason goes into ``meta.json``."""
        signature = _signature(inputs)
        known = self._graphs.get(signature)
        if known is not None:
            return known
        key = join(self.spec.compilation_hash, graph_file(signature))
        if store.exists(key):  # the same graph and signature: another process, an earlier run
            self._graphs[signature] = (key, None)
            return key, None
        if self.graph is None:
            result: tuple[str | None, str | None] = (
                None, "the capturer was given no traced graph to export")
            self._graphs[signature] = result
            return result
        try:
            import torch  # heavy and optional: only once per signature, for a selected call

            from vllm_neuron.compile.toolchains.host import exportable_graph

            ep = torch.export.export(exportable_graph(self.graph.gm), tuple(args))
            # Not kept in the graph: the bundle holds the inputs already (vLLM's weights among
            # them), and pickling them would also pickle what vLLM hangs on a parameter
            # (loaders, local lambdas), which fails the save.
            ep.example_inputs = None
            buf = io.BytesIO()
            torch.export.save(ep, buf)
            store.create(key, buf.getvalue())
            result = (key, None)
        except Exception as exc:  # noqa: BLE001 - best-effort, see the docstring
            if unwritable_cause(exc, under=local_path_of(self.spec.root)) is not None:
                raise  # the root itself cannot take files: capture_call says so, once
            first = str(exc).strip().split("\n\n")[0]  # torch's advice paragraphs follow
            reason = printable(f"{type(exc).__name__}: {first}", GRAPH_ERROR_LIMIT)
            if not any(error for _, error in self._graphs.values()):
                logger.warning(
                    "vllm_neuron: could not save the graph of %s for eager replay (%s); "
                    "its bundles say why in meta.json (graph_error), and replay will need "
                    "its compile-cache entry", self.spec.compilation_hash, reason)  # fmt: skip
            result = (None, reason)
        self._graphs[signature] = result
        return result


def _signature(inputs: Sequence[InputSpec]) -> str:
    """What the exported program is specialised to: every input's kind, dtype and shape, and
    every non-tensor input's value (16 hex digits of its digest)."""
    described = [(s.kind, s.dtype, s.shape, None if s.file else repr(s.value)) for s in inputs]
    digest = hashlib.blake2b(msgspec.json.encode(described), digest_size=8)
    return digest.hexdigest()
