"""A host graph compiled in another process: the exported program travels as a file.

The tracing process exports the graph (`export_job`: the same export plan as
`HostToolchain.compile`, then ``torch.export.save``) into a job directory; a compile worker
process loads it (``torch.export.load``) and runs AOTInductor on it (`compile_job`), writing
the same ``graph.pt2`` and the same `CompiledArtifact` as an in-process compile. Export needs
the live graph (fake tensors, the tracing context) and stays with the tracer; AOTInductor's
compile - most of the time - is neither thread-safe nor in need of the tracer, and moves out.
An exported program is also what a remote builder would need.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

import msgspec

from vllm_neuron.compile.toolchains.aoti_wrapper import compile_and_package, prepare_runtime
from vllm_neuron.compile.toolchains.base import CompiledArtifact, ToolchainError, require_torch
from vllm_neuron.compile.toolchains.host import (
    ARTIFACT_NAME,
    HostToolchain,
    _outside_tracing,
    export_program,
)
from vllm_neuron.compile.toolchains.op_libraries import load_for_missing_schema, load_namespaces

__all__ = ["JOB_PROGRAM", "JOB_RECORD", "HostJob", "compile_job", "prepare_host_compiles",
           "export_job"]

JOB_PROGRAM = "program.pt2"
JOB_RECORD = "job.json"


class HostJob(msgspec.Struct, frozen=True):
    """What a worker needs besides the program: the compile's flags and what the artifact
    record says about the graph's inputs and outputs (known at export)."""

    inductor_configs: dict[str, Any]
    out_spec: str
    output_shapes: tuple[str, ...]
    num_inputs: int
    derived_inputs: tuple[int, ...]
    # The torch.ops namespaces the program calls beyond torch's own (vLLM's kernels, this
    # package's collectives): their libraries are loaded before the program is read.
    namespaces: tuple[str, ...] = ()
    # The explicit target the key was computed for, and the CPU features it needs
    # (cpu_target.py): the worker compiles for exactly that.
    cflags: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()


def export_job(toolchain: HostToolchain, gm: Any, example_inputs: Sequence[Any],
               job_dir: str) -> HostJob:  # fmt: skip
    """Export `gm` for `example_inputs` into `job_dir` (program and job record); the
    record."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    treespec_dumps = require_torch("torch.utils._pytree.treespec_dumps")
    inputs = tuple(example_inputs)
    plan, ep, out_spec, shapes = export_program(gm, inputs)
    # Into memory, then written by Python: torch's own file writer aborts the whole process
    # when a write fails (a full temporary directory), where Python raises an OSError.
    buffer = io.BytesIO()
    with _outside_tracing():
        torch.export.save(ep, buffer)
    with open(os.path.join(job_dir, JOB_PROGRAM), "wb") as f:
        f.write(buffer.getbuffer())
    target = toolchain.host_target()
    job = HostJob(inductor_configs=toolchain.inductor_configs, out_spec=treespec_dumps(
        out_spec), output_shapes=tuple(shapes), num_inputs=len(inputs),
        derived_inputs=plan.derived, namespaces=_op_namespaces(ep), cflags=target.cflags,
        requires=target.requires)  # fmt: skip
    with open(os.path.join(job_dir, JOB_RECORD), "wb") as f:
        f.write(msgspec.json.encode(job))
    return job


def compile_job(job_dir: str, out_dir: str) -> CompiledArtifact:
    """Compile the job in `job_dir` into `out_dir` (in a compile worker process)."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    with open(os.path.join(job_dir, JOB_RECORD), "rb") as f:
        job = msgspec.json.decode(f.read(), type=HostJob)
    path = os.path.join(job_dir, JOB_PROGRAM)
    load_namespaces(job.namespaces, f"the exported graph {path}")
    try:
        ep = torch.export.load(path)
    except Exception as exc:  # a graph calling a kernel library this process has not loaded
        if not load_for_missing_schema(exc, f"the exported graph {path}"):
            raise
        ep = torch.export.load(path)
    os.makedirs(out_dir, exist_ok=True)
    try:
        compile_and_package(ep, os.path.join(out_dir, ARTIFACT_NAME), job.inductor_configs,
                            job.cflags)
    except Exception as exc:
        raise ToolchainError(f"AOTInductor failed to compile the graph: {exc}") from exc
    return CompiledArtifact(toolchain=HostToolchain.name, target="cpu-inductor",
                            files=(ARTIFACT_NAME,), output_shapes=job.output_shapes,
                            out_spec=job.out_spec, num_inputs=job.num_inputs,
                            derived_inputs=job.derived_inputs, requires=job.requires)  # fmt: skip


def prepare_host_compiles(out_dir: str) -> bool:
    """What a node's first host compile builds once, built now: a tiny graph is compiled
    (its scratch files in `out_dir`, which the caller throws away) only as far as the
    precompiled headers of AOTInductor's wrapper and kernels and the wrapper's runtime part
    (`aoti_wrapper.prepare_runtime`), all keyed by the same flags as every later compile's.
    True when the runtime part is kept."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    class Tiny(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(x) * 2.0

    _, program, _, _ = export_program(torch.fx.symbolic_trace(Tiny()), (torch.randn(4, 8),))
    with _outside_tracing():
        return prepare_runtime(program, os.path.join(out_dir, ARTIFACT_NAME), {},
                               HostToolchain().host_target().cflags)


_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional",
                               "_c10d_functional_autograd", "higher_order"})  # fmt: skip


def _op_namespaces(ep: Any) -> tuple[str, ...]:
    """The ``torch.ops`` namespaces of the ops `ep`'s graph calls, beyond torch's own."""
    found = {str(namespace) for node in ep.graph.nodes if node.op == "call_function"
             and (namespace := getattr(node.target, "namespace", None)) is not None}
    return tuple(sorted(found - _TORCH_NAMESPACES))
