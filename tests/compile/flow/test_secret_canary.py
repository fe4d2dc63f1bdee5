"""A canary credential in the environment (``HF_TOKEN``) and in a compiler flag reaches no
file this package writes - the local tier, the remote tier's entries and notes, the
manifest and its ledger - and no log line, under both logging set-ups: logging configured
before the plugin is imported, and a handler added after (issue 39, docs/trust.md).

One fresh process per set-up compiles a real graph with the canary in an Inductor option
(a compiler flag: in the key, recorded redacted), publishes it to a folder remote, fails a
compile whose error quotes the canary (a failure note on both tiers), and emits a manifest
whose ledger lists the flags; then every byte it wrote is read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CANARY = "hf_canaryE2E7c41d9b05"

_SETUPS = {
    "logging configured before the plugin": """
import logging
logging.basicConfig(filename=LOG, level=logging.DEBUG)
import vllm_neuron
""",
    "a handler added after the plugin": """
import logging
import vllm_neuron
logging.getLogger().addHandler(logging.FileHandler(LOG))
logging.getLogger().setLevel(logging.DEBUG)
""",
}

_RUN = """
import os, torch
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.runtime import CompileRuntime
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.manifest import LedgerWriter, emit_manifest
from vllm_neuron.manifest.config import config_from_mapping

token = os.environ["HF_TOKEN"]

class Scale(torch.nn.Module):
    def forward(self, x):
        return (x * 2.5,)

cache = TwoTierCache(LOCAL, remote=REMOTE)
toolchain = HostToolchain(inductor_configs={"cpp.cxx": ("g++", token)})  # g++ is what runs
runtime = CompileRuntime(cache, toolchain)
_, compiled = runtime.compile(torch.fx.symbolic_trace(Scale()), [torch.zeros(2, 3)])

def fail(*args):
    raise ValueError(f"could not download the model with token {token}")

try:
    cache.get_or_compile("5ec2e75ec2e75ec2e75ec2e75ec2e7aa", fail)
except Exception as exc:
    logging.getLogger("vllm_neuron.compile").warning("the compile failed: %s", exc)
LedgerWriter(MANIFESTS).record(compiled.key, rank=0, input_shapes=["2,3"],
                               compiler_flags=f"--target cpu --hf-token {token} -O2")
emit_manifest(MANIFESTS, config_from_mapping({"model": "m", "target": "cpu",
              "vllm_config": {"model_config": {"hf_token": token}}}),
              cache_root=None, prefix="nodev", cleanup=False)
cache.wait_for_upkeep(timeout=120)
from vllm_neuron.backends import open_store
assert open_store(REMOTE).published(compiled.key) is not None  # promoted
print("DONE")
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("setup", sorted(_SETUPS))
def test_a_canary_in_the_environment_and_a_flag_reaches_no_file_note_or_log_line(
    tmp_path: Path, setup: str
) -> None:
    paths = {"LOG": tmp_path / "log.txt", "LOCAL": tmp_path / "local",
             "REMOTE": tmp_path / "remote", "MANIFESTS": tmp_path / "manifests"}  # fmt: skip
    script = "".join(f"{name} = {str(path)!r}\n" for name, path in paths.items())
    script += _SETUPS[setup] + _RUN
    env = {**os.environ, "HF_TOKEN": CANARY, "PYTHONPATH": str(ROOT),
           "VLLM_CACHE_ROOT": str(tmp_path / "cache"), "VLLM_NEURON_RUN_ID": "canary",
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=540, check=False)  # fmt: skip
    assert done.returncode == 0 and "DONE" in done.stdout, done.stderr[-4000:]

    log = paths["LOG"].read_text()
    assert "could not download the model" in log, log  # the lines reached the file
    notes = [p for p in paths["REMOTE"].rglob("*") if ".failures" in p.parts and p.is_file()]
    assert notes and all(b"could not download" in p.read_bytes() for p in notes), notes
    assert (paths["MANIFESTS"] / "nodev" / "manifest.json").is_file()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()
               and "xdg" not in p.parts]  # fmt: skip
    assert any(p.name == "entry.json" and "remote" in p.parts for p in written)
    leaked = [str(p) for p in written if CANARY.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert CANARY not in done.stdout + done.stderr
