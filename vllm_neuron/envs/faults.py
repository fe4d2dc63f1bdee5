"""VLLM_NEURON_FAULT: the named step at which this process kills itself (crash tests).

The points are the storage layer's registry (`vllm_neuron.backends.faults.POINTS`, listed
by ``vllm-neuron debug faults``); this group parses the variable and arms the registry when
the process loads its settings (`fault_settings`: the compile runtime's build, the CLI,
the vLLM plugin's start). An unknown name is a ConfigError naming the variable and listing
the points: a typo must not make a crash test pass because nothing ever crashed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_neuron.backends.faults import DISK_FAULT_POINTS, FAULT_KINDS, POINTS, arm

from ._parse import ConfigError, EnvVar, environ_or_default, parsed_once, raw

__all__ = [
    "VARIABLES",
    "VLLM_NEURON_FAULT",
    "FaultSettings",
    "disarm_faults",
    "fault_settings",
    "load_fault_settings",
]

VLLM_NEURON_FAULT = "VLLM_NEURON_FAULT"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        VLLM_NEURON_FAULT,
        "(unset)",
        "testing",
        "For crash tests only: the name of a fault point (vllm-neuron debug faults lists "
        "them); a process reaching it kills itself with SIGKILL. <point>@full or "
        "<point>@read-only instead fails the write there once, as a disk that just filled "
        "up or turned read-only.",
    ),
)


@dataclass(frozen=True)
class FaultSettings:
    """The fault point this process dies at, or None (the normal case), and what happens
    there (`FAULT_KINDS`: ``kill``, or a disk fault)."""

    point: str | None = None
    kind: str = "kill"


def load_fault_settings(environ: Mapping[str, str] | None = None) -> FaultSettings:
    """VLLM_NEURON_FAULT, one of the registered points (pure: nothing is armed)."""
    env = environ_or_default(environ)
    value = raw(env, VLLM_NEURON_FAULT)
    if value is None:
        return FaultSettings()
    point, _, kind = value.partition("@")
    if point not in POINTS:
        raise ConfigError(
            f"{VLLM_NEURON_FAULT}={env[VLLM_NEURON_FAULT]!r} is not a fault point; the points "
            f"are: {', '.join(POINTS)}"
        )
    if kind and kind not in FAULT_KINDS:
        raise ConfigError(
            f"{VLLM_NEURON_FAULT}={env[VLLM_NEURON_FAULT]!r}: {kind!r} is not a fault kind; "
            f"the kinds are: {', '.join(FAULT_KINDS)}"
        )
    if kind and kind != "kill" and point not in DISK_FAULT_POINTS:
        raise ConfigError(
            f"{VLLM_NEURON_FAULT}={env[VLLM_NEURON_FAULT]!r}: a disk fault can only be armed at "
            f"a write point: {', '.join(DISK_FAULT_POINTS)}"
        )
    return FaultSettings(point=point, kind=kind or "kill")


@parsed_once
def fault_settings() -> FaultSettings:
    """The process's fault setting, parsed from os.environ on first use, and armed."""
    settings = load_fault_settings()
    arm(settings.point, settings.kind)
    return settings


def disarm_faults() -> None:
    """Disarm the registry (``reset_for_tests``): the next `fault_settings` re-reads."""
    arm(None)
