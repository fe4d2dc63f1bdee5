"""vLLM's CPU kernel paths: which one this CPU runs, and how a test runs the AVX2 one anywhere.

vLLM picks its kernel library by the CPU (``CpuPlatform.import_kernels``), and what a
captured graph calls follows: with AVX-512, oneDNN matmuls (float32) and the shared-memory
all-reduce ``_C::shm_allreduce``; with AVX2 only, ``_C_AVX2``'s kernels and torch's
functional collectives on a gloo group. A suite that only ever ran the path of its
developer's CPU went red on the other kind twice. So the tests that depend on the choice
run the AVX2 path on every machine: where the CPU has AVX-512, the processes of that run get
``avx2_kernels/sitecustomize.py`` first on PYTHONPATH (vLLM then loads ``_C_AVX2``, as on an
AVX2-only CPU), aten's and oneDNN's own dispatch capped at AVX2; where it has not, that is
simply the CPU's path. Such a test names the path it ran in its id (``[avx2]``,
``[avx512-bf16]``), and the session's header says which path is this CPU's and which forced.

``VLLM_NEURON_TEST_KERNEL_PATHS=avx2`` runs only the AVX2 path (docs/testing: the AVX2 pass
alone); unset, every path this CPU can run.
"""

from __future__ import annotations

import os
from pathlib import Path

AVX2 = "avx2"
AVX2_SITE = Path(__file__).resolve().parent / "avx2_kernels"
ONLY = "VLLM_NEURON_TEST_KERNEL_PATHS"


def native_path() -> str:
    """The kernel path vLLM takes on this CPU, named as its library's build."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return AVX2
    return "avx512-bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"


def kernel_paths() -> list[str]:
    """The paths to run here: the AVX2 one first (forced when it is not the CPU's), then the
    CPU's own when it differs, unless ``VLLM_NEURON_TEST_KERNEL_PATHS`` narrows them."""
    paths = [AVX2] if native_path() == AVX2 else [AVX2, native_path()]
    only = os.environ.get(ONLY, "").strip()
    if not only:
        return paths
    wanted = [p.strip() for p in only.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in (AVX2, native_path())]
    if unknown:
        raise ValueError(f"{ONLY}={only!r}: this CPU runs {', '.join(paths)}, not {unknown}")
    return [p for p in paths if p in wanted]


def forced(path: str) -> bool:
    return path == AVX2 and native_path() != AVX2


def kernel_env(path: str) -> dict[str, str]:
    """Environment overrides for a process (a server, a replay) that must take ``path``."""
    if not forced(path):
        return {}
    pythonpath = os.pathsep.join(filter(None, [str(AVX2_SITE), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": pythonpath, "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}  # fmt: skip


def describe(path: str) -> str:
    if forced(path):
        return f"{path} (forced on this {native_path()} CPU)"
    return f"{path} (this CPU's)"


RAN: list[str] = []  # "what: path" lines, printed at the end of the session (conftest)


def note(what: str, path: str) -> None:
    """Say, in the session's output, which kernel path ``what`` ran on."""
    RAN.append(f"{what}: {describe(path)}")
