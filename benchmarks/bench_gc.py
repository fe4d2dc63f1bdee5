"""Garbage collection of a 10,000-entry remote (`vllm-neuron cache gc`, `compile/upkeep/collect.py`)
against a plain recursive listing of the same tree, in the same process: a folder and S3
on a moto server on loopback (started here; its requests counted with
`moto_s3_server(on_request=...)`).

The tree: ``--entries`` published entries of two small files each (``entry.json``, 100
bytes, and ``graph.bin``, 64 bytes), plus debris, 1 % of the entries each: abandoned
staging areas (folder) or versions never committed (S3), released leases, failure notes
past the cool-down; on S3 also 10 unfinished multipart uploads of one part. A folder is
written with plain file calls and its debris's times set seven hours back; on S3 every
object is a ``put_object`` through boto3, 16 threads (an entry: its version's two files,
then its commit record), and since S3 keeps its own times the collection runs with
``older_than=0`` (what ``--older-than 0s`` does): the debris is as old as the entries.

Measured, each the best of ``--rounds``:

- **listing** (the baseline): every file with its size and time - ``os.scandir``
  recursively with a ``stat`` per entry (folder); ``list_objects_v2`` pages through
  boto3 (S3);
- **plan**: `plan_gc` (``cache gc --dry-run``) of the tree with its debris;
- **plan, keep**: the same with ``keep`` = half the keys (``--keep-manifest``): which
  entries are unreferenced is decided from the same walk;
- **collect**: `GcPlan.execute` of that plan (once: it removes the debris);
- **plan, clean**: `plan_gc` once the debris is gone (the steady state: a tier gc'ed
  daily).

Targets: a plan of the clean tree costs at most twice the listing's wall time, and on S3
at most the listing's requests plus one (the listing of unfinished uploads); collecting
costs a bounded number of requests per item removed (reported).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from vllm_neuron.backends import open_store
from vllm_neuron.backends.records import encode
from vllm_neuron.backends.testing import moto_s3_server

from ._harness import machine, sized

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
REQUESTS = itertools.count()
HOURS = 3600.0
WALL_TARGET = 2.0  # plan of a clean tree / listing
THREADS = 16


def key_for(i: int) -> str:
    return f"9cbe7c{i:026x}"


def requests() -> int:
    return next(REQUESTS)


def lease_bytes(key: str) -> bytes:
    from vllm_neuron.backends.locks import LeaseRecord

    return encode(LeaseRecord(owner=f"node:1:{key[:8]}", generation=1, expires=0.0,
                              released=True))


def note_bytes() -> bytes:
    from vllm_neuron.compile.entry.failure_notes import FailureNote

    return encode(FailureNote(at=time.time() - HOURS, error="ValueError: old", pid=1,
                              host="node"))


def entry_json(key: str) -> bytes:
    return json.dumps({"key": key, "files": {"graph.bin": {"size": 64}}}).encode().ljust(100)


# ----------------------------------------------------------------------------- trees
def build_folder(root: str, entries: int) -> int:
    """The folder tree; returns how many debris items it holds."""
    past = time.time() - 7 * HOURS
    for i in range(entries):
        key = key_for(i)
        os.makedirs(os.path.join(root, key))
        with open(os.path.join(root, key, "entry.json"), "wb") as f:
            f.write(entry_json(key))
        with open(os.path.join(root, key, "graph.bin"), "wb") as f:
            f.write(b"g" * 64)
    debris = max(1, entries // 100)
    for i in range(debris):
        staging = os.path.join(root, ".staging", uuid.uuid4().hex)
        os.makedirs(staging)
        with open(os.path.join(staging, "graph.bin"), "wb") as f:
            f.write(b"half")
        for path in (os.path.join(staging, "graph.bin"), staging):
            os.utime(path, (past, past))
        lease = os.path.join(root, ".locks", key_for(i))
        os.makedirs(lease)
        with open(os.path.join(lease, "000000000001"), "wb") as f:
            f.write(lease_bytes(key_for(i)))
        os.utime(os.path.join(lease, "000000000001"), (past, past))
        os.makedirs(os.path.join(root, ".failures"), exist_ok=True)
        with open(os.path.join(root, ".failures", f"{key_for(i)}.json"), "wb") as f:
            f.write(note_bytes())
    return 3 * debris


def build_s3(client: Any, bucket: str, prefix: str, entries: int) -> int:
    """The S3 tree; returns how many debris items it holds."""
    debris = max(1, entries // 100)

    def entry(i: int) -> None:
        key, version = key_for(i), uuid.uuid4().hex
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}/.v/{version}/entry.json",
                          Body=entry_json(key))
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}/.v/{version}/graph.bin",
                          Body=b"g" * 64)
        record = {"type": "commit", "version": version, "committed_at": time.time(),
                  "empty": False}
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}/.commit",
                          Body=json.dumps(record).encode())
        if i < debris:
            orphan = key_for(entries + i)  # a promotion killed mid-upload
            client.put_object(Bucket=bucket, Body=b"half",
                              Key=f"{prefix}/{orphan}/.v/{uuid.uuid4().hex}/graph.bin")
            client.put_object(Bucket=bucket, Key=f"{prefix}/.locks/{key}/000000000001",
                              Body=lease_bytes(key))
            client.put_object(Bucket=bucket, Key=f"{prefix}/.failures/{key}.json",
                              Body=note_bytes())

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(entry, range(entries)))
    uploads = 10
    for i in range(uploads):
        key = f"{prefix}/{key_for(i)}/.v/{uuid.uuid4().hex}/graph.neff"
        started = client.create_multipart_upload(Bucket=bucket, Key=key)
        client.upload_part(Bucket=bucket, Key=key, UploadId=started["UploadId"],
                           PartNumber=1, Body=b"n" * 1024)
    return 3 * debris + uploads


def folder_listing(root: str) -> int:
    """The baseline: every file under `root` with its size and time."""
    count, stack = 0, [root]
    while stack:
        for entry in os.scandir(stack.pop()):
            entry.stat(follow_symlinks=False)  # size and time, as gc's walk has them
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            else:
                count += 1
    return count


def s3_listing(client: Any, bucket: str, prefix: str) -> int:
    """The baseline: every object under the prefix with its size and time."""
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                  Prefix=f"{prefix}/"):
        count += len(page.get("Contents", []))
    return count


# --------------------------------------------------------------------------- measuring
def timed(fn: Callable[[], Any], rounds: int) -> tuple[float, int, Any]:
    """Best wall time of `rounds` calls, the requests of one call, its result."""
    best, spent, result = float("inf"), 0, None
    for _ in range(rounds):
        before = requests()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
        spent = requests() - before - 1  # minus the counter read itself
    return best, spent, result


def measure(kind: str, store: Any, listing: Callable[[], int], entries: int, debris: int,
            rounds: int, *, count_requests: bool) -> bool:
    from vllm_neuron.compile.upkeep.collect import plan_gc

    keep = {key_for(i) for i in range(0, entries, 2)}
    base_s, base_req, files = timed(listing, rounds)
    plan_s, plan_req, plan = timed(
        lambda: plan_gc(store, older_than=0.0, lease_grace=0.0), rounds)
    keep_s, keep_req, keep_plan = timed(
        lambda: plan_gc(store, older_than=0.0, lease_grace=0.0, keep=keep), rounds)
    assert len(plan.items) == debris, (len(plan.items), debris, plan.items[:3])
    unreferenced = sum(1 for i in keep_plan.items if i.kind == "entry")
    assert unreferenced == entries - len(keep), unreferenced
    collect_s, collect_req, outcome = timed(plan.execute, 1)
    assert len(outcome.removed) == debris and not outcome.failed, outcome
    clean_s, clean_req, clean = timed(
        lambda: plan_gc(store, older_than=0.0, lease_grace=0.0), rounds)
    assert clean.items == (), clean.items[:3]
    clean_base_s, clean_base_req, clean_files = timed(listing, rounds)

    def req(n: int) -> str:
        return f"{n:>7,}" if count_requests else "      -"

    print(f"{kind}: {entries:,} entries, {files:,} files, {debris} debris items")
    print(f"  {'':<28} {'wall':>9} {'requests':>9}")
    for name, seconds, n in ((f"listing, {files:,} files", base_s, base_req),
                             ("plan, with debris", plan_s, plan_req),
                             (f"plan, keep {len(keep):,}", keep_s, keep_req),
                             (f"collect {debris} items", collect_s, collect_req),
                             (f"listing, {clean_files:,} files", clean_base_s, clean_base_req),
                             ("plan, clean tree", clean_s, clean_req)):
        print(f"  {name:<28} {seconds:>8.3f}s {req(n):>9}")
    ratio = clean_s / clean_base_s
    met = ratio <= WALL_TARGET
    line = (f"{kind}: gc plan / listing {ratio:.2f}x wall (clean tree; target <= "
            f"{WALL_TARGET:g}x; with debris {plan_s / base_s:.2f}x)")
    if count_requests:
        met = met and clean_req <= clean_base_req + 1
        line += (f", requests {clean_req} vs {clean_base_req} (target <= listing + 1; with "
                 f"debris {plan_req} vs {base_req}); collect: {collect_req / debris:.1f} "
                 "requests per item")
    print(line + (": met" if met else ": NOT MET"))
    return met


@contextmanager
def s3_env() -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in S3_ENV}
    os.environ.update(S3_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_gc", description=__doc__)
    parser.add_argument("--entries", type=int, default=sized(10_000, 200))
    parser.add_argument("--rounds", type=int, default=sized(3, 1))
    parser.add_argument("--only", choices=("folder", "s3"), default=None)
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    met = True
    if args.only in (None, "folder"):
        root = tempfile.mkdtemp(prefix="bench-gc-")
        try:
            start = time.perf_counter()
            debris = build_folder(root, args.entries)
            print(f"folder tree built in {time.perf_counter() - start:.1f} s")
            store = open_store(root)
            met &= measure("folder", store, lambda: folder_listing(root), args.entries,
                           debris, args.rounds, count_requests=False)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.only in (None, "s3"):
        import boto3

        with s3_env(), moto_s3_server(on_request=requests) as endpoint:
            client = boto3.client("s3", endpoint_url=endpoint)
            bucket, prefix = f"bench-gc-{uuid.uuid4().hex[:12]}", "compile-cache"
            client.create_bucket(Bucket=bucket)
            start = time.perf_counter()
            debris = build_s3(client, bucket, prefix, args.entries)
            print(f"S3 tree built in {time.perf_counter() - start:.1f} s")
            store = open_store(f"s3://{bucket}/{prefix}", endpoint_url=endpoint)
            met &= measure("S3", store, lambda: s3_listing(client, bucket, prefix),
                           args.entries, debris, args.rounds, count_requests=True)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
