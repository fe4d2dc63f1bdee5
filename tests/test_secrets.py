"""Secrets never reach a file: what counts as one, its redaction, and the files written.

The properties hold `redact_text` to its promise for any surrounding text; the rest sets
canary credentials in the environment (and in a profiled server's own environment), lets
the real writers write real files under ``tmp_path`` (a manifest and its ledger, a run
spec, a profile run's manifest, a snapshot bundle's ``meta.json``, a log file) and reads
every byte back looking for a canary.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_neuron import envs
from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.cli.format import print_json, table
from vllm_neuron.envs import (
    REDACTED,
    ConfigError,
    RedactingFilter,
    is_secret_name,
    redact_argv,
    redact_config,
    redact_environment,
    redact_text,
)
from vllm_neuron.envs.secrets import KNOWN_SECRET_NAMES
from vllm_neuron.manifest import LedgerWriter, emit_manifest
from vllm_neuron.manifest.config import config_from_mapping
from vllm_neuron.manifest.ledger import sanitize_compiler_flags
from vllm_neuron.profiling.artifacts import ProfileArtifacts
from vllm_neuron.profiling.capture import run_capture
from vllm_neuron.profiling.options import CaptureOptions
from vllm_neuron.profiling.run_record import ProfileManifest, read_manifest, write_manifest
from vllm_neuron.profiling.run_spec import (
    KVTransfer,
    Launch,
    RunSpec,
    ServeConfig,
    Workload,
    read_run_spec,
    serve_command,
    snapshot_model_env,
    write_run_spec,
)
from vllm_neuron.report.markup import esc
from vllm_neuron.snapshot.meta import CallMeta, InputSpec, read_call_meta, write_call_meta

AWS = "canary-aws-7f3e9a1b2c"
SESSION = "canary-session-55d0e1"
HF = "canary-hf-0c4d2e8f"
PASSWORD = "canary-pw-91ab77"
SERVER_ONLY = "canary-wandb-server-only-3e1f"  # in the server's --server-env, not ours
CANARIES = (AWS, SESSION, HF, PASSWORD, SERVER_ONLY)


@pytest.fixture
def canaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials set in this process's environment, as a deployment would have them."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION)
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("MY_SERVICE_PASSWORD", PASSWORD)
    monkeypatch.delenv("NEURON_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", f"test-{uuid.uuid4().hex[:12]}")


def assert_no_canary(root: Path) -> list[Path]:
    """Every file under `root`, read as bytes, holds no canary; returns the files read."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    for path in files:
        data = path.read_bytes()
        leaked = [c for c in CANARIES if c.encode() in data]
        assert not leaked, f"{path} holds {leaked}:\n{data.decode(errors='replace')}"
    return files


# What is a secret ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KNOWN_SECRET_NAMES) + [
    "MY_SERVICE_PASSWORD", "DB_PASS", "GITLAB_PRIVATE_TOKEN", "S3_SECRET_KEY", "apiKey",
    "hf_token", "--hf-token", "--api-key", "Authorization", "OAUTH_CLIENT", "X-Amz-Credential",
    "ssh_private_key", "db_passwd", "GPG_PASSPHRASE",
])  # fmt: skip
def test_credentials_are_secret_by_name(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "TOKENIZERS_PARALLELISM", "max_num_batched_tokens", "tokenizer", "PATH", "HF_HOME",
    "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "author", "XAUTHORITY", "passed", "BYPASS",
    "key", "public_key", "VLLM_NEURON_CACHE_TRUSTED_KEYS",
])  # fmt: skip
def test_ordinary_names_are_not(name: str) -> None:
    assert not is_secret_name(name)


def test_no_variable_of_this_package_is_a_secret() -> None:
    # Their values are paths, switches and sizes; a name that looked like a secret would be
    # redacted from manifests and hit ordinary text (NOT_SECRET_NAMES says which are not).
    assert [v.name for v in envs.ENVIRONMENT_VARIABLES if is_secret_name(v.name)] == []


# redact_text: properties ---------------------------------------------------------------------

