"""What a capture is asked to do: its options, and the workload and server derived from them.

`vllm-neuron profile capture` maps its flags onto `CaptureOptions`; `build_workload` and
`build_serve_config` turn them into the run spec's workload and serve config, refusing
combinations that can never produce the phase asked for (before anything is launched).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.envs import ProfilingSettings

from . import artifacts as artifacts_mod
from .run_spec import (
    DECODE_ONLY_CONNECTOR,
    DEFAULT_ACTIVITIES,
    DEFAULT_ENTRYPOINT,
    PREFILL,
    ServeConfig,
    Workload,
    profiler_settings,
)

FALLBACK_MODES = ("auto", "never", "always")
# Profiling windows per server launch. A window misses its phase only when the host is so
# busy that the trigger's evidence goes stale (see `recipes`), so one or two more windows
# are what a loaded host needs, and a capture that misses three is reported, not retried
# forever.
DEFAULT_MAX_WINDOWS = 3


@dataclass
class CaptureOptions:
    """Everything a capture needs; `vllm-neuron profile capture` maps its flags onto it."""

    recipe: str
    model: str
    project_root: str | None = None
    run_name: str | None = None
    profiler: str = "auto"
    # serving
    host: str = "127.0.0.1"
    port: int = 8041
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    distributed_executor_backend: str | None = None
    extra_args: list[str] = field(default_factory=list)
    entrypoint: list[str] | None = None
    server_env: dict[str, str] = field(default_factory=dict)
    activities: list[str] = field(default_factory=lambda: list(DEFAULT_ACTIVITIES))
    model_env: list[str] = field(default_factory=list)
    # workload
    input_len: int = 128
    output_len: int | None = None
    concurrency: int | None = None
    num_requests: int | None = None
    # decode trigger and fallback
    stats_interval: float | None = None
    decode_fallback: str = "auto"
    decode_connector: dict[str, Any] = field(default_factory=lambda: dict(DECODE_ONLY_CONNECTOR))
    fallback_patience: int = 12
    # profiling windows per server launch (see DEFAULT_MAX_WINDOWS)
    max_windows: int = DEFAULT_MAX_WINDOWS
    # time limits (seconds)
    ready_timeout: float = 3600.0
    request_timeout: float = 600.0
    start_profile_timeout: float = 60.0
    stop_profile_timeout: float = 180.0
    teardown_grace: float = 30.0


def detect_profiler() -> str:
    """``neuron`` on a machine with Neuron devices, otherwise vLLM's ``torch`` profiler."""
    if os.path.exists("/dev/neuron0") or shutil.which("neuron-ls"):
        return artifacts_mod.NEURON
    return artifacts_mod.TORCH


def build_workload(opts: CaptureOptions, recipe: str) -> Workload:
    if recipe == PREFILL:
        if opts.output_len not in (None, 1):
            raise ValueError("prefill isolation sends one request with output length 1")
        if opts.concurrency not in (None, 1) or opts.num_requests not in (None, 1):
            raise ValueError("prefill isolation sends exactly one request (concurrency 1)")
        return Workload(input_len=opts.input_len, output_len=1, concurrency=1, num_requests=1)
    concurrency = opts.concurrency or 4
    workload = Workload(
        input_len=opts.input_len,
        output_len=opts.output_len or 256,
        concurrency=concurrency,
        num_requests=opts.num_requests or concurrency * 2,
    )
    if workload.output_len < 2:
        raise ValueError("decode isolation needs an output length of at least 2")
    if workload.num_requests < workload.concurrency:
        raise ValueError("num_requests must be at least the concurrency")
    if (opts.max_num_seqs is not None and opts.concurrency
            and opts.max_num_seqs < opts.concurrency):
        raise ValueError(
            f"--max-num-seqs {opts.max_num_seqs} is below the concurrency "
            f"{opts.concurrency}: Running can never reach the target"
        )
    return workload


def build_serve_config(opts: CaptureOptions, profiler: str, output_dir: str) -> ServeConfig:
    """The server's configuration, its profiler writing into `output_dir` (a real directory:
    the capture hands the run store's ``output/`` to the server through the store's door)."""
    profiler_config, additional = profiler_settings(
        profiler, output_dir, activities=opts.activities
    )
    env = dict(opts.server_env)
    if opts.stats_interval is not None:
        env["VLLM_LOG_STATS_INTERVAL"] = f"{opts.stats_interval:g}"
    if profiler == artifacts_mod.NEURON:
        # At the 5 s default, workers die before the runtime flushes its system traces.
        env.setdefault("VLLM_NEURON_WORKER_TERMINATION_TIMEOUT", "60")
    return ServeConfig(
        model=opts.model,
        served_model_name=opts.served_model_name,
        host=opts.host,
        port=opts.port,
        tensor_parallel_size=opts.tensor_parallel_size,
        max_model_len=opts.max_model_len,
        max_num_seqs=opts.max_num_seqs,
        enforce_eager=opts.enforce_eager,
        distributed_executor_backend=opts.distributed_executor_backend,
        profiler_config=profiler_config,
        additional_config=additional,
        extra_args=list(opts.extra_args),
        entrypoint=list(opts.entrypoint or DEFAULT_ENTRYPOINT),
        env=env,
    )


def server_environment(
    cfg: ServeConfig, settings: ProfilingSettings, base: dict[str, str] | None = None
) -> tuple[dict[str, str], str | None]:
    """The server's environment and the PATH prefix that was put first (if any)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("HF_HOME", settings.hf_home)
    prefix = None
    if settings.venv_path:
        prefix = os.path.join(settings.venv_path, "bin")
        env["PATH"] = prefix + os.pathsep + env.get("PATH", "")
        env["VIRTUAL_ENV"] = settings.venv_path
    env.update(cfg.env)
    return env, prefix
