"""A capture's run record: its output manifest (``manifest.json``), every artifact by path.

(Not the compile manifest of `vllm_neuron.manifest`.) It is the entry point for analysis:
the session directory's name cannot be known in advance, so readers take paths from here,
never from a guess. It is written from a ``finally`` block, so a failed or interrupted run
still has one saying what happened, and it back-references ``run_spec.json``. Teardown is
recorded in its own field, separately from the capture's result: cleanup can neither rescue
a failed capture nor erase a successful one. ``windows`` records every profiling window the
capture ran (see `Window`) and ``max_windows`` the bound it ran under.

``profile`` is what discovery found (`artifacts.ProfileArtifacts`, from `artifacts.collect`).
It keeps the Neuron plugin's keys for a Neuron capture (``device_ntff``, ``system_trace_pb``,
``trace_info_pb``, ``neff_dir``, ``cpu_util_pb``, ``host_mem_pb``); a torch-profiler capture
uses the same structure with ``profiler: "torch"``, its worker traces in ``traces`` and the
rank-0 trace as ``device_trace`` (the trace whose absence or emptiness is the failure to
look for, whatever the profiler).

`ProfileManifest` is a `Document` of the record layer: its version stays in the
``schema_version`` field the profiling document fixes, and a later version is read by an
upcaster registered for ``MANIFEST_TAG``.

**The Neuron plugin's form.** AWS's plugin writes ``manifest.json`` with exactly the keys the
profiling document lists (``recipe``, ``profile.{device_ntff, system_trace_pb,
trace_info_pb, neff_dir, cpu_util_pb, host_mem_pb}``, ``neff_hashes``) and no
``schema_version``. Such a file is read as version 0 of this schema (``SEED_VERSION``) and
upcast by `_upcast_seed_form`: ``profiler`` is ``neuron`` (those keys are the Neuron
profiler's), ``device_trace`` is ``device_ntff``, ``phase`` follows from ``recipe``, and
``status`` is ``unrecorded`` (`STATUS_UNRECORDED`): the form records no outcome, so the run
is judged by its artifacts alone. What only the file's location can tell (``run_dir``,
``run_name``, ``run_spec``, ``serve_log``, ``profile.output_dir``) is filled in by
`with_location` from the directory it was read from, following the document's layout
(``run_spec.json``, ``logs/serve.log``, ``output/`` beside it). Every other field of ours
takes its default.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from vllm_neuron.backends import PRIVATE_FILE, Store, local_path_of, register_upcaster
from vllm_neuron.backends.records import Document, RecordCodec, encode_document
from vllm_neuron.envs import redact_config

from .artifacts import NEURON, ProfileArtifacts
from .layout import MANIFEST_FILE, OUTPUT_DIR, RUN_SPEC_FILE, SERVE_LOG
from .run_spec import PHASES

SCHEMA_VERSION = 1
SEED_VERSION = 0  # the Neuron plugin's manifest.json: no schema_version field
MANIFEST_TAG = "profile-manifest"  # the upcaster registry's name for this document
STATUS_UNRECORDED = "unrecorded"  # a manifest in the plugin's form says nothing of outcome
STATUSES = ("running", "ok", "failed", "interrupted", STATUS_UNRECORDED)


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


class ProfileManifest(Document, frozen=True, kw_only=True):
    record_tag = MANIFEST_TAG
    version_field = "schema_version"
    missing_version = SEED_VERSION

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


class PluginProfile(msgspec.Struct, frozen=True, kw_only=True):
    """``profile`` in the Neuron plugin's manifest: absolute paths, null when not written."""

    device_ntff: str | None = None
    system_trace_pb: str | None = None
    trace_info_pb: str | None = None
    neff_dir: str | None = None
    cpu_util_pb: str | None = None
    host_mem_pb: str | None = None


class PluginManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The Neuron plugin's ``manifest.json``: the keys the profiling document lists.

    Used only to type-check that form before it is upcast; unknown keys are ignored.
    """

    recipe: str
    profile: PluginProfile
    neff_hashes: list[str] = msgspec.field(default_factory=list)


@register_upcaster(MANIFEST_TAG, SEED_VERSION)
def _upcast_seed_form(raw: dict[str, Any]) -> dict[str, Any]:
    """The plugin's form (version 0) as version 1; see the module docstring.

    Keys the two forms share keep their values (and are type-checked by the final
    conversion), so a plugin file that also carries one of our fields is not overridden.
    """
    seed = msgspec.convert(raw, PluginManifest)  # raises ValidationError, naming the key
    out = dict(raw)
    profile = dict(raw["profile"])
    profile.setdefault("profiler", NEURON)
    profile.setdefault("output_dir", "")
    profile.setdefault("device_trace", seed.profile.device_ntff)
    out["profile"] = profile
    out.setdefault("run_name", "")
    out.setdefault("phase", PHASES.get(seed.recipe, ""))
    out.setdefault("status", STATUS_UNRECORDED)
    out.setdefault("run_dir", "")
    out.setdefault("run_spec", "")
    out.setdefault("serve_log", "")
    return out


def with_location(manifest: ProfileManifest, run_dir: str) -> ProfileManifest:
    """`manifest` with the paths only its location can tell filled in where they are empty.

    Our own manifests always carry them, so this changes only a manifest in the plugin's
    form, after the document's layout: ``<run_dir>/run_spec.json``, ``logs/serve.log``,
    ``output/``.
    """
    run_dir = run_dir.rstrip("/") or "/"
    changes: dict[str, Any] = {}
    if not manifest.run_dir:
        changes["run_dir"] = run_dir
    if not manifest.run_name:
        changes["run_name"] = os.path.basename(run_dir)
    if not manifest.run_spec:
        changes["run_spec"] = os.path.join(run_dir, RUN_SPEC_FILE)
    if not manifest.serve_log:
        changes["serve_log"] = os.path.join(run_dir, SERVE_LOG)
    if not manifest.profile.output_dir:
        changes["profile"] = msgspec.structs.replace(
            manifest.profile, output_dir=os.path.join(run_dir, OUTPUT_DIR)
        )
    return msgspec.structs.replace(manifest, **changes) if changes else manifest


def encode_manifest(value: ProfileManifest) -> bytes:
    """The record as ``manifest.json`` holds it, every secret redacted
    (`vllm_neuron.envs.secrets`): an error quotes the server's log, a fallback its connector
    config, and either may carry a credential."""
    return encode_document(redact_config(msgspec.to_builtins(value)))


_MANIFESTS = RecordCodec(ProfileManifest)


def decode_manifest(
    data: bytes, run_dir: str | None = None, *, source: str = "profile manifest"
) -> ProfileManifest:
    """Our ``manifest.json`` (any supported version) or the Neuron plugin's form; a
    `RecordError` naming `source` (the file) otherwise.

    `run_dir`, the directory the file was read from, fills in the paths the plugin's form
    does not record (`with_location`); without it they stay empty.
    """
    manifest = _MANIFESTS.decode(data, source=source)
    return manifest if run_dir is None else with_location(manifest, run_dir)


def write_manifest(store: Store, manifest: ProfileManifest) -> None:
    """Atomically write ``manifest.json`` at the root of the run's store, readable by this
    user only (it can quote the server's log and command line, secrets redacted)."""
    store.write(MANIFEST_FILE, encode_manifest(manifest), mode=PRIVATE_FILE)


def read_manifest(store: Store) -> ProfileManifest | None:
    data = store.read(MANIFEST_FILE)
    if data is None:
        return None
    where = local_path_of(store.url) or store.url  # the run directory, for a local store
    return decode_manifest(data, where, source=f"{where.rstrip('/')}/{MANIFEST_FILE}")
