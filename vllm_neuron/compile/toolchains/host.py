"""The host toolchain: TorchInductor ahead-of-time compilation (AOTInductor) on CPU.

Why it exists: the Neuron compiler is not installable off Trainium, but the cache's
policy (keys, locks, tiers, manifest) should run for real everywhere. AOTInductor produces
a self-contained ``.pt2`` package per graph, compiles in seconds to a minute, and loads in
a fresh process without the original Python code, which is exactly the shape of a NEFF.

Flow: ``torch.export.export(gm, inputs)`` -> ``aoti_compile_and_package`` -> ``graph.pt2``.
Output shapes come from the exported program's fake-tensor metadata, so the model is never
executed. The exported output pytree spec is recorded so ``load`` returns the graph's own
output structure (tuple, list or a single tensor).

Symbolic inputs (what vLLM's piecewise compiler hands over: fake tensors whose token
dimension is a symbol, plus that symbol as an integer input) are exported as one dynamic
program: each fake tensor becomes a zero-filled real tensor of its hinted size and strides,
every symbolic dimension is marked dynamic, and each integer input that equals a tensor
dimension is read from that dimension inside the program instead (AOTInductor ignores
integer inputs at run time, measured with torch 2.13); the loaded callable drops those
inputs (``CompiledArtifact.derived_inputs``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_neuron.compile.toolchains.aoti_wrapper import compile_and_package
from vllm_neuron.compile.toolchains.base import (
    CompiledArtifact,
    Toolchain,
    ToolchainError,
    ToolchainKind,
    format_shape,
    require_torch,
    restore_output_structure,
)
from vllm_neuron.compile.toolchains.cpu_target import (
    CpuInfo,
    HostTarget,
    compiler_identity,
    cpp_compiler,
    host_target,
    missing_features,
    read_cpuinfo,
)
from vllm_neuron.compile.toolchains.host_collectives import (
    calls_functional_collectives,
    register_collective_ops,
    route_collectives,
)
from vllm_neuron.compile.toolchains.node_files import torch_loader_scratch
from vllm_neuron.compile.toolchains.op_libraries import load_for_missing_schema
from vllm_neuron.compile.toolchains.torch_internals import cpu_feature, resolve, unreadable

__all__ = ["HostToolchain", "cpp_compiler", "exportable_graph"]

ARTIFACT_NAME = "graph.pt2"

# CPU features whose presence changes the vector code Inductor emits; an artifact built
# with AVX-512 dies with SIGILL on an AVX2-only node, so they are part of the key (with the
# explicit target the code is compiled for and the features it needs: cpu_target.py).
_CPU_FEATURE_PROBES = (
    ("avx2", "_is_avx2_supported"),
    ("avx512", "_is_avx512_supported"),
    ("avx512_bf16", "_is_avx512_bf16_supported"),
    ("vnni", "_is_vnni_supported"),
    ("amx_tile", "_is_amx_tile_supported"),
    ("amx_fp16", "_is_amx_fp16_supported"),
)
# What this module does to a graph before export (`_derive_integer_inputs`): the rewrites
# change the compiled program but not the graph's hash, so their version is in the key.
# 2: functional collectives routed through Python (host_collectives).
PROGRAM_REWRITES = "2"


class HostToolchain(Toolchain):
    """AOTInductor on the host CPU."""

    name: ClassVar[ToolchainKind] = "host"

    def __init__(self, inductor_configs: Mapping[str, Any] | None = None, *,
                 cpu: CpuInfo | None | str = "node") -> None:  # fmt: skip
        """`cpu`: the CPU to compile for; ``"node"`` (the default) reads this node's
        (/proc/cpuinfo). Whatever it is, an artifact loads only where this node has every
        feature it needs."""
        self.target = "cpu-inductor"
        self._inductor_configs = dict(inductor_configs or {})
        self._cpu = node_cpu() if cpu == "node" else cpu
        self._target: HostTarget | None = None

    def host_target(self) -> HostTarget:
        """The target this toolchain compiles for (computed once: cpu_target.py)."""
        if self._target is None:
            self._target = host_target(cpp_compiler(), self._inductor_configs,
                                       None if isinstance(self._cpu, str) else self._cpu)
        return self._target

    def versions(self) -> dict[str, str]:
        # Lazy: torch is heavy and optional; only this path needs it.
        import torch

        # Through the fence: a probe torch no longer has is keyed as unknown, never as absent.
        has = {name: cpu_feature(probe) for name, probe in _CPU_FEATURE_PROBES}
        features = [name if known else f"unknown:torch.cpu.{probe}"
                    for (name, probe), known in zip(_CPU_FEATURE_PROBES, has.values(),
                                                    strict=True)
                    if known is not False]  # fmt: skip
        versions = {
            "torch": str(torch.__version__),
            "machine": platform.machine(),
            "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "cpu_features": ",".join(features),
            # What decides the instructions the artifact may contain (cpu_target.py).
            "cpu_target": self.host_target().describe,
            "cpu_requires": ",".join(self.host_target().requires),
            "compiler": compiler_identity(cpp_compiler()),
            "program_rewrites": PROGRAM_REWRITES,
        }
        # Read last: what any of the above could not read (absent when all were read, so
        # keys are unchanged on a torch with every fenced name).
        unread = unreadable()
        if unread:
            versions["torch_internals"] = unread
        return versions

    def compiler_args(self) -> list[str]:
        return sorted(f"--{k}={v}" for k, v in self._inductor_configs.items())

    @property
    def inductor_configs(self) -> dict[str, Any]:
        """The Inductor configuration every compile gets (a copy)."""
        return dict(self._inductor_configs)

    def compile(self, gm: Any, example_inputs: Sequence[Any], out_dir: str) -> CompiledArtifact:
        treespec_dumps = require_torch("torch.utils._pytree.treespec_dumps")
        inputs = tuple(example_inputs)
        plan, ep, out_spec, shapes = export_program(gm, inputs)
        os.makedirs(out_dir, exist_ok=True)
        package_path = os.path.join(out_dir, ARTIFACT_NAME)
        try:
            with _outside_tracing():
                compile_and_package(ep, package_path, self._inductor_configs,
                                    self.host_target().cflags)
        except Exception as exc:
            raise ToolchainError(f"AOTInductor failed to compile the graph: {exc}") from exc
        return CompiledArtifact(
            toolchain=self.name,
            target=self.target,
            files=(ARTIFACT_NAME,),
            output_shapes=tuple(shapes),
            out_spec=treespec_dumps(out_spec),
            num_inputs=len(inputs),
            derived_inputs=plan.derived,
            requires=self.host_target().requires,
        )

    def check_meta(self, meta: CompiledArtifact) -> None:
        """Also refuse an artifact that needs a CPU feature this node lacks (compiled for a
        newer CPU): it is never loaded, whatever key it was found under."""
        super().check_meta(meta)
        missing = missing_features(meta.requires, node_cpu())
        if missing:
            cpu = node_cpu()
            raise ToolchainError(
                f"artifact was compiled for CPU features this CPU "
                f"({cpu.model if cpu else 'flags unreadable'}) lacks: {', '.join(missing)}; "
                "it is not loaded here")

    def load(self, entry_dir: str, meta: CompiledArtifact) -> Callable[..., Any]:
        self.check_meta(meta)
        path = os.path.join(entry_dir, meta.files[0])
        register_collective_ops()  # what a graph with collectives calls (host_collectives)
        try:
            runner = _load_package(path)
        except Exception as exc:  # MissingOpLibrary says which kernel library and how to get it
            raise ToolchainError(f"cannot load AOTInductor package {path}: {exc}") from exc
        return _graph_callable(runner, meta)

    def package_of(self, meta: CompiledArtifact) -> str | None:
        return meta.files[0] if meta.files and meta.files[0].endswith(".pt2") else None

    def load_unpacked(self, directory: str, meta: CompiledArtifact) -> Callable[..., Any]:
        """`load` from the package's members unpacked in ``directory`` (compile/tiers/unpacked.py):
        the shared object is opened where it is, nothing is written to ``$TMPDIR``."""
        self.check_meta(meta)
        register_collective_ops()
        try:
            runner = _load_unpacked(directory)
        except Exception as exc:
            raise ToolchainError(
                f"cannot load the unpacked AOTInductor package in {directory}: {exc}") from exc
        return _graph_callable(runner, meta)


@functools.cache
def node_cpu() -> CpuInfo | None:
    """This node's CPU, as /proc/cpuinfo describes it (read once)."""
    return read_cpuinfo()


