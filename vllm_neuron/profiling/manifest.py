"""The output manifest (``manifest.json``): every artifact of a capture by absolute path.

It is the entry point for analysis: the session directory's name cannot be known in
advance, so readers take paths from here, never from a guess. It is written from a
``finally`` block, so a failed or interrupted run still has one saying what happened, and
it back-references ``run_spec.json``. Teardown is recorded in its own field, separately
from the capture's result: cleanup can neither rescue a failed capture nor erase a
successful one. ``windows`` records every profiling window the capture ran (see `Window`)
and ``max_windows`` the bound it ran under.

``profile`` keeps the seed's keys for a Neuron capture (``device_ntff``,
``system_trace_pb``, ``trace_info_pb``, ``neff_dir``, ``cpu_util_pb``, ``host_mem_pb``); a
torch-profiler capture uses the same structure with ``profiler: "torch"``, its worker
traces in ``traces`` and the rank-0 trace as ``device_trace`` (the trace whose absence or
emptiness is the failure to look for, whatever the profiler).
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_neuron.backends import Store
from vllm_neuron.backends.records import decode_document, encode_document

from .artifacts import Artifacts
from .layout import MANIFEST_FILE

SCHEMA_VERSION = 1
STATUSES = ("running", "ok", "failed", "interrupted")


class TraceEntry(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    size: int
    worker: str = ""


class ProfileArtifacts(msgspec.Struct, frozen=True, kw_only=True):
    profiler: str
    output_dir: str
    device_trace: str | None = None
    device_ntff: str | None = None
    system_trace_pb: str | None = None
    trace_info_pb: str | None = None
    neff_dir: str | None = None
    cpu_util_pb: str | None = None
    host_mem_pb: str | None = None
    session_dir: str | None = None
    activities: list[str] = msgspec.field(default_factory=list)
    traces: list[TraceEntry] = msgspec.field(default_factory=list)


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One server launch; the decode fallback makes a second one."""

    attempt: int
    kv_transfer: dict[str, Any] | None = None
    outcome: str = ""
    reason: str = ""
    serve_log: str = ""
    pgid: int | None = None


class Window(msgspec.Struct, frozen=True, kw_only=True):
    """One profiling window: a run of the workload, its arming and one profiler session.

    A window whose trace misses the phase is set aside and the workload runs again, up to
    ``max_windows`` per server launch. Outcomes: ``captured`` (its trace is the run's
    ``output/``), ``rejected`` (its trace failed the phase check: ``reason``; the files
    were moved to ``traces``, outside ``output/``, so no two windows' traces mix) and
    ``missed`` (the workload ended before the trigger could fire on fresh evidence: no
    profiler session was opened).
    """

    window: int
    attempt: int = 1
    outcome: str = ""
    reason: str = ""
    trigger: dict[str, Any] | None = None
    traces: list[str] = msgspec.field(default_factory=list)
    steps: list[str] = msgspec.field(default_factory=list)
    requests: dict[str, Any] = msgspec.field(default_factory=dict)
    timings: dict[str, float] = msgspec.field(default_factory=dict)


class Teardown(msgspec.Struct, frozen=True, kw_only=True):
    pgid: int | None = None
    signals: list[str] = msgspec.field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0
    survivors: list[int] = msgspec.field(default_factory=list)
    error: str | None = None
    clean: bool = True


class Validation(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    failures: list[str] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)


class ProfileManifest(msgspec.Struct, frozen=True, kw_only=True):
    schema_version: int = SCHEMA_VERSION
    run_name: str
    recipe: str
    phase: str
    status: str = "running"
    error: str | None = None
    failed_stage: str | None = None
    run_dir: str
    run_spec: str
    serve_log: str
    profile: ProfileArtifacts
    neff_hashes: list[str] = msgspec.field(default_factory=list)
    executed_graphs: list[str] = msgspec.field(default_factory=list)
    trigger: dict[str, Any] | None = None
    fallback: dict[str, Any] | None = None
    attempts: list[Attempt] = msgspec.field(default_factory=list)
    max_windows: int = 0
    windows: list[Window] = msgspec.field(default_factory=list)
    requests: dict[str, Any] = msgspec.field(default_factory=dict)
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    versions: dict[str, str | None] = msgspec.field(default_factory=dict)
    teardown: Teardown | None = None
    validation: Validation | None = None
    started_at: str = ""
    finished_at: str = ""


def profile_from_artifacts(found: Artifacts, activities: list[str]) -> ProfileArtifacts:
    return ProfileArtifacts(
        profiler=found.profiler,
        output_dir=found.output_dir,
        device_trace=found.device_trace,
        device_ntff=found.device_ntff,
        system_trace_pb=found.system_trace_pb,
        trace_info_pb=found.trace_info_pb,
        neff_dir=found.neff_dir,
        cpu_util_pb=found.cpu_util_pb,
        host_mem_pb=found.host_mem_pb,
        session_dir=found.session_dir,
        activities=list(activities),
        traces=[TraceEntry(path=t.path, size=t.size, worker=t.worker) for t in found.traces],
    )


def encode_manifest(value: ProfileManifest) -> bytes:
    return encode_document(value)


def decode_manifest(data: bytes) -> ProfileManifest:
    return decode_document(data, ProfileManifest, version_field="schema_version",
                           supported=SCHEMA_VERSION, what="profile manifest")


def write_manifest(store: Store, manifest: ProfileManifest) -> None:
    """Atomically write ``manifest.json`` at the root of the run's store."""
    store.write(MANIFEST_FILE, encode_manifest(manifest))


def read_manifest(store: Store) -> ProfileManifest | None:
    data = store.read(MANIFEST_FILE)
    return None if data is None else decode_manifest(data)
