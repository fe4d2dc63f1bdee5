"""The Neuron toolchain: FX -> HLO (torch_neuronx) -> NEFF (``neuronx-cc``).

Why it is thin: the device-specific steps (lowering through torch-xla, the compiler, the
Neuron runtime) exist only on Trainium hosts, so this module keeps them behind three narrow
calls (``xla_trace``, the ``neuronx-cc`` command line, ``torch.classes.neuron.Model``) and
keeps everything testable off-device pure: availability probing, the compiler command line,
running the compiler, and reading result shapes from HLO text for the manifest.

Selecting this toolchain without the packages fails at construction with
:class:`ToolchainUnavailable` naming what is missing and how to install it, instead of
failing minutes later inside the first compile.

Off-device only the pure parts are exercised by tests; the lowering and the runtime calls
follow torch-neuronx's own ``trace`` implementation and are unverified here.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from vllm_neuron.compile.toolchains.base import (
    CompiledArtifact,
    CompilerKilled,
    Toolchain,
    ToolchainError,
    ToolchainKind,
    ToolchainUnavailable,
    format_shape,
    require_torch,
    restore_output_structure,
)

__all__ = [
    "INSTALL_HINT",
    "LoweredNeuronGraph",
    "NeuronToolchain",
    "missing_neuron_packages",
    "neuronx_cc_command",
    "parse_hlo_entry_result_shapes",
    "run_neuronx_cc",
]

INSTALL_HINT = (
    "pip install neuronx-cc torch-neuronx --extra-index-url https://pip.repos.neuron.amazonaws.com"
)
NEFF_NAME = "graph.neff"
HLO_NAME = "graph.hlo.pb"
METANEFF_NAME = "graph.metaneff.pb"

WhichFn = Callable[[str], "str | None"]
FindSpecFn = Callable[[str], Any]


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def missing_neuron_packages(
    which: WhichFn | None = None, find_spec: FindSpecFn | None = None
) -> list[str]:
    """Human-readable names of the missing Neuron pieces; empty when all are present.

    The probes are injectable (and looked up at call time) so selection logic can be
    tested without the packages.
    """
    which = which or shutil.which
    find_spec = find_spec or _find_spec
    missing: list[str] = []
    if find_spec("torch_neuronx") is None:
        missing.append("torch-neuronx (Python module torch_neuronx)")
    if which("neuronx-cc") is None:
        missing.append("neuronx-cc (the neuronx-cc executable on PATH)")
    return missing


def _unavailable(missing: Sequence[str]) -> ToolchainUnavailable:
    return ToolchainUnavailable(
        "the neuron toolchain is not available: missing "
        + " and ".join(missing)
        + f"; install with: {INSTALL_HINT} (or set VLLM_NEURON_TOOLCHAIN=host to compile "
        "with TorchInductor on the CPU)"
    )


def neuronx_cc_command(
    hlo_path: str,
    neff_path: str,
    target: str,
    compiler_args: Sequence[str] = (),
    executable: str = "neuronx-cc",
) -> list[str]:
    """The compiler command line: ``neuronx-cc compile --framework XLA <hlo> ...``."""
    return [
        executable,
        "compile",
        "--framework",
        "XLA",
        hlo_path,
        "--target",
        target,
        "--output",
        neff_path,
        *compiler_args,
    ]


_RUNNING: set[subprocess.Popen[str]] = set()
_RUNNING_LOCK = threading.Lock()


def _stop_running_compilers() -> None:
    """A process that exits while a thread of its cache runs ``neuronx-cc`` (a server
    stopped during its cold start) stops the compiler too: nobody would publish its NEFF,
    and it would hold the node's memory while the next server's compiles start."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        with contextlib.suppress(OSError):
            proc.kill()


atexit.register(_stop_running_compilers)


