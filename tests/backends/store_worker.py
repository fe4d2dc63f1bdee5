"""A separate process acting on a store, for the race and crash tests.

    python store_worker.py '{"cmd": "create", "url": ..., "options": {...}, ...}'

Protocol on stdout, one JSON document per line: ``{"ready": ...}`` once the store is open
(and, for lock holders, the lock is held), then ``{"result": ...}``. Racing commands block
on stdin until the parent writes ``go``, so every process is past interpreter start-up
before any of them acts (and waiting costs no CPU). A rewriter stops when the ``stop``
file appears.

S3 endpoints come from the environment (``AWS_ENDPOINT_URL``), as in a deployment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from vllm_neuron.backends import Record, open_store


class RaceEvent(Record, tag="race-event", frozen=True):
    writer: int
    seq: int
    payload: str = ""


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def wait_for_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(f"worker: expected 'go' on stdin, got {line!r}")


def main(args: dict[str, Any]) -> None:
    store = open_store(args["url"], **args.get("options", {}))
    cmd = args["cmd"]
    me = int(args.get("id", 0))

    if cmd == "create":
        emit(ready=True)
        wait_for_go()
        won = [key for key in args["keys"] if store.create(key, b"winner-%d" % me)]
        emit(result=won)

    elif cmd == "publish":
        stagings = []
        for final in args["finals"]:
            staging = store.stage(final)
            # Every writer stages the same names with its own content.
            staging.write("a", b"%d" % me * 1000)
            staging.write("sub/b", b"writer %d" % me)
            staging.write(f"only-{me}", b"")
            stagings.append(staging)
        emit(ready=True)
        wait_for_go()
        emit(result=[s.final for s in stagings if s.commit()])

    elif cmd == "rewrite":
        size, values = int(args["size"]), [v.encode() for v in args["values"]]
        emit(ready=True)
        wait_for_go()
        writes = 0
        while not os.path.exists(args["stop"]):
            store.write(args["key"], values[writes % len(values)] * size)
            writes += 1
        emit(result=writes)

    elif cmd == "read":
        # Read for `seconds`, then on until every value was seen (at most 10x as long):
        # the check only means something if reads overlapped rewrites.
        size, values = int(args["size"]), {v.encode() for v in args["values"]}
        emit(ready=True)
        wait_for_go()
        start = time.monotonic()
        reads, seen, bad = 0, set(), []
        while True:
            elapsed = time.monotonic() - start
            if elapsed > float(args["seconds"]) * (1 if len(seen) == len(values) else 10):
                break
            data = store.read(args["key"])
            reads += 1
            if data is None or len(data) != size or data.count(data[:1]) != size:
                bad.append(None if data is None else [len(data), sorted(set(data))[:4]])
                continue
            if data[:1] not in values:
                bad.append(["unknown value", data[:1].decode()])
            seen.add(data[:1])
        result = {"reads": reads, "seen": sorted(v.decode() for v in seen), "bad": bad[:5]}
        emit(result={**result, "n_bad": len(bad)})

    elif cmd == "hold":
        lock = store.lock(args["name"], lease_duration=float(args.get("lease_duration", 30)))
        lock.acquire(timeout=30)
        emit(ready=True, generation=lock.generation, pid=os.getpid())
        time.sleep(3600)  # until SIGKILLed

    elif cmd == "log_and_exit":
        log = store.log(args["stream"])
        for seq in range(int(args["count"])):
            log.append(RaceEvent(writer=me, seq=seq, payload="x" * (seq % 50)))
        emit(ready=True, segment=log.segment_key)
        os._exit(0)  # no close, no flush, no atexit: every line must already be durable

    else:
        raise SystemExit(f"worker: unknown command {cmd!r}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
