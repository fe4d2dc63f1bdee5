"""What every `vllm-neuron` command shares (`cli/options.py`): the group options on every
leaf (the leaf's value wins), ``--quiet`` for cron, help on every argument, and a closed
pipe that ends quietly."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_world import KEY_A, World, build_world, run

from vllm_neuron.cli import build_parser
from vllm_neuron.cli.options import leaf_parsers

CRON_COMMANDS = [("cache", "gc"), ("cache", "prune"), ("cache", "warm"), ("cache", "promote")]


@pytest.fixture
def world(tmp_path: Path, no_remote_env: None) -> World:
    return build_world(tmp_path)


def test_every_leaf_takes_the_options_of_the_groups_above_it() -> None:
    leaves = leaf_parsers(build_parser())
    assert len(leaves) > 20
    for path, leaf in leaves:
        assert "-v" in leaf._option_string_actions, path
        if path[0] == "cache":
            assert "--cache-dir" in leaf._option_string_actions, path


def test_the_leafs_value_wins_and_the_groups_stays_when_the_leaf_gives_none() -> None:
    parse = build_parser().parse_args
    assert parse(["cache", "--cache-dir", "A", "ls", "--cache-dir", "B"]).cache_dir == "B"
    assert parse(["cache", "--cache-dir", "A", "ls"]).cache_dir == "A"
    assert parse(["cache", "ls"]).cache_dir is None
    assert parse(["cache", "stats", "-v"]).verbose and parse(["-v", "cache", "stats"]).verbose
    assert not parse(["cache", "stats"]).verbose


def test_cache_dir_after_the_leaf_is_the_tier_read(capsys: pytest.CaptureFixture[str],
                                                    world: World, tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing-here")
    code, out, err = run(capsys, ["cache", "ls", "--cache-dir", world.local])
    assert code == 0 and KEY_A in out, err
    code, out, err = run(capsys, ["cache", "--cache-dir", missing, "ls", "--cache-dir",
                                  world.local, "-v"])  # fmt: skip
    assert code == 0 and KEY_A in out, err
    code, _, err = run(capsys, ["cache", "--cache-dir", world.local, "ls", "--cache-dir",
                                missing])  # fmt: skip
    assert code == 2 and missing in err


def test_every_argument_of_every_command_says_what_it_is_for() -> None:
    """Walks the real tree: an argument added without help fails here (a hidden internal
    flag says so with ``help=argparse.SUPPRESS``)."""
    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    missing += walk(sub, (*path, name))
                helps = {a.dest: a.help for a in action._choices_actions}
                missing += [f"{' '.join(path)} {n}" for n in action.choices
                            if not helps.get(n)]  # fmt: skip
            elif not action.help:
                name = "/".join(action.option_strings) or action.dest
                missing.append(f"{' '.join(path)} {name}")
        return missing

    assert walk(build_parser(), ("vllm-neuron",)) == []


@pytest.mark.parametrize("command", CRON_COMMANDS, ids=" ".join)
def test_cron_commands_take_quiet(command: tuple[str, ...]) -> None:
    (leaf,) = [p for path, p in leaf_parsers(build_parser()) if path == command]
    assert "--quiet" in leaf._option_string_actions and "-q" in leaf._option_string_actions


def test_quiet_prints_only_errors(capsys: pytest.CaptureFixture[str], world: World) -> None:
    code, out, _ = run(capsys, ["cache", "prune", "--cache-dir", world.local,
                                "--max-size", "1"])  # fmt: skip
    assert code == 0 and "delete" in out  # without -q: a line per entry and a summary
    build_world(world.root / "again")
    again = str(world.root / "again" / "cache")
    code, out, err = run(capsys, ["cache", "prune", "--cache-dir", again, "--max-size", "1",
                                  "-q"])  # fmt: skip
    assert (code, out, err) == (0, "", "")
    code, out, err = run(capsys, ["cache", "gc", "--cache-dir", again, "--quiet"])
    assert (code, out) == (0, "")
    code, out, err = run(capsys, ["cache", "promote", "--cache-dir", again, "--all", "-q",
                                  "--to", "s3//bucket/x"])  # fmt: skip
    assert code == 2 and out == "" and "s3://bucket/x" in err  # errors still said


def _with_closed_pipe(*argv: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """The command with its stdout a pipe whose reader is gone before it writes a byte
    (``| head -1`` that has read its line): deterministic, no race with the reader."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "vllm_neuron.cli", *argv], stdout=write,
                              stderr=subprocess.PIPE, cwd=cwd, timeout=120, check=False)
    finally:
        os.close(write)


@pytest.mark.parametrize("argv", [("cache", "stats", "--cache-dir", "{local}"), ("--help",)],
                         ids=["cache stats", "--help"])
def test_a_closed_pipe_ends_quietly(argv: tuple[str, ...], world: World) -> None:
    done = _with_closed_pipe(*world.cli(*argv), cwd=world.root)
    assert done.stderr == b"" and done.returncode == 0
