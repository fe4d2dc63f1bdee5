"""Compile cache: cache key, toolchains, two-tier cache and the torch.compile backend.

Kept import-light on purpose: submodules import torch themselves, so importing
``vllm_neuron.compile`` costs nothing until a graph is compiled.
"""

from .tiers.promote import save_cache

__all__ = ["save_cache"]
