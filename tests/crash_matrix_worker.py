"""The one worker of the crash matrix (tests/test_crash_matrix.py): ``python
crash_matrix_worker.py MODE JSON`` does one piece of work the way a real process does it,
and prints a result line. The test starts it once with ``VLLM_NEURON_FAULT`` set (it must
die by SIGKILL at that point), then again without (it must finish the same work).

Modes, each a kind of process that writes or coordinates:

- ``get``: a rank getting a key through the two-tier cache (fake compile, the fleet's
  single flight when a remote is given);
- ``cli``: a ``vllm-neuron`` command (``cache promote``, ``cache gc``, ``cache prune``;
  the CLI arms the fault itself);
- ``manifest``: an engine run: ledger lines, then the emit;
- ``snapshot``: one captured forward of a compiled executable;
- ``torch``: ``torch.compile(backend="vllm_neuron")`` of a tiny model, a real Inductor
  compile (the runtime's build arms the fault itself).

``nfs_under``: local paths under it are taken for an NFS mount, as `/proc/mounts` would
say (the ``nfs`` profile: leases instead of kernel locks, fsync before publishing), for the
stores this process opens by URL alone. Every wait is a handshake (``hold_dir``: a compile
that stops half-way until the test lets it go on, or until the process is killed), never a
pause on the clock.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "compile", "helpers"))

from cache_workers import _hold_once, entry_is_right, fake_compile  # noqa: E402

RESULT_PREFIX = "CRASH_WORKER_RESULT "
SAFETY = 600.0


def nfs_profile_for(base: str, real: Any) -> Any:
    """`router.profile_for` that takes local paths under `base` for an NFS mount."""
    base = os.path.abspath(base)

    def profile_for(path: str, mounts_text: str | None = None) -> tuple[str, bool]:
        absolute = os.path.abspath(path)
        if absolute == base or absolute.startswith(base + os.sep):
            return "nfs", False
        return real(path, mounts_text)

    return profile_for


def pretend_nfs(base: str) -> None:
    """Local paths under `base` are on NFS for every store this process opens."""
    from vllm_neuron.backends import router

    router.profile_for = nfs_profile_for(base, router.profile_for)


def arm_from_settings() -> None:
    """What every process kind does at start: load its settings (which arms the fault)."""
    from vllm_neuron.envs import fault_settings

    fault_settings()


def run_get(args: Mapping[str, Any]) -> dict[str, Any]:
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.flow.cache import TwoTierCache

    arm_from_settings()
    key = args["key"]
    cache = TwoTierCache(
        open_store(args["cache_dir"], **args.get("local_options", {})),
        remote=args.get("remote"),
        remote_options=args.get("remote_options"),
        timeout=SAFETY,
        lease_duration=float(args["lease_seconds"]),
        remote_lease_seconds=float(args["lease_seconds"]),
    )
    result = cache.get_or_compile(
        key, lambda out: fake_compile(out, key=key, hold_dir=args.get("hold_dir")))
    assert result.path is not None
    # What a serving process does in the background, done before this one exits: promote
    # what an earlier, killed process owed the remote (compile/upkeep/owed.py).
    assert cache.wait_for_upkeep(SAFETY)
    return {"source": result.source, "wrong": entry_is_right(result.path, key)}


def run_cli(args: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm-neuron <argv>`` (the CLI loads its settings, and so arms the fault, itself)."""
    from vllm_neuron.cli import main

    return {"status": main(list(args["argv"]))}


