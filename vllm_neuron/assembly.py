"""The assembly: builds the process's compile runtime from settings and plugs features in.

`compile` knows how to key, cache and load a graph, and offers two hooks (listeners and
executable wrappers); it knows no feature. This module is the one place that decides
which features listen: the manifest recorder (when VLLM_NEURON_MANIFEST_DIR is set), the
snapshot capturer (when snapshot capture is enabled) and, with both on, the link that names
each bundle written in the engine's manifest (`link_bundles`). Everything that needs "the"
runtime of this process (the torch.compile backend, vLLM's compiler adaptor, the worker
hooks, the demo) gets it here with `get_runtime`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.runtime import CompileRuntime
from vllm_neuron.compile.tiers.location import resolve_local_tier, writable_stand_in
from vllm_neuron.compile.toolchains.node_files import use_tier
from vllm_neuron.compile.toolchains.select import select_toolchain
from vllm_neuron.envs import (
    ConfigError,
    check_snapshot_root,
    compile_cache_settings,
    fault_settings,
    host_mode_settings,
    manifest_settings,
)
from vllm_neuron.manifest.recorder import install_recorder
from vllm_neuron.manifest.snapshot_links import SnapshotLinker
from vllm_neuron.snapshot.capture import CapturedBundle, install_snapshot_capture
from vllm_neuron.snapshot.config import SnapshotConfig, snapshot_config

logger = logging.getLogger("vllm_neuron")

_RUNTIME: CompileRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def build_runtime() -> CompileRuntime:
    """A runtime from the environment (parsed once by `vllm_neuron.envs`), features on.

    Every setting is resolved before anything is built, so a malformed one (a cache root,
    remote tier, manifest dir or snapshot root with a regular file in the way included)
    ends a plain ``torch.compile`` in a `ConfigError` naming the variable and its value.
    """
    fault_settings()  # VLLM_NEURON_FAULT (crash tests) armed before anything is written
    settings = compile_cache_settings()
    manifest_dir = manifest_settings().manifest_dir
    snapshots = snapshot_config()
    if snapshots.enabled:
        check_snapshot_root(snapshots.root)
    # Last of the settings: its probe writes (a malformed setting must refuse first).
    local_dir, bypassed = resolve_local_tier(settings)
    if bypassed is None and not settings.disable_compile_cache:
        use_tier(local_dir)  # the toolchain's node files: in the tier (node_files.py)
    read_only = list(settings.baked_caches)  # NEURON_LIBTORCH_BAKED_CACHE
    if bypassed is not None and local_dir and os.path.isdir(local_dir):
        # This user's own tier, that this process cannot write (a read-only image or
        # mount, no space): served from in place, never written, judged as any read-only
        # tier (by signature: it may be an image layer prepared elsewhere; tiers/baked.py).
        read_only.insert(0, local_dir)
        stand_in, why_not = writable_stand_in(settings)
        if stand_in is None:
            bypassed += f"; no writable place for this process's compiles either ({why_not})"
        else:
            logger.info("vllm_neuron: %s; the local compile cache is read-only for this "
                        "process: its entries are served in place and it is never written; "
                        "compiles, events and statistics go to %s", bypassed, stand_in)
            local_dir, bypassed = stand_in, None
    if bypassed is not None:
        if settings.disable_warmup_compile and not read_only:
            raise ConfigError(
                f"{bypassed}; VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 serves only pre-compiled "
                "graphs from the local tier, so nothing could be served"
            )
        # Hits need no writes: the read-only tiers still serve theirs.
        kept = f"; the read-only tiers {', '.join(read_only)} still serve their hits" if (
            read_only) else ""  # fmt: skip
        logger.warning("vllm_neuron: %s; the compile cache is bypassed for this process: "
                       "every graph is compiled and served, nothing is cached%s", bypassed,
                       kept)  # fmt: skip
        # A tier in memory that nothing is published to: the cache's events stay readable
        # in-process (metrics) and nothing touches the refused directory.
        local_dir = f"memory://vllm-neuron-bypassed-{os.getpid()}"
    name = settings.toolchain
    if name == "auto" and host_mode_settings().enabled:
        name = "host"  # vLLM runs on the host CPU: only host artifacts can run there
    toolchain = select_toolchain(name)
    cache = TwoTierCache(
        local_dir,
        remote=None if bypassed else settings.remote_cache,
        timeout=settings.compilation_timeout,
        disabled=settings.disable_compile_cache or bypassed is not None,
        precompiled_only=settings.disable_warmup_compile,
        toolchain=toolchain.name,
        target=toolchain.target,
        remote_write=settings.remote_write,
        remote_lease_seconds=settings.remote_lease_seconds,
        compile_retry_after=settings.compile_retry_after,
        max_size=settings.cache_max_size,
        compile_workers=settings.compile_workers,
        defer_compiles=settings.defer_compiles,
        read_only=read_only,
        writes_bypassed=bypassed is not None,
    )
    runtime = CompileRuntime(cache, toolchain)
    install_recorder(runtime, manifest_dir)
    install_snapshot_capture(runtime, snapshots, on_bundle=link_bundles(manifest_dir, snapshots))
    return runtime


def link_bundles(manifest_dir: str | None,
                 snapshots: SnapshotConfig) -> Callable[[CapturedBundle], None] | None:
    """With the manifest and input snapshots both on: each bundle written is named in the
    engine's manifest, on its graph (docs/manifest.md); else None (nothing listens)."""
    if not manifest_dir or not snapshots.enabled:
        return None
    linker = SnapshotLinker(manifest_dir, snapshots.root)

    def link(bundle: CapturedBundle) -> None:
        meta = bundle.meta
        linker.record(meta.compilation_hash, global_rank=meta.global_rank,
                      call_index=meta.call_index, call_prefix=bundle.prefix,
                      outputs=bool(meta.outputs))

    return link


def get_runtime() -> CompileRuntime:
    """The process's runtime, built on first use."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = build_runtime()
        return _RUNTIME


def reset_runtime(runtime: CompileRuntime | None = None) -> None:
    """Replace (or drop) the process's runtime; for tests and for re-reading settings."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        _RUNTIME = runtime
