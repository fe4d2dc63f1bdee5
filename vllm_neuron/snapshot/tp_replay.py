"""Replaying bundles whose graph calls a collective: all ranks of the call together.

Why: in a tensor-parallel capture each rank's piece ends in an all-reduce (after a
row-parallel layer, or the vocab-parallel embedding's masked lookup), and that call sums
with the other ranks' calls: one rank's bundle run alone either waits forever or sums with
nothing. So a bundle whose ``meta.json`` lists collective ops (or, for a bundle that does
not record them, a group larger than one) is replayed in a group: the same call on every
rank of its tensor-parallel group, one process per rank (:mod:`.rank_worker`), joined by
vLLM's own distributed set-up over gloo on loopback, so the graph's collective (on vLLM's
CPU platform ``_C::shm_allreduce`` with the tensor-parallel group's shared-memory handle)
finds the group it was traced against. Each rank replays its own bundle with its own
artifact (the compile-cache entry named by its bundle's hash: a piece can have a different
graph per rank) and reports for itself.

"The same call" is the forward (``global_step``) and the call's position among that
forward's graph calls (``forward_call``), which every rank shares even where the graphs
differ; a bundle that predates ``forward_call`` pairs only with bundles of the same hash
and call index. When a rank's bundle of the call is missing (capture limited by
``..._RANKS``, a lost file), the bundle is refused with a report that says which rank.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_neuron.backends import Store

from .bundles import Bundle, list_bundles
from .collectives import needs_group
from .compare import OutputComparison
from .meta import CallMeta, read_call_meta
from .replay_report import ReplayReport, report_of
from .runners import CacheChoice

__all__ = ["ReplayGroup", "ReplayPlan", "needs_group", "plan_groups", "replay_groups"]

GROUP_TIMEOUT = 1800.0  # seconds for all groups of one size: a bound against a hung rank


def _call_key(meta: CallMeta) -> Hashable:
    """What names one call on every rank of the group (see the module docstring)."""
    if meta.forward_call is not None and meta.global_step is not None:
        return ("call", meta.dp_rank, meta.tp_size, meta.global_step, meta.forward_call)
    return ("hash", meta.dp_rank, meta.tp_size, meta.compilation_hash, meta.call_index)


@dataclass(frozen=True)
class ReplayGroup:
    """One call on every rank: ``members[r]`` is tensor-parallel rank r's bundle."""

    tp_size: int
    members: tuple[str, ...]


@dataclass
class ReplayPlan:
    """What runs in this process, what runs in rank groups, what is refused (by prefix)."""

    alone: list[Bundle] = field(default_factory=list)
    groups: list[ReplayGroup] = field(default_factory=list)
    refused: dict[str, ReplayReport] = field(default_factory=dict)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def plan_groups(store: Store, bundles: Sequence[Bundle], runner: str = "auto") -> ReplayPlan:
    """Sort ``bundles`` into those that replay alone and the rank groups the others need,
    finding each group's other ranks anywhere under ``store`` (a rank-specific graph of the
    same piece lives under another hash)."""
    plan = ReplayPlan()
    grouped = [b for b in bundles if needs_group(b.meta)]
    plan.alone = [b for b in bundles if not needs_group(b.meta)]
    if not grouped:
        return plan
    index: dict[Hashable, dict[int, str]] = {}
    for info in list_bundles(store).bundles:
        meta = read_call_meta(store, info.prefix)
        if meta is not None and needs_group(meta):
            index.setdefault(_call_key(meta), {}).setdefault(meta.tp_rank, info.prefix)
    seen: dict[Hashable, ReplayGroup] = {}
    for bundle in grouped:
        meta = bundle.meta
        key = _call_key(meta)
        members = index.get(key, {bundle.meta.tp_rank: bundle.prefix})
        missing = [r for r in range(meta.tp_size) if r not in members]
        if missing:
            ops = ", ".join(meta.collectives or ()) or "collectives"
            where = (f"step {meta.global_step}, call {meta.forward_call} of the forward"
                     if meta.forward_call is not None else
                     f"graph {meta.compilation_hash}, call {meta.call_index}")  # fmt: skip
            plan.refused[bundle.prefix] = report_of(bundle, runner, problem=(
                f"cannot replay rank {meta.tp_rank} alone: its graph calls {ops}, a "
                f"collective over the {meta.tp_size} ranks of its tensor-parallel group, so "
                f"it replays only together with the same call on every rank ({where}); no "
                f"bundle of {_ranks(missing)} was captured for that call under "
                f"{store.url.rstrip('/')} (capture every rank: leave "
                "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_RANKS unset)"))  # fmt: skip
            continue
        if key not in seen:
            seen[key] = ReplayGroup(meta.tp_size, tuple(members[r] for r in range(meta.tp_size)))
            plan.groups.append(seen[key])
    return plan


