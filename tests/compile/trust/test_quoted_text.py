"""A key id or an entry key read from a tier reaches a verdict, an exception or a log line
only capped and escaped (`entry.text.printable`; issue 39): a writer without a key cannot
forge log lines (a line break), colour a terminal (an escape sequence) or flood a log."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vllm_neuron.backends import FileDigest, open_store
from vllm_neuron.backends.records import encode
from vllm_neuron.backends.testing_ops import publish
from vllm_neuron.compile.entry.check import check_entry
from vllm_neuron.compile.entry.record import ENTRY_RECORD, build_record, encode_record
from vllm_neuron.compile.tiers.promote import _remote_problem
from vllm_neuron.compile.tiers.unpacked import (
    UNPACKED_RECORD,
    UnpackedRecord,
    _sound,
    _Unsound,
    copy_name,
)
from vllm_neuron.compile.trust.policy import trust_policy
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


def test_a_remote_entry_naming_another_key_is_quoted_escaped(tmp_path: Path) -> None:
    """`promote_entry`'s judgement of the remote's entry (a log line, and the quarantine
    note it leaves on the remote) quotes the key its record names only escaped."""
    key = "2" * 32
    remote = open_store(str(tmp_path / "remote"))
    record = build_record(key=HOSTILE, components={}, toolchain="t", target="t",
                          compile_seconds=0.0, files={}, meta={})  # fmt: skip
    publish(remote, key, {ENTRY_RECORD: encode_record(record)})
    problem = _remote_problem(remote, key, remote.publication(key), trust_policy())
    assert problem is not None and "record names key" in problem
    _clean(problem)


def test_a_baked_copy_naming_another_package_is_quoted_escaped(tmp_path: Path) -> None:
    """An unpacked copy's record read from a baked tier names its key and package in the
    reason it is unsound only escaped."""
    store = open_store(str(tmp_path / "baked"))
    source = FileDigest(size=1, sha256="0" * 64)
    name = copy_name("3" * 32, source)
    publish(store, name, {UNPACKED_RECORD: encode(UnpackedRecord(
        key=HOSTILE, package=HOSTILE, source=source, files={}, at=0.0))})
    with pytest.raises(_Unsound) as raised:
        _sound(store, name, "3" * 32, "pkg.zip", source)
    assert "another package" in str(raised.value)
    _clean(str(raised.value))
