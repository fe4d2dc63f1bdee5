"""Helpers shared by the snapshot tests (imported by name; conftest puts this dir on the path)."""

from __future__ import annotations

from typing import Any

from vllm_neuron.snapshot import SnapshotConfig, load_snapshot_config

PREFIX = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_"
HASH = "0123456789abcdef0123456789abcdef"


def make_config(root: str, **env: str) -> SnapshotConfig:
    """An enabled config from short names: ``make_config(root, CAPTURE_TOKEN="12")``."""
    full = {PREFIX + "ENABLE": "1", PREFIX + "DIR": root}
    full.update({PREFIX + k: v for k, v in env.items()})
    return load_snapshot_config(full)


def ctx(step: int, req_ids: Any = ("r-0",), positions: Any = (10,), is_decode: Any = True,
        num_spec: int = 0, config: SnapshotConfig | None = None) -> Any:  # fmt: skip
    """A forward context with its verdict evaluated by ``config``'s selector."""
    from vllm_neuron.snapshot import SnapshotForwardContext

    return SnapshotForwardContext.build(
        step, list(req_ids), list(positions), is_decode, num_spec,
        selector=None if config is None else config.selector,
    )  # fmt: skip