SECRET_NAMES = st.sampled_from(sorted(KNOWN_SECRET_NAMES) + ["MY_SERVICE_PASSWORD",
                                                              "db_pass", "ServiceApiKey"])
# A value overlapping the marker (a "<", a ">", or a piece of "<redacted>") could not be
# told from it; no credential does, and a boolean word is not looked for in text.
SECRET_VALUES = st.text(st.characters(blacklist_characters="<>", blacklist_categories=["Cs"]),
                        min_size=8, max_size=40).filter(
    lambda v: v not in REDACTED and v.lower() not in ("true", "false", "none", "null"))
PLAIN = st.text(st.characters(whitelist_categories=["L", "N"], whitelist_characters=" _./,"),
                max_size=60)
PLAIN_NAMES = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,24}", fullmatch=True).filter(
    lambda n: not is_secret_name(n))


@given(name=SECRET_NAMES, value=SECRET_VALUES, parts=st.lists(st.text(), min_size=1, max_size=4))
def test_no_secret_value_survives_any_surrounding_text(name: str, value: str,
                                                       parts: list[str]) -> None:
    text = value.join(parts) + value
    assert value not in redact_text(text, {name: value})


@given(values=st.lists(SECRET_VALUES, min_size=2, max_size=4), text=st.text())
def test_several_secrets_overlapping_in_text_all_go(values: list[str], text: str) -> None:
    environ = {f"SECRET_{i}": v for i, v in enumerate(values)}
    mixed = text.join(values) + "".join(values) + text
    out = redact_text(mixed, environ)
    assert not [v for v in values if v in out]


@given(text=PLAIN, name=PLAIN_NAMES, value=PLAIN)
def test_text_and_variables_without_secrets_are_untouched(text: str, name: str,
                                                          value: str) -> None:
    environ = {name: value or "x"}
    assert redact_text(text, environ) == text
    assert redact_environment(environ, {}) == environ


@given(name=SECRET_NAMES, value=SECRET_VALUES, other=PLAIN_NAMES, text=st.text())
def test_an_environment_keeps_every_name_and_no_secret(name: str, value: str, other: str,
                                                       text: str) -> None:
    out = redact_environment({name: value, other: text + value + text}, {})
    assert list(out) == [name, other] and out[name] == REDACTED
    assert value not in out[other]


def test_unset_and_empty_values_stay_as_they_are() -> None:
    assert redact_environment({"HF_TOKEN": None, "AWS_SESSION_TOKEN": ""}, {}) == {
        "HF_TOKEN": None, "AWS_SESSION_TOKEN": ""}


def test_short_and_boolean_values_are_not_looked_for_in_text() -> None:
    environ = {"HF_HUB_TOKEN": "abc", "USE_AUTH": "true"}
    assert redact_text("abc is true", environ) == "abc is true"


# Free text, command lines, configs -----------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("s3://AKIAXYZ:wJalr/+secret@bucket/cache", "s3://<redacted>@bucket/cache"),
    ("https://user:p@ss@host:8080/path", "https://<redacted>@host:8080/path"),
    ("fetch https://tok@hub.example/m failed", "fetch https://<redacted>@hub.example/m failed"),
    ("https://h/f?X-Amz-Security-Token=abc&x=1", "https://h/f?X-Amz-Security-Token=<redacted>&x=1"),
    ("env HF_TOKEN=abc PATH=/bin", "env HF_TOKEN=<redacted> PATH=/bin"),
    ("serve --hf-token abc --port 8000", "serve --hf-token <redacted> --port 8000"),
    ("serve --api-key=abc --hf-token --port 1", "serve --api-key=<redacted> --hf-token --port 1"),
    ('{"hf_token": "abc", "model": "m"}', '{"hf_token": "<redacted>", "model": "m"}'),
    ("non-default args: {'hf_token': 'abc', 'port': 1}",
     "non-default args: {'hf_token': '<redacted>', 'port': 1}"),
    ("https://host/path and no credentials", "https://host/path and no credentials"),
    ("--max-num-batched-tokens 2048 --tokenizer t", "--max-num-batched-tokens 2048 --tokenizer t"),
])  # fmt: skip
def test_free_text(text: str, expected: str) -> None:
    assert redact_text(text, {}) == expected


