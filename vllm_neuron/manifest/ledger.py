"""The compile-time ledger: every rank records the graphs it traces.

One line per traced graph, appended to this process's own segment
``ledger/<prefix>/<run>/<pid>.jsonl`` through the storage layer (raw `os.write` on POSIX, so
a line survives a forked child's ``os._exit()``). ``<run>`` is the engine run's id
(:func:`vllm_neuron.envs.run_id`), shared by every process of the run, so the emit folds
this run's segments and never those a crashed earlier run left under the same prefix. The
first write of a process truncates a stale file of the same run and pid; later writes
append. Writers never share a file, so they never contend. Everything here is best-effort:
a failure is logged once and swallowed.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from vllm_neuron.backends import EventLog, Record, Store, encode_into, fault_point, join, open_store
from vllm_neuron.envs import redact_argv, run_id
from vllm_neuron.identity import get_server_prefix

from .schema import Piece

logger = logging.getLogger("vllm_neuron.manifest")
_thread = threading.get_ident
_write = os.write

LEDGER_DIR = "ledger"
_TRUNCATED: set[tuple[str, str, str, int]] = set()
_WRITERS: weakref.WeakSet[LedgerWriter] = weakref.WeakSet()


def _forget_segments_in_child() -> None:
    """In a forked child every writer re-resolves its segment (the child's own pid file)."""
    for writer in list(_WRITERS):
        writer._current = None
        writer._fd = writer._owner = -1
        writer._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_segments_in_child)


def ledger_stream(prefix: str, run: str) -> str:
    """The stream (directory) of one run's segments: ``ledger/<prefix>/<run>``."""
    return join(LEDGER_DIR, prefix, run)


class LedgerEntry(Record, frozen=True, tag="ledger", omit_defaults=True):
    """A ledger line, `{key, rank, input_shapes, compiler_flags}` (docs/manifest.md), plus
    the writer's global rank.

    ``rank`` is TP-group-relative; ``global_rank`` (when the writer knows it) lets the
    emitter attribute a graph correctly even when several TP groups share local ranks.
    ``piece`` is what vLLM calls the graph (compile range, subgraph index): the same on
    every rank even when the graph is not, so the emit can judge completeness per piece;
    absent when the compile did not come through vLLM (or from an older writer).

    Fields at their default are not written (``omit_defaults``): the line is those four
    fields plus the record tag, ~20% less to encode on every traced graph and to decode at
    emit. That includes ``v`` while it is 1, so a reader takes a line without ``v`` as
    version 1; a version 2 must therefore always be written, not become a default (the
    record codec refuses to read a type that omits a default ``v`` other than 1).
    """

    key: str
    rank: int
    input_shapes: list[str]
    compiler_flags: str
    global_rank: int | None = None
    piece: Piece | None = None


def _dim(d: Any) -> str:
    if isinstance(d, int):
        return str(int(d))
    if hasattr(d, "node"):
        # A symbolic size (torch.SymInt, what vLLM's piecewise graphs carry): its name.
        # int() would evaluate it, which specialises the graph being traced to one size.
        return str(d)
    return str(int(d)) if hasattr(d, "__index__") else str(d)


def format_shape(shape: Sequence[Any]) -> str:
    """The ledger's shape strings: ``(4,)`` -> "4,", ``(4, 8)`` -> "4, 8", ``()`` -> "";
    a symbolic size keeps its name (``(s72, 128)`` -> "s72, 128")."""
    dims = [_dim(d) for d in shape]
    return dims[0] + "," if len(dims) == 1 else ", ".join(dims)


def input_shapes_of(example_inputs: Sequence[Any]) -> list[str]:
    """Shape strings of the tensor inputs of a traced graph (non-tensors are scalars)."""
    return [format_shape(getattr(x, "shape", ())) for x in example_inputs]


_PATH_FLAG = re.compile(r"^(--?[A-Za-z0-9_.-]+)=(.*)$")


def _is_machine_path(value: str) -> bool:
    value = value.strip("'\"")
    return value.startswith(("/", "~")) or bool(re.match(r"^[A-Za-z]:[\\/]", value))


def sanitize_compiler_flags(flags: Sequence[str] | str) -> str:
    """The flags as one string, with machine-specific paths and secrets removed (memoised:
    a process compiles many graphs with the same flags, and this runs on every ledger
    line)."""
    return _sanitize(flags if isinstance(flags, str) else tuple(str(f) for f in flags))


