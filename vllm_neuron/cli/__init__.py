"""The `vllm-neuron` command: a thin shell over the library's functions.

Each feature adds one sub-command module (`cache`, later `manifest`, `profile`); each
module exposes `register(subparsers)` and its handlers return the process exit status.

Exit status: 0 done, 1 a problem found (a corrupt entry, a failed check), 2 bad usage or
something that cannot be used: a malformed setting or URL, a missing store, refused access,
an unreachable endpoint, a missing optional package (every error the storage layer raises on
purpose), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from vllm_neuron.backends import StoreError
from vllm_neuron.envs import fault_settings

from . import cache as cache_cmd
from . import debug as debug_cmd
from . import demo as demo_cmd
from . import manifest as manifest_cmd
from . import profile as profile_cmd
from . import report as report_cmd
from . import snapshot as snapshot_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-neuron", description="Artifacts of vLLM Neuron deployments."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)
    cache_cmd.register(sub)
    debug_cmd.register(sub)
    demo_cmd.register(sub)
    manifest_cmd.register(sub)
    profile_cmd.register(sub)
    report_cmd.register(sub)
    snapshot_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        fault_settings()  # VLLM_NEURON_FAULT (crash tests): a bad name is exit 2
        return int(args.handler(args))
    except (ValueError, RuntimeError, OSError, KeyError, StoreError) as exc:
        print(f"vllm-neuron: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
