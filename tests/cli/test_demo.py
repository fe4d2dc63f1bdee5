"""The README's main command: ``vllm-neuron demo`` (python3 dev.py demo) on a fresh machine,
then ``vllm-neuron report`` on the directory it wrote (issue 27), opened in headless
chromium. The demo runs once for both (three processes, each with a real compile or load)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPORT_TESTS = Path(__file__).resolve().parent.parent / "report"
if str(REPORT_TESTS) not in sys.path:
    sys.path.insert(0, str(REPORT_TESTS))

from report_browser import descendants, load, parse, select  # noqa: E402


@dataclass(frozen=True)
class Demo:
    cwd: Path  # where the user ran it
    workdir: Path
    proc: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    env = dict(os.environ)
    for name in ("NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
                 "VLLM_NEURON_DISABLE_WARMUP_COMPILE", "VLLM_CACHE_ROOT"):
        env.pop(name, None)
    env["VLLM_NEURON_TOOLCHAIN"] = "host"
    cwd = tmp_path_factory.mktemp("demo-run")
    workdir = cwd / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "demo", "--workdir", str(workdir)],
        env=env, capture_output=True, text=True, timeout=840, cwd=str(cwd),
    )
    return Demo(cwd, workdir, proc)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_runs_end_to_end_and_prints_its_table(demo: Demo) -> None:
    proc, workdir = demo.proc, demo.workdir
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("STEP"))
    assert "SOURCE" in lines[header] and "COMPILES" in lines[header]
    rows = {line.split("  ")[0]: line for line in lines[header + 2 : header + 5]}
    assert set(rows) == {"cold process", "second process", "new node, shared remote"}
    assert "compiled" in rows["cold process"]
    assert " local " in rows["second process"] + " "
    assert "remote" in rows["new node, shared remote"]
    assert all(row.rstrip().endswith("ok") for row in rows.values()), rows
    assert "demo passed" in proc.stdout
    # Node C fetched, it did not compile: its local tier holds the promoted entries.
    node_c = workdir / "node-c" / "neuron" / "compile_cache"
    assert [p for p in os.listdir(node_c) if not p.startswith(".")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_report_on_the_demos_output(demo: Demo) -> None:
    """``vllm-neuron report demo`` where the user ran the demo: a directory of nodes. Both
    nodes' tiers are local (their event logs), the promoted-to folder is remote, and each
    lists the demo's entry: the key node A compiled, promoted, and node C fetched."""
    assert demo.proc.returncode == 0, demo.proc.stdout + demo.proc.stderr
    page = demo.cwd / "report.html"
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "report", "demo"],
                          cwd=str(demo.cwd), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "3 tiers (2 local, 1 remote)" in done.stdout
    loaded = load(page, demo.cwd)
    assert loaded.console == []
    dom = parse(loaded.dom)
    tiers = {s.attrs["data-cache"]: s for s in select(dom, "section", class_="cache")}
    node = demo.workdir.resolve()
    expected = {str(node / "node-a" / "neuron" / "compile_cache"): "local",
                str(node / "node-c" / "neuron" / "compile_cache"): "local",
                str(node / "remote-cache"): "remote"}  # fmt: skip
    assert {loc: s.attrs["data-tier"] for loc, s in tiers.items()} == expected
    keys = {}
    for location, section in tiers.items():
        heading = next(e for e in section.children if e.tag == "h3")
        assert heading.text.endswith(f"{expected[location].capitalize()} tier {location}")
        rows = [e for e in descendants(section) if e.tag == "tr" and "data-key" in e.attrs]
        assert rows and all(int(r.attrs["data-size"]) > 0 for r in rows), location
        assert not any(r.attrs.get("class") == "bad" for r in rows), location
        keys[location] = {r.attrs["data-key"] for r in rows}
        for row in rows:
            toolchain = [c.text for c in row.children if c.tag == "td"][4]
            assert toolchain == "host"
    assert len(set(map(frozenset, keys.values()))) == 1  # the same entries on all three
    # node A's compile and node C's fetch are on the timeline
    assert len(select(dom, "rect", data_kind="compile")) == 1
    assert len(select(dom, "rect", data_kind="fetch")) == 1
