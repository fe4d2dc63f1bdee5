"""The `vllm-neuron` command: a thin shell over the library's functions.

Each feature adds one sub-command module (`cache`, later `manifest`, `profile`); each
module exposes `register(subparsers)` and its handlers return the process exit status.

Exit status (`EXIT_OK`, `EXIT_PROBLEM`, `EXIT_USAGE`; shown in ``--help``'s epilog and
docs/cli.md): 0 done, 1 a problem found (a corrupt entry, a failed check), 2 bad usage or
something that cannot be used: a malformed setting or URL, a missing store, refused access,
an unreachable endpoint, a missing optional package (every error the storage layer raises on
purpose), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from vllm_neuron.backends import StoreError
from vllm_neuron.envs import (
    RedactingFilter,
    fault_settings,
    install_log_redaction,
    redact_text,
    validate_groups,
)
from vllm_neuron.version import __version__

from . import cache as cache_cmd
from . import debug as debug_cmd
from . import demo as demo_cmd
from . import manifest as manifest_cmd
from . import profile as profile_cmd
from . import report as report_cmd
from . import snapshot as snapshot_cmd
from .options import PipeTolerantStdout, share_group_options

EXIT_OK = 0
"""Done: nothing wrong was found."""
EXIT_PROBLEM = 1
"""The command ran and found a problem: a corrupt entry, a failed check, a graph missing."""
EXIT_USAGE = 2
"""Bad usage, or something that cannot be used (a malformed URL, an unreachable tier)."""

SETTINGS_READ: dict[str, tuple[str, ...]] = {
    "cache": ("compile_cache", "trust"),
    "demo": ("compile_cache", "trust"),
    "manifest": ("compile_cache", "manifest"),
    "profile": ("profiling",),
    "report": ("compile_cache", "trust"),
    "snapshot": ("compile_cache", "snapshot"),
}
"""The settings groups (`vllm_neuron.envs.listing.GROUPS`) each command reads: validated
before it runs, so ``VLLM_NEURON_CACHE_TRUST=requre cache stats`` is exit 2 naming the
variable and the value, never a silent default. ``debug`` validates nothing: ``debug env``
shows every setting's error, and ``debug faults`` reads only VLLM_NEURON_FAULT (checked
for every command)."""

EPILOG = """output: every command that reports takes --json: one JSON document on stdout, nothing
else there (progress bars go to stderr, only on a terminal, and never with --json).

exit status (every command):
  0  done, nothing wrong found
  1  a problem found: a corrupt entry, a failed check, a graph that would be compiled,
     something that could not be removed or promoted
  2  bad usage or something that cannot be used: a malformed setting or URL, a missing
     store, refused access, an unreachable endpoint, a missing optional package
     (the reason on stderr)

options: -v and a group's options (cache --cache-dir) work before the sub-command or after
it (the later one wins); -q/--quiet on the commands cron runs prints errors only. Output
piped into a reader that stops early (| head) ends quietly.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-neuron", description="Artifacts of vLLM Neuron deployments.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)
    cache_cmd.register(sub)
    debug_cmd.register(sub)
    demo_cmd.register(sub)
    manifest_cmd.register(sub)
    profile_cmd.register(sub)
    report_cmd.register(sub)
    snapshot_cmd.register(sub)
    share_group_options(parser)  # -v, cache --cache-dir: on every leaf below them too
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    stdout = sys.stdout
    sys.stdout = PipeTolerantStdout(stdout)  # | head: the rest is discarded, quietly
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        quiet = bool(getattr(args, "quiet", False))
        if quiet:  # -q: errors (stderr) and the exit status only
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - closed below
        return _run(args, quiet)
    finally:
        try:
            sys.stdout.flush()
        finally:
            if not isinstance(sys.stdout, PipeTolerantStdout) and sys.stdout is not stdout:
                sys.stdout.close()
            sys.stdout = stdout


def _run(args: argparse.Namespace, quiet: bool) -> int:
    install_log_redaction()  # on our loggers: whichever handler prints a line of ours
    handler = logging.StreamHandler()  # used only if the root logger has no handler yet
    handler.addFilter(RedactingFilter())  # no secret in a log line (envs/secrets.py)
    logging.basicConfig(
        level=logging.ERROR if quiet else logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        handlers=[handler],
    )
    try:
        fault_settings()  # VLLM_NEURON_FAULT (crash tests): a bad name is exit 2
        validate_groups(SETTINGS_READ.get(args.command, ()))  # a typo: exit 2, named
        return int(args.handler(args))
    except (ValueError, RuntimeError, OSError, KeyError, StoreError) as exc:
        print(f"vllm-neuron: error: {redact_text(str(exc))}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
