"""Failure notes are advice, bounded (entry/failure_notes.py): a note from the future, a note
rewritten for ever, an unsigned note under ``require``, a note's text, a secret in an error.

The reader's monotonic clock is the test's (`Clock`): "one retry period later" is a number
the test adds. Real files; the notes are written as a writer of the tier would.
"""

from __future__ import annotations

import logging
import time as real_time
import uuid
from typing import Any

import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.backends.records import encode
from vllm_neuron.compile.entry import failure_notes
from vllm_neuron.compile.entry.failure_notes import (
    CLOCK_SKEW,
    NOTE_TEXT_LIMIT,
    FailureNote,
    NoteSigner,
    note_message,
    note_payload,
    printable,
    recent_failure,
    write_failure_note,
)
from vllm_neuron.compile.entry.load_failure_notes import note_load_failure
from vllm_neuron.compile.entry.notes import (
    FAILURES,
    LOAD_FAILURES,
    QUARANTINE,
    STOPPED,
    STOPPED_NOTES,
    StoppedNote,
)
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.quarantine import quarantine_entry
from vllm_neuron.compile.trust.signing import (
    TrustedKeys,
    generate_key_pair,
    judge_note,
    load_signer,
    sign_note,
)

RETRY = 300.0
SECRET = "hf_" + "Zq9xSecretTokenValue" * 2


