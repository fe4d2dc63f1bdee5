"""A tier whose path torch's compile command line cannot carry (toolchains/node_files.py):
torch writes a compile's paths unquoted into one command line and splits it again, so node
files under a path with a space would fail every compile; such a tier's node files go to a
throwaway group instead, with one warning naming the tier. A real process, no compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_neuron.compile.toolchains.node_files import NODE_DIR, THROWAWAY_PREFIX

SHOW = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from vllm_neuron.compile.toolchains import node_files
print(node_files.group_dir(), flush=True)
"""


def test_a_tier_path_torch_would_cut_in_two_keeps_no_node_files(tmp_path: Path):
    local = tmp_path / "my cache" / "tier"
    local.mkdir(parents=True, mode=0o700)
    os.chmod(local.parent, 0o700)
    temp = tmp_path / "tmp"
    temp.mkdir(mode=0o700)
    env = {**os.environ, "_VLLM_NEURON_NODE_FILES": str(local / NODE_DIR), "TMPDIR": str(temp),
           "PYTHONPATH": os.getcwd()}
    env.pop("_VLLM_NEURON_SHARED_NODE_FILES", None)
    done = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    group = Path(done.stdout.strip())
    assert group.parent.name.startswith(THROWAWAY_PREFIX), group
    said = [line for line in done.stderr.splitlines() if "are kept in" in line]
    assert len(said) == 1 and "WARNING" in said[0] and str(local / NODE_DIR) in said[0]
    assert "command line" in said[0]
    assert not (local / NODE_DIR).exists()
    assert not any(temp.iterdir()), sorted(temp.rglob("*"))  # removed at exit
