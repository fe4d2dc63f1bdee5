"""Validate a capture's run directory: did it produce the evidence it claims?

A server can serve correctly and still write no device trace, so a capture is checked,
not trusted:

- ``manifest.json`` and ``run_spec.json`` exist and decode (a run spec with the guide's seven
  keys in another tool's shape is a NOTE: what it says cannot be checked, the artifacts
  still are); a run whose manifest says it
  failed or was interrupted fails with that reason. A manifest in the Neuron plugin's form
  (no ``schema_version``, see `run_record`) records no outcome: it is upcast, noted as such,
  and the run is judged by the artifacts it names;
- the device trace is named and is a non-empty file (a null or zero-byte device trace is
  *the* failure to look for); for Neuron captures the system trace, ``trace_info.pb`` and
  the NEFF directory are present and non-empty too;
- ``cpu_util.pb`` / ``host_mem.pb`` at zero bytes are flagged as "not requested" when their
  activity was not requested (they exist but are not evidence), and are a failure when it
  was;
- for torch-profiler traces, phase isolation is checked from the trace itself: every
  recorded step of a prefill capture is context work only, and every step of a decode
  capture is generation work only, at the target batch size, filling the whole window
  (``max_iterations`` steps). The capture runs the same check on each profiling window
  (`check_phase_traces`) before accepting it.

`validate_run` returns a report; ``ok`` is False when any failure was found.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from vllm_neuron.backends import local_root_missing, open_store
from vllm_neuron.backends.records import RecordError

from .artifacts import HOST_ACTIVITIES, NEURON, TORCH, ProfileArtifacts, collect
from .files import file_size
from .layout import MANIFEST_FILE, RUN_SPEC_FILE
from .run_record import STATUS_UNRECORDED, ProfileManifest, decode_manifest
from .run_spec import DECODE, MAX_ITERATIONS, PREFILL, RunSpec, decode_run_spec
from .trace import TraceError, check_decode_steps, check_prefill_steps, read_trace


@dataclass
class ValidationReport:
    run_dir: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    steps: dict[str, list[str]] = field(default_factory=dict)  # trace path -> step names

    @property
    def ok(self) -> bool:
        return not self.failures


def _file_problem(label: str, path: str | None) -> str | None:
    if not path:
        return f"{label} is null: no such artifact was written"
    size = file_size(path)
    if size is None:
        return f"{label} {path} does not exist"
    if size == 0:
        return f"{label} {path} is zero bytes"
    return None


def _load(run_dir: str, report: ValidationReport) -> tuple[RunSpec | None, ProfileManifest | None]:
    store = open_store(run_dir, create=False)
    spec = manifest = None
    for name in (RUN_SPEC_FILE, MANIFEST_FILE):
        data = store.read(name)
        if data is None:
            report.failures.append(f"{name} is missing from {run_dir}")
            continue
        try:
            if name == RUN_SPEC_FILE:
                spec = decode_run_spec(data)
            else:
                manifest = decode_manifest(data, run_dir, source=name)
        except RecordError as exc:
            if name == RUN_SPEC_FILE and _seed_shaped(data):
                # Another tool's run spec in the guide's shape: what it describes cannot be
                # compared with our schema, but the capture is judged by its artifacts.
                report.notes.append(
                    f"{name} has the guide's keys but not this tool's schema ({exc.problem}): "
                    "drift against the served configuration and the phase of the trace "
                    "steps were not checked; the capture is judged by its artifacts")
            else:
                report.failures.append(f"{name} cannot be read: {exc.problem}")
    return spec, manifest


SEED_RUN_SPEC_KEYS = frozenset({"schema_version", "run_name", "phase", "recipe", "workload",
                                "serve_config", "model_env"})
"""The keys the profiling guide gives every ``run_spec.json``."""


def _seed_shaped(data: bytes) -> bool:
    try:
        raw = json.loads(data)
    except ValueError:
        return False
    return isinstance(raw, dict) and raw.keys() >= SEED_RUN_SPEC_KEYS


def validate_run(run_dir: str) -> ValidationReport:
    run_dir = os.path.abspath(run_dir)
    report = ValidationReport(run_dir)
    if local_root_missing(run_dir):
        report.failures.append(f"{run_dir} is not a directory")
        return report
    spec, manifest = _load(run_dir, report)

    if manifest is not None and manifest.status == STATUS_UNRECORDED:
        report.notes.append(
            f"{MANIFEST_FILE} is in the Neuron plugin's form (no schema_version): it records "
            "no capture status, so the run is judged by the artifacts it names"
        )
    elif manifest is not None and manifest.status != "ok":
        detail = f": {manifest.error}" if manifest.error else ""
        stage = f" at {manifest.failed_stage}" if manifest.failed_stage else ""
        report.failures.append(f"capture status is {manifest.status!r}{stage}{detail}")

    profile: ProfileArtifacts | None = manifest.profile if manifest is not None else None
    if profile is None and spec is not None:
        # No manifest: still say what is on disk, by discovery.
        profile = collect(os.path.join(run_dir, "output"), spec.profiler)
    if profile is None:
        return report

    problem = _file_problem("device trace", profile.device_trace)
    if problem:
        report.failures.append(problem)
    if profile.profiler == NEURON:
        _check_neuron(profile, report)
    _check_host_files(profile, report)
    if profile.profiler == TORCH and spec is not None:
        _check_torch_phase(profile, spec, report)
    return report


def _check_neuron(profile: ProfileArtifacts, report: ValidationReport) -> None:
    for label, path in (
        ("system trace (system_trace_pb)", profile.system_trace_pb),
        ("trace_info.pb", profile.trace_info_pb),
    ):
        problem = _file_problem(label, path)
        if problem:
            report.failures.append(
                problem + " (workers killed before the runtime flushed its buffers? "
                "set VLLM_NEURON_WORKER_TERMINATION_TIMEOUT=60)"
            )
    if not profile.neff_dir or local_root_missing(profile.neff_dir):
        report.failures.append(
            f"NEFF directory {profile.neff_dir or '(null)'} is missing: Neuron Explorer cannot "
            "render the device profile without it"
        )


def _check_host_files(profile: ProfileArtifacts, report: ValidationReport) -> None:
    requested = set(profile.activities)
    for key, activity in HOST_ACTIVITIES.items():
        path = getattr(profile, key)
        if not path:
            if activity in requested:
                report.failures.append(f"{key}: {activity} was requested but no file was written")
            continue
        size = file_size(path)
        if size is None:
            report.failures.append(f"{key} {path} does not exist")
            continue
        if size > 0:
            continue
        if activity in requested:
            report.failures.append(f"{key} {path} is zero bytes although {activity} was requested")
        else:
            report.notes.append(
                f"{key} {path} is zero bytes: {activity} was not requested in activities, "
                "so this file is not evidence"
            )


def window_steps(spec: RunSpec) -> int:
    """How many model steps one profiling window records (``max_iterations``; 0 = unbounded)."""
    value = spec.serve_config.profiler_config.get("max_iterations", MAX_ITERATIONS)
    return value if isinstance(value, int) and value > 0 else 1


def check_phase_traces(
    paths: list[str], spec: RunSpec, *, device_trace: str | None = None
) -> tuple[list[str], dict[str, list[str]]]:
    """Phase-isolation failures of torch-profiler traces, and each trace's step names.

    Shared by `validate_run` and by the capture's check of each profiling window before it
    is accepted, so a window is retried on exactly the evidence validation would reject.
    A missing or zero-byte `device_trace` is left to the caller (it reports it its way).
    """
    failures: list[str] = []
    steps: dict[str, list[str]] = {}
    connector = spec.kv_transfer is not None
    for path in paths:
        if _file_problem("trace", path):
            if path != device_trace:
                failures.append(f"worker trace {path} is missing or zero bytes")
            continue
        try:
            summary = read_trace(path)
        except TraceError as exc:
            failures.append(str(exc))
            continue
        steps[path] = [s.name for s in summary.steps]
        if spec.recipe == PREFILL:
            problems = check_prefill_steps(summary.steps, max_requests=1)
        elif spec.recipe == DECODE:
            problems = check_decode_steps(
                summary.steps,
                target_batch=spec.workload.concurrency,
                decode_only_connector=connector,
                min_steps=window_steps(spec),
            )
        else:
            problems = [f"unknown recipe {spec.recipe!r} in run_spec.json"]
        failures.extend(f"{os.path.basename(path)}: {p}" for p in problems)
    return failures, steps


def _check_torch_phase(
    profile: ProfileArtifacts,
    spec: RunSpec,
    report: ValidationReport,
) -> None:
    traces = [t.path for t in profile.traces] or (
        [profile.device_trace] if profile.device_trace else []
    )
    failures, steps = check_phase_traces(traces, spec, device_trace=profile.device_trace)
    report.failures.extend(failures)
    report.steps.update(steps)
    connector = spec.kv_transfer is not None
    if connector:
        report.notes.append(
            "decode captured with the decode-only KV connector "
            f"({spec.kv_transfer.config.get('kv_connector') if spec.kv_transfer else '?'}): "
            "the KV cache holds dummy values, so generated tokens are meaningless; the "
            "trace is valid for performance only"
        )
