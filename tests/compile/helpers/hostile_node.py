"""A long-lived cache node for the hostile-remote model (tests/compile/flow/
test_hostile_remote_model.py), driven over a pipe: one JSON request a line on stdin, one
JSON answer a line on stdout (prefixed, so nothing else printed there is taken for one).

``python hostile_node.py BENIGN_SO`` - the node's trust comes from its environment
(VLLM_NEURON_CACHE_SIGNING_KEY / _TRUSTED_KEYS: a builder, a serving node under
``require``, or neither: trust off). Starting Python and importing the cache costs far more
than a cached get, so the model starts each node once and each example only names a fresh
local tier and remote location (``cache_dir``, ``remote``): the node opens a new
`TwoTierCache` when they change.

The test toolchain: a compile of a key writes the key's deterministic files
(`cache_workers.expected_files`) and ``kernel.so``, a copy of `BENIGN_SO` (a real shared
object built by the test). Serving a graph is what a runtime does: the entry's files are
checked against those bytes, and every ``*.so`` in the entry is loaded (``dlopen``, then
closed again), as a loader handed the entry would load it. A shared object the cache should
never have admitted (the adversary's canary) would so run its constructor in this process.

A request is asked the way vLLM asks after each failure on a restarted node: a
`CompileError` (a failure note stopped it) is retried every 50 ms for ``retry_for`` seconds;
the answer counts the refusals and how long they lasted.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback
from typing import Any

from cache_workers import entry_is_right, expected_files

PREFIX = "HOSTILE_NODE "
SO_NAME = "kernel.so"


def memory_kib() -> dict[str, int]:
    """This process's resident memory now (VmRSS) and at its peak (VmHWM), in KiB."""
    found: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                found[name] = int(value.split()[0])
    return found


def _load_shared_objects(path: str) -> int:
    """``dlopen`` every shared object of the entry at `path` (then close it); how many."""
    import _ctypes

    loaded = 0
    for root, _, names in os.walk(path):
        for name in sorted(names):
            if name.endswith(".so"):
                library = ctypes.CDLL(os.path.join(root, name))
                _ctypes.dlclose(library._handle)
                loaded += 1
    return loaded


class Node:
    def __init__(self, benign_so: str) -> None:
        with open(benign_so, "rb") as f:
            self.benign = f.read()
        self.cache: Any = None
        self.where: tuple[str, str] | None = None

    def _cache_for(self, request: dict[str, Any]) -> Any:
        from vllm_neuron.compile.flow.cache import TwoTierCache

        where = (request["cache_dir"], request["remote"])
        if where != self.where:
            self.cache = TwoTierCache(
                request["cache_dir"], remote=request["remote"],
                remote_options=request.get("remote_options") or {},
                timeout=float(request["timeout"]),
                remote_lease_seconds=float(request["lease_seconds"]),
                compile_retry_after=float(request["retry_after"]))  # fmt: skip
            self.where = where
        return self.cache

    def compile_fn(self, key: str) -> Any:
        def compile_into(out: str) -> dict[str, Any]:
            for name, data in [*expected_files(key).items(), (SO_NAME, self.benign)]:
                path = os.path.join(out, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
            return {"fake": True, "key": key}

        return compile_into

    def get(self, request: dict[str, Any]) -> dict[str, Any]:
        from vllm_neuron.compile.entry.outcomes import CompileError

        key = request["key"]
        cache = self._cache_for(request)
        start = time.monotonic()
        refused: list[float] = []
        errors: list[str] = []
        while True:
            try:
                result = cache.get_or_compile(key, self.compile_fn(key))
                break
            except CompileError as exc:  # a failure note stopped it: vLLM asks again
                refused.append(time.monotonic())
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                if time.monotonic() - start < float(request["retry_for"]):
                    time.sleep(0.05)
                    continue
                return {"ok": False, "error": errors[-1], "refused": len(refused),
                        "seconds": time.monotonic() - start}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - reported to the model
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-3000:],
                        "refused": len(refused), "seconds": time.monotonic() - start}
        wrong = entry_is_right(result.path, key)
        try:
            with open(os.path.join(result.path, SO_NAME), "rb") as f:
                if f.read() != self.benign:
                    wrong = wrong or f"{SO_NAME}: wrong bytes"
        except OSError as exc:
            wrong = wrong or f"{SO_NAME}: {exc}"
        loaded = _load_shared_objects(result.path)
        return {"ok": True, "source": result.source, "wrong": wrong, "loaded": loaded,
                "refused": len(refused), "seconds": time.monotonic() - start,
                "refused_for": refused[-1] - refused[0] if refused else 0.0,
                "first_error": errors[0] if errors else None}  # fmt: skip


def main(argv: list[str]) -> int:
    node = Node(argv[0])
    import vllm_neuron.compile.flow.cache  # noqa: F401 - imported before the baseline
    from vllm_neuron.backends import open_store

    open_store("s3://vllm-neuron-baseline/x")  # the S3 client's modules too (no request)
    print(PREFIX + json.dumps({"ready": os.getpid(), **memory_kib()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        answer = node.get(request) if request["op"] == "get" else {}
        answer.update(memory_kib())
        answer["id"] = request.get("id")
        print(PREFIX + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
