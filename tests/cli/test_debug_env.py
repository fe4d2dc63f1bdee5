"""`vllm-neuron debug env`: this machine as the compile cache sees it (what a bug report
needs), every setting with its value, origin and error; and every command refusing a
malformed setting it reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_neuron.cli import main
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.envs import ENVIRONMENT_VARIABLES, GROUPS, READ_VARIABLES, setting_rows


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "debug", "env", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_json_names_the_cpu_the_toolchain_and_what_enters_the_key() -> None:
    done = run("--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert found["torch"] == torch.__version__
    # No vLLM in the test environment: said, not an error.
    assert found["vllm"] is None and found["vllm_kernels"] == "vLLM not installed"
    assert found["toolchain"] == "host" and found["target"] == HostToolchain().target
    assert found["key_versions"] == HostToolchain().versions()
    assert found["compiler_args"] == []


def test_the_table_says_the_same() -> None:
    table = run()
    document = json.loads(run("--json").stdout)
    assert table.returncode == 0, table.stderr
    rows = dict(re.findall(r"^(\S.*?)  +(\S.*)$", table.stdout, re.M))
    assert rows["cpu_capability"] == document["cpu_capability"]
    assert rows["toolchain"] == document["toolchain"]
    for name, value in document["key_versions"].items():
        assert rows[f"key version {name}"] == value
    assert "enter every cache key" in table.stdout


CREDENTIALS = "AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIbPxRfiCYEXAMPLEKEY"


def test_every_setting_with_its_value_origin_and_error() -> None:
    """``VLLM_NEURON_CACHE_TRUST=requre`` used to pass ``debug env`` silently."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_NEURON", "NEURON_"))}
    env.update(VLLM_NEURON_CACHE_TRUST="requre", VLLM_NEURON_CACHE_MAX_SIZE="500M",
               NEURON_LIBTORCH_REMOTE_CACHE=f"s3://{CREDENTIALS}@bucket/x",
               VLLM_NEURON_COMPILE_WORKERS="none")  # two errors in one group: both shown
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "debug", "env", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 1, done.stderr  # a malformed setting is a problem found
    assert CREDENTIALS.split(":")[1] not in done.stdout  # redacted (envs/secrets.py)
    rows = {r["name"]: r for r in json.loads(done.stdout)["settings"]}
    assert set(rows) == set(READ_VARIABLES)  # every variable the package reads
    trust = rows["VLLM_NEURON_CACHE_TRUST"]
    assert (trust["value"], trust["source"]) == ("requre", "environment")
    assert "VLLM_NEURON_CACHE_TRUST='requre' is not one of off, warn, require" in trust["error"]
    size = rows["VLLM_NEURON_CACHE_MAX_SIZE"]
    assert (size["value"], size["source"], size["error"]) == ("500M", "environment", None)
    assert "credentials" in rows["NEURON_LIBTORCH_REMOTE_CACHE"]["error"]
    assert "VLLM_NEURON_COMPILE_WORKERS='none' is not a positive whole number" in rows[
        "VLLM_NEURON_COMPILE_WORKERS"]["error"]
    timeout = rows["NEURON_LIBTORCH_COMPILATION_TIMEOUT"]
    assert (timeout["value"], timeout["source"], timeout["error"]) == (None, "default", None)
    table = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "debug", "env"],
                           capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert table.returncode == 1 and CREDENTIALS.split(":")[1] not in table.stdout
    assert re.search(r"^VLLM_NEURON_CACHE_TRUST +requre +environment +VLLM_NEURON_CACHE_TRUST="
                     r"'requre' is not one of", table.stdout, re.M), table.stdout  # fmt: skip


def test_the_listing_knows_every_settings_group() -> None:
    assert {v.name for g in GROUPS.values() for v in g.variables} == {
        v.name for v in ENVIRONMENT_VARIABLES}


@pytest.mark.parametrize("argv,name,value,said", [
    (["cache", "stats"], "VLLM_NEURON_CACHE_TRUST", "requre", "is not one of"),
    (["cache", "gc", "--dry-run"], "VLLM_NEURON_CACHE_TRUST", "requre", "is not one of"),
    (["cache", "ls"], "VLLM_NEURON_CACHE_MAX_SIZE", "5X", "cannot parse size"),
    (["manifest", "show", "x"], "VLLM_NEURON_CACHE_MAX_SIZE", "5X", "cannot parse size"),
])  # fmt: skip
def test_every_command_refuses_a_malformed_setting_it_reads(
    argv: list[str], name: str, value: str, said: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv(name, value)
    code = main([*argv, *(["--cache-dir", str(tmp_path / "cache")] if argv[0] == "cache"
                          else [])])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"{name}={value!r}" in err and said in err, err


def test_the_rows_themselves_carry_no_secret() -> None:
    """Redacted where the rows are made, not only where a command prints them."""
    rows = {r.name: r for r in setting_rows(
        {"NEURON_LIBTORCH_REMOTE_CACHE": f"s3://{CREDENTIALS}@bucket/x", "HOME": "/h"})}
    value = rows["NEURON_LIBTORCH_REMOTE_CACHE"].value
    assert value is not None and "bucket/x" in value and CREDENTIALS.split(":")[1] not in value
