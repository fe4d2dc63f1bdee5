"""Bundles written by the Neuron plugin are read: ``meta.json`` upcast, ls/show/replay.

The fixture (`plugin_bundle`, files under ``data/neuron_plugin/``) is written exactly in the
plugin's form with numpy and json. Bundles written by our own capturer must still read the
same as before (round trip).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from plugin_bundle import (
    CALL_INDEX,
    DATA_ROOT,
    PLUGIN_HASH,
    POSITIONS,
    REQ_IDS,
    TARGET,
    plugin_inputs,
    write_plugin_bundle,
    write_plugin_call,
)
from snapshot_helpers import ctx, make_config

from vllm_neuron.backends import encode, open_store
from vllm_neuron.backends.records import RecordError
from vllm_neuron.cli import main
from vllm_neuron.snapshot import SnapshotCapturer, forward_context
from vllm_neuron.snapshot.bundles import list_bundles, load_bundle
from vllm_neuron.snapshot.meta import (
    PLUGIN_WRITER,
    CallMeta,
    InputSpec,
    MatchRecord,
    decode_call_meta,
    read_call_meta,
)
from vllm_neuron.snapshot.replay import replay

CapturerFactory = Callable[..., SnapshotCapturer]  # the capturer_for fixture
PREFIX = f"{PLUGIN_HASH}/rank1/call{CALL_INDEX}"


@pytest.fixture
def plugin_root(tmp_path: Path) -> Path:
    """A copy of the checked-in plugin bundles (two tp ranks of one call)."""
    root = tmp_path / "snapshots"
    shutil.copytree(DATA_ROOT, root)
    return root


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_fixture_files_are_what_the_plugin_form_writes(tmp_path: Path) -> None:
    """The checked-in files are byte for byte what numpy + json write in the plugin's form."""
    write_plugin_bundle(str(tmp_path))
    ours = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    theirs = sorted(p.relative_to(DATA_ROOT) for p in Path(DATA_ROOT).rglob("*") if p.is_file())
    assert ours == theirs and len(ours) == 12
    for rel in ours:
        assert (tmp_path / rel).read_bytes() == (Path(DATA_ROOT) / rel).read_bytes(), rel
    raw = json.loads((Path(DATA_ROOT) / PREFIX / "meta.json").read_text())
    assert "type" not in raw and "v" not in raw and raw["schema"] == 1
    assert all(set(i) == {"index", "dtype", "shape"} for i in raw["inputs"])


def test_plugin_meta_is_upcast() -> None:
    meta = decode_call_meta((Path(DATA_ROOT) / PREFIX / "meta.json").read_bytes())
    assert meta.v == 1 and meta.from_plugin and meta.writer == PLUGIN_WRITER
    assert meta.compilation_hash == PLUGIN_HASH and meta.format == "npy"
    assert (meta.global_rank, meta.tp_rank, meta.dp_rank, meta.call_index) == (1, 1, 0, 3)
    assert meta.selected_by == ["call", "token"]  # the plugin's call_index rule is our call
    assert meta.global_step == 17 and meta.is_prompt is False
    assert meta.req_ids == REQ_IDS and meta.positions == POSITIONS
    assert meta.inputs == [
        InputSpec(index=0, kind="tensor", file="tensor0.npy", dtype="int64", shape=[2, 1],
                  nbytes=16),
        InputSpec(index=1, kind="tensor", file="tensor1.npy", dtype="int32", shape=[2], nbytes=8),
        InputSpec(index=2, kind="tensor", file="tensor2.npy", dtype="bfloat16", shape=[2, 8],
                  nbytes=32),
        InputSpec(index=3, kind="tensor", file="tensor3.npy", dtype="float8_e4m3fn", shape=[4],
                  nbytes=4),
        InputSpec(index=4, kind="tensor", file="tensor4.npy", dtype="bool", shape=[2], nbytes=2),
    ]  # fmt: skip
    # the plugin's token match records the target; the row's position is in `positions`
    assert meta.matches == [MatchRecord(rule="token", row=1, req_id=REQ_IDS[1], position=12,
                                        target=TARGET, offset=1)]  # fmt: skip
    assert meta.outputs == [] and meta.graph is None and meta.toolchain is None
    assert (meta.num_speculative_tokens, meta.created, meta.pid) == (0, 0.0, 0)
    # once read, it is our record: it encodes and decodes as ours
    assert decode_call_meta(encode(meta)) == meta


