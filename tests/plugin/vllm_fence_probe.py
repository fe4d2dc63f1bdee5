"""Run in the vLLM environment's interpreter (test_vllm_internals.py): the canary and the
forced-missing runs of every fenced vLLM name, in one process.

Prints one ``FENCE <json>`` line: ``canary`` (each name's problem at this vLLM, None when it
is as fenced) and, per name (``missing``), what the plugin does with that name removed from
its module (``delattr``, as after a rename): the platform plugin's answer in host mode, the
compile backend of the host platform, which worker class vLLM would build, whether the
rank-independent embedding installs, the settings registered with vLLM, the ranks read, and
how many warnings named it. The plugin's modules are imported anew for each run.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from typing import Any

os.environ["VLLM_NEURON_HOST_MODE"] = "1"

import vllm  # noqa: E402 - where vLLM's source is (the canary's scan)
import vllm.config  # noqa: E402,F401 - vLLM loaded as in a server, before the plugin
import vllm.distributed.parallel_state  # noqa: E402,F401
import vllm.envs  # noqa: E402
import vllm.v1.worker.cpu_worker  # noqa: E402,F401

from vllm_neuron import vllm_internals  # noqa: E402

_VLLMS_OWN = set(vllm.envs.environment_variables)


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fresh_plugin() -> None:
    for name in [m for m in sys.modules if m.startswith("vllm_neuron.plugin")]:
        del sys.modules[name]
    vllm_internals._forget()


def _outcome() -> dict[str, Any]:
    _fresh_plugin()
    plugin = importlib.import_module("vllm_neuron.plugin")
    plugin._start_cpu_probe_ahead = lambda: None  # type: ignore[attr-defined] # no probe
    out: dict[str, Any] = {"platform": plugin.platform_plugin()}
    if out["platform"] is not None:
        platform = importlib.import_module("vllm_neuron.plugin.platform")
        out["backend"] = platform.NeuronHostPlatform.get_compile_backend()
        if out["backend"].startswith("vllm_neuron"):
            importlib.import_module("vllm_neuron.plugin.compiler")  # what vLLM then loads
    worker = importlib.import_module("vllm_neuron.plugin.worker").NeuronHostWorker
    out["worker"] = None if worker is None else f"{worker.__module__}.{worker.__qualname__}"
    try:
        embedding = importlib.import_module("vllm_neuron.plugin.vocab_embedding")
        out["embedding"] = embedding._unlike_the_known_layer() is None
    except ImportError:
        out["embedding"] = False
    vllm_env = importlib.import_module("vllm_neuron.plugin.vllm_env")
    table = sys.modules["vllm.envs"].__dict__.get("environment_variables", {})
    for name in set(table) - _VLLMS_OWN:
        del table[name]  # as in a new process: nothing registered yet
    out["registered"] = len(vllm_env.register_settings_with_vllm())
    from vllm_neuron.identity import detect_ranks, tensor_parallel_size

    out["ranks"] = [detect_ranks().tp_rank, tensor_parallel_size()]
    model_info = importlib.import_module("vllm_neuron.plugin.model_info")
    out["model_info"] = [model_info.local_model_info_dir() is not None,
                         (model_info.problem("a-B.json", b"{}") or "").startswith("this vLLM")]
    inspection = importlib.import_module("vllm_neuron.plugin.model_inspection")
    out["inspects_in_process"] = inspection.inspect_in_process()
    registry = sys.modules.get("vllm.model_executor.models.registry")
    runner = getattr(registry, "_run_in_subprocess", None)
    if hasattr(runner, "subprocess_runner"):  # vLLM's own back, for the next run
        registry._run_in_subprocess = runner.subprocess_runner  # type: ignore[union-attr]
    return out


def _callers(name: str) -> list[str]:
    """Where vLLM's source reads `name` (a bare name or an attribute), as
    ``<file under vllm>:<innermost enclosing function, or <module>>``: the canary's scan that
    what the plugin replaces has no reader beside the one it was written for."""
    import ast

    class Reads(ast.NodeVisitor):
        def __init__(self) -> None:
            self.scopes = ["<module>"]
            self.where: set[str] = set()

        def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
            self.scopes.append(node.name)
            self.generic_visit(node)
            self.scopes.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Name(self, node: ast.Name) -> None:
            if node.id == name:
                self.where.add(self.scopes[-1])

        def visit_Attribute(self, node: ast.Attribute) -> None:
            if node.attr == name:
                self.where.add(self.scopes[-1])
            self.generic_visit(node)

    root = os.path.dirname(vllm.__file__)
    found = []
    for folder, _, files in os.walk(root):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if name not in text:
                continue
            reads = Reads()
            reads.visit(ast.parse(text))
            found += [f"{os.path.relpath(path, root)}:{scope}" for scope in reads.where]
    return sorted(found)


def main() -> None:
    handler = _Count()
    logging.getLogger("vllm_neuron").addHandler(handler)
    report: dict[str, Any] = {
        "canary": {q: vllm_internals.problem(q) for q in vllm_internals.FENCED},
        "feeds_key": [q for q, e in vllm_internals.FENCED.items() if e.feeds_key],
        "callers": {"_run_in_subprocess": _callers("_run_in_subprocess")},
        "baseline": _outcome(),
        "missing": {},
    }
    report["baseline_warnings"] = len(handler.messages)
    for qualname, entry in vllm_internals.FENCED.items():
        module = importlib.import_module(entry.module)
        saved = getattr(module, entry.name)
        delattr(module, entry.name)
        handler.messages.clear()
        try:
            outcome = _outcome()
        except Exception as exc:  # noqa: BLE001 - reported: the test names it
            outcome = {"raised": f"{type(exc).__name__}: {exc}"}
        finally:
            setattr(module, entry.name, saved)
        outcome["warned"] = sum(qualname in m for m in handler.messages)
        report["missing"][qualname] = outcome
    print("FENCE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
