"""Run spec and manifest records, the derived command line, layout and settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.envs import ConfigError, load_profiling_settings
from vllm_neuron.profiling.artifacts import ProfileArtifacts, collect
from vllm_neuron.profiling.layout import RunLayout, default_run_name, validate_run_name
from vllm_neuron.profiling.run_record import (
    ProfileManifest,
    Teardown,
    decode_manifest,
    encode_manifest,
    read_manifest,
    write_manifest,
)
from vllm_neuron.profiling.run_spec import (
    DECODE_ONLY_CONNECTOR,
    KVTransfer,
    RunSpec,
    ServeConfig,
    Workload,
    decode_run_spec,
    encode_run_spec,
    normalize_recipe,
    profiler_settings,
    read_run_spec,
    serve_command,
    snapshot_model_env,
    write_run_spec,
)

SEED_KEYS = ["schema_version", "run_name", "phase", "recipe", "workload", "serve_config",
             "model_env"]


def spec(**kw: object) -> RunSpec:
    pc, ac = profiler_settings("torch", "/p/output")
    base: dict[str, object] = dict(
        run_name="r1", phase="decode", recipe="decode_isolation",
        workload=Workload(input_len=64, output_len=128, concurrency=4, num_requests=8),
        serve_config=ServeConfig(model="/models/m", port=9000, max_num_seqs=4,
                                 enforce_eager=True, profiler_config=pc, additional_config=ac,
                                 extra_args=["--kv-cache-memory-bytes", "67108864"],
                                 env={"VLLM_LOG_STATS_INTERVAL": "0.25"}),
        model_env={"XLA_IR_DEBUG": "1", "NEURON_CC_FLAGS": None},
    )
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def test_run_spec_has_the_seed_fields_and_round_trips() -> None:
    s = spec()
    doc = json.loads(encode_run_spec(s))
    assert list(doc)[: len(SEED_KEYS)] == SEED_KEYS
    assert doc["schema_version"] == 1
    assert decode_run_spec(encode_run_spec(s)) == s


def test_run_spec_written_atomically_through_the_store() -> None:
    store = open_store("memory://profiling-run-spec-test")
    assert read_run_spec(store) is None
    write_run_spec(store, spec())
    write_run_spec(store, spec(run_name="r2"))
    got = read_run_spec(store)
    assert got is not None and got.run_name == "r2"


def test_unknown_schema_version_is_refused() -> None:
    raw = json.loads(encode_run_spec(spec()))
    raw["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version 99"):
        decode_run_spec(json.dumps(raw).encode())


def test_command_is_derived_from_serve_config() -> None:
    s = spec()
    argv = serve_command(s.serve_config)
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/models/m"
    assert argv[argv.index("--port") + 1] == "9000"
    assert "--enforce-eager" in argv
    pc = json.loads(argv[argv.index("--profiler-config") + 1])
    assert pc == {"profiler": "torch", "torch_profiler_dir": "/p/output", "ignore_frontend": True,
                  "delay_iterations": 1, "max_iterations": 2}
    assert argv[-2:] == ["--kv-cache-memory-bytes", "67108864"]
    assert "--kv-transfer-config" not in argv


def test_fallback_connector_is_appended_but_not_merged_into_serve_config() -> None:
    kv = KVTransfer(config=dict(DECODE_ONLY_CONNECTOR), reason="no prefill-free tick")
    s = spec(kv_transfer=kv)
    argv = serve_command(s.serve_config, s.kv_transfer)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
    # The pinned serving configuration is unchanged: it derives the same command without it.
    assert serve_command(s.serve_config) == argv[:-2]
    doc = json.loads(encode_run_spec(s))
    assert "kv_transfer" not in json.dumps(doc["serve_config"])
    assert doc["kv_transfer"]["config"]["kv_connector"] == "DecodeBenchConnector"


def test_neuron_profiler_settings() -> None:
    pc, ac = profiler_settings("neuron", "/root/agent_artifacts/profiles/r/output")
    assert pc == {"profiler": "cuda", "delay_iterations": 0, "max_iterations": 2}
    assert ac == {"neuron_profiler": {
        "activities": ["device_profile", "system_profile"], "neuron_cores": [0],
        "output_dir": "/root/agent_artifacts/profiles/r/output"}}
    with pytest.raises(ValueError):
        profiler_settings("nsight", "/x")


def test_model_env_snapshot() -> None:
    env = {"XLA_IR_DEBUG": "1", "OTHER": "x"}
    assert snapshot_model_env(["XLA_IR_DEBUG", "NEURON_CC_FLAGS", "XLA_IR_DEBUG"], env) == {
        "NEURON_CC_FLAGS": None, "XLA_IR_DEBUG": "1"}


def test_recipe_names() -> None:
    assert normalize_recipe("prefill") == "prefill_isolation"
    assert normalize_recipe("decode_isolation") == "decode_isolation"
    with pytest.raises(ValueError, match="unknown recipe"):
        normalize_recipe("warmup")


def test_manifest_round_trip_and_atomic_write() -> None:
    m = ProfileManifest(
        run_name="r", recipe="prefill_isolation", phase="prefill", status="ok",
        run_dir="/x", run_spec="/x/run_spec.json", serve_log="/x/logs/serve.log",
        profile=ProfileArtifacts(profiler="torch", output_dir="/x/output",
                                 device_trace="/x/output/rank0.1.pt.trace.json.gz"),
        teardown=Teardown(pgid=123, signals=["SIGTERM"], exit_code=0),
    )
    doc = json.loads(encode_manifest(m))
    for key in ("recipe", "profile", "neff_hashes", "run_spec", "teardown"):
        assert key in doc
    for key in ("device_ntff", "system_trace_pb", "trace_info_pb", "neff_dir", "cpu_util_pb",
                "host_mem_pb"):
        assert key in doc["profile"]
    assert decode_manifest(encode_manifest(m)) == m
    store = open_store("memory://profiling-manifest-test")
    write_manifest(store, m)
    assert read_manifest(store) == m
    with pytest.raises(ValueError, match="schema_version 2 is not supported"):
        decode_manifest(b'{"schema_version": 2}')
    with pytest.raises(ValueError, match="profile manifest: not JSON"):
        decode_manifest(b"{not json")


def test_layout_under_the_one_knob(tmp_path: Path) -> None:
    layout = RunLayout.for_run(str(tmp_path), "decode-1")
    assert layout.run_dir == f"{tmp_path}/agent_artifacts/profiles/decode-1"
    assert layout.serve_log == f"{layout.run_dir}/logs/serve.log"
    assert layout.output_dir == f"{layout.run_dir}/output"
    for bad in ("", "../x", "a/b", ".hidden", "x" * 200):
        with pytest.raises(ValueError):
            validate_run_name(bad)
    name = default_run_name("prefill", now=0.0)
    assert name.startswith("prefill-19700101T000000Z-")
    validate_run_name(name)


def test_profiling_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = load_profiling_settings({})
    assert s.project_root == str(tmp_path)
    assert s.hf_home == f"{tmp_path}/agent_artifacts/models"
    assert s.venv_path is None and s.vllm_neuron_dir is None
    venv = tmp_path / "venv"
    venv.mkdir()
    env = {"NEURON_PROJECT_ROOT": "/data/proj", "VLLM_NEURON_VENV_PATH": str(venv),
           "VLLM_NEURON_DIR": str(tmp_path), "HF_HOME": "/hf"}
    s = load_profiling_settings(env)
    assert (s.project_root, s.hf_home, s.venv_path, s.vllm_neuron_dir) == (
        "/data/proj", "/hf", str(venv), str(tmp_path))
    # --project-root wins over the variable.
    assert load_profiling_settings(env, project_root="/other").project_root == "/other"
    with pytest.raises(ConfigError, match="VLLM_NEURON_VENV_PATH='/no/such/dir'"):
        load_profiling_settings({"VLLM_NEURON_VENV_PATH": "/no/such/dir"})


def test_profiling_variables_are_documented() -> None:
    from vllm_neuron.envs import ENVIRONMENT_VARIABLES

    names = {v.name for v in ENVIRONMENT_VARIABLES if v.feature == "profiling"}
    assert {"NEURON_PROJECT_ROOT", "VLLM_NEURON_VENV_PATH", "VLLM_NEURON_DIR",
            "HF_HOME"} <= names


def test_torch_artifact_discovery_orders_workers(tmp_path: Path) -> None:
    for name in ("rank1.5.pt.trace.json.gz", "rank0.9.pt.trace.json.gz", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    found = collect(str(tmp_path), "torch")
    assert [t.worker for t in found.traces] == ["rank0.9", "rank1.5"]
    assert found.device_trace == os.path.join(tmp_path, "rank0.9.pt.trace.json.gz")
    empty = collect(str(tmp_path / "missing"), "torch")
    assert empty.device_trace is None and empty.traces == []
