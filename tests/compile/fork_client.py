"""A process that gets its compile worker from the fork server named in its environment and
hands it a real job, then waits to be killed (test_fork_server.py): the worker serves this
process, not its parent, and must exit with it, even mid-compile.

    python fork_client.py OUT_DIR   ->  prints {"job_dir", "started", "forked"} as one line
"""

from __future__ import annotations

import json
import sys

import torch

from vllm_neuron.compile.compile_workers import WorkerPool, prepare_job
from vllm_neuron.compile.toolchains.host import HostToolchain


def main(out_dir: str) -> int:
    pool = WorkerPool(idle_seconds=3600.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).eval()  # fmt: skip
    job = prepare_job(HostToolchain(), torch.fx.symbolic_trace(model), [torch.randn(4, 64)],
                      workers=1, pool=pool)  # fmt: skip
    assert job is not None
    print(json.dumps({"job_dir": job.job_dir, "started": pool.started, "forked": pool.forked}),
          flush=True)  # fmt: skip
    job.compile(out_dir)  # the test kills this process before it returns
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
