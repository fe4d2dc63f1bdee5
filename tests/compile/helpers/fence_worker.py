"""A fresh process compiling one small graph with the host toolchain while torch lacks some
of the private names behind the fence, for test_torch_internals.py:
``python fence_worker.py SCALE [QUALNAME|QUALNAME=signature...]`` prints one JSON line.

``QUALNAME``: the fence looks for a name torch does not have (as after a rename in a later
torch: torch's own callers follow the rename, ours would not). ``QUALNAME=signature``:
torch's function is replaced by one taking a further parameter (its signature changed) that
still does torch's work."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import sys
import tempfile
from typing import Any

import torch
import torch.fx

from vllm_neuron.compile.toolchains import torch_internals
from vllm_neuron.compile.toolchains.host import HostToolchain

TWO_PARTS = "compiled in two parts"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


class Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.silu(self.linear(x)) * self.scale + r
        return h, torch.nn.functional.rms_norm(h, (8,))


def _hide(qualname: str) -> None:
    entry = torch_internals.FENCED[qualname]
    torch_internals.FENCED[qualname] = dataclasses.replace(entry, name=entry.name + "_renamed")


def _change_signature(qualname: str) -> None:
    entry = torch_internals.FENCED[qualname]
    module = importlib.import_module(entry.module)
    original = getattr(module, entry.name)

    @functools.wraps(original)
    def changed(*args: Any, later: object = None) -> Any:
        return original(*args)

    del changed.__wrapped__  # its own signature, not torch's
    setattr(module, entry.name, changed)


def main() -> None:
    scale = float(sys.argv[1])
    for arg in sys.argv[2:]:
        name, _, how = arg.partition("=")
        (_change_signature if how == "signature" else _hide)(name)
    records = Records()
    logging.getLogger("vllm_neuron").addHandler(records)
    logging.getLogger("vllm_neuron").setLevel(logging.DEBUG)
    torch.manual_seed(0)
    module = Scaled(scale)
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    toolchain = HostToolchain()
    with tempfile.TemporaryDirectory() as out:
        artifact = toolchain.compile(torch.fx.symbolic_trace(module), inputs, out)
        outputs = tuple(toolchain.load(out, artifact)(*inputs))
    expected = module(*inputs)
    versions = toolchain.versions()  # before the warnings are read: it reads the key's names
    print(json.dumps({
        "correct": all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                       for a, b in zip(outputs, expected, strict=True)),
        "split": any(TWO_PARTS in m for _, m in records.messages),
        "warnings": [m for level, m in records.messages if level >= logging.WARNING],
        "versions": versions,
        "cflags": list(toolchain.host_target().cflags),
    }))


if __name__ == "__main__":
    main()
