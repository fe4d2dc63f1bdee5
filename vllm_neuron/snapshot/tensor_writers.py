"""The device-to-host write of a bundle's tensors, behind one narrow interface.

Why an interface: where the tensors live decides how they get to the store. The default
writer (:class:`HostTensorWriter`) copies tensors to the host with torch and encodes them
itself; :class:`NeuronRuntimeWriter` hands the vector to the Neuron runtime's serialize op
and is chosen automatically when that op is registered (on Trainium with the runtime that
has it). Policy (which forward, which files, when a bundle exists) stays in
:mod:`.bundle_writer` and :mod:`.capture`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vllm_neuron.backends import Store, fault_point, join

from .capture_spec import SnapshotCaptureError
from .encoding import SnapshotFormat, write_tensor

__all__ = [
    "HostTensorWriter",
    "NeuronRuntimeWriter",
    "SnapshotWriter",
    "default_writer",
    "neuron_serialize_op",
]

# The Neuron runtime's standalone serialize op: torch.ops.neuron.<name>(tensors, call_dir,
# format, file_names) copies each tensor device->host and writes it under call_dir.
# Off-device this module only detects it; the call follows the runtime's documented
# contract and is unverified here (there is no Trainium in CI).
NEURON_OP_NAMESPACE = "neuron"
NEURON_OP_NAME = "serialize_tensors"


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
            fault_point("snapshot.mid-tensors")


def neuron_serialize_op() -> Callable[..., Any] | None:
    """The Neuron runtime's serialize op when it is registered, else None."""
    try:
        import torch  # heavy and optional: only when a capturer picks its writer

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
