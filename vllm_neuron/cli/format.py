"""Plain-text rendering helpers shared by the sub-commands.

`table` and `print_json` are where most command output leaves, so they redact secrets on
the way (`vllm_neuron.envs.secrets`: the values of this process's secret variables, a URL's
credentials, ``--hf-token X``), whatever record or setting a command shows (``debug env``'s
compiler flags, ``cache explain``'s recorded values, an old manifest).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

from vllm_neuron.compile.entry.text import human_age, human_size
from vllm_neuron.envs import redact_config, redact_text

__all__ = ["human_age", "human_size", "print_json", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[redact_text(str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_json(value: Any) -> None:
    def default(obj: Any) -> Any:
        if is_dataclass(obj) and not isinstance(obj, type):
            return asdict(obj)
        raise TypeError(f"cannot encode {type(obj).__name__}")

    # Through JSON first, so dataclasses are plain data; keys name no variable here.
    plain = json.loads(json.dumps(value, default=default))
    json.dump(redact_config(plain, by_key=False), sys.stdout, indent=2)
    sys.stdout.write("\n")
