"""``hlo_metaneff`` and ``write_params`` as the Neuron toolchain calls them."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any


def hlo_metaneff(hlo: Any, input_names: list[str], aliases: Any) -> Any:
    data = ("metaneff " + " ".join(input_names)).encode()
    return SimpleNamespace(SerializeToString=lambda: data)


def write_params(model_dir: str, constants: dict[str, Any]) -> list[str]:
    with open(os.path.join(model_dir, "weights.bin"), "wb") as f:
        f.write(repr(sorted(constants)).encode())
    return ["weights.bin"]
