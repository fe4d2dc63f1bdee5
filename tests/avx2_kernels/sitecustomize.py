"""Make vLLM pick its AVX2 CPU kernels on any x86 CPU (tests/cpu_kernels.py puts this
folder first on a process's PYTHONPATH; Python imports ``sitecustomize`` at start-up).

vLLM's CPU platform chooses ``_C`` (AVX-512 + BF16), ``_C_AVX512`` or ``_C_AVX2`` from
``torch.cpu._is_avx512_supported()`` and ``_is_avx512_bf16_supported()``; with both False
it loads ``_C_AVX2`` (which runs on AVX-512 hardware too), has no shared-memory all-reduce,
and traces tensor-parallel collectives as torch's functional ones: what an AVX2-only CPU
(AMD EPYC) runs. The other AVX-512-only probes answer False as well, so Inductor and the
compile cache's key see the same CPU that vLLM does. Nothing is imported until the program
imports ``torch.cpu`` itself: processes that never use torch pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

_FALSE = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
          "_is_vnni_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")  # fmt: skip


def _answer_false() -> bool:
    return False


class _ForceAvx2(importlib.abc.MetaPathFinder):
    """Patches ``torch.cpu`` right after it is executed, whoever imports it first."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)  # find the real spec; this finder is done after that
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for probe in _FALSE:
                setattr(module, probe, _answer_false)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torch.cpu" in sys.modules:  # pragma: no cover - only if torch came before site
    for _probe in _FALSE:
        setattr(sys.modules["torch.cpu"], _probe, _answer_false)
else:
    sys.meta_path.insert(0, _ForceAvx2())