def run_manifest(args: Mapping[str, Any]) -> dict[str, Any]:
    from vllm_neuron.backends import open_store
    from vllm_neuron.envs import run_id
    from vllm_neuron.identity import get_server_prefix
    from vllm_neuron.manifest.emit import emit_manifest
    from vllm_neuron.manifest.ledger import LedgerWriter
    from vllm_neuron.manifest.schema import ManifestConfig

    arm_from_settings()
    store = open_store(args["root"])
    writer = LedgerWriter(store)
    for key in args["keys"]:
        assert writer.record(key, rank=0, input_shapes=["4, 8"], compiler_flags="--opt=2")
    manifest = emit_manifest(store, ManifestConfig(model="crash-matrix"), cache_root=None)
    return {"prefix": get_server_prefix(), "run": run_id(),
            "graphs": sorted(g.graph_hash for g in manifest.graphs)}  # fmt: skip


def run_snapshot(args: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    from vllm_neuron.envs.snapshot import DIR, ENABLE, FORMAT
    from vllm_neuron.snapshot import (
        CaptureBudget,
        HostTensorWriter,
        RankInfo,
        SnapshotCapturer,
        SnapshotForwardContext,
        forward_context,
        load_snapshot_config,
        resolve_capture_spec,
    )

    arm_from_settings()
    config = load_snapshot_config({ENABLE: "1", DIR: args["root"], FORMAT: "npy"})
    spec = resolve_capture_spec(args["hash"], config=config, ranks=RankInfo(),
                                budget=CaptureBudget(config.max_captures))  # fmt: skip
    assert spec is not None
    capturer = SnapshotCapturer(spec, writer=HostTensorWriter())

    def executable(x: Any, w: Any, n: int) -> Any:
        y = (x @ w) * n
        return y, y.sum()

    fn = capturer.wrap(executable)
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    w = torch.eye(4, dtype=torch.float32)
    ctx = SnapshotForwardContext.build(0, ["req-0"], [0], False, 0, selector=config.selector)
    with forward_context(ctx):
        fn(x, w, 3)
    return {"captured": list(capturer.captured)}


def run_torch(args: Mapping[str, Any]) -> dict[str, Any]:
    """A real compile through the package's torch.compile backend. With ``hold_dir``, the
    compile runs to its end, then stops there (before its entry is staged) until the test
    lets it go on or the process dies (a lease holder's heartbeat reaching its point)."""
    import torch

    import vllm_neuron  # noqa: F401 - registers the backend
    from vllm_neuron.assembly import get_runtime

    sys.path.insert(0, os.path.join(HERE, "compile", "helpers"))
    from cache_workers import build_model

    if args.get("hold_dir"):
        cache = get_runtime().cache
        real_get_or_compile = cache.get_or_compile

        def get_or_compile(key: str, compile_fn: Any, **kwargs: Any) -> Any:
            def compile_then_hold(out_dir: str) -> Any:
                meta = compile_fn(out_dir)
                _hold_once(args["hold_dir"])
                return meta

            return real_get_or_compile(key, compile_then_hold, **kwargs)

        cache.get_or_compile = get_or_compile  # type: ignore[method-assign]

    model, x = build_model(args.get("model", "mlp_a"))
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend="vllm_neuron", dynamic=False)(x)
    history = get_runtime().history
    assert get_runtime().cache.wait_for_upkeep(SAFETY)  # as in run_get
    return {"sources": [g.result.source for g in history], "keys": [g.key for g in history],
            "matches": bool(torch.allclose(actual, expected, rtol=1e-4, atol=1e-5))}


MODES = {"get": run_get, "cli": run_cli, "manifest": run_manifest,
         "snapshot": run_snapshot, "torch": run_torch}  # fmt: skip


def main(argv: list[str]) -> int:
    mode, raw = argv[0], argv[1]
    args = json.loads(raw)
    if args.get("nfs_under"):
        pretend_nfs(args["nfs_under"])
    try:
        result = {"ok": True, **MODES[mode](args)}
    except Exception as exc:  # reported to the test, which shows it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}  # fmt: skip
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def parse_result(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX):]))
    raise AssertionError(f"no result line in the worker's output:\n{stdout}")


def command(mode: str, args: Mapping[str, Any]) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), mode, json.dumps(dict(args))]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
