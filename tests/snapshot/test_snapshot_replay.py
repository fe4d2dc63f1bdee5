"""Replay and the CLI: ls/show/replay, the comparison report, tensor-parallel bundles."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.fx
from snapshot_helpers import HASH, ctx, make_config

from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.snapshot import RankInfo, SnapshotCapturer, SnapshotConfig, forward_context
from vllm_neuron.snapshot.bundles import locate
from vllm_neuron.snapshot.compare import compare_outputs
from vllm_neuron.snapshot.encoding import encode_tensor

CapturerFactory = Callable[..., SnapshotCapturer]  # the capturer_for fixture


class Shard(torch.nn.Module):
    """A column-parallel layer's shard: each rank has its own weight slice."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(x @ w)
        return h, h.sum(dim=-1)


class FakeGraph:
    """What the compile runtime hands a wrapper: key, FX graph, example inputs, artifact."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.gm = torch.fx.symbolic_trace(Shard())
        self.example_inputs = [torch.zeros(2, 8), torch.zeros(8, 4)]
        self.artifact = type("A", (), {"toolchain": "host", "target": "cpu-inductor"})()


def capture_tp(root: str, capturer_for: CapturerFactory, ranks: int = 2, steps: int = 3,
               fmt: str = "npy") -> SnapshotConfig:  # fmt: skip
    """Each rank captures decode step 2 of one request (token rule) with its own shard."""
    cfg = make_config(root, CAPTURE_TOKEN="12", FORMAT=fmt)
    gen = torch.Generator().manual_seed(0)
    fns = []
    for r in range(ranks):
        cap = capturer_for(cfg, rank=RankInfo(global_rank=r, tp_rank=r), graph=FakeGraph(HASH))
        fns.append(cap.wrap(Shard()))
    weights = [torch.randn(8, 4, generator=gen) for _ in range(ranks)]
    for step in range(steps):
        x = torch.randn(2, 8, generator=gen)
        with forward_context(ctx(step, ["a", "b"], [9 + step, 3 + step], True, config=cfg)):
            for fn, w in zip(fns, weights, strict=True):
                fn(x, w)
    return cfg


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def perturb(root: Path, prefix: str, index: int = 0, fmt: str = "npy") -> None:
    path = root / prefix / f"tensor{index}.{fmt}"
    from vllm_neuron.snapshot.encoding import decode_tensor

    meta = json.loads((root / prefix / "meta.json").read_text())
    spec = meta["inputs"][index]
    t = decode_tensor(path.read_bytes(), fmt, spec["dtype"], spec["shape"])  # type: ignore[arg-type]
    t = t.clone()
    t.view(-1)[0] += 0.5
    path.write_bytes(encode_tensor(t, fmt))  # type: ignore[arg-type]


def test_ls_show_replay_eager(
    tmp_path: Path, capturer_for: CapturerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "snaps"
    capture_tp(str(root), capturer_for, ranks=1)
    (root / HASH / "rank0" / "call7").mkdir()  # a capture that never finished
    (root / HASH / "rank0" / "call7" / "tensor0.npy").write_bytes(b"partial")

    code, out = run_cli(capsys, "snapshot", "ls", str(root))
    assert code == 0
    assert HASH[:12] in out and "token" in out and "decode" in out
    assert "1 bundles" in out
    assert f"incomplete (no meta.json, not a bundle): {HASH}/rank0/call7" in out
    code, out = run_cli(capsys, "snapshot", "ls", str(root), "--json")
    listing = json.loads(out)
    assert [b["prefix"] for b in listing["bundles"]] == [f"{HASH}/rank0/call2"]
    assert listing["bundles"][0]["selected_by"] == ["token"]
    assert listing["incomplete"] == [f"{HASH}/rank0/call7"]

    bundle = str(root / HASH / "rank0" / "call2")
    code, out = run_cli(capsys, "snapshot", "show", bundle)
    assert code == 0 and "selected by   token" in out and "target 12 (offset 1)" in out
    assert "tensor0.npy" in out and "output1.npy" in out
    code, out = run_cli(capsys, "snapshot", "show", bundle, "--json")
    (shown,) = json.loads(out)
    # The graph exported with this call's values: one program per input signature.
    assert shown["call_index"] == 2 and re.fullmatch(rf"{HASH}/graph-[0-9a-f]{{16}}\.pt2",
                                                     shown["graph"]), shown["graph"]
    assert shown["graph_error"] is None

    # no compile cache here: auto falls back to the exported graph
    code, out = run_cli(capsys, "snapshot", "replay", bundle, "--cache-dir", str(tmp_path / "cc"))
    assert code == 0, out
    assert "runner: eager" in out and "PASS: 1 of 1" in out
    assert "MAX_ABS_ERR" in out and "COSINE" in out
    code, out = run_cli(capsys, "snapshot", "replay", bundle, "--runner", "cache",
                        "--cache-dir", str(tmp_path / "cc"))  # fmt: skip
    assert code == 1 and "NOT RUN: no compile cache" in out

    perturb(root, f"{HASH}/rank0/call2")
    code, out = run_cli(capsys, "snapshot", "replay", bundle, "--runner", "eager")
    assert code == 1
    assert "FAIL" in out
    code, out = run_cli(capsys, "snapshot", "replay", bundle, "--runner", "eager", "--json")
    (report,) = json.loads(out)
    assert code == 1 and not report["passed"]
    assert report["outputs"][0]["max_abs_err"] > 0 and report["outputs"][0]["cosine"] < 1


def test_tensor_parallel_capture_replays_every_rank(
    tmp_path: Path, capturer_for: CapturerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "tp"
    capture_tp(str(root), capturer_for, ranks=2)
    # Both ranks' calls have one signature (same shapes): one exported graph.
    names = sorted(p.name for p in (root / HASH).iterdir())
    assert names[1:] == ["rank0", "rank1"] and re.fullmatch(r"graph-[0-9a-f]{16}\.pt2", names[0])
    code, out = run_cli(capsys, "snapshot", "replay", str(root / HASH), "--runner", "eager")
    assert code == 0 and "PASS: 2 of 2" in out
    assert "(rank 0, call 2" in out and "(rank 1, call 2" in out
    perturb(root, f"{HASH}/rank1/call2", index=1)  # only rank 1's weight shard
    code, out = run_cli(capsys, "snapshot", "replay", HASH, "--root", str(root),
                        "--runner", "eager")  # fmt: skip
    assert code == 1 and "FAIL: 1 of 2" in out


def test_replay_from_memory_url(
    memory_root: str, capturer_for: CapturerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    capture_tp(memory_root, capturer_for, ranks=1, fmt="pt")
    code, out = run_cli(capsys, "snapshot", "ls", memory_root)
    assert code == 0 and "1 bundles" in out
    code, out = run_cli(capsys, "snapshot", "replay", f"{memory_root}/{HASH}/rank0/call2",
                        "--runner", "eager")  # fmt: skip
    assert code == 0, out


def test_replay_from_s3(
    s3_env: str, s3_store_url: str, capturer_for: CapturerFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    capture_tp(s3_store_url, capturer_for, ranks=2, fmt="safetensors")
    code, out = run_cli(capsys, "snapshot", "ls", s3_store_url, "--json")
    assert len(json.loads(out)["bundles"]) == 2
    url = f"{s3_store_url}/{HASH}"
    code, out = run_cli(capsys, "snapshot", "replay", url, "--runner", "eager")
    assert code == 0 and "PASS: 2 of 2" in out, out


def test_locate_forms(tmp_path: Path, memory_root: str) -> None:
    (tmp_path / "r").mkdir()
    store, prefix = locate(str(tmp_path / "r" / HASH / "rank3" / "call1"))
    assert store.url.endswith("/r") and prefix == f"{HASH}/rank3/call1"
    store, prefix = locate(str(tmp_path / "r" / HASH) + "/")
    assert prefix == HASH
    store, prefix = locate(str(tmp_path / "r"))
    assert prefix == ""
    store, prefix = locate(f"{memory_root}/{HASH}/rank0")
    assert store.url == memory_root and prefix == f"{HASH}/rank0"
    store, prefix = locate(f"{HASH}/rank0/call4", root=str(tmp_path / "r"))
    assert prefix == f"{HASH}/rank0/call4"


def test_replay_of_a_non_bundle_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call = tmp_path / HASH / "rank0" / "call0"
    call.mkdir(parents=True)
    code, out = run_cli(capsys, "snapshot", "replay", str(call))
    assert code == 2 and "no snapshot bundle" in out


# The comparison -----------------------------------------------------------------------------------


def test_metrics_are_exact_on_known_values() -> None:
    expected = torch.tensor([1.0, 2.0, 0.0, -4.0])
    actual = torch.tensor([1.0, 2.5, 0.0, -4.0])
    (c,) = compare_outputs([actual], [expected], atol=0.1, rtol=0.1)
    assert c.max_abs_err == pytest.approx(0.5)
    assert c.max_rel_err == pytest.approx(0.25)
    dot = 1 + 5 + 16
    assert c.cosine == pytest.approx(dot / (math.sqrt(1 + 6.25 + 16) * math.sqrt(21)))
    assert not c.passed and c.mismatched == 1
    (c,) = compare_outputs([actual], [expected], atol=0.0, rtol=0.25)
    assert c.passed


def test_default_tolerances_are_per_dtype() -> None:
    e = torch.ones(4, dtype=torch.bfloat16)
    (c,) = compare_outputs([e * 1.0078125], [e])  # one bf16 ulp: within bf16's rtol
    assert c.passed and c.rtol == pytest.approx(1.6e-2)
    f = torch.ones(4)
    (c,) = compare_outputs([f * 1.001], [f])
    assert not c.passed  # float32's default rtol is 1.3e-6
    i = torch.arange(4)
    (c,) = compare_outputs([i + torch.tensor([0, 0, 0, 1])], [i])
    assert not c.passed and (c.atol, c.rtol) == (0.0, 0.0)


def test_nan_inf_shape_and_dtype_handling() -> None:
    nan, inf = float("nan"), float("inf")
    e = torch.tensor([nan, inf, 1.0])
    (c,) = compare_outputs([torch.tensor([nan, inf, 1.0])], [e])
    assert c.passed and c.max_abs_err == 0.0
    (c,) = compare_outputs([torch.tensor([1.0, inf, 1.0])], [e])
    assert not c.passed and c.max_abs_err == inf
    (c,) = compare_outputs([torch.zeros(2, 2)], [torch.zeros(4)])
    assert not c.passed and "shape" in (c.problem or "")
    (c,) = compare_outputs([torch.zeros(4, dtype=torch.float16)], [torch.zeros(4)])
    assert not c.passed and "dtype" in (c.problem or "")
    (c,) = compare_outputs([torch.zeros(0)], [torch.zeros(0)])
    assert c.passed and c.cosine == 1.0


def test_replay_of_a_bundle_without_outputs_fails(
    memory_root: str, capturer_for: CapturerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_neuron.snapshot.meta import META_FILE, decode_call_meta

    capture_tp(memory_root, capturer_for, ranks=1)
    store = open_store(memory_root)
    key = f"{HASH}/rank0/call2/{META_FILE}"
    meta = decode_call_meta(store.read(key) or b"")
    import msgspec

    from vllm_neuron.backends import encode

    store.write(key, encode(msgspec.structs.replace(meta, outputs=[])))
    code, out = run_cli(capsys, "snapshot", "replay", f"{memory_root}/{HASH}/rank0/call2",
                        "--runner", "eager")  # fmt: skip
    assert code == 1 and "no captured outputs" in out


