"""Named fault points: the registry, VLLM_NEURON_FAULT, `vllm-neuron debug faults`.

The crash matrix itself (every point killed for real, then healed) is
tests/test_crash_matrix.py; this file checks the surface: an unknown name is refused at
start-up naming the variable and the points, every point the registry names is called
somewhere in the code (and nothing calls a point the registry does not name), an armed
process dies by SIGKILL at its point and only there, and the CLI lists them.
"""

from __future__ import annotations

import ast
import errno
import json
import re
import signal
import subprocess
import sys
import timeit
from pathlib import Path

import pytest

from vllm_neuron import envs
from vllm_neuron.backends import faults
from vllm_neuron.backends.faults import POINTS, fault_point
from vllm_neuron.cli import main
from vllm_neuron.envs import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_a_point_is_parsed_and_blank_means_unset() -> None:
    assert envs.load_fault_settings({}).point is None
    assert envs.load_fault_settings({"VLLM_NEURON_FAULT": "  "}).point is None
    assert envs.load_fault_settings({"VLLM_NEURON_FAULT": " fetch.mid-copy "}).point == (
        "fetch.mid-copy")


def test_an_unknown_point_names_the_variable_and_lists_the_points() -> None:
    with pytest.raises(ConfigError) as caught:
        envs.load_fault_settings({"VLLM_NEURON_FAULT": "compile.staged"})
    message = str(caught.value)
    assert "VLLM_NEURON_FAULT='compile.staged'" in message
    assert all(name in message for name in POINTS)
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.arm("compile.staged")


def test_a_disk_fault_fails_the_write_at_its_point_once() -> None:
    settings = envs.load_fault_settings({"VLLM_NEURON_FAULT": "fetch.copied@full"})
    assert (settings.point, settings.kind) == ("fetch.copied", "full")
    with pytest.raises(ConfigError, match=r"'sideways' is not a fault kind.*full, read-only"):
        envs.load_fault_settings({"VLLM_NEURON_FAULT": "fetch.copied@sideways"})
    with pytest.raises(ConfigError, match=r"only be armed at a write point"):
        envs.load_fault_settings({"VLLM_NEURON_FAULT": "gc.mid-delete@full"})
    for kind, code in (("full", errno.ENOSPC), ("read-only", errno.EROFS)):
        faults.arm("fetch.copied", kind)
        try:
            fault_point("fetch.mid-copy")  # another point: nothing happens
            with pytest.raises(OSError) as caught:
                fault_point("fetch.copied")
            assert caught.value.errno == code and "fault point fetch.copied" in str(caught.value)
            fault_point("fetch.copied")  # once: the next write goes through
        finally:
            faults.arm(None)


def test_loading_arms_and_reset_disarms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NEURON_FAULT", "emit.after-write")
    envs.reset_for_tests()
    try:
        assert envs.fault_settings().point == "emit.after-write"
        assert faults.armed() == "emit.after-write"
        fault_point("emit.before-write")  # another point: nothing happens
    finally:
        monkeypatch.delenv("VLLM_NEURON_FAULT")
        envs.reset_for_tests()
    assert faults.armed() is None


def _calls_in_source() -> dict[str, set[str]]:
    """Every ``fault_point("<name>")`` call in the package and the storage layer, as the
    registry names its place: ``path:Class.function``."""
    found: dict[str, set[str]] = {}
    files = [p for p in (ROOT / "vllm_neuron").rglob("*.py")
             if p.relative_to(ROOT).parts[1] != "backends"]  # fmt: skip
    for path in sorted(files + list((ROOT / "backends").rglob("*.py"))):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fault_point"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            names, current = [], parents.get(node)
            while current is not None:
                if isinstance(current, ast.FunctionDef | ast.ClassDef):
                    names.append(current.name)
                current = parents.get(current)
            where = f"{path.relative_to(ROOT).as_posix()}:{'.'.join(reversed(names))}"
            found.setdefault(str(node.args[0].value), set()).add(where)
    return found


def test_every_point_is_called_where_the_registry_says_and_no_call_is_unregistered() -> None:
    calls = _calls_in_source()
    assert set(calls) == set(POINTS), set(calls) ^ set(POINTS)
    for name, wheres in calls.items():
        assert wheres == {POINTS[name].where}, (name, wheres)


def test_unarmed_cost_is_a_global_read() -> None:
    # Not a benchmark, a guard: an unarmed point is a call, a global read and a compare
    # (about 50 ns); a point that started to format or look something up would be 10x.
    assert faults.armed() is None
    per_call = min(timeit.repeat(lambda: fault_point("fetch.mid-copy"), number=20000,
                                 repeat=5)) / 20000  # fmt: skip
    assert per_call < 5e-6, per_call


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    full = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_FAULT"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_an_armed_process_dies_by_sigkill_at_its_point_and_only_there() -> None:
    code = (
        "from vllm_neuron.envs import fault_settings\n"
        "from vllm_neuron.backends import fault_point\n"
        "fault_settings()\n"
        "fault_point('emit.before-write')\n"
        "print('passed the other point', flush=True)\n"
        "fault_point('emit.after-write')\n"
        "print('survived')\n"
    )
    done = _run(code, VLLM_NEURON_FAULT="emit.after-write")
    assert done.returncode == -signal.SIGKILL, done
    assert done.stdout == "passed the other point\n"
    unarmed = _run(code)
    assert unarmed.returncode == 0 and "survived" in unarmed.stdout, unarmed


def test_cli_lists_every_point(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["debug", "faults"]) == 0
    out = capsys.readouterr().out
    for point in POINTS.values():
        assert re.search(rf"^{re.escape(point.name)}\s+{re.escape(point.where)}\s", out, re.M)
    assert main(["debug", "faults", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed] == list(POINTS)
    assert all(p["description"] and p["armed"] is False for p in listed)


def test_cli_refuses_an_unknown_point_at_start_up() -> None:
    done = _run("from vllm_neuron.cli import main; raise SystemExit(main(['debug', 'faults']))",
                VLLM_NEURON_FAULT="bogus")  # fmt: skip
    assert done.returncode == 2
    assert "VLLM_NEURON_FAULT='bogus' is not a fault point" in done.stderr


@pytest.mark.parametrize("start", [
    "from vllm_neuron.assembly import build_runtime; build_runtime()",
    "from vllm_neuron.plugin import resolve_settings; resolve_settings()",
    "from vllm_neuron.cli import main; main(['debug', 'faults', '--json'])",
], ids=["compile-runtime", "vllm-plugin", "cli"])
def test_every_process_kind_arms_the_fault_when_it_loads_its_settings(
    start: str, tmp_path: Path
) -> None:
    code = f"{start}\nfrom vllm_neuron.backends import faults\nprint('ARMED', faults.armed())\n"
    done = _run(code, VLLM_NEURON_FAULT="snapshot.before-meta", VLLM_CACHE_ROOT=str(tmp_path),
                VLLM_NEURON_TOOLCHAIN="host")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ARMED snapshot.before-meta" in done.stdout, done.stdout
