"""Find what a profiler wrote under a run's ``output/`` directory.

The session directory's name carries an instance id, a pid and a nanosecond timestamp
that cannot be known in advance, so artifacts are discovered, never assumed; the manifest
then names each one by absolute path. What discovery finds is the manifest's ``profile``
record itself (`ProfileArtifacts`): one struct, so the two cannot drift apart. Discovery
lists the directory through a store opened on it (the storage layer is the only door to
bytes), in the order a walk of the tree visits it.

Two profilers write into ``output/``:

- **neuron** (the Neuron profiler behind ``"profiler": "cuda"``): per session a device trace
  (``*.ntff``), system traces (``*.pb``; ``trace_info.pb`` maps the session to the NEFFs it
  executed; ``cpu_util.pb`` / ``host_mem.pb`` are zero bytes unless requested) and a
  ``neffs/`` directory.
- **torch** (vLLM's torch profiler, the host stand-in): one
  ``<worker_name>.<id>.pt.trace.json.gz`` per worker rank. Its ``device_trace`` is the
  trace of the lowest-named worker (rank 0 sorts first).
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
from collections.abc import Iterable

import msgspec

from vllm_neuron.backends import Store, open_store

NEURON = "neuron"
TORCH = "torch"
PROFILERS = (NEURON, TORCH)

TORCH_TRACE_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json")
HOST_FILES = {"cpu_util_pb": "cpu_util.pb", "host_mem_pb": "host_mem.pb"}
HOST_ACTIVITIES = {"cpu_util_pb": "cpu_util", "host_mem_pb": "host_memory"}
_NEFF_HASH = re.compile(r"([0-9a-fA-F]{8,})")


class TraceEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One trace file: a torch worker's trace, or a Neuron device trace (``worker`` "")."""

    path: str
    size: int
    worker: str = ""


class ProfileArtifacts(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """The manifest's ``profile``: absolute paths of the artifacts found (None when absent).

    ``activities`` are the Neuron profiler activities the run asked for (what makes a
    zero-byte host file evidence or not); discovery cannot see them, the run passes them.
    (``dict=True`` gives instances a ``__dict__`` for `neff_hashes` to be cached in; only
    the fields are encoded and compared.)
    """

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

    @functools.cached_property
    def neff_hashes(self) -> list[str]:
        """The hashes in the names of the NEFFs under ``neff_dir``, sorted and distinct: the
        manifest's top-level ``neff_hashes`` (where the Neuron plugin's form keeps them).

        Listed on the first access and kept, so it is only meaningful where the files are
        (the capturing host); a manifest that was read back has them in its own field.
        """
        if not self.neff_dir:
            return []
        keys = open_store(self.neff_dir, create=False).list("")
        hashes = set()
        for key in keys:
            if key.endswith(".neff"):
                found = _NEFF_HASH.findall(posixpath.basename(key)[: -len(".neff")])
                if found:
                    hashes.add(max(found, key=len))
        return sorted(hashes)


def _walk_order(key: str) -> list[tuple[int, str]]:
    """Sort key putting `key` where a top-down walk (names sorted) visits it: a directory's
    files before its subdirectories. Discovery keeps that order: where two sessions both
    wrote ``trace_info.pb``, the one visited last is named."""
    *dirs, name = key.split("/")
    return [(1, d) for d in dirs] + [(0, name)]


def _listing(output_dir: str) -> tuple[Store, list[str]]:
    """The store on `output_dir` (nothing created) and every file key in it, in walk order."""
    store = open_store(output_dir, create=False)
    return store, sorted(store.list(""), key=_walk_order)


def _size(store: Store, key: str) -> int:
    info = store.info(key)
    return -1 if info is None else info.size


def torch_worker_name(path: str) -> str:
    name = os.path.basename(path)
    for suffix in TORCH_TRACE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def collect(output_dir: str, profiler: str, *, activities: Iterable[str] = ()) -> ProfileArtifacts:
    """Discover the artifacts `profiler` left under `output_dir` (`activities`: what the run
    asked the Neuron profiler for, recorded alongside)."""
    output_dir = os.path.abspath(output_dir)
    if profiler == TORCH:
        return _collect_torch(output_dir, list(activities))
    if profiler == NEURON:
        return _collect_neuron(output_dir, list(activities))
    raise ValueError(f"unknown profiler {profiler!r}; expected one of {', '.join(PROFILERS)}")


def _collect_torch(output_dir: str, activities: list[str]) -> ProfileArtifacts:
    store, keys = _listing(output_dir)
    traces = [
        TraceEntry(path=os.path.join(output_dir, key), size=_size(store, key),
                   worker=torch_worker_name(key))
        for key in keys
        if key.endswith(TORCH_TRACE_SUFFIXES)
    ]
    traces.sort(key=lambda t: (t.worker, t.path))
    return ProfileArtifacts(
        profiler=TORCH,
        output_dir=output_dir,
        device_trace=traces[0].path if traces else None,
        activities=activities,
        traces=traces,
    )


def _collect_neuron(output_dir: str, activities: list[str]) -> ProfileArtifacts:
    store, keys = _listing(output_dir)
    sizes = {os.path.join(output_dir, k): _size(store, k) for k in keys
             if k.endswith((".ntff", ".pb"))}  # fmt: skip
    files = [os.path.join(output_dir, k) for k in keys]
    ntffs = sorted((p for p in files if p.endswith(".ntff")), key=lambda p: (-sizes[p], p))
    pbs = [p for p in files if p.endswith(".pb")]
    named = {os.path.basename(p): p for p in pbs}
    special = {"trace_info.pb", *HOST_FILES.values()}
    system = sorted((p for p in pbs if os.path.basename(p) not in special),
                    key=lambda p: (-sizes[p], p))  # fmt: skip
    neff_dirs = sorted({os.path.dirname(p) for p in files if p.endswith(".neff")})
    device = ntffs[0] if ntffs else None
    anchor = device or (system[0] if system else None)
    return ProfileArtifacts(
        profiler=NEURON,
        output_dir=output_dir,
        device_trace=device,
        device_ntff=device,
        system_trace_pb=system[0] if system else None,
        trace_info_pb=named.get("trace_info.pb"),
        neff_dir=os.path.commonpath(neff_dirs) if neff_dirs else None,
        cpu_util_pb=named.get(HOST_FILES["cpu_util_pb"]),
        host_mem_pb=named.get(HOST_FILES["host_mem_pb"]),
        session_dir=os.path.dirname(anchor) if anchor else None,
        activities=activities,
        traces=[TraceEntry(path=p, size=sizes[p]) for p in ntffs],
    )