def _graph_callable(runner: Callable[..., Any], meta: CompiledArtifact) -> Callable[..., Any]:
    """The graph's callable around a loaded program: all ``num_inputs`` in (the derived ones
    dropped), the graph's own output structure out."""
    num_outputs = len(meta.output_shapes)
    derived = frozenset(meta.derived_inputs)
    keep = [i for i in range(meta.num_inputs) if i not in derived]

    def run(*args: Any) -> Any:
        if len(args) != meta.num_inputs:
            raise TypeError(f"compiled graph takes {meta.num_inputs} inputs, got {len(args)}")
        if derived:
            args = tuple(args[i] for i in keep)
        return restore_output_structure(runner(*args), meta.out_spec, num_outputs)

    return run


def export_program(gm: Any, inputs: tuple[Any, ...]) -> tuple[_ExportPlan, Any, Any, list[str]]:
    """``torch.export`` of `gm` for `inputs` as this toolchain compiles it (in this process,
    or in a compile worker: `host_jobs`): the plan, the program, its output spec and the
    user outputs' shapes, checked against each other."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    plan = _export_plan(gm, inputs)
    try:
        with _outside_tracing():
            ep = torch.export.export(plan.gm, plan.args, dynamic_shapes=plan.dynamic_shapes)
    except Exception as exc:
        raise ToolchainError(f"torch.export could not export the graph: {exc}") from exc
    out_spec = ep.call_spec.out_spec
    if out_spec is None:
        raise ToolchainError("the exported program has no output spec")
    shapes = _user_output_shapes(ep)
    if len(shapes) != out_spec.num_leaves:
        raise ToolchainError(f"exported program has {len(shapes)} user outputs but its output "
                             f"spec has {out_spec.num_leaves} leaves")  # fmt: skip
    return plan, ep, out_spec, shapes


def _load_package(path: str) -> Any:
    """``aoti_load_package``, loading the kernel library the graph calls when it is missing
    (a graph traced inside vLLM calls vLLM's CPU kernels; see ``op_libraries``)."""
    aoti_load_package = require_torch("torch._inductor.aoti_load_package")
    try:
        with torch_loader_scratch():  # its aotinductor_* copy unpacked in ours, removed
            return aoti_load_package(path)
    except Exception as exc:
        if not load_for_missing_schema(exc, f"the compiled graph {path}"):
            raise
    with torch_loader_scratch():
        return aoti_load_package(path)


def _load_unpacked(directory: str) -> Callable[..., Any]:
    """torch's package loader (``AOTIModelPackageLoader``, with ``aoti_load_package``'s
    defaults) given the package's members, as a callable of the program's inputs. Without
    ``aoti_load_package``'s Python layer: it imports torch's export-archive stack and runs
    Inductor's ISA probe (seconds, once per process) and parses the call spec on every call."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    # Without it, ToolchainUnavailable: tiers/unpacked.py loads the package instead.
    package_loader = require_torch("torch._C._aoti.AOTIModelPackageLoader")

    def open_loader() -> Any:
        return package_loader(directory, "model", False, 1, -1)

    try:
        loader = open_loader()
    except Exception as exc:
        if not load_for_missing_schema(exc, f"the compiled graph in {directory}"):
            raise
        loader = open_loader()
    tensor = torch.Tensor

    def run(*args: Any) -> Any:
        # As the package loader's own wrapper does: only tensors reach the program.
        return loader.boxed_run([a for a in args if isinstance(a, tensor)])

    return run


# Symbolic inputs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ExportPlan:
    """What to hand torch.export: the graph, concrete arguments, which dims are dynamic."""

    gm: Any
    args: tuple[Any, ...]
    dynamic_shapes: tuple[Any, ...] | None = None
    derived: tuple[int, ...] = ()


def _is_symbolic(value: Any) -> bool:
    # Lazy: torch is heavy and optional; only this path needs it.
    from torch.fx.experimental.symbolic_shapes import is_symbolic

    return bool(is_symbolic(value))


def _hint(value: Any) -> int:
    """The concrete value a (possibly symbolic) size had when the graph was traced."""
    if not _is_symbolic(value):
        return int(value)
    node = value.node
    hint = node.hint
    if hint is None and getattr(node, "shape_env", None) is not None:
        hint = node.shape_env.size_hint(node.expr, allow_none=True)
    if hint is None:
        raise ToolchainError(f"symbolic size {value} has no example value to export with")
    return int(hint)


def _export_plan(gm: Any, inputs: tuple[Any, ...]) -> _ExportPlan:
    """Concrete, exportable arguments for ``inputs``; unchanged when nothing is symbolic."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch
    from torch.export import Dim

    # Without it, every tensor input is exported from a zero-filled real one (same program).
    fake_tensor = resolve("torch._subclasses.fake_tensor.FakeTensor") or torch.Tensor

    def symbolic_tensor(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and (
            isinstance(x, fake_tensor) or any(_is_symbolic(d) for d in x.shape)
        )

    if not any(symbolic_tensor(x) or isinstance(x, torch.SymInt) for x in inputs):
        if calls_functional_collectives(gm):  # rewritten, on a copy (see _derive_integer_inputs)
            return _ExportPlan(_derive_integer_inputs(gm, {}), inputs)
        return _ExportPlan(gm, inputs)

    # Integer inputs that some tensor input carries as a dimension: read them from there.
    derived: dict[int, tuple[int, int]] = {}
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.SymInt):
            continue
        source = next(
            (
                (j, d)
                for j, t in enumerate(inputs)
                if isinstance(t, torch.Tensor)
                for d, size in enumerate(t.shape)
                if _is_symbolic(size) and size.node.expr == x.node.expr  # type: ignore[attr-defined]
            ),
            None,
        )
        if source is None:
            raise ToolchainError(
                f"input {i} is the symbolic integer {x}, which is no dimension of a tensor "
                "input; the host toolchain cannot compile it as a dynamic program"
            )
        derived[i] = source

    args: list[Any] = []
    dynamic: list[Any] = []
    with _outside_tracing():
        for i, x in enumerate(inputs):
            if i in derived:
                continue
            if isinstance(x, torch.Tensor):
                shape = [_hint(d) for d in x.shape]
                stride = [_hint(s) for s in x.stride()]
                real = torch.empty_strided(shape, stride, dtype=x.dtype, device="cpu")
                args.append(real.zero_())
                dims = {d: Dim.AUTO for d, size in enumerate(x.shape) if _is_symbolic(size)}
                dynamic.append(dims or None)
            elif isinstance(x, torch.SymInt):  # pragma: no cover - all derived above
                args.append(_hint(x))
                dynamic.append(None)
            else:
                args.append(x)
                dynamic.append(None)
    # Always a fresh GraphModule: it also has an explicit forward signature, which export
    # needs to match `dynamic_shapes` (a recompiled dynamo graph's is `*args, **kwargs`).
    graph_module = _derive_integer_inputs(gm, derived)
    return _ExportPlan(graph_module, tuple(args), tuple(dynamic), tuple(sorted(derived)))


def exportable_graph(gm: Any) -> Any:
    """A copy of ``gm`` with the rewrites every export of a vLLM piece needs (see
    `_derive_integer_inputs`: ``param.data`` read as the parameter, uninitialised buffers
    zero-filled, collectives routed): the program this toolchain compiles, so the input
    snapshot's reference graph (exported with a captured call's concrete values) computes
    what the compiled artifact computes, and exports at all."""
    return _derive_integer_inputs(gm, {})


def _derive_integer_inputs(gm: Any, derived: Mapping[int, tuple[int, int]]) -> Any:
    """A copy of ``gm`` prepared for export: placeholder ``i`` becomes
    ``sym_size(placeholder j, dim d)`` for each ``i -> (j, d)`` of ``derived``, plus the
    rewrites below.

    The caller's graph is left alone (vLLM keeps it for other compile ranges). These
    rewrites change the compiled program but not the cache key: a change to them must
    also change a key component (e.g. a version in `HostToolchain.versions`).
    """
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch
    import torch.fx

    graph = torch.fx.Graph()
    value_map: dict[Any, Any] = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    for i, (j, d) in sorted(derived.items()):
        with graph.inserting_after(last):
            size = graph.call_function(torch.ops.aten.sym_size.int, (placeholders[j], d))
        placeholders[i].replace_all_uses_with(size)
        graph.erase_node(placeholders[i])
    empty_to_zeros = {torch.empty: torch.zeros, torch.empty_like: torch.zeros_like}
    get_data_attr = resolve("torch._C._autograd._get_data_attr")  # None: keyed as unknown
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if get_data_attr is not None and node.target is get_data_attr:
            # `param.data` is the parameter itself in an inference graph; traced by
            # export it would become an untraceable fake constant.
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in empty_to_zeros:
            # Uninitialised buffers (vLLM's attention output, allocated in one piece,
            # returned through a view and filled by the attention op before the next):
            # zeros are one valid content, and make the program deterministic, so a
            # snapshot's reference outputs replay exactly. The cost is one memset.
            node.target = empty_to_zeros[node.target]
    try:
        route_collectives(graph)  # GIL-free collectives; see host_collectives
    except ValueError as exc:
        raise ToolchainError(str(exc)) from exc
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


@contextlib.contextmanager
def _outside_tracing() -> Iterator[None]:
    """Leave the fake-tensor mode and tracing context of a caller that compiles while
    dynamo traces (vLLM compiles its pieces from inside the dynamo backend call)."""
    tracing = resolve("torch._guards.tracing")
    unset_fake_temporarily = resolve("torch._subclasses.fake_tensor.unset_fake_temporarily")
    if tracing is None or unset_fake_temporarily is None:  # warned: the caller's context
        yield
        return
    with unset_fake_temporarily(), tracing(None):
        yield


def _user_output_shapes(ep: Any) -> list[str]:
    """Shapes of the user-visible outputs, from the exported graph's fake values."""
    # Lazy: torch is heavy and optional; only this path needs it.
    from torch.export.graph_signature import OutputKind

    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    values = output_node.args[0]
    shapes: list[str] = []
    for spec, value in zip(ep.graph_signature.output_specs, values, strict=True):
        if spec.kind != OutputKind.USER_OUTPUT:
            continue  # buffer mutations and the like are not returned to the caller
        val = value.meta.get("val") if hasattr(value, "meta") else value
        shape = getattr(val, "shape", None)
        shapes.append(format_shape(shape) if shape is not None else "")
    return shapes
