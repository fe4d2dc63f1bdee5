"""What a cold start begins before its first graph is traced.

A host-mode compile worker spends its first seconds on start-up, not on the graph: torch,
vLLM's kernel library, and Inductor's CPU probe, which builds and loads test programs for
the vector ISA its kernels will use (about 2.5 s on an AMX host with a fresh Inductor cache,
0.3 s once its programs are there: toolchains/vector_isa.py); a node's first AOTInductor
compile also builds precompiled headers (about 5 s). On a cold start those seconds used to
come after the engine had traced its model, on the path to the first answer, once per
worker. Two head starts move them off it:

* vLLM's first process (the API server, when vLLM first asks the platform plugin for its
  platform - seconds before it loads the general plugins, and before any engine process
  exists) runs the probe and a tiny compile in a process of its own
  (`start_cpu_probe_if_cold`). What they build lands in Inductor's caches, which the engine
  processes and their workers share, while vLLM itself is still importing on one core.
* the process that will trace starts up to two compile workers once vLLM has set up its
  device (`CompileRuntime.start_compile_worker_if_cold`), so their start-up overlaps the
  model's loading - if it compiles in workers at all (a share of one slot compiles in
  place: `CompileRuntime.compiles_in_background`).

Both only on a node that is likely to compile: host mode, deferred compiles, a cache that
compiles (not disabled, not pre-compiled-only), and a local tier that holds no entry at all
(a new node, a fresh cache). A node with entries starts neither: a warm start must not pay
for them.

A new node of a deployment the fleet knows starts neither either: its graphs are on the
remote already (tiers/deployments.py: each rank that started records the keys it loaded, by
deployment), so it will fetch, not compile, and the probe and workers would only take the
cores vLLM loads the model on (measured: a new node 1.39x a warm restart's wall time, 2.3x
its CPU seconds, with them). The decision needs the deployment, which is known once vLLM has
built its configuration (`start_cpu_probe_if_cold`'s ``deployment``); when vLLM asks for its
platform, earlier, the probe starts only if the remote has no deployment recorded at all (a
fleet's first node, or no remote), and otherwise waits for the configuration. A rank of a
known deployment fetches its graphs in the background while the model loads instead
(`CompileRuntime.start_for_deployment`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, TypeVar

from vllm_neuron.envs import (
    CompileCacheSettings,
    ConfigError,
    cold_start_without,
    load_cpu_probe_marker,
    load_trust_settings,
    mark_cpu_probe_started,
)

from .tiers.deployments import DEPLOYMENTS_DIR, deployment_known
from .tiers.location import get_neuron_compile_cache_dir, holds_entries
from .toolchains.node_files import use_tier

if TYPE_CHECKING:
    from vllm_neuron.backends import Store

__all__ = ["PROBE_SAID", "fleet_knows", "likely_to_compile", "look_within", "quick_remote",
           "start_cpu_probe_if_cold", "started_by_an_ancestor"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")
T = TypeVar("T")

LOOK_SECONDS = 3.0
"""The most one request of `fleet_knows`'s look at an S3 remote may take."""
LOOK_DEADLINE = 10.0
"""The most a whole look at the remote at start-up may take (`look_within`), whatever the
remote: an NFS server that went away blocks its callers with no timeout at all."""
PROBE_SAID = 4000
"""How much of what a failed probe printed (its end: the traceback) is logged with it."""


def quick_remote(url: str) -> Store:
    """The remote tier at `url`, opened for a look at start-up: a guess must not hold a
    start up, so on S3 a few seconds at most per request (`LOOK_SECONDS`; a remote that is
    down costs this look, then the cache's own, as before). Makes no request."""
    from vllm_neuron.backends import open_store

    quick = ({"request_timeout": LOOK_SECONDS, "connect_timeout": LOOK_SECONDS}
             if url.startswith("s3://") else {})  # fmt: skip
    return open_store(url, create=False, **quick)


