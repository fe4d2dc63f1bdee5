"""Store write/read/create of a small record vs the bare `os` calls, on local disk.

The baselines are the least a correct implementation must do: atomic write = write a
unique temp file + `os.replace`; read = `os.open` + `os.read` + `os.close`; exclusive
create = `os.open(O_CREAT | O_EXCL)` + `os.write` (which, unlike `store.create`, can
expose a half-written file). Reported as ratios of medians (ext4 starts writeback on a
rename over an existing file, which makes single rounds of the write case very noisy).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import uuid

from vllm_neuron.backends import Record, encode, open_store
from vllm_neuron.backends.mounts import filesystem_type

from ._harness import machine, measure, sized


class EntryMeta(Record, tag="entry-meta", frozen=True):
    key: str
    size: int
    sha256: str
    files: tuple[str, ...]


DATA = encode(
    EntryMeta(key="3f2a9c0d1e7b4a65", size=1_572_864, sha256="ab" * 32, files=("model.neff",))
)


def run(n: int, rounds: int, directory: str) -> dict[str, float]:
    store = open_store(os.path.join(directory, "store"), profile="local")
    bare_dir = os.path.join(directory, "bare")
    os.makedirs(os.path.join(bare_dir, "entries"))
    store.write("entries/meta.json", DATA)
    bare_path = os.path.join(bare_dir, "entries", "meta.json")
    with open(bare_path, "wb") as f:
        f.write(DATA)
    counter = itertools.count()

    def store_write(count: int) -> None:
        write = store.write
        for _ in range(count):
            write("entries/meta.json", DATA)

    def bare_write(count: int) -> None:
        for _ in range(count):
            tmp = f"{bare_path}.{uuid.uuid4().hex}.partial"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, DATA)
            finally:
                os.close(fd)
            os.replace(tmp, bare_path)

    def store_read(count: int) -> None:
        read = store.read
        for _ in range(count):
            read("entries/meta.json")

    def bare_read(count: int) -> None:
        for _ in range(count):
            fd = os.open(bare_path, os.O_RDONLY)
            try:
                os.read(fd, 1 << 16)
            finally:
                os.close(fd)

    def store_create(count: int) -> None:
        create = store.create
        for _ in range(count):
            create(f"created/{next(counter)}", DATA)

    def bare_create(count: int) -> None:
        base = os.path.join(bare_dir, "created")
        os.makedirs(base, exist_ok=True)
        for _ in range(count):
            fd = os.open(f"{base}/{next(counter)}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, DATA)
            finally:
                os.close(fd)

    pairs = {
        "atomic write": (store_write, bare_write, "store.write", "tmp + os.replace"),
        "read": (store_read, bare_read, "store.read", "os.open + os.read"),
        "create-if-absent": (store_create, bare_create, "store.create (tmp + link)", "O_EXCL"),
    }
    print(f"{len(DATA)}-byte record, {n:,} ops x {rounds} rounds, on {filesystem_type(directory)}:")
    results: dict[str, float] = {}
    for label, (ours_fn, base_fn, ours_name, base_name) in pairs.items():
        timings = measure({ours_name: ours_fn, base_name: base_fn}, n, rounds)
        ours, base = timings[ours_name], timings[base_name]
        print(f" {label}:")
        print(ours.line())
        print(base.line())
        ratio = ours.median / base.median
        overhead = 1e6 / ours.median - 1e6 / base.median
        print(
            f"  store/bare {ratio:.2f}x by median ({ours.best / base.best:.2f}x best/best);"
            f" overhead {overhead:+.1f} us/op"
        )
        results[label] = ratio
    assert store.read("entries/meta.json") == DATA
    return results


def main(argv: list[str] | None = None) -> int:
    """Run with defaults (as `python -m benchmarks` does) or with `argv`; reports, no goal."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_atomic_write", description=__doc__
    )
    parser.add_argument("--n", type=int, default=sized(20_000, 50), help="operations per round")
    parser.add_argument("--rounds", type=int, default=sized(5, 2))
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-atomic-") as directory:
        run(args.n, args.rounds, directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
