"""Snapshot bundles (with their replays) and profile runs (with their validation).

Why together: both are "runs" a report lists as found, each judged by its own feature's
check - a bundle by replaying it against its captured outputs (`snapshot.replay`), a
profile run by validating its files (`profiling.validate`) - and both must survive one
broken member: an unreadable run is a line on the page, the others are still listed.

Replay is opt-in (``report --replay``): it imports torch and runs every graph. Validation
runs where it can: `validate_run` reads a run directory on this machine (traces are named
by absolute path); a run read from a URL shows the validation its manifest recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.backends import local_path_of, open_store
from vllm_neuron.profiling.files import file_size
from vllm_neuron.profiling.layout import MANIFEST_FILE, RUN_SPEC_FILE
from vllm_neuron.profiling.run_record import ProfileManifest, read_manifest
from vllm_neuron.profiling.validate import validate_run
from vllm_neuron.snapshot.bundles import BundleInfo, SnapshotListing, list_bundles, load_bundle
from vllm_neuron.snapshot.replay import ReplayReport, RunnerKey, replay, replay_bundle
from vllm_neuron.snapshot.runners import ResolvedRunner

__all__ = [
    "ARTIFACT_FIELDS",
    "ProfileRun",
    "SnapshotView",
    "Validation",
    "gather_profiles",
    "gather_snapshots",
]

# The manifest's named artifacts, in the order `profile show` lists them.
ARTIFACT_FIELDS = ("device_trace", "device_ntff", "system_trace_pb", "trace_info_pb",
                   "neff_dir", "cpu_util_pb", "host_mem_pb")  # fmt: skip


@dataclass(frozen=True)
class SnapshotView:
    """A snapshot root: its bundles, and each bundle's replay when one was run."""

    root: str
    listing: SnapshotListing | None = None
    replays: dict[str, ReplayReport] = field(default_factory=dict)  # by bundle prefix
    error: str | None = None


@dataclass(frozen=True)
class Validation:
    ok: bool
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    source: str = "checked"  # "checked" here (validate_run), or "recorded" in the manifest


@dataclass(frozen=True)
class ProfileRun:
    location: str
    manifest: ProfileManifest | None = None
    validation: Validation | None = None
    sizes: dict[str, int | None] = field(default_factory=dict)  # artifact path -> bytes
    error: str | None = None


def _replay_all(listing: SnapshotListing, store: Any, cache_dir: str | None) -> dict[str, Any]:
    """Every bundle's replay as `snapshot replay` of the root runs it (a tensor-parallel
    capture's collective bundles together with their other ranks); a bundle that replay of
    the root leaves out (incomplete), or all of them when the root cannot be replayed as a
    whole (a bundle that does not load), bundle by bundle, each failure its own report."""
    try:
        out: dict[str, Any] = dict(replay(store, "", cache_dir=cache_dir))
    except Exception:  # noqa: BLE001 - one bad bundle must not hide the others' replays
        out = {}
    rest = [info for info in listing.bundles if info.prefix not in out]
    out.update(_replay_each(rest, store, cache_dir))
    return out


def _replay_each(infos: Sequence[BundleInfo], store: Any, cache_dir: str | None) -> dict[str, Any]:
    runners: dict[RunnerKey, ResolvedRunner] = {}
    out: dict[str, ReplayReport] = {}
    for info in infos:
        try:
            out[info.prefix] = replay_bundle(load_bundle(store, info.prefix), cache_dir=cache_dir,
                                             runners=runners)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a bundle that cannot run is its report
            where = f"{store.url.rstrip('/')}/{info.prefix}"
            out[info.prefix] = ReplayReport(where, "auto", problem=f"{type(exc).__name__}: {exc}",
                                            global_rank=info.global_rank,
                                            call_index=info.call_index)  # fmt: skip
    return out


def gather_snapshots(
    roots: Sequence[str], *, replay: bool, cache_dir: str | None
) -> tuple[SnapshotView, ...]:
    views = []
    for root in roots:
        try:
            store = open_store(root, create=False)
            listing = list_bundles(store)
            replays = _replay_all(listing, store, cache_dir) if replay else {}
        except Exception as exc:  # noqa: BLE001 - one bad root must not hide the others
            views.append(SnapshotView(root, error=f"{type(exc).__name__}: {exc}"))
            continue
        views.append(SnapshotView(root, listing, replays))
    return tuple(views)


def _run_locations(location: str) -> list[str]:
    """A profile run (``run_spec.json`` or ``manifest.json`` at it), or a directory of runs."""
    store = open_store(location, create=False)
    if store.exists(RUN_SPEC_FILE) or store.exists(MANIFEST_FILE):
        return [store.url]

    def is_run(name: str) -> bool:
        return store.exists(f"{name}/{RUN_SPEC_FILE}") or store.exists(f"{name}/{MANIFEST_FILE}")

    return [store.sub(n).url for n in store.list_dir("") if not n.startswith(".") and is_run(n)]


def _sizes(manifest: ProfileManifest) -> dict[str, int | None]:
    """The size of every file the manifest names, where it is (None: not there)."""
    p = manifest.profile
    paths = [getattr(p, name) for name in ARTIFACT_FIELDS] + [t.path for t in p.traces]
    out: dict[str, int | None] = {}
    for path in dict.fromkeys(x for x in paths if x):
        try:
            out[path] = file_size(path)
        except Exception:  # noqa: BLE001 - a path from another machine, or unreadable
            out[path] = None
    return out


def _profile_run(location: str) -> ProfileRun:
    manifest = read_manifest(open_store(location, create=False))
    local = local_path_of(location)
    validation = None
    if local is not None:
        checked = validate_run(local)
        validation = Validation(checked.ok, tuple(checked.failures), tuple(checked.notes))
    elif manifest is not None and manifest.validation is not None:
        v = manifest.validation
        validation = Validation(v.ok, tuple(v.failures), tuple(v.notes), source="recorded")
    sizes = _sizes(manifest) if manifest is not None and local is not None else {}
    return ProfileRun(location, manifest, validation, sizes)


def gather_profiles(locations: Sequence[str]) -> tuple[ProfileRun, ...]:
    runs = []
    for location in locations:
        for run in _run_locations(location):
            try:
                runs.append(_profile_run(run))
            except Exception as exc:  # noqa: BLE001 - one bad run must not hide the others
                runs.append(ProfileRun(run, error=f"{type(exc).__name__}: {exc}"))
    return tuple(runs)
