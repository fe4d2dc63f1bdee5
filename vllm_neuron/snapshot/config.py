"""Snapshot configuration and the selection rules, resolved once per process.

Why once: the model runner (which evaluates the token/request rules per forward) and every
compiled executable (which applies the call-index rule and writes bundles) must agree on one
reading of the environment, and a typo must stop start-up instead of silently disabling a
debugging run hours later. The variables are parsed by :mod:`vllm_neuron.envs.snapshot`
(once per process, forgotten by ``vllm_neuron.envs.reset_for_tests``); this module decides
what they select. :func:`snapshot_config` is the process's configuration;
:func:`load_snapshot_config` builds one from a mapping, which the tests feed dictionaries.

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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_neuron.envs import (
    ConfigError,
    SnapshotFormat,
    SnapshotSettings,
    load_snapshot_settings,
    snapshot_settings,
)
from vllm_neuron.envs.snapshot import DEFAULT_FORMAT, DEFAULT_MAX_CAPTURES, ENABLE, NAMES

__all__ = [
    "CaptureSelector",
    "ConfigError",
    "ForwardVerdict",
    "RowMatch",
    "SnapshotConfig",
    "check_snapshot_gating",
    "config_from_settings",
    "load_snapshot_config",
    "snapshot_config",
]

# The names of the variables this configuration comes from (parsed in vllm_neuron.envs).
VARIABLES = NAMES

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
    root_setting: str = field(default="VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR", compare=False)

    def captures_rank(self, tp_rank: int) -> bool:
        return self.ranks is None or tp_rank in self.ranks


def config_from_settings(settings: SnapshotSettings) -> SnapshotConfig:
    """The selection the parsed variables ask for.

    The call-index rule is on when CAPTURE_AT_CALL is set (every call for ``-1``), and also,
    at call ``0``, when no rule at all is set: enabling capture alone must capture
    something. A token or request rule alone turns it off, so that only the forwards the
    rule names are captured.
    """
    if not settings.enabled:
        return SnapshotConfig(enabled=False, root=settings.root,
                              root_setting=settings.root_setting)
    at_calls: frozenset[int] | None
    if settings.all_calls or settings.at_calls is not None:
        at_calls = settings.at_calls
    elif settings.tokens or settings.requests:
        at_calls = None
    else:
        at_calls = frozenset({0})  # no rule configured: the first call
    return SnapshotConfig(
        enabled=True,
        selector=CaptureSelector(
            at_calls=at_calls,
            all_calls=settings.all_calls,
            tokens=settings.tokens,
            requests=settings.requests,
        ),
        max_captures=settings.max_captures,
        ranks=settings.ranks,
        format=settings.format,
        root=settings.root,
        root_setting=settings.root_setting,
    )


def load_snapshot_config(environ: Mapping[str, str] | None = None) -> SnapshotConfig:
    """The snapshot configuration of ``environ`` (default os.environ), parsed by
    :func:`vllm_neuron.envs.load_snapshot_settings`; the tests feed it dictionaries."""
    return config_from_settings(load_snapshot_settings(environ))


# The config derived from the process's settings group, kept with the group it was built
# from: `vllm_neuron.envs.reset_for_tests` drops the group, and the next call rebuilds.
_derived: tuple[SnapshotSettings, SnapshotConfig] | None = None


def snapshot_config() -> SnapshotConfig:
    """The process's snapshot configuration, from the settings parsed once per process.

    The same object on every call until the settings are re-read: every compiled
    executable asks for it, and none may see a different reading of the environment.
    """
    global _derived
    settings = snapshot_settings()
    derived = _derived
    if derived is None or derived[0] is not settings:
        derived = (settings, config_from_settings(settings))
        _derived = derived
    return derived[1]


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
