"""vLLM's model information carried to a deployment's new nodes (vllm_neuron/plugin/
model_info.py), with vLLM's own files and vLLM's own reader, in the vLLM environment
(model_info_probe.py); no server is started. The serve tests show it in real starts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

PROBE = Path(__file__).with_name("model_info_probe.py")
FILE = "vllm-model_executor-models-llama-LlamaForCausalLM.json"


def test_a_new_node_gets_vllms_model_information_and_nothing_planted(
        vllm_python: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "NEURON_LIBTORCH_", "_VLLM_NEURON_"))}  # fmt: skip
    proc = subprocess.run([str(vllm_python), str(PROBE), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=vllm_python.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MODELINFO "))
    out = json.loads(line.removeprefix("MODELINFO "))
    # Node A's file is vLLM's, published once (the second publish finds the same bytes).
    assert out["a_files"] == [FILE]
    assert out["a_problem"] is None
    assert out["published"] == [1, 0]
    assert out["remote_same"]
    # Node B: vLLM reads nothing before, and its own reader finds the class after the copy
    # (no inspection subprocess); a second restore copies nothing (the directory has one).
    assert out["b_vllm_before"] is None
    assert out["b_restored"] == [1, 0]
    assert out["b_same"]
    assert out["b_vllm_after"] == "LlamaForCausalLM"
    # Planted files: each ignored with one warning naming it; the good one still copied.
    assert out["c_restored"] == 1
    assert out["c_files"] == [FILE]
    planted = ["junk-Junk", "wrong-fields-", "extra-field-", "other-class-", "nested-",
               "type-is-attention-free-", "type-supports-pp-", "type-attn-type-",
               "type-default-seq-pooling-type-", "type-score-type-",
               "type-supported-video-pruning-methods-", "arch-not-str-", "large-", "fifo-",
               "link-"]
    assert len(out["c_warnings"]) == len(planted), out["c_warnings"]
    for name in planted:
        assert sum(name in w for w in out["c_warnings"]) == 1, (name, out["c_warnings"])
    assert not any("not.a.vllm.name" in w for w in out["c_warnings"])
    # A node where vLLM has run keeps its own answers.
    assert out["d_restored"] == 0
    assert out["d_files"] == ["vllm-model_executor-models-opt-OPTForCausalLM.json"]
    # The registration's restore: from the remote set, once per start; said per file under
    # trust warn; none under require.
    assert out["e_restored"] == 1
    assert out["e2_restored_in_the_same_start"] == 0
    assert out["w_restored"] == 1
    assert len(out["w_warnings"]) == 1 and FILE in out["w_warnings"][0], out["w_warnings"]
    assert out["f_restored"] == 0
    assert not out["f_exists"]