def _report_from_json(raw: dict[str, Any]) -> ReplayReport:
    """A worker's report back from JSON (``dataclasses.asdict``: tuples became lists)."""
    outputs = tuple(OutputComparison(**{**o, "shape": tuple(o["shape"])})
                    for o in raw.pop("outputs"))  # fmt: skip
    raw.pop("passed", None)
    report = ReplayReport(**raw)
    return replace(report, outputs=outputs, collectives=tuple(report.collectives),
                   peers=tuple(report.peers))  # fmt: skip


def _launch(job_dir: Path, ranks: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for rank in range(ranks):
        with (job_dir / f"rank{rank}.log").open("wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vllm_neuron.snapshot.rank_worker",
                 str(job_dir / "job.json"), str(rank)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))  # fmt: skip
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> dict[int, str]:
    """Wait for every rank; the first that fails (or the deadline) stops the others, which
    would otherwise wait for it in a collective. rank -> why it did not finish."""
    deadline = time.monotonic() + timeout
    failed: dict[int, str] = {}
    while any(p.poll() is None for p in procs) and not failed:
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            if code != 0:
                failed[rank] = f"exited with status {code}"
        if time.monotonic() > deadline:
            failed.update({r: f"did not finish within {timeout:.0f} s"
                           for r, p in enumerate(procs) if p.poll() is None})  # fmt: skip
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    for rank, proc in enumerate(procs):
        if proc.returncode != 0 and rank not in failed:
            failed[rank] = f"stopped after another rank failed (status {proc.returncode})"
    return failed


def _run_size(store: Store, groups: list[ReplayGroup], tp_size: int, options: dict[str, object],
              ) -> dict[str, ReplayReport]:  # fmt: skip
    job_dir = Path(tempfile.mkdtemp(prefix="vllm-neuron-replay-"))
    try:
        job = {"root": store.url, "tp_size": tp_size, "groups": [g.members for g in groups],
               "init": f"file://{job_dir / 'rendezvous'}", "ident": uuid.uuid4().hex[:12],
               **options}  # fmt: skip
        (job_dir / "job.json").write_text(json.dumps(job))
        failed = _wait(_launch(job_dir, tp_size), GROUP_TIMEOUT)
        reports: dict[str, ReplayReport] = {}
        if failed:
            why = "; ".join(
                f"rank {r} {what}: "
                + (job_dir / f"rank{r}.log").read_text(errors="replace").strip()[-1500:]
                for r, what in sorted(failed.items())
            )
            for group in groups:
                for rank, prefix in enumerate(group.members):
                    reports[prefix] = ReplayReport(
                        f"{store.url.rstrip('/')}/{prefix}", str(options["runner"]),
                        problem=f"the replay processes of its tensor-parallel group failed: "
                                f"{why}", global_rank=rank, tp_rank=rank)  # fmt: skip
            return reports
        for rank in range(tp_size):
            results = json.loads((job_dir / f"result{rank}.json").read_text())
            for group, raw in zip(groups, results, strict=True):
                report = _report_from_json(raw)
                peers = tuple(f"{store.url.rstrip('/')}/{p}" for r, p in
                              enumerate(group.members) if r != rank)  # fmt: skip
                reports[group.members[rank]] = replace(report, peers=peers)
        return reports
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def replay_groups(
    store: Store,
    groups: Sequence[ReplayGroup],
    *,
    runner: str = "auto",
    cache_dir: CacheChoice | str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> dict[str, ReplayReport]:
    """Replay every group, one process per rank running all groups of its size in order;
    the report of every member bundle, by prefix."""
    choice = cache_dir if isinstance(cache_dir, CacheChoice) or cache_dir is None else (
        CacheChoice(cache_dir))
    options: dict[str, object] = {
        "runner": runner, "atol": atol, "rtol": rtol,
        "cache_dir": None if choice is None else [choice.path, choice.named_by],
    }  # fmt: skip
    reports: dict[str, ReplayReport] = {}
    for size in sorted({g.tp_size for g in groups}):
        reports.update(_run_size(store, [g for g in groups if g.tp_size == size], size,
                                 options))  # fmt: skip
    return reports

