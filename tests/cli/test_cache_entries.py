"""`cache ls` names what a hit would find wrong; `cache explain` shows the values behind
the differing hashes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cli_world import KEY_A, KEY_B, build_world, run

from vllm_neuron.backends import open_store


def entry_file(local: str, key: str, rel: str) -> str:
    store = open_store(local)
    path = store.local_path(f"{store.published(key)}/{rel}")
    assert path is not None
    return path


def test_ls_names_a_short_file_and_an_unreadable_record(tmp_path: Path, capsys: Any,
                                                       no_remote_env: None) -> None:
    world = build_world(tmp_path)
    with open(entry_file(world.local, KEY_A, "meta.txt"), "ab") as f:
        f.write(b"longer than recorded")
    with open(entry_file(world.local, KEY_B, "entry.json"), "wb") as f:
        f.write(b"{not json")
    code, out, _ = run(capsys, ["cache", "--cache-dir", world.local, "ls"])
    assert code == 0  # a listing reports; `cache verify` is the check that exits 1
    rows = {line.split()[0]: line for line in out.splitlines() if line[:32] in (KEY_A, KEY_B)}
    assert "meta.txt" in rows[KEY_A] and "bytes" in rows[KEY_A]
    assert "unreadable record" in rows[KEY_B]
    assert rows[KEY_B].split()[4] == "-"  # AGE: unknown, not 56 years
    assert "2 entries" in out and "2 with a problem" in out
    code, out, _ = run(capsys, ["cache", "--cache-dir", world.local, "ls", "--json"])
    doc = {e["key"]: e for e in json.loads(out)}
    assert doc[KEY_B]["age_seconds"] is None and doc[KEY_A]["age_seconds"] >= 0
    assert "meta.txt" in doc[KEY_A]["problem"] and "unreadable" in doc[KEY_B]["problem"]


def test_explain_prints_the_recorded_values_beside_the_hashes(tmp_path: Path, capsys: Any,
                                                             no_remote_env: None) -> None:
    world = build_world(tmp_path)
    code, out, _ = run(capsys, ["cache", "--cache-dir", world.local, "explain", KEY_A, KEY_B])
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["COMPONENT", KEY_A[:12], KEY_B[:12]]
    target = lines.index(next(line for line in lines if line.startswith("target")))
    assert lines[target + 1].split() == ["target", "cpu", "trn2"]
    assert not any(line.strip().startswith("versions") for line in lines)  # same hash


def test_explain_of_identical_keys(tmp_path: Path, capsys: Any, no_remote_env: None) -> None:
    world = build_world(tmp_path)
    code, out, _ = run(capsys, ["cache", "--cache-dir", world.local, "explain", KEY_A, KEY_A])
    assert code == 0 and "identical key components" in out
    code, out, _ = run(capsys, ["cache", "--cache-dir", world.local, "explain", KEY_A, KEY_A,
                                "--json"])
    assert json.loads(out) == {"key_a": KEY_A, "key_b": KEY_A, "identical": True,
                               "components": []}
    assert os.path.isdir(world.local)
