"""What one executable captures and where: its :class:`CaptureSpec`, resolved when it loads.

Why resolved once per executable: identity (compilation hash, ranks), the selection rules,
the process-global budget and the destination do not change between forwards, so the hot
path reads one frozen object instead of the environment, and a malformed hash or setting
fails at load time rather than in the middle of a forward.

:class:`SnapshotCaptureError` lives here, at the bottom of the capture modules (spec,
:mod:`.tensor_writers`, :mod:`.bundle_writer`, :mod:`.capture`), so every step of a capture
raises the one error the caller catches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vllm_neuron.backends import Store, join, open_store, validate_key
from vllm_neuron.identity import RankInfo, detect_ranks, tensor_parallel_size

from .config import SnapshotConfig, snapshot_config
from .context import CaptureBudget, get_capture_budget
from .encoding import SnapshotFormat

__all__ = ["CaptureSpec", "SnapshotCaptureError", "resolve_capture_spec"]


class SnapshotCaptureError(RuntimeError):
    """A selected forward could not be captured; the forward was aborted, no bundle left."""


_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def _open_root(root: str) -> Store:
    """The bundle root as a store (cached per URL; local roots are created on first use)."""
    with _STORES_LOCK:
        store = _STORES.get(root)
        if store is None:
            store = _STORES[root] = open_store(root)
        return store


@dataclass(frozen=True)
class CaptureSpec:
    """Everything one executable needs to capture: identity, rules, budget, destination."""

    compilation_hash: str
    config: SnapshotConfig
    ranks: RankInfo
    budget: CaptureBudget
    tp_size: int = 1  # the tensor-parallel group a collective replay must rebuild

    @property
    def format(self) -> SnapshotFormat:
        return self.config.format

    @property
    def root(self) -> str:
        return self.config.root

    def call_prefix(self, call_index: int) -> str:
        """``<hash>/rank<global_rank>/call<call_index>`` relative to the snapshot root."""
        return join(self.compilation_hash, f"rank{self.ranks.global_rank}", f"call{call_index}")

    def store(self) -> Store:
        try:
            return _open_root(self.config.root)
        except Exception as exc:
            raise SnapshotCaptureError(
                f"cannot open the snapshot directory {self.config.root!r} "
                f"({self.config.root_setting}): {exc}"
            ) from exc


def resolve_capture_spec(
    compilation_hash: str,
    *,
    config: SnapshotConfig | None = None,
    ranks: RankInfo | None = None,
    budget: CaptureBudget | None = None,
) -> CaptureSpec | None:
    """The capture spec for one executable, or None when this process never captures it
    (capture disabled, or this tp rank is filtered out by ``..._RANKS``)."""
    cfg = snapshot_config() if config is None else config
    if not cfg.enabled:
        return None
    validate_key(compilation_hash)
    if "/" in compilation_hash:
        raise ValueError(f"compilation hash {compilation_hash!r} must be one path segment")
    info = detect_ranks() if ranks is None else ranks
    if not cfg.captures_rank(info.tp_rank):
        return None
    return CaptureSpec(
        compilation_hash=compilation_hash,
        config=cfg,
        ranks=info,
        budget=get_capture_budget() if budget is None else budget,
        tp_size=tensor_parallel_size(),
    )
