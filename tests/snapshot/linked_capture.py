"""An engine's manifest whose graphs name their snapshot bundles, made by the real writers:
two ranks trace two graphs (the manifest ledger), the manifest is emitted, then each rank's
real capturer, with the assembly's link (`vllm_neuron.assembly.link_bundles`) as its
listener, captures one decode forward of both graphs. Imported by name (the snapshot and
report tests put this directory on the path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from vllm_neuron.assembly import link_bundles
from vllm_neuron.manifest import LedgerWriter, ManifestConfig, Topology, emit_manifest
from vllm_neuron.snapshot import (
    CaptureBudget,
    RankInfo,
    SnapshotCapturer,
    clear_current_forward,
    forward_context,
    reset_snapshot_config,
    resolve_capture_spec,
)

SHARD_HASH = "5a" * 16
NORM_HASH = "6b" * 16
STEP = 2  # the captured forward: its decode row generates position 12 (CAPTURE_TOKEN)
PREFIX = "nodev"


class Shard(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(x @ w)
        return h, h.sum(dim=-1)


class Norm(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h / (h.norm(dim=-1, keepdim=True) + 1.0)


class FakeGraph:
    """What the compile runtime hands a wrapper: key, FX graph, example inputs, artifact."""

    def __init__(self, key: str, module: torch.nn.Module, *example: torch.Tensor) -> None:
        self.key = key
        self.gm = torch.fx.symbolic_trace(module)
        self.example_inputs = list(example)
        self.artifact = type("A", (), {"toolchain": "host", "target": "cpu-inductor"})()


@dataclass(frozen=True)
class Linked:
    manifest_dir: str
    snapshot_root: str

    @property
    def engine(self) -> str:
        return f"{self.manifest_dir.rstrip('/')}/{PREFIX}"


def capture_linked(manifest_dir: str, snapshot_root: str, ranks: int = 2,
                   cache_root: str | None = None) -> Linked:
    """See the module docstring; the caller sets VLLM_NEURON_RUN_ID (one engine run)."""
    from snapshot_helpers import ctx, make_config

    config = ManifestConfig(model="tiny", target="cpu-inductor", dtype="float32",
                            topology=Topology(world_size=ranks, tensor_parallel_size=ranks))
    for rank in range(ranks):
        writer = LedgerWriter(manifest_dir)
        for key in (SHARD_HASH, NORM_HASH):
            assert writer.record(key, rank=rank, global_rank=rank, input_shapes=["2, 8"],
                                 compiler_flags="")
    emit_manifest(manifest_dir, config, cache_root=cache_root, environment={},
                  link_snapshots=True, snapshot_root=snapshot_root)
    cfg = make_config(snapshot_root, CAPTURE_TOKEN="12", FORMAT="npy")
    on_bundle = link_bundles(manifest_dir, cfg)
    assert on_bundle is not None
    gen = torch.Generator().manual_seed(0)
    layers = []
    for rank in range(ranks):
        info = RankInfo(global_rank=rank, tp_rank=rank)
        budget = CaptureBudget(cfg.max_captures)
        pair = []
        for key, module, example in ((SHARD_HASH, Shard(), (torch.zeros(2, 8), torch.zeros(8, 4))),
                                     (NORM_HASH, Norm(), (torch.zeros(2, 4),))):
            spec = resolve_capture_spec(key, config=cfg, ranks=info, budget=budget)
            assert spec is not None
            graph = FakeGraph(key, module, *example)
            pair.append(SnapshotCapturer(spec, graph=graph,  # type: ignore[arg-type]
                                         on_bundle=on_bundle).wrap(module))
        layers.append((pair, torch.randn(8, 4, generator=gen)))
    try:
        for step in range(STEP + 1):
            x = torch.randn(2, 8, generator=gen)
            with forward_context(ctx(step, ["a", "b"], [9 + step, 3 + step], True, config=cfg)):
                for (shard, norm), w in layers:
                    norm(shard(x, w)[0])
    finally:
        reset_snapshot_config()
        clear_current_forward()
    return Linked(manifest_dir, snapshot_root)


def expected_paths(key: str, ranks: int = 2, root: str = "") -> list[str]:
    """The bundles each graph names: one per rank (the captured forward is each graph's
    call STEP), relative to a local root or URLs under a URL root."""
    base = f"{root.rstrip('/')}/" if "://" in root else ""
    return [f"{base}{key}/rank{r}/call{STEP}" for r in range(ranks)]
