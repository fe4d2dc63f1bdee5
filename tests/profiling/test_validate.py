"""Trace parsing and run-directory validation, over crafted run directories."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest
from profiling_support import DATA

from vllm_neuron.backends import open_store
from vllm_neuron.cli import main as cli_main
from vllm_neuron.profiling import artifacts
from vllm_neuron.profiling.layout import RunLayout
from vllm_neuron.profiling.run_record import ProfileManifest, read_manifest, write_manifest
from vllm_neuron.profiling.run_spec import (
    DECODE,
    DECODE_ONLY_CONNECTOR,
    PREFILL,
    KVTransfer,
    RunSpec,
    ServeConfig,
    Workload,
    profiler_settings,
    write_run_spec,
)
from vllm_neuron.profiling.trace import (
    TraceError,
    check_decode_steps,
    check_prefill_steps,
    parse_step_name,
    read_trace,
)
from vllm_neuron.profiling.validate import validate_run

# -- trace annotations ---------------------------------------------------------------------


def test_parse_default_and_detailed_annotations() -> None:
    s = parse_step_name("execute_context_1(137)_generation_0(0)")
    assert s is not None
    assert (s.context_requests, s.context_tokens, s.generation_requests, s.generation_tokens) == (
        1, 137, 0, 0)
    d = parse_step_name(
        "execute_141_context_1(sq137sk137sqsq18769sqsk18769)_generation_4(sq4sk600sqsq4sqsk600)"
    )
    assert d is not None
    assert (d.context_requests, d.context_tokens, d.generation_requests, d.generation_tokens) == (
        1, 137, 4, 4)
    assert parse_step_name("execute_model") is None
    assert parse_step_name("vllm/v1/worker/gpu_worker.py(1300): execute_model") is None


@pytest.mark.parametrize(
    ("name", "steps"),
    [
        ("real_prefill", ["execute_context_1(137)_generation_0(0)",
                          "execute_context_0(0)_generation_0(0)"]),
        ("real_decode_c4", ["execute_context_0(0)_generation_4(4)"] * 2),
        ("real_connector_c1", ["execute_context_1(1)_generation_0(0)",
                               "execute_context_0(0)_generation_1(1)"]),
    ],
)
def test_read_real_vllm_trace_excerpts(name: str, steps: list[str]) -> None:
    """Excerpts of traces written by vLLM 0.32's torch profiler (annotations kept)."""
    summary = read_trace(str(DATA / f"{name}.rank0.pt.trace.json.gz"))
    assert [s.name for s in summary.steps] == steps
    assert summary.vllm_version == "0.32.0"
    assert summary.rank == 0


def test_phase_checks_on_real_traces() -> None:
    prefill = read_trace(str(DATA / "real_prefill.rank0.pt.trace.json.gz")).steps
    decode = read_trace(str(DATA / "real_decode_c4.rank0.pt.trace.json.gz")).steps
    connector = read_trace(str(DATA / "real_connector_c1.rank0.pt.trace.json.gz")).steps
    assert check_prefill_steps(prefill) == []
    assert check_decode_steps(decode, target_batch=4) == []
    assert check_decode_steps(connector, target_batch=1, decode_only_connector=True) == []
    # Crossed over, each fails and says why.
    assert "generation work" in check_prefill_steps(decode)[0]
    assert "context (prefill) work" in check_decode_steps(prefill, target_batch=1)[0]
    assert "not the target batch 2" in check_decode_steps(decode, target_batch=2)[0]
    # The connector's one-token context rows are accepted only in connector mode.
    assert check_decode_steps(connector, target_batch=1) != []
    assert "more than one token" in check_decode_steps(
        prefill, target_batch=1, decode_only_connector=True)[0]


def test_a_decode_window_shorter_than_max_iterations_missed_the_steady_state() -> None:
    one = [s for s in (parse_step_name("execute_context_0(0)_generation_4(4)"),
                       parse_step_name("execute_context_0(0)_generation_0(0)")) if s]
    assert check_decode_steps(one, target_batch=4) == []  # no window length given
    problems = check_decode_steps(one, target_batch=4, min_steps=2)
    assert problems == ["only 1 model step(s) recorded in a window of 2 (max_iterations): "
                        "the window opened as the decode leg ended"]


def test_no_recorded_step_is_a_failure() -> None:
    empty = [parse_step_name("execute_context_0(0)_generation_0(0)")]
    assert "no model step" in check_prefill_steps([s for s in empty if s])[0]
    assert "no model step" in check_decode_steps([], target_batch=1)[0]


def test_unreadable_trace(tmp_path: Path) -> None:
    bad = tmp_path / "rank0.1.pt.trace.json.gz"
    bad.write_bytes(b"\x1f\x8b not gzip")
    with pytest.raises(TraceError):
        read_trace(str(bad))


# -- crafted run directories ---------------------------------------------------------------


