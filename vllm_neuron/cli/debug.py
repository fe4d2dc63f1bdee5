"""`vllm-neuron debug faults`: the named fault points a crash test can kill a process at.

``VLLM_NEURON_FAULT=<point>`` makes a process that reaches the point kill itself with
SIGKILL (docs/faults.md); this lists every point, where it is and what a crash there
leaves behind, as a table or (``--json``) a list of objects.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_neuron.backends.faults import POINTS
from vllm_neuron.envs import fault_settings

from .format import print_json, table


def register(sub: Any) -> None:
    parser = sub.add_parser("debug", help="tools for testing this package itself")
    cmds = parser.add_subparsers(dest="debug_command", required=True)
    faults = cmds.add_parser(
        "faults", help="list the fault points VLLM_NEURON_FAULT can name (crash tests)"
    )
    faults.add_argument("--json", action="store_true")
    faults.set_defaults(handler=cmd_faults)


def cmd_faults(args: argparse.Namespace) -> int:
    armed = fault_settings().point
    if args.json:
        print_json([{"name": p.name, "where": p.where, "description": p.description,
                     "armed": p.name == armed} for p in POINTS.values()])  # fmt: skip
        return 0
    print(table(["POINT", "WHERE", "WHEN IT FIRES"],
                [(p.name, p.where, p.description) for p in POINTS.values()]))  # fmt: skip
    return 0
