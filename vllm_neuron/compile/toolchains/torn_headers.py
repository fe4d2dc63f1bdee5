"""A torn precompiled header of torch's, removed instead of failing every compile after it.

AOTInductor compiles its wrapper and kernels with precompiled headers, which torch builds
into the temporary directory's ``torchinductor_<user>/precompiled_headers`` once per node and
never again while the file exists. A header torn by a build that was killed mid-write (an
OOM kill, a reboot) then fails every compile that reads it ("cannot read PCH file"), on that
node, until someone removes it - and a compile that fails is a failure the graph's waiters
raise, fleet-wide during a cold start, for something that is this node's disk and not the
graph.

`run_healing_torn_headers` runs a compile command; when GCC cannot read a header of
torch's that the command includes, it waits for torch's lock on that header (a build in
progress elsewhere finishes first) and runs the command again; only if it still cannot read
it, the header is removed (under that lock, which is then released) and the command runs
once more: its ``-include`` then reads the header's text. Torch remembers a header per
process, so the process that removed it compiles without it from then on; the next process
builds it again, as torch does for a missing one. Said once per header, as a warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import threading
from collections.abc import Callable, Iterator

__all__ = ["LOCK_SECONDS", "TORN_MESSAGES", "publish_by_rename", "run_healing_torn_headers"]

logger = logging.getLogger("vllm_neuron.compile")

TORN_MESSAGES = ("cannot read PCH file", "while reading precompiled header")
"""What GCC says of a precompiled header it cannot read (torn, truncated): ``-include`` on
the command line, or in the source."""
LOCK_SECONDS = 300.0
"""How long a compile waits for a build of the header in progress elsewhere."""


def run_healing_torn_headers(run: Callable[[str, str], None], cmd_line: str, cwd: str) -> None:
    """`run(cmd_line, cwd)` (a runner of compile commands that raises on failure, with the
    compiler's output in its message), healing a torn precompiled header of torch's that the
    command reads (see the module); any other failure is raised as it is. A command that
    builds a precompiled header writes it by rename (`publish_by_rename`)."""
    run = publish_by_rename(run)
    try:
        run(cmd_line, cwd)
        return
    except Exception as exc:
        headers = _torchs_headers(cmd_line) if _torn(exc) else []
        if not headers:
            raise
        first = exc
    try:
        with _header_locks(headers):
            pass  # a build in progress elsewhere has finished
    except Exception:  # its lock not had in time: the compile's own failure stands
        raise first from None
    try:
        run(cmd_line, cwd)
        return
    except Exception as exc:
        if not _torn(exc):
            raise
        first = exc
    try:
        with _header_locks(headers):  # nobody builds or removes it meanwhile
            for header in headers:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(header + ".gch")
    except Exception:
        raise first from None
    logger.warning("vllm_neuron: torch's precompiled header %s could not be read (torn by a "
                   "build killed mid-write?); removed: this process compiles without it, the "
                   "next one builds it again", ", ".join(h + ".gch" for h in headers))  # fmt: skip
    run(cmd_line, cwd)


def publish_by_rename(run: Callable[[str, str], None]) -> Callable[[str, str], None]:
    """`run`, with a command whose output (``-o``) is a precompiled header (``.gch``) made
    to write a name of this build's own beside it, renamed onto the header once it
    succeeded: readers see no header or a whole one. What a killed build leaves is its own
    ``.tmp`` file, never the shared name; a failed one's is removed."""

    def publishing(cmd_line: str, cwd: str) -> None:
        try:
            words = shlex.split(cmd_line)
        except ValueError:
            words = []
        at = [i for i, word in enumerate(words[:-1])
              if word == "-o" and words[i + 1].endswith(".gch")]  # fmt: skip
        if len(at) != 1:
            run(cmd_line, cwd)
            return
        header = os.path.join(cwd, words[at[0] + 1])
        staged = f"{header}.{os.getpid()}.{threading.get_ident()}.tmp"
        words[at[0] + 1] = staged
        try:
            run(shlex.join(words), cwd)
            os.replace(staged, header)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)

    return publishing


def _torn(exc: Exception) -> bool:
    return any(message in str(exc) for message in TORN_MESSAGES)


def _torchs_headers(cmd_line: str) -> list[str]:
    """The precompiled headers of torch's (in its header directory, with a ``.gch`` beside
    them) that `cmd_line` includes with ``-include``."""
    from torch._inductor import codecache

    header_dir = getattr(codecache, "_HEADER_DIR", None)
    if not header_dir:
        return []
    directory = os.path.realpath(header_dir)
    try:
        words = shlex.split(cmd_line)
    except ValueError:
        return []
    included = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "-include"]
    included += [word[len("-include"):] for word in words
                 if word.startswith("-include") and len(word) > len("-include")]  # fmt: skip
    return [path for path in included
            if os.path.dirname(os.path.realpath(path)) == directory
            and os.path.isfile(path + ".gch")]  # fmt: skip


@contextlib.contextmanager
def _header_locks(headers: list[str]) -> Iterator[None]:
    """torch's own build locks of `headers` (``precompiled_headers/locks/<name>.lock``, as
    `codecache._precompile_header` names them), held for the block."""
    from torch._inductor import codecache
    from torch.utils._filelock import FileLock

    lock_dir: str = getattr(codecache, "_HEADER_LOCK_DIR", "")
    with contextlib.ExitStack() as held:
        for header in sorted(headers) if lock_dir else ():
            name = os.path.splitext(os.path.basename(header))[0]
            held.enter_context(FileLock(os.path.join(lock_dir, f"{name}.lock"),
                                        timeout=LOCK_SECONDS))  # fmt: skip
        yield
