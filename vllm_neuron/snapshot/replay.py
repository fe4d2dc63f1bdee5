"""Reading bundles back: list them, load them, and replay a captured forward off the device.

Replay loads a bundle's inputs (each reinterpreted with the dtype meta.json records), runs
the graph, and compares every output with the reference the capturer stored next to the
inputs (``output{j}.{fmt}``: what the executable returned on the device for exactly those
inputs). Two ways to run the graph:

- ``cache``: the compile-cache entry named by the bundle's hash, loaded with the host
  toolchain (TorchInductor) - the same artifact, re-run on the host;
- ``eager``: the graph the capturer exported once per hash (``<hash>/graph.pt2``,
  ``torch.export``), run by PyTorch eagerly - the reference semantics, and the only option
  for a NEFF captured on Trainium and replayed on a laptop.

``auto`` takes the cache entry when it exists and the host can load it, else the graph.

Per output the report gives max absolute error, max relative error and cosine similarity,
and a pass/fail against ``atol``/``rtol`` (``|actual - expected| <= atol + rtol * |expected|``
elementwise, NaN only where the reference has NaN). Without explicit tolerances each
dtype gets the defaults of ``torch.testing.assert_close`` (exact for integers and bool).

A bundle exists iff its ``meta.json`` does; directories without one are incomplete
(a crash mid-capture) and are reported as such, never replayed.
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from vllm_neuron.backends import Store, is_url, join, local_path_of, open_store
from vllm_neuron.compile.toolchains.op_libraries import load_for_missing_schema

from .encoding import SnapshotFormat, decode_tensor
from .kernel_handles import KernelHandleError, rebuild_handle
from .meta import GRAPH_FILE, META_FILE, CallMeta, InputSpec, read_call_meta

__all__ = [
    "Bundle",
    "BundleInfo",
    "OutputComparison",
    "ReplayError",
    "ReplayReport",
    "SnapshotListing",
    "compare_outputs",
    "default_tolerances",
    "find_bundles",
    "list_bundles",
    "load_bundle",
    "locate",
    "open_snapshot_root",
    "replay",
    "replay_bundle",
]

RUNNERS = ("auto", "cache", "eager")

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


def open_snapshot_root(url: str) -> Store:
    """The store at a snapshot root, read-only in spirit: nothing is created, and a local
    root (a path or ``file://`` URL) that is not a directory is a ReplayError."""
    path = local_path_of(url)
    if path is not None and not os.path.isdir(path):
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
        from .config import load_snapshot_config

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


def _restore_strides(tensor: Any, stride: Sequence[int] | None) -> Any:
    """The captured layout, when it was a plain (non-overlapping) strided one."""
    if stride is None or tuple(stride) == tuple(tensor.stride()) or tensor.numel() <= 1:
        return tensor
    if any(s <= 0 for s in stride):
        return tensor  # broadcast/overlapping layouts are replayed contiguous
    import torch

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


# Runners ------------------------------------------------------------------------------------


def _cache_runner(compilation_hash: str, cache_dir: str | None) -> Callable[..., Any]:
    import msgspec

    from vllm_neuron.compile.entry import read_record
    from vllm_neuron.compile.toolchains.base import CompiledArtifact
    from vllm_neuron.compile.toolchains.select import select_toolchain

    if cache_dir is None:
        from vllm_neuron.envs import get_neuron_compile_cache_dir

        cache_dir = get_neuron_compile_cache_dir()
    path = local_path_of(cache_dir)
    if path is not None and not os.path.isdir(path):
        raise ReplayError(f"no compile cache at {cache_dir}")
    store = open_store(cache_dir, create=False)
    content = store.published(compilation_hash)
    if content is None:
        raise ReplayError(f"the compile cache {cache_dir} has no entry {compilation_hash}")
    entry_dir = store.local_path(content)
    if entry_dir is None:
        raise ReplayError(f"the compile cache {cache_dir} is not on local disk")
    record = read_record(store, content)
    artifact = msgspec.convert(record.meta, CompiledArtifact)
    toolchain = select_toolchain("host")
    if artifact.toolchain != toolchain.name:
        raise ReplayError(
            f"entry {compilation_hash} was built by the {artifact.toolchain} toolchain "
            f"({artifact.target}); the host cannot run it - use the eager runner"
        )
    return toolchain.load(entry_dir, artifact)


def _eager_runner(bundle: Bundle) -> Callable[..., Any]:
    key = bundle.meta.graph or join(bundle.meta.compilation_hash, GRAPH_FILE)
    data = bundle.store.read(key)
    if data is None:
        raise ReplayError(
            f"no exported graph {key} next to {bundle.location} (the capture could not save "
            "it); replay with the compile-cache runner instead"
        )
    try:
        program = _load_exported(data, f"the exported graph {key}")
    except Exception as exc:  # MissingOpLibrary says which kernel library and how to get it
        raise ReplayError(f"cannot load the exported graph {key}: {exc}") from exc
    module = program.module()

    def run(*args: Any) -> Any:
        return module(*args)

    return run


def _load_exported(data: bytes, what: str) -> Any:
    """``torch.export.load``, loading the kernel library the graph calls when it is missing
    (a graph traced inside vLLM calls vLLM's CPU kernels)."""
    import torch

    try:
        return torch.export.load(io.BytesIO(data))
    except Exception as exc:
        if not load_for_missing_schema(exc, what):
            raise
    return torch.export.load(io.BytesIO(data))


def resolve_runner(
    bundle: Bundle, runner: str = "auto", cache_dir: str | None = None
) -> tuple[str, Callable[..., Any]]:
    """(runner name, callable) for ``bundle``; see the module docstring for the choice."""
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}; use one of {', '.join(RUNNERS)}")
    if runner == "cache":
        return "cache", _cache_runner(bundle.meta.compilation_hash, cache_dir)
    if runner == "eager":
        return "eager", _eager_runner(bundle)
    try:
        return "cache", _cache_runner(bundle.meta.compilation_hash, cache_dir)
    except Exception as cache_exc:  # noqa: BLE001 - fall back to the exported graph
        try:
            return "eager", _eager_runner(bundle)
        except ReplayError as eager_exc:
            raise ReplayError(f"{cache_exc}; and {eager_exc}") from eager_exc


