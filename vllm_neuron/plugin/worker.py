"""The host-mode worker: vLLM's CPU worker plus this package's runner and warm-up hooks."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from vllm_neuron.envs import host_mode_settings
from vllm_neuron.vllm_internals import resolve

from .hooks import ArtifactWorkerHooks

__all__ = ["NeuronHostWorker"]

logger = logging.getLogger("vllm_neuron.plugin")

CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"

# Through the fence (vllm_internals.py). Not as fenced (its constructor or a method we
# override changed), `NeuronHostWorker` is vLLM's own worker, without hooks (the fence warned
# once); missing, it is None, as vLLM's CPU platform, which names that path, fails too (a
# vLLM that moved it names the new path, and the host platform keeps that worker).
_base: Any = resolve(CPU_WORKER)


def _stock_worker() -> Any:
    module, _, name = CPU_WORKER.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


class _HostWorker(ArtifactWorkerHooks, _base or object):  # type: ignore[misc]
    """``CPUWorker`` that publishes the snapshot forward context and emits the manifest.

    Before anything builds the model, it has vLLM build the vocab-parallel embedding whose
    piece is one graph on every tensor-parallel rank (`vocab_embedding.py`), unless
    VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING=0; and, once its device is set up (its
    tensor-parallel group known, so its share of the node's compile slots is), on a node whose
    local tier was empty before that set-up it starts its compile workers (when it has any:
    a share of more than one slot, `CompileRuntime.compiles_in_background`), whose start-up
    then runs while the model loads - unless the remote records this rank's graphs of this
    deployment: they are fetched meanwhile instead (compile/head_start.py).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if host_mode_settings().rank_independent_embedding:
            _install_rank_independent_embedding()
        super().__init__(*args, **kwargs)

    def init_device(self) -> None:
        # Looked at before the device is set up: setting it up joins this rank to the others
        # (their process group's rendezvous), so no rank of this engine has begun fetching
        # into the node's shared local tier yet - a rank that looked afterwards could find
        # another's fetched entries there and take this new node for a warm one.
        tier_was_empty = _local_tier_holds_no_entry()
        super().init_device()
        # Read once, before vLLM changes its configuration any further (an auto-fitted
        # maximum length...): the record written after warm-up is the one looked up here.
        self.vllm_neuron_deployment = _begin_before_the_model_loads(
            self.vllm_config, self.rank, tier_was_empty)


_HostWorker.__name__ = _HostWorker.__qualname__ = "NeuronHostWorker"
NeuronHostWorker: Any = _HostWorker if _base is not None else _stock_worker()


def _local_tier_holds_no_entry() -> bool | None:
    """Whether the configured local tier holds no entry now - the directory the first
    process's CPU probe decided on (head_start.py), also when this process will write to a
    stand-in beside a read-only one; None when that could not be told (a malformed setting:
    the runtime's own start says so, naming it), and the runtime then looks itself."""
    from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir, holds_entries
    from vllm_neuron.envs import compile_cache_settings

    try:
        return not holds_entries(get_neuron_compile_cache_dir(compile_cache_settings()))
    except Exception as exc:  # noqa: BLE001 - a head start's guess, never a need
        logger.debug("vllm_neuron: the local tier was not looked at early: %s", exc)
        return None


def _begin_before_the_model_loads(vllm_config: Any, rank: int, tier_was_empty: bool | None
                                  ) -> tuple[str | None, int]:  # fmt: skip
    """On a node whose local tier held no entry before this rank set up its device
    (`tier_was_empty`): fetch this rank's graphs in the background when the remote records
    them for this deployment, else start the compile workers early
    (`CompileRuntime.start_for_deployment`). The deployment and this rank's place in it."""
    # Lazy: the runtime's assembly reads every setting, once this process is a worker.
    from vllm_neuron.assembly import get_runtime
    from vllm_neuron.envs import ConfigError

    from .deployment import deployment_of, rank_in_deployment

    deployment, rank = deployment_of(vllm_config), rank_in_deployment(vllm_config, rank)
    logger.info("vllm_neuron: deployment %s, rank %d", deployment or "unknown", rank)
    try:
        began = get_runtime().start_for_deployment(deployment, rank,
                                                   tier_was_empty=tier_was_empty)
    except ConfigError:
        return deployment, rank  # a malformed setting: the first compile says it, naming it
    except Exception as exc:  # noqa: BLE001 - an early start is a head start, never a need
        logger.warning("vllm_neuron: nothing begun before the model loads: %s", exc)
        return deployment, rank
    if began == "workers":
        logger.info("vllm_neuron: this node's local tier holds no entry: compile workers "
                    "start now, while the model loads")
    elif began is not None:
        logger.info("vllm_neuron: this node's local tier holds no entry, the remote tier "
                    "records this rank's %s graphs of this deployment: fetched while the "
                    "model loads, no compile worker started", began.split()[1])
    return deployment, rank


def _install_rank_independent_embedding() -> None:
    try:
        # Lazy: it imports vLLM's layer internals; a vLLM that moved them keeps its layer.
        from .vocab_embedding import install_rank_independent_embedding
    except ImportError as exc:
        logger.warning(
            "vllm_neuron: vLLM's vocab-parallel embedding is not the layer this package "
            "knows (%s): kept as is, its piece compiles once per rank", exc,
        )  # fmt: skip
        return
    install_rank_independent_embedding()
