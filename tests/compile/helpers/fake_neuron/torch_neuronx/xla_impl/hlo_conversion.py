"""``xla_trace`` as the Neuron toolchain calls it: an HLO module for the graph. The fake's
"HLO" is the graph's code and its input and output shapes (outputs from running it on the
example inputs), with the protobuf attributes the toolchain reads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class FakeHlo:
    def __init__(self, text: str, result_shapes: list[tuple[int, ...]]) -> None:
        self.text = text
        self.entry_computation_id = 1
        shapes = [SimpleNamespace(tuple_shapes=[], dimensions=list(s)) for s in result_shapes]
        result = SimpleNamespace(tuple_shapes=shapes, dimensions=[])
        self.computations = [SimpleNamespace(id=1, program_shape=SimpleNamespace(result=result))]

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        return self.text.encode()


def xla_trace(gm: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    import torch
    import torch.utils._pytree as pytree

    with torch.no_grad():
        outputs = pytree.tree_leaves(gm(*inputs))
    shapes = [tuple(o.shape) for o in outputs]
    ins = ",".join("x".join(map(str, t.shape)) for t in inputs)
    hlo = FakeHlo(f"inputs {ins}\noutputs {shapes}\n{gm.code}", shapes)
    names = [f"input{i}" for i in range(len(inputs))]
    return hlo, names, {}, None, None, {}