# Comparison ---------------------------------------------------------------------------------

# (rtol, atol) per dtype: torch.testing.assert_close's defaults, fp8 by mantissa width.
_TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-3, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
    "float8_e4m3fn": (0.125, 1e-5),
    "float8_e4m3fnuz": (0.125, 1e-5),
    "float8_e5m2": (0.25, 1e-5),
    "float8_e5m2fnuz": (0.25, 1e-5),
    "float8_e8m0fnu": (1.0, 1e-5),
}


def default_tolerances(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for an output of ``dtype`` when none are given: exact for integers."""
    rtol, atol = _TOLERANCES.get(dtype, (0.0, 0.0))
    return atol, rtol


@dataclass(frozen=True)
class OutputComparison:
    """How one replayed output compares with its captured reference."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    max_abs_err: float
    max_rel_err: float
    cosine: float
    atol: float
    rtol: float
    mismatched: int
    passed: bool
    problem: str | None = None


@dataclass(frozen=True)
class ReplayReport:
    """The replay of one bundle."""

    bundle: str
    runner: str
    outputs: tuple[OutputComparison, ...] = ()
    problem: str | None = None
    global_rank: int = 0
    call_index: int = 0

    @property
    def passed(self) -> bool:
        return self.problem is None and all(o.passed for o in self.outputs)


def _compare_one(
    index: int, actual: Any, expected: Any, atol: float | None, rtol: float | None
) -> OutputComparison:
    import torch

    if not isinstance(expected, torch.Tensor):
        same = actual == expected
        return OutputComparison(index, type(expected).__name__, (), 0.0 if same else math.inf,
                                0.0 if same else math.inf, 1.0 if same else 0.0, 0.0, 0.0,
                                0 if same else 1, bool(same),
                                None if same else f"{actual!r} != {expected!r}")  # fmt: skip
    dname = str(expected.dtype).removeprefix("torch.")
    d_atol, d_rtol = default_tolerances(dname)
    a_tol = d_atol if atol is None else atol
    r_tol = d_rtol if rtol is None else rtol
    shape = tuple(int(d) for d in expected.shape)

    def fail(problem: str) -> OutputComparison:
        return OutputComparison(index, dname, shape, math.inf, math.inf, 0.0, a_tol, r_tol,
                                int(expected.numel()), False, problem)  # fmt: skip

    if not isinstance(actual, torch.Tensor):
        return fail(f"replay returned {type(actual).__name__}, expected a tensor")
    if tuple(actual.shape) != shape:
        return fail(f"shape {tuple(actual.shape)} != captured {shape}")
    if actual.dtype != expected.dtype:
        return fail(f"dtype {actual.dtype} != captured {expected.dtype}")
    if expected.numel() == 0:
        return OutputComparison(index, dname, shape, 0.0, 0.0, 1.0, a_tol, r_tol, 0, True)
    wide = torch.complex128 if expected.is_complex() else torch.float64
    a = actual.detach().cpu().to(wide).flatten()
    b = expected.detach().cpu().to(wide).flatten()
    both_nan = torch.isnan(a) & torch.isnan(b)
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    equal = both_nan | same_inf
    diff = (a - b).abs().to(torch.float64)
    diff = torch.where(equal, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    ref = b.abs().to(torch.float64)
    ok = (diff <= a_tol + r_tol * ref) | equal
    rel = torch.where(
        ref > 0, diff / torch.where(ref > 0, ref, torch.ones_like(ref)),
        torch.where(diff > 0, torch.full_like(diff, math.inf), torch.zeros_like(diff)),
    )  # fmt: skip
    finite = torch.isfinite(a) & torch.isfinite(b)
    af, bf = a[finite], b[finite]
    dot = (af * bf.conj()).sum().real if a.is_complex() else (af * bf).sum()
    na, nb = af.abs().pow(2).sum().sqrt(), bf.abs().pow(2).sum().sqrt()
    if float(na) == 0.0 and float(nb) == 0.0:
        cosine = 1.0
    elif float(na) == 0.0 or float(nb) == 0.0:
        cosine = 0.0
    else:
        cosine = float(dot / (na * nb))
    mismatched = int((~ok).sum())
    return OutputComparison(
        index=index,
        dtype=dname,
        shape=shape,
        max_abs_err=float(diff.max()),
        max_rel_err=float(rel.max()),
        cosine=cosine,
        atol=a_tol,
        rtol=r_tol,
        mismatched=mismatched,
        passed=mismatched == 0,
    )


def compare_outputs(
    actual: Sequence[Any],
    expected: Sequence[Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> list[OutputComparison]:
    """Elementwise comparison of replayed outputs against the captured ones."""
    if len(actual) != len(expected):
        raise ReplayError(f"replay returned {len(actual)} outputs, captured {len(expected)}")
    pairs = enumerate(zip(actual, expected, strict=True))
    return [_compare_one(i, a, e, atol, rtol) for i, (a, e) in pairs]


def _no_reference(bundle: Bundle) -> str:
    """Why ``bundle``, which holds no captured outputs, cannot be replayed.

    A bundle from the Neuron plugin holds the call's inputs and ``meta.json`` only, so the
    message names the bundle and everything replay would need from it; its inputs are still
    loaded, so a bad tensor file is reported rather than hidden behind the missing outputs.
    """
    meta = bundle.meta
    if not meta.from_plugin:
        return "the bundle has no captured outputs to compare against"
    graph_key = meta.graph or join(meta.compilation_hash, GRAPH_FILE)
    missing = [f"no captured outputs (output<j>.{meta.format}, listed as outputs in "
               f"{META_FILE}) to compare a replay against"]  # fmt: skip
    if not bundle.store.exists(graph_key):
        missing.append(f"no exported graph ({graph_key}) to run it with")
    loaded = f"its {len(meta.inputs)} inputs load"
    for spec in meta.inputs:
        try:
            bundle._load(spec)
        except (ReplayError, ValueError) as exc:  # SnapshotEncodingError is a ValueError
            where = "" if spec.file is None or spec.file in str(exc) else f"{spec.file}: "
            loaded = f"its inputs do not load either: {where}{exc}"
            break
    return (
        f"cannot replay {bundle.location}: it was written by the Neuron plugin, which stores "
        f"a call's inputs (tensor<i>.{meta.format}) and {META_FILE} only, so it has no "
        f"artifact replay can use: {'; and '.join(missing)} ({loaded})"
    )


def replay_bundle(
    bundle: Bundle,
    *,
    runner: str = "auto",
    cache_dir: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    runners: dict[tuple[str, str], tuple[str, Callable[..., Any]]] | None = None,
) -> ReplayReport:
    """Run ``bundle``'s inputs through its graph and compare with its captured outputs."""
    import torch
    import torch.utils._pytree as pytree

    meta = bundle.meta

    def report(runner_name: str, outputs: Sequence[OutputComparison] = (),
               problem: str | None = None) -> ReplayReport:  # fmt: skip
        return ReplayReport(bundle.location, runner_name, tuple(outputs), problem,
                            meta.global_rank, meta.call_index)  # fmt: skip

    if not meta.outputs:
        return report(runner, problem=_no_reference(bundle))
    cache_key = (meta.compilation_hash, runner)
    if runners is not None and cache_key in runners:
        name, fn = runners[cache_key]
    else:
        name, fn = resolve_runner(bundle, runner, cache_dir)
        if runners is not None:
            runners[cache_key] = (name, fn)
    inputs = bundle.load_inputs()
    expected = bundle.load_outputs()
    with torch.no_grad():
        result = fn(*inputs)
    actual = list(pytree.tree_leaves(result))
    try:
        return report(name, compare_outputs(actual, expected, atol=atol, rtol=rtol))
    except ReplayError as exc:
        return report(name, problem=str(exc))


def replay(
    store: Store,
    prefix: str,
    *,
    runner: str = "auto",
    cache_dir: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> list[ReplayReport]:
    """Replay every bundle at or under ``prefix`` (all ranks of a tensor-parallel capture)."""
    prefixes = find_bundles(store, prefix)
    if not prefixes:
        raise ReplayError(f"no snapshot bundle at {store.url.rstrip('/')}/{prefix}".rstrip("/"))
    runners: dict[tuple[str, str], tuple[str, Callable[..., Any]]] = {}
    return [
        replay_bundle(load_bundle(store, p), runner=runner, cache_dir=cache_dir, atol=atol,
                      rtol=rtol, runners=runners)  # fmt: skip
        for p in prefixes
    ]
