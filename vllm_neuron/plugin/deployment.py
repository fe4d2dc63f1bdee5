"""Which deployment a vLLM engine is, as the remote tier's deployment records name it.

A new node of a known deployment fetches its graphs instead of compiling them
(compile/tiers/deployments.py, compile/head_start.py), if it can tell, before tracing, that
the fleet has started this deployment before. The deployment is a digest of what makes its
graphs and can be read from vLLM's configuration before the model loads: the model's
architecture (its Hugging Face configuration, without the names of where it was loaded
from), dtype, maximum length, tensor- and pipeline-parallel sizes, vLLM's compilation mode
and sizes, the versions
of Python, torch, vLLM and this package, the machine and its CPU's feature flags, and the
toolchain. What differs between the pods of one deployment - the
model's path, host name, port, served name, KV-cache size, cache roots - is not in it.

It is a guess's input, not a key: two deployments with one digest would share a record (one
node then skips a head start, or fetches a graph it does not use); a deployment whose
digest changed with nothing else (a new vLLM release) starts as a cold one once. When the
configuration cannot be read as expected (a vLLM that moved a field) there is no deployment,
and a start behaves as it did before these records: no guess, no harm.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import platform
import sys
from typing import Any

__all__ = ["deployment_of", "rank_in_deployment", "ranks_of"]

logger = logging.getLogger("vllm_neuron.plugin")

WHERE_FROM = ("_name_or_path", "name_or_path", "_commit_hash", "transformers_version")
"""Hugging Face configuration fields that say where a model was loaded from, not what it is."""


def deployment_of(vllm_config: Any) -> str | None:
    """The deployment `vllm_config` describes (32 hex digits; see the module), or None when
    its configuration cannot be read (said at debug level)."""
    try:
        facts = _facts(vllm_config)
        text = json.dumps(facts, sort_keys=True, default=str)
    except Exception as exc:  # noqa: BLE001 - no deployment: a start as before
        logger.debug("vllm_neuron: no deployment digest for this engine: %s", exc)
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def ranks_of(vllm_config: Any) -> int:
    """How many ranks one engine of the deployment has (tensor x pipeline parallel)."""
    parallel = vllm_config.parallel_config
    return int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)


def rank_in_deployment(vllm_config: Any, rank: int) -> int:
    """A worker's rank within its engine (data-parallel engines share one record each)."""
    return int(rank) % max(1, ranks_of(vllm_config))


def _facts(vllm_config: Any) -> dict[str, Any]:
    import torch

    from vllm_neuron.compile.toolchains.cpu_target import read_cpuinfo
    from vllm_neuron.envs import load_compile_cache_settings
    from vllm_neuron.version import __version__

    model = vllm_config.model_config
    architecture = {k: v for k, v in model.hf_config.to_dict().items() if k not in WHERE_FROM}
    compilation = vllm_config.compilation_config
    cpu = read_cpuinfo()
    return {
        "architecture": architecture,
        "dtype": str(model.dtype),
        "max_model_len": model.max_model_len,
        "ranks": [int(vllm_config.parallel_config.tensor_parallel_size),
                  int(vllm_config.parallel_config.pipeline_parallel_size)],
        # As the API server reads it when vLLM configures the platform and the workers read it
        # before the model loads: the fields both see alike (the batched-token limit and the
        # compile ranges' endpoints are not yet settled in the former).
        "compilation": [str(compilation.mode), str(compilation.compile_sizes)],
        "versions": [sys.version, torch.__version__, _version_of("vllm"), __version__,
                     platform.machine()],
        "cpu": sorted(cpu.flags) if cpu is not None else None,
        "toolchain": load_compile_cache_settings().toolchain,
    }


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
