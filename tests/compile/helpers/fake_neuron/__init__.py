"""A stand-in for the Neuron stack, which exists only on Trainium: ``torch_neuronx``'s
lowering (`torch_neuronx.xla_impl`) and a ``neuronx-cc`` executable (`neuronx_cc.py`, put on
PATH by `compiler_on_path`), enough for the Neuron toolchain's own code - lowering in the
tracing thread, the compiler as a process of its own, the entry's files - to run here. The
NEFF it writes is deterministic bytes, not a program: loading one needs the Neuron runtime,
which `pieces.py` replaces."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def compiler_on_path(bin_dir: str) -> str:
    """``bin_dir`` holding an executable ``neuronx-cc`` that runs the fake compiler
    (`neuronx_cc.py`) with this interpreter, put first on PATH; returns the new PATH."""
    os.makedirs(bin_dir, exist_ok=True)
    exe = os.path.join(bin_dir, "neuronx-cc")
    with open(exe, "w") as f:
        f.write(f"#!{sys.executable}\nimport runpy\n"
                f"runpy.run_path({os.path.join(HERE, 'neuronx_cc.py')!r}, run_name='__main__')\n")
    os.chmod(exe, 0o755)
    return bin_dir + os.pathsep + os.environ.get("PATH", "")


@contextmanager
def installed(monkeypatch: pytest.MonkeyPatch, bin_dir: str) -> Iterator[None]:
    """The fake stack importable and its compiler on PATH (in ``bin_dir``), so the Neuron
    toolchain selects it; all undone after."""
    monkeypatch.syspath_prepend(HERE)
    monkeypatch.setenv("PATH", compiler_on_path(bin_dir))
    try:
        yield
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "torch_neuronx"]:
            del sys.modules[name]
