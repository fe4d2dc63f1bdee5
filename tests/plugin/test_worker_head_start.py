"""When the host worker looks at the node's local tier (plugin/worker.py): before its device
is set up, inside vLLM's own environment.

The ranks of one engine share the node's local tier, and setting a rank's device up joins it
to the others (their process group's rendezvous): no rank begins fetching before every rank
has begun setting up. A rank that looked after its set-up could find another rank's fetched
entries and take a new node for a warm one (begin nothing: the flaky TP=2 "new node" start).
Here vLLM's set-up is first shown to join the ranks (its call that does is replaced by one
that says so), then replaced by one that lands another rank's entry in the tier, and what the
worker hands on as "the tier was empty" is read back. No server, no process group.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]

INIT_DEVICE = """
import json, sys
from pathlib import Path
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir
from vllm_neuron.plugin import worker

tier = Path(get_neuron_compile_cache_dir())
handed_on = []

# The premise: vLLM's own set-up of a CPU worker's device joins the ranks (its distributed
# environment: the gloo group's rendezvous). A vLLM that moved that out of init_device would
# let a rank fetch before another looked.
import types
from vllm.v1.worker import cpu_worker

class Joined(Exception):
    pass

def join(*args, **kwargs):
    raise Joined

cpu_worker.init_worker_distributed_environment = join
bare = object.__new__(CPUWorker)
bare.vllm_config = types.SimpleNamespace(speculative_config=None)
bare.distributed_init_method, bare.rank, bare.local_rank = "tcp://127.0.0.1:9", 0, 0
try:
    CPUWorker.init_device(bare)
    joins = False
except Joined:
    joins = True

def set_up_device(self):  # meanwhile another rank's fetch lands in the node's tier
    (tier / ("a" * 32)).mkdir(parents=True, exist_ok=True)

def begin(vllm_config, rank, tier_was_empty):
    handed_on.append(tier_was_empty)
    return None, rank

CPUWorker.init_device = set_up_device
worker._begin_before_the_model_loads = begin
rank = object.__new__(worker.NeuronHostWorker)
rank.vllm_config, rank.rank, rank.model_runner = None, 1, None  # snapshots off: unused
rank.init_device()
now = sorted(p.name for p in tier.iterdir())
print("HANDED", json.dumps({"joins": joins, "empty": handed_on, "now": now}))
"""


def handed_on(vllm_python: Path, cache_root: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_CACHE_ROOT=str(cache_root),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([str(vllm_python), "-c", INIT_DEVICE], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("HANDED "))
    return json.loads(line.removeprefix("HANDED "))


def test_the_tier_is_looked_at_before_the_ranks_meet(vllm_python: Path, tmp_path: Path) -> None:
    # A new node: empty when looked at, though another rank's entry is there by the begin.
    assert handed_on(vllm_python, tmp_path / "new") == {
        "joins": True, "empty": [True], "now": ["a" * 32]}
    # A node whose tier held an entry before the start: a warm one.
    held = tmp_path / "warm" / "neuron" / "compile_cache" / ("b" * 32)
    held.mkdir(parents=True)
    assert handed_on(vllm_python, tmp_path / "warm") == {
        "joins": True, "empty": [False], "now": ["a" * 32, "b" * 32]}
