"""One formatter for sizes and one for ages (`compile/entry/text.py`), used by the CLI, the
report page and the upkeep messages alike: two copies used to disagree (a negative age, an
unknown size)."""

from __future__ import annotations

import re
from pathlib import Path

import vllm_neuron
from vllm_neuron.cli import format as cli_format
from vllm_neuron.compile.entry.text import human_age, human_size
from vllm_neuron.report import page, sections, tier_table

PACKAGE = Path(vllm_neuron.__file__).parent
# What a size or age formatter looks like, wherever it hides and whatever it is called.
FORMATTER = re.compile(r'\(\s*"d"\s*,\s*86400\s*\)|"KiB"')


def test_sizes_read_the_same_everywhere() -> None:
    assert human_size(None) == "-"
    assert human_size(0) == "0 B" and human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB" and human_size(500 << 20) == "500.0 MiB"
    assert human_size(3 << 40) == "3.0 TiB" and human_size(2 << 50) == "2048.0 TiB"


def test_ages_read_the_same_everywhere() -> None:
    assert human_age(-5) == "0s"  # a node whose clock runs a little ahead
    assert (human_age(42), human_age(210), human_age(7200), human_age(9.1 * 86400)) == (
        "42s", "3.5m", "2.0h", "9.1d")


def test_every_caller_uses_the_one_formatter() -> None:
    assert cli_format.human_size is human_size and cli_format.human_age is human_age
    assert page.human_size is human_size and sections.human_size is human_size
    assert tier_table.human_age is human_age and tier_table.human_size is human_size
    copies = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
              if FORMATTER.search(p.read_text())]  # fmt: skip
    assert copies == ["compile/entry/text.py"], copies
