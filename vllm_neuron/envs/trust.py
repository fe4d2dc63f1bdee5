"""Who may have built the entries this process loads (docs/trust.md).

Only parsing lives here: which files the variables name and which policy they ask for. The
keys themselves are read (and a bad key refused, naming the variable) by
:mod:`vllm_neuron.compile.trust.signing`, the one module that touches key material.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from ._parse import ConfigError, EnvVar, environ_or_default, expand_path, parsed_once, raw

__all__ = [
    "TRUST_MODES",
    "VARIABLES",
    "VLLM_NEURON_CACHE_SIGNING_KEY",
    "VLLM_NEURON_CACHE_TRUST",
    "VLLM_NEURON_CACHE_TRUSTED_KEYS",
    "TrustMode",
    "TrustSettings",
    "load_trust_settings",
    "split_key_paths",
    "trust_settings",
]

VLLM_NEURON_CACHE_SIGNING_KEY = "VLLM_NEURON_CACHE_SIGNING_KEY"
VLLM_NEURON_CACHE_TRUSTED_KEYS = "VLLM_NEURON_CACHE_TRUSTED_KEYS"
VLLM_NEURON_CACHE_TRUST = "VLLM_NEURON_CACHE_TRUST"

TrustMode = Literal["off", "warn", "require"]
TRUST_MODES: tuple[TrustMode, ...] = ("off", "warn", "require")

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        VLLM_NEURON_CACHE_SIGNING_KEY,
        "(unset: this process signs nothing)",
        "compile cache",
        "An Ed25519 private key file (`vllm-neuron cache keygen`): this process signs every "
        "entry it publishes and promotes. Give it to builders only.",
    ),
    EnvVar(
        VLLM_NEURON_CACHE_TRUSTED_KEYS,
        "(unset: no key is trusted)",
        "compile cache",
        "Public key files, or directories of them (*.pub), separated by ':' or ',': the "
        "builders whose entries this process loads. Several at once for a rotation.",
    ),
    EnvVar(
        VLLM_NEURON_CACHE_TRUST,
        "require when trusted keys or a signing key are set, else off",
        "compile cache",
        "off | warn | require. require: an entry not signed by a trusted key is never "
        "loaded or copied (a miss); warn: it is loaded, with a warning; off: signatures are "
        "not looked at.",
    ),
)


@dataclass(frozen=True)
class TrustSettings:
    """The trust variables as values: absolute paths, and the policy after its default."""

    signing_key: str | None = None
    trusted_keys: tuple[str, ...] = ()
    mode: TrustMode = "off"

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def split_key_paths(value: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """``value`` (paths separated by ':' or ','), each expanded and made absolute."""
    parts = [p.strip() for chunk in value.split(os.pathsep) for p in chunk.split(",")]
    return tuple(expand_path(p, environ) for p in parts if p)


def load_trust_settings(environ: Mapping[str, str] | None = None) -> TrustSettings:
    env = environ_or_default(environ)
    signing = raw(env, VLLM_NEURON_CACHE_SIGNING_KEY)
    trusted_raw = raw(env, VLLM_NEURON_CACHE_TRUSTED_KEYS)
    trusted = split_key_paths(trusted_raw, env) if trusted_raw is not None else ()
    if trusted_raw is not None and not trusted:
        value = env[VLLM_NEURON_CACHE_TRUSTED_KEYS]
        raise ConfigError(f"{VLLM_NEURON_CACHE_TRUSTED_KEYS}={value!r} names no key file")
    mode_raw = raw(env, VLLM_NEURON_CACHE_TRUST)
    if mode_raw is None:  # a builder (a signing key) trusts at least its own key
        mode: TrustMode = "require" if trusted or signing is not None else "off"
    elif mode_raw.lower() in TRUST_MODES:
        mode = cast(TrustMode, mode_raw.lower())
    else:
        raise ConfigError(f"{VLLM_NEURON_CACHE_TRUST}={env[VLLM_NEURON_CACHE_TRUST]!r} is not one "
                          f"of {', '.join(TRUST_MODES)}")  # fmt: skip
    if mode != "off" and not trusted and signing is None:
        raise ConfigError(
            f"{VLLM_NEURON_CACHE_TRUST}={mode} needs {VLLM_NEURON_CACHE_TRUSTED_KEYS} (the "
            "public keys of the builders to trust); none is set"
        )
    return TrustSettings(
        signing_key=None if signing is None else expand_path(signing, env),
        trusted_keys=trusted,
        mode=mode,
    )


@parsed_once
def trust_settings() -> TrustSettings:
    """The process's trust settings, parsed from os.environ on first use."""
    return load_trust_settings()
