"""The platform this package gives vLLM (selected by :func:`vllm_neuron.plugin.platform_plugin`).

``NeuronHostPlatform`` (``VLLM_NEURON_HOST_MODE=1``) is vLLM's CPU platform plus this
package's hooks: every piecewise graph vLLM compiles goes through the two-tier compile cache
(host toolchain, AOTInductor), the worker publishes the snapshot forward context and emits
the manifest. It runs the whole artifact system inside a real ``vllm serve`` without
Trainium.

There is no Neuron device platform here: its device side (the worker and model runner that
execute NEFFs) belongs to the Neuron runtime integration, so on a Neuron host the platform
plugin claims nothing and vLLM selects that integration's platform (or its own).

``vllm.config`` is imported inside methods only: importing it while vLLM resolves its
current platform is a circular import.
"""

from __future__ import annotations

from typing import Any

from vllm_neuron.envs import INTERNAL_MARKERS, OWN_SETTINGS
from vllm_neuron.vllm_internals import require, resolve

from .hooks import COMPILER_ADAPTOR, configure_engine

__all__ = ["CPU_WORKER", "HOST_WORKER", "NeuronHostPlatform"]

CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
HOST_WORKER = "vllm_neuron.plugin.worker.NeuronHostWorker"

# The platform plugin names this class only when vLLM's CPU platform is as fenced
# (vllm_internals.py); named anyway, the import says which name is not.
CpuPlatform: Any = require("vllm.platforms.cpu.CpuPlatform")


def adaptor_usable() -> bool:
    """Whether vLLM's compiler interface and compile mode are as the adaptor was written
    against; when not, the host platform compiles as vLLM's CPU platform does (warned once
    per name by the fence)."""
    return all(resolve(name) is not None for name in (
        "vllm.compilation.compiler_interface.CompilerInterface",
        "vllm.config.CompilationMode"))


class NeuronHostPlatform(CpuPlatform):
    """vLLM's CPU platform, compiling through this package's cache (host mode)."""

    # vLLM's hook for variables its Ray executor copies to the workers (beyond VLLM_*, HF_*
    # and the names registered in vllm.envs): this package's settings, NEURON_* ones
    # included, and the markers the first process sets for the processes it starts.
    additional_env_vars: list[str] = [*OWN_SETTINGS, *INTERNAL_MARKERS]

    @classmethod
    def get_compile_backend(cls) -> str:
        return COMPILER_ADAPTOR if adaptor_usable() else str(super().get_compile_backend())

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        requested_mode = vllm_config.compilation_config.mode
        super().check_and_update_config(vllm_config)
        configure_engine(
            vllm_config,
            requested_mode=requested_mode,
            base_worker=CPU_WORKER,
            worker=HOST_WORKER,
            backend=COMPILER_ADAPTOR if adaptor_usable() else None,
        )
        # Lazy: the package imports this module's parent first.
        from . import start_cpu_probe_for_engine

        start_cpu_probe_for_engine(vllm_config)

