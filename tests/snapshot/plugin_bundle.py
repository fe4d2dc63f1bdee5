"""A snapshot bundle in the Neuron plugin's form, written the way the plugin writes it.

On a Trainium host AWS's Neuron plugin writes, per captured call,
``<hash>/rank<global rank>/call<call index>/`` holding ``tensor{i}.{format}`` (one file per
positional input, written by the Neuron runtime's serialize op) and a ``meta.json`` written
last with ``json.dump(payload, f, indent=2, sort_keys=True)``. Its fields:

    schema, hash, format, global_rank, tp_rank, dp_rank, call_index, selected_by,
    inputs: [{index, dtype, shape}], global_step, is_prompt, matches, req_ids, positions

``dtype`` is ``str(tensor.dtype)`` (``"torch.bfloat16"``); a match is the plugin's
``SnapshotMatch`` as a dict (``batch_index``, ``request_id``, ``position``, ``reason``),
where a token match's ``position`` is the targeted token; ``selected_by`` names the rules
``call_index``, ``token`` and ``request``. In ``npy`` format bfloat16 and float8 have no
numpy type and are stored as raw fixed-width bytes (``|V2`` / ``|V1``).

This module writes such a bundle with numpy and json only (no torch, nothing of
``vllm_neuron``), so the fixture cannot accidentally be in our own form.
``tests/snapshot/data/neuron_plugin/`` holds the files it writes (checked byte for byte by
the tests), so the foreign form is also on disk as files.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

DATA_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "neuron_plugin")
PLUGIN_HASH = "5f0c2e9ab7d14c3e"
CALL_INDEX = 3
REQ_IDS = ["chatcmpl-warm-1b2c3d4e", "chatcmpl-debug-42-9a8546d5"]
POSITIONS = [40, 12]  # decode: one position per row
TARGET = 13  # the token rule's target: row 1 at position 12 generates position 13


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as raw 2-byte records."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).view("V2")


def plugin_inputs(rank: int) -> list[tuple[str, np.ndarray]]:
    """``(torch dtype name, array as the runtime stores it)`` per positional input."""
    rng = np.random.default_rng(rank)
    hidden = rng.standard_normal((2, 8)).astype(np.float32)
    # float8_e4m3fn bytes of small values: 0x38 is 1.0, 0x40 2.0, 0xB8 -1.0, 0x30 0.5
    scales = np.array([0x38, 0x40, 0xB8, 0x30], dtype=np.uint8).view("V1")
    return [
        ("torch.int64", np.array([[1734], [29871]], dtype=np.int64)),  # input ids
        ("torch.int32", np.array(POSITIONS, dtype=np.int32)),
        ("torch.bfloat16", _bf16_bits(hidden)),
        ("torch.float8_e4m3fn", scales),
        ("torch.bool", np.array([True, False])),
    ]


def plugin_meta(rank: int, inputs: list[tuple[str, np.ndarray]]) -> dict[str, Any]:
    """The payload the plugin's ``write_call_meta`` builds for rank ``rank`` of tp 2."""
    return {
        "schema": 1,
        "hash": PLUGIN_HASH,
        "format": "npy",
        "global_rank": rank,
        "tp_rank": rank,
        "dp_rank": 0,
        "call_index": CALL_INDEX,
        "selected_by": ["call_index", "token"],
        "inputs": [
            {"index": i, "dtype": dtype, "shape": list(arr.shape)}
            for i, (dtype, arr) in enumerate(inputs)
        ],
        "global_step": 17,
        "is_prompt": False,
        "matches": [
            {"batch_index": 1, "request_id": REQ_IDS[1], "position": TARGET, "reason": "token"}
        ],
        "req_ids": list(REQ_IDS),
        "positions": list(POSITIONS),
    }


def write_plugin_call(call_dir: str, meta: dict[str, Any], arrays: list[np.ndarray]) -> None:
    """One call directory: the tensor files first, ``meta.json`` last, as the plugin does."""
    os.makedirs(call_dir, exist_ok=True)
    for i, arr in enumerate(arrays):
        np.save(os.path.join(call_dir, f"tensor{i}.{meta['format']}"), arr, allow_pickle=False)
    with open(os.path.join(call_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def write_plugin_bundle(root: str, ranks: int = 2) -> list[str]:
    """The plugin's bundles of call ``CALL_INDEX`` on ``ranks`` tp ranks; their call dirs."""
    dirs = []
    for rank in range(ranks):
        inputs = plugin_inputs(rank)
        call_dir = os.path.join(root, PLUGIN_HASH, f"rank{rank}", f"call{CALL_INDEX}")
        write_plugin_call(call_dir, plugin_meta(rank, inputs), [a for _, a in inputs])
        dirs.append(call_dir)
    return dirs


if __name__ == "__main__":  # regenerate tests/snapshot/data/neuron_plugin/
    print("\n".join(write_plugin_bundle(DATA_ROOT)))
