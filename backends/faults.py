"""Named fault points: the steps where a crash test makes a process die by SIGKILL.

Every step that writes or coordinates (a compile staged, a promotion half uploaded, a
lease just taken, a manifest written but its ledger not yet removed, ...) calls
``fault_point("<name>")``. Nothing happens unless the process was armed with that name
(``VLLM_NEURON_FAULT=<name>``, parsed by ``vllm_neuron.envs.faults``, which calls `arm`
when the settings are loaded); then the process kills itself with SIGKILL right there, as
a power cut or the OOM killer would, with no ``finally`` block, no ``atexit`` and no
flush. The crash matrix (tests/test_crash_matrix.py) uses that to check that every such
death heals without a manual step.

Why here, in the lowest layer: several points are inside the storage layer (a tree copy,
a verified copy, a lease), and the layer cannot import the settings; the settings arm the
registry instead. `POINTS` is the one list of names: arming an unknown one is refused, so
a typo in the variable is a start-up error, not a test that silently crashes nowhere.

Cost when unarmed: one global read and a comparison with None per call (none of the
points is on a per-graph hot path: a cache hit and a ledger line pass none of them).
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

__all__ = ["DISK_FAULT_POINTS", "FAULT_KINDS", "POINTS", "FaultPoint", "arm", "armed",
           "fault_point"]  # fmt: skip

FAULT_KINDS: dict[str, int | None] = {"kill": None, "full": errno.ENOSPC,
                                      "read-only": errno.EROFS}  # fmt: skip
"""What an armed point does: ``kill`` (SIGKILL, the default), or fail the write in progress
as if the disk had just filled up (``full``: ENOSPC) or turned read-only (``read-only``:
EROFS), once: the process must carry on (``VLLM_NEURON_FAULT=<point>@full``)."""


@dataclass(frozen=True)
class FaultPoint:
    """One point: where it is (file:function) and what a crash there leaves behind."""

    name: str
    where: str
    description: str


def _points(*points: FaultPoint) -> dict[str, FaultPoint]:
    return {p.name: p for p in points}


POINTS: dict[str, FaultPoint] = _points(
    # Compile (the local tier)
    FaultPoint(
        "compile.staging-written", "vllm_neuron/compile/tiers/build.py:compile_and_publish",
        "a compile's output is staged and digested; its entry record is not written"),
    FaultPoint(
        "compile.record-written", "vllm_neuron/compile/tiers/build.py:compile_and_publish",
        "the entry record is staged (last); the entry is not yet published"),
    FaultPoint(
        "compile.published", "vllm_neuron/compile/tiers/build.py:compile_and_publish",
        "the entry is published in the local tier; not yet logged or promoted"),
    # Promotion (local tier -> remote tier)
    FaultPoint(
        "promote.mid-upload", "backends/transfer.py:copy_file",
        "the first file of a promotion is in the remote's staging area, the rest not all"),
    FaultPoint(
        "promote.uploaded", "vllm_neuron/compile/tiers/promote.py:promote_entry",
        "every file of a promotion is uploaded; the remote publication is not committed"),
    FaultPoint(
        "promote.committed", "vllm_neuron/compile/tiers/promote.py:promote_entry",
        "the entry is published on the remote; the promotion event is not logged"),
    # Fetch (remote tier -> local tier)
    FaultPoint(
        "fetch.mid-copy", "backends/verified_copy.py:_copy_one",
        "the first file of a fetch is copied and verified into local staging, the rest not all"),
    FaultPoint(
        "fetch.copied", "vllm_neuron/compile/tiers/remote.py:fetch_entry",
        "a fetch staged every file and the entry record locally; not yet published"),
    # Unpacking a host entry's package beside it in the local tier (compile/tiers/unpacked.py)
    FaultPoint(
        "unpack.mid-copy", "vllm_neuron/compile/tiers/unpacked.py:_unpack",
        "the first member of a package is unpacked into local staging, the rest not all"),
    FaultPoint(
        "unpack.staged", "vllm_neuron/compile/tiers/unpacked.py:_unpack",
        "every member of a package and the copy's record are staged; not yet published"),
    # A compile worker process (vllm_neuron/compile/workers/pool.py)
    FaultPoint(
        "worker.started", "vllm_neuron/compile/workers/process.py:_compile_one",
        "a compile worker started, read its job, has not compiled yet"),
    # Leases (stores without kernel locks: NFS, Lustre without flock, S3)
    FaultPoint(
        "lease.acquired", "backends/locks.py:LeaseLock.acquire",
        "a lease was just taken (its generation record created); it is never released"),
    FaultPoint(
        "lease.renewed", "backends/locks.py:LeaseLock._beat",
        "the holder's heartbeat just renewed its lease, between two renewals"),
    # Manifest
    FaultPoint(
        "ledger.appended", "vllm_neuron/manifest/ledger.py:LedgerWriter._append",
        "a process wrote its first ledger line; its run will never emit"),
    FaultPoint(
        "emit.before-write", "vllm_neuron/manifest/emit.py:emit_manifest",
        "the ledger is folded; manifest.json is not written"),
    FaultPoint(
        "emit.after-write", "vllm_neuron/manifest/emit.py:emit_manifest",
        "manifest.json is written; the engine's ledger is not yet removed"),
    # Snapshot capture
    FaultPoint(
        "snapshot.mid-tensors", "vllm_neuron/snapshot/tensor_writers.py:HostTensorWriter.write",
        "the first tensor file of a bundle is written, the others not"),
    FaultPoint(
        "snapshot.before-meta", "vllm_neuron/snapshot/bundle_writer.py:BundleWriter.capture_call",
        "every input and output tensor of a bundle is written; meta.json is not"),
    # Collection (cache gc; the size bound's eviction and cache prune)
    FaultPoint(
        "gc.mid-delete", "vllm_neuron/compile/upkeep/collect.py:GcPlan.execute",
        "cache gc removed the first item of its plan, not the rest"),
    FaultPoint(
        "evict.mid-delete", "vllm_neuron/compile/upkeep/eviction.py:withdraw_entries",
        "an eviction or prune withdrew its first entry, not the rest"),
)

# The points inside a write to a node's local tier: where a disk fault can be armed.
DISK_FAULT_POINTS = ("compile.staging-written", "compile.record-written", "fetch.mid-copy",
                     "fetch.copied", "unpack.mid-copy", "unpack.staged")  # fmt: skip

_armed: str | None = None
_kind: int | None = None  # the errno a disk fault raises; None: kill


def fault_point(name: str) -> None:
    """Die here by SIGKILL if this process was armed with `name` (or, for a disk fault, fail
    the write in progress once with its OSError); otherwise nothing."""
    global _armed
    if _armed is None:
        return
    if name == _armed:
        code = _kind
        if code is None:
            os.kill(os.getpid(), signal.SIGKILL)
            return  # pragma: no cover - SIGKILL does not return
        _armed = None  # once: the disk is full (read-only) at this moment, not forever
        raise OSError(code, f"{os.strerror(code)} (fault point {name})")


def arm(point: str | None, kind: str = "kill") -> None:
    """Make `point` kill this process when it is reached (None: disarm), or with a `kind`
    of `FAULT_KINDS` fail the write there once.

    ``ValueError`` for a name that is not in `POINTS`, listing them, or an unknown kind.
    """
    global _armed, _kind
    if point is not None and point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; the points are: {', '.join(POINTS)}")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; the kinds are: {', '.join(FAULT_KINDS)}")
    if kind != "kill" and point is not None and point not in DISK_FAULT_POINTS:
        raise ValueError(f"a disk fault can only be armed at a write point "
                         f"({', '.join(DISK_FAULT_POINTS)}), not {point!r}")  # fmt: skip
    _armed, _kind = point, FAULT_KINDS[kind]


def armed() -> str | None:
    """The point this process dies (or fails a write) at, or None."""
    return _armed
