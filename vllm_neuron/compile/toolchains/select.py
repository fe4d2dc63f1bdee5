"""Pick the toolchain that compiles graphs: ``auto`` | ``host`` | ``neuron``.

``auto`` means "the real thing when it is installed": Neuron when torch-neuronx and
neuronx-cc are present, otherwise TorchInductor on the host, so the same deployment
configuration works on Trainium and on a laptop. An explicit ``neuron`` never falls back:
asking for Neuron where it is missing is an error that says what to install.
"""

from __future__ import annotations

from vllm_neuron.compile.toolchains.base import Toolchain
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.compile.toolchains.neuron import NeuronToolchain, missing_neuron_packages
from vllm_neuron.envs import TOOLCHAIN_NAMES, ToolchainName, compile_cache_settings

__all__ = ["select_toolchain"]


def select_toolchain(name: ToolchainName | None = None) -> Toolchain:
    """The toolchain called ``name``; ``None`` reads VLLM_NEURON_TOOLCHAIN."""
    if name is None:
        name = compile_cache_settings().toolchain
    if name not in TOOLCHAIN_NAMES:
        raise ValueError(f"unknown toolchain {name!r}; use one of {', '.join(TOOLCHAIN_NAMES)}")
    if name == "host":
        return HostToolchain()
    if name == "neuron" or not missing_neuron_packages():
        return NeuronToolchain()
    return HostToolchain()
