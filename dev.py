#!/usr/bin/env python3
"""Project bootstrap: everything a fresh machine with only Python needs.

    python3 dev.py demo     # the compile-cache demo (local disk by default)
    python3 dev.py test     # the whole test suite (what CI runs)
    python3 dev.py lint     # ruff, mypy and the layer contract (also part of test)
    python3 dev.py bench    # the benchmarks
    python3 dev.py lock     # write dev-lock.txt again (after a change to the dependencies)

Each command creates `.venv/` on first use and installs the project into it from
pyproject.toml at constraints.txt's versions, every other package at dev-lock.txt's (again
whenever one of them changes); nothing is installed by hand.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("VLLM_NEURON_DEV_VENV", ROOT / ".venv"))
PY = VENV / "bin" / "python"
EXTRAS = {"demo": "torch", "test": "test", "lint": "test,lint", "bench": "test"}


CONSTRAINTS = ROOT / "constraints.txt"
# Every other package of the development environment, at the versions `dev.py lock` resolved:
# without them pip's resolver spends minutes (six of CPU, measured) choosing versions for
# moto's and s3fs's dependencies on every fresh machine. Only .venv uses it (vLLM's test
# environment keeps vLLM's own versions of these).
LOCK = ROOT / "dev-lock.txt"
ALL_EXTRAS = "test,lint,torch"  # what the lock covers: every command's extras


def ensure_env(extras: str) -> None:
    if not PY.exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    # Exact versions from constraints.txt and dev-lock.txt (pyproject.toml gives ranges); any
    # of the three changing installs again.
    digest = hashlib.sha256(b"\0".join(
        p.read_bytes() for p in (ROOT / "pyproject.toml", CONSTRAINTS, LOCK))).hexdigest()[:16]
    stamp = VENV / f".vllm-neuron-installed-{extras.replace(',', '-')}-{digest}"
    if stamp.exists():
        return
    print(f"dev.py: installing vllm-neuron[{extras}] into {VENV}", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.check_call([*pip, "-c", str(CONSTRAINTS), "-c", str(LOCK), "-e",
                           f"{ROOT}[{extras}]"], cwd=ROOT)  # fmt: skip
    stamp.touch()


def write_lock() -> int:
    """Resolve every command's extras afresh at constraints.txt's versions, in a new
    environment, and write what was installed (but the project and what constraints.txt
    pins) to dev-lock.txt."""
    def name(line: str) -> str:  # a distribution's name as pip compares it (PEP 503)
        return re.sub(r"[-_.]+", "-", line.split("==")[0].strip()).lower()

    pinned = {name(line) for line in CONSTRAINTS.read_text().splitlines()
              if "==" in line and not line.lstrip().startswith("#")}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vllm-neuron-lock-") as tmp:
        venv.EnvBuilder(with_pip=True).create(tmp)
        py = str(Path(tmp) / "bin" / "python")
        pip = [py, "-m", "pip", "--disable-pip-version-check"]
        subprocess.check_call([*pip, "install", "-q", "-c", str(CONSTRAINTS), "-e",
                               f"{ROOT}[{ALL_EXTRAS}]"], cwd=ROOT)  # fmt: skip
        # --all: setuptools too (torch requires it); pip itself is the installer's own.
        frozen = subprocess.run([*pip, "freeze", "--all", "--exclude-editable"], check=True,
                                stdout=subprocess.PIPE, text=True).stdout.splitlines()
    keep = sorted((line for line in frozen if "==" in line and " @ " not in line
                   and name(line) not in {*pinned, "pip"}),
                  key=str.lower)  # fmt: skip
    LOCK.write_text(
        "# Written by `python3 dev.py lock`: every package of the development environment\n"
        "# (.venv) that constraints.txt does not pin, at the versions pip resolved. dev.py\n"
        "# installs with both files as constraints, so a fresh machine skips the resolver's\n"
        "# search. Not used inside vLLM's environment, which keeps vLLM's own versions.\n"
        + "".join(f"{line}\n" for line in keep))
    print(f"dev.py: wrote {len(keep)} versions to {LOCK.name}")
    return 0


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
    One worker more than cores: with one per core the cores sat idle a tenth of the run
    (tests waiting out lease periods, S3 round trips and process hand-offs), which a third
    worker fills on a 2-core machine; more than four would only multiply the vLLM servers in
    memory. `-n` on the command line wins."""
    if any(a == "-n" or a.startswith(("-n", "--numprocesses", "--dist")) for a in rest):
        return []
    return ["-n", str(max(3, min(4, (os.cpu_count() or 2) + 1))), "--dist", "loadfile",
            "--no-loadscope-reorder"]  # the order of tests/conftest.py: long modules first


def run(argv: list[str]) -> int:
    cmd = argv[0] if argv else "test"
    rest = argv[1:]
    if cmd == "lock":
        return write_lock()
    if cmd not in EXTRAS:
        print(f"usage: python3 dev.py {{{'|'.join([*EXTRAS, 'lock'])}}} [args...]",
              file=sys.stderr)  # fmt: skip
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