def write_trace(path: Path, steps: list[str]) -> None:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.5, "dur": 1.0}]
    events += [{"ph": "X", "cat": "user_annotation", "name": n, "ts": float(i + 1), "dur": 1.0}
               for i, n in enumerate(steps)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"vllm_version": "0.32.0", "distributedInfo": {"rank": 0},
                   "traceEvents": events}, f)


def make_run(
    root: Path,
    name: str,
    *,
    recipe: str = PREFILL,
    profiler: str = "torch",
    concurrency: int = 1,
    kv_transfer: KVTransfer | None = None,
    status: str = "ok",
    activities: list[str] | None = None,
    setup: object = None,
) -> Path:
    layout = RunLayout.for_run(str(root), name)
    os.makedirs(layout.output_dir, exist_ok=True)
    profiler_config, additional = profiler_settings(profiler, layout.output_dir)
    spec = RunSpec(
        run_name=name,
        phase="prefill" if recipe == PREFILL else "decode",
        recipe=recipe,
        workload=Workload(concurrency=concurrency, num_requests=concurrency,
                          output_len=1 if recipe == PREFILL else 64),
        serve_config=ServeConfig(model="/m", profiler_config=profiler_config,
                                 additional_config=additional),
        profiler=profiler,
        kv_transfer=kv_transfer,
    )
    store = open_store(layout.run_dir)
    write_run_spec(store, spec)
    if callable(setup):
        setup(Path(layout.output_dir))
    acts = activities if activities is not None else (
        ["device_profile", "system_profile"] if profiler == "neuron" else [])
    found = artifacts.collect(layout.output_dir, profiler, activities=acts)
    write_manifest(store, ProfileManifest(
        run_name=name, recipe=recipe, phase=spec.phase, status=status,
        error=None if status == "ok" else "server exited with code 1 before it was ready",
        failed_stage=None if status == "ok" else "ready",
        run_dir=layout.run_dir, run_spec=layout.run_spec, serve_log=layout.serve_log,
        profile=found, neff_hashes=found.neff_hashes,
    ))
    return Path(layout.run_dir)


def torch_trace(steps: list[str], worker: str = "rank0") -> object:
    def setup(out: Path) -> None:
        write_trace(out / f"{worker}.1795947567611134459.pt.trace.json.gz", steps)

    return setup


def test_valid_prefill_and_decode_runs(tmp_path: Path) -> None:
    p = make_run(tmp_path, "p", setup=torch_trace(["execute_context_1(31)_generation_0(0)",
                                                   "execute_context_0(0)_generation_0(0)"]))
    report = validate_run(str(p))
    assert report.ok, report.failures
    assert list(report.steps.values()) == [["execute_context_1(31)_generation_0(0)",
                                            "execute_context_0(0)_generation_0(0)"]]
    d = make_run(tmp_path, "d", recipe=DECODE, concurrency=4,
                 setup=torch_trace(["execute_context_0(0)_generation_4(4)"] * 2))
    assert validate_run(str(d)).ok


def test_missing_trace_fails(tmp_path: Path) -> None:
    run = make_run(tmp_path, "missing")
    report = validate_run(str(run))
    assert not report.ok
    assert any("device trace is null" in f for f in report.failures)


def test_zero_byte_trace_fails(tmp_path: Path) -> None:
    def setup(out: Path) -> None:
        (out / "rank0.1.pt.trace.json.gz").write_bytes(b"")

    run = make_run(tmp_path, "zero", setup=setup)
    report = validate_run(str(run))
    assert not report.ok
    assert any("is zero bytes" in f and "device trace" in f for f in report.failures)


def test_trace_deleted_after_the_manifest_fails(tmp_path: Path) -> None:
    run = make_run(tmp_path, "gone", setup=torch_trace(["execute_context_1(3)_generation_0(0)"]))
    for f in (run / "output").iterdir():
        f.unlink()
    report = validate_run(str(run))
    assert any("does not exist" in f for f in report.failures)


def test_decode_run_with_a_short_window_fails(tmp_path: Path) -> None:
    run = make_run(tmp_path, "short", recipe=DECODE, concurrency=4, setup=torch_trace(
        ["execute_context_0(0)_generation_4(4)", "execute_context_0(0)_generation_0(0)"]))
    report = validate_run(str(run))
    assert any("only 1 model step(s) recorded in a window of 2" in f for f in report.failures)


def test_decode_with_prefill_leak_fails(tmp_path: Path) -> None:
    run = make_run(tmp_path, "leak", recipe=DECODE, concurrency=4, setup=torch_trace(
        ["execute_context_1(64)_generation_3(3)", "execute_context_0(0)_generation_4(4)"]))
    report = validate_run(str(run))
    assert not report.ok
    assert any("context (prefill) work" in f for f in report.failures)