def test_argv_redacts_the_value_of_a_secret_flag_in_both_forms() -> None:
    argv = ["python", "-m", "vllm", "--hf-token", "hf_abc123", "--api-key=sk-1234",
            "--token", "--port", "8000", "--model", "s3://AK:SE@bucket/llama",
            '{"kv_connector": "X", "password": "pw1234"}']  # fmt: skip
    assert redact_argv(argv, {}) == [
        "python", "-m", "vllm", "--hf-token", REDACTED, f"--api-key={REDACTED}",
        "--token", "--port", "8000", "--model", f"s3://{REDACTED}@bucket/llama",
        f'{{"kv_connector": "X", "password": "{REDACTED}"}}']  # fmt: skip


def test_argv_redacts_the_current_value_of_a_secret_variable_anywhere() -> None:
    assert redact_argv(["--note", f"x{HF}y"], {"HF_TOKEN": HF}) == ["--note", f"x{REDACTED}y"]


def test_config_redacts_by_key_and_keeps_what_is_no_secret() -> None:
    config = {"model_config": {"hf_token": "hf_abc", "model": "m", "tokenizer": "t",
                               "max_num_batched_tokens": 2048},
              "use_token": True,  # "use the cached token": not a secret itself
              "load_config": {"model_loader_extra_config": {
                  "credentials": {"id": "AK", "key": "SE"}, "s3_endpoint": "https://u:p@h"}},
              "args": ["--api-key", "k123"]}  # fmt: skip
    assert redact_config(config, {}) == {
        "model_config": {"hf_token": REDACTED, "model": "m", "tokenizer": "t",
                         "max_num_batched_tokens": 2048},
        "use_token": True,
        "load_config": {"model_loader_extra_config": {
            "credentials": {"id": REDACTED, "key": REDACTED},
            "s3_endpoint": f"https://{REDACTED}@h"}},
        "args": ["--api-key", REDACTED]}  # fmt: skip


def test_compiler_flags_in_the_ledger_lose_their_secrets() -> None:
    flags = "--target trn2 --auth-token abc123 --cache=s3://K:S@b/x -O1"
    assert sanitize_compiler_flags(flags) == (
        f"--target trn2 --auth-token {REDACTED} --cache=s3://{REDACTED}@b/x -O1")


def test_a_store_url_with_credentials_is_refused_naming_the_variable_not_the_secret() -> None:
    url = f"s3://AKIAEXAMPLE:{AWS}@bucket/cache"
    for load, name in ((envs.load_compile_cache_settings, "NEURON_LIBTORCH_REMOTE_CACHE"),
                       (envs.load_manifest_settings, "VLLM_NEURON_MANIFEST_DIR")):
        with pytest.raises(ConfigError, match=name) as raised:
            load({name: url})
        assert AWS not in str(raised.value) and "<redacted>@bucket" in str(raised.value)


# Files written with canary credentials set ---------------------------------------------------


def test_a_manifest_and_its_ledger_hold_no_secret(tmp_path: Path, canaries: None) -> None:
    manifests = tmp_path / "manifests"
    LedgerWriter(str(manifests)).record(
        "a" * 32, rank=0, input_shapes=["4,"],
        compiler_flags=f"--target trn2 --hf-token {HF} --remote=s3://AKIA:{AWS}@bucket/x")
    config = config_from_mapping({
        "model": f"s3://user:{PASSWORD}@models/llama", "target": "trn2",
        "neuron_config": {"note": f"session {SESSION}"},
        "vllm_config": {"model_config": {"hf_token": HF, "model": "llama"},
                        "load_config": {"model_loader_extra_config": {
                            "s3_secret_access_key": AWS}}},
    })  # fmt: skip
    manifest = emit_manifest(str(manifests), config, cache_root=None, prefix="nodev",
                             cleanup=False,
                             environment={"python": "3.11.7", "pkg": f"HF_TOKEN={HF}"})
    files = assert_no_canary(tmp_path)
    assert {p.name for p in files} >= {"manifest.json"} and any(
        p.suffix == ".jsonl" for p in files)  # the ledger segment is there, and read
    # The names stay: a reader sees what was set.
    assert manifest.config.vllm_config["model_config"] == {"hf_token": REDACTED,
                                                           "model": "llama"}
    assert manifest.config.model == f"s3://{REDACTED}@models/llama"
    assert manifest.environment["python"] == "3.11.7"


