"""The kept runtime parts of AOTInductor wrappers (aoti_wrapper.py): where, under what name,
made once, and only ever from a place no other user can change.

An object is kept in the local tier's node files (`runtime_objects_dir`, node_files.py),
named by the SHA-256 of everything its bytes depend on (the part's text, the compile command,
torch's version and AOTInductor runtime headers, the compiler's version, and what a
``native`` target in the command means on this CPU) and by the SHA-256 of its own bytes,
checked before each use: a torn or changed object is removed and made again.
It is made under a kernel lock (dropped if its maker dies) from a source and a staging file
of that attempt's own, and renamed into place whole.
It is used only from a directory this user owns and no one else can write, under
directories no one else can replace (private_dirs.py `why_not_private`): it is linked into
every artifact the node compiles, and those are published to the fleet.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import time

from vllm_neuron.backends import PRIVATE_FILE, KernelLock, LockTimeout, open_store
from vllm_neuron.backends.digests import file_digest
from vllm_neuron.compile.toolchains.cpu_target import torch_meaning
from vllm_neuron.compile.toolchains.node_files import group_dir
from vllm_neuron.compile.toolchains.private_dirs import make_private_dir
from vllm_neuron.compile.toolchains.torn_headers import run_healing_torn_headers

__all__ = ["FAILED", "RUNTIME_DIR", "KeptRuntime", "private_runtime_dir", "run",
           "runtime_objects_dir", "swap"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

RUNTIME_DIR = "runtime"
"""In this process's group of node files (node_files.py): the runtime parts' objects."""
DEBRIS_SECONDS = 3600.0
"""After this, what a killed maker left (its source, its staged object) is removed."""

FAILED: set[str] = set()
"""Runtime parts (and directories) whose split failed in this process: their wrappers
compile whole from then on, not failing again at every graph."""


def runtime_objects_dir() -> str:
    """Where the runtime parts' objects are kept: `RUNTIME_DIR` in this process's group of
    node files (node_files.py: in the local tier, private), its path without symlinks."""
    return os.path.realpath(os.path.join(group_dir(), RUNTIME_DIR))


def private_runtime_dir() -> str | None:
    """`runtime_objects_dir`, made ``0700`` if needed; None (said once, with why) when
    another user could change what it holds (private_dirs.py `why_not_private`): the
    wrappers are then compiled whole, which needs no kept object at all."""
    why: str | None
    try:
        directory = runtime_objects_dir()
    except OSError as exc:  # no group at all (node_files.py)
        directory, why = RUNTIME_DIR, str(exc)
    else:
        why = make_private_dir(directory)
    if why is None:
        return directory
    if directory not in FAILED:
        FAILED.add(directory)
        logger.info("vllm_neuron: %s is not private to this user (%s); AOTInductor wrappers "
                    "compile whole", directory, why)  # fmt: skip
    return None


class KeptRuntime:
    """A wrapper's runtime part and where its object is kept. Its name covers everything
    the object's bytes depend on: the part's text, the compile command (flags, the
    precompiled header's path, which torch names by compiler and headers), torch's version
    and its AOTInductor runtime headers, the compiler's version, and - for a command that
    compiles for ``native`` (torch's own flags: cpu_target.py) - what ``native`` means on
    this CPU, which the literal string does not say."""

    def __init__(self, text: str, cmd: list[str], source: str, out: str) -> None:
        digest = hashlib.sha256()
        flags = [t for t in cmd if t not in (source, out)]
        native = tuple(t[1:] for t in flags if t.startswith("-") and t.endswith("=native"))
        meaning = (torch_meaning(cmd[0], native),) if native else ()
        for piece in (text, *flags, *_build_identity(cmd[0]), *meaning):
            digest.update(piece.encode("utf-8", "surrogateescape"))
            digest.update(b"\0")
        self.name = digest.hexdigest()[:40]
        self.text, self.cmd, self.source, self.out = text, cmd, source, out
        self.made: str | None = None  # the object this process made, if it did

    def kept_or_made(self, directory: str, *, wait: float) -> str | None:
        """The kept object, made now if needed; None when another process holds its lock
        for longer than `wait` seconds, or it does not compile (then never again here)."""
        kept = _sound_object(directory, self.name)
        if kept is not None:
            return kept
        lock = KernelLock(os.path.join(directory, f"{self.name}.lock"),
                          name=f"AOTInductor runtime {self.name}")  # fmt: skip
        try:
            lock.acquire(timeout=wait)
        except LockTimeout:
            return None
        try:
            kept = _sound_object(directory, self.name)
            if kept is None:
                kept = self._make(directory)
            if kept is None:
                FAILED.add(self.name)
            return kept
        finally:
            lock.release()

    def _make(self, directory: str) -> str | None:
        _sweep_debris(directory)
        # Names of this attempt's own (a killed maker's compiler may still write its own);
        # its debug information names the source as one fixed path, so the same source makes
        # the same bytes, and it compiles from the directory itself, not from torch's build
        # directory (a new one per compile, which the debug information would record).
        runtime_src = os.path.join(directory, f"{self.name}.{os.getpid()}.cpp")
        staged = os.path.join(directory, f"{self.name}.{os.getpid()}.tmp")
        fixed = os.path.join(directory, f"{self.name}.cpp")
        try:
            # Through the storage layer (the only door to bytes): this user's private dir.
            open_store(directory, create=False, profile="local").write(
                os.path.basename(runtime_src), self.text.encode("utf-8"), mode=PRIVATE_FILE)
            command = swap(self.cmd, self.source, runtime_src, self.out, staged)
            if _maps_file_prefixes(self.cmd[0]):  # gcc < 8 cannot: its bytes name the source
                command.append(f"-ffile-prefix-map={runtime_src}={fixed}")
            if not run(command, directory):
                return None
            kept = os.path.join(directory, f"{self.name}.{_content_digest(staged)}.o")
            os.replace(staged, kept)  # whole, or not at all
            self.made = kept
            return kept
        finally:
            for leftover in (runtime_src, staged):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)


def _sweep_debris(directory: str) -> None:
    """Remove what makers killed mid-way left (their source and staged object), once they
    are an hour old: a maker's compiler may outlive it, writing its own files only."""
    now = time.time()
    for entry in os.listdir(directory):
        if entry.endswith((".cpp", ".tmp")):
            path = os.path.join(directory, entry)
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime > DEBRIS_SECONDS:
                    os.unlink(path)


@functools.lru_cache(maxsize=8)
def _build_identity(compiler: str) -> tuple[str, ...]:
    """What the runtime object's bytes depend on beyond its text and flags: torch's version,
    its AOTInductor runtime headers, the compiler's version."""
    import torch

    headers = hashlib.sha256()
    include = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc",
                           "inductor")  # fmt: skip
    for sub in ("aoti_runtime", "aoti_include"):
        folder = os.path.join(include, sub)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    headers.update(name.encode() + b"\0" + f.read())
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                          check=False, timeout=60)  # fmt: skip
    return (torch.__version__, str(getattr(torch.version, "git_version", "")),
            headers.hexdigest(), done.stdout + done.stderr)