def look_within(look: Callable[[threading.Event], T], default: T, what: str,
                deadline: float = LOOK_DEADLINE) -> T:
    """`look(gave_up)`, run in a thread of its own and given `deadline` seconds; `default`
    (said, naming `what`) when it has not answered by then, or failed. A start-up's look at
    the remote is a guess that must never hold the start up: a call into a hung NFS mount
    never returns. The thread left blocked holds nothing (a daemon: it ends with the
    process), and `gave_up` is set for it: a look that writes stops there."""
    answer: list[T] = []
    gave_up = threading.Event()

    def run() -> None:
        try:
            answer.append(look(gave_up))
        except Exception as exc:  # noqa: BLE001 - a guess: the default, said
            logger.info("vllm_neuron: the remote tier's answer to %s failed (%s); this start "
                        "goes on without it", what, exc)  # fmt: skip

    try:
        look_thread = threading.Thread(target=run, daemon=True, name="vllm-neuron-remote-look")
        look_thread.start()
    except RuntimeError as exc:  # no thread left: no look either
        logger.info("vllm_neuron: %s was not made (%s)", what, exc)
        return default
    look_thread.join(deadline)
    alive = look_thread.is_alive()  # before the answer: one given meanwhile is then taken
    if answer:
        return answer[0]
    if alive:
        gave_up.set()
        logger.warning("vllm_neuron: the remote tier did not answer %s within %.0f s; this "
                       "start goes on without it", what, deadline)  # fmt: skip
    return default


def likely_to_compile(settings: CompileCacheSettings, local_dir: str, toolchain: str) -> bool:
    """Whether a process with these settings is likely to compile host graphs in workers:
    the host toolchain, deferred compiles, a cache that compiles, an empty local tier."""
    if toolchain != "host" or not settings.defer_compiles or settings.compile_workers < 1:
        return False
    if settings.disable_compile_cache or settings.disable_warmup_compile:
        return False
    return not holds_entries(local_dir)


def fleet_knows(settings: CompileCacheSettings, deployment: str | None, ranks: int = 1
                ) -> bool:  # fmt: skip
    """Whether the remote tier says this start will fetch rather than compile: with a
    `deployment`, every one of its `ranks` ranks is recorded (tiers/deployments.py); without
    one (not known yet), any deployment is. False without a remote, or when it cannot be
    read within `LOOK_DEADLINE` (a cold start's machinery is then started, as without this
    look)."""
    if not settings.remote_cache:
        return False
    return look_within(lambda _gave_up: _fleet_knows(settings, deployment, ranks), False,
                       "a look at its deployment records")


def _fleet_knows(settings: CompileCacheSettings, deployment: str | None, ranks: int) -> bool:
    assert settings.remote_cache
    try:
        if load_trust_settings().mode == "require":
            return False  # a record is not signed: under require, none is believed
    except ConfigError:
        return False  # the cache's own start says it, naming the setting
    try:
        from vllm_neuron.backends.errors import ListingTooLarge

        remote = quick_remote(settings.remote_cache)
        if deployment is not None:
            return deployment_known(remote, deployment, ranks)
        try:
            return bool(remote.list_dir(DEPLOYMENTS_DIR, max_names=1))
        except ListingTooLarge:
            return True  # more than one
    except Exception as exc:  # noqa: BLE001 - a head start's guess, never a need
        logger.info("vllm_neuron: the remote tier's deployments could not be read (%s); "
                    "this start is taken for a cold one", exc)  # fmt: skip
        return False