class Clock:
    """`time` for failure_notes.py: the true wall clock, a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.mono = 50_000.0

    def time(self) -> float:
        return real_time.time()

    def monotonic(self) -> float:
        return self.mono


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(failure_notes, "time", fake)
    return fake


@pytest.fixture
def store(tmp_path: Any) -> Any:
    return open_store(str(tmp_path / "tier"))


def key() -> str:
    return uuid.uuid4().hex  # what this process saw is per tier and key: one per test


def note(at: float, **fields: Any) -> bytes:
    return encode(FailureNote(**{"at": at, "error": "ValueError: boom", "pid": 1,
                                 "host": "h", **fields}))  # fmt: skip


def test_a_note_dated_past_the_skew_margin_is_ignored_with_one_warning(store, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")
    k = key()
    store.write(FAILURES.path(k), note(4102444800.0))  # 2100
    assert recent_failure(store, k, since=0.0, retry_after=RETRY) is None
    assert recent_failure(store, k, since=0.0, retry_after=RETRY) is None
    assert sum("ahead of this node's clock" in r.getMessage() for r in caplog.records) == 1
    for at in (float("nan"), float("inf")):
        store.write(FAILURES.path(k), b'{"type":"compile-failure","at":' + (
            b"1e999" if at == float("inf") else b"null") + b',"error":"e","pid":1,"host":"h"}')
        assert recent_failure(store, k, since=0.0, retry_after=RETRY) is None
    within = real_time.time() + CLOCK_SKEW / 2  # a clock a little ahead: still a failure
    store.write(FAILURES.path(k), note(within))
    assert recent_failure(store, k, since=0.0, retry_after=RETRY) is not None


def test_notes_stop_a_compile_one_retry_period_at_most_however_often_rewritten(
    store, clock, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")
    k = key()
    for _ in range(10):  # rewritten before every look, over most of a period
        store.write(FAILURES.path(k), note(real_time.time()))
        assert recent_failure(store, k, since=0.0, retry_after=RETRY) is not None
        clock.mono += RETRY / 10 - 0.01
    clock.mono += 0.2  # one retry period since the first note stopped it
    for _ in range(3):
        store.write(FAILURES.path(k), note(real_time.time()))
        assert recent_failure(store, k, since=0.0, retry_after=RETRY) is None
    assert sum("compiling it here" in r.getMessage() for r in caplog.records) == 1
    assert recent_failure(store, key(), since=0.0, retry_after=RETRY) is None  # no note
    other = key()  # another key's notes are counted apart
    store.write(FAILURES.path(other), note(real_time.time()))
    assert recent_failure(store, other, since=0.0, retry_after=RETRY) is not None


def test_a_signed_note_verifies_only_with_its_key_and_unchanged(store, tmp_path) -> None:
    private, _, _ = generate_key_pair(str(tmp_path / "k"), "builder")
    stranger_private, _, _ = generate_key_pair(str(tmp_path / "s"), "stranger")
    builder = load_signer(private)
    trusted = TrustedKeys({builder.key_id: builder.public_key})

    def verify(n: FailureNote, payload: bytes) -> str | None:
        verdict = judge_note(trusted, n.signer, n.signature, payload)
        return None if verdict.trusted else verdict.reason

    k = key()
    signer = NoteSigner(builder.key_id, lambda payload: sign_note(builder, payload))
    assert write_failure_note(store, k, "ValueError: boom", sign=signer) is None
    written = recent_failure(store, k, since=0.0, verify=verify)
    assert written is not None and written.signer == builder.key_id and written.signature
    forged = {f: getattr(written, f) for f in written.__struct_fields__ if f != "v"}
    for change in ({"error": "ValueError: other"}, {"at": written.at + 1}, {"host": "x"},
                   {"pid": 2}, {"signature": "00" * 64}, {"signer": "", "signature": ""}):
        store.write(FAILURES.path(k), encode(FailureNote(**{**forged, **change})))
        assert recent_failure(store, k, since=0.0, verify=verify) is None, change
    other = key()  # a note moved to another key does not verify there
    store.write(FAILURES.path(other), encode(FailureNote(**forged)))
    assert recent_failure(store, other, since=0.0, verify=verify) is None
    stranger = load_signer(stranger_private)
    store.write(FAILURES.path(k), encode(FailureNote(**{**forged, "signer": stranger.key_id})))
    assert recent_failure(store, k, since=0.0, verify=verify) is None
    assert note_payload(k, written).startswith(b'{"at":')  # canonical: sorted keys


def test_an_old_note_without_signature_fields_reads() -> None:
    old = b'{"type":"compile-failure","at":1.5,"error":"E: x","pid":3,"host":"h"}'
    from vllm_neuron.compile.entry.notes import FAILURE_NOTES

    decoded = FAILURE_NOTES.decode(old)
    assert (decoded.signer, decoded.signature) == ("", "")


def test_a_notes_text_reaches_a_message_capped_and_escaped() -> None:
    evil = FailureNote(at=1.0, error="E: x\nCRITICAL forged log line\x1b[31m\u202e" + "y" * 9000,
                       pid=1, host="h\r\nost")  # fmt: skip
    message = note_message("k" * 32, evil, "s3://b/p")
    assert "\n" not in message and "\r" not in message and "\x1b" not in message
    assert "\u202e" not in message and "\\n" in message and "\\x1b" in message
    assert len(message) < NOTE_TEXT_LIMIT + 400 and "more characters" in message
    assert printable("plain text") == "plain text"


def test_secrets_never_reach_a_note_on_a_shared_tier(store, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    k = key()
    error = f"OSError: 401 for https://huggingface.co with token {SECRET} (HF_TOKEN={SECRET})"
    assert write_failure_note(store, k, error) is None
    note_load_failure(store, k, error)
    quarantine_entry(store, k, f"it does not load: {error}", warn=False)
    written = [store.read(FAILURES.path(k)), store.read(QUARANTINE.path(k))]
    written += [store.read(f) for f in store.list(LOAD_FAILURES.directory)]
    assert len(written) == 3 and all(w is not None and b"401" in w for w in written)
    assert not any(SECRET.encode() in (w or b"") for w in written)


def _stopped_at(local: Any, k: str) -> float | None:
    held = STOPPED_NOTES.read(local, STOPPED.path(k))
    return None if held is None else held.at


@pytest.mark.parametrize("planted", ["stale", "future"])
def test_a_stale_or_future_stopped_note_neither_stops_nor_disables_the_bound(
    tmp_path, clock, planted
) -> None:
    """This node's ``.stopped/<key>.json`` older than two retry periods (a stop long over,
    or planted to disable the bound) or dated past the skew margin (planted to stop the key
    for ever) reads as absent and is written anew: a fresh note stops the compile one retry
    period, counted from now."""
    remote, local = open_store(str(tmp_path / "remote")), open_store(str(tmp_path / "local"))
    k = key()
    now = real_time.time()
    at = now - 3 * RETRY if planted == "stale" else now + 100 * CLOCK_SKEW
    local.write(STOPPED.path(k), encode(StoppedNote(at=at, pid=1)))
    remote.write(FAILURES.path(k), note(now))

    assert recent_failure(remote, k, since=0.0, retry_after=RETRY, stopped_in=local) is not None
    rewritten = _stopped_at(local, k)
    assert rewritten is not None and abs(rewritten - now) < CLOCK_SKEW
    clock.mono += RETRY + 1  # one retry period later: compiled here
    assert recent_failure(remote, k, since=0.0, retry_after=RETRY, stopped_in=local) is None


def test_a_compile_or_a_fetch_forgets_when_notes_stopped_the_key(tmp_path, compile_fn) -> None:
    """Once the key compiled (or was fetched) on this node, its ``.stopped/<key>.json`` is
    gone: a later failure note counts its retry period anew, never from a stop long over."""
    remote = str(tmp_path / "remote")
    k = key()
    for node in ("builder", "fetcher"):
        local = open_store(str(tmp_path / node))
        local.write(STOPPED.path(k), encode(StoppedNote(at=real_time.time() - 10, pid=1)))
    builder = TwoTierCache(str(tmp_path / "builder"), remote=remote)
    assert builder.get_or_compile(k, compile_fn(k)).source == "compiled"
    fetcher = TwoTierCache(str(tmp_path / "fetcher"), remote=remote)
    assert fetcher.get_or_compile(k, compile_fn(k, fail="must not compile")).source == "remote"
    for node in ("builder", "fetcher"):
        assert _stopped_at(open_store(str(tmp_path / node)), k) is None, node