def run_neuronx_cc(
    hlo_path: str,
    neff_path: str,
    target: str,
    compiler_args: Sequence[str] = (),
    executable: str | None = None,
    scratch_parent: str | None = None,
) -> list[str]:
    """Run ``neuronx-cc`` and return the command; raise ToolchainError with its output
    (`CompilerKilled` when a signal ended it).

    The compiler runs in a scratch directory (in ``scratch_parent``, default the temporary
    directory) because it drops logs and temporaries in its working directory, and an entry
    must hold only what it declares.
    """
    exe = executable or shutil.which("neuronx-cc")
    if exe is None:
        raise _unavailable(["neuronx-cc (the neuronx-cc executable on PATH)"])
    command = neuronx_cc_command(hlo_path, neff_path, target, compiler_args, exe)
    with tempfile.TemporaryDirectory(prefix="neuronx-cc-", dir=scratch_parent) as scratch:
        proc = subprocess.Popen(command, cwd=scratch, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        try:
            output, _ = proc.communicate()
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
    if proc.returncode != 0:
        tail = output[-4000:]
        reason = {-9: " (killed, often out of memory)", -6: " (aborted)", -11: " (crashed)"}
        error = CompilerKilled if proc.returncode in (-9, -15) else ToolchainError
        raise error(
            f"neuronx-cc exited with {proc.returncode}{reason.get(proc.returncode, '')}: {tail}"
        )
    if not os.path.isfile(neff_path):
        raise ToolchainError(f"neuronx-cc succeeded but wrote no {neff_path}")
    return command


# HLO text -----------------------------------------------------------------------------------

_COMMENT_RE = re.compile(r"/\*.*?\*/", re.S)
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


def _matching_paren(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced parentheses in HLO text")


def _shapes_in(type_text: str) -> list[str]:
    return [
        ", ".join(d.strip() for d in m.group(2).split(",") if d.strip())
        for m in _SHAPE_RE.finditer(type_text)
    ]


def parse_hlo_entry_result_shapes(hlo_text: str) -> list[str]:
    """The result shapes of the ENTRY computation, one ``"4, 8"`` string per array.

    ``ENTRY %main.5 (p0: f32[4,8]) -> (f32[4,8], s32[4]) {`` gives ``["4, 8", "4"]`` and
    ``-> f32[]`` gives ``[""]``. Nested tuples are flattened; layouts (``{1,0}``) and
    ``/*index=5*/`` comments are ignored. When the header has no signature, the ENTRY
    body's ROOT instruction type is used.
    """
    text = _COMMENT_RE.sub("", hlo_text)
    match = re.search(r"^\s*ENTRY\b", text, re.M)
    if match is None:
        raise ValueError("HLO text has no ENTRY computation")
    pos = match.end()
    body = text.index("{", pos) if "{" in text[pos:] else len(text)
    header_paren = text.find("(", pos)
    if 0 <= header_paren < body:
        close = _matching_paren(text, header_paren)
        rest = text[close + 1 :]
        arrow = re.match(r"\s*->\s*", rest)
        if arrow:
            result = rest[arrow.end() :]
            if result.startswith("("):
                return _shapes_in(result[: _matching_paren(result, 0) + 1])
            single = _SHAPE_RE.match(result)
            if single:
                return _shapes_in(single.group(0))
    root = re.search(r"\bROOT\s+%?[\w.\-]+\s*=\s*", text[pos:])
    if root is None:
        raise ValueError("cannot find the ENTRY result type in HLO text")
    result = text[pos + root.end() :]
    if result.startswith("("):
        return _shapes_in(result[: _matching_paren(result, 0) + 1])
    single = _SHAPE_RE.match(result)
    if single is None:
        raise ValueError("cannot parse the ENTRY ROOT type in HLO text")
    return _shapes_in(single.group(0))


def _proto_result_shapes(hlo: Any) -> list[str]:
    """Result shapes from an HloModuleProto's entry computation program shape."""
    entry = next(c for c in hlo.computations if c.id == hlo.entry_computation_id)
    result = entry.program_shape.result

    def flat(shape: Any) -> list[str]:
        if len(shape.tuple_shapes):
            return [s for sub in shape.tuple_shapes for s in flat(sub)]
        return [format_shape(list(shape.dimensions))]

    return flat(result)


# Toolchain ----------------------------------------------------------------------------------


class LoweredNeuronGraph:
    """A graph lowered to HLO (`NeuronToolchain.lower`), waiting for ``neuronx-cc``: what a
    thread of the cache runs while the tracing thread lowers the next graph. The compiler is
    a process of its own, so compiles of different graphs run side by side (as many as the
    node's compile slots allow)."""

    def __init__(self, work_dir: str, artifact: CompiledArtifact,
                 compiler_args: Sequence[str]) -> None:  # fmt: skip
        self.work_dir = work_dir
        self.artifact = artifact
        self._compiler_args = list(compiler_args)

    def compile(self, out_dir: str) -> CompiledArtifact:
        os.makedirs(out_dir, exist_ok=True)
        for name in (HLO_NAME, METANEFF_NAME):
            shutil.copyfile(os.path.join(self.work_dir, name), os.path.join(out_dir, name))
        run_neuronx_cc(os.path.join(self.work_dir, "model"), os.path.join(out_dir, NEFF_NAME),
                       self.artifact.target, self._compiler_args,
                       scratch_parent=self.work_dir)  # fmt: skip
        return self.artifact



def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


class NeuronToolchain(Toolchain):
    """neuronx-cc on Trainium; constructing it checks that its packages are installed."""

    name: ClassVar[ToolchainKind] = "neuron"

    def __init__(
        self,
        target: str = "trn2",
        extra_compiler_args: Sequence[str] = (),
        *,
        which: WhichFn | None = None,
        find_spec: FindSpecFn | None = None,
    ) -> None:
        missing = missing_neuron_packages(which, find_spec)
        if missing:
            raise _unavailable(missing)
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", target):
            raise ValueError(f"invalid Neuron target {target!r}")
        self.target = target
        self._extra_args = list(extra_compiler_args)

    def versions(self) -> dict[str, str]:
        return {
            "torch": _dist_version("torch"),
            "torch-neuronx": _dist_version("torch-neuronx"),
            "neuronx-cc": _dist_version("neuronx-cc"),
            "nki": _dist_version("nki"),
        }

    def compiler_args(self) -> list[str]:
        return list(self._extra_args)

    def compile(self, gm: Any, example_inputs: Sequence[Any], out_dir: str) -> CompiledArtifact:
        with tempfile.TemporaryDirectory(prefix="neuron-model-") as work_dir:
            return self.lower(gm, example_inputs, work_dir).compile(out_dir)

    def lower(self, gm: Any, example_inputs: Sequence[Any], work_dir: str) -> LoweredNeuronGraph:
        """FX -> HLO with torch-neuronx, in the tracing thread; the HLO, its metaneff and the
        compiler's model folder (the HLO with its constants, the weights) go in ``work_dir``.
        `LoweredNeuronGraph.compile` runs ``neuronx-cc`` on them from any thread."""
        # Lazy: torch is heavy and optional; only this path needs it.
        import torch.fx

        try:
            # Lazy: torch-neuronx is heavy and optional; only this path needs it.
            from torch_neuronx.xla_impl.hlo_conversion import xla_trace
            from torch_neuronx.xla_impl.trace import hlo_metaneff, write_params
        except ImportError as exc:
            raise _unavailable([f"a usable torch-neuronx ({exc})"]) from exc

        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        leaves, spec = require_torch("torch.utils._pytree.tree_flatten")(output_node.args[0])
        if any(not isinstance(leaf, torch.fx.Node) for leaf in leaves):
            raise ToolchainError("graphs returning Python constants are not supported")

        traced = xla_trace(gm, tuple(example_inputs))
        hlo, input_names, constants, _flattener, _packer, aliases = traced
        if aliases:
            raise ToolchainError("graphs that mutate their inputs are not supported")
        shapes = _proto_result_shapes(hlo)
        if len(shapes) != len(leaves):
            raise ToolchainError(f"HLO returns {len(shapes)} arrays, graph {len(leaves)}")

        hlo_bytes = hlo.SerializeToString()
        os.makedirs(work_dir, exist_ok=True)
        with open(os.path.join(work_dir, HLO_NAME), "wb") as f:
            f.write(hlo_bytes)
        metaneff = hlo_metaneff(hlo, input_names, aliases)
        with open(os.path.join(work_dir, METANEFF_NAME), "wb") as f:
            f.write(metaneff.SerializeToString())
        # The compiler reads the HLO with its constants (weights) from a model folder;
        # the folder is scratch, the constants end up inside the NEFF.
        model_dir = os.path.join(work_dir, "model")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "graph.hlo"), "wb") as f:
            f.write(hlo_bytes)
        weights = write_params(model_dir, constants)
        with open(os.path.join(model_dir, "metadata.json"), "w") as f:
            json.dump({"model_files": "graph.hlo", "version": "1.0", "weights": weights}, f)
        artifact = CompiledArtifact(
            toolchain=self.name,
            target=self.target,
            files=(NEFF_NAME, METANEFF_NAME),
            output_shapes=tuple(shapes),
            out_spec=require_torch("torch.utils._pytree.treespec_dumps")(spec),
            num_inputs=len(example_inputs),
            hlo_file=HLO_NAME,
        )
        return LoweredNeuronGraph(work_dir, artifact, self._extra_args)

    def load(self, entry_dir: str, meta: CompiledArtifact) -> Callable[..., Any]:
        self.check_meta(meta)
        # Lazy: torch is heavy and optional; only this path needs it.
        import torch

        try:
            import torch_neuronx  # noqa: F401  (registers torch.classes.neuron)
        except ImportError as exc:
            raise _unavailable([f"a usable torch-neuronx ({exc})"]) from exc
        with open(os.path.join(entry_dir, NEFF_NAME), "rb") as f:
            neff = f.read()
        with open(os.path.join(entry_dir, METANEFF_NAME), "rb") as f:
            metaneff = f.read()
        model = torch.classes.neuron.Model(neff, metaneff)
        num_outputs = len(meta.output_shapes)

        def run(*args: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            result = torch.ops.neuron.forward_v2(tensors, model)
            return restore_output_structure(result, meta.out_spec, num_outputs)

        return run
