#!/usr/bin/env python3
"""Project bootstrap: everything a fresh machine with only Python needs.

    python3 dev.py demo     # the compile-cache demo (local disk by default)
    python3 dev.py test     # the whole test suite (what CI runs)
    python3 dev.py lint     # ruff, mypy and the layer contract (also part of test)
    python3 dev.py bench    # the benchmarks

Each command creates `.venv/` on first use and installs the project into it from
pyproject.toml at constraints.txt's versions (again whenever either changes); nothing is
installed by hand.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("VLLM_NEURON_DEV_VENV", ROOT / ".venv"))
PY = VENV / "bin" / "python"
EXTRAS = {"demo": "torch", "test": "test", "lint": "test,lint", "bench": "test"}


def ensure_env(extras: str) -> None:
    if not PY.exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    # Exact versions from constraints.txt (pyproject.toml gives ranges); either file changing
    # installs again.
    constraints = ROOT / "constraints.txt"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + b"\0"
                            + constraints.read_bytes()).hexdigest()[:16]
    stamp = VENV / f".vllm-neuron-installed-{extras.replace(',', '-')}-{digest}"
    if stamp.exists():
        return
    print(f"dev.py: installing vllm-neuron[{extras}] into {VENV}", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.check_call([*pip, "-c", str(constraints), "-e", f"{ROOT}[{extras}]"], cwd=ROOT)
    stamp.touch()


def ensure_chromium() -> None:
    """The report's tests open the page in a real headless browser: Debian's chromium."""
    if shutil.which("chromium"):
        return
    if os.geteuid() != 0:
        print("dev.py: chromium is missing and this is not root, so the report's browser tests "
              "will fail: install it with `apt-get install chromium`", file=sys.stderr)
        return
    print("dev.py: installing chromium (the report's browser tests)", flush=True)
    apt = ["apt-get", "install", "-y", "-q", "chromium"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.call(apt, env=env) != 0:  # a fresh machine's package lists may be stale
        subprocess.check_call(["apt-get", "update", "-q"], env=env)
        subprocess.check_call(apt, env=env)


def test_workers(rest: list[str]) -> list[str]:
    """The suite's modules run on every core, a module's tests in order on one worker
    (`--dist loadfile`: a module's server sequence is cold, then warm, then a second node).
    Most tests wait on subprocesses or one core, so two workers pay on a 2-core machine; more
    than four would only multiply the vLLM servers in memory. `-n` on the command line wins."""
    if any(a == "-n" or a.startswith(("-n", "--numprocesses", "--dist")) for a in rest):
        return []
    return ["-n", str(max(2, min(4, os.cpu_count() or 2))), "--dist", "loadfile",
            "--no-loadscope-reorder"]  # the order of tests/conftest.py: long modules first


def run(argv: list[str]) -> int:
    cmd = argv[0] if argv else "test"
    rest = argv[1:]
    if cmd not in EXTRAS:
        print(f"usage: python3 dev.py {{{'|'.join(EXTRAS)}}} [args...]", file=sys.stderr)
        return 2
    ensure_env(EXTRAS[cmd])
    env = dict(os.environ)
    if cmd == "test":
        ensure_chromium()
        return subprocess.call([str(PY), "-m", "pytest", "tests", *test_workers(rest), *rest],
                               cwd=ROOT, env=env)
    if cmd == "demo":
        return subprocess.call([str(PY), "-m", "vllm_neuron.cli", "demo", *rest], cwd=ROOT,
                               env=env)
    if cmd == "lint":
        return subprocess.call([str(PY), "-m", "pytest", "-q", "tests/test_lint.py"], cwd=ROOT)
    return subprocess.call([str(PY), "-m", "benchmarks", *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