def test_decode_connector_mode_accepts_one_token_context_rows(tmp_path: Path) -> None:
    kv = KVTransfer(config=dict(DECODE_ONLY_CONNECTOR), reason="no prefill-free tick")
    steps = ["execute_context_1(1)_generation_0(0)", "execute_context_0(0)_generation_1(1)"]
    run = make_run(tmp_path, "conn", recipe=DECODE, kv_transfer=kv, setup=torch_trace(steps))
    report = validate_run(str(run))
    assert report.ok, report.failures
    assert any("meaningless" in n for n in report.notes)


def test_failed_run_fails_validation_with_its_reason(tmp_path: Path) -> None:
    run = make_run(tmp_path, "failed", status="failed")
    report = validate_run(str(run))
    assert any("capture status is 'failed' at ready: server exited" in f
               for f in report.failures)


def test_missing_manifest_and_spec(tmp_path: Path) -> None:
    run = make_run(tmp_path, "nomanifest", setup=torch_trace(
        ["execute_context_1(3)_generation_0(0)"]))
    (run / "manifest.json").unlink()
    report = validate_run(str(run))
    assert report.failures == [f"manifest.json is missing from {run}"]
    (run / "run_spec.json").unlink()
    report = validate_run(str(run))
    assert len(report.failures) == 2
    assert not validate_run(str(tmp_path / "nope")).ok


def neuron_session(*, cpu_bytes: bytes = b"", host_bytes: bytes = b"",
                   ntff: bytes = b"ntff", pb: bytes = b"pb") -> object:
    def setup(out: Path) -> None:
        session = out / "i-0abc_pid1234_1795947567611134459"
        session.mkdir(parents=True)
        (session / "device_nc0.ntff").write_bytes(ntff)
        (session / "ntrace.pb").write_bytes(pb)
        (session / "trace_info.pb").write_bytes(b"info")
        (session / "cpu_util.pb").write_bytes(cpu_bytes)
        (session / "host_mem.pb").write_bytes(host_bytes)
        neffs = out / "neffs"
        neffs.mkdir()
        (neffs / "neff_8f3a2b1c9d0e.neff").write_bytes(b"neff")

    return setup


def test_neuron_unrequested_zero_byte_host_files_are_flagged_not_failed(tmp_path: Path) -> None:
    run = make_run(tmp_path, "neuron", profiler="neuron", setup=neuron_session())
    report = validate_run(str(run))
    assert report.ok, report.failures
    flagged = [n for n in report.notes if "not requested" in n]
    assert len(flagged) == 2
    assert any("cpu_util_pb" in n for n in flagged) and any("host_mem_pb" in n for n in flagged)
    m = read_manifest(open_store(str(run), create=False))
    assert m is not None
    assert m.profile.device_ntff and m.profile.device_ntff.endswith("device_nc0.ntff")
    assert m.profile.system_trace_pb and m.profile.system_trace_pb.endswith("ntrace.pb")
    assert m.profile.neff_dir and m.profile.neff_dir.endswith("neffs")
    assert m.neff_hashes == ["8f3a2b1c9d0e"]


def test_neuron_requested_zero_byte_host_file_fails(tmp_path: Path) -> None:
    run = make_run(tmp_path, "neuron-req", profiler="neuron", setup=neuron_session(
        host_bytes=b"data"), activities=["device_profile", "system_profile", "cpu_util",
                                         "host_memory"])
    report = validate_run(str(run))
    assert report.failures == [
        f"cpu_util_pb {run}/output/i-0abc_pid1234_1795947567611134459/cpu_util.pb is zero "
        "bytes although cpu_util was requested"
    ]


def test_neuron_zero_byte_device_and_system_traces_fail(tmp_path: Path) -> None:
    run = make_run(tmp_path, "neuron-empty", profiler="neuron",
                   setup=neuron_session(ntff=b"", pb=b""))
    failures = validate_run(str(run)).failures
    assert any(f.startswith("device trace") and "zero bytes" in f for f in failures)
    assert any("system trace" in f and "VLLM_NEURON_WORKER_TERMINATION_TIMEOUT" in f
               for f in failures)


def test_cli_validate_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = make_run(tmp_path, "good", setup=torch_trace(["execute_context_1(3)_generation_0(0)"]))
    bad = make_run(tmp_path, "bad")
    assert cli_main(["profile", "validate", str(good)]) == 0
    assert "ok" in capsys.readouterr().out
    assert cli_main(["profile", "validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAIL device trace is null" in out
    assert cli_main(["profile", "validate", "--json", str(bad)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["failures"]
    assert cli_main(["profile", "show", str(good)]) == 0
    assert "prefill_isolation" in capsys.readouterr().out
    assert cli_main(["profile", "list", "--project-root", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_name"] for r in rows] == ["bad", "good"]
    shutil.rmtree(good)
    assert cli_main(["profile", "show", str(good)]) == 2
