"""Settings of the vLLM plugin's host mode (vllm_neuron/plugin)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ._parse import (
    ConfigError,
    EnvVar,
    bool_var,
    environ_or_default,
    parsed_once,
    pid_marker,
    raw,
)
from .compile_cache import VLLM_NEURON_TOOLCHAIN

__all__ = [
    "VARIABLES",
    "VLLM_NEURON_CPU_PROBE_STARTED",
    "VLLM_NEURON_HOST_MODE",
    "VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING",
    "VLLM_NEURON_WITHOUT",
    "COLD_START_MECHANISMS",
    "cold_start_without",
    "VLLM_USE_AOT_COMPILE",
    "HostModeSettings",
    "host_mode_settings",
    "load_cpu_probe_marker",
    "load_host_mode_settings",
    "mark_cpu_probe_started",
]

VLLM_NEURON_HOST_MODE = "VLLM_NEURON_HOST_MODE"
VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING = "VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING"
# An internal marker, not a setting: named outside vLLM's ``VLLM_*`` namespace, which vLLM
# checks against its list of variables (a leading underscore: no VLLM_ prefix).
VLLM_NEURON_CPU_PROBE_STARTED = "_VLLM_NEURON_CPU_PROBE_STARTED"
# An internal marker for the cold-start A/B benchmark (benchmarks/bench_cold_start_ab.py):
# the mechanisms a start runs without, each falling back to what torch and vLLM do alone.
VLLM_NEURON_WITHOUT = "_VLLM_NEURON_WITHOUT"
COLD_START_MECHANISMS: tuple[str, ...] = (
    "probe", "early-workers", "prepare-runtime", "wrapper-split", "first-valid-isa",
    "in-place", "workers", "rank-sharing", "in-process-inspection")  # fmt: skip
"""What `VLLM_NEURON_WITHOUT` may name: the CPU probe ahead (head_start.py), compile workers
started before the model loads, the probe's compile of the wrapper's runtime part, the
wrapper compiled in two parts (aoti_wrapper.py), the vector-ISA probe stopped at the first
valid ISA (vector_isa.py), a share of one slot compiling in place (in workers instead),
host compile workers at larger shares (in place instead), and the ranks sharing out the pieces
(deferred compiles: without it every process waits for a piece another compiles, as with
VLLM_NEURON_DEFER_COMPILES=0 but with the head start unchanged), and vLLM's inspection of
the model's class in the process that asks (plugin/model_inspection.py; without it, in vLLM's
subprocess)."""
# vLLM's own variable; read here because host mode must turn it off (see the plugin).
VLLM_USE_AOT_COMPILE = "VLLM_USE_AOT_COMPILE"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        VLLM_NEURON_HOST_MODE,
        "0",
        "vllm-plugin",
        "1 runs the whole artifact system inside a real vLLM without Trainium: a platform "
        "extending vLLM's CPU platform whose compiler is the two-tier cache (host toolchain).",
    ),
    EnvVar(
        VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING,
        "1",
        "vllm-plugin",
        "In host mode at tensor parallelism above 1: 1 gives vLLM's vocab-parallel embedding "
        "its shard bounds as a buffer, so its piece is one graph on every rank (compiled once "
        "per engine, not once per rank; same outputs); 0 keeps vLLM's own layer.",
    ),
    EnvVar(
        VLLM_NEURON_CPU_PROBE_STARTED,
        "(set by the first process of a host-mode start, inherited by the others)",
        "vllm-plugin",
        "The process id of the process that looked at whether to run Inductor's CPU probe "
        "ahead of a cold start (vllm_neuron/compile/head_start.py); the processes it starts "
        "inherit it and do not look again. Not a setting: leave it unset.",
    ),
    EnvVar(
        VLLM_NEURON_WITHOUT,
        "(unset)",
        "vllm-plugin",
        "For the cold-start A/B benchmark only: comma-separated cold-start mechanisms this "
        f"start runs without ({', '.join(COLD_START_MECHANISMS)}). Not a setting: leave it "
        "unset.",
    ),
)


@dataclass(frozen=True)
class HostModeSettings:
    """Whether vLLM runs on this package's host platform (CPU, host toolchain).

    ``vllm_aot_compile`` is vLLM's VLLM_USE_AOT_COMPILE as set (stripped; None when unset
    or blank). It is vLLM's to interpret, so it is kept as text and never refused here;
    the plugin only needs to know whether the user turned vLLM's AOT artifact on, which
    would let warm restarts bypass this package's cache. ``rank_independent_embedding`` is
    whether the host worker replaces vLLM's vocab-parallel embedding by one whose shard
    bounds are a buffer (`vllm_neuron/plugin/vocab_embedding.py`).
    """

    enabled: bool = False
    vllm_aot_compile: str | None = None
    rank_independent_embedding: bool = True

    @property
    def vllm_aot_compile_requested(self) -> bool:
        """Whether VLLM_USE_AOT_COMPILE is set to anything but ``0``."""
        return self.vllm_aot_compile not in (None, "0")


def load_host_mode_settings(environ: Mapping[str, str] | None = None) -> HostModeSettings:
    """VLLM_NEURON_HOST_MODE, a strict boolean; host mode compiles with the host toolchain,
    so asking for the Neuron toolchain at the same time is refused."""
    env = environ_or_default(environ)
    enabled = bool_var(env, VLLM_NEURON_HOST_MODE, False)
    toolchain = raw(env, VLLM_NEURON_TOOLCHAIN)
    if enabled and toolchain is not None and toolchain.lower() == "neuron":
        raise ConfigError(
            f"{VLLM_NEURON_HOST_MODE}={env[VLLM_NEURON_HOST_MODE]!r} runs vLLM on the host CPU "
            f"and compiles with the host toolchain, but {VLLM_NEURON_TOOLCHAIN}="
            f"{env[VLLM_NEURON_TOOLCHAIN]!r} asks for Neuron: unset one of them"
        )
    return HostModeSettings(
        enabled=enabled,
        vllm_aot_compile=raw(env, VLLM_USE_AOT_COMPILE),
        rank_independent_embedding=bool_var(env, VLLM_NEURON_RANK_INDEPENDENT_EMBEDDING, True),
    )


@parsed_once
def host_mode_settings() -> HostModeSettings:
    """The process's host-mode setting, parsed from os.environ on first use."""
    return load_host_mode_settings()


