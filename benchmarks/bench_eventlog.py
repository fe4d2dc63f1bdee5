"""Event-log append vs `json.dumps` + `write` + `flush`, one small record per line, on disk.

Both sides make every line reach the kernel before the next one (the baseline by
flushing, the event log by one `os.write` per record), so both survive `os._exit()`.
Target (issue 2): >= 3x the baseline and >= 300k lines/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from vllm_neuron.backends import Record, encode_line, open_store
from vllm_neuron.backends.mounts import filesystem_type

from ._harness import machine, measure, sized

TARGET_RATIO = 3.0
TARGET_RATE = 300_000


class GraphTraced(Record, tag="graph-traced", frozen=True):
    """Shaped like the ledger's records: a key, a rank and a tensor shape."""

    key: str
    rank: int
    shape: tuple[int, ...]


RECORD = GraphTraced(key="3f2a9c0d1e7b4a65", rank=3, shape=(4, 128, 4096))
AS_DICT = {"type": "graph-traced", "v": 1, "key": RECORD.key, "rank": 3, "shape": [4, 128, 4096]}


def run(n: int, rounds: int, directory: str) -> dict[str, float]:
    store = open_store(os.path.join(directory, "store"), profile="local")
    log = store.log("ledger", writer="bench")
    baseline_path = os.path.join(directory, "baseline.jsonl")
    baseline = open(baseline_path, "w", encoding="utf-8")  # noqa: SIM115 - closed below

    def eventlog_append(count: int) -> None:
        append, record = log.append, RECORD
        for _ in range(count):
            append(record)

    def json_write_flush(count: int) -> None:
        write, flush, dumps, data = baseline.write, baseline.flush, json.dumps, AS_DICT
        for _ in range(count):
            write(dumps(data) + "\n")
            flush()

    floor_fd = os.open(os.path.join(directory, "floor.jsonl"), os.O_WRONLY | os.O_CREAT)
    floor_line = encode_line(RECORD)

    def os_write_floor(count: int) -> None:
        write, fd, line = os.write, floor_fd, floor_line
        for _ in range(count):
            write(fd, line)

    timings = measure(
        {
            "EventLog.append (msgspec, one os.write)": eventlog_append,
            "json.dumps + f.write + f.flush": json_write_flush,
            "floor: os.write of a pre-encoded line": os_write_floor,
        },
        n,
        rounds,
    )
    baseline.close()
    os.close(floor_fd)
    log.close()
    # The benchmark must have done the real thing: every line is there and decodes.
    decoded = log.read([GraphTraced])
    expected_lines = n // 10 + n * rounds
    assert decoded.skipped == 0 and len(decoded.records) == expected_lines, (
        len(decoded.records),
        decoded.skipped,
    )
    ours, base, floor = timings.values()
    ratio = ours.best / base.best
    print(f"event-log append, {n:,} lines x {rounds} rounds, on {filesystem_type(directory)}:")
    for timing in timings.values():
        print(timing.line())
    print(f"  ratio (best/best) {ratio:.2f}x; median/median {ours.median / base.median:.2f}x")
    print(f"  EventLog.append reaches {ours.best / floor.best:.0%} of the bare os.write floor")
    ok = ratio >= TARGET_RATIO and ours.best >= TARGET_RATE
    print(
        f"  target >= {TARGET_RATIO:.0f}x and >= {TARGET_RATE:,} lines/s: "
        + ("met" if ok else "MISSED")
    )
    return {"ours": ours.best, "baseline": base.best, "ratio": ratio, "met": float(ok)}


def main(argv: list[str] | None = None) -> int:
    """Run with defaults (as `python -m benchmarks` does) or with `argv`; 1 if a goal is missed."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_eventlog", description=__doc__
    )
    parser.add_argument("--n", type=int, default=sized(200_000, 500), help="lines per round")
    parser.add_argument("--rounds", type=int, default=sized(5, 2))
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-eventlog-") as directory:
        result = run(args.n, args.rounds, directory)
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
