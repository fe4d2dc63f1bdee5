"""The ``VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_*`` variables, parsed and validated
(docs/snapshots.md).

Only the values live here: what the rules mean (which forward and which call they select,
the call-0 default when no rule is set) is the snapshot feature's, in
:mod:`vllm_neuron.snapshot.config`, built from :class:`SnapshotSettings`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

from vllm_neuron.backends import is_url

from ._parse import (
    ConfigError,
    EnvVar,
    environ_or_default,
    normalize_location_var,
    parse_bool,
    parsed_once,
    raw,
    require_local_directory,
)
from .compile_cache import load_compile_cache_settings

__all__ = [
    "DEFAULT_FORMAT",
    "DEFAULT_MAX_CAPTURES",
    "SNAPSHOT_FORMATS",
    "VARIABLES",
    "SnapshotFormat",
    "SnapshotSettings",
    "check_snapshot_root",
    "load_snapshot_settings",
    "snapshot_settings",
]

# The feature's logger: these warnings are about capture being off or wider than asked,
# and users filter them with the rest of the snapshot feature's lines.
logger = logging.getLogger("vllm_neuron.snapshot")

PREFIX = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_"
ENABLE = PREFIX + "ENABLE"
CAPTURE_AT_CALL = PREFIX + "CAPTURE_AT_CALL"
CAPTURE_TOKEN = PREFIX + "CAPTURE_TOKEN"
CAPTURE_REQUEST = PREFIX + "CAPTURE_REQUEST"
MAX_CAPTURES = PREFIX + "MAX_CAPTURES"
RANKS = PREFIX + "RANKS"
FORMAT = PREFIX + "FORMAT"
DIR = PREFIX + "DIR"
NAMES = (ENABLE, CAPTURE_AT_CALL, CAPTURE_TOKEN, CAPTURE_REQUEST, MAX_CAPTURES, RANKS, FORMAT,
         DIR)  # fmt: skip

# The tensor file formats a bundle can be written in (vllm_neuron/snapshot/encoding.py
# implements them and takes the names from here, so the two cannot disagree).
SnapshotFormat = Literal["pt", "npy", "safetensors"]
SNAPSHOT_FORMATS: tuple[SnapshotFormat, ...] = ("pt", "npy", "safetensors")

DEFAULT_MAX_CAPTURES = 4
DEFAULT_FORMAT: SnapshotFormat = "pt"
ALL_CALLS = -1

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(ENABLE, "0", "snapshot",
           "Master switch of input snapshot capture; needs synchronous scheduling."),
    EnvVar(CAPTURE_AT_CALL, "(unset: call 0 when no other rule is set)", "snapshot",
           "Comma-separated 0-based post-warm-up call indices of each executable, or -1 for "
           "all."),
    EnvVar(CAPTURE_TOKEN, "(unset)", "snapshot",
           "Comma-separated target token positions (prompt length + decode step); decode only."),
    EnvVar(CAPTURE_REQUEST, "(unset)", "snapshot",
           "Comma-separated request ids; vLLM's <id>-<8 hex> matches its base id <id>."),
    EnvVar(MAX_CAPTURES, str(DEFAULT_MAX_CAPTURES), "snapshot",
           "Process-global budget of captured forwards (every executable of a forward shares "
           "one)."),
    EnvVar(RANKS, "(unset: every rank)", "snapshot",
           "Comma-separated tp ranks that capture; a malformed list warns and captures all."),
    EnvVar(FORMAT, DEFAULT_FORMAT, "snapshot",
           "Tensor file format: pt (torch.save, loaded weights_only), npy, or safetensors."),
    EnvVar(DIR, "$VLLM_CACHE_ROOT/neuron/snapshots", "snapshot",
           "Bundle root: a local path or a store URL (memory://name, s3://bucket/prefix)."),
)  # fmt: skip


@dataclass(frozen=True)
class SnapshotSettings:
    """The snapshot variables as values.

    ``at_calls`` None: CAPTURE_AT_CALL is unset (``all_calls`` is True for ``-1``);
    ``ranks`` None: every rank (unset, or a malformed list); ``root`` is a local path or a
    store URL, resolved even when capture is off (replay and the CLI read bundles from it).
    With ``enabled`` False nothing but ``root`` is parsed. ``root_setting`` is how a message
    about the root names it (the variable as set, or the cache root it defaults under).
    """

    enabled: bool = False
    at_calls: frozenset[int] | None = None
    all_calls: bool = False
    tokens: frozenset[int] = frozenset()
    requests: tuple[str, ...] = ()
    max_captures: int = DEFAULT_MAX_CAPTURES
    ranks: frozenset[int] | None = None
    format: SnapshotFormat = DEFAULT_FORMAT
    root: str = ""
    root_setting: str = field(default=DIR, compare=False)


def _int_list(name: str, value: str, what: str) -> list[int]:
    out: list[int] = []
    for item in value.split(","):
        item = item.strip()
        if not re.fullmatch(r"-?\d+", item):
            shown = "an empty item" if not item else repr(item)
            raise ConfigError(f"{name}={value!r}: {shown} is not {what}")
        out.append(int(item))
    return out


def _parse_at_call(value: str) -> tuple[frozenset[int], bool]:
    values = _int_list(CAPTURE_AT_CALL, value, "an integer call index")
    if ALL_CALLS in values:
        if len(values) > 1:
            raise ConfigError(
                f"{CAPTURE_AT_CALL}={value!r}: -1 (every call) cannot be combined with indices"
            )
        return frozenset(), True
    bad = [v for v in values if v < 0]
    if bad:
        raise ConfigError(
            f"{CAPTURE_AT_CALL}={value!r}: call indices are 0-based (>= 0), or -1 for every "
            f"call; got {bad[0]}"
        )
    return frozenset(values), False


def _parse_tokens(value: str) -> frozenset[int]:
    values = _int_list(CAPTURE_TOKEN, value, "an integer token position")
    bad = [v for v in values if v < 1]
    if bad:
        raise ConfigError(
            f"{CAPTURE_TOKEN}={value!r}: a target token position is prompt length + decode "
            f"step (>= 1); got {bad[0]}"
        )
    return frozenset(values)


def _parse_requests(value: str) -> tuple[str, ...]:
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        # An empty id would be a prefix of every request id: refuse it.
        raise ConfigError(f"{CAPTURE_REQUEST}={value!r} has an empty request id")
    return tuple(dict.fromkeys(items))


def _parse_max_captures(value: str) -> int:
    if not re.fullmatch(r"\d+", value) or int(value) < 1:
        raise ConfigError(f"{MAX_CAPTURES}={value!r} must be a whole number >= 1")
    return int(value)


def _parse_ranks(value: str) -> frozenset[int] | None:
    """A malformed rank list degrades to "every rank" with a warning (docs/snapshots.md):
    capturing more ranks than asked wastes disk, failing start-up would lose the run."""
    try:
        values = _int_list(RANKS, value, "a tp rank")
        if any(v < 0 for v in values):
            raise ConfigError(f"{RANKS}={value!r}: ranks are >= 0")
    except ConfigError as exc:
        logger.warning("vllm_neuron: %s; capturing every rank", exc)
        return None
    return frozenset(values)


def _parse_format(value: str) -> SnapshotFormat:
    lowered = value.lower()
    if lowered not in SNAPSHOT_FORMATS:
        raise ConfigError(f"{FORMAT}={value!r} is not a snapshot format; use one of "
                          f"{', '.join(SNAPSHOT_FORMATS)}")  # fmt: skip
    if lowered == "safetensors" and importlib.util.find_spec("safetensors") is None:
        # Refused at start-up: the first capture, hours later, could not be written.
        raise ConfigError(
            f"{FORMAT}={value!r} needs the safetensors package: pip install safetensors"
        )
    return cast(SnapshotFormat, lowered)


def _root(env: Mapping[str, str]) -> str:
    """DIR (a local path made absolute, or a URL without its trailing slashes), else
    ``$VLLM_CACHE_ROOT/neuron/snapshots``, next to the compile cache."""
    override = normalize_location_var(env, DIR)
    if override is None:
        root = load_compile_cache_settings(env).cache_root
        return os.path.join(root, "neuron", "snapshots")
    return override.rstrip("/") if is_url(override) else override


def _root_setting(env: Mapping[str, str], root: str) -> str:
    """The setting that put the bundle root at ``root``, as a message names it."""
    if raw(env, DIR) is not None:
        return f"{DIR}={env[DIR]!r}"
    cache_root_setting = load_compile_cache_settings(env).cache_root_setting
    return f"{DIR} (unset: {root} under {cache_root_setting})"


def load_snapshot_settings(environ: Mapping[str, str] | None = None) -> SnapshotSettings:
    """Parse and validate the snapshot variables of ``environ`` (default os.environ).

    With the master switch off nothing else is parsed (capture is off, so the other
    variables cannot matter), but setting them without it is logged: it is the most common
    way to lose a debugging run.
    """
    env = environ_or_default(environ)
    enabled = raw(env, ENABLE) is not None and parse_bool(ENABLE, env[ENABLE])
    if not enabled:
        stray = [v for v in NAMES[1:] if raw(env, v) is not None]
        if stray:
            logger.warning(
                "vllm_neuron: %s set but %s is not: input snapshot capture is off",
                ", ".join(stray),
                ENABLE,
            )
        root = _root(env)
        return SnapshotSettings(enabled=False, root=root, root_setting=_root_setting(env, root))

    # This order decides which error a doubly mistyped environment shows first: keep it.
    token_raw, request_raw = raw(env, CAPTURE_TOKEN), raw(env, CAPTURE_REQUEST)
    tokens = frozenset() if token_raw is None else _parse_tokens(token_raw)
    requests = () if request_raw is None else _parse_requests(request_raw)
    at_raw = raw(env, CAPTURE_AT_CALL)
    at_calls, all_calls = (None, False) if at_raw is None else _parse_at_call(at_raw)
    max_raw, ranks_raw, format_raw = raw(env, MAX_CAPTURES), raw(env, RANKS), raw(env, FORMAT)
    return SnapshotSettings(
        enabled=True,
        at_calls=None if all_calls else at_calls,
        all_calls=all_calls,
        tokens=tokens,
        requests=requests,
        max_captures=DEFAULT_MAX_CAPTURES if max_raw is None else _parse_max_captures(max_raw),
        ranks=None if ranks_raw is None else _parse_ranks(ranks_raw),
        format=DEFAULT_FORMAT if format_raw is None else _parse_format(format_raw),
        root=(root := _root(env)),
        root_setting=_root_setting(env, root),
    )


@parsed_once
def snapshot_settings() -> SnapshotSettings:
    """The process's snapshot settings, parsed from os.environ on first use."""
    return load_snapshot_settings()


def check_snapshot_root(root: str, environ: Mapping[str, str] | None = None) -> str:
    """``root`` (the resolved bundle root of an enabled capture), or a ConfigError when a
    file is in the way, naming VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR, or VLLM_CACHE_ROOT
    when the root is its default under the cache root.

    Why: bundles are written at the first captured forward, long after start-up, where a
    failed write would lose the very forward the capture was set up for.
    """
    env = environ_or_default(environ)
    return require_local_directory(
        root, env, setting=_root_setting(env, root), purpose="the input snapshot bundles"
    )

