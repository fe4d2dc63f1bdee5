"""Capture: bundle layout and meta.json, every store, fail-loud, writers, zero cost when off."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from snapshot_helpers import HASH, ctx, make_config

from vllm_neuron.backends import Store, open_store
from vllm_neuron.snapshot import (
    CaptureBudget,
    HostTensorWriter,
    NeuronRuntimeWriter,
    RankInfo,
    SnapshotCaptureError,
    SnapshotCapturer,
    SnapshotConfig,
    SnapshotEncodingError,
    SnapshotForwardContext,
    default_writer,
    forward_context,
    install_snapshot_capture,
    read_call_meta,
)
from vllm_neuron.snapshot.bundles import list_bundles, load_bundle
from vllm_neuron.snapshot.encoding import FORMATS
from vllm_neuron.snapshot.tensor_writers import neuron_serialize_op

CapturerFactory = Callable[..., SnapshotCapturer]  # the capturer_for fixture

W = torch.randn(4, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))


def executable(x: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = (x @ w) * n
    return y, y.float().sum()


def run_decode(fn: Any, cfg: SnapshotConfig, steps: int, prompt_len: int = 10) -> list[Any]:
    """Drive ``steps`` forwards: one prefill, then decode steps."""
    inputs = []
    for step in range(steps):
        x = torch.full((1, 4), float(step), dtype=torch.bfloat16)
        pos = 0 if step == 0 else prompt_len + step - 1
        with forward_context(ctx(step, ["req-1-deadbeef"], [pos], step > 0, config=cfg)):
            fn(x, W, 3)
        inputs.append(x)
    return inputs


# Layout and meta.json ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_bundle_layout_and_meta(tmp_path: Path, capturer_for: CapturerFactory, fmt: str) -> None:
    root = tmp_path / "snaps"
    cfg = make_config(str(root), CAPTURE_TOKEN="12", FORMAT=fmt)
    cap = capturer_for(cfg, rank=RankInfo(global_rank=5, tp_rank=1, dp_rank=2))
    fn = cap.wrap(executable)
    inputs = run_decode(fn, cfg, steps=5)  # decode step k generates position 10 + k
    call = root / HASH / "rank5" / "call2"
    assert sorted(os.listdir(call)) == sorted(
        ["meta.json", f"tensor0.{fmt}", f"tensor1.{fmt}", f"output0.{fmt}", f"output1.{fmt}"]
    )
    meta = json.loads((call / "meta.json").read_text())
    assert meta["type"] == "snapshot-call" and meta["v"] == 1
    assert meta["compilation_hash"] == HASH and meta["format"] == fmt
    assert (meta["global_rank"], meta["tp_rank"], meta["dp_rank"]) == (5, 1, 2)
    assert meta["call_index"] == 2 and meta["global_step"] == 2
    assert meta["selected_by"] == ["token"] and meta["is_prompt"] is False
    assert meta["req_ids"] == ["req-1-deadbeef"] and meta["positions"] == [11]
    assert meta["matches"] == [{"rule": "token", "row": 0, "req_id": "req-1-deadbeef",
                                "position": 11, "target": 12, "offset": 1, "request": None}]
    assert [(i["kind"], i["dtype"], i["shape"]) for i in meta["inputs"]] == [
        ("tensor", "bfloat16", [1, 4]), ("tensor", "bfloat16", [4, 4]), ("scalar", None, None)
    ]  # fmt: skip
    assert meta["inputs"][2]["value"] == 3
    assert [(o["dtype"], o["shape"]) for o in meta["outputs"]] == [
        ("bfloat16", [1, 4]), ("float32", [])
    ]  # fmt: skip
    bundle = load_bundle(open_store(str(root)), f"{HASH}/rank5/call2")
    x, w, n = bundle.load_inputs()
    assert torch.equal(x, inputs[2]) and torch.equal(w, W) and n == 3
    y, s = bundle.load_outputs()
    ref_y, ref_s = executable(inputs[2], W, 3)
    assert torch.equal(y, ref_y) and torch.equal(s, ref_s)


def test_directory_is_named_by_call_index_not_by_rule(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_REQUEST="req-1")
    cap = capturer_for(cfg)
    fn = cap.wrap(executable)
    run_decode(fn, cfg, steps=3)
    assert [p.split("/")[-1] for p in cap.captured] == ["call0", "call1", "call2"]
    meta = read_call_meta(open_store(memory_root), cap.captured[1])
    assert meta is not None and meta.selected_by == ["request"]
    assert meta.matches[0].request == "req-1"


def test_earlier_bundle_at_the_same_call_is_replaced(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="0", FORMAT="npy")
    store = open_store(memory_root)
    # leftovers of an earlier run: a stray file that the new bundle does not have
    store.write(f"{HASH}/rank0/call0/tensor9.npy", b"old")
    store.write(f"{HASH}/rank0/call0/meta.json", b"{}")
    fn = capturer_for(cfg).wrap(executable)
    run_decode(fn, cfg, steps=1)
    files = {k.rsplit("/", 1)[1] for k in store.list(f"{HASH}/rank0/call0")}
    assert "tensor9.npy" not in files and "meta.json" in files


# Stores -------------------------------------------------------------------------------------------


def _capture_on(root: str, capturer_for: CapturerFactory) -> Store:
    cfg = make_config(root, CAPTURE_AT_CALL="0,2", FORMAT="npy")
    run_decode(capturer_for(cfg).wrap(executable), cfg, steps=3)
    return open_store(root)


def _check_bundles(store: Store) -> None:
    listing = list_bundles(store)
    assert [b.prefix for b in listing.bundles] == [f"{HASH}/rank0/call0", f"{HASH}/rank0/call2"]
    assert listing.incomplete == ()
    assert all(b.files == 5 and b.size > 0 for b in listing.bundles)
    x, w, n = load_bundle(store, f"{HASH}/rank0/call2").load_inputs()
    assert torch.equal(x, torch.full((1, 4), 2.0, dtype=torch.bfloat16)) and torch.equal(w, W)


def test_bundles_on_local_disk(tmp_path: Path, capturer_for: CapturerFactory) -> None:
    _check_bundles(_capture_on(str(tmp_path / "local"), capturer_for))


def test_bundles_in_memory(memory_root: str, capturer_for: CapturerFactory) -> None:
    _check_bundles(_capture_on(memory_root, capturer_for))


def test_bundles_on_s3(s3_env: str, s3_store_url: str, capturer_for: CapturerFactory) -> None:
    _check_bundles(_capture_on(s3_store_url, capturer_for))


# Fail-loud ----------------------------------------------------------------------------------------


def test_unwritable_target_aborts_the_forward(
    tmp_path: Path, capturer_for: CapturerFactory
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # root can write anywhere; a file in the path stops it
    cfg = make_config(str(blocker / "snaps"), CAPTURE_AT_CALL="0")
    budget = CaptureBudget(4)
    calls: list[int] = []

    def counted(*args: Any) -> Any:
        calls.append(1)
        return executable(*args)

    fn = capturer_for(cfg, budget=budget).wrap(counted)
    with pytest.raises(SnapshotCaptureError, match="snaps"):
        run_decode(fn, cfg, steps=1)
    assert calls == []  # the executable never ran: the forward was aborted
    assert budget.consumed == 0 and budget.remaining == 4


class FailingWriter:
    """Writes the first file, then fails with ``error`` - as a full disk or a dying device."""

    name = "failing"

    def __init__(self, error: OSError) -> None:
        self.error = error
        self.calls = 0

    def write(self, store: Store, prefix: str, items: Sequence[tuple[str, Any]], fmt: Any) -> None:
        self.calls += 1
        HostTensorWriter().write(store, prefix, items[:1], fmt)
        raise self.error


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_failing_device_write_aborts_the_forward_and_leaves_no_bundle(
    where: str, tmp_path: Path, memory_root: str, capturer_for: CapturerFactory
) -> None:
    root = str(tmp_path / "s") if where == "local" else memory_root
    cfg = make_config(root, CAPTURE_AT_CALL="0")
    budget = CaptureBudget(4)
    writer = FailingWriter(OSError(errno.EIO, "Input/output error"))
    fn = capturer_for(cfg, budget=budget, writer=writer).wrap(executable)
    with pytest.raises(SnapshotCaptureError, match="Input/output error") as info:
        run_decode(fn, cfg, steps=1)
    assert "no bundle was left" in str(info.value)
    store = open_store(root)
    assert store.list() == []  # the file written before the failure was removed
    assert list_bundles(store).bundles == ()
    assert budget.consumed == 0 and budget.stopped is None


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_snapshot_root_that_cannot_take_files_serves_the_forward_and_stops_capture(
    code: int, tmp_path: Path, capturer_for: CapturerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(tmp_path / "s")
    cfg = make_config(root, CAPTURE_AT_CALL="-1")
    budget = CaptureBudget(4)
    writer = FailingWriter(OSError(code, os.strerror(code), os.path.join(root, "x")))
    calls: list[int] = []

    def counted(*args: Any) -> Any:
        calls.append(1)
        return executable(*args)

    fn = capturer_for(cfg, budget=budget, writer=writer).wrap(counted)
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.snapshot"):
        run_decode(fn, cfg, steps=3)  # every forward is served
    assert len(calls) == 3
    assert writer.calls == 1  # capture stopped after the first fault: no retry per forward
    assert open_store(root).list() == []  # nothing half-written
    assert budget.consumed == 0 and budget.stopped is not None
    said = [r.getMessage() for r in caplog.records if "bypassed" in r.getMessage()]
    assert len(said) == 1, said
    assert "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR" in said[0] and root in said[0], said


def test_failing_meta_write_leaves_no_bundle(
    memory_root: str, capturer_for: CapturerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="0")
    cap = capturer_for(cfg)
    store = cap.spec.store()
    real_write = type(store).write

    def write(self: Store, key: str, data: bytes) -> None:
        if key.endswith("meta.json"):
            raise OSError("connection reset")
        real_write(self, key, data)

    monkeypatch.setattr(type(store), "write", write)
    with pytest.raises(SnapshotCaptureError, match="meta.json"):
        run_decode(cap.wrap(executable), cfg, steps=1)
    monkeypatch.undo()
    assert store.list() == []


def test_failing_executable_leaves_no_bundle_and_keeps_its_error(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="0")
    budget = CaptureBudget(1)

    def broken(*args: Any) -> Any:
        raise ValueError("device error")

    fn = capturer_for(cfg, budget=budget).wrap(broken)
    with pytest.raises(ValueError, match="device error"):
        run_decode(fn, cfg, steps=1)
    assert open_store(memory_root).list() == [] and budget.remaining == 1


def test_unsupported_dtype_raises_before_anything_is_written(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="0", FORMAT="npy")
    fn = capturer_for(cfg).wrap(lambda x: x)
    with forward_context(SnapshotForwardContext(step=0)), pytest.raises(
        SnapshotEncodingError, match="FORMAT=pt"
    ):
        fn(torch.zeros(2, dtype=torch.complex32))
    assert open_store(memory_root).list() == []


def test_non_tensor_inputs_are_refused(memory_root: str, capturer_for: CapturerFactory) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="0")
    fn = capturer_for(cfg).wrap(lambda x, obj: x)
    with forward_context(SnapshotForwardContext(step=0)), pytest.raises(
        SnapshotCaptureError, match="tensor1 is a object"
    ):
        fn(torch.zeros(2), object())


# Writers ------------------------------------------------------------------------------------------


def test_default_writer_is_the_host_writer_without_the_neuron_op() -> None:
    assert neuron_serialize_op() is None  # no Neuron runtime here: detected, not faked
    assert isinstance(default_writer(), HostTensorWriter)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_neuron_runtime_writer_contract(
    where: str, tmp_path: Path, memory_root: str, capturer_for: CapturerFactory
) -> None:
    """The op gets (tensors, call_dir, format, file names) and writes into call_dir; on a
    store without local paths its files are uploaded from a scratch directory."""
    seen: list[tuple[int, str, str]] = []

    def fake_op(tensors: list[torch.Tensor], call_dir: str, fmt: Any, names: list[str]) -> None:
        seen.append((len(tensors), os.path.basename(call_dir), fmt))
        for t, name in zip(tensors, names, strict=True):
            HostTensorWriter().write(open_store(call_dir), "", [(name, t)], fmt)

    root = str(tmp_path / "n") if where == "local" else memory_root
    cfg = make_config(root, CAPTURE_AT_CALL="0", FORMAT="npy")
    cap = capturer_for(cfg, writer=NeuronRuntimeWriter(fake_op))
    run_decode(cap.wrap(executable), cfg, steps=1)
    assert seen[0][0] == 2 and seen[0][2] == "npy"
    if where == "local":
        assert seen[0][1] == "call0"
    bundle = load_bundle(open_store(root), cap.captured[0])
    assert bundle.meta.writer == "neuron-runtime"
    assert torch.equal(bundle.load_inputs()[1], W)


def test_neuron_writer_that_skips_a_file_fails_the_capture(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="0")
    cap = capturer_for(cfg, writer=NeuronRuntimeWriter(lambda *a: None))
    with pytest.raises(SnapshotCaptureError, match="did not write tensor0.pt"):
        run_decode(cap.wrap(executable), cfg, steps=1)
    assert open_store(memory_root).list() == []


# Zero cost when off ------------------------------------------------------------------------------


class FakeRuntime:
    def __init__(self) -> None:
        self.wrappers: list[Any] = []

    def add_wrapper(self, wrapper: Any) -> None:
        self.wrappers.append(wrapper)


class FakeGraph:
    def __init__(self, key: str) -> None:
        self.key = key
        self.gm = None
        self.example_inputs: list[Any] = []
        self.artifact = type("A", (), {"toolchain": "host", "target": "cpu-inductor"})()


def test_disabled_installs_nothing() -> None:
    runtime = FakeRuntime()
    assert install_snapshot_capture(runtime, SnapshotConfig(enabled=False)) is False  # type: ignore[arg-type]
    assert runtime.wrappers == []


def test_enabled_wraps_and_a_filtered_rank_keeps_the_raw_callable(
    memory_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = FakeRuntime()
    cfg = make_config(memory_root, RANKS="3")
    assert install_snapshot_capture(runtime, cfg) is True  # type: ignore[arg-type]
    (wrapper,) = runtime.wrappers
    monkeypatch.setenv("RANK", "0")
    assert wrapper(FakeGraph(HASH), executable) is executable  # rank 0 never captures
    monkeypatch.setenv("RANK", "3")  # (a real process has one rank: use another graph)
    wrapped = wrapper(FakeGraph("abcdef0123456789"), executable)
    assert wrapped is not executable and wrapped.__wrapped__ is executable
    assert wrapped.capturer.spec.ranks.global_rank == 3


@pytest.mark.parametrize(("enable", "wrappers"), [(None, 0), ("0", 0), ("1", 1)])
def test_build_runtime_installs_capture_only_when_enabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enable: str | None, wrappers: int
) -> None:
    from vllm_neuron import envs
    from vllm_neuron.assembly import build_runtime
    from vllm_neuron.snapshot import reset_snapshot_config

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.delenv("VLLM_NEURON_MANIFEST_DIR", raising=False)
    if enable is None:
        monkeypatch.delenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE", raising=False)
    else:
        monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE", enable)
    envs.reset_for_tests()
    reset_snapshot_config()
    try:
        assert len(build_runtime()._wrappers) == wrappers
    finally:
        envs.reset_for_tests()


def test_build_runtime_fails_at_startup_on_a_malformed_selection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_neuron import envs
    from vllm_neuron.assembly import build_runtime
    from vllm_neuron.envs import ConfigError

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE", "1")
    monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_CAPTURE_AT_CALL", "first")
    envs.reset_for_tests()
    try:
        with pytest.raises(ConfigError, match="CAPTURE_AT_CALL='first'"):
            build_runtime()
    finally:
        envs.reset_for_tests()


def test_executables_of_one_hash_share_one_call_counter(memory_root: str) -> None:
    """Identical graphs (repeated layers of a piecewise model) share a hash and a cache
    entry: like one NEFF, they count calls together, so no call<K> is written twice."""
    runtime = FakeRuntime()
    cfg = make_config(memory_root, CAPTURE_AT_CALL="-1")
    install_snapshot_capture(runtime, cfg)  # type: ignore[arg-type]
    (wrapper,) = runtime.wrappers
    layer1 = wrapper(FakeGraph(HASH), lambda x: x + 1)
    layer2 = wrapper(FakeGraph(HASH), lambda x: x + 2)
    other = wrapper(FakeGraph("ffff0000ffff0000"), lambda x: x * 3)
    assert layer1.capturer is layer2.capturer and other.capturer is not layer1.capturer
    for step in range(2):
        with forward_context(SnapshotForwardContext(step=step)):
            other(layer2(layer1(torch.ones(2))))
    store = open_store(memory_root)
    calls = sorted((b.compilation_hash, b.call_index) for b in list_bundles(store).bundles)
    assert calls == [(HASH, 0), (HASH, 1), (HASH, 2), (HASH, 3),
                     ("ffff0000ffff0000", 0), ("ffff0000ffff0000", 1)]  # fmt: skip
    outputs = [load_bundle(store, f"{HASH}/rank0/call{k}").load_outputs()[0] for k in range(4)]
    assert [float(o[0]) for o in outputs] == [2.0, 4.0, 2.0, 4.0]
