"""The capture orchestration end to end, against `fake_vllm.py` (a real server process).

These cover what the real-vLLM tests cannot afford to repeat: the decode fallback's
relaunch, the "never" mode, environment plumbing and both interrupt signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from profiling_support import ROOT, group_alive, wait_until
from tmpfs_mounts import fill, remount  # tests/tmpfs_mounts.py

from vllm_neuron.backends import open_store
from vllm_neuron.profiling.capture import run_capture
from vllm_neuron.profiling.options import CaptureOptions
from vllm_neuron.profiling.run_record import read_manifest
from vllm_neuron.profiling.run_spec import read_run_spec


def options(recipe: str, model: str, port: int, entry: list[str], **kw: object) -> CaptureOptions:
    base: dict[str, object] = dict(
        recipe=recipe, model=model, port=port, entrypoint=entry, profiler="torch",
        ready_timeout=60, request_timeout=60, teardown_grace=5, max_num_seqs=4,
    )
    base.update(kw)
    return CaptureOptions(**base)  # type: ignore[arg-type]


def files(run_dir: str) -> tuple[object, object]:
    store = open_store(run_dir, create=False)
    return read_run_spec(store), read_manifest(store)


def test_prefill_capture(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    monkeypatch.setenv("VLLM_NEURON_VENV_PATH", str(venv))
    monkeypatch.setenv("VLLM_NEURON_DIR", str(tmp_path))
    monkeypatch.setenv("XLA_IR_DEBUG", "1")
    result = run_capture(options("prefill", fake_model, port, fake_entrypoint, run_name="p",
                                 model_env=["MY_COMPILE_FLAG"]), log=lambda m: None)
    assert result.exit_code == 0, result.manifest
    assert result.run_dir == f"{project_root}/agent_artifacts/profiles/p"
    spec, m = files(result.run_dir)
    assert spec is not None and m is not None
    assert m.status == "ok" and m.validation is not None and m.validation.ok
    assert m.recipe == "prefill_isolation" and m.run_spec == f"{result.run_dir}/run_spec.json"
    assert m.executed_graphs[0].startswith("execute_context_1(")
    assert m.profile.device_trace and os.path.getsize(m.profile.device_trace) > 0
    assert m.requests["sent"] == 1 and m.requests["completion_tokens"] == 1
    assert m.teardown is not None and m.teardown.clean and m.teardown.signals == ["SIGTERM"]
    assert group_alive(m.teardown.pgid) == []
    assert spec.model_env["XLA_IR_DEBUG"] == "1" and spec.model_env["MY_COMPILE_FLAG"] is None
    assert spec.launch is not None and spec.launch.path_prefix == str(venv / "bin")
    assert spec.launch.cwd == str(tmp_path)
    log = Path(m.serve_log).read_text()
    assert f"cwd {tmp_path} PATH0 {venv / 'bin'}" in log  # VLLM_NEURON_DIR and VENV_PATH


def test_decode_capture_arms_on_the_stats_trigger(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    result = run_capture(options(
        "decode", fake_model, port, fake_entrypoint, run_name="d", concurrency=4,
        output_len=300, num_requests=4, stats_interval=0.1,
    ), log=lambda m: None)
    m = result.manifest
    assert result.exit_code == 0, (m.error, m.validation)
    assert m.trigger is not None and m.trigger["kind"] == "stats"
    assert "Avg prompt throughput: 0.0 tokens/s" in m.trigger["line"]
    assert m.executed_graphs == ["execute_context_0(0)_generation_4(4)"] * 2
    assert m.fallback is None and len(m.attempts) == 1
    spec, _ = files(result.run_dir)
    assert spec is not None and spec.serve_config.env["VLLM_LOG_STATS_INTERVAL"] == "0.1"
    assert spec.kv_transfer is None


def test_decode_withdraws_a_stale_trigger_and_runs_another_window(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    """The first batch's ticks arrive in one burst after it finished (a starved log reader):
    the steady tick in the burst is stale, so no profiler session opens on it; the workload
    runs again in a second window, which arms on fresh ticks."""
    logs: list[str] = []
    result = run_capture(options(
        "decode", fake_model, port, fake_entrypoint, run_name="stale", concurrency=4,
        output_len=300, num_requests=4, stats_interval=0.1,
        server_env={"FAKE_VLLM_STALE_TICKS": "1"},
    ), log=logs.append)
    m = result.manifest
    assert result.exit_code == 0, (m.error, m.validation)
    assert [(w.attempt, w.window, w.outcome) for w in m.windows] == [
        (1, 1, "missed"), (1, 2, "captured")]
    missed = m.windows[0]
    assert "before the trigger fired on fresh evidence" in missed.reason
    # Read before or after the last response arrived, the burst is stale either way.
    assert ("no longer shows steady decode" in missed.reason and "Running: 0" in missed.reason
            or "read only after the last response" in missed.reason), missed.reason
    assert missed.trigger is None and missed.traces == []
    assert m.max_windows == 3 and m.fallback is None and len(m.attempts) == 1
    assert m.trigger == m.windows[1].trigger and m.trigger is not None
    assert "Running: 4 reqs, Waiting: 0 reqs" in m.trigger["line"]
    assert m.windows[1].steps == ["execute_context_0(0)_generation_4(4)"] * 2
    assert m.executed_graphs == ["execute_context_0(0)_generation_4(4)"] * 2
    assert m.requests["ok"] == 4 and m.requests["completion_tokens"] == [300]
    assert any(line.startswith("profiling window 1 of 3 missed") for line in logs), logs
    log = Path(m.serve_log).read_text()
    assert log.count("profiler session") == 1  # the stale window opened none


@pytest.mark.parametrize("recipe", ["prefill", "decode"])
def test_a_window_without_a_model_step_is_set_aside_and_run_again(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str], recipe: str
) -> None:
    """The profiler's first session records no model step (it opened after the work): the
    window is rejected, its trace moved out of output/, and a second window captures."""
    extra: dict[str, object] = dict(concurrency=4, output_len=300, num_requests=4,
                                    stats_interval=0.1) if recipe == "decode" else {}
    result = run_capture(options(
        recipe, fake_model, port, fake_entrypoint, run_name=f"empty-{recipe}",
        server_env={"FAKE_VLLM_EMPTY_WINDOWS": "1"}, **extra,
    ), log=lambda m: None)
    m = result.manifest
    assert result.exit_code == 0, (m.error, m.validation)
    assert [w.outcome for w in m.windows] == ["rejected", "captured"]
    rejected, captured = m.windows
    assert "no model step was recorded" in rejected.reason and rejected.steps == []
    # Each window's trace on its own: the rejected one under windows/, the captured in output/.
    window_dir = Path(result.run_dir) / "windows" / "attempt1-window1"
    assert len(rejected.traces) == 1 and Path(rejected.traces[0]).parent == window_dir
    assert Path(rejected.traces[0]).stat().st_size > 0
    assert [t.path for t in m.profile.traces] == captured.traces
    assert len(captured.traces) == 1 and Path(captured.traces[0]).parent.name == "output"
    assert captured.steps == m.executed_graphs and captured.steps
    assert m.validation is not None and m.validation.ok, m.validation
    assert rejected.timings.keys() >= {"start_profile_s", "stop_profile_s"}
    assert m.attempts[-1].outcome == "captured"


def test_a_decode_window_whose_start_lands_after_the_batch_is_run_again(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    """The trigger was fresh, but /start_profile took effect only after the batch's last
    step: the delayed profiler never started, wrote nothing, and a second window captures."""
    result = run_capture(options(
        "decode", fake_model, port, fake_entrypoint, run_name="late", concurrency=4,
        output_len=300, num_requests=4, stats_interval=0.1,
        server_env={"FAKE_VLLM_LATE_STARTS": "1"},
    ), log=lambda m: None)
    m = result.manifest
    assert result.exit_code == 0, (m.error, m.validation)
    assert [w.outcome for w in m.windows] == ["rejected", "captured"]
    late = m.windows[0]
    assert late.reason == "the profiler wrote no trace for the window" and late.traces == []
    # Recorded for diagnosis; not asserted: the client may not have read the responses yet.
    assert late.trigger is not None and "in_flight_after_start" in late.trigger
    assert not (Path(result.run_dir) / "windows").exists()  # nothing to set aside
    assert m.executed_graphs == ["execute_context_0(0)_generation_4(4)"] * 2
    assert m.validation is not None and m.validation.ok


def test_max_windows_bounds_the_retries_and_is_named_in_the_error(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    result = run_capture(options(
        "prefill", fake_model, port, fake_entrypoint, run_name="exhausted", max_windows=2,
        server_env={"FAKE_VLLM_EMPTY_WINDOWS": "5"},
    ), log=lambda m: None)
    m = result.manifest
    assert result.exit_code == 1
    assert m.status == "failed" and m.failed_stage == "capture"
    assert m.error is not None and "none of 2 profiling windows recorded the prefill phase" in (
        m.error) and "max_windows 2" in m.error and "--max-windows" in m.error
    assert "no model step" in m.error
    assert m.max_windows == 2
    assert [w.outcome for w in m.windows] == ["rejected", "rejected"]
    first, last = m.windows
    assert Path(first.traces[0]).parent.name == "attempt1-window1"
    assert last.traces == [t.path for t in m.profile.traces]  # the last one stays in output/
    assert m.validation is not None and not m.validation.ok
    assert any("no model step" in f for f in m.validation.failures)
    assert m.teardown is not None and m.teardown.clean
    spec, _ = files(result.run_dir)
    assert spec is not None


def test_a_batch_that_never_runs_whole_misses_windows_instead_of_falling_back(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    """Decode ticks happen, but never at the target batch (the server holds 2 of the 4
    requests at once, as staggered arrivals on a busy host also do): the windows miss and
    the error says why; the decode-only connector would not help, so there is no relaunch."""
    result = run_capture(options(
        "decode", fake_model, port, fake_entrypoint, run_name="half", concurrency=4,
        output_len=60, num_requests=4, stats_interval=0.1, max_windows=2,
        extra_args=["--max-num-seqs", "2"],
    ), log=lambda m: None)
    m = result.manifest
    assert result.exit_code == 1 and m.status == "failed"
    assert [w.outcome for w in m.windows] == ["missed", "missed"]
    assert all("the batch never ran whole: at most 2 of the 4 requests" in w.reason
               for w in m.windows)
    assert m.error is not None and "max_windows 2" in m.error and m.fallback is None
    assert len(m.attempts) == 0 and m.teardown is not None and m.teardown.clean


def test_max_windows_below_one_is_refused(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    with pytest.raises(ValueError, match=r"max_windows \(--max-windows\) must be at least 1"):
        run_capture(options("prefill", fake_model, port, fake_entrypoint, max_windows=0))


def test_decode_falls_back_to_the_decode_only_connector(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    """Concurrency 1 with 2-token outputs: no tick is ever prefill-free."""
    logs: list[str] = []
    result = run_capture(options(
        "decode", fake_model, port, fake_entrypoint, run_name="f", concurrency=1,
        output_len=2, num_requests=200, stats_interval=0.1, fallback_patience=3,
    ), log=logs.append)
    m = result.manifest
    assert result.exit_code == 0, (m.error, m.validation)
    assert [a.outcome for a in m.attempts] == ["fallback", "captured"]
    assert m.attempts[0].kv_transfer is None
    assert m.attempts[0].serve_log.endswith("logs/serve.attempt1.log")
    assert os.path.exists(m.attempts[0].serve_log)
    assert m.attempts[1].kv_transfer == {"kv_connector": "DecodeBenchConnector",
                                         "kv_role": "kv_both"}
    assert m.fallback is not None and "busy ticks had prefill" in m.fallback["reason"]
    assert m.trigger is not None and m.trigger["kind"] == "connector"
    assert m.validation is not None and any("meaningless" in n for n in m.validation.notes)
    spec, _ = files(result.run_dir)
    assert spec is not None and spec.launch is not None and spec.launch.attempt == 2
    assert spec.kv_transfer is not None
    assert spec.kv_transfer.config["kv_connector"] == "DecodeBenchConnector"
    # Recorded next to the configuration, not merged into it.
    assert "--kv-transfer-config" not in spec.serve_config.extra_args
    assert spec.launch.argv[-2] == "--kv-transfer-config"
    assert any("falling back" in line for line in logs)


def test_decode_fallback_never_fails_with_the_reason(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    result = run_capture(options(
        "decode", fake_model, port, fake_entrypoint, run_name="n", concurrency=1,
        output_len=2, num_requests=200, stats_interval=0.1, fallback_patience=3,
        decode_fallback="never",
    ), log=lambda m: None)
    m = result.manifest
    assert result.exit_code == 1
    assert m.status == "failed" and m.failed_stage == "capture"
    assert m.error is not None and "decode arming never fired" in m.error
    assert m.teardown is not None and m.teardown.clean


def test_launch_failure_records_run_spec_and_a_failed_manifest(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    result = run_capture(options("prefill", fake_model + "-missing", port, fake_entrypoint,
                                 run_name="bad"), log=lambda m: None)
    m = result.manifest
    assert result.exit_code == 1
    assert m.status == "failed" and m.failed_stage == "ready"
    assert m.error is not None and "exited with code 1" in m.error and "no model at" in m.error
    assert m.profile.device_trace is None
    assert m.validation is not None and not m.validation.ok
    spec, _ = files(result.run_dir)
    assert spec is not None and spec.serve_config.model.endswith("-missing")
    assert m.teardown is not None and m.teardown.clean


def test_existing_run_directory_is_refused(
    project_root: Path, fake_model: str, port: int, fake_entrypoint: list[str]
) -> None:
    run_dir = project_root / "agent_artifacts" / "profiles" / "taken"
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="already exists"):
        run_capture(options("prefill", fake_model, port, fake_entrypoint, run_name="taken"))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(("sig", "inherit_ignored"),
                         [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-inherited-ignored"])
def test_signal_mid_capture_tears_down_and_writes_the_manifest(
    project_root: Path, fake_model: str, port: int, sig: signal.Signals, inherit_ignored: bool
) -> None:
    """The capture command gets a signal while the server is starting up.

    ``inherit_ignored`` starts it the way ``cmd &`` in a script does, with SIGINT ignored:
    ``kill -INT`` must still interrupt the capture.
    """
    cmd = [sys.executable, "-m", "vllm_neuron.cli", "profile", "capture", "--recipe", "decode",
           "--model", fake_model, "--run-name", "sig", "--port", str(port), "--profiler",
           "torch", "--server-command", f"{sys.executable} {ROOT}/tests/profiling/fake_vllm.py",
           "--server-env", "FAKE_VLLM_STARTUP_S=60", "--teardown-grace", "5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ),
                            preexec_fn=_ignore_sigint if inherit_ignored else None)
    run_dir = project_root / "agent_artifacts" / "profiles" / "sig"
    try:
        assert wait_until(lambda: (run_dir / "logs" / "serve.log").exists()
                          and "fake vllm: pid" in (run_dir / "logs" / "serve.log").read_text(),
                          30)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    _, m = files(str(run_dir))
    assert m is not None
    assert m.status == "interrupted" and m.failed_stage == "ready"
    assert m.error == f"interrupted by {sig.name}"
    assert m.teardown is not None and m.teardown.clean and m.teardown.survivors == []
    assert group_alive(m.teardown.pgid) == []
    assert "status interrupted" in err
    assert json.loads((run_dir / "run_spec.json").read_text())["recipe"] == "decode_isolation"


def test_sigint_while_profiling_sends_the_owed_stop_and_tears_down(
    project_root: Path, fake_model: str, port: int
) -> None:
    """Ctrl-C after the decode trigger fired: stop_profile is still sent during cleanup."""
    cmd = [sys.executable, "-m", "vllm_neuron.cli", "profile", "capture", "--recipe", "decode",
           "--model", fake_model, "--run-name", "armed", "--port", str(port), "--profiler",
           "torch", "--server-command", f"{sys.executable} {ROOT}/tests/profiling/fake_vllm.py",
           "--concurrency", "2", "--num-requests", "2", "--output-len", "100000",
           "--stats-interval", "0.1", "--max-num-seqs", "2", "--teardown-grace", "5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ))
    err_lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # logged once /start_profile has returned
            err_lines.append(line)
            if "profiling window 1 open" in line:
                break
        else:
            raise AssertionError("".join(err_lines))
        # The server wrote the 2-iteration window's trace (the capture still owes the stop).
        output = project_root / "agent_artifacts" / "profiles" / "armed" / "output"
        assert wait_until(lambda: any(output.glob("*.pt.trace.json.gz")), 60)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(err_lines) + err
    _, m = files(str(project_root / "agent_artifacts" / "profiles" / "armed"))
    assert m is not None and m.status == "interrupted" and m.failed_stage == "capture"
    assert "start_profile_s" in m.timings and "stop_profile_s" in m.timings
    assert m.trigger is not None and m.trigger["kind"] == "stats"  # recorded when it fired
    assert m.profile.device_trace is not None  # the 2-iteration window was written
    assert m.teardown is not None and m.teardown.clean
    assert group_alive(m.teardown.pgid) == []


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_run_directory_that_cannot_take_files_is_refused_before_a_server_starts(
    fault: str, tmpfs: Path, fake_model: str, port: int
) -> None:
    """A project root on a read-only or full filesystem: the capture says which directory,
    which setting and why, exits 2, and starts no server (no minutes of start-up lost)."""
    root = tmpfs / "project"
    root.mkdir()
    if fault == "read-only":
        remount(tmpfs, "ro")
    else:
        remount(tmpfs, "size=1m")
        fill(tmpfs)
    cmd = [sys.executable, "-m", "vllm_neuron.cli", "profile", "capture", "--recipe", "prefill",
           "--model", fake_model, "--run-name", "full", "--port", str(port), "--profiler",
           "torch", "--server-command", f"{sys.executable} {ROOT}/tests/profiling/fake_vllm.py"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NEURON_PROJECT_ROOT": str(root)})  # fmt: skip
    assert done.returncode == 2, done.stderr
    reason = "read-only file system" if fault == "read-only" else "no space left"
    assert "NEURON_PROJECT_ROOT" in done.stderr and reason in done.stderr, done.stderr
    assert "fake vllm" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
