"""Find what a profiler wrote under a run's ``output/`` directory.

The session directory's name carries an instance id, a pid and a nanosecond timestamp
that cannot be known in advance, so artifacts are discovered, never assumed; the manifest
then names each one by absolute path.

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

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

NEURON = "neuron"
TORCH = "torch"
PROFILERS = (NEURON, TORCH)

TORCH_TRACE_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json")
HOST_FILES = {"cpu_util_pb": "cpu_util.pb", "host_mem_pb": "host_mem.pb"}
HOST_ACTIVITIES = {"cpu_util_pb": "cpu_util", "host_mem_pb": "host_memory"}
_NEFF_HASH = re.compile(r"([0-9a-fA-F]{8,})")


@dataclass(frozen=True)
class TraceFile:
    path: str
    size: int
    worker: str = ""


@dataclass(frozen=True)
class Artifacts:
    """Absolute paths of the artifacts found (None when absent)."""

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
    traces: list[TraceFile] = field(default_factory=list)
    neff_hashes: list[str] = field(default_factory=list)


def _walk_files(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def torch_worker_name(path: str) -> str:
    name = os.path.basename(path)
    for suffix in TORCH_TRACE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def collect(output_dir: str, profiler: str) -> Artifacts:
    """Discover the artifacts `profiler` left under `output_dir`."""
    output_dir = os.path.abspath(output_dir)
    if profiler == TORCH:
        return _collect_torch(output_dir)
    if profiler == NEURON:
        return _collect_neuron(output_dir)
    raise ValueError(f"unknown profiler {profiler!r}; expected one of {', '.join(PROFILERS)}")


def _collect_torch(output_dir: str) -> Artifacts:
    traces = [
        TraceFile(path, _size(path), torch_worker_name(path))
        for path in _walk_files(output_dir)
        if path.endswith(TORCH_TRACE_SUFFIXES)
    ]
    traces.sort(key=lambda t: (t.worker, t.path))
    return Artifacts(
        profiler=TORCH,
        output_dir=output_dir,
        device_trace=traces[0].path if traces else None,
        traces=traces,
    )


def _collect_neuron(output_dir: str) -> Artifacts:
    files = list(_walk_files(output_dir))
    ntffs = sorted((p for p in files if p.endswith(".ntff")), key=lambda p: (-_size(p), p))
    pbs = [p for p in files if p.endswith(".pb")]
    named = {os.path.basename(p): p for p in pbs}
    special = {"trace_info.pb", *HOST_FILES.values()}
    system = sorted((p for p in pbs if os.path.basename(p) not in special),
                    key=lambda p: (-_size(p), p))
    neffs = [p for p in files if p.endswith(".neff")]
    neff_dir = None
    if neffs:
        dirs = sorted({os.path.dirname(p) for p in neffs})
        neff_dir = os.path.commonpath(dirs)
    hashes = []
    for p in neffs:
        m = _NEFF_HASH.findall(os.path.basename(p)[: -len(".neff")])
        if m:
            hashes.append(max(m, key=len))
    device = ntffs[0] if ntffs else None
    anchor = device or (system[0] if system else None)
    session_dir = os.path.dirname(anchor) if anchor else None
    return Artifacts(
        profiler=NEURON,
        output_dir=output_dir,
        device_trace=device,
        device_ntff=device,
        system_trace_pb=system[0] if system else None,
        trace_info_pb=named.get("trace_info.pb"),
        neff_dir=neff_dir,
        cpu_util_pb=named.get(HOST_FILES["cpu_util_pb"]),
        host_mem_pb=named.get(HOST_FILES["host_mem_pb"]),
        session_dir=session_dir,
        traces=[TraceFile(p, _size(p)) for p in ntffs],
        neff_hashes=sorted(set(hashes)),
    )
