"""A torn precompiled header of torch's is removed instead of failing every compile after
it (toolchains/torn_headers.py): real compiles in fresh processes with a private temporary
directory, and the decision on its own with a stand-in for torch's command runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cache_workers import SAFETY
from torch._inductor import codecache, exc

from vllm_neuron.compile.toolchains import torn_headers
from vllm_neuron.compile.toolchains.node_files import NODE_DIR
from vllm_neuron.compile.toolchains.torn_headers import run_healing_torn_headers

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "torn_header_worker.py"


def _compile(tmp: Path, name: str, scale: float, *extra: str) -> tuple[dict[str, Any], str]:
    # One node's processes: its headers in its local tier's node files (node_files.py), this
    # test's own - never the session's group, which other tests' processes read meanwhile.
    env = {**os.environ, "TMPDIR": str(tmp), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
           "_VLLM_NEURON_NODE_FILES": str(tmp / "tier" / NODE_DIR)}  # fmt: skip
    env.pop("_VLLM_NEURON_SHARED_NODE_FILES", None)
    done = subprocess.run([sys.executable, str(WORKER), str(tmp / name), str(scale), *extra],
                          env=env, capture_output=True, text=True, timeout=4 * SAFETY,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.timeout(13 * SAFETY)
def test_a_node_whose_precompiled_headers_are_torn_still_compiles(tmp_path):
    built, _ = _compile(tmp_path, "first", 1.25, "--tear")
    assert built["sizes"], built  # torch built its headers; the worker then tore them
    assert Path(built["header_dir"]).is_relative_to(tmp_path / "tier" / NODE_DIR), built
    # The heal waits on torch's own lock of each header: named as torch names it.
    assert {name.removesuffix(".h.gch") + ".lock" for name in built["sizes"]} <= set(
        built["locks"]), built
    # A new process on the same node: torch sees the headers' files and would read them.
    healed, log = _compile(tmp_path, "second", 1.75)
    assert "could not be read" in log and "removed" in log, log[-3000:]
    said = [line for line in log.splitlines() if "could not be read" in line]
    assert len(said) == len(set(said)) == len(built["sizes"]), said  # once per header
    assert healed["sizes"] == {}, healed  # removed: the next process builds them again
    rebuilt, log = _compile(tmp_path, "third", 2.25)
    assert "could not be read" not in log
    assert set(rebuilt["sizes"]) == set(built["sizes"]), rebuilt


class _Runner:
    """Stands in for torch's command runner: fails as told, records each call."""

    def __init__(self, *outputs: str | None) -> None:
        self.outputs, self.calls = list(outputs), 0

    def __call__(self, cmd_line: str, cwd: str) -> None:
        self.calls += 1
        output = self.outputs.pop(0)
        if output is not None:
            raise exc.CppCompileError(cmd_line.split(), output)


@pytest.fixture
def header(tmp_path, monkeypatch) -> Path:
    """A precompiled header in (a private stand-in for) torch's header directory."""
    directory = tmp_path / "precompiled_headers"
    (directory / "locks").mkdir(parents=True)
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(directory))
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(directory / "locks"))
    path = directory / "abc.h"
    path.write_text("#include <vector>\n")
    (directory / "abc.h.gch").write_bytes(b"torn")
    return path


TORN = "<command-line>: fatal error: cannot read PCH file: No such file or directory"


def test_a_header_that_reads_on_the_second_try_is_kept(header):
    run = _Runner(TORN, None)  # a build was in progress: done once its lock is had
    run_healing_torn_headers(run, f"g++ -include {header} -c a.cpp", "/")
    assert run.calls == 2 and Path(f"{header}.gch").exists()


def test_a_header_that_still_cannot_be_read_is_removed_and_the_compile_goes_without(header):
    run = _Runner(TORN, TORN, None)
    run_healing_torn_headers(run, f"g++ -include {header} -c a.cpp", "/")
    assert run.calls == 3 and not Path(f"{header}.gch").exists()


@pytest.mark.parametrize("case", ["another error", "not torch's header", "fails without"])
def test_anything_else_is_raised_as_it_is(header, tmp_path, case):
    other = tmp_path / "mine.h"
    other.write_text("")
    Path(f"{other}.gch").write_bytes(b"torn")
    outputs: tuple[str | None, ...] = {
        "another error": ("error: 'x' was not declared",),
        "not torch's header": (TORN,),
        "fails without": (TORN, TORN, "error: 'x' was not declared"),
    }[case]
    included = other if case == "not torch's header" else header
    run = _Runner(*outputs)
    with pytest.raises(exc.CppCompileError):
        run_healing_torn_headers(run, f"g++ -include {included} -c a.cpp", "/")
    assert run.calls == len(outputs)
    assert Path(f"{other}.gch").exists()  # never a header that is not torch's
    assert Path(f"{header}.gch").exists() == (case != "fails without")


def test_the_lock_waited_on_is_torchs_own(header, monkeypatch):
    taken: list[str] = []

    class Recording:
        def __init__(self, path: str, timeout: float) -> None:
            taken.append(path)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc_info: object) -> None:
            return None

    monkeypatch.setattr("torch.utils._filelock.FileLock", Recording)
    run_healing_torn_headers(_Runner(TORN, None), f"g++ -include {header} -c a.cpp", "/")
    assert taken == [os.path.join(codecache._HEADER_LOCK_DIR, "abc.lock")]
    assert torn_headers.LOCK_SECONDS > 0


@pytest.mark.parametrize("killed", [False, True])
def test_a_precompiled_header_is_written_by_rename(tmp_path, killed):
    """A header's build (a real g++) never writes the name compiles read: its own file,
    renamed into place whole once built; a build that dies leaves neither (issue 42)."""
    header = tmp_path / "abc.h"
    header.write_text("#include <vector>\n")
    published = tmp_path / "abc.h.gch"
    seen: list[str] = []

    def run(cmd_line: str, cwd: str) -> None:
        seen.append(cmd_line)
        assert not published.exists()  # a signal now would tear no shared file
        subprocess.run(cmd_line.split(), cwd=cwd, check=True, timeout=SAFETY)
        if killed:
            raise exc.CppCompileError(cmd_line.split(), "killed (test)")

    command = f"g++ -x c++-header {header} -o {published.name}"
    if killed:
        with pytest.raises(exc.CppCompileError):
            run_healing_torn_headers(run, command, str(tmp_path))
        assert not published.exists()
    else:
        run_healing_torn_headers(run, command, str(tmp_path))
        assert published.read_bytes()[:4] == b"gpch"  # a whole header, under its name
    assert f"-o {published.name}" not in seen[0], seen
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["abc.h"] + ([] if killed else ["abc.h.gch"]))  # nothing of the build's own left
