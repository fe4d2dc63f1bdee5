"""The compile runtime: toolchain + two-tier cache, and the hooks features plug into.

`torch.compile(backend="vllm_neuron")` and vLLM's compiler adapter both come here: key
the graph, get its artifacts through the two-tier cache, load them, and tell whoever
listens what was compiled. Who listens is not this package's business: the assembly
(`vllm_neuron.assembly`) builds the process's runtime and plugs the features in
(the manifest recorder as a listener, the snapshot capturer as a wrapper).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from vllm_neuron.envs import cold_start_without, redact_config

from .entry.outcomes import CompileError, PendingCompile
from .flow.cache import CacheResult, TwoTierCache
from .tiers.build import CompileFn
from .tiers.deployments import deployment_keys, remember_keys
from .tiers.health import unwritable_cause
from .tiers.location import holds_entries
from .tiers.unpacked import load_entry
from .toolchains.base import (
    ARTIFACTS,
    CompiledArtifact,
    Toolchain,
    ToolchainError,
    ToolchainUnavailable,
)
from .toolchains.op_libraries import MissingOpLibrary
from .workers.job_dirs import warn_once
from .workers.pool import POOL, WorkerPool, prepare_job, start_worker_early

logger = logging.getLogger("vllm_neuron.compile")


@dataclass(frozen=True, kw_only=True)
class TracedGraph:
    """A graph as traced: what it is and its key, known before its artifacts are (a
    deferred compile's arrive at its first call). What listeners are told."""

    key: str
    components: dict[str, str]
    gm: Any
    example_inputs: Sequence[Any]
    compiler_flags: list[str]
    toolchain: Toolchain
    piece: str | None = None  # the piece of the model it is, when the caller named one


@dataclass(frozen=True, kw_only=True)
class CompiledGraph(TracedGraph):
    """A traced graph with its artifacts loaded: where they came from and what they are."""

    result: CacheResult
    artifact: CompiledArtifact


GraphListener = Callable[[TracedGraph], None]
ExecutableWrapper = Callable[[CompiledGraph, Callable[..., Any]], Callable[..., Any]]
"""Wraps a loaded executable (e.g. the snapshot capturer around each forward)."""


class CompileRuntime:
    """Keys, caches, loads; one per process (see `get_runtime`)."""

    def __init__(
        self,
        cache: TwoTierCache,
        toolchain: Toolchain,
        *,
        replica_groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.cache = cache
        self.toolchain = toolchain
        self.replica_groups = replica_groups
        self._listeners: list[GraphListener] = []
        self._wrappers: list[ExecutableWrapper] = []
        self.history: list[CompiledGraph] = []

    def add_listener(self, listener: GraphListener) -> None:
        """Call `listener` after every graph is compiled or loaded (best-effort)."""
        self._listeners.append(listener)

    def add_wrapper(self, wrapper: ExecutableWrapper) -> None:
        """Wrap every executable loaded from now on with `wrapper(graph, fn) -> fn`.

        Wrappers are how per-forward features (snapshot capture) sit on the execute path
        without the toolchains knowing about them; with none installed the loaded
        callable is returned as is, so a disabled feature costs nothing per forward.
        """
        self._wrappers.append(wrapper)

    def start_compile_worker_if_cold(self, pool: WorkerPool = POOL, *,
                                     tier_was_empty: bool | None = None) -> bool:  # fmt: skip
        """Start compile workers now (up to two of this process's share), before the engine
        traces its model, when this process is likely to compile its own graphs in workers
        (head_start.py: the host toolchain, deferred compiles, a cache that compiles, a
        local tier that holds no entry at all - `tier_was_empty`, when the caller looked
        earlier, else looked at now; `compiles_in_background`), so their start-up overlaps
        the model's loading. True when any was started."""
        cache = self.cache
        if cache.disabled or cache.precompiled_only or not cache.defer_compiles:
            return False
        if cold_start_without("early-workers"):  # the A/B benchmark's other side
            return False
        if tier_was_empty is None:
            tier_was_empty = not holds_entries(cache.local_dir)
        if not tier_was_empty or not self.compiles_in_background:
            return False
        return start_worker_early(self.toolchain, workers=cache.compile_share, pool=pool)

    def start_for_deployment(self, deployment: str | None, rank: int, pool: WorkerPool = POOL,
                             *, tier_was_empty: bool | None = None) -> str | None:  # fmt: skip
        """What this rank begins before the engine traces its model, once its device is set
        up (head_start.py): on a node whose local tier holds no entry, the graphs the remote
        records for this rank of `deployment` (tiers/deployments.py; not under trust mode
        ``require``: a record is not signed) are fetched in the background while the model
        loads, and no compile worker starts - they will be
        fetched, not compiled; without such a record, compile workers start early
        (`start_compile_worker_if_cold`). What it began, for the log: ``"fetch N"``,
        ``"workers"``, or None.

        `tier_was_empty`: whether the local tier held no entry when the caller looked, before
        this start's ranks could write there (looked at now when None). The ranks of one
        engine share the node's tier: a rank that looked once another had begun fetching
        would find that rank's entries and take a new node for a warm one."""
        cache = self.cache
        if cache.disabled:
            return None
        if tier_was_empty is None:
            tier_was_empty = not holds_entries(cache.local_dir)
        if not tier_was_empty:
            return None
        keys = None
        if deployment is not None and not cache.trust.requires:
            try:
                remote = cache.remote
                keys = None if remote is None else deployment_keys(remote, deployment, rank)
            except Exception as exc:  # noqa: BLE001 - a guess: a cold start's machinery then
                logger.info("vllm_neuron: the remote tier's record of this deployment could "
                            "not be read (%s); taken for a cold start", exc)  # fmt: skip
        if keys:
            cache.prefetch(keys)
            return f"fetch {len(keys)}"
        began = self.start_compile_worker_if_cold(pool, tier_was_empty=tier_was_empty)
        return "workers" if began else None

    def may_record_deployment(self) -> bool:
        """Whether this process, its start-up over, may tell the remote about its
        deployment: it may write there, and something it loaded came from a compile or the
        remote (a start served wholly by its local tier cannot tell a new node anything
        new, and reads nothing of the remote for it)."""
        cache = self.cache
        if cache.disabled or not cache.writes_remote:
            return False
        return not all(g.result.source in ("local", "memory", "baked") for g in self.history)

    def remember_deployment(self, deployment: str | None, rank: int) -> bool:
        """Record on the remote the keys this rank of `deployment` loaded, once its start-up
        is over (every graph loaded), when it may write there and any came from a compile or
        the remote (a start served wholly by its local tier found them recorded, or cannot
        tell a new node anything new); True when written. Never raises: the record is
        advice for the next new node, never a need."""
        cache = self.cache
        # The start-up is over: what the records' prefetch has not fetched is not waited for,
        # and what it fetched but this process never used is no longer kept from eviction.
        cache.prefetch_done()
        if deployment is None or not self.may_record_deployment():
            return False
        remote = cache.remote
        if remote is None:
            return False
        try:
            return remember_keys(remote, deployment, rank, [g.key for g in self.history])
        except Exception as exc:  # noqa: BLE001 - see above
            logger.warning("vllm_neuron: this deployment's keys were not recorded on the "
                           "remote tier: %s", exc)  # fmt: skip
            return False

    @property
    def compiles_in_background(self) -> bool:
        """Whether this process's pieces compile off its tracing thread (`begin`'s
        ``worker``): the Neuron toolchain's always (``neuronx-cc`` is a process of its own,
        run from a thread of the cache: minutes a graph, during which tracing goes on); the
        host toolchain's in compile workers only when this process may run more than one
        compile at once (its share of the node's slots, `workers/slots.py`). With a share of one -
        the ranks of a tensor-parallel engine that fill a small node's slots between them - a
        worker would compile its pieces one after another too, and would cost an
        interpreter's start-up (torch, vLLM's kernels: about 5 core-seconds, beside the
        engine's own start-up) and each graph's export to a file: the rank compiles them in
        place, on the cores vLLM gave it (as stock vLLM does), taking turns with its peers
        as before (measured: a 2-core TP=2 cold start 46 s with workers, 41 s in place)."""
        if self.toolchain.name != "host":
            return True
        # The A/B benchmark's other sides (benchmarks/bench_cold_start_ab.py).
        if cold_start_without("workers"):
            return False
        return self.cache.compile_share > 1 or cold_start_without("in-place")

    def compile_graph(self, gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Artifacts for `gm` from the cache (compiling on a miss), loaded as a callable."""
        return self.compile(gm, example_inputs)[0]

    def compile(
        self, gm: Any, example_inputs: Sequence[Any], *, piece: str | None = None
    ) -> tuple[Callable[..., Any], TracedGraph]:
        """`compile_graph`, plus the record of what happened: a `CompiledGraph` (key, cache
        source, artifact), or only the `TracedGraph` when the compile was deferred.

        Deferred (docs/compile-cache.md): when another process holds the graph's compile,
        or no compile slot of the node is free, the callable comes back at once and tracing
        goes on to the next graph; its first call waits for the holder's result and loads
        it (or takes the compile over, or raises the holder's error). Listeners hear of the
        graph now, at trace time, either way; wrappers wrap it once it is loaded.

        `piece` is the piece of the model the graph is, as the command line names it
        (vLLM's compiler adaptor passes ``Piece.label()``; this layer knows no manifest): it
        goes on the cache's compile events, so `cache stats` can count what tensor
        parallelism cost (a piece compiled to several keys), and on the graph records."""
        from .key.cache_key import compute_cache_key  # lazy: imports torch.fx, only when compiling

        toolchain = self.toolchain
        flags = toolchain.compiler_args()
        key = compute_cache_key(
            gm,
            example_inputs,
            toolchain_versions=toolchain.versions(),
            compiler_args=flags,
            target=toolchain.target,
            replica_groups=self.replica_groups,
        )

        # What the key was made of (cache explain; readers of the artifact ignore it), with
        # secrets redacted: the record is signed and published to the shared tier, and a
        # compiler flag may carry a token (the key's hash covers the flags as given).
        recorded_inputs = redact_config(msgspec.to_builtins(key.inputs), by_key=False)

        def compile_into(out_dir: str) -> dict[str, Any]:
            artifact = toolchain.compile(gm, example_inputs, out_dir)
            meta: dict[str, Any] = msgspec.to_builtins(artifact)
            meta["key_inputs"] = recorded_inputs
            return meta

        traced = TracedGraph(key=key.key, components=dict(key.components), gm=gm,
                             example_inputs=example_inputs, compiler_flags=flags,
                             toolchain=toolchain, piece=piece)  # fmt: skip
        def to_worker() -> tuple[CompileFn, Callable[[], None]] | None:
            job = prepare_job(toolchain, gm, example_inputs,  # exported here, while tracing
                              workers=self.cache.compile_share)
            if job is None:
                return None

            def compile_in_worker(out_dir: str) -> dict[str, Any]:
                meta: dict[str, Any] = msgspec.to_builtins(job.compile(out_dir))
                meta["key_inputs"] = recorded_inputs
                return meta

            return compile_in_worker, job.discard

        # A named piece comes from vLLM's piecewise backend, which compiles every piece
        # before it calls any: its own compiles go to workers too, when it may run several
        # at once (`compiles_in_background`). A plain torch.compile calls each graph at once,
        # and a worker would only add its start-up.
        in_workers = piece is not None and self.compiles_in_background
        outcome = self.cache.begin(key.key, compile_into, components=key.components,
                                   piece=piece, worker=to_worker if in_workers else None)
        if isinstance(outcome, PendingCompile):
            self._tell_listeners(traced)
            return DeferredGraph(lambda: self._loaded(traced, _result_of(outcome, traced),
                                                      compile_into)[0]), traced  # fmt: skip
        compiled, graph = self._loaded(traced, outcome, compile_into)
        self._tell_listeners(traced)
        return compiled, graph

    def _loaded(self, traced: TracedGraph, result: CacheResult, compile_into: CompileFn
                ) -> tuple[Callable[..., Any], CompiledGraph]:  # fmt: skip
        """Load `result`'s artifact (healing an entry that will not load), record it in
        `history` and wrap it."""
        try:
            artifact, compiled = self._load(result)
        except ToolchainError as exc:
            if not _entry_at_fault(result, exc):
                raise
            # An entry that verified but will not load (another build of a library, a
            # truncated artifact with the right checksum...): healed, never fatal.
            warn_once(f"vllm_neuron: compile cache entry {traced.key} ({result.source}) does "
                       f"not load here ({exc}); withdrawn, compiling the graph again")  # fmt: skip
            result = self.cache.heal_unloadable(result, str(exc), compile_into,
                                                components=traced.components, piece=traced.piece)
            artifact, compiled = self._load(result)
        graph = CompiledGraph(**{f.name: getattr(traced, f.name) for f in fields(TracedGraph)},
                              result=result, artifact=artifact)  # fmt: skip
        self.history.append(graph)
        for wrapper in self._wrappers:
            compiled = wrapper(graph, compiled)
        return compiled, graph

    def _tell_listeners(self, traced: TracedGraph) -> None:
        for listener in list(self._listeners):
            try:
                listener(traced)
            except Exception as exc:  # noqa: BLE001 - listeners are best-effort features
                logger.warning("vllm_neuron: graph listener %r failed: %s", listener, exc)

    def _load(self, result: CacheResult) -> tuple[CompiledArtifact, Callable[..., Any]]:
        artifact = ARTIFACTS.convert(
            result.record.meta, source=f"{self.cache.local_dir}/{result.key}/entry.json meta"
        )
        if result.path is None:
            raise RuntimeError(
                f"the local compile cache {self.cache.local_dir} is not on local disk; "
                "compiled artifacts can only be loaded from a local directory"
            )
        # From the verified unpacked copy of its package, where the toolchain loads one
        # (a hit then writes nothing to $TMPDIR): compile/tiers/unpacked.py.
        return artifact, load_entry(self.toolchain, self.cache.local, result, artifact,
                                    grew=self.cache.keep_within_bound,
                                    read_only=self.cache.read_only.holding(result),
                                    baked_copies=self.cache.read_only.copies_usable)


class DeferredGraph:
    """The callable of a deferred compile: its first call loads the graph (waiting for
    the holder if it has not finished), every call runs it. Thread-safe: concurrent first
    calls load once. A load that raises is tried again at the next call."""

    __slots__ = ("_fn", "_load", "_lock")

    def __init__(self, load: Callable[[], Callable[..., Any]]) -> None:
        self._load = load
        self._fn: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._fn is not None

    def __call__(self, *args: Any) -> Any:
        fn = self._fn
        if fn is None:
            with self._lock:
                if self._fn is None:
                    self._fn = self._load()
                fn = self._fn
        return fn(*args)


def _result_of(pending: PendingCompile, traced: TracedGraph) -> CacheResult:
    """A deferred graph's result; a failed compile - another process's or a worker's - is a
    `CompileError` naming the graph's key and piece, raised where the graph is first called."""
    try:
        return pending.result()
    except (CompileError, ToolchainError) as exc:
        if traced.piece is None or traced.piece in str(exc):
            raise
        raise CompileError(f"graph {traced.key} ({traced.piece}): {exc}") from exc


def _entry_at_fault(result: CacheResult, exc: ToolchainError) -> bool:
    """Whether a load failure is the entry's (healed by compiling again) rather than this
    process's: a graph compiled just now, a toolchain or kernel library this Python lacks,
    or a full or read-only disk where the loader unpacks are raised as they are."""
    if result.source in ("compiled", "uncached") or isinstance(exc, ToolchainUnavailable):
        return False
    return not isinstance(exc.__cause__, MissingOpLibrary) and unwritable_cause(exc) is None

