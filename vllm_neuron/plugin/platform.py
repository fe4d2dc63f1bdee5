"""The platforms this package gives vLLM (selected by :func:`vllm_neuron.plugin.platform_plugin`).

``NeuronHostPlatform`` (``VLLM_NEURON_HOST_MODE=1``) is vLLM's CPU platform plus this
package's hooks: every piecewise graph vLLM compiles goes through the two-tier compile cache
(host toolchain, AOTInductor), the worker publishes the snapshot forward context and emits
the manifest. It runs the whole artifact system inside a real ``vllm serve`` without
Trainium.

``NeuronPlatform`` is what a machine with Neuron devices gets. Its device side (the worker
and model runner that execute NEFFs) belongs to the Neuron runtime packages, which cannot be
installed here; without them it stops start-up and says what to install.

``vllm.config`` is imported inside methods only: importing it while vLLM resolves its
current platform is a circular import (FACTS.md).
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import Platform, PlatformEnum

from .hooks import COMPILER_ADAPTOR, configure_engine

__all__ = ["CPU_WORKER", "HOST_WORKER", "NeuronHostPlatform", "NeuronPlatform"]

CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
HOST_WORKER = "vllm_neuron.plugin.worker.NeuronHostWorker"


class NeuronHostPlatform(CpuPlatform):
    """vLLM's CPU platform, compiling through this package's cache (host mode)."""

    @classmethod
    def get_compile_backend(cls) -> str:
        return COMPILER_ADAPTOR

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        requested_mode = vllm_config.compilation_config.mode
        super().check_and_update_config(vllm_config)
        configure_engine(
            vllm_config,
            requested_mode=requested_mode,
            base_worker=CPU_WORKER,
            worker=HOST_WORKER,
            backend=cls.get_compile_backend(),
        )


class NeuronPlatform(Platform):
    """Trainium/Inferentia: needs the Neuron runtime packages for its device side."""

    _enum = PlatformEnum.OOT
    device_name: str = "neuron"
    device_type: str = "neuron"
    dispatch_key: str = "XLA"
    dist_backend: str = "gloo"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "neuron"

    @classmethod
    def get_compile_backend(cls) -> str:
        return COMPILER_ADAPTOR

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        from vllm_neuron.compile.toolchains.neuron import INSTALL_HINT, missing_neuron_packages

        missing = missing_neuron_packages()
        if missing:
            raise RuntimeError(
                "vllm_neuron: Neuron devices are present but the Neuron runtime packages are "
                f"not: missing {' and '.join(missing)}; install with: {INSTALL_HINT}. "
                "To run vLLM on this machine's CPU with this package's compile cache, "
                "manifest and snapshots, set VLLM_NEURON_HOST_MODE=1."
            )
        raise RuntimeError(
            "vllm_neuron: the Neuron device worker is provided by the Neuron runtime "
            "integration, not by this package; this package's hooks for it are "
            "vllm_neuron.plugin.hooks (configure_engine, ArtifactWorkerHooks)."
        )
