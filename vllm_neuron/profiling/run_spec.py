"""The run specification (``run_spec.json``): the input contract of one capture.

Written at **launch**, before the server starts compiling, so it survives a failed launch.
``serve_config`` is the source of truth: the server's command line is derived from it by
`serve_command` and never built separately, so what is recorded cannot drift from what
ran. The decode-only fallback's KV-transfer connector is recorded next to it
(``kv_transfer``), never merged into it, so a drift check still sees the pinned serving
configuration served unmodified.

What is written holds no secret (`encode_run_spec`): the values of credentials in
``serve_config`` (its ``env``, ``extra_args``, ``model``), ``model_env`` and the launch's
``argv`` are ``<redacted>``, their names kept.

`RunSpec` is a `Document` of the record layer: the guide fixes ``schema_version`` as its
version field, and a later version is read by an upcaster registered for ``RUN_SPEC_TAG``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from vllm_neuron.backends import PRIVATE_FILE, Store
from vllm_neuron.backends.records import Document, RecordCodec, encode_document
from vllm_neuron.envs import environment_with, redact_config

from .artifacts import NEURON, TORCH
from .layout import RUN_SPEC_FILE

SCHEMA_VERSION = 1
RUN_SPEC_TAG = "run-spec"  # the upcaster registry's name for this document
PREFILL = "prefill_isolation"
DECODE = "decode_isolation"
RECIPES = (PREFILL, DECODE)
PHASES = {PREFILL: "prefill", DECODE: "decode"}
RECIPE_ALIASES = {"prefill": PREFILL, "decode": DECODE, PREFILL: PREFILL, DECODE: DECODE}

DEFAULT_ENTRYPOINT = ("python", "-m", "vllm.entrypoints.openai.api_server")
# The smallest window that keeps collective-operation analysis possible (seed: at 1 the
# CcOp table is empty), and the correct value for both recipes.
MAX_ITERATIONS = 2
DEFAULT_ACTIVITIES = ("device_profile", "system_profile")

# Environment variables that change the compiled graphs or what a capture records; their
# values at launch are snapshotted into ``model_env`` (unset ones as null).
DEFAULT_MODEL_ENV = (
    "XLA_IR_DEBUG",
    "XLA_HLO_DEBUG",
    "NEURON_FRAMEWORK_DEBUG",
    "NEURON_CC_FLAGS",
    "NEURON_RT_ENABLE_DGE_NOTIFICATIONS",
    "VLLM_NEURON_RESERVED_HEADROOM_GIB",
    "VLLM_NEURON_MIN_KV_BUDGET_GIB",
    "VLLM_NEURON_WORKER_TERMINATION_TIMEOUT",
)

# vLLM's decode-benchmark connector fills every prompt's KV cache except the last token
# with dummy values, so no real prefill is ever computed (vLLM 0.32:
# vllm/distributed/kv_transfer/kv_connector/v1/decode_bench_connector.py).
DECODE_ONLY_CONNECTOR: dict[str, Any] = {
    "kv_connector": "DecodeBenchConnector",
    "kv_role": "kv_both",
}


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """What the recipe drives. Prefill isolation uses one request of ``output_len`` 1."""

    endpoint: str = "/v1/chat/completions"
    input_len: int = 128
    output_len: int = 1
    concurrency: int = 1
    num_requests: int = 1
    ignore_eos: bool = True


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The structured serving configuration; `serve_command` derives the command line."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8041
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    distributed_executor_backend: str | None = None
    profiler_config: dict[str, Any] = msgspec.field(default_factory=dict)
    additional_config: dict[str, Any] | None = None
    extra_args: list[str] = msgspec.field(default_factory=list)
    entrypoint: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_ENTRYPOINT))
    env: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def request_model(self) -> str:
        """The ``model`` field requests must carry."""
        return self.served_model_name or self.model


class KVTransfer(msgspec.Struct, frozen=True, kw_only=True):
    """The decode-only fallback's connector, recorded next to ``serve_config``."""

    config: dict[str, Any]
    reason: str = ""


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """How the server process was started (resolved at launch)."""

    argv: list[str]
    cwd: str | None = None
    path_prefix: str | None = None
    executable: str | None = None
    attempt: int = 1


class RunSpec(Document, frozen=True, kw_only=True):
    record_tag = RUN_SPEC_TAG
    version_field = "schema_version"

    schema_version: int = SCHEMA_VERSION
    run_name: str
    phase: str
    recipe: str
    workload: Workload
    serve_config: ServeConfig
    model_env: dict[str, str | None] = msgspec.field(default_factory=dict)
    profiler: str = TORCH
    kv_transfer: KVTransfer | None = None
    launch: Launch | None = None
    project_root: str = ""
    created_at: str = ""


