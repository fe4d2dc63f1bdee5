"""AOTInductor's C++ wrapper compiled in two parts: its runtime once per node, the model per graph.

Why: most of a host compile is ``g++`` on the wrapper AOTInductor generates, and most of that
is not the model. Every wrapper carries the same runtime: the C interface the loader calls
(``AOTInductorModelContainerCreate`` ...), the model container, and the model's base class
template (``AOTInductorModelBase<AOTInductorModel>``, whose constructor alone instantiates
``std::regex``), all instantiated and compiled again for each graph. Measured with torch 2.13
on a small vLLM-like piece: 3.5 s for the whole wrapper; 1.6 s for its model part when the
base class is declared instantiated elsewhere (``extern template``); 3.5 s for the runtime
part with the base class instantiated, once. Three pieces of a tiny Llama then cost about
6 core-seconds less, on every cold host start.

How: while `split_wrapper_builds` is active in a thread, torch's compile of a
``*.wrapper.cpp`` into ``*.wrapper.o`` (``cpp_builder._run_compile_cmd``) is done as

1. the *runtime part*: the wrapper's text up to the end of its ``extern "C"`` interface,
   plus an explicit instantiation of the base class, compiled once per node and kept
   (aoti_runtime_store.py: named by all its bytes depend on and by its bytes' digest, made
   under a lock, used only from a place no other user can change).
2. the *model part*: the wrapper's ``#include`` lines, the ``extern template`` declaration,
   and the rest of the wrapper, compiled with the original command.
3. ``g++ -r`` of both into the ``*.wrapper.o`` torch expects; torch links the package as
   always. The package is what torch would build (the same code, in two translation units)
   and loads with torch's loader.

The runtime part is made first when no other process is making it (others may be waiting
for it); when one is, the model part is compiled while it does. `prepare_runtime` compiles
a graph only as far as the runtime part: a cold start's probe (head_start.py) makes it
before the first graph needs it.

Anything unexpected runs torch's own command instead: a wrapper without the layout this
relies on (another torch, another kind of wrapper), a part that does not compile, a lock
not had within `LOCK_SECONDS`, a directory that cannot be written (full, read-only) or that
another user could change, a kept runtime object that does not link (removed, unless this
process just made it), any other error. A part that failed once is not split again in that
process. The split never makes a compile fail that would otherwise succeed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vllm_neuron.compile.toolchains.aoti_runtime_store import (
    FAILED,
    RUNTIME_DIR,
    KeptRuntime,
    private_runtime_dir,
    run,
    runtime_objects_dir,
    swap,
)
from vllm_neuron.compile.toolchains.cpu_target import compiling_for
from vllm_neuron.compile.toolchains.node_files import secure_inductor_dirs
from vllm_neuron.compile.toolchains.torch_internals import resolve
from vllm_neuron.compile.toolchains.torn_headers import run_healing_torn_headers
from vllm_neuron.compile.toolchains.vector_isa import ask_first_valid_only
from vllm_neuron.envs import cold_start_without

__all__ = ["LOCK_SECONDS", "RUNTIME_DIR", "compile_and_package", "prepare_runtime",
           "runtime_objects_dir", "split_wrapper_builds", "split_wrapper_source"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

LOCK_SECONDS = 300.0
"""How long a compile waits for another process making the same runtime object."""

_INTERFACE_END = '} // extern "C"\n'
_MODEL_MARK = "AOTInductorModel::AOTInductorModel("
_BASE = "AOTInductorModelBase<AOTInductorModel>"
_DECLARE = f"namespace torch::aot_inductor {{ extern template class {_BASE}; }}\n"
_INSTANTIATE = f"namespace torch::aot_inductor {{ template class {_BASE}; }}\n"

_active = threading.local()
_install_lock = threading.Lock()

RunCmd = Callable[[str, str], None]
RUN_COMPILE_CMD = "torch._inductor.cpp_builder._run_compile_cmd"


def compile_and_package(program: Any, package_path: str, inductor_configs: Mapping[str, Any],
                        cflags: tuple[str, ...] = ()) -> None:  # fmt: skip
    """torch's ``aoti_compile_and_package`` of an exported `program`, its wrapper compiled
    in two parts, for the explicit target `cflags` where torch would compile for ``native``
    (cpu_target.py; empty: torch's own flags): how the host toolchain compiles, in a worker
    or in place."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    secure_inductor_dirs()  # its cache and headers go into the artifact: private ones only
    ask_first_valid_only()  # Inductor's CPU probe tests only the ISA it will pick
    with compiling_for(cflags, inductor_configs), split_wrapper_builds():
        torch._inductor.aoti_compile_and_package(
            program, package_path=package_path, inductor_configs=dict(inductor_configs) or None)


def prepare_runtime(program: Any, package_path: str, inductor_configs: Mapping[str, Any],
                    cflags: tuple[str, ...] = ()) -> bool:  # fmt: skip
    """Compile `program` only as far as its wrapper's runtime part: what AOTInductor builds
    once per node (precompiled headers, then that part) is then kept for later compiles;
    the graph's own code is not compiled. True when the runtime part is kept (else the
    graph was compiled whole, or not at all: its error is raised)."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    secure_inductor_dirs()
    ask_first_valid_only()
    try:
        with compiling_for(cflags, inductor_configs), \
                split_wrapper_builds(stop_after_runtime=True):
            torch._inductor.aoti_compile_and_package(
                program, package_path=package_path,
                inductor_configs=dict(inductor_configs) or None)  # fmt: skip
    except Exception as exc:  # torch wraps what its compile raises (InductorError)
        if not _caused_by_kept(exc):
            raise
        return True
    return False


def _caused_by_kept(exc: BaseException | None) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, _RuntimeKept):
            return True
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None)  # torch's InductorError
        exc = inner if isinstance(inner, BaseException) else exc.__cause__ or exc.__context__
    return False


class _RuntimeKept(Exception):
    """Raised through torch's compile once the runtime part is kept (`prepare_runtime`)."""


@contextlib.contextmanager
def split_wrapper_builds(*, stop_after_runtime: bool = False) -> Iterator[None]:
    """Within this block, in this thread, AOTInductor wrappers compile in two parts (with
    `stop_after_runtime`, only the runtime part, then `_RuntimeKept` is raised)."""
    if cold_start_without("wrapper-split"):  # the A/B benchmark's other side: whole
        yield
        return
    _install()
    saved = getattr(_active, "depth", 0), getattr(_active, "stop", False)
    _active.depth, _active.stop = saved[0] + 1, stop_after_runtime
    try:
        yield
    finally:
        _active.depth, _active.stop = saved


def split_wrapper_source(source: str) -> tuple[str, str] | None:
    """(runtime part, model part) of a wrapper's text, each a complete translation unit, or
    None when the text is not laid out as this module expects."""
    lines = source.splitlines(keepends=True)
    head = 0
    while head < len(lines) and (not lines[head].strip() or lines[head].startswith("#include")):
        head += 1
    end = source.find(_INTERFACE_END)
    if head == 0 or end < 0 or source.count(_INTERFACE_END) != 1:
        return None
    runtime, model = source[:end + len(_INTERFACE_END)], source[end + len(_INTERFACE_END):]
    if _MODEL_MARK not in model or _MODEL_MARK in runtime or _BASE in model:
        return None
    if "AOTInductorModelContainerCreate" not in runtime:
        return None
    preamble = "".join(lines[:head])
    return runtime + _INSTANTIATE, preamble + _DECLARE + model


# ------------------------------------------------------------------------------- the hook
def _install() -> None:
    """Put `run` in front of torch's compile-command runner (again if something replaced
    it since). Only threads inside `split_wrapper_builds` are affected (wrappers split, a
    torn precompiled header healed: torn_headers.py); every other command runs as before."""
    with _install_lock:
        # Through the fence: a torch without it (or with another signature) compiles whole.
        current = resolve(RUN_COMPILE_CMD)
        if current is None or getattr(current, "_vllm_neuron_split", False):
            return
        original: RunCmd = current

        def run(cmd_line: str, cwd: str) -> None:
            if not getattr(_active, "depth", 0):
                original(cmd_line, cwd)
            elif not _split_build(cmd_line, cwd):
                run_healing_torn_headers(original, cmd_line, cwd)

        run._vllm_neuron_split = True  # type: ignore[attr-defined]
        from torch._inductor import cpp_builder

        cpp_builder._run_compile_cmd = run


def _split_build(cmd_line: str, cwd: str) -> bool:
    """Build the wrapper object of `cmd_line` in two parts; False (nothing built) when the
    command is not a wrapper compile or the split cannot be done: run it as it is. Never
    raises, but `_RuntimeKept` (the runtime part is kept, as `prepare_runtime` asked)."""
    try:
        return _split(cmd_line, cwd)
    except _RuntimeKept:
        if os.path.basename(cwd).endswith("_CxxBuild"):  # torch's, which it would remove
            shutil.rmtree(cwd, ignore_errors=True)
        raise
    except Exception as exc:  # noqa: BLE001 - the split is an optimisation: compile whole
        logger.debug("compile cache: the AOTInductor wrapper could not be split (%s: %s); "
                     "compiled whole", type(exc).__name__, exc)  # fmt: skip
        return False


def _split(cmd_line: str, cwd: str) -> bool:
    cmd = shlex.split(cmd_line)
    sources = [t for t in cmd if t.endswith(".wrapper.cpp")]
    if len(sources) != 1 or "-c" not in cmd or cmd.count("-o") != 1 or cmd[-1] == "-o":
        return False
    source, out = sources[0], cmd[cmd.index("-o") + 1]
    if not out.endswith(".wrapper.o"):
        return False
    with open(source, encoding="utf-8") as f:
        parts = split_wrapper_source(f.read())
    if parts is None:
        logger.debug("compile cache: %s is not laid out as expected; compiled whole", source)
        return False
    runtime_text, model_text = parts
    runtime = KeptRuntime(runtime_text, cmd, source, out)
    if runtime.name in FAILED:
        return False  # it failed once in this process: not again at every graph
    directory = private_runtime_dir()
    if directory is None:
        return False
    # The runtime part first when no other process is making it (others may be waiting for
    # it); else the model part first, which overlaps the wait.
    runtime_o = runtime.kept_or_made(directory, wait=0.0)
    if runtime.name in FAILED:
        return False  # it did not compile just now
    if getattr(_active, "stop", False):
        runtime_o = runtime_o or _waited_for(runtime, directory)
        if runtime_o is None:
            return False
        raise _RuntimeKept(runtime_o)
    model_src = source[: -len(".wrapper.cpp")] + ".wrapper_model.cpp"
    model_o = out[: -len(".o")] + "_model.o"
    try:
        with open(model_src, "w", encoding="utf-8") as f:
            f.write(model_text)
        if not run(swap(cmd, source, model_src, out, model_o), cwd):
            FAILED.add(runtime.name)
            return False
        runtime_o = runtime_o or _waited_for(runtime, directory)
        if runtime_o is None:
            return False
        if not run([cmd[0], "-r", "-nostdlib", "-o", out, model_o, runtime_o], cwd):
            FAILED.add(runtime.name)
            if runtime.made is None:  # kept from before: it may be what is wrong
                with contextlib.suppress(OSError):
                    os.unlink(runtime_o)
            with contextlib.suppress(OSError):
                os.unlink(out)  # what the failed link may have left: torch writes it anew
            return False
    finally:
        for leftover in (model_src, model_o):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
    logger.debug("compile cache: %s compiled in two parts (runtime %s)", source, runtime_o)
    return True


def _waited_for(runtime: KeptRuntime, directory: str) -> str | None:
    """The runtime object another process is making, waited for up to `LOCK_SECONDS`; one
    not had by then (a maker that stalls) is not waited for again in this process."""
    kept = runtime.kept_or_made(directory, wait=LOCK_SECONDS)
    if kept is None:
        FAILED.add(runtime.name)
    return kept
