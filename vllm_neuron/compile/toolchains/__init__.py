"""Toolchains turn a traced FX graph into an artifact directory and load it back.

``host`` is TorchInductor (AOTInductor) on the CPU, ``neuron`` is neuronx-cc; see
:func:`select_toolchain`.
"""

from vllm_neuron.compile.toolchains.base import (
    CompiledArtifact,
    Toolchain,
    ToolchainError,
    ToolchainUnavailable,
)
from vllm_neuron.compile.toolchains.select import select_toolchain

__all__ = [
    "CompiledArtifact",
    "Toolchain",
    "ToolchainError",
    "ToolchainUnavailable",
    "select_toolchain",
]
