"""Run directories written by the Neuron plugin: ``manifest.json`` without ``schema_version``.

The plugin's manifest has exactly the keys the profiling guide lists (``recipe``,
``profile.{device_ntff, system_trace_pb, trace_info_pb, neff_dir, cpu_util_pb,
host_mem_pb}``, ``neff_hashes``). The fixture files under ``data/neuron_plugin/`` are in
that form; ``@RUN_DIR@`` stands for the run directory, since the manifest names every
artifact by absolute path. Files written by our own code must still read (round trip).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from profiling_support import DATA

from vllm_neuron.backends import open_store
from vllm_neuron.backends.records import RecordError
from vllm_neuron.cli import main as cli_main
from vllm_neuron.profiling.artifacts import ProfileArtifacts
from vllm_neuron.profiling.layout import RunLayout
from vllm_neuron.profiling.run_record import (
    STATUS_UNRECORDED,
    ProfileManifest,
    Teardown,
    Validation,
    Window,
    decode_manifest,
    encode_manifest,
    read_manifest,
    write_manifest,
)
from vllm_neuron.profiling.run_spec import (
    RunSpec,
    ServeConfig,
    Workload,
    decode_run_spec,
    encode_run_spec,
)
from vllm_neuron.profiling.validate import validate_run

FIXTURES = DATA / "neuron_plugin"
SESSION = "i-0f1e2d3c4b5a69788_pid48213_1795947567611134459"
SEED_KEYS = {"recipe", "profile", "neff_hashes"}
SEED_PROFILE_KEYS = {"device_ntff", "system_trace_pb", "trace_info_pb", "neff_dir",
                     "cpu_util_pb", "host_mem_pb"}  # fmt: skip


def fixture_text(name: str, run_dir: Path) -> str:
    return (FIXTURES / name).read_text().replace("@RUN_DIR@", str(run_dir))


def plugin_run(root: Path, name: str = "decode-llama-tp8", *, ntff: bytes = b"NTFF" * 64,
               pb: bytes = b"pb" * 32, with_spec: bool = True) -> Path:  # fmt: skip
    """A run directory as the plugin leaves it: run_spec.json, manifest.json, logs/, output/
    with one session directory (device trace, system traces) and neffs/."""
    run_dir = RunLayout.for_run(str(root), name).run_dir
    run = Path(run_dir)
    session = run / "output" / SESSION
    session.mkdir(parents=True)
    (session / "device_profile_nc0.ntff").write_bytes(ntff)
    (session / "ntrace.pb").write_bytes(pb)
    (session / "trace_info.pb").write_bytes(b"\x0a\x10" + b"3b9d0f6c1a2e4857")
    (session / "cpu_util.pb").write_bytes(b"")  # not requested: zero bytes
    (session / "host_mem.pb").write_bytes(b"")
    (run / "output" / "neffs").mkdir()
    (run / "output" / "neffs" / "MODULE_3b9d0f6c1a2e4857.neff").write_bytes(b"NEFF")
    (run / "logs").mkdir()
    (run / "logs" / "serve.log").write_text("INFO: started\n")
    (run / "manifest.json").write_text(fixture_text("manifest.json", run))
    if with_spec:
        (run / "run_spec.json").write_text(fixture_text("run_spec.json", run))
    return run


def test_fixture_is_the_seed_form() -> None:
    raw = json.loads((FIXTURES / "manifest.json").read_text())
    assert set(raw) == SEED_KEYS and "schema_version" not in raw
    assert set(raw["profile"]) == SEED_PROFILE_KEYS


def test_seed_manifest_is_upcast(tmp_path: Path) -> None:
    run = plugin_run(tmp_path)
    data = (run / "manifest.json").read_bytes()
    bare = decode_manifest(data)  # without a location: what the form itself says
    assert bare.schema_version == 1 and bare.status == STATUS_UNRECORDED
    assert (bare.recipe, bare.phase) == ("decode_isolation", "decode")
    assert bare.run_dir == bare.run_name == bare.run_spec == bare.serve_log == ""
    p = bare.profile
    assert p.profiler == "neuron" and p.output_dir == "" and p.activities == []
    assert p.device_trace == p.device_ntff == f"{run}/output/{SESSION}/device_profile_nc0.ntff"
    assert p.system_trace_pb == f"{run}/output/{SESSION}/ntrace.pb"
    assert p.trace_info_pb == f"{run}/output/{SESSION}/trace_info.pb"
    assert p.neff_dir == f"{run}/output/neffs"
    assert p.cpu_util_pb and p.host_mem_pb and p.cpu_util_pb.endswith("cpu_util.pb")
    assert bare.neff_hashes == ["3b9d0f6c1a2e4857"]
    assert (bare.windows, bare.attempts, bare.teardown, bare.validation) == ([], [], None, None)

    located = read_manifest(open_store(str(run), create=False))
    assert located is not None
    assert located.run_dir == str(run) and located.run_name == "decode-llama-tp8"
    assert located.run_spec == f"{run}/run_spec.json"
    assert located.serve_log == f"{run}/logs/serve.log"
    assert located.profile.output_dir == f"{run}/output"
    assert located.profile.device_ntff == p.device_ntff
    # once read, it is our manifest: it encodes and reads back as ours
    assert decode_manifest(encode_manifest(located)) == located


def test_seed_manifest_keeps_a_shared_key_and_ignores_unknown_ones() -> None:
    raw = {"recipe": "prefill_isolation", "profile": {"device_ntff": None},
           "neff_hashes": [], "run_spec": "/runs/p/run_spec.json", "instance": "trn2"}
    m = decode_manifest(json.dumps(raw).encode(), "/runs/p")
    assert m.run_spec == "/runs/p/run_spec.json" and m.phase == "prefill"
    assert m.profile.device_trace is None and m.profile.system_trace_pb is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"profile": {}}, "missing required field `recipe`"),
        ({"recipe": "decode_isolation"}, "missing required field `profile`"),
        ({"recipe": "decode_isolation", "profile": {"device_ntff": 5}}, "$.profile.device_ntff"),
        ({"recipe": "decode_isolation", "profile": {}, "neff_hashes": "abc"}, "$.neff_hashes"),
        ({"schema_version": 2, "recipe": "decode_isolation", "profile": {}},
         "schema_version 2 is not supported"),
    ],
)
def test_bad_manifests_are_refused_naming_why(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="profile manifest") as info:
        decode_manifest(json.dumps(raw).encode())
    assert message in str(info.value)


def test_validate_a_seed_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = plugin_run(tmp_path)
    report = validate_run(str(run))
    assert report.ok, report.failures
    assert any("Neuron plugin's form" in n and "no capture status" in n for n in report.notes)
    assert sum("not requested" in n for n in report.notes) == 2

    assert cli_main(["profile", "validate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "NOTE manifest.json is in the Neuron plugin's form" in out and f"{run}: ok" in out
    assert cli_main(["profile", "validate", "--json", str(run)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert cli_main(["profile", "show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "decode_isolation" in out and "status unrecorded" in out
    assert "device_profile_nc0.ntff" in out and "Neuron plugin's form" in out
    assert cli_main(["profile", "list", "--project-root", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["run_name"] == "decode-llama-tp8" and row["status"] == STATUS_UNRECORDED


def test_validate_reports_what_a_seed_run_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = plugin_run(tmp_path, "empty", ntff=b"", pb=b"")
    failures = validate_run(str(empty)).failures
    assert any(f.startswith("device trace") and "zero bytes" in f for f in failures)
    assert any("system trace" in f and "zero bytes" in f for f in failures)
    assert cli_main(["profile", "validate", str(empty)]) == 1
    assert "FAIL device trace" in capsys.readouterr().out

    null = plugin_run(tmp_path, "null")
    raw = json.loads((null / "manifest.json").read_text())
    raw["profile"]["device_ntff"] = None
    (null / "manifest.json").write_text(json.dumps(raw, indent=2))
    assert validate_run(str(null)).failures == [
        "device trace is null: no such artifact was written"]

    nospec = plugin_run(tmp_path, "nospec", with_spec=False)
    assert validate_run(str(nospec)).failures == [f"run_spec.json is missing from {nospec}"]


def test_seed_run_spec_reads(tmp_path: Path) -> None:
    """The guide defines run_spec.json with schema_version: it reads as ours, as is."""
    run = plugin_run(tmp_path)
    spec = decode_run_spec((run / "run_spec.json").read_bytes())
    assert (spec.schema_version, spec.recipe, spec.phase) == (1, "decode_isolation", "decode")
    assert spec.workload.concurrency == 4 and spec.serve_config.tensor_parallel_size == 8
    assert spec.model_env["XLA_IR_DEBUG"] == "1"


# -- our own files still read ---------------------------------------------------------------


def test_our_manifest_and_run_spec_round_trip(tmp_path: Path) -> None:
    layout = RunLayout.for_run(str(tmp_path), "ours")
    m = ProfileManifest(
        run_name="ours", recipe="decode_isolation", phase="decode", status="ok",
        run_dir=layout.run_dir, run_spec=layout.run_spec, serve_log=layout.serve_log,
        profile=ProfileArtifacts(profiler="neuron", output_dir=layout.output_dir,
                                 device_trace="/d.ntff", device_ntff="/d.ntff",
                                 activities=["device_profile"]),
        neff_hashes=["aa"], max_windows=3, windows=[Window(window=1, outcome="captured")],
        teardown=Teardown(pgid=1, signals=["SIGTERM"]), validation=Validation(ok=True),
        started_at="2026-01-01T00:00:00Z",
    )  # fmt: skip
    os.makedirs(layout.run_dir)
    store = open_store(layout.run_dir)
    write_manifest(store, m)
    data = store.read("manifest.json")
    assert data is not None and json.loads(data)["schema_version"] == 1
    assert decode_manifest(data) == m == read_manifest(store)
    assert decode_manifest(data, "/elsewhere") == m  # our paths are never replaced

    spec = RunSpec(run_name="ours", phase="decode", recipe="decode_isolation",
                   workload=Workload(concurrency=2), serve_config=ServeConfig(model="/m"),
                   profiler="neuron")  # fmt: skip
    assert decode_run_spec(encode_run_spec(spec)) == spec
    with pytest.raises(RecordError, match="^run_spec.json: has no schema_version"):
        decode_run_spec(b'{"run_name": "x"}')


def test_a_run_spec_in_another_tools_shape_is_a_note_and_the_artifacts_judge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory made by hand from the guide's tables: the run spec has the seven keys
    but a serve_config of another tool's shape (no ``model``)."""
    foreign = {"schema_version": 1, "run_name": "by-hand", "phase": "decode",
               "recipe": "decode_isolation", "workload": {"concurrency": 4},
               "serve_config": {"tp": 8, "engine": "other-tool"}, "model_env": {}}
    run = plugin_run(tmp_path, "by-hand")
    (run / "run_spec.json").write_text(json.dumps(foreign))
    report = validate_run(str(run))
    assert report.ok, report.failures
    assert any("guide's keys but not this tool's schema" in n and "model" in n
               for n in report.notes), report.notes
    assert cli_main(["profile", "validate", str(run)]) == 0
    assert "NOTE run_spec.json has the guide's keys" in capsys.readouterr().out
    # The same with a zero-byte device trace: the artifacts fail it.
    empty = plugin_run(tmp_path, "by-hand-empty", ntff=b"")
    (empty / "run_spec.json").write_text(json.dumps(foreign))
    assert any(f.startswith("device trace") and "zero bytes" in f
               for f in validate_run(str(empty)).failures)
    # Not the guide's shape at all: still a failure naming the file.
    broken = plugin_run(tmp_path, "broken")
    (broken / "run_spec.json").write_text(json.dumps({"hello": "world"}))
    assert any(f.startswith("run_spec.json cannot be read")
               for f in validate_run(str(broken)).failures)
