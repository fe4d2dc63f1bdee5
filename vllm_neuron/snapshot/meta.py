"""``meta.json``: the identity tag of one bundle, and the bundle's commit record.

A bundle ``<hash>/rank<N>/call<K>/`` exists if and only if its ``meta.json`` exists: the
capturer writes every tensor file first and ``meta.json`` last, with the store's atomic
write, so a reader never mistakes a half-written directory for a capture. Writing it
raises on any failure (fail-loud: a bundle that looks captured but is not is worse than an
aborted forward).

The record is a frozen, tagged ``msgspec`` struct with a schema version (``v``), like every
record the project persists; old versions are upcast explicitly when read.
"""

from __future__ import annotations

import msgspec

from vllm_neuron.backends import Record, RecordCodec, Store, join

from .kernel_handles import KernelHandle

__all__ = [
    "META_FILE",
    "CallMeta",
    "InputSpec",
    "MatchRecord",
    "SnapshotMetaError",
    "decode_call_meta",
    "read_call_meta",
    "write_call_meta",
]

META_FILE = "meta.json"
GRAPH_FILE = "graph.pt2"  # the exported graph, once per hash: <hash>/graph.pt2


class SnapshotMetaError(RuntimeError):
    """meta.json is missing, unreadable, or could not be written."""


class InputSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One positional input (or output) of the captured call.

    ``kind`` is ``"tensor"`` (stored in ``file``), ``"scalar"`` (a Python number passed
    positionally, e.g. a dynamic size; its ``value`` is kept here) or ``"kernel-handle"``
    (a pointer to a kernel object of the capturing process: ``file`` holds the weight it
    was made from, ``handle`` how to rebuild it; see ``kernel_handles``).
    """

    index: int
    kind: str
    file: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    stride: list[int] | None = None
    nbytes: int = 0
    device: str | None = None
    value: int | float | bool | None = None
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


class CallMeta(Record, frozen=True, kw_only=True, tag="snapshot-call"):
    """Everything needed to find, trust and replay one captured call."""

    compilation_hash: str
    format: str
    global_rank: int
    tp_rank: int
    dp_rank: int
    call_index: int
    selected_by: list[str]
    inputs: list[InputSpec]
    outputs: list[InputSpec] = msgspec.field(default_factory=list)
    global_step: int
    is_prompt: bool
    req_ids: list[str] = msgspec.field(default_factory=list)
    positions: list[int] = msgspec.field(default_factory=list)
    matches: list[MatchRecord] = msgspec.field(default_factory=list)
    num_speculative_tokens: int = 0
    writer: str = "host"
    toolchain: str | None = None
    target: str | None = None
    graph: str | None = None  # key of the exported graph relative to the snapshot root
    created: float = 0.0
    pid: int = 0

    @property
    def files(self) -> list[str]:
        return [s.file for s in (*self.inputs, *self.outputs) if s.file]


_CODEC = RecordCodec([CallMeta])


def decode_call_meta(data: bytes) -> CallMeta:
    try:
        meta = _CODEC.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise SnapshotMetaError(f"meta.json is not a snapshot record: {exc}") from exc
    if not isinstance(meta, CallMeta):  # pragma: no cover - the codec has one type
        raise SnapshotMetaError("meta.json is not a snapshot record")
    return meta


def write_call_meta(store: Store, call_prefix: str, meta: CallMeta) -> None:
    """Commit the bundle at ``call_prefix``: write its meta.json atomically, or raise."""
    from vllm_neuron.backends import encode

    key = join(call_prefix, META_FILE)
    try:
        data = msgspec.json.format(encode(meta), indent=2) + b"\n"  # read by humans too
        store.write(key, data)
    except Exception as exc:
        raise SnapshotMetaError(f"cannot write {store.url}/{key}: {exc}") from exc


def read_call_meta(store: Store, call_prefix: str) -> CallMeta | None:
    """The bundle's record; None when there is no meta.json (no bundle, or incomplete)."""
    data = store.read(join(call_prefix, META_FILE))
    if data is None:
        return None
    try:
        return decode_call_meta(data)
    except SnapshotMetaError as exc:
        raise SnapshotMetaError(f"{store.url}/{call_prefix}/{META_FILE}: {exc}") from exc
