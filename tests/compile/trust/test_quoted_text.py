"""A key id or an entry key read from a tier reaches a verdict, an exception or a log line
only capped and escaped (`entry.text.printable`; issue 39): a writer without a key cannot
forge log lines (a line break), colour a terminal (an escape sequence) or flood a log."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from vllm_neuron.backends import open_store
from vllm_neuron.compile.entry.check import check_entry
from vllm_neuron.compile.entry.record import ENTRY_RECORD, build_record, encode_record
from vllm_neuron.compile.trust.signing import TrustedKeys

HOSTILE = "\x1b[31mforged\nWARNING fake line\r" + "A" * 5000


def _clean(text: str) -> None:
    assert "\n" not in text and "\r" not in text and "\x1b" not in text, text
    assert len(text) < 1000, len(text)


def test_a_key_id_from_a_tier_is_quoted_capped_and_escaped() -> None:
    record = build_record(key="0" * 32, components={}, toolchain="t", target="t",
                          compile_seconds=0.0, files={}, meta={})  # fmt: skip
    for sig in ({"key_id": HOSTILE, "signature": "00"},
                {"key_id": HOSTILE, "signature": "00", "algorithm": HOSTILE}):
        verdict = TrustedKeys({}).judge(record, msgspec.json.encode(sig))
        assert verdict.status in ("untrusted", "bad-signature")
        _clean(verdict.reason)


def test_an_entry_key_from_a_tier_is_quoted_capped_and_escaped(tmp_path: Path) -> None:
    key = "1" * 32
    record = build_record(key=HOSTILE, components={}, toolchain="t", target="t",
                          compile_seconds=0.0, files={}, meta={})  # fmt: skip
    os.makedirs(tmp_path / key)
    (tmp_path / key / ENTRY_RECORD).write_bytes(encode_record(record))
    judged: Any = check_entry(open_store(str(tmp_path)), key)
    assert not judged.ok
    _clean(str(judged.problem))
