"""One process of a Neuron "engine" on the fake stack: hands several graphs to the runtime
as vLLM's piecewise backend does (a piece name each, every graph before any call), then
calls each. Settings from the environment; prints one JSON line: per graph its key, whether
the runtime returned before the graph compiled (deferred), and what its first call gave
(the NEFF's bytes, or the error). With FAKE_PIECES_EXIT_WHEN_STARTED=<fifo> it calls none:
it exits once the compiler writes to <fifo> (a compile has started)."""

from __future__ import annotations

import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(widths: list[int], bin_dir: str) -> dict[str, object]:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    from fake_neuron import compiler_on_path

    os.environ["PATH"] = compiler_on_path(bin_dir)
    import torch

    from vllm_neuron.assembly import get_runtime
    from vllm_neuron.compile.runtime import DeferredGraph
    from vllm_neuron.compile.toolchains.neuron import NEFF_NAME, NeuronToolchain

    def load(self: NeuronToolchain, entry_dir: str, meta: object) -> object:
        with open(os.path.join(entry_dir, NEFF_NAME), "rb") as f:
            neff = f.read()  # the Neuron runtime is not here: the call answers the NEFF
        return lambda *args: neff.decode()

    NeuronToolchain.load = load  # type: ignore[method-assign]
    runtime = get_runtime()
    assert isinstance(runtime.toolchain, NeuronToolchain), runtime.toolchain
    graphs = []
    for width in widths:
        torch.manual_seed(width)
        model = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.ReLU()).eval()
        fn, traced = runtime.compile(torch.fx.symbolic_trace(model), [torch.randn(4, width)],
                                     piece=f"piece {width}")
        graphs.append((fn, traced.key, isinstance(fn, DeferredGraph)))
    leave_when = os.environ.get("FAKE_PIECES_EXIT_WHEN_STARTED")
    if leave_when:  # a server stopped during its cold start: exits while a compile runs
        with open(leave_when, "rb") as started:  # a FIFO the compiler writes when it starts
            started.read(1)
        return {"graphs": [], "writer": f"{socket.gethostname()}-{os.getpid()}"}
    results = []
    for fn, key, deferred in graphs:
        try:
            results.append({"key": key, "deferred": deferred, "output": fn()})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.append({"key": key, "deferred": deferred,
                            "error": f"{type(exc).__name__}: {exc}"})
    return {"graphs": results, "writer": f"{socket.gethostname()}-{os.getpid()}"}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]), sys.argv[2])), flush=True)
