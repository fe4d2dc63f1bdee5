"""Per-executable capture: which forward is captured, and the capturer's place on the
execute path.

A :class:`SnapshotCapturer` wraps each loaded executable (installed through
``CompileRuntime.add_wrapper`` by :func:`install_snapshot_capture`, and only when capture
is enabled, so a disabled feature leaves the raw callable on the execute path); the
executables of one compilation hash share one capturer and one call counter. Per call:

1. no published forward context (warm-up): call through; nothing is counted;
2. the call gets its graph's next post-warm-up call index;
3. call-index rule OR the forward's token/request verdict; not selected: call through;
4. the process-global budget is reserved (one unit per forward);
5. the bundle is written around the call (:mod:`.bundle_writer`: inputs, run, outputs,
   ``meta.json`` last);
6. any failure leaves no bundle and gives the budget unit back; a snapshot root that cannot
   take files (full, read-only, refused) ends capture for the process with one warning
   naming the setting, and the forward is served; any other failure (a value that cannot be
   stored) raises :class:`SnapshotCaptureError`, aborting the forward;
7. a bundle written is announced to the ``on_bundle`` listener, if any (the assembly's: it
   names the bundle in the engine's manifest); a listener that fails is logged once.

Steps 1-4 run on every forward and stay cheap; what one executable captures and where is
its :class:`CaptureSpec` (:mod:`.capture_spec`), how tensors reach the store its writer
(:mod:`.tensor_writers`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_neuron.identity import RankInfo

from . import context as _context
from .bundle_writer import BundleWriter
from .capture_spec import CaptureSpec, resolve_capture_spec
from .config import RULE_CALL, RULE_ORDER, SnapshotConfig, snapshot_config
from .context import SnapshotForwardContext
from .context import next_forward_call as ctx_position
from .meta import CallMeta
from .tensor_writers import SnapshotWriter, default_writer

if TYPE_CHECKING:
    from vllm_neuron.compile.runtime import CompiledGraph, CompileRuntime

__all__ = ["BundleListener", "CapturedBundle", "SnapshotCapturer", "build_capturer",
           "install_snapshot_capture"]

logger = logging.getLogger("vllm_neuron.snapshot")


@dataclass(frozen=True)
class CapturedBundle:
    """A bundle just written: the snapshot root, its call prefix there, its record."""

    root: str
    prefix: str
    meta: CallMeta


BundleListener = Callable[[CapturedBundle], None]


class SnapshotCapturer:
    """Owns the per-forward capture decision for one executable; its bundles are written
    by a :class:`BundleWriter`."""

    def __init__(
        self,
        spec: CaptureSpec,
        *,
        writer: SnapshotWriter | None = None,
        graph: CompiledGraph | None = None,
        on_bundle: BundleListener | None = None,
    ) -> None:
        self.spec = spec
        self.bundles = BundleWriter(
            spec, writer if writer is not None else default_writer(), graph
        )
        self.calls = 0  # post-warm-up calls seen so far; the next call's index
        self.captured: list[str] = []  # call prefixes written by this capturer
        self.on_bundle = on_bundle
        self._warned_budget = False
        self._warned_listener = False
        selector = spec.config.selector
        self._all_calls = selector.all_calls
        self._at_calls = selector.at_calls or frozenset()
        self._forward_rules = selector.has_forward_rules

    @property
    def writer(self) -> SnapshotWriter:
        """The writer of this executable's tensors (recorded in each ``meta.json``)."""
        return self.bundles.writer

    @property
    def graph(self) -> CompiledGraph | None:
        """The compiled graph this capturer wraps, when it was built from one."""
        return self.bundles.graph

    # -- the execute path
    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with capture on its path: one global read when no forward is published."""
        ctx_module = _context
        run = self.run

        def snapshot_forward(*args: Any) -> Any:
            ctx = ctx_module._current
            if ctx is None:
                return fn(*args)
            return run(ctx, fn, args)

        snapshot_forward.__wrapped__ = fn  # type: ignore[attr-defined]
        snapshot_forward.capturer = self  # type: ignore[attr-defined]
        return snapshot_forward

    def select(self, ctx: SnapshotForwardContext, call_index: int) -> tuple[list[str], list[Any]]:
        """(rules that fired, row matches) for this executable's ``call_index``-th call."""
        selector = self.spec.config.selector
        verdict = ctx.verdict
        if verdict is None and selector.has_forward_rules:
            verdict = selector.evaluate_forward(
                ctx.req_ids, ctx.positions, ctx.is_decode, ctx.num_speculative_tokens
            )
        rules = set(verdict.selected_by) if verdict else set()
        if selector.selects_call(call_index):
            rules.add(RULE_CALL)
        matches = list(verdict.matches) if verdict else []
        return [r for r in RULE_ORDER if r in rules], matches

    def run(self, ctx: SnapshotForwardContext, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """One post-warm-up call: decide, and capture if selected."""
        call_index = self.calls
        self.calls = call_index + 1
        forward_call = ctx_position(ctx)
        # Fast path for the common case (nothing selected), without building any record.
        verdict = ctx.verdict
        if (
            not self._all_calls
            and call_index not in self._at_calls
            and (not verdict.selected_by if verdict is not None else not self._forward_rules)
        ):
            return fn(*args)
        selected_by, matches = self.select(ctx, call_index)
        if not selected_by:
            return fn(*args)
        budget = self.spec.budget
        if not budget.reserve(ctx.step):
            if budget.stopped is None and not self._warned_budget:
                self._warned_budget = True
                logger.info(
                    "vllm_neuron: snapshot budget of %d forwards used up; not capturing %s",
                    budget.max_captures,
                    self.spec.call_prefix(call_index),
                )
            return fn(*args)
        try:
            out, written = self.capture(ctx, call_index, selected_by, matches, fn, args,
                                        forward_call)  # fmt: skip
        except BaseException:
            budget.release(ctx.step)
            raise
        if written:
            budget.commit(ctx.step)
        else:
            budget.release(ctx.step)
        return out

    # -- the capture itself
    def capture(
        self,
        ctx: SnapshotForwardContext,
        call_index: int,
        selected_by: list[str],
        matches: Sequence[Any],
        fn: Callable[..., Any],
        args: Sequence[Any],
        forward_call: int | None = None,
    ) -> tuple[Any, bool]:
        """Write the bundle of this call around running ``fn`` (:mod:`.bundle_writer`);
        (``fn``'s result, whether the bundle was written)."""
        out, meta = self.bundles.capture_call(ctx, call_index, selected_by, matches, fn,
                                              args, forward_call)  # fmt: skip
        if meta is None:
            return out, False
        prefix = self.spec.call_prefix(call_index)
        self.captured.append(prefix)
        if self.on_bundle is not None:
            self._announce(self.on_bundle, CapturedBundle(self.spec.root, prefix, meta))
        return out, True

    def _announce(self, listener: BundleListener, bundle: CapturedBundle) -> None:
        """Tell the listener; the bundle is written whatever it does (logged once)."""
        try:
            listener(bundle)
        except Exception as exc:  # noqa: BLE001 - the forward and its bundle stand
            if not self._warned_listener:
                self._warned_listener = True
                logger.warning("vllm_neuron: the listener of snapshot bundles failed on %s/%s: "
                               "%s", bundle.root.rstrip("/"), bundle.prefix, exc)


# Integration --------------------------------------------------------------------------------


def build_capturer(
    graph: CompiledGraph,
    *,
    config: SnapshotConfig | None = None,
    ranks: RankInfo | None = None,
    writer: SnapshotWriter | None = None,
    on_bundle: BundleListener | None = None,
) -> SnapshotCapturer | None:
    """The capturer of one compiled executable, or None when it never captures."""
    spec = resolve_capture_spec(graph.key, config=config, ranks=ranks)
    if spec is None:
        return None
    return SnapshotCapturer(spec, writer=writer, graph=graph, on_bundle=on_bundle)


def install_snapshot_capture(
    runtime: CompileRuntime,
    config: SnapshotConfig | None = None,
    *,
    on_bundle: BundleListener | None = None,
) -> bool:
    """Wrap every executable ``runtime`` loads with a capturer, when capture is enabled.

    Disabled (the default), nothing is installed: executables are the raw callables.
    Called by ``build_runtime``; a malformed snapshot setting raises here, at start-up.
    ``on_bundle`` is called with every bundle written (in the capturing thread).
    """
    cfg = snapshot_config() if config is None else config
    if not cfg.enabled:
        return False
    # One capturer per compilation hash: identical graphs (the repeated layers of a
    # piecewise-compiled model) are one executable with one call counter, as one NEFF is
    # on the device, so their calls get distinct call indices instead of overwriting
    # each other's call<K> directory.
    capturers: dict[str, SnapshotCapturer | None] = {}
    lock = threading.Lock()

    def snapshot_wrapper(graph: CompiledGraph, fn: Callable[..., Any]) -> Callable[..., Any]:
        with lock:
            if graph.key not in capturers:
                capturers[graph.key] = build_capturer(graph, config=cfg, on_bundle=on_bundle)
            capturer = capturers[graph.key]
        return fn if capturer is None else capturer.wrap(fn)

    runtime.add_wrapper(snapshot_wrapper)
    return True