def start_cpu_probe_if_cold(settings: CompileCacheSettings, *, configured: bool = False,
                            deployment: str | None = None, ranks: int = 1,
                            ) -> subprocess.Popen[bytes] | None:  # fmt: skip
    """In the first process of a host-mode start: run Inductor's CPU probe now, in a process
    of its own, when this node is likely to compile (see the module). Once per start: the
    processes this one starts inherit _VLLM_NEURON_CPU_PROBE_STARTED and start none.
    `configured`: vLLM has built its configuration, which describes `deployment` (None when
    it could not be read) with `ranks` ranks; before that, a remote that records any
    deployment leaves the decision to the call that is configured (nothing is marked). The
    probe's process when it was started (reaped by a thread of this process)."""
    if started_by_an_ancestor(load_cpu_probe_marker()):
        return None
    if cold_start_without("probe"):  # the A/B benchmark's other side
        mark_cpu_probe_started()
        return None
    try:
        local_dir = get_neuron_compile_cache_dir(settings)
    except ConfigError:
        mark_cpu_probe_started()
        return None  # the cache's own start says it, naming the setting
    toolchain = "host" if settings.toolchain in ("auto", "host") else settings.toolchain
    if not likely_to_compile(settings, local_dir, toolchain):
        mark_cpu_probe_started()
        return None
    if not configured:
        if fleet_knows(settings, None):
            return None  # decided once the deployment is known
    elif deployment is not None and fleet_knows(settings, deployment, ranks):
        mark_cpu_probe_started()
        logger.info("vllm_neuron: the remote tier records every rank of this deployment: "
                    "no CPU probe ahead (its graphs are fetched, not compiled)")
        return None
    mark_cpu_probe_started()
    use_tier(local_dir)  # the probe's headers go into the tier (toolchains/node_files.py)
    try:
        # What it prints, kept nameless (nothing left in the temporary directory) and said
        # with its exit status if it fails: a probe broken by a torch change must say why.
        said = tempfile.TemporaryFile(prefix="vllm_neuron_cpu_probe_")  # noqa: SIM115
    except OSError as exc:
        logger.warning("vllm_neuron: Inductor's CPU probe not started ahead: %s", exc)
        return None
    try:
        probe = subprocess.Popen(
            [sys.executable, "-m", "vllm_neuron.compile.workers.process", "--probe",
             str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=said, stderr=said,
            start_new_session=True)  # a group of its own, with its compilers: process.py
    except OSError as exc:  # no process left: the workers probe for themselves
        said.close()
        logger.warning("vllm_neuron: Inductor's CPU probe not started ahead: %s", exc)
        return None
    # Reaped when it ends, so no zombie is left in a server that runs for weeks (without a
    # thread - a pids limit reached - `subprocess` reaps it at this process's next start of
    # one).
    try:
        threading.Thread(target=_reap, args=(probe, said), daemon=True,
                         name="vllm-neuron-cpu-probe").start()  # fmt: skip
    except RuntimeError:
        said.close()
    return probe


def started_by_an_ancestor(marker: int | None) -> bool:
    """Whether a start's marker (_VLLM_NEURON_CPU_PROBE_STARTED, _VLLM_NEURON_MODEL_INFO_LOOKED:
    a process id) names this process or one it descends from: a value inherited from
    anything else (a launcher that loaded vLLM's plugins itself, then started servers) does
    not stop this start's own."""
    if marker is None:
        return False
    pid = os.getpid()
    for _ in range(64):  # a process tree is not deeper; a loop in /proc's answers ends here
        if pid == marker:
            return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                pid = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid <= 1:
            return False
    return False


def _reap(probe: subprocess.Popen[bytes], said: IO[bytes]) -> None:
    """Wait for the probe; if it failed, log its exit status and the end of what it printed,
    once (the workers then probe for themselves, and a first job says its own failure)."""
    with said:
        try:
            status = probe.wait()
        except OSError:
            return
        if status == 0:
            return
        try:
            end = said.seek(0, os.SEEK_END)
            said.seek(max(0, end - PROBE_SAID))
            text = said.read().decode(errors="replace").strip()
        except OSError as exc:
            text = f"(its output could not be read: {exc})"
        logger.warning("vllm_neuron: Inductor's CPU probe ahead of the cold start failed "
                       "(exit status %s); the compile workers probe for themselves: %s",
                       status, text or "(it printed nothing)")  # fmt: skip