def test_plugin_meta_minimal_and_null_fields() -> None:
    """A call-index capture without a forward context: nulls and empty lists, as the plugin
    writes them; a request match keeps its position."""
    raw = {"schema": 1, "hash": "ab" * 8, "format": "pt", "global_rank": 0, "tp_rank": 0,
           "dp_rank": 0, "call_index": 0, "selected_by": ["call_index"], "inputs": [],
           "global_step": None, "is_prompt": None, "matches": [], "req_ids": [],
           "positions": []}  # fmt: skip
    meta = decode_call_meta(json.dumps(raw).encode())
    assert meta.global_step is None and meta.is_prompt is None and meta.inputs == []
    # fields the plugin might leave out entirely take the documented defaults
    for key in ("schema", "inputs", "global_step", "is_prompt", "matches", "req_ids",
                "positions"):  # fmt: skip
        del raw[key]
    meta = decode_call_meta(json.dumps(raw).encode())
    assert (meta.global_step, meta.is_prompt, meta.matches, meta.req_ids) == (None, None, [], [])
    raw.update(is_prompt=True, req_ids=["abc-12345678"], positions=[0, 1, 2],
               matches=[{"batch_index": 0, "request_id": "abc-12345678", "position": -1,
                         "reason": "request"}])  # fmt: skip
    (match,) = decode_call_meta(json.dumps(raw).encode()).matches
    assert match == MatchRecord(rule="request", row=0, req_id="abc-12345678", position=-1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": 2}, "schema 2 is not supported"),
        ({"global_rank": "one"}, "$.global_rank"),
        ({"format": "tar"}, "format 'tar' is not a snapshot format"),
        ({"inputs": [{"index": 0, "shape": [1]}]}, "missing required field `dtype`"),
        ({"hash": None}, "$.hash"),
    ],
)
def test_bad_plugin_meta_is_refused_naming_why(change: dict[str, object], message: str) -> None:
    raw = json.loads((Path(DATA_ROOT) / PREFIX / "meta.json").read_text())
    raw.update(change)
    with pytest.raises(RecordError, match="^meta.json: no record tag, so it was read as the "
                       "Neuron plugin's form, and is not that either") as info:
        decode_call_meta(json.dumps(raw).encode())
    assert message in str(info.value)


def test_our_tagged_record_is_not_taken_for_the_plugin_form() -> None:
    with pytest.raises(RecordError, match="^meta.json: not a valid snapshot-call record: "
                       "Object missing required field `compilation_hash`"):
        decode_call_meta(b'{"type": "snapshot-call", "v": 1, "hash": "x"}')
    with pytest.raises(RecordError, match="^meta.json: not a JSON object"):
        decode_call_meta(b"[1, 2]")


def test_plugin_tensors_load_bit_exact(plugin_root: Path) -> None:
    bundle = load_bundle(open_store(str(plugin_root), create=False), PREFIX)
    loaded = bundle.load_inputs()
    stored = plugin_inputs(1)
    assert [str(t.dtype) for t in loaded] == [d for d, _ in stored]
    for tensor, (_, arr) in zip(loaded, stored, strict=True):
        assert tuple(tensor.shape) == arr.shape
        if arr.dtype.kind == "V":  # raw bf16/fp8 bytes: compare the bits
            assert tensor.contiguous().view(torch.uint8).numpy().tobytes() == arr.tobytes()
        else:
            assert np.array_equal(tensor.numpy(), arr)
    assert loaded[3].float().tolist() == [1.0, 2.0, -1.0, 0.5]


