"""``meta.json``: the identity tag of one bundle, and the bundle's commit record.

A bundle ``<hash>/rank<N>/call<K>/`` exists if and only if its ``meta.json`` exists: the
capturer writes every tensor file first and ``meta.json`` last, with the store's atomic
write, so a reader never mistakes a half-written directory for a capture. Writing it
raises on any failure (fail-loud: a bundle that looks captured but is not is worse than an
aborted forward).

The record is a frozen, tagged ``msgspec`` struct with a schema version (``v``), like every
record the project persists, read through the record layer's codec: old versions are upcast
explicitly, and a file that does not read is a ``RecordError`` naming it.

**Bundles written by the Neuron plugin.** AWS's plugin writes the same bundle layout
(``<hash>/rank<N>/call<K>/tensor{i}.{npy|pt}`` + ``meta.json``) on a Trainium host, and users
bring such bundles here to inspect or replay. Its ``meta.json`` is a plain object without
our ``type``/``v``: ``{"schema": 1, "hash", "format", "global_rank", "tp_rank", "dp_rank",
"call_index", "selected_by", "inputs": [{"index", "dtype", "shape"}], "global_step",
"is_prompt", "matches", "req_ids", "positions"}`` (`PluginCallMeta`). A JSON object without
our tag is read as version 0 of ``snapshot-call`` (the codec's `Untagged` form) and upcast
by `_upcast_plugin_form` through the records' upcaster registry:

- ``hash`` is ``compilation_hash``; a ``selected_by`` rule ``call_index`` is our ``call``;
- an input without ``kind`` is a plain tensor input, stored in ``tensor{index}.{format}``
  (the plugin's file naming); its dtype loses the ``torch.`` prefix the plugin writes
  (``str(tensor.dtype)``), and ``nbytes`` is computed from dtype and shape;
- a match ``{"batch_index", "request_id", "position", "reason"}`` becomes a `MatchRecord`:
  ``reason`` is the rule, ``batch_index`` the row, ``request_id`` the request; for a token
  match the plugin's ``position`` is the targeted token (our ``target``), and the row's own
  position and the ``offset`` come from ``positions`` when it has the row (else ``-1`` and
  null);
- ``global_step`` / ``is_prompt`` stay null when the plugin wrote null (a call-index capture
  with no published forward);
- what the plugin does not record takes these defaults: no ``outputs`` (so there is nothing
  to compare a replay against), ``writer`` ``"neuron-plugin"`` (`PLUGIN_WRITER`, how
  readers tell such a bundle apart), no ``toolchain``/``target``/``graph``,
  ``num_speculative_tokens`` 0, ``created`` 0 and ``pid`` 0 (unknown).

A plugin ``schema`` other than 1 is refused, naming it: a later layout is not guessed at.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from vllm_neuron.backends import Record, RecordCodec, Store, join, register_upcaster
from vllm_neuron.backends.records import Untagged, encode_document

from .encoding import FORMATS, RAW_BYTE_DTYPES
from .kernel_handles import KernelHandle

__all__ = [
    "META_FILE",
    "PLUGIN_WRITER",
    "CallMeta",
    "InputSpec",
    "MatchRecord",
    "PluginCallMeta",
    "SnapshotMetaError",
    "decode_call_meta",
    "graph_file",
    "read_call_meta",
    "write_call_meta",
]

META_FILE = "meta.json"
GRAPH_FILE = "graph.pt2"  # the exported graph of bundles written before graph_file()
GRAPH_ERROR_LIMIT = 2000  # characters of an export's error kept in meta.json
META_TAG = "snapshot-call"
PLUGIN_VERSION = 0  # the Neuron plugin's meta.json, read as version 0 of META_TAG
PLUGIN_SCHEMAS = (1,)  # the plugin's own "schema" values this reader knows
PLUGIN_WRITER = "neuron-plugin"  # CallMeta.writer of a bundle written by the plugin
PLUGIN_TENSOR_STEM = "tensor"  # the plugin's files: tensor{index}.{format}


class SnapshotMetaError(RuntimeError):
    """meta.json could not be written (reading one that does not read is a ``RecordError``)."""


class InputSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One positional input (or output) of the captured call.

    ``kind`` is ``"tensor"`` (stored in ``file``), ``"scalar"`` (a Python number or None
    passed positionally, e.g. vLLM's batch size; its ``value`` is kept here),
    ``"sequence"`` (a flat tuple, list or ``torch.Size`` of numbers, e.g. a shape: its items
    in ``value``, which of the three in ``container``) or ``"kernel-handle"`` (a pointer to
    a kernel object of the capturing process: ``file`` holds the weight it was made from,
    ``handle`` how to rebuild it; see ``kernel_handles``).
    """

    index: int
    kind: str
    file: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    stride: list[int] | None = None
    nbytes: int = 0
    device: str | None = None
    value: int | float | bool | list[int | float | bool | None] | None = None
    container: str | None = None  # a "sequence": "tuple", "list" or "size"
    handle: KernelHandle | None = None


class MatchRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A row a token/request rule matched (see ``config.RowMatch``)."""

    rule: str
    row: int
    req_id: str
    position: int
    target: int | None = None
    offset: int | None = None
    request: str | None = None


class CallMeta(Record, frozen=True, kw_only=True, tag=META_TAG):
    """Everything needed to find, trust and replay one captured call.

    ``global_step`` and ``is_prompt`` are null only in a bundle from the Neuron plugin that
    captured a call with no published forward; our capturer always records them.
    """

    compilation_hash: str
    format: str
    global_rank: int
    tp_rank: int
    dp_rank: int
    call_index: int
    selected_by: list[str]
    inputs: list[InputSpec]
    outputs: list[InputSpec] = msgspec.field(default_factory=list)
    global_step: int | None
    is_prompt: bool | None
    req_ids: list[str] = msgspec.field(default_factory=list)
    positions: list[int] = msgspec.field(default_factory=list)
    matches: list[MatchRecord] = msgspec.field(default_factory=list)
    num_speculative_tokens: int = 0
    writer: str = "host"
    toolchain: str | None = None
    target: str | None = None
    graph: str | None = None  # key of the exported graph relative to the snapshot root
    # Why no graph was saved for this call (``graph`` is then null): the export's error, so
    # a replay that needs the reference graph names it instead of guessing.
    graph_error: str | None = None
    created: float = 0.0
    pid: int = 0
    # Tensor parallelism (absent in bundles written before it was recorded, and in the
    # Neuron plugin's; see collectives.py and docs/snapshots.md): the call's position among
    # the compiled-graph calls of its forward (the same on every rank, so it pairs a rank's
    # bundle with the other ranks' bundles of the same call even where their graphs
    # differ), the tensor-parallel group's size (0: unknown), the collective ops the graph
    # calls (None: unknown).
    forward_call: int | None = None
    tp_size: int = 0
    collectives: list[str] | None = None

    @property
    def files(self) -> list[str]:
        return [s.file for s in (*self.inputs, *self.outputs) if s.file]

    @property
    def from_plugin(self) -> bool:
        """Whether the Neuron plugin wrote this bundle (inputs only; see the module doc)."""
        return self.writer == PLUGIN_WRITER


def graph_file(signature: str) -> str:
    """The exported graph for calls of one input signature: ``graph-<signature>.pt2``.

    Per signature, not per hash: the graph is exported with the call's non-tensor inputs
    (vLLM's batch size, a ``SymInt`` while tracing) and tensor shapes specialised to their
    captured values, so each distinct signature of a hash has its own program."""
    return f"graph-{signature}.pt2"


# The Neuron plugin's form -------------------------------------------------------------------


class PluginInput(msgspec.Struct, frozen=True, kw_only=True):
    """One input in the plugin's ``meta.json``: ``dtype`` is ``str(tensor.dtype)``."""

    index: int
    dtype: str
    shape: list[int]


class PluginMatch(msgspec.Struct, frozen=True, kw_only=True):
    """One matched row in the plugin's ``meta.json`` (its ``SnapshotMatch``)."""

    batch_index: int
    request_id: str
    position: int
    reason: str


class PluginCallMeta(msgspec.Struct, frozen=True, kw_only=True):
    """The Neuron plugin's ``meta.json``, field for field; used to type-check it before
    the upcast. Fields the plugin may leave out get the defaults it would have written."""

    schema: int = 1
    hash: str
    format: str
    global_rank: int
    tp_rank: int
    dp_rank: int
    call_index: int
    selected_by: list[str]
    inputs: list[PluginInput] = msgspec.field(default_factory=list)
    global_step: int | None = None
    is_prompt: bool | None = None
    matches: list[PluginMatch] = msgspec.field(default_factory=list)
    req_ids: list[str] = msgspec.field(default_factory=list)
    positions: list[int] = msgspec.field(default_factory=list)


_PLUGIN_RULES = {"call_index": "call"}  # the plugin's rule names that differ from ours
_RAW_BYTE_SIZES = {"bfloat16": 2}  # the other raw-byte dtypes (float8_*) are one byte


def _itemsize(dtype: str) -> int | None:
    """Bytes per element of the torch dtype called ``dtype``, without importing torch."""
    if dtype in RAW_BYTE_DTYPES:
        return _RAW_BYTE_SIZES.get(dtype, 1)
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # no numpy type (complex32, sub-byte and quantized types)
        return None


def _plugin_input(spec: PluginInput, fmt: str) -> dict[str, Any]:
    dtype = spec.dtype.removeprefix("torch.")
    size = _itemsize(dtype)
    return {
        "index": spec.index,
        "kind": "tensor",
        "file": f"{PLUGIN_TENSOR_STEM}{spec.index}.{fmt}",
        "dtype": dtype,
        "shape": list(spec.shape),
        "nbytes": 0 if size is None else size * math.prod(spec.shape),
    }


def _plugin_match(m: PluginMatch, positions: list[int]) -> dict[str, Any]:
    """A plugin match in our terms. The plugin's token match records the *targeted* token
    (row position + offset) as ``position``; a token rule fires on decode rows only, where
    ``positions`` holds one position per row, so the row's own position is read there."""
    out: dict[str, Any] = {"rule": m.reason, "row": m.batch_index, "req_id": m.request_id,
                           "position": m.position}  # fmt: skip
    if m.reason == "token":
        row_position = positions[m.batch_index] if 0 <= m.batch_index < len(positions) else None
        out["target"] = m.position
        out["position"] = -1 if row_position is None else row_position
        out["offset"] = None if row_position is None else m.position - row_position
    return out


@register_upcaster(META_TAG, PLUGIN_VERSION)
def _upcast_plugin_form(raw: dict[str, Any]) -> dict[str, Any]:
    """The Neuron plugin's ``meta.json`` as version 1 of ours; see the module docstring."""
    plugin = msgspec.convert(raw, PluginCallMeta)  # raises ValidationError, naming the field
    if plugin.schema not in PLUGIN_SCHEMAS:
        raise ValueError(
            f"the Neuron plugin's meta.json schema {plugin.schema} is not supported "
            f"(this version reads schema {', '.join(map(str, PLUGIN_SCHEMAS))})"
        )
    if plugin.format not in FORMATS:
        raise ValueError(
            f"format {plugin.format!r} is not a snapshot format (one of {', '.join(FORMATS)})"
        )
    return {
        "type": META_TAG,
        "compilation_hash": plugin.hash,
        "format": plugin.format,
        "global_rank": plugin.global_rank,
        "tp_rank": plugin.tp_rank,
        "dp_rank": plugin.dp_rank,
        "call_index": plugin.call_index,
        "selected_by": [_PLUGIN_RULES.get(r, r) for r in plugin.selected_by],
        "inputs": [_plugin_input(i, plugin.format) for i in plugin.inputs],
        "global_step": plugin.global_step,
        "is_prompt": plugin.is_prompt,
        "req_ids": list(plugin.req_ids),
        "positions": list(plugin.positions),
        "matches": [_plugin_match(m, plugin.positions) for m in plugin.matches],
        "writer": PLUGIN_WRITER,
    }


_CODEC = RecordCodec(CallMeta, untagged=Untagged(META_TAG, PLUGIN_VERSION,
                                                  "the Neuron plugin's form"))  # fmt: skip


def decode_call_meta(data: bytes, *, source: str = META_FILE) -> CallMeta:
    """Our record (any version), or the Neuron plugin's ``meta.json`` upcast to it.

    Our records always carry the ``type`` tag; a JSON object without one is the plugin's
    form, version 0. Anything else is a ``RecordError`` naming `source` and why.
    """
    return _CODEC.decode(data, source=source)


def write_call_meta(store: Store, call_prefix: str, meta: CallMeta) -> None:
    """Commit the bundle at ``call_prefix``: write its meta.json atomically, or raise."""
    key = join(call_prefix, META_FILE)
    try:
        store.write(key, encode_document(meta))  # indented: read by humans too
    except Exception as exc:
        raise SnapshotMetaError(f"cannot write {store.url}/{key}: {exc}") from exc


def read_call_meta(store: Store, call_prefix: str) -> CallMeta | None:
    """The bundle's record; None when there is no meta.json (no bundle, or incomplete)."""
    return _CODEC.read(store, join(call_prefix, META_FILE))
