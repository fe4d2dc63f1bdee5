"""The worker of the garbage-collection fleet test (``python gc_workers.py JSON``): one
"node" that compiles, promotes and fetches continuously while `cache gc` runs.

Rounds: round ``r`` starts once the test has finished garbage-collection pass ``r``
(``<gc_dir>/pass-<r>``), so passes interleave with the work by handshake, never by timing.
Each round gets its keys through a fresh `TwoTierCache` (no memory hits) on the node's
own local tier and the shared remote, in fleet mode: a key no tier has is compiled once in
the fleet (the remote lease) and promoted, other nodes fetch it. After a round the node
withdraws its local copies, so a key the next round names again is fetched again. Every
entry got is checked byte for byte (`cache_workers.entry_is_right`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from cache_workers import (
    RESULT_PREFIX,
    SAFETY,
    _poll,
    _wait_for_go,
    entry_is_right,
    fake_compile,
)


def run_churn(args: dict[str, Any]) -> dict[str, Any]:
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.flow.cache import TwoTierCache

    local = open_store(args["cache_dir"])
    got: list[dict[str, Any]] = []
    _wait_for_go(args.get("barrier_dir"))
    try:
        for r, keys in enumerate(args["rounds"]):
            gate = os.path.join(args["gc_dir"], f"pass-{r}")
            _poll(lambda gate=gate: os.path.exists(gate), f"gc pass {r}")
            cache = TwoTierCache(
                local,
                remote=args["remote"],
                remote_options=args.get("remote_options"),
                timeout=SAFETY,
                remote_lease_seconds=float(args.get("remote_lease_seconds", 2.0)),
            )
            for key in keys:
                result = cache.get_or_compile(
                    key, lambda out, key=key: fake_compile(out, key=key, delay=0.05))
                assert result.path is not None
                got.append({"key": key, "round": r, "source": result.source,
                            "wrong": entry_is_right(result.path, key)})
            for key in keys:
                local.unpublish(key)  # the next round that names it fetches it again
    except Exception as exc:  # reported to the test, which fails on it
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(), "got": got}
    return {"ok": True, "got": got}


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(run_churn(json.loads(sys.argv[1]))), flush=True)
