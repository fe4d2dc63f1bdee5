"""Shared data of the manifest tests: the documented example graph as a real cache entry."""

from __future__ import annotations

import os
from collections.abc import Callable

SEED_KEY = "fc5c06b7" + "0" * 24
SEED_HLO = """HloModule jit_forward


ENTRY %main.42 (p0.1: s32[4], p1.2: s32[4]) -> (s32[4], f32[4,49152]) {
  %p0.1 = s32[4]{0} parameter(0)
  %p1.2 = s32[4]{0} parameter(1)
  ROOT %tuple.41 = (s32[4]{0}, f32[4,49152]{1,0}) tuple(%p0.1, %p1.2)
}
"""
SEED_NEFF_SIZE = 949498


def neuron_like_compile(key: str) -> Callable[[str], dict[str, object]]:
    """A compile function that writes what neuronx-cc leaves: an HLO module and a NEFF."""

    def compile_into(out_dir: str) -> dict[str, object]:
        with open(os.path.join(out_dir, "graph.hlo"), "w", encoding="utf-8") as f:
            f.write(SEED_HLO)
        neff = f"graph_{key}.neff"
        with open(os.path.join(out_dir, neff), "wb") as f:
            f.write(os.urandom(SEED_NEFF_SIZE))
        return {
            "toolchain": "neuron",
            "target": "trn2",
            "files": [neff],
            "output_shapes": [],
            "out_spec": "",
            "num_inputs": 2,
            "hlo_file": "graph.hlo",
        }

    return compile_into
