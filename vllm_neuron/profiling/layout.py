"""Where a capture's files go: one knob, ``NEURON_PROJECT_ROOT``, and no override.

    <project_root>/agent_artifacts/
        profiles/<run_name>/      run_spec.json, manifest.json, logs/serve.log, output/,
                                  windows/ (the traces of rejected profiling windows)
        bench/<run_name>/         benchmark results of the same run name
        models/                   weights (the default HF_HOME)
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from vllm_neuron.backends.writable import directory_problem, free_bytes, mib

ARTIFACTS_DIR = "agent_artifacts"
RUN_SPEC_FILE = "run_spec.json"
MANIFEST_FILE = "manifest.json"
LOGS_DIR = "logs"
SERVE_LOG_NAME = "serve.log"
SERVE_LOG = f"{LOGS_DIR}/{SERVE_LOG_NAME}"
OUTPUT_DIR = "output"
WINDOWS_DIR = "windows"

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_run_name(name: str) -> str:
    """A run name is one path component: letters, digits, ``.``, ``_`` and ``-``."""
    if not _RUN_NAME.match(name) or name in (".", ".."):
        raise ValueError(
            f"run name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def default_run_name(recipe: str, now: float | None = None) -> str:
    """``<recipe>-<UTC timestamp>-<pid>``: unique per launch, sortable by time."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{recipe}-{stamp}-{os.getpid()}"


def artifacts_root(project_root: str) -> str:
    return os.path.join(os.path.abspath(project_root), ARTIFACTS_DIR)


def models_dir(project_root: str) -> str:
    return os.path.join(artifacts_root(project_root), "models")


def window_key(attempt: int, window: int) -> str:
    """The run-store key of a rejected window's files: outside ``output/``, never mixed."""
    return f"{WINDOWS_DIR}/attempt{attempt}-window{window}"


def attempt_log_key(attempt: int) -> str:
    """The run-store key an earlier launch's server log is kept under (decode fallback)."""
    return f"{LOGS_DIR}/serve.attempt{attempt}.log"


def bench_dir(project_root: str, run_name: str) -> str:
    return os.path.join(artifacts_root(project_root), "bench", validate_run_name(run_name))


@dataclass(frozen=True)
class RunLayout:
    """The absolute paths of one capture run."""

    run_dir: str

    @classmethod
    def for_run(cls, project_root: str, run_name: str) -> RunLayout:
        return cls(
            os.path.join(artifacts_root(project_root), "profiles", validate_run_name(run_name))
        )

    @property
    def run_spec(self) -> str:
        return os.path.join(self.run_dir, RUN_SPEC_FILE)

    @property
    def manifest(self) -> str:
        return os.path.join(self.run_dir, MANIFEST_FILE)

    @property
    def serve_log(self) -> str:
        return os.path.join(self.run_dir, SERVE_LOG)

    @property
    def output_dir(self) -> str:
        return os.path.join(self.run_dir, OUTPUT_DIR)

    def window_dir(self, attempt: int, window: int) -> str:
        """Where a rejected window's files are kept: outside ``output/``, never mixed."""
        return os.path.join(self.run_dir, window_key(attempt, window))

    def attempt_log(self, attempt: int) -> str:
        return os.path.join(self.run_dir, attempt_log_key(attempt))


CAPTURE_SPACE_RESERVE = 64 << 20
"""Free bytes a run directory's filesystem must have before a server is started for it: a
trace that cannot be written costs the whole capture, found after minutes of start-up."""


def check_room(run_dir: str, project_root: str) -> None:
    """A ValueError naming the setting and the reason when the run directory cannot take
    the capture's files (read-only, refused, or less than `CAPTURE_SPACE_RESERVE` free),
    before anything is started. The probe's parents stay; the run directory itself is
    created later, as before."""
    parent = os.path.dirname(run_dir)
    problem = directory_problem(parent)
    if problem is None:
        free = free_bytes(parent)
        if free is not None and free < CAPTURE_SPACE_RESERVE:
            problem = (f"no space left: {mib(free)} free, a capture needs at least "
                       f"{mib(CAPTURE_SPACE_RESERVE)}")  # fmt: skip
    if problem is not None:
        raise ValueError(f"cannot write the capture's run directory {run_dir} (under "
                         f"NEURON_PROJECT_ROOT or --project-root: {project_root}): {problem}")
