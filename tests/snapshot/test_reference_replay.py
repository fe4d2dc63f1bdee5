"""The reference ("eager") replay of graphs the way vLLM hands them over: the batch size as a
``SymInt`` input while tracing (an ``int`` at run time), shape tuples and None among the
inputs. Each captured call gets a saved graph specialised to its own values; a graph that
cannot be saved says why, in ``meta.json`` and in the replay; nothing that did not run is
counted as a mismatch (issue 41)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from snapshot_helpers import HASH, ctx, make_config

from vllm_neuron.cli import main
from vllm_neuron.snapshot import RankInfo, forward_context


class TracedGraph:
    """What the compile runtime hands a wrapper: the FX graph dynamo traced with its example
    inputs (``SymInt`` for a dynamic size), and the artifact's identity."""

    def __init__(self, key: str, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
        self.key = key
        self.gm = gm
        self.example_inputs = example_inputs
        self.artifact = type("A", (), {"toolchain": "host", "target": "cpu-inductor"})()


def piece(x: torch.Tensor, w: torch.Tensor, shape: tuple[int, int], bias: Any) -> torch.Tensor:
    """A vLLM-like piece: the batch size is read from ``x`` (a SymInt input once traced with
    dynamic shapes), a shape tuple and None are passed positionally."""
    h = torch.tanh(x @ w).reshape(x.shape[0], *shape[1:])
    return h if bias is None else h + bias


def shaped(x: torch.Tensor, w: torch.Tensor, shape: tuple[int, int], unused: Any) -> Any:
    """A graph taking a shape tuple and an input vLLM passes as None."""
    return torch.tanh(x @ w).reshape(shape[0], shape[1])


def trace_dynamic(fn: Any, *args: Any) -> TracedGraph:
    """The graph and example inputs dynamo gives a backend with dynamic shapes."""
    traced: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        traced.update(gm=gm, example_inputs=list(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    assert any(isinstance(e, torch.SymInt) for e in traced["example_inputs"])
    return TracedGraph(HASH, traced["gm"], traced["example_inputs"])


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def capture_calls(root: Path, capturer_for: Any, graph: TracedGraph,
                  batches: tuple[int, ...]) -> list[dict[str, Any]]:  # fmt: skip
    """Capture every call of ``graph`` (one per batch size) through the real capturer with
    the graph's own inputs: the gm called with concrete ints, as at run time."""
    cfg = make_config(str(root), CAPTURE_AT_CALL="-1", MAX_CAPTURES="16")
    capturer = capturer_for(cfg, rank=RankInfo(), graph=graph)
    fn = capturer.wrap(graph.gm.forward)
    gen = torch.Generator().manual_seed(0)
    # A weight as vLLM passes it: a parameter with a local function hung on it (its loader).
    w = torch.nn.Parameter(torch.randn(8, 8, generator=gen), requires_grad=False)
    w.weight_loader = lambda param, loaded: param.data.copy_(loaded)  # type: ignore[attr-defined]
    for step, batch in enumerate(batches):
        x = torch.randn(batch, 8, generator=gen)
        args = [a if not isinstance(a, torch.SymInt) else batch for a in
                _run_args(graph, x, w)]  # fmt: skip
        with forward_context(ctx(step, ["r"], [step], True, config=cfg)):
            fn(*args)
    metas = sorted((root / HASH / "rank0").glob("call*/meta.json"))
    return [json.loads(p.read_text()) for p in metas]


def _run_args(graph: TracedGraph, x: torch.Tensor, w: torch.Tensor) -> list[Any]:
    """The gm's positional inputs for this call, in its placeholder order (by name)."""
    values: list[Any] = []
    for node in graph.gm.graph.find_nodes(op="placeholder"):
        example = node.meta.get("example_value")
        if isinstance(example, torch.SymInt):
            values.append(example)
        elif "x" in node.name:
            values.append(x)
        elif "w" in node.name:
            values.append(w)
        else:
            raise AssertionError(f"unexpected placeholder {node.name}")
    return values


def test_every_call_of_a_dynamic_graph_has_a_reference_graph_and_replays_eagerly(
    tmp_path: Path, capturer_for: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = torch.Generator().manual_seed(1)
    graph = trace_dynamic(lambda x, w: piece(x, w, (x.shape[0], 8), None),
                          torch.randn(3, 8, generator=gen), torch.randn(8, 8, generator=gen))
    root = tmp_path / "snaps"
    metas = capture_calls(root, capturer_for, graph, batches=(3, 5, 3))
    assert len(metas) == 3
    # The batch size reached the capture as an int input and is kept as a scalar.
    assert all(any(s["kind"] == "scalar" for s in m["inputs"]) for m in metas)
    # Every bundle names a saved graph; two batch sizes, two programs, the third call's the
    # first's (same signature).
    graphs = [m["graph"] for m in metas]
    assert all(g and re.fullmatch(rf"{HASH}/graph-[0-9a-f]{{16}}\.pt2", g) for g in graphs)
    assert graphs[0] == graphs[2] != graphs[1]
    assert all(m["graph_error"] is None for m in metas)
    code, out = run_cli(capsys, "snapshot", "replay", str(root / HASH), "--runner", "eager")
    assert code == 0, out
    assert "PASS: 3 of 3 bundles match" in out and "runners: eager for 3" in out
    # A bundle replayed with another signature's graph would not run: the programs really
    # are specialised (what the per-signature file is for).
    other = root / HASH / "rank0" / "call1" / "meta.json"
    meta = json.loads(other.read_text())
    other.write_text(json.dumps({**meta, "graph": graphs[0]}))
    code, out = run_cli(capsys, "snapshot", "replay", str(root / HASH / "rank0" / "call1"),
                        "--runner", "eager")  # fmt: skip
    assert code == 1 and "NOT RUN: running it with the eager runner failed" in out, out
    assert "Traceback" not in out, out


def test_shape_tuples_and_none_are_stored_and_replayed(
    tmp_path: Path, capturer_for: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    gm = torch.fx.symbolic_trace(shaped)
    graph = TracedGraph(HASH, gm, [torch.zeros(2, 8), torch.zeros(8, 8), (2, 8), None])
    cfg = make_config(str(tmp_path / "snaps"), CAPTURE_AT_CALL="0")
    fn = capturer_for(cfg, rank=RankInfo(), graph=graph).wrap(gm.forward)
    gen = torch.Generator().manual_seed(2)
    with forward_context(ctx(0, ["r"], [0], True, config=cfg)):
        fn(torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen), (4, 8), None)
    bundle = tmp_path / "snaps" / HASH / "rank0" / "call0"
    meta = json.loads((bundle / "meta.json").read_text())
    assert [(s["kind"], s["value"], s["container"]) for s in meta["inputs"][2:]] == [
        ("sequence", [4, 8], "tuple"), ("scalar", None, None)]
    assert meta["graph"] and meta["graph_error"] is None
    code, out = run_cli(capsys, "snapshot", "replay", str(bundle), "--runner", "eager")
    assert code == 0 and "PASS: 1 of 1" in out, out


def test_a_value_a_snapshot_cannot_hold_fails_the_forward_naming_it(
    tmp_path: Path, capturer_for: Any
) -> None:
    from vllm_neuron.snapshot import SnapshotCaptureError

    gm = torch.fx.symbolic_trace(shaped)
    graph = TracedGraph(HASH, gm, [])
    cfg = make_config(str(tmp_path / "snaps"), CAPTURE_AT_CALL="0")
    fn = capturer_for(cfg, rank=RankInfo(), graph=graph).wrap(gm.forward)
    with forward_context(ctx(0, ["r"], [0], True, config=cfg)), pytest.raises(
            SnapshotCaptureError, match=r"tensor2 is a tuple; snapshots hold"):
        fn(torch.zeros(2, 8), torch.zeros(8, 8), ((2,), 8), None)  # nested: not a shape
    assert not (tmp_path / "snaps" / HASH / "rank0" / "call0").exists()


# A graph that cannot be exported: its op has no fake implementation, so torch.export
# cannot trace it (a real reason, not a simulated one).
@torch.library.custom_op("vllm_neuron_test::opaque_scale", mutates_args=())
def opaque_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Opaque(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm_neuron_test.opaque_scale(x) + 1


def test_a_graph_that_cannot_be_saved_is_named_with_its_reason(
    tmp_path: Path, capturer_for: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    gm = torch.fx.symbolic_trace(Opaque())
    graph = TracedGraph(HASH, gm, [torch.zeros(2, 4)])
    root = tmp_path / "snaps"
    cfg = make_config(str(root), CAPTURE_AT_CALL="0")
    fn = capturer_for(cfg, rank=RankInfo(), graph=graph).wrap(gm.forward)
    with forward_context(ctx(0, ["r"], [0], True, config=cfg)):
        out = fn(torch.ones(2, 4))
    assert torch.equal(out, torch.full((2, 4), 3.0))  # the forward is served
    bundle = root / HASH / "rank0" / "call0"
    meta = json.loads((bundle / "meta.json").read_text())
    assert meta["graph"] is None
    reason = meta["graph_error"]
    assert reason and "opaque_scale" in reason, reason
    assert not list((root / HASH).glob("graph*.pt2"))
    code, out = run_cli(capsys, "snapshot", "show", str(bundle))
    assert code == 0 and "(not saved: " in out and "opaque_scale" in out, out
    code, out = run_cli(capsys, "snapshot", "replay", str(bundle), "--runner", "eager")
    assert code == 1
    assert "NOT RUN: the capture could not save the graph of" in out and "opaque_scale" in out
    assert "FAIL: none of the 1 bundles was replayed, so nothing was compared" in out
    assert "0 of 1" not in out
    # auto with no cache entry: both reasons, never a mismatch.
    code, out = run_cli(capsys, "snapshot", "replay", str(bundle), "--cache-dir",
                        str(tmp_path / "no-cache"))  # fmt: skip
    assert code == 1 and "no compile cache" in out and "opaque_scale" in out, out
    assert "1 could not be replayed" in out


def test_the_reference_tolerance_allows_rounding_at_the_tensors_scale_not_more() -> None:
    """The eager runner's allowance (docs/snapshots.md): REFERENCE_ULPS units in the last
    place of the output's largest value, on top of the dtype's defaults."""
    from vllm_neuron.snapshot.compare import REFERENCE_ULPS, compare_outputs

    expected = torch.tensor([4.0, 1e-3, -2.0], dtype=torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps
    # Near a cancellation: one unit at the tensor's scale (4.0) on an element near zero.
    rounded = expected.clone()
    rounded[1] += 4.0 * eps
    (same,) = compare_outputs([rounded], [expected])
    (ref,) = compare_outputs([rounded], [expected], reference=True)
    assert not same.passed and ref.passed
    assert ref.atol == pytest.approx(1e-5 + REFERENCE_ULPS * eps * 4.0)
    # Beyond the allowance: a real divergence still fails the reference comparison.
    wrong = expected.clone()
    wrong[1] += 2 * REFERENCE_ULPS * eps * 4.0
    (bad,) = compare_outputs([wrong], [expected], reference=True)
    assert not bad.passed and bad.mismatched == 1
    # Integers stay exact; explicit tolerances replace the allowance.
    (ints,) = compare_outputs([torch.tensor([1, 3])], [torch.tensor([1, 2])], reference=True)
    assert not ints.passed and ints.atol == 0.0
    (given,) = compare_outputs([rounded], [expected], atol=0.0, rtol=0.0, reference=True)
    assert not given.passed and given.atol == 0.0


def test_a_graph_error_someone_else_wrote_is_quoted_not_obeyed(
    tmp_path: Path, capturer_for: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """meta.json is anyone's file: its graph_error reaches the terminal escaped."""
    gm = torch.fx.symbolic_trace(Opaque())
    root = tmp_path / "snaps"
    cfg = make_config(str(root), CAPTURE_AT_CALL="0")
    fn = capturer_for(cfg, rank=RankInfo(), graph=TracedGraph(HASH, gm, [])).wrap(gm.forward)
    with forward_context(ctx(0, ["r"], [0], True, config=cfg)):
        fn(torch.ones(2, 4))
    meta_file = root / HASH / "rank0" / "call0" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "graph_error": "\x1b[2J\x1b[31mwiped\rok"}))
    for argv in (("show",), ("replay", "--runner", "eager")):
        _, out = run_cli(capsys, "snapshot", *argv, str(meta_file.parent))
        assert "\x1b" not in out and "\r" not in out, out
        assert "\\x1b[2J" in out, out
