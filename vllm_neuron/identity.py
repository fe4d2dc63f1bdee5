"""Engine identity: which physical Neuron cores this engine owns.

`get_server_prefix()` names an engine by its core window, ``dev{first}_{last}`` over
``NEURON_VISIBLE_DEVICES``, or ``nodev`` when none is visible (a CPU compile). Engines of a
data-parallel deployment narrow the variable to disjoint slices before anything is written,
so the prefix is per engine by the time the manifest and ledger paths are resolved: it is
therefore read at use time, never cached at import.

The variables are read by :mod:`vllm_neuron.envs.identity`; this module decides what they
mean (the core window, which rank source wins).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_neuron.envs import load_identity_settings
from vllm_neuron.vllm_internals import resolve

logger = logging.getLogger("vllm_neuron")

NO_DEVICE = "nodev"
_PARALLEL_STATE = "vllm.distributed.parallel_state"
_RANGE = re.compile(r"^(\d+)\s*-\s*(\d+)$")
_warned: set[str] = set()
_prefixes: dict[str, str] = {}


class DeviceListError(ValueError):
    """NEURON_VISIBLE_DEVICES is not a list of core indices and ranges."""


def parse_visible_devices(value: str) -> list[int]:
    """``"0-7"``, ``"0,1,2,3"``, ``"8-15"``, ``"0-3,8-11"`` -> sorted core indices."""
    cores: set[int] = set()
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        match = _RANGE.match(part)
        if match:
            first, last = int(match.group(1)), int(match.group(2))
            if last < first:
                raise DeviceListError(
                    f"NEURON_VISIBLE_DEVICES={value!r}: range {part!r} runs backwards"
                )
            cores.update(range(first, last + 1))
        elif part.isdigit():
            cores.add(int(part))
        else:
            raise DeviceListError(
                f"NEURON_VISIBLE_DEVICES={value!r}: {part!r} is not a core index or a range "
                "(expected e.g. 0-7 or 0,1,2,3)"
            )
    return sorted(cores)


def get_server_prefix(environ: Mapping[str, str] | None = None) -> str:
    """``dev{first}_{last}`` for the visible cores, or ``nodev``.

    A malformed value is reported once and treated as ``nodev`` (best-effort: the prefix
    only names files, it must never stop a compile).
    """
    raw = load_identity_settings(environ).visible_devices
    if raw is None:
        return NO_DEVICE
    cached = _prefixes.get(raw)
    if cached is not None:  # read on every ledger line: parse each distinct value once
        return cached
    prefix = _prefix_of(raw)
    _prefixes[raw] = prefix
    return prefix


def _prefix_of(raw: str) -> str:
    try:
        cores = parse_visible_devices(raw)
    except DeviceListError as exc:
        if raw not in _warned:
            _warned.add(raw)
            logger.warning("%s; using the engine prefix %r", exc, NO_DEVICE)
        return NO_DEVICE
    if not cores:
        return NO_DEVICE
    return f"dev{cores[0]}_{cores[-1]}"


# Ranks -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankInfo:
    """Where this worker sits: global rank (unique per process), and its tp/dp ranks."""

    global_rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0


def _vllm_group(accessor: str) -> Any | None:
    """vLLM's ``parallel_state.<accessor>`` through the fence (vllm_internals.py), when this
    process has loaded vLLM's parallel state (else it is no vLLM rank): None otherwise."""
    if _PARALLEL_STATE not in sys.modules:
        return None
    return resolve(f"{_PARALLEL_STATE}.{accessor}")


def _vllm_rank(accessor: str, otherwise: int) -> int:
    get_group = _vllm_group(accessor)
    if get_group is None:
        return otherwise
    try:
        return int(get_group().rank_in_group)
    except Exception:  # noqa: BLE001 - vLLM's groups are not set up (yet)
        return otherwise


def detect_ranks() -> RankInfo:
    """The ranks of this process: torch.distributed and vLLM's groups when initialised,
    else the launcher's ``RANK``/``VLLM_DP_RANK`` variables, else 0."""
    global_rank: int | None = None
    try:
        # Lazy: torch is heavy and optional; only this path needs it.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            global_rank = int(dist.get_rank())
    except Exception:  # noqa: BLE001 - torch may be absent or half-initialised
        global_rank = None
    launcher = load_identity_settings()
    if global_rank is None:
        global_rank = launcher.rank or 0
    tp_rank, dp_rank = global_rank, launcher.dp_rank or 0
    tp_rank = _vllm_rank("get_tp_group", tp_rank)
    dp_rank = _vllm_rank("get_dp_group", dp_rank)
    return RankInfo(global_rank=global_rank, tp_rank=tp_rank, dp_rank=dp_rank)


def tensor_parallel_size() -> int:
    """The size of this process's tensor-parallel group: vLLM's when it is set up, else
    torch.distributed's world size, else 1 (one process, no collective partner).

    Looked up in the modules already loaded, never imported: a process that has not
    imported vLLM is no vLLM rank, and the compile slots ask on every take (`peers`)."""
    get_tp_group = _vllm_group("get_tp_group")
    if get_tp_group is not None:
        try:
            return max(1, int(get_tp_group().world_size))
        except Exception:  # noqa: BLE001 - its groups are not set up (yet)
            pass
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return max(1, int(dist.get_world_size()))
        except Exception:  # noqa: BLE001 - half-initialised
            pass
    return 1