@functools.lru_cache(maxsize=256)
def _sanitize(flags: str | tuple[str, ...]) -> str:
    """A flag whose value is an absolute path (``--logfile=/tmp/x`` or ``--workdir /tmp/x``)
    is dropped with its value; a bare absolute path argument is dropped. What is left is
    redacted as a command line (`redact_argv`): the flags come from ``NEURON_CC_FLAGS`` and
    reach the manifest, which must hold no secret.
    """
    tokens = flags.split() if isinstance(flags, str) else [str(t) for t in flags]
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        match = _PATH_FLAG.match(token)
        if match and _is_machine_path(match.group(2)):
            i += 1
            continue
        if token.startswith("-") and i + 1 < len(tokens) and _is_machine_path(tokens[i + 1]):
            i += 2
            continue
        if _is_machine_path(token):
            i += 1
            continue
        out.append(token)
        i += 1
    return " ".join(redact_argv(out))


class LedgerWriter:
    """Appends this process's ledger lines; resolves its engine prefix at first use."""

    def __init__(self, manifest_dir: str | Store) -> None:
        self._target = manifest_dir
        self._store: Store | None = manifest_dir if isinstance(manifest_dir, Store) else None
        self._failed = False
        self._lock = threading.Lock()
        # The segment this process writes, resolved at its first write (by then init_device
        # has narrowed NEURON_VISIBLE_DEVICES) and again in a forked child.
        self._current: EventLog | None = None
        # The hot path (see `record`): the segment's descriptor, the thread that may use it
        # and that thread's line buffer; -1 until the first line, and again after a fork.
        self._fd = -1
        self._owner = -1
        self._line = bytearray()
        _WRITERS.add(self)
        # The last flags string seen and its sanitised form (one attribute, so a thread never
        # reads a pair from two calls): a process compiles every graph with the same flags
        # object, so the common case is one identity check.
        self._flags: tuple[object, str] = (None, "")

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(str(self._target))
        return self._store

    def _log(self) -> EventLog:
        """This process's segment, resolved once per process (and again in a forked child).

        The prefix and the run are read now (after init_device narrowed
        NEURON_VISIBLE_DEVICES; a forked child keeps its parent's run). The first write
        discards a stale same-pid file, once per process and segment however many writers
        the process has; later ones append.
        """
        prefix, run, pid = get_server_prefix(), run_id(), os.getpid()
        segment = (self.store.url, prefix, run, pid)
        first = segment not in _TRUNCATED
        _TRUNCATED.add(segment)
        return self.store.log(ledger_stream(prefix, run), writer=str(pid), truncate_first=first)

    def _append(self, entry: LedgerEntry) -> None:
        """The first line of this process (opens the segment), or a line from a thread
        other than the one that owns the hot path."""
        with self._lock:
            log = self._current
            if log is None:
                log = self._current = self._log()
            log.append(entry)
            fault_point("ledger.appended")
            fd = log.descriptor()
            if fd >= 0 and self._owner == -1:
                self._fd, self._owner = fd, _thread()

    def record(
        self,
        key: str,
        *,
        rank: int,
        input_shapes: list[str],
        compiler_flags: Sequence[str] | str,
        global_rank: int | None = None,
        piece: Piece | None = None,
    ) -> bool:
        """Append one ledger line; False (logged once) if it could not be written."""
        try:
            seen, flags = self._flags
            if compiler_flags is not seen:
                flags = sanitize_compiler_flags(compiler_flags)
                if isinstance(compiler_flags, str):  # immutable: identity means equality
                    self._flags = (compiler_flags, flags)
            entry = LedgerEntry(key=key, rank=rank, input_shapes=input_shapes,
                                compiler_flags=flags, global_rank=global_rank, piece=piece)
            if self._owner == _thread():
                # Hot path, one Python frame per traced graph: exactly what EventLog.append
                # does on a descriptor (encode into a reused buffer, one os.write), inline,
                # because the extra frame is ~10% of a line (benchmarks/RESULTS.md).
                line = self._line
                encode_into(entry, line)
                line.append(10)
                _write(self._fd, line)
            else:
                self._append(entry)
            return True
        except Exception as exc:  # noqa: BLE001 - the manifest never breaks a compile
            if not self._failed:
                self._failed = True
                logger.warning(
                    "manifest: cannot write the compile ledger under %s "
                    "(VLLM_NEURON_MANIFEST_DIR): %s; this engine's manifest will be incomplete",
                    self._target,
                    exc,
                )
            return False
