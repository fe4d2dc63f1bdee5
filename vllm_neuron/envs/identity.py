"""Where this process sits: its Neuron cores, its launcher's ranks, its user.

The raw reads behind :mod:`vllm_neuron.identity`, which keeps what they mean (the engine
prefix, the rank logic that prefers torch.distributed and vLLM's groups).

Not cached, unlike the other groups: the engines of a data-parallel deployment narrow
NEURON_VISIBLE_DEVICES to their own slice after the package is imported, and a Ray worker
receives its environment after import too, so these are read at each use. They are
best-effort by design: they only name files and pick ranks, so a malformed value is
reported (or ignored) where it is used and never stops a compile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ._parse import EnvVar, environ_or_default, raw

__all__ = [
    "NEURON_VISIBLE_DEVICES",
    "RANK",
    "VARIABLES",
    "VLLM_DP_RANK",
    "IdentitySettings",
    "load_identity_settings",
]

NEURON_VISIBLE_DEVICES = "NEURON_VISIBLE_DEVICES"
RANK = "RANK"
VLLM_DP_RANK = "VLLM_DP_RANK"
USER = "USER"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        NEURON_VISIBLE_DEVICES,
        "(unset: the engine prefix is nodev)",
        "identity",
        "The Neuron cores of this engine (e.g. 0-7 or 0,1,2,3); names its manifest and "
        "ledger segments dev{first}_{last}. Set by the launcher, not for this package.",
    ),
    EnvVar(
        RANK,
        "0",
        "identity",
        "Global rank from the launcher (torchrun), used before torch.distributed is up.",
    ),
    EnvVar(
        VLLM_DP_RANK,
        "0",
        "identity",
        "vLLM's data-parallel rank, used before vLLM's process groups are up.",
    ),
)


@dataclass(frozen=True, slots=True)
class IdentitySettings:
    """The identity variables as set: ``visible_devices`` stripped (None when unset or
    blank; its syntax is :mod:`vllm_neuron.identity`'s to check), ``rank`` and ``dp_rank``
    None unless a plain non-negative integer, ``user`` the login name from USER (None when
    unset: the feature that needs one asks the system)."""

    visible_devices: str | None = None
    rank: int | None = None
    dp_rank: int | None = None
    user: str | None = None


def _index(env: Mapping[str, str], name: str) -> int | None:
    value = raw(env, name)
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def load_identity_settings(environ: Mapping[str, str] | None = None) -> IdentitySettings:
    """The identity variables of ``environ`` (default os.environ), read now."""
    env = environ_or_default(environ)
    return IdentitySettings(
        visible_devices=raw(env, NEURON_VISIBLE_DEVICES),
        rank=_index(env, RANK),
        dp_rank=_index(env, VLLM_DP_RANK),
        user=raw(env, USER),
    )
