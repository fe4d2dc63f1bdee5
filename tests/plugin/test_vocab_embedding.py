"""The vocab-parallel embedding whose shard bounds are a buffer (`plugin/vocab_embedding.py`),
inside vLLM's own environment: one traced graph for every rank where vLLM's layer traces one
per rank, and the same outputs as vLLM's layer bit for bit; installed through vLLM's own
out-of-tree registry, once, and never over another platform's replacement.

The layers are built for one rank of a two-rank group without starting the other process:
the group object answers the rank and size, and its all-reduce returns this rank's share
(what the sum needs the other process for), the same for both layers compared. The real
two-process engine is tests/plugin/test_vllm_serve_tp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]

LAYERS = """
import json, sys
import torch
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm_neuron.plugin.vocab_embedding import RankIndependentVocabParallelEmbedding

class OneRankOfTwo:
    world_size = 2
    def __init__(self, rank):
        self.rank_in_group = rank
    def all_reduce(self, tensor):
        return tensor

VOCAB, DIM = 418, 8  # the tiny Llama's: rank 0 holds ids 0-223, rank 1 224-417
ADDED = int(sys.argv[1])  # added (LoRA) vocabulary beyond the original
torch.manual_seed(0)
ids = torch.cat([torch.arange(VOCAB + ADDED), torch.randint(0, VOCAB + ADDED, (37,))])
ids = ids.to(torch.int32)
out = {"graphs": {}, "equal": {}, "bounds": {}}
for rank in (0, 1):
    sizes = dict(num_embeddings=VOCAB + ADDED, embedding_dim=DIM, org_num_embeddings=VOCAB,
                 parallel_group=OneRankOfTwo(rank))
    stock = VocabParallelEmbedding(**sizes)
    ours = RankIndependentVocabParallelEmbedding(**sizes)
    assert type(stock) is VocabParallelEmbedding  # nothing registered in this process
    with torch.no_grad():
        stock.weight.normal_()
        ours.weight.copy_(stock.weight)
    out["bounds"][rank] = ours.vocab_shard_bounds.tolist()
    for name, layer in (("stock", stock), ("ours", ours)):
        codes = []
        def capture(gm, example_inputs, codes=codes):
            codes.append(gm.code)
            return gm.forward
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend=capture, fullgraph=True)
        eager, traced = layer(ids), compiled(ids)
        assert len(codes) == 1, codes
        out["graphs"][f"{name}{rank}"] = codes[0]
        out["equal"][f"{name}{rank}-traced"] = torch.equal(eager, traced)
        out[f"{name}{rank}"] = eager
    out["equal"][f"rank{rank}"] = torch.equal(out.pop(f"stock{rank}"), out.pop(f"ours{rank}"))
print("RESULT " + json.dumps(out))
"""

INSTALL = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm_neuron.plugin import vocab_embedding as ve

if sys.argv[1] == "other":
    @PluggableLayer.register_oot(name="VocabParallelEmbedding")
    class SomeoneElses(VocabParallelEmbedding):
        pass
print("INSTALLED", ve.install_rank_independent_embedding(), ve.install_rank_independent_embedding())
layer = VocabParallelEmbedding(64, 4, disable_tp=True)
print("BUILT", type(layer).__name__)
"""


def run(vllm_python: Path, script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([str(vllm_python), "-c", script, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# start, end, padding, added start, added end: vLLM's own shard indices of each rank
BOUNDS = {
    0: {"0": [0, 224, 0, 418, 418], "1": [224, 418, 30, 418, 418]},
    # 16 added ids (ids 418-433, rows after the original vocabulary's padding): rank 0's
    16: {"0": [0, 224, 0, 418, 434], "1": [224, 418, 30, 434, 434]},
}


@pytest.mark.parametrize("added", sorted(BOUNDS))
def test_one_graph_for_both_ranks_and_vllms_outputs_bit_for_bit(
    vllm_python: Path, added: int
) -> None:
    out = run(vllm_python, LAYERS, str(added))
    (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    graphs = result["graphs"]
    # vLLM's layer bakes each rank's range into its graph; this one takes it as an input.
    assert graphs["stock0"] != graphs["stock1"]
    assert graphs["ours0"] == graphs["ours1"]
    assert "vocab_shard_bounds" in graphs["ours0"]
    assert result["bounds"] == BOUNDS[added]
    assert all(result["equal"].values()), result["equal"]


def test_installed_through_vllms_registry_once(vllm_python: Path) -> None:
    out = run(vllm_python, INSTALL, "none")
    assert "INSTALLED True True" in out
    assert "BUILT RankIndependentVocabParallelEmbedding" in out
    assert out.count("shard bounds as a buffer") == 1


def test_another_platforms_replacement_is_kept_with_a_warning(vllm_python: Path) -> None:
    out = run(vllm_python, INSTALL, "other")
    assert "INSTALLED False False" in out
    assert "BUILT SomeoneElses" in out
    assert "is already replaced by __main__" in out and "one graph per rank" in out
