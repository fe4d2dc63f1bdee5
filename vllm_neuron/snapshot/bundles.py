"""Finding and reading snapshot bundles: the root, the ``<hash>/rank<N>/call<K>`` layout,
bundle arguments, and a bundle's tensors.

Why one module: ``snapshot ls``, ``snapshot show`` and replay must agree on what a bundle
is, how one is named and how its files read back; none of that needs a graph to run.
A bundle exists iff its ``meta.json`` does; directories without one are incomplete (a
crash mid-capture) and are reported as such, never loaded. A bundle argument is a path or
URL of a call directory, of a rank or hash directory (every bundle below it: all ranks of
a tensor-parallel capture), or such a ``<hash>/...`` relative to a snapshot root.

Loading reinterprets each tensor file with the dtype ``meta.json`` records, restores the
captured strides when they were a plain layout, and rebuilds kernel handles from their
stored weights (their owners live as long as the :class:`Bundle`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from vllm_neuron.backends import Store, is_url, join, local_root_missing, open_store

from .config import load_snapshot_config
from .encoding import SnapshotFormat, decode_tensor
from .kernel_handles import KernelHandleError, rebuild_handle
from .meta import META_FILE, CallMeta, InputSpec, read_call_meta

__all__ = [
    "Bundle",
    "BundleInfo",
    "ReplayError",
    "SnapshotListing",
    "find_bundles",
    "list_bundles",
    "load_bundle",
    "locate",
    "open_snapshot_root",
]

_BUNDLE_KEY = re.compile(r"^([^/.][^/]*)/rank(\d+)/call(\d+)/(.+)$")
# The trailing <hash>[/rank<N>[/call<K>]] of a bundle path or URL.
_TAIL = re.compile(r"(?:^|/)([0-9a-f]{8,})(?:/(rank\d+)(?:/(call\d+))?)?/*$")


class ReplayError(RuntimeError):
    """A bundle cannot be replayed (missing graph, unreadable file, wrong arity...)."""


# Listing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleInfo:
    """One complete bundle, as ``snapshot ls`` shows it."""

    prefix: str
    compilation_hash: str
    global_rank: int
    tp_rank: int
    dp_rank: int
    call_index: int
    global_step: int | None  # null only in a Neuron plugin bundle without a forward context
    is_prompt: bool | None
    selected_by: tuple[str, ...]
    format: str
    inputs: int
    outputs: int
    files: int
    size: int
    created: float


@dataclass(frozen=True)
class SnapshotListing:
    """Every bundle under a root, plus the call directories that are not bundles."""

    root: str
    bundles: tuple[BundleInfo, ...] = ()
    incomplete: tuple[str, ...] = ()  # no meta.json: a capture that never finished
    unreadable: tuple[str, ...] = ()  # meta.json present but not a snapshot record

    @property
    def size(self) -> int:
        return sum(b.size for b in self.bundles)


def list_bundles(store: Store, prefix: str = "") -> SnapshotListing:
    """All bundles under ``prefix`` of ``store``, sorted by hash, rank and call."""
    groups: dict[tuple[str, int, int], dict[str, int]] = {}
    for info in store.iter_files(prefix):
        rel = info.key
        m = _BUNDLE_KEY.match(rel)
        if m is None:
            continue
        key = (m.group(1), int(m.group(2)), int(m.group(3)))
        groups.setdefault(key, {})[m.group(4)] = info.size
    bundles: list[BundleInfo] = []
    incomplete: list[str] = []
    unreadable: list[str] = []
    for (hash_, rank, call), files in sorted(groups.items()):
        call_prefix = join(hash_, f"rank{rank}", f"call{call}")
        if META_FILE not in files:
            incomplete.append(call_prefix)
            continue
        try:
            meta = read_call_meta(store, call_prefix)
        except Exception:  # noqa: BLE001 - one bad bundle must not hide the others
            unreadable.append(call_prefix)
            continue
        if meta is None:  # deleted between the listing and the read
            continue
        bundles.append(
            BundleInfo(
                prefix=call_prefix,
                compilation_hash=meta.compilation_hash,
                global_rank=meta.global_rank,
                tp_rank=meta.tp_rank,
                dp_rank=meta.dp_rank,
                call_index=meta.call_index,
                global_step=meta.global_step,
                is_prompt=meta.is_prompt,
                selected_by=tuple(meta.selected_by),
                format=meta.format,
                inputs=len(meta.inputs),
                outputs=len(meta.outputs),
                files=len(files),
                size=sum(files.values()),
                created=meta.created,
            )
        )
    return SnapshotListing(
        root=store.url, bundles=tuple(bundles), incomplete=tuple(incomplete),
        unreadable=tuple(unreadable),
    )  # fmt: skip


def find_bundles(store: Store, prefix: str = "") -> list[str]:
    """Call prefixes of the complete bundles at or under ``prefix``."""
    if prefix and store.exists(join(prefix, META_FILE)):
        return [prefix]
    listing = list_bundles(store)
    if not prefix:
        return [b.prefix for b in listing.bundles]
    return [b.prefix for b in listing.bundles if b.prefix.startswith(prefix.rstrip("/") + "/")]


# Addressing ---------------------------------------------------------------------------------


def open_snapshot_root(url: str) -> Store:
    """The store at a snapshot root, read-only in spirit: nothing is created, and a local
    root (a path or ``file://`` URL) that is not a directory is a ReplayError."""
    if local_root_missing(url):
        raise ReplayError(f"no snapshot directory at {url}")
    return open_store(url, create=False)


def locate(arg: str, root: str | None = None) -> tuple[Store, str]:
    """(store rooted at the snapshot root, prefix) for a bundle argument.

    ``arg`` is a path or URL of a bundle (``.../<hash>/rank<N>/call<K>``), of a rank or hash
    directory (every bundle below it), or such a relative ``<hash>/...`` under ``root``
    (default: the configured snapshot root).
    """
    arg = arg.strip()
    url = is_url(arg)
    if not url and not os.path.isabs(arg) and not os.path.exists(arg):
        base = root or load_snapshot_config().root
        return open_snapshot_root(base), arg.strip("/")
    location = arg if url else os.path.abspath(arg)
    trimmed = location.rstrip("/")
    m = _TAIL.search(trimmed)
    if m is None:
        return open_snapshot_root(location), ""
    base = trimmed[: m.start()] or "/"
    if url and base.endswith(":/"):  # "memory://<hash>...": the root is the bare scheme
        base += "/"
    prefix = "/".join(p for p in m.groups() if p)
    return open_snapshot_root(base), prefix


# Loading ------------------------------------------------------------------------------------


@dataclass
class Bundle:
    """A complete bundle: its record and lazy access to its tensors."""

    store: Store
    prefix: str
    meta: CallMeta
    # Owners of the kernel handles rebuilt for this bundle's inputs: a handle's kernel
    # memory is released when its owner is collected, so they live as long as the bundle.
    handle_owners: list[Any] = field(default_factory=list, repr=False)

    @property
    def location(self) -> str:
        return f"{self.store.url.rstrip('/')}/{self.prefix}"

    def _load(self, spec: InputSpec) -> Any:
        if spec.kind == "kernel-handle":
            return self._rebuild_handle(spec)
        if spec.kind == "sequence":
            return _sequence(spec, self.location)
        if spec.kind != "tensor":
            return spec.value
        return self._load_tensor(spec)

    def _rebuild_handle(self, spec: InputSpec) -> Any:
        if spec.handle is None:
            raise ReplayError(f"{self.location}: input {spec.index} is a kernel handle "
                              "without its description in meta.json")
        weight = self._load_tensor(spec)
        what = f"{self.location} input {spec.index}"
        try:
            handle, owner = rebuild_handle(spec.handle, weight, what)
        except KernelHandleError as exc:
            raise ReplayError(str(exc)) from exc
        self.handle_owners.append(owner)
        return handle

    def _load_tensor(self, spec: InputSpec) -> Any:
        assert spec.file is not None and spec.dtype is not None and spec.shape is not None
        key = join(self.prefix, spec.file)
        data = self.store.read(key)
        if data is None:
            raise ReplayError(f"{self.location}: {spec.file} is missing")
        fmt = cast(SnapshotFormat, self.meta.format)
        what = f"{self.location}/{spec.file}"
        tensor = decode_tensor(data, fmt, spec.dtype, spec.shape, what=what)
        return _restore_strides(tensor, spec.stride)

    def load_inputs(self) -> list[Any]:
        return [self._load(s) for s in self.meta.inputs]

    def load_outputs(self) -> list[Any]:
        return [self._load(s) for s in self.meta.outputs]


def _sequence(spec: InputSpec, where: str) -> Any:
    """A ``"sequence"`` input as the captured call passed it: tuple, list or torch.Size."""
    items = spec.value if isinstance(spec.value, list) else []
    if spec.container == "tuple":
        return tuple(items)
    if spec.container == "list":
        return list(items)
    if spec.container == "size":
        import torch  # heavy optional dependency: only for a bundle that holds a Size

        return torch.Size([int(v) for v in items if v is not None])
    raise ReplayError(f"{where}: input {spec.index} is a sequence of unknown container "
                      f"{spec.container!r} in meta.json")


def _restore_strides(tensor: Any, stride: Sequence[int] | None) -> Any:
    """The captured layout, when it was a plain (non-overlapping) strided one."""
    if stride is None or tuple(stride) == tuple(tensor.stride()) or tensor.numel() <= 1:
        return tensor
    if any(s <= 0 for s in stride):
        return tensor  # broadcast/overlapping layouts are replayed contiguous
    import torch  # heavy optional dependency: only once a tensor needs its strides back

    try:
        out = torch.empty_strided(tuple(tensor.shape), tuple(stride), dtype=tensor.dtype)
        out.copy_(tensor)
        return out
    except RuntimeError:
        return tensor


def load_bundle(store: Store, prefix: str) -> Bundle:
    meta = read_call_meta(store, prefix)
    if meta is None:
        raise ReplayError(
            f"{store.url.rstrip('/')}/{prefix} is not a bundle (no {META_FILE}: "
            "not a call directory, or a capture that never finished)"
        )
    return Bundle(store, prefix, meta)
