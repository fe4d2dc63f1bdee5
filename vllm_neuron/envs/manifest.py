"""Settings of the compile-artifact manifest (docs/manifest.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ._parse import (
    EnvVar,
    environ_or_default,
    normalize_location_var,
    parsed_once,
    require_local_directory,
)

__all__ = [
    "VARIABLES",
    "VLLM_NEURON_MANIFEST_DIR",
    "ManifestSettings",
    "load_manifest_settings",
    "manifest_settings",
]

VLLM_NEURON_MANIFEST_DIR = "VLLM_NEURON_MANIFEST_DIR"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        VLLM_NEURON_MANIFEST_DIR,
        "(unset)",
        "manifest",
        "Directory or store URL for compile ledgers and per-engine manifests; "
        "unset or empty disables the manifest (there is no default location).",
    ),
)


@dataclass(frozen=True)
class ManifestSettings:
    """The manifest is on exactly when `manifest_dir` is set (docs/manifest.md)."""

    manifest_dir: str | None = None

    @property
    def enabled(self) -> bool:
        return self.manifest_dir is not None


def load_manifest_settings(environ: Mapping[str, str] | None = None) -> ManifestSettings:
    """VLLM_NEURON_MANIFEST_DIR: a local path (made absolute) or a store URL."""
    env = environ_or_default(environ)
    location = normalize_location_var(env, VLLM_NEURON_MANIFEST_DIR)
    if location is None:
        return ManifestSettings()
    # The ledger is best-effort (a write that fails at run time is logged, never fatal),
    # so a file in the way would otherwise only lose the manifest, quietly.
    require_local_directory(
        location, env,
        setting=f"{VLLM_NEURON_MANIFEST_DIR}={env[VLLM_NEURON_MANIFEST_DIR]!r}",
        purpose="the compile ledgers and manifests",
    )  # fmt: skip
    return ManifestSettings(location)


@parsed_once
def manifest_settings() -> ManifestSettings:
    """The process's manifest settings, parsed from os.environ on first use."""
    return load_manifest_settings()
