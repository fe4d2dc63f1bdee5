"""What every `vllm-neuron` command shares: group options on each leaf, ``--quiet``, and a
standard output that survives a closed pipe.

**Group options on every leaf.** ``-v`` (the root's) and ``cache --cache-dir`` are
accepted before the sub-command, as they always were, and after it, on every leaf below
the group that declares them (``vllm-neuron cache ls --cache-dir X -v``), as ``hf cache``
and ``pip cache`` take their options. `share_group_options` copies them once, after the
tree is built, so a leaf added later gets them without remembering to. A leaf's copy has
no default (``SUPPRESS``): given after the leaf it wins, not given it leaves the group's
value alone.

**--quiet** (`quiet_option`, on the commands cron runs: ``cache gc``, ``prune``, ``warm``,
``promote``, ``bake``, ``verify``, ``sign``): nothing on stdout, no progress bars and no
warnings; errors (stderr) and the exit status only.

**A closed pipe** (``vllm-neuron cache stats | head -1``): `PipeTolerantStdout` discards
what is written after the reader went away, so the command finishes its work and exits
with its own status, without a "Broken pipe" message or traceback.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any, TextIO

__all__ = ["JSON_HELP", "PipeTolerantStdout", "leaf_parsers", "quiet_option", "share_group_options"]

_NOT_SHARED = frozenset({"help", "version"})

JSON_HELP = "one JSON document on stdout instead of the table (nothing else there)"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-commands of ``parser`` by name (empty for a leaf)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.setdefault(name, sub)
    return found


def leaf_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command of the tree under ``parser`` that has no sub-command, with its path
    (``("cache", "ls")``); ``parser`` itself when it is a leaf."""
    subs = _subparsers(parser)
    if not subs:
        return [(path, parser)]
    return [leaf for name, sub in subs.items() for leaf in leaf_parsers(sub, (*path, name))]


def _group_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in _NOT_SHARED
            and a.help != argparse.SUPPRESS]  # fmt: skip


def _copy_option(leaf: argparse.ArgumentParser, action: argparse.Action) -> None:
    """``action`` again on ``leaf``, defaulting to nothing so the group's value stays."""
    if any(s in leaf._option_string_actions for s in action.option_strings):
        return  # the leaf has its own option of that name
    kwargs: dict[str, Any] = {"dest": action.dest, "default": argparse.SUPPRESS,
                              "help": action.help}  # fmt: skip
    if isinstance(action, argparse._StoreTrueAction):
        kwargs["action"] = "store_true"
    elif type(action) is argparse._StoreAction and action.nargs is None:
        kwargs.update(metavar=action.metavar, type=action.type, choices=action.choices)
    else:  # pragma: no cover - a group option of another kind needs its copy written here
        raise TypeError(f"cannot share {action.option_strings} ({type(action).__name__})")
    leaf.add_argument(*action.option_strings, **kwargs)


def share_group_options(parser: argparse.ArgumentParser,
                        inherited: tuple[argparse.Action, ...] = ()) -> None:  # fmt: skip
    """Add every option of each command group (the root included) to each leaf below it."""
    subs = _subparsers(parser)
    if not subs:
        for action in inherited:
            _copy_option(parser, action)
        return
    passed = (*inherited, *_group_options(parser))
    for sub in subs.values():
        share_group_options(sub, passed)


def quiet_option(parser: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` for a command cron runs: only errors and the exit status."""
    parser.add_argument(
        "-q", "--quiet", action="store_true",
        help="print nothing but errors (stderr); the exit status says how it went (for cron)",
    )  # fmt: skip


class PipeTolerantStdout(io.TextIOBase):
    """Standard output that stops writing, silently, once its reader has gone away.

    Why not SIGPIPE's default (die at once): the command would stop half-way through its
    work (a ``prune`` printing as it deletes) and a socket of a store client would kill the
    process too. Why not catching `BrokenPipeError` around the command: the same half-way
    stop, and Python's flush at exit would print "Exception ignored ... Broken pipe". So
    the write fails here only: the descriptor is pointed at /dev/null (what the exit flush
    then writes to) and everything after is discarded.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self.reader_gone = False

    def _gone(self) -> None:
        self.reader_gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass  # not a real descriptor (a test's capture): nothing will flush it later

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return not self.reader_gone and self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", "utf-8"))
