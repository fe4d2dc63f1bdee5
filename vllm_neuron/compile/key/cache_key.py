"""The compile-cache key: one 32-hex MD5 over six component hashes.

Why this shape: a key must be equal exactly when a compiled artifact can be reused. Every
rank of a tensor-parallel job, every node and every restart must compute the same key for
the same graph, and anything that changes the compiled code must change it. So the key
hashes a *canonical* serialization of each input to the compiler and nothing else, one
component each:

``graph``, ``inputs``
    The FX graph and the example inputs, in the process-independent form of
    :mod:`.graph_canon` (device indices normalised to 0, provenance left out, constant
    tensors by content).
``compiler_args``
    The toolchain's flags, canonicalised by :mod:`.compiler_args` (output-location flags
    left out, sorted).
``versions``, ``target``, ``replica_groups``
    The toolchain's versions, the hardware target and the collective groups.

The components are kept next to the key so that "why did this miss?" has an answer
(:func:`explain_key_difference`). MD5 is a content fingerprint here, not a security measure.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch.fx

from .compiler_args import canonicalize_compiler_args
from .graph_canon import KeyComputationError, digest_json, graph_digest, inputs_canon, md5

__all__ = [
    "COMPONENTS",
    "KEY_SCHEMA_VERSION",
    "CacheKey",
    "compute_cache_key",
    "explain_key_difference",
]

# Bump when the canonical form changes: old entries then stop matching instead of being
# reused under a key that no longer means the same thing.
KEY_SCHEMA_VERSION = 1

COMPONENTS: tuple[str, ...] = (
    "graph",
    "inputs",
    "versions",
    "compiler_args",
    "target",
    "replica_groups",
)


class CacheKey(msgspec.Struct, frozen=True):
    """A cache key, the per-component hashes it was made from, and the canonical values
    behind every component but the graph (`inputs`: recorded in the entry, so that
    ``cache explain`` can say what changed, not only that something did)."""

    key: str
    components: dict[str, str]
    inputs: dict[str, Any] = msgspec.field(default_factory=dict)


def _replica_groups_canon(groups: Sequence[Sequence[int]] | None) -> Any:
    if groups is None:
        return None
    canon: list[list[int]] = []
    for group in groups:
        row: list[int] = []
        for rank in group:
            if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
                raise KeyComputationError(f"replica group entry {rank!r} is not an int")
            row.append(int(rank))
        canon.append(row)
    return canon


def compute_cache_key(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    toolchain_versions: Mapping[str, str],
    compiler_args: Sequence[str],
    target: str,
    replica_groups: Sequence[Sequence[int]] | None = None,
) -> CacheKey:
    """The cache key of compiling ``gm`` for ``example_inputs`` with one toolchain setup."""
    versions = {str(k): str(v) for k, v in toolchain_versions.items()}
    values: dict[str, Any] = {
        "inputs": inputs_canon(example_inputs),
        "versions": versions,
        "compiler_args": canonicalize_compiler_args(compiler_args),
        "target": str(target),
        "replica_groups": _replica_groups_canon(replica_groups),
    }
    components = {"graph": graph_digest(gm)}
    components.update({name: digest_json(value) for name, value in values.items()})
    material = "\n".join(
        [f"vllm-neuron-cache-key/v{KEY_SCHEMA_VERSION}"]
        + [f"{name}={components[name]}" for name in COMPONENTS]
    )
    return CacheKey(key=str(md5(material.encode()).hexdigest()), components=components,
                    inputs=values)


def explain_key_difference(
    a_components: Mapping[str, str] | CacheKey, b_components: Mapping[str, str] | CacheKey
) -> list[str]:
    """Names of the components whose hashes differ (or exist on one side only).

    Known components come first, in :data:`COMPONENTS` order; unknown names follow sorted.
    """
    a = a_components.components if isinstance(a_components, CacheKey) else a_components
    b = b_components.components if isinstance(b_components, CacheKey) else b_components
    names = [n for n in COMPONENTS if n in a or n in b]
    names += sorted((set(a) | set(b)) - set(COMPONENTS))
    return [n for n in names if a.get(n) != b.get(n)]
