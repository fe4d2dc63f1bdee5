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
   plus an explicit instantiation of the base class. Its object is kept in torch's own
   per-user cache directory (where AOTInductor keeps its precompiled headers), named by the
   SHA-256 of its text and of the compile command (so only a wrapper with byte-identical
   runtime text, compiled with identical flags, reuses it) and by the SHA-256 of its own
   bytes, checked before each use (a torn or changed object is removed and made again).
   Made under a file lock and renamed into place whole: a process killed mid-way leaves no
   object, and concurrent compiles on a node make it once. Used only from a directory that
   this user owns and no one else can write (`_private`): the object is linked into every
   artifact the node compiles, and those are published to the fleet.
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
not had within `LOCK_SECONDS`, a cache directory that cannot be written (full, read-only),
a kept runtime object that does not link (it is then removed, and made again next time).
The split never makes a compile fail that would otherwise succeed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vllm_neuron.backends.digests import file_digest

__all__ = ["LOCK_SECONDS", "RUNTIME_DIR", "compile_and_package", "prepare_runtime",
           "runtime_objects_dir", "split_wrapper_builds", "split_wrapper_source"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

RUNTIME_DIR = "vllm_neuron_aoti_runtime"
"""Under torch's per-user cache directory: the runtime parts' objects, by digest."""
LOCK_SECONDS = 300.0
"""How long a compile waits for another process making the same runtime object."""

_INTERFACE_END = '} // extern "C"\n'
_MODEL_MARK = "AOTInductorModel::AOTInductorModel("
_BASE = "AOTInductorModelBase<AOTInductorModel>"
_DECLARE = f"namespace torch::aot_inductor {{ extern template class {_BASE}; }}\n"
_INSTANTIATE = f"namespace torch::aot_inductor {{ template class {_BASE}; }}\n"

_active = threading.local()
_install_lock = threading.Lock()
_installed = False

RunCmd = Callable[[str, str], None]


def compile_and_package(program: Any, package_path: str,
                        inductor_configs: Mapping[str, Any]) -> None:  # fmt: skip
    """torch's ``aoti_compile_and_package`` of an exported `program`, its wrapper compiled
    in two parts: how the host toolchain compiles, in a worker or in place."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    with split_wrapper_builds():
        torch._inductor.aoti_compile_and_package(
            program, package_path=package_path, inductor_configs=dict(inductor_configs) or None)


def prepare_runtime(program: Any, package_path: str,
                    inductor_configs: Mapping[str, Any]) -> bool:  # fmt: skip
    """Compile `program` only as far as its wrapper's runtime part: what AOTInductor builds
    once per node (precompiled headers, then that part) is then kept for later compiles;
    the graph's own code is not compiled. True when the runtime part is kept (else the
    graph was compiled whole, or not at all: its error is raised)."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    try:
        with split_wrapper_builds(stop_after_runtime=True):
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
        exc = exc.__cause__ or exc.__context__
    return False


class _RuntimeKept(Exception):
    """Raised through torch's compile once the runtime part is kept (`prepare_runtime`)."""


@contextlib.contextmanager
def split_wrapper_builds(*, stop_after_runtime: bool = False) -> Iterator[None]:
    """Within this block, in this thread, AOTInductor wrappers compile in two parts (with
    `stop_after_runtime`, only the runtime part, then `_RuntimeKept` is raised)."""
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


def runtime_objects_dir() -> str:
    """Where the runtime parts' objects are kept: beside AOTInductor's precompiled headers."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.join(default_cache_dir(), RUNTIME_DIR)


# ------------------------------------------------------------------------------- the hook
def _install() -> None:
    """Put `_run` in front of torch's compile-command runner, once per process. Only threads
    inside `split_wrapper_builds` are affected; every other command runs as before."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from torch._inductor import cpp_builder

        original: RunCmd = cpp_builder._run_compile_cmd

        def run(cmd_line: str, cwd: str) -> None:
            if getattr(_active, "depth", 0) and _split_build(cmd_line, cwd):
                return
            original(cmd_line, cwd)

        cpp_builder._run_compile_cmd = run
        _installed = True


