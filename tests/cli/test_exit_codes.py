"""The exit status every command keeps (0 done, 1 a problem found, 2 bad usage or
unreachable), per command family, and ``--version``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_world import KEY_A, KEY_B, build_world, run

from vllm_neuron.backends import open_store
from vllm_neuron.cli import build_parser
from vllm_neuron.version import __version__


def test_version_is_the_package_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"vllm-neuron {__version__}"


def test_help_documents_the_exit_status() -> None:
    text = build_parser().format_help()
    for line in ("0  done", "1  a problem found", "2  bad usage"):
        assert line in text


def corrupt(store_dir: str, key: str) -> None:
    store = open_store(store_dir)
    prefix = store.published(key)
    assert prefix is not None
    path = store.local_path(f"{prefix}/meta.txt")
    assert path is not None
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


# (what, argv with {local} {remote} {manifest} {root} filled, exit status)
PROBLEMS: list[tuple[str, list[str], int]] = [
    ("cache verify: a corrupt entry", ["cache", "--cache-dir", "{local}", "verify", "--keep"], 1),
    ("cache warm: a graph the remote lacks", ["cache", "--cache-dir", "{root}/node", "warm",
                                              "{manifest}", "--remote", "{remote}"], 1),
    ("cache promote: a key the tier lacks", ["cache", "--cache-dir", "{local}", "promote",
                                             "--to", "{remote}", "--key", "f" * 32], 1),
    ("manifest check: no artifacts", ["manifest", "check", "{manifest}", "--cache-dir",
                                      "{local}"], 1),
    ("profile validate: not a run", ["profile", "validate", "{root}"], 1),
]

USAGE: list[tuple[str, list[str]]] = [
    ("cache: unknown option", ["cache", "ls", "--no-such-option"]),
    ("cache: a malformed URL", ["cache", "ls", "s3:/bucket"]),
    ("cache: no such local cache", ["cache", "--cache-dir", "{root}/none", "ls", "--json"]),
    ("cache: a bad duration", ["cache", "--cache-dir", "{local}", "prune", "--older-than",
                               "soon", "--json"]),
    ("cache explain: a key the tier lacks", ["cache", "--cache-dir", "{local}", "explain",
                                             KEY_A, "f" * 32, "--json"]),
    ("cache promote: no destination", ["cache", "--cache-dir", "{local}", "promote", "--all",
                                       "--json"]),
    ("manifest: a missing manifest", ["manifest", "check", "{root}/none.json", "--json"]),
    ("manifest: an unreachable remote", ["manifest", "check", "{manifest}", "--remote",
                                         "s3:/bucket", "--json"]),
    ("profile: no such run", ["profile", "show", "{root}/none", "--json"]),
    ("snapshot: no bundle", ["snapshot", "show", "{root}/none", "--json"]),
    ("debug: unknown sub-command", ["debug", "nothing"]),
]


@pytest.mark.parametrize(("name", "argv", "status"), PROBLEMS, ids=[p[0] for p in PROBLEMS])
def test_a_problem_found_is_exit_1(name: str, argv: list[str], status: int, tmp_path: Path,
                                   capsys: Any, no_remote_env: None) -> None:
    world = build_world(tmp_path)
    if "verify" in argv:
        corrupt(world.local, KEY_B)
    code, out, err = run(capsys, world.cli(*argv))
    assert code == status, (out, err)
    json_code, doc, _ = run(capsys, world.cli(*argv, "--json"))
    assert json_code == status and json.loads(doc) is not None


@pytest.mark.parametrize(("name", "argv"), USAGE, ids=[u[0] for u in USAGE])
def test_bad_usage_or_unreachable_is_exit_2(name: str, argv: list[str], tmp_path: Path,
                                            capsys: Any, no_remote_env: None) -> None:
    world = build_world(tmp_path)
    code, out, err = run(capsys, world.cli(*argv))
    assert code == 2, (out, err)
    assert out == ""  # the reason goes to stderr; stdout stays empty (even with --json)
    assert err.strip()