def test_ls_show_on_plugin_bundles(plugin_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listing = list_bundles(open_store(str(plugin_root), create=False))
    assert [b.prefix for b in listing.bundles] == [
        f"{PLUGIN_HASH}/rank0/call3", f"{PLUGIN_HASH}/rank1/call3"]
    assert not listing.unreadable and not listing.incomplete
    code, out = run_cli(capsys, "snapshot", "ls", str(plugin_root))
    assert code == 0 and "2 bundles" in out
    assert "call,token" in out and "5/0" in out and "decode" in out

    code, out = run_cli(capsys, "snapshot", "show", str(plugin_root / PREFIX))
    assert code == 0, out
    assert "writer: neuron-plugin" in out and "written by the Neuron plugin" in out
    assert f"match         token: row 1 {REQ_IDS[1]} @12 target 13 (offset 1)" in out
    assert "tensor2.npy" in out and "bfloat16" in out and "2x8" in out
    code, out = run_cli(capsys, "snapshot", "show", PLUGIN_HASH, "--root", str(plugin_root),
                        "--json")  # fmt: skip
    shown = json.loads(out)
    assert [b["global_rank"] for b in shown] == [0, 1]
    assert shown[1]["compilation_hash"] == PLUGIN_HASH and shown[1]["outputs"] == []


def test_ls_and_show_unknown_step_and_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = plugin_inputs(0)[:1]
    meta = {"schema": 1, "hash": PLUGIN_HASH, "format": "npy", "global_rank": 0, "tp_rank": 0,
            "dp_rank": 0, "call_index": 0, "selected_by": ["call_index"],
            "inputs": [{"index": 0, "dtype": inputs[0][0], "shape": list(inputs[0][1].shape)}],
            "global_step": None, "is_prompt": None, "matches": [], "req_ids": [],
            "positions": []}  # fmt: skip
    write_plugin_call(str(tmp_path / PLUGIN_HASH / "rank0" / "call0"), meta, [inputs[0][1]])
    code, out = run_cli(capsys, "snapshot", "ls", str(tmp_path))
    assert code == 0
    (row,) = [line for line in out.splitlines() if line.startswith(PLUGIN_HASH[:12])]
    assert row.split()[4:6] == ["-", "-"] and row.split()[-1] == "-"  # step, phase; age
    code, out = run_cli(capsys, "snapshot", "show", str(tmp_path / PLUGIN_HASH / "rank0/call0"))
    assert code == 0 and "call          0 (step -, -)" in out


def test_replay_says_what_the_plugin_bundle_lacks(
    plugin_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(str(plugin_root), create=False)
    reports = list(replay(store, PLUGIN_HASH).values())
    assert len(reports) == 2 and not any(r.passed for r in reports)
    problem = reports[1].problem or ""
    assert problem.startswith(f"cannot replay {plugin_root}/{PREFIX}: ")
    assert "written by the Neuron plugin" in problem
    assert "no captured outputs (output<j>.npy" in problem
    assert f"no exported graph ({PLUGIN_HASH}/graph.pt2)" in problem
    assert "its 5 inputs load" in problem

    code, out = run_cli(capsys, "snapshot", "replay", str(plugin_root / PREFIX))
    assert code == 1 and "Traceback" not in out
    assert f"NOT RUN: cannot replay {plugin_root}/{PREFIX}" in out
    # Nothing ran: never reported as "0 of 1 match".
    assert "FAIL: none of the 1 bundles was replayed, so nothing was compared" in out
    assert "0 of 1" not in out
    code, out = run_cli(capsys, "snapshot", "replay", str(plugin_root / PREFIX), "--json")
    (report,) = json.loads(out)
    assert code == 1 and report["passed"] is False and "no exported graph" in report["problem"]

    # a graph put next to the bundle removes that item; a broken tensor file is named
    (plugin_root / PLUGIN_HASH / "graph.pt2").write_bytes(b"not used")
    (plugin_root / PREFIX / "tensor2.npy").write_bytes(b"garbage")
    (report,) = replay(store, PREFIX).values()
    assert report.problem is not None
    assert "no exported graph" not in report.problem and "no captured outputs" in report.problem
    assert "its inputs do not load either" in report.problem and "tensor2.npy" in report.problem


def test_replay_cli_in_a_fresh_process_prints_no_traceback(plugin_root: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "snapshot", "replay", str(plugin_root / PREFIX)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "cannot replay" in proc.stdout and "no captured outputs" in proc.stdout


# -- our own files still read --------------------------------------------------------------


def test_bundles_written_by_our_capturer_still_read(
    tmp_path: Path, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(str(tmp_path), CAPTURE_TOKEN="12", FORMAT="npy")
    cap = capturer_for(cfg)
    fn = cap.wrap(lambda x, n: (x * 2, x.sum() + n))
    with forward_context(ctx(2, ["a", "b"], [11, 3], True, config=cfg)):
        fn(torch.arange(6, dtype=torch.float32).reshape(2, 3), 4)
    (prefix,) = cap.captured
    store = open_store(str(tmp_path), create=False)
    data = store.read(f"{prefix}/meta.json")
    assert data is not None and b'"type": "snapshot-call"' in data
    meta = read_call_meta(store, prefix)
    assert meta is not None and not meta.from_plugin and meta.writer == "host"
    assert meta.global_step == 2 and meta.is_prompt is False
    assert [s.kind for s in meta.inputs] == ["tensor", "scalar"] and len(meta.outputs) == 2
    assert meta.matches == [MatchRecord(rule="token", row=0, req_id="a", position=11, target=12,
                                        offset=1)]  # fmt: skip
    assert decode_call_meta(data) == meta == decode_call_meta(encode(meta))
    assert msgspec.json.decode(data)["compilation_hash"] == meta.compilation_hash


def test_every_field_of_our_record_round_trips() -> None:
    meta = CallMeta(
        compilation_hash="cd" * 16, format="safetensors", global_rank=3, tp_rank=1, dp_rank=1,
        call_index=9, selected_by=["call", "request"],
        inputs=[InputSpec(index=0, kind="tensor", file="tensor0.safetensors", dtype="float16",
                          shape=[4], stride=[1], nbytes=8, device="cpu"),
                InputSpec(index=1, kind="scalar", value=2.5)],
        outputs=[InputSpec(index=0, kind="tensor", file="output0.safetensors", dtype="float16",
                           shape=[4], stride=[1], nbytes=8, device="cpu")],
        global_step=41, is_prompt=True, req_ids=["r-1"], positions=[0],
        matches=[MatchRecord(rule="request", row=0, req_id="r-1", position=0, request="r")],
        num_speculative_tokens=2, writer="neuron-runtime", toolchain="host",
        target="cpu-inductor", graph="cd/graph.pt2", created=1.5, pid=7,
    )  # fmt: skip
    assert decode_call_meta(encode(meta)) == meta
    assert not meta.from_plugin
