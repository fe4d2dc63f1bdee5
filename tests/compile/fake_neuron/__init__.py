"""A stand-in for the Neuron stack, which exists only on Trainium: ``torch_neuronx``'s
lowering (`torch_neuronx.xla_impl`) and a ``neuronx-cc`` executable (``bin/``), enough for
the Neuron toolchain's own code - lowering in the tracing thread, the compiler as a process
of its own, the entry's files - to run here. The NEFF it writes is deterministic bytes, not a
program: loading one needs the Neuron runtime, which tests replace (`install`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(HERE, "bin")


@contextmanager
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fake stack importable and on PATH (so the Neuron toolchain selects it), and the
    Neuron runtime's load replaced by one that returns the NEFF's bytes; all undone after."""
    from vllm_neuron.compile.toolchains.neuron import NEFF_NAME, NeuronToolchain

    def load(self: NeuronToolchain, entry_dir: str, meta: object) -> object:
        with open(os.path.join(entry_dir, NEFF_NAME), "rb") as f:
            neff = f.read()
        return lambda *args: neff

    monkeypatch.syspath_prepend(HERE)
    monkeypatch.setenv("PATH", BIN + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setattr(NeuronToolchain, "load", load)
    try:
        yield
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "torch_neuronx"]:
            del sys.modules[name]
