"""Settings of profile capture (docs/profiling.md).

Not cached like the other groups: a capture resolves them once, with the
``--project-root`` flag of its command line, and nothing else in the process reads them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ._parse import ConfigError, EnvVar, environ_or_default, expand_path, raw

__all__ = [
    "HF_HOME",
    "NEURON_PROJECT_ROOT",
    "VARIABLES",
    "VLLM_NEURON_DIR",
    "VLLM_NEURON_VENV_PATH",
    "ProfilingSettings",
    "load_profiling_settings",
]

NEURON_PROJECT_ROOT = "NEURON_PROJECT_ROOT"
VLLM_NEURON_VENV_PATH = "VLLM_NEURON_VENV_PATH"
VLLM_NEURON_DIR = "VLLM_NEURON_DIR"
HF_HOME = "HF_HOME"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        NEURON_PROJECT_ROOT,
        "(the current directory)",
        "profiling",
        "The one output knob: every capture artifact lands under <root>/agent_artifacts/.",
    ),
    EnvVar(
        VLLM_NEURON_VENV_PATH,
        "(unset)",
        "profiling",
        "Python environment of the server; its bin/ is put first on the server's PATH.",
    ),
    EnvVar(
        VLLM_NEURON_DIR,
        "(unset: the current directory)",
        "profiling",
        "The vLLM Neuron source tree; the profiling server's working directory.",
    ),
    EnvVar(
        HF_HOME,
        "$NEURON_PROJECT_ROOT/agent_artifacts/models",
        "profiling",
        "Where model weights live; given to the profiling server when unset.",
    ),
)


@dataclass(frozen=True)
class ProfilingSettings:
    """Where a capture writes and how its server is started (all paths absolute)."""

    project_root: str
    hf_home: str
    venv_path: str | None = None
    vllm_neuron_dir: str | None = None


def load_profiling_settings(
    environ: Mapping[str, str] | None = None, *, project_root: str | None = None
) -> ProfilingSettings:
    """``project_root`` (the ``--project-root`` flag) wins over NEURON_PROJECT_ROOT."""
    env = environ_or_default(environ)
    root_raw = project_root if project_root else raw(env, NEURON_PROJECT_ROOT)
    root = expand_path(root_raw, env) if root_raw else os.path.abspath(os.getcwd())
    hf_raw = raw(env, HF_HOME)
    hf_home = (
        expand_path(hf_raw, env) if hf_raw else os.path.join(root, "agent_artifacts", "models")
    )
    paths: dict[str, str | None] = {}
    for name in (VLLM_NEURON_VENV_PATH, VLLM_NEURON_DIR):
        value = raw(env, name)
        if value is None:
            paths[name] = None
            continue
        path = expand_path(value, env)
        if not os.path.isdir(path):
            raise ConfigError(f"{name}={env[name]!r} is not a directory")
        paths[name] = path
    return ProfilingSettings(
        project_root=root,
        hf_home=hf_home,
        venv_path=paths[VLLM_NEURON_VENV_PATH],
        vllm_neuron_dir=paths[VLLM_NEURON_DIR],
    )
