"""Snapshot settings and the selection rules, resolved once per process.

Why once: the model runner (which evaluates the token/request rules per forward) and every
compiled executable (which applies the call-index rule and writes bundles) must agree on one
reading of the environment, and a typo must stop start-up instead of silently disabling a
debugging run hours later. :func:`snapshot_config` parses on first use and caches;
:func:`load_snapshot_config` is the pure parser the tests feed dictionaries.

Rules (docs/snapshots.md), OR'd together:

- call index (``..._CAPTURE_AT_CALL``): the N-th post-warm-up call of one compiled graph
  (all executables of one compilation hash count together, as one NEFF does); ``-1``
  selects every call; with no rule configured at all this is call ``0``;
- token (``..._CAPTURE_TOKEN``): a decode row at position ``p`` generates one of the target
  positions ``p + offset``, ``offset`` in ``1..num_speculative_tokens + 1``; never on
  prefill rows, where that relation does not hold;
- request (``..._CAPTURE_REQUEST``): the caller's id equals vLLM's request id, or vLLM's id
  is the caller's id plus its ``-<8 hex>`` suffix.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from vllm_neuron.envs import ConfigError, parse_bool

from .encoding import FORMATS, SnapshotFormat

__all__ = [
    "CaptureSelector",
    "ConfigError",
    "ForwardVerdict",
    "RowMatch",
    "SnapshotConfig",
    "check_snapshot_gating",
    "default_snapshot_root",
    "load_snapshot_config",
    "snapshot_config",
]

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
VARIABLES = (ENABLE, CAPTURE_AT_CALL, CAPTURE_TOKEN, CAPTURE_REQUEST, MAX_CAPTURES, RANKS,
             FORMAT, DIR)  # fmt: skip

DEFAULT_MAX_CAPTURES = 4
DEFAULT_FORMAT: SnapshotFormat = "pt"
ALL_CALLS = -1

RULE_CALL = "call"
RULE_TOKEN = "token"
RULE_REQUEST = "request"
RULE_ORDER = (RULE_CALL, RULE_TOKEN, RULE_REQUEST)

_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}")


# Selection ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowMatch:
    """One row of a forward that a token or request rule matched (recorded in meta.json)."""

    rule: str
    row: int
    req_id: str
    position: int
    target: int | None = None  # token rule: the targeted position p + offset
    offset: int | None = None  # token rule: 1 for plain decode, up to 1 + num_spec
    request: str | None = None  # request rule: the configured id that matched


@dataclass(frozen=True)
class ForwardVerdict:
    """What the forward-level rules (token, request) say about one forward."""

    selected_by: tuple[str, ...] = ()
    matches: tuple[RowMatch, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.selected_by)


NOT_SELECTED = ForwardVerdict()


@dataclass(frozen=True)
class CaptureSelector:
    """The three selection rules. ``at_calls`` None means no call-index rule."""

    at_calls: frozenset[int] | None = frozenset({0})
    all_calls: bool = False
    tokens: frozenset[int] = frozenset()
    requests: tuple[str, ...] = ()

    @property
    def has_forward_rules(self) -> bool:
        """Whether the per-forward rules (token, request) can fire at all."""
        return bool(self.tokens or self.requests)

    def selects_call(self, call_index: int) -> bool:
        """The call-index rule for the ``call_index``-th post-warm-up call of one executable."""
        return self.all_calls or (self.at_calls is not None and call_index in self.at_calls)

    def request_matches(self, req_id: str) -> str | None:
        """The configured id that selects ``req_id`` (exact, or base id + ``-<8 hex>``)."""
        for wanted in self.requests:
            if req_id == wanted:
                return wanted
            if req_id.startswith(wanted) and _VLLM_SUFFIX.fullmatch(req_id, len(wanted)):
                return wanted
        return None

    def evaluate_forward(
        self,
        req_ids: Sequence[str],
        positions: Sequence[int],
        is_decode: bool | Sequence[bool],
        num_speculative_tokens: int = 0,
    ) -> ForwardVerdict:
        """The token and request rules for one forward; the runner calls this once.

        ``positions[i]`` is the position of row ``i``'s first scheduled token; with
        ``num_speculative_tokens = n`` a decode row generates positions ``p+1 .. p+n+1``.
        ``is_decode`` is one flag for the forward or one per row (mixed batches).
        """
        if not self.has_forward_rules:
            return NOT_SELECTED
        if len(positions) != len(req_ids):
            raise ValueError(
                f"evaluate_forward: {len(req_ids)} request ids but {len(positions)} positions"
            )
        decode_rows = _row_flags(is_decode, len(req_ids))
        matches: list[RowMatch] = []
        rules: set[str] = set()
        if self.tokens:
            offsets = range(1, max(0, num_speculative_tokens) + 2)
            for row, (req_id, pos) in enumerate(zip(req_ids, positions, strict=True)):
                if not decode_rows[row]:
                    continue
                for offset in offsets:
                    if pos + offset in self.tokens:
                        rules.add(RULE_TOKEN)
                        matches.append(
                            RowMatch(RULE_TOKEN, row, req_id, pos, target=pos + offset,
                                     offset=offset)  # fmt: skip
                        )
        if self.requests:
            for row, (req_id, pos) in enumerate(zip(req_ids, positions, strict=True)):
                wanted = self.request_matches(req_id)
                if wanted is not None:
                    rules.add(RULE_REQUEST)
                    matches.append(RowMatch(RULE_REQUEST, row, req_id, pos, request=wanted))
        if not rules:
            return NOT_SELECTED
        return ForwardVerdict(tuple(r for r in RULE_ORDER if r in rules), tuple(matches))


def _row_flags(is_decode: bool | Sequence[bool], rows: int) -> tuple[bool, ...]:
    if isinstance(is_decode, bool):
        return (is_decode,) * rows
    flags = tuple(bool(f) for f in is_decode)
    if len(flags) != rows:
        raise ValueError(f"evaluate_forward: {rows} rows but {len(flags)} is_decode flags")
    return flags


# Settings -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotConfig:
    """The resolved snapshot settings of this process.

    ``ranks`` None captures every rank; ``root`` is a local path or a store URL
    (``memory://``, ``s3://``) under which ``<hash>/rank<N>/call<K>/`` bundles go.
    """

    enabled: bool = False
    selector: CaptureSelector = field(default_factory=CaptureSelector)
    max_captures: int = DEFAULT_MAX_CAPTURES
    ranks: frozenset[int] | None = None
    format: SnapshotFormat = DEFAULT_FORMAT
    root: str = ""

    def captures_rank(self, tp_rank: int) -> bool:
        return self.ranks is None or tp_rank in self.ranks


def _raw(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _int_list(name: str, raw: str, what: str) -> list[int]:
    out: list[int] = []
    for item in raw.split(","):
        item = item.strip()
        if not re.fullmatch(r"-?\d+", item):
            shown = "an empty item" if not item else repr(item)
            raise ConfigError(f"{name}={raw!r}: {shown} is not {what}")
        out.append(int(item))
    return out


def _parse_at_call(raw: str) -> tuple[frozenset[int], bool]:
    values = _int_list(CAPTURE_AT_CALL, raw, "an integer call index")
    if ALL_CALLS in values:
        if len(values) > 1:
            raise ConfigError(
                f"{CAPTURE_AT_CALL}={raw!r}: -1 (every call) cannot be combined with indices"
            )
        return frozenset(), True
    bad = [v for v in values if v < 0]
    if bad:
        raise ConfigError(
            f"{CAPTURE_AT_CALL}={raw!r}: call indices are 0-based (>= 0), or -1 for every call;"
            f" got {bad[0]}"
        )
    return frozenset(values), False


def _parse_tokens(raw: str) -> frozenset[int]:
    values = _int_list(CAPTURE_TOKEN, raw, "an integer token position")
    bad = [v for v in values if v < 1]
    if bad:
        raise ConfigError(
            f"{CAPTURE_TOKEN}={raw!r}: a target token position is prompt length + decode step "
            f"(>= 1); got {bad[0]}"
        )
    return frozenset(values)


def _parse_requests(raw: str) -> tuple[str, ...]:
    items = [item.strip() for item in raw.split(",")]
    if any(not item for item in items):
        # An empty id would be a prefix of every request id: refuse it.
        raise ConfigError(f"{CAPTURE_REQUEST}={raw!r} has an empty request id")
    return tuple(dict.fromkeys(items))


def _parse_max_captures(raw: str) -> int:
    if not re.fullmatch(r"\d+", raw) or int(raw) < 1:
        raise ConfigError(f"{MAX_CAPTURES}={raw!r} must be a whole number >= 1")
    return int(raw)


def _parse_ranks(raw: str) -> frozenset[int] | None:
    """A malformed rank list degrades to "every rank" with a warning (docs/snapshots.md)."""
    try:
        values = _int_list(RANKS, raw, "a tp rank")
        if any(v < 0 for v in values):
            raise ConfigError(f"{RANKS}={raw!r}: ranks are >= 0")
    except ConfigError as exc:
        logger.warning("vllm_neuron: %s; capturing every rank", exc)
        return None
    return frozenset(values)


def _parse_format(raw: str) -> SnapshotFormat:
    lowered = raw.lower()
    if lowered not in FORMATS:
        raise ConfigError(f"{FORMAT}={raw!r} is not a snapshot format; use one of pt, npy, "
                          "safetensors")  # fmt: skip
    if lowered == "safetensors" and importlib.util.find_spec("safetensors") is None:
        raise ConfigError(
            f"{FORMAT}={raw!r} needs the safetensors package: pip install safetensors"
        )
    return cast(SnapshotFormat, lowered)


def default_snapshot_root(environ: Mapping[str, str] | None = None) -> str:
    """``$VLLM_CACHE_ROOT/neuron/snapshots`` (next to the compile cache), or the override."""
    from vllm_neuron.envs import load_compile_cache_settings

    env: Mapping[str, str] = os.environ if environ is None else environ
    override = _raw(env, DIR)
    if override is not None:
        if "://" in override:
            return override.rstrip("/")
        return os.path.abspath(os.path.expanduser(override))
    root = load_compile_cache_settings(env).cache_root
    return os.path.join(root, "neuron", "snapshots")


def load_snapshot_config(environ: Mapping[str, str] | None = None) -> SnapshotConfig:
    """Parse and validate the snapshot variables of ``environ`` (default os.environ).

    With the master switch off nothing else is parsed (capture is off, so the other
    variables cannot matter), but setting them without it is logged: it is the most common
    way to lose a debugging run.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    enable_raw = _raw(env, ENABLE)
    enabled = False if enable_raw is None else parse_bool(ENABLE, env[ENABLE])
    if not enabled:
        stray = [v for v in VARIABLES[1:] if _raw(env, v) is not None]
        if stray:
            logger.warning(
                "vllm_neuron: %s set but %s is not: input snapshot capture is off",
                ", ".join(stray),
                ENABLE,
            )
        return SnapshotConfig(enabled=False, root=default_snapshot_root(env))

    at_raw, token_raw, request_raw = (
        _raw(env, CAPTURE_AT_CALL),
        _raw(env, CAPTURE_TOKEN),
        _raw(env, CAPTURE_REQUEST),
    )
    tokens = _parse_tokens(token_raw) if token_raw is not None else frozenset()
    requests = _parse_requests(request_raw) if request_raw is not None else ()
    if at_raw is not None:
        at_calls: frozenset[int] | None
        at_calls, all_calls = _parse_at_call(at_raw)
        if all_calls:
            at_calls = None
    elif tokens or requests:
        at_calls, all_calls = None, False
    else:
        at_calls, all_calls = frozenset({0}), False  # no rule configured: the first call

    max_raw = _raw(env, MAX_CAPTURES)
    ranks_raw = _raw(env, RANKS)
    format_raw = _raw(env, FORMAT)
    return SnapshotConfig(
        enabled=True,
        selector=CaptureSelector(
            at_calls=at_calls, all_calls=all_calls, tokens=tokens, requests=requests
        ),
        max_captures=DEFAULT_MAX_CAPTURES if max_raw is None else _parse_max_captures(max_raw),
        ranks=None if ranks_raw is None else _parse_ranks(ranks_raw),
        format=DEFAULT_FORMAT if format_raw is None else _parse_format(format_raw),
        root=default_snapshot_root(env),
    )


@functools.lru_cache(maxsize=1)
def snapshot_config() -> SnapshotConfig:
    """The process's snapshot settings, parsed from os.environ on first use."""
    return load_snapshot_config()


def check_snapshot_gating(
    async_scheduling: bool, config: SnapshotConfig | None = None
) -> SnapshotConfig:
    """Start-up gate (the platform's ``check_and_update_config`` calls it once).

    Resolves the settings (a malformed selection, budget or format raises here, not
    mid-request) and refuses async scheduling when capture is on: capture reads the inputs
    inline, and under async scheduling they may still belong to the previous forward.
    """
    cfg = snapshot_config() if config is None else config
    if cfg.enabled and async_scheduling:
        raise ConfigError(
            f"{ENABLE}=1 needs synchronous scheduling, but async scheduling is enabled: "
            "under async scheduling the input buffers may still belong to the previous "
            f"forward. Disable async scheduling (--no-async-scheduling) or unset {ENABLE}"
        )
    return cfg
