"""The command-line tests' world: real tiers the commands run on (a module of its own,
not conftest: every test folder has a conftest.py, so importing one by name is ambiguous).

`build_world(root)` builds, with the compile cache's own code and fake compiles (the
compile tests' `cache_workers`), a local tier holding two entries whose keys differ in
their graph, input and target components, a folder remote holding one of them, and a
manifest naming both.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "compile", "helpers"))

from cache_workers import fake_compile  # noqa: E402  (tests/compile's fake compiles)

from vllm_neuron.cli import main  # noqa: E402
from vllm_neuron.compile.flow.cache import TwoTierCache  # noqa: E402

KEY_A = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa1"
KEY_B = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb2"
COMPONENTS_A = {"graph": "g" * 32, "inputs": "i" * 32, "versions": "v" * 32, "target": "t" * 32}
COMPONENTS_B = {"graph": "h" * 32, "inputs": "j" * 32, "versions": "v" * 32, "target": "u" * 32}


@dataclass
class World:
    root: Path
    local: str
    remote: str
    manifest: str

    def cli(self, *argv: str) -> list[str]:
        """`argv` with ``{local}``, ``{remote}``, ``{manifest}`` and ``{root}`` filled in."""
        return [a.format(local=self.local, remote=self.remote, manifest=self.manifest,
                         root=str(self.root)) for a in argv]


def build_world(root: Path) -> World:
    local, remote = str(root / "cache"), str(root / "remote")
    TwoTierCache(local, target="cpu").get_or_compile(
        KEY_A, lambda out: fake_compile(out, key=KEY_A), components=COMPONENTS_A)
    TwoTierCache(local, target="trn2").get_or_compile(
        KEY_B, lambda out: fake_compile(out, key=KEY_B), components=COMPONENTS_B)
    TwoTierCache(str(root / "builder"), remote=remote).get_or_compile(
        KEY_A, lambda out: fake_compile(out, key=KEY_A), components=COMPONENTS_A)
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({
        "manifest_version": "1",
        "config": {"topology": {"world_size": 1}},
        "graphs": [{"graph_hash": k, "ranks": [0]} for k in (KEY_A, KEY_B)],
    }))
    return World(root, local, remote, str(manifest))


def run(capsys: Any, argv: list[str]) -> tuple[int, str, str]:
    """The command run in this process: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: bad usage
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