def load_cpu_probe_marker(environ: Mapping[str, str] | None = None) -> int | None:
    """_VLLM_NEURON_CPU_PROBE_STARTED: the process id of the process of this start that looked
    at whether to run Inductor's CPU probe ahead (vllm_neuron/compile/head_start.py), or None
    when unset. Read at each use (the first process sets it while running); a value that is
    no process id is no marker (None), never an error: it is no setting of the user's."""
    return pid_marker(environ_or_default(environ), VLLM_NEURON_CPU_PROBE_STARTED)


def mark_cpu_probe_started() -> None:
    """Set _VLLM_NEURON_CPU_PROBE_STARTED to this process's id, for the processes it starts."""
    os.environ[VLLM_NEURON_CPU_PROBE_STARTED] = str(os.getpid())


def cold_start_without(mechanism: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether _VLLM_NEURON_WITHOUT turns `mechanism` (one of `COLD_START_MECHANISMS`) off
    for this start. Read at each use; a name that is no mechanism is a `ConfigError` naming
    the variable and the value (a misspelt A/B would measure nothing)."""
    if mechanism not in COLD_START_MECHANISMS:
        raise ValueError(f"{mechanism!r} is not one of {COLD_START_MECHANISMS}")
    value = raw(environ_or_default(environ), VLLM_NEURON_WITHOUT)
    if value is None:
        return False
    names = {name.strip() for name in value.split(",") if name.strip()}
    unknown = sorted(names - set(COLD_START_MECHANISMS))
    if unknown:
        raise ConfigError(f"{VLLM_NEURON_WITHOUT}={value!r}: {', '.join(unknown)} is not a "
                          f"cold-start mechanism (one of {', '.join(COLD_START_MECHANISMS)})")
    return mechanism in names
