"""The host toolchain: TorchInductor ahead-of-time compilation (AOTInductor) on CPU.

Why it exists: the Neuron compiler is not installable off Trainium, but the cache's
policy (keys, locks, tiers, manifest) should run for real everywhere. AOTInductor produces
a self-contained ``.pt2`` package per graph, compiles in seconds to a minute, and loads in
a fresh process without the original Python code, which is exactly the shape of a NEFF.

Flow: ``torch.export.export(gm, inputs)`` -> ``aoti_compile_and_package`` -> ``graph.pt2``.
Output shapes come from the exported program's fake-tensor metadata, so the model is never
executed. The exported output pytree spec is recorded so ``load`` returns the graph's own
output structure (tuple, list or a single tensor).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from vllm_neuron.compile.toolchains.base import (
    CompiledArtifact,
    Toolchain,
    ToolchainError,
    ToolchainKind,
    format_shape,
    restore_output_structure,
)

__all__ = ["HostToolchain"]

ARTIFACT_NAME = "graph.pt2"

# CPU features whose presence changes the vector code Inductor emits; an artifact built
# with AVX-512 dies with SIGILL on an AVX2-only node, so they are part of the key.
_CPU_FEATURE_PROBES = (
    ("avx2", "_is_avx2_supported"),
    ("avx512", "_is_avx512_supported"),
    ("avx512_bf16", "_is_avx512_bf16_supported"),
    ("vnni", "_is_vnni_supported"),
    ("amx_tile", "_is_amx_tile_supported"),
    ("amx_fp16", "_is_amx_fp16_supported"),
)


class HostToolchain(Toolchain):
    """AOTInductor on the host CPU."""

    name: ClassVar[ToolchainKind] = "host"

    def __init__(self, inductor_configs: Mapping[str, Any] | None = None) -> None:
        self.target = "cpu-inductor"
        self._inductor_configs = dict(inductor_configs or {})

    def versions(self) -> dict[str, str]:
        import torch

        features = [
            name
            for name, probe in _CPU_FEATURE_PROBES
            if getattr(torch.cpu, probe, lambda: False)()
        ]
        return {
            "torch": str(torch.__version__),
            "machine": platform.machine(),
            "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "cpu_features": ",".join(features),
        }

    def compiler_args(self) -> list[str]:
        return sorted(f"--{k}={v}" for k, v in self._inductor_configs.items())

    def compile(self, gm: Any, example_inputs: Sequence[Any], out_dir: str) -> CompiledArtifact:
        import torch
        import torch.utils._pytree as pytree

        inputs = tuple(example_inputs)
        try:
            ep = torch.export.export(gm, inputs)
        except Exception as exc:
            raise ToolchainError(f"torch.export could not export the graph: {exc}") from exc
        out_spec = ep.call_spec.out_spec
        if out_spec is None:
            raise ToolchainError("the exported program has no output spec")
        shapes = _user_output_shapes(ep)
        if len(shapes) != out_spec.num_leaves:
            raise ToolchainError(
                f"exported program has {len(shapes)} user outputs but its output spec "
                f"has {out_spec.num_leaves} leaves"
            )
        os.makedirs(out_dir, exist_ok=True)
        package_path = os.path.join(out_dir, ARTIFACT_NAME)
        try:
            torch._inductor.aoti_compile_and_package(
                ep,
                package_path=package_path,
                inductor_configs=dict(self._inductor_configs) or None,
            )
        except Exception as exc:
            raise ToolchainError(f"AOTInductor failed to compile the graph: {exc}") from exc
        return CompiledArtifact(
            toolchain=self.name,
            target=self.target,
            files=(ARTIFACT_NAME,),
            output_shapes=tuple(shapes),
            out_spec=pytree.treespec_dumps(out_spec),
            num_inputs=len(inputs),
        )

    def load(self, entry_dir: str, meta: CompiledArtifact) -> Callable[..., Any]:
        self.check_meta(meta)
        import torch

        path = os.path.join(entry_dir, meta.files[0])
        try:
            runner = torch._inductor.aoti_load_package(path)
        except Exception as exc:
            raise ToolchainError(f"cannot load AOTInductor package {path}: {exc}") from exc
        num_outputs = len(meta.output_shapes)

        def run(*args: Any) -> Any:
            if len(args) != meta.num_inputs:
                raise TypeError(f"compiled graph takes {meta.num_inputs} inputs, got {len(args)}")
            return restore_output_structure(runner(*args), meta.out_spec, num_outputs)

        return run


def _user_output_shapes(ep: Any) -> list[str]:
    """Shapes of the user-visible outputs, from the exported graph's fake values."""
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