def normalize_recipe(name: str) -> str:
    try:
        return RECIPE_ALIASES[name]
    except KeyError:
        raise ValueError(
            f"unknown recipe {name!r}; use one of prefill, decode ({', '.join(RECIPES)})"
        ) from None


def profiler_settings(
    profiler: str, output_dir: str, *, activities: Iterable[str] = DEFAULT_ACTIVITIES
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(profiler_config, additional_config)`` arming ``profiler`` into `output_dir`.

    Both recipes record ``max_iterations 2``: the first two engine steps after
    ``/start_profile``. On Neuron, ``"profiler": "cuda"`` is the slot the plugin
    reinterprets as the Neuron profiler, configured by the ``neuron_profiler`` block, with
    ``delay_iterations 0`` (armed on the next iteration). With vLLM's torch profiler the
    traces go to ``torch_profiler_dir`` and the API server's own CPU trace (which ignores the
    iteration window) is left out, and ``delay_iterations`` is 1: vLLM then starts the
    profiler inside the first step after ``/start_profile`` instead of at the call, and that
    step is still the first one recorded, so the window holds the same two steps. What it
    leaves out is the idle worker between the call and that step, whose polling loop the
    Python tracer (``with_stack``) records at hundreds of thousands of events a second: a
    window that opened after its batch ended (see `recipes`) otherwise grows to tens of MB
    before its stop, and exporting that can outlast ``--stop-profile-timeout`` on a busy
    host. Delayed, such a window records nothing and writes no trace.
    """
    output_dir = os.path.abspath(output_dir)
    window = {"delay_iterations": 0, "max_iterations": MAX_ITERATIONS}
    if profiler == TORCH:
        return (
            {"profiler": "torch", "torch_profiler_dir": output_dir, "ignore_frontend": True,
             **window, "delay_iterations": 1},
            None,
        )
    if profiler == NEURON:
        block = {
            "activities": list(activities),
            "neuron_cores": [0],  # worker ranks, not physical cores: one rank of one replica
            "output_dir": output_dir,
        }
        return {"profiler": "cuda", **window}, {"neuron_profiler": block}
    raise ValueError(f"unknown profiler {profiler!r}; use torch or neuron")


def _json_arg(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def serve_command(cfg: ServeConfig, kv_transfer: KVTransfer | None = None) -> list[str]:
    """The server's argv, derived from `cfg` (plus the fallback connector, if any)."""
    argv = [*cfg.entrypoint, "--model", cfg.model, "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    argv += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.distributed_executor_backend:
        argv += ["--distributed-executor-backend", cfg.distributed_executor_backend]
    if cfg.profiler_config:
        argv += ["--profiler-config", _json_arg(cfg.profiler_config)]
    if cfg.additional_config:
        argv += ["--additional-config", _json_arg(cfg.additional_config)]
    argv += list(cfg.extra_args)
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", _json_arg(kv_transfer.config)]
    return argv


def snapshot_model_env(
    names: Iterable[str], environ: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """The launch-time values of the declared variables (null when unset); a secret's
    value is redacted when the spec is written (`encode_run_spec`)."""
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name in sorted(set(names))}


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def encode_run_spec(value: RunSpec) -> bytes:
    """The spec as ``run_spec.json`` holds it: with every secret redacted
    (`vllm_neuron.envs.secrets`). A server's command line and environment are where
    credentials are passed (``--hf-token``, ``--server-env HF_TOKEN=...``, a URL with
    ``user:pass@``), and ``model_env`` may name any variable; the names are kept, the values
    become ``<redacted>``, looked up in this process's environment and the server's own."""
    secrets = environment_with({**value.serve_config.env, **value.model_env})
    return encode_document(redact_config(msgspec.to_builtins(value), secrets))


_RUN_SPECS = RecordCodec(RunSpec)


def decode_run_spec(data: bytes, *, source: str = RUN_SPEC_FILE) -> RunSpec:
    """`data` as a run spec, or a `RecordError` naming `source` (the file) and why."""
    return _RUN_SPECS.decode(data, source=source)


def write_run_spec(store: Store, spec: RunSpec) -> None:
    """Atomically write ``run_spec.json`` at the root of the run's store, readable by this
    user only (it holds the server's command line and environment, secrets redacted)."""
    store.write(RUN_SPEC_FILE, encode_run_spec(spec), mode=PRIVATE_FILE)


def read_run_spec(store: Store) -> RunSpec | None:
    return _RUN_SPECS.read(store, RUN_SPEC_FILE)