@functools.lru_cache(maxsize=8)
def _maps_file_prefixes(compiler: str) -> bool:
    """Whether `compiler` takes ``-ffile-prefix-map`` (gcc 8, clang 10 and later)."""
    try:
        done = subprocess.run([compiler, "-ffile-prefix-map=/a=/b", "-x", "c++", "-fsyntax-only",
                               os.devnull], capture_output=True, check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


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


def run(cmd: list[str], cwd: str) -> bool:
    """Run a compiler command, healing a torn precompiled header of torch's that it reads
    (torn_headers.py: not the split's failure); whether it succeeded (its output logged when
    not)."""
    try:
        run_healing_torn_headers(_run_checked, shlex.join(cmd), cwd)
    except _CompileFailed as exc:
        logger.debug("compile cache: %s failed: %s", " ".join(cmd[:2]), exc)
        return False
    return True


class _CompileFailed(Exception):
    """A compiler command's failure; its message ends with the compiler's output."""


def _run_checked(cmd_line: str, cwd: str) -> None:
    done = subprocess.run(shlex.split(cmd_line), cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, check=False)  # fmt: skip
    if done.returncode != 0:
        raise _CompileFailed(f"exit {done.returncode}: "
                             f"{done.stdout[-2000:].decode(errors='replace')}")  # fmt: skip


def swap(cmd: list[str], source: str, new_source: str, out: str, new_out: str) -> list[str]:
    """`cmd` compiling `new_source` into `new_out` instead of `source` into `out`."""
    return [new_source if t == source else new_out if t == out else t for t in cmd]