def test_a_run_spec_and_a_profile_manifest_hold_no_secret(tmp_path: Path,
                                                          canaries: None) -> None:
    serve = ServeConfig(
        model=f"https://user:{PASSWORD}@hub.example/llama",
        extra_args=["--hf-token", HF, f"--api-key={PASSWORD}", "--max-num-batched-tokens", "64"],
        env={"WANDB_API_KEY": SERVER_ONLY, "NOTE": f"wandb {SERVER_ONLY}",
             "VLLM_LOG_STATS_INTERVAL": "0.25"},
    )  # fmt: skip
    kv = KVTransfer(config={"kv_connector": "X", "kv_connector_extra_config": {
        "password": PASSWORD}}, reason="requested")  # fmt: skip
    spec = RunSpec(
        run_name="r1", phase="decode", recipe="decode_isolation", workload=Workload(),
        serve_config=serve, kv_transfer=kv,
        model_env=snapshot_model_env(["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "XLA_IR_DEBUG"]),
        launch=Launch(argv=serve_command(serve, kv), cwd=str(tmp_path)),
    )
    store = open_store(str(tmp_path / "run"))
    write_run_spec(store, spec)
    write_manifest(store, ProfileManifest(
        run_name="r1", recipe="decode_isolation", phase="decode", status="failed",
        error=f"server exited 1; last lines of serve.log:\nHF_TOKEN={HF} {AWS}",
        run_dir=str(tmp_path / "run"), run_spec="run_spec.json", serve_log="logs/serve.log",
        profile=ProfileArtifacts(profiler="torch", output_dir=str(tmp_path / "run" / "output")),
        fallback={"kv_transfer_config": kv.config},
    ))  # fmt: skip
    assert_no_canary(tmp_path)

    written = read_run_spec(store)
    assert written is not None
    assert written.model_env == {"AWS_SECRET_ACCESS_KEY": REDACTED, "HF_TOKEN": REDACTED,
                                 "XLA_IR_DEBUG": None}
    assert written.serve_config.env == {"WANDB_API_KEY": REDACTED, "NOTE": f"wandb {REDACTED}",
                                        "VLLM_LOG_STATS_INTERVAL": "0.25"}
    assert written.serve_config.extra_args == ["--hf-token", REDACTED, f"--api-key={REDACTED}",
                                               "--max-num-batched-tokens", "64"]
    assert written.launch is not None
    argv = written.launch.argv
    assert argv[argv.index("--hf-token") + 1] == REDACTED
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"] == {"password": REDACTED}
    # What is no secret is written as it was: a drift check still reads the configuration.
    assert written.serve_config.profiler_config == spec.serve_config.profiler_config
    assert written.workload == spec.workload
    profile = read_manifest(store)
    assert profile is not None and profile.error is not None
    assert f"HF_TOKEN={REDACTED}" in profile.error


def test_a_failed_capture_writes_and_logs_no_secret(tmp_path: Path, canaries: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A "server" that echoes its secrets and dies: the capture quotes its log in the error.
    for name in ("NEURON_PROJECT_ROOT", "VLLM_NEURON_VENV_PATH", "VLLM_NEURON_DIR", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    script = ("import os, sys; print('args', sys.argv, 'wandb', os.environ['WANDB_API_KEY'], "
              "'hf', os.environ['HF_TOKEN']); sys.exit(3)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines: list[str] = []
    result = run_capture(CaptureOptions(
        recipe="prefill", model=str(model), project_root=str(tmp_path / "project"),
        run_name="leak", profiler="torch", port=port, entrypoint=[sys.executable, "-c", script],
        extra_args=["--hf-token", HF], server_env={"WANDB_API_KEY": SERVER_ONLY},
        ready_timeout=30, teardown_grace=5,
    ), log=lines.append)  # fmt: skip
    assert result.exit_code != 0 and result.manifest.status == "failed"
    assert result.manifest.error is not None and "last lines" in result.manifest.error
    assert not [c for c in CANARIES if c in "\n".join(lines)], lines
    assert any(f"--hf-token {REDACTED}" in line for line in lines)
    # logs/serve.log is the server's own output, written by it directly (docs/trust.md).
    serve_log = Path(result.run_dir) / "logs" / "serve.log"
    assert SERVER_ONLY in serve_log.read_text()
    serve_log.unlink()
    assert_no_canary(tmp_path)


def test_a_snapshot_bundle_meta_holds_no_secret(tmp_path: Path, canaries: None) -> None:
    meta = CallMeta(
        compilation_hash="0123456789abcdef0123456789abcdef", format="npy", global_rank=0,
        tp_rank=0, dp_rank=0, call_index=0, selected_by=["request"],
        inputs=[InputSpec(index=0, kind="tensor", file="tensor0.npy", dtype="float32",
                          shape=[2], nbytes=8)],
        global_step=3, is_prompt=False, req_ids=["chatcmpl-1-abcdef01"], toolchain="host",
        target="cpu-inductor",
    )  # fmt: skip
    store = open_store(str(tmp_path / "snapshots"))
    write_call_meta(store, "0123456789abcdef0123456789abcdef/rank0/call0", meta)
    assert_no_canary(tmp_path)
    # Request ids and the rest are no secrets: kept as they were.
    assert read_call_meta(store, "0123456789abcdef0123456789abcdef/rank0/call0") == meta


def test_log_lines_through_our_handler_hold_no_secret(tmp_path: Path, canaries: None) -> None:
    path = tmp_path / "vllm_neuron.log"
    handler = logging.FileHandler(path)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("vllm_neuron.test_secrets")
    logger.addHandler(handler)
    try:
        logger.warning("remote s3://AKIA:%s@bucket unreachable (token %s)", AWS, HF)
        try:
            raise OSError(f"cannot open https://u:{PASSWORD}@host/x")
        except OSError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert_no_canary(tmp_path)
    assert f"s3://{REDACTED}@bucket unreachable (token {REDACTED})" in path.read_text()


def test_the_command_line_prints_no_secret(tmp_path: Path, canaries: None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    print_json({"compiler_args": ["--hf-token", HF], "private_key": "/keys/builder.key"})
    print(table(["WHAT", "VALUE"], [("compiler args", f"--api-key {PASSWORD}")]))
    assert main(["manifest", "show", str(tmp_path / f"missing-{AWS}")]) != 0
    out, err = capsys.readouterr()
    assert not [c for c in CANARIES if c in out + err]
    # Keys of command output name no variable: a key file's path is shown as it is.
    assert '"private_key": "/keys/builder.key"' in out


def test_the_report_page_shows_no_secret(canaries: None) -> None:
    page = esc(f"model s3://AK:{AWS}@bucket/m, error: token {HF}")
    assert page == f"model s3://{esc(REDACTED)}@bucket/m, error: token {esc(REDACTED)}"


def test_a_store_url_with_credentials_is_refused_anywhere_without_echoing_them() -> None:
    """On the command line too (not only in settings): the URL would end up in events."""
    import subprocess
    import sys

    from vllm_neuron.backends import InvalidLocation, check_location

    with pytest.raises(InvalidLocation, match="credentials in it is refused"):
        check_location("s3://AKIAXYZ:canary-cli-secret-77@bucket/cache")
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "ls",
                           "s3://AKIAXYZ:canary-cli-secret-77@bucket/cache"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "credentials in it is refused" in done.stderr
    assert "canary-cli-secret-77" not in done.stderr + done.stdout


def test_a_short_placeholder_is_not_taken_for_a_secret_in_text() -> None:
    """vLLM's usual OPENAI_API_KEY=EMPTY, or a 4-digit PIN, must not rewrite every EMPTY or
    1234 in a report's numbers and a listing's keys."""
    text = "EMPTY 1234 entries, 12345678 bytes"
    assert redact_text(text, {"OPENAI_API_KEY": "EMPTY", "MY_PIN_PASSWORD": "1234"}) == text
