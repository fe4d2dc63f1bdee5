"""Folders of a shared tier that a node lists to clean up after a key - a key's
load-failure notes (``.load-failures/<key>/``, on every promotion) and the unpacked copies
(``.unpacked/``, on every quarantine of a folder store) - are listed bounded: one a writer
without a key filled with names is left as it is, with one warning (issue 39)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.compile.entry import load_failure_notes
from vllm_neuron.compile.tiers import unpacked

KEY = "b057b057b057b057b057b057b057b0aa"


def _spy(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    asked: list[int | None] = []
    real = store.list_dir

    def spy(prefix: str = "", *, max_names: int | None = None) -> list[str]:
        asked.append(max_names)
        return real(prefix, max_names=max_names)

    monkeypatch.setattr(store, "list_dir", spy)
    return asked


@pytest.mark.parametrize("names", [3, 4])
def test_a_keys_load_failure_notes_are_forgotten_only_when_the_folder_is_bounded(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any,
        names: int) -> None:  # fmt: skip
    store = open_store(str(tmp_path / "remote"))
    for i in range(names):
        store.write(f".load-failures/{KEY}/host{i}.json", b"{}")
    monkeypatch.setattr(load_failure_notes, "NOTES_READ_MAX", 3)
    asked = _spy(store, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.compile"):
        load_failure_notes.forget_load_failures(store, KEY)
    assert asked == [3]
    left = store.list_dir(f".load-failures/{KEY}")
    warned = [r for r in caplog.records if "not forgetting" in r.getMessage()]
    if names > 3:  # over-full: left as it is, said once
        assert len(left) == names and len(warned) == 1
    else:
        assert left == [] and warned == []


def test_an_over_full_unpacked_folder_is_never_listed_whole(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:  # fmt: skip
    store = open_store(str(tmp_path / "remote"))
    for i in range(4):
        store.write(f".unpacked/{KEY}-{i:08x}/x", b"x")
    monkeypatch.setattr(unpacked, "UNPACKED_LIST_MAX", 3)
    asked = _spy(store, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.compile"):
        unpacked.drop_unpacked(store, KEY)
    assert asked == [3]
    assert [r for r in caplog.records if "not withdrawing" in r.getMessage()]
