"""Torch's private names the host toolchain reads or replaces, behind one fence.

Why: torch does not promise its private names (``torch._inductor.cpp_builder._run_compile_cmd``,
``torch.cpu._is_avx512_supported``...) from one release to the next. Read bare, a renamed one
either raises in every host compile or, worse, silently drops what it fed into the key. So
every such name is listed here (`FENCED`: what it is for, what happens without it) and read
only through `resolve`, which checks that the name is still there with the signature this
package was written against (the canary test at the pinned torch checks the list itself).

Without one, the package does what torch does on its own: the compile still succeeds
(wrapper compiled whole, Inductor's own ISA probe and flags), with one warning per name and
process. What feeds the key fails *closed*: a name that cannot be read is recorded
(`unreadable`) and the host toolchain's key then says so (``unknown:<name>``), so the entry
is never shared with a node that could read it, nor with one where the feature is absent.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["FENCED", "Fenced", "cpu_feature", "has", "resolve", "unknown", "unreadable"]

logger = logging.getLogger("vllm_neuron.compile")

_CPP_BUILDER = "torch._inductor.cpp_builder"
_VEC_ISA = "torch._inductor.cpu_vec_isa"
_PYTREE = "torch.utils._pytree"
_FAKE = "torch._subclasses.fake_tensor"
_NO_PYTREE = ("the host toolchain is unavailable (ToolchainUnavailable naming it): torch has no "
              "other way to flatten and restore a graph's outputs")
_MISSING = object()


@dataclass(frozen=True)
class Fenced:
    """One private name: `module`'s attribute `name` (dotted: an attribute's attribute, as
    ``cpp.simdlen`` of Inductor's config); `params`, the parameter names of the callable we
    use (None: not called, only read: `kind` is then its type, if checked)."""

    module: str
    name: str
    params: tuple[str, ...] | None
    purpose: str
    without: str
    feeds_key: bool = False
    kind: type | None = None
    setting: bool = False  # a configuration value: None is a value, not a missing name

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


def _cpu_probe(name: str, feature: str) -> Fenced:
    return Fenced("torch.cpu", name, (), f"whether this CPU has {feature}: in the key "
                  "(an artifact with it dies with SIGILL where it is missing)",
                  f"the key says unknown:torch.cpu.{name} (an entry of its own)", feeds_key=True)


_ENTRIES = (
    Fenced(_CPP_BUILDER, "_run_compile_cmd", ("cmd_line", "cwd"),
           "replaced process-wide to split AOTInductor's wrapper compile (aoti_wrapper.py) and "
           "heal torn precompiled headers (torn_headers.py)",
           "the wrapper is compiled whole by torch; torn headers are not healed"),
    Fenced(_CPP_BUILDER, "_get_cpu_arch_cflags", ("cpp_compiler",),
           "read for torch's own -march, and replaced to compile for an explicit target "
           "(cpu_target.py)",
           "torch's own flags (-march=native), described by the compiler in the key, plus "
           "unknown:<name>", feeds_key=True),
    Fenced(_CPP_BUILDER, "get_cpp_compiler", (),
           "the C++ compiler Inductor uses: its identity is in the key",
           "g++ is assumed, and the key says unknown:<name>", feeds_key=True),
    Fenced(_VEC_ISA, "valid_vec_isa_list", (),
           "replaced to stop Inductor's vector-ISA probe at the first valid ISA (vector_isa.py)",
           "Inductor probes every ISA the CPU claims (seconds more on a cold start)"),
    Fenced(_VEC_ISA, "x86_isa_checker", (),
           "the ISA flags the CPU claims, as Inductor reads them: the vector ISAs the key "
           "bounds (cpu_target.py) and the first-valid shortcut",
           "the key says unknown:<name> and requires every ISA flag of this CPU; no shortcut",
           feeds_key=True),
    Fenced(_VEC_ISA, "supported_vec_isa_list", None,
           "Inductor's candidate vector ISAs, in its order: as above",
           "the key says unknown:<name> and requires every ISA flag of this CPU; no shortcut",
           feeds_key=True, kind=list),
    Fenced(_VEC_ISA, "pick_vec_isa", (),
           "Inductor's vector-ISA pick, run ahead by compile workers and the cold-start probe",
           "nothing is run ahead: the first compile probes as torch does"),
    _cpu_probe("_is_avx2_supported", "AVX2"),
    _cpu_probe("_is_avx512_supported", "AVX-512"),
    _cpu_probe("_is_avx512_bf16_supported", "AVX-512 BF16"),
    _cpu_probe("_is_vnni_supported", "VNNI"),
    _cpu_probe("_is_amx_tile_supported", "AMX tiles"),
    _cpu_probe("_is_amx_fp16_supported", "AMX FP16"),
    Fenced("torch._inductor.config", "cpp.simdlen", None,
           "read: whether Inductor's ISA pick reads beyond its first valid candidate "
           "(vector_isa.py)", "no first-valid shortcut: Inductor probes every ISA", setting=True),
    Fenced("torch._inductor.config", "cpp.march", None,
           "read: whether torch compiles for -march=native, the case an explicit target "
           "replaces (cpu_target.py)", "torch's own flags (-march=native), keyed as they are",
           setting=True),
    Fenced("torch._inductor", "aoti_load_package", ("path", "run_single_threaded",
           "device_index"), "torch's package loader: loads a host entry's .pt2 (host.py)",
           "no host entry can be loaded: ToolchainUnavailable naming it (torch has no other "
           "loader)"),
    Fenced("torch._C._aoti", "AOTIModelPackageLoader", None,
           "torch's loader given a package's members unpacked in the local tier (host.py, "
           "tiers/unpacked.py): nothing is copied to $TMPDIR",
           "the package is loaded by aoti_load_package instead (its copy in $TMPDIR, removed "
           "once loaded)", kind=type),
    Fenced("torch._guards", "tracing", ("context",),
           "with unset_fake_temporarily: leave the tracing context of a caller that compiles "
           "while dynamo traces (host.py)",
           "compiles run in the caller's context: one called while dynamo traces (vLLM's "
           "pieces) may fail in torch.export (ToolchainError); workers and the CLI are not "
           "affected"),
    Fenced(_FAKE, "unset_fake_temporarily", (),
           "leave the fake-tensor mode of a caller that compiles while dynamo traces (host.py)",
           "as for torch._guards.tracing"),
    Fenced(_FAKE, "FakeTensor", None,
           "tells a fake example input, exported from a zero-filled real tensor (host.py)",
           "every tensor input is exported from a zero-filled real tensor of its shape "
           "(same program)", kind=type),
    Fenced("torch._C._autograd", "_get_data_attr", None,
           "the target of param.data in a traced graph, rewritten to the parameter itself "
           "(host.py; export cannot trace it)",
           "param.data is not rewritten (export may refuse such a graph: ToolchainError), and "
           "the key says unknown:<name> (the program differs)", feeds_key=True),
    Fenced("torch._ops", "OpOverload", None,
           "tells torch's functional collectives in a graph, routed GIL-free "
           "(host_collectives.py)",
           "collectives are not routed (the graph compiled as traced, or refused by export: "
           "ToolchainError), and the key says unknown:<name> (the program differs)",
           feeds_key=True, kind=type),
    Fenced("torch._ops", "OpOverloadPacket", None, "as torch._ops.OpOverload",
           "as torch._ops.OpOverload", feeds_key=True, kind=type),
    Fenced("torch._dynamo.backends.registry", "register_backend",
           ("compiler_fn", "name", "tags"),
           "registers torch.compile(backend=\"vllm_neuron\") (dynamo_backend.py)",
           "the backend is not registered (one warning): torch.compile(backend=\"vllm_neuron\") "
           "fails with dynamo's unknown-backend error"),
    Fenced("torch._dynamo.backends.registry", "_COMPILER_FNS", None,
           "dynamo's registered backends: registering is idempotent (dynamo_backend.py)",
           "as register_backend", kind=dict),
    Fenced("torch._dynamo.backends.registry", "_BACKENDS", None,
           "dynamo's entry-point backends not loaded yet: never registered twice "
           "(dynamo_backend.py)", "as register_backend", kind=dict),
    Fenced(_PYTREE, "treespec_dumps", ("treespec", "protocol"),
           "a graph's output structure, stored in its entry (host.py, host_jobs.py, neuron.py)",
           _NO_PYTREE),
    Fenced(_PYTREE, "treespec_loads", ("serialized",),
           "the stored output structure, restored on load (base.py)", _NO_PYTREE),
    Fenced(_PYTREE, "tree_unflatten", ("leaves", "treespec"), "as treespec_loads", _NO_PYTREE),
    Fenced(_PYTREE, "tree_leaves", ("tree", "is_leaf"),
           "a result's tensors: restored output structure (base.py), a snapshot's outputs "
           "(snapshot/*)", _NO_PYTREE + "; a snapshot cannot be written or replayed"),
    Fenced(_PYTREE, "tree_flatten", ("tree", "is_leaf"),
           "a graph's outputs, lowered for Neuron (neuron.py)", _NO_PYTREE),
)

FENCED: dict[str, Fenced] = {e.qualname: e for e in _ENTRIES}
"""Every private torch name the host toolchain touches, by qualified name."""

_lock = threading.Lock()
_warned: set[str] = set()
_unreadable: set[str] = set()  # key-feeding names that raised when read


def resolve(qualname: str) -> Any | None:
    """The fenced name `qualname` as torch has it now, or None when it is missing or its
    signature changed (one warning per name and process; a key-feeding name is then in
    `unreadable`)."""
    entry = FENCED[qualname]
    problem = _problem(entry)
    if problem is None:
        return _lookup(entry)
    _warn(qualname, problem, entry)
    return None


def has(qualname: str) -> bool:
    """Whether the fenced `qualname` is there as expected (a setting whose value may be None:
    ``cpp.simdlen``); one warning per name and process when not."""
    entry = FENCED[qualname]
    problem = _problem(entry)
    if problem is not None:
        _warn(qualname, problem, entry)
    return problem is None


def _lookup(entry: Fenced) -> Any:
    value: Any = importlib.import_module(entry.module)
    for part in entry.name.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            break
    return value


def _warn(qualname: str, problem: str, entry: Fenced) -> None:
    with _lock:
        first = qualname not in _warned
        _warned.add(qualname)
    if first:
        logger.warning("vllm_neuron: torch's private %s %s; %s", qualname, problem,
                       entry.without)  # fmt: skip


def _problem(entry: Fenced) -> str | None:
    try:
        value = _lookup(entry)
    except ImportError as exc:
        return f"cannot be imported ({exc})"
    if value is _MISSING or (value is None and not entry.setting):
        return "is missing"
    if entry.kind is not None and not isinstance(value, entry.kind):
        return f"is a {type(value).__name__}, not a {entry.kind.__name__}"
    if entry.params is None:
        return None
    if not callable(value):
        return "is not callable"
    try:
        params = tuple(inspect.signature(value).parameters)
    except (TypeError, ValueError):
        return "has no readable signature"
    if params != entry.params:
        return f"takes ({', '.join(params)}), not ({', '.join(entry.params)})"
    return None


def cpu_feature(probe: str) -> bool | None:
    """``torch.cpu.<probe>()``: whether this CPU has the feature, or None when torch cannot
    say (missing, changed or raising: `unreadable`, so the key fails closed)."""
    qualname = f"torch.cpu.{probe}"
    fn = resolve(qualname)
    if fn is None:
        return None
    try:
        return bool(fn())
    except Exception as exc:  # noqa: BLE001 - unknown, never assumed absent
        unknown(qualname, f"raised {type(exc).__name__}: {exc}")
        return None


def unknown(qualname: str, why: str) -> str:
    """Record that the key-feeding `qualname` could not be read (`why`, warned once) and
    return the key's word for it, ``unknown:<qualname>``."""
    with _lock:
        first = qualname not in _warned
        _warned.add(qualname)
        _unreadable.add(qualname)
    if first:
        logger.warning("vllm_neuron: torch's private %s %s; %s", qualname, why,
                       FENCED[qualname].without if qualname in FENCED else "keyed as unknown")
    return f"unknown:{qualname}"


def unreadable() -> str:
    """The key's account of the key-feeding names torch does not have as expected now, and
    of those that raised when read in this process: empty when every one was read (the key
    is then what it always was)."""
    now = {q for q, e in FENCED.items() if e.feeds_key and _problem(e) is not None}
    with _lock:
        return ",".join(f"unknown:{q}" for q in sorted(now | _unreadable))


def _forget() -> None:
    """Forget every warning and unreadable name (tests: a process starting anew)."""
    with _lock:
        _warned.clear()
        _unreadable.clear()