def _split_build(cmd_line: str, cwd: str) -> bool:
    """Build the wrapper object of `cmd_line` in two parts; False (nothing built) when the
    command is not a wrapper compile or the split cannot be done: run it as it is."""
    cmd = shlex.split(cmd_line)
    sources = [t for t in cmd if t.endswith(".wrapper.cpp")]
    if len(sources) != 1 or "-c" not in cmd or cmd.count("-o") != 1:
        return False
    out = cmd[cmd.index("-o") + 1]
    if not out.endswith(".wrapper.o"):
        return False
    source = sources[0]
    try:
        with open(source, encoding="utf-8") as f:
            parts = split_wrapper_source(f.read())
    except (OSError, UnicodeDecodeError):
        return False
    if parts is None:
        logger.debug("compile cache: %s is not laid out as expected; compiled whole", source)
        return False
    runtime_text, model_text = parts
    runtime = _Runtime(runtime_text, [t for t in cmd if t not in (source, out)], cmd,
                       source, out)  # fmt: skip
    model_src = source[: -len(".wrapper.cpp")] + ".wrapper_model.cpp"
    model_o = out[: -len(".o")] + "_model.o"
    try:
        directory = _private_runtime_dir()
        if directory is None:
            return False
        # The runtime part first when no other process is making it (others may wait for
        # it); else the model part first, which overlaps the wait.
        runtime_o = runtime.kept_or_made(directory, wait=0.0)
        if getattr(_active, "stop", False):
            if runtime_o is None:
                runtime_o = runtime.kept_or_made(directory, wait=LOCK_SECONDS)
            if runtime_o is None:
                return False
            raise _RuntimeKept(runtime_o)
        try:
            with open(model_src, "w", encoding="utf-8") as f:
                f.write(model_text)
            if not _compile(_swap(cmd, source, model_src, out, model_o), model_src, cwd):
                return False
            if runtime_o is None:
                runtime_o = runtime.kept_or_made(directory, wait=LOCK_SECONDS)
            if runtime_o is None:
                return False
            if not _run([cmd[0], "-r", "-nostdlib", "-o", out, model_o, runtime_o], cwd):
                logger.debug("compile cache: the kept AOTInductor runtime %s did not link; "
                             "removed", runtime_o)  # fmt: skip
                with contextlib.suppress(OSError):
                    os.unlink(runtime_o)
                with contextlib.suppress(OSError):
                    os.unlink(out)  # what the failed link may have left: torch writes it anew
                return False
        finally:
            for leftover in (model_src, model_o):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
    except _Unbuildable:
        return False
    except OSError as exc:  # a full or read-only disk: torch's own command says what it can
        logger.debug("compile cache: the AOTInductor wrapper could not be split (%s)", exc)
        return False
    logger.debug("compile cache: %s compiled in two parts (runtime %s)", source, runtime_o)
    return True


def _private_runtime_dir() -> str | None:
    """`runtime_objects_dir`, made if needed; None when it is not private to this user."""
    directory = runtime_objects_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if not _private(directory):
        logger.debug("compile cache: %s is not private to this user; wrappers compile whole",
                     directory)  # fmt: skip
        return None
    return directory


class _Unbuildable(Exception):
    """The runtime part does not compile on its own: the wrapper is compiled whole."""


class _Runtime:
    """A wrapper's runtime part (`text`, compiled with `flags`) and where its object is."""

    def __init__(self, text: str, flags: list[str], cmd: list[str], source: str,
                 out: str) -> None:  # fmt: skip
        digest = hashlib.sha256()
        for piece in (text, *flags):
            digest.update(piece.encode())
            digest.update(b"\0")
        self.name = digest.hexdigest()[:40]
        self.text, self.cmd, self.source, self.out = text, cmd, source, out

    def kept_or_made(self, directory: str, *, wait: float) -> str | None:
        """The kept object, made now if needed; None when another process holds its lock
        for longer than `wait` seconds. `_Unbuildable` when it does not compile."""
        from filelock import FileLock, Timeout

        kept = _sound_object(directory, self.name)
        if kept is not None:
            return kept
        try:
            with FileLock(os.path.join(directory, f"{self.name}.lock"), timeout=wait):
                return _sound_object(directory, self.name) or self._make(directory)
        except Timeout:
            return None

    def _make(self, directory: str) -> str:
        # Names of their own under the lock, the same for every build: the object's debug
        # information names its source, and the same source makes the same bytes.
        runtime_src = os.path.join(directory, f"{self.name}.cpp")
        staged = os.path.join(directory, f"{self.name}.tmp")
        try:
            with open(runtime_src, "w", encoding="utf-8") as f:
                f.write(self.text)
            # From the directory itself, not torch's build directory (a new one per
            # compile, which the debug information would record).
            command = _swap(self.cmd, self.source, runtime_src, self.out, staged)
            if not _compile(command, runtime_src, directory):
                raise _Unbuildable(runtime_src)
            kept = os.path.join(directory, f"{self.name}.{_content_digest(staged)}.o")
            os.replace(staged, kept)  # whole, or not at all
            return kept
        finally:
            for leftover in (runtime_src, staged):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)


def _private(directory: str) -> bool:
    """Whether `directory` and its parent belong to this user and no one else can write
    them: what is kept there is linked into every artifact this node compiles (and may
    publish to the fleet), so another user's object must never be picked up."""
    for path in (directory, os.path.dirname(directory)):
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
    return True


def _sound_object(directory: str, name: str) -> str | None:
    """The kept object `name` whose bytes match the digest in its file name; any other file
    of that name (torn, changed) is removed."""
    prefix = f"{name}."
    for entry in os.listdir(directory):
        if not (entry.startswith(prefix) and entry.endswith(".o")):
            continue
        path = os.path.join(directory, entry)
        if entry == f"{name}.{_content_digest(path)}.o":
            return path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return None


def _content_digest(path: str) -> str:
    return file_digest(path).sha256[:32]


def _swap(cmd: list[str], source: str, new_source: str, out: str, new_out: str) -> list[str]:
    return [new_source if t == source else new_out if t == out else t for t in cmd]


def _compile(cmd: list[str], what: str, cwd: str) -> bool:
    if _run(cmd, cwd):
        return True
    logger.debug("compile cache: %s did not compile on its own; the wrapper is compiled whole",
                 what)  # fmt: skip
    return False


def _run(cmd: list[str], cwd: str) -> bool:
    done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          check=False)  # fmt: skip
    return done.returncode == 0
