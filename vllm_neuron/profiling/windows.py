"""Profiling windows: the recipe run until one window's trace holds the phase.

Per server launch, up to ``max_windows`` windows run (docs/profiling.md). A torch-profiler
window is judged from its traces as soon as it closes, by the check validation runs
(`check_phase_traces`), so a window is retried on exactly the evidence validation would
reject. A rejected window's files are moved out of ``output/`` to
``windows/attempt<A>-window<W>/``, so no two windows' traces mix, and every window leaves
a record (`run_record.Window`).

Kept apart from `capture`, the run around the windows (launches, the decode fallback,
teardown, the manifest). ``output/`` is listed, moved and cleared through the run's store;
only the server is handed its real directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from vllm_neuron.backends import Store, join

from .artifacts import TORCH, collect
from .layout import OUTPUT_DIR, window_key
from .recipes import ProfilerControl, RecipeFailed, RecipeResult, WindowMissed
from .run_record import Window
from .run_spec import RunSpec
from .validate import check_phase_traces

RecipeRunner = Callable[[int], RecipeResult]
"""Runs the recipe for one window (its number); raises `WindowMissed` when it missed."""


class Windows:
    """The profiling windows of one capture, and the run's ``output/`` they write into."""

    def __init__(
        self,
        store: Store,
        run_dir: str,
        output_dir: str,
        *,
        profiler: str,
        phase: str,
        limit: int,
        log: Callable[[str], None],
    ) -> None:
        self.store = store  # the run directory's
        self.run_dir = run_dir
        self.output_dir = output_dir  # output/, as the server was handed it
        self.profiler = profiler
        self.phase = phase
        self.limit = limit
        self.log = log
        self.records: list[Window] = []
        # The latest window's: its trigger is set as soon as it fires (`armed`), so a
        # capture interrupted afterwards still records what armed it.
        self.result = RecipeResult()

    def capture(
        self, attempt: int, control: ProfilerControl, spec: RunSpec, run_recipe: RecipeRunner
    ) -> None:
        """Run windows until one's trace holds the phase, at most ``limit``.

        Raises `RecipeFailed` naming the setting when every window missed; the last
        window's files stay in ``output/`` so validation reports what was recorded.
        """
        last = ""
        for window in range(1, self.limit + 1):
            self.result = RecipeResult()
            control.timings = {}
            try:
                self.result = run_recipe(window)
            except WindowMissed as exc:
                last = exc.reason
                self.log(f"profiling window {window} of {self.limit} missed: {exc.reason}")
                self.records.append(self._record(control, attempt, window, "missed", last))
                continue
            failures, traces, steps = self.check(spec)
            if not failures:
                self.records.append(
                    self._record(control, attempt, window, "captured", "", traces, steps))
                if window > 1:
                    self.log(f"profiling window {window} of {self.limit} captured the phase")
                return
            last = "; ".join(failures)
            self.log(f"profiling window {window} of {self.limit} rejected: {last}")
            self.records.append(self._record(control, attempt, window, "rejected", last,
                                             traces, steps, set_aside=window < self.limit))
        raise RecipeFailed(
            f"none of {self.limit} profiling windows recorded the {self.phase} phase "
            f"(max_windows {self.limit}; raise it with --max-windows); last: {last}"
        )

    def armed(self, trigger: dict[str, Any]) -> None:
        self.result.trigger = trigger

    def check(self, spec: RunSpec) -> tuple[list[str], list[str], dict[str, list[str]]]:
        """The window just closed: its phase failures, its traces, their step names.

        Only torch-profiler traces can be read here: Neuron traces are flushed when the
        workers exit, so a Neuron window is accepted as is and checked after teardown.
        """
        found = collect(self.output_dir, self.profiler)
        traces = [t.path for t in found.traces]
        if self.profiler != TORCH:
            return [], traces, {}
        if not traces:
            return ["the profiler wrote no trace for the window"], traces, {}
        failures, steps = check_phase_traces(traces, spec, device_trace=found.device_trace)
        return failures, traces, steps

    def _record(
        self,
        control: ProfilerControl,
        attempt: int,
        window: int,
        outcome: str,
        reason: str,
        traces: list[str] | None = None,
        steps: dict[str, list[str]] | None = None,
        *,
        set_aside: bool = False,
    ) -> Window:
        """The window's record; with `set_aside`, its files are moved out of output/."""
        traces = list(traces or [])
        names = [name for path in traces for name in (steps or {}).get(path, [])]
        if set_aside:
            traces = self.set_aside(window_key(attempt, window), traces)
        return Window(
            window=window,
            attempt=attempt,
            outcome=outcome,
            reason=reason,
            trigger=self.result.trigger,
            traces=traces,
            steps=names,
            requests=dict(self.result.requests),
            timings=dict(control.timings),
        )

    def set_aside(self, key: str, traces: list[str]) -> list[str]:
        """Move everything in output/ to `key` of the run; returns where `traces` went."""
        for name in self.store.list_dir(OUTPUT_DIR):
            self.store.rename(join(OUTPUT_DIR, name), join(key, name))
        moved_to = os.path.join(self.run_dir, key)
        return [os.path.join(moved_to, os.path.relpath(p, self.output_dir)) for p in traces]

    def clear(self) -> None:
        """Empty output/, so that only the next launch's session can be found there."""
        for name in self.store.list_dir(OUTPUT_DIR):
            key = join(OUTPUT_DIR, name)
            with contextlib.suppress(OSError):
                if not self.store.delete(key):  # a directory
                    self.store.delete_tree(key)
