"""One capture, end to end: run spec, launch, readiness, recipe, teardown, manifest.

The order is the contract:

1. ``run_spec.json`` is written (atomically, through the storage layer) **before** the
   server is launched, so it survives a launch or compile failure;
2. the server is launched in its own process group, logging to ``logs/serve.log``, and
   polled on ``/v1/models``;
3. the recipe runs in profiling windows (`windows`): each window's trace is checked for
   the phase before it is accepted, and a window that missed it is set aside
   (``windows/``) and the workload runs again, up to ``max_windows`` per launch (a decode
   capture may also relaunch once with the decode-only connector);
4. from a ``finally`` block, whatever happened (an error, Ctrl-C, SIGTERM): an owed
   ``/stop_profile`` is sent, ``manifest.json`` is written, the server's process group is
   torn down, and the manifest is rewritten with the teardown record, the artifacts found
   and the validation result. A second Ctrl-C during that block is ignored, so a capture
   cannot leak a device-holding server by being interrupted twice.

Secrets (`vllm_neuron.envs.secrets`) are redacted from everything the capture writes: the
run spec and the manifest when they are encoded, its own log lines (`run_capture`'s
``say``) and an error that quotes the server's log. The server's own ``logs/serve.log`` is
the server's output, written by it directly, and is not rewritten.

The run directory is a store, and the capture reads, lists and moves its files through it.
The two directories another program writes its own files into, the profiler's ``output/``
and the server's ``logs/``, are handed out by the store's door (`Store.local_output`) for as
long as a server may write there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from vllm_neuron.backends import open_store
from vllm_neuron.envs import environment_with, load_profiling_settings, redact_text
from vllm_neuron.version import __version__

from . import artifacts as artifacts_mod
from .client import HTTPFailure, VllmClient
from .layout import (
    LOGS_DIR,
    OUTPUT_DIR,
    SERVE_LOG,
    SERVE_LOG_NAME,
    RunLayout,
    attempt_log_key,
    check_room,
    default_run_name,
)
from .lifecycle import ReadyTimeout, ServerExited, ServerProcess
from .options import (
    FALLBACK_MODES,
    CaptureOptions,
    build_serve_config,
    build_workload,
    detect_profiler,
    server_environment,
)
from .recipes import (
    NeedsFallback,
    ProfilerControl,
    RecipeFailed,
    RecipeResult,
    decode_isolation,
    prefill_isolation,
)
from .run_record import Attempt, ProfileManifest, Teardown, Validation, write_manifest
from .run_spec import (
    DECODE,
    DEFAULT_MODEL_ENV,
    PHASES,
    PREFILL,
    KVTransfer,
    Launch,
    RunSpec,
    normalize_recipe,
    serve_command,
    snapshot_model_env,
    utc_now,
    write_run_spec,
)
from .signals import Interrupted, shielded, signals_interrupt
from .trace import TraceError, read_trace
from .validate import validate_run
from .windows import Windows

__all__ = ["CaptureOptions", "CaptureResult", "run_capture"]

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


@dataclass
class CaptureResult:
    run_dir: str
    manifest: ProfileManifest
    exit_code: int


class _Run:
    """The mutable state of one capture, folded into the manifest at the end."""

    def __init__(self, opts: CaptureOptions, log: Callable[[str], None]) -> None:
        self.opts = opts
        self.log = log
        self.recipe = normalize_recipe(opts.recipe)
        self.settings = load_profiling_settings(project_root=opts.project_root)
        self.run_name = opts.run_name or default_run_name(PHASES[self.recipe])
        self.layout = RunLayout.for_run(self.settings.project_root, self.run_name)
        check_room(self.layout.run_dir, self.settings.project_root)
        if open_store(self.layout.run_dir, create=False).list_dir(""):
            raise ValueError(
                f"run directory {self.layout.run_dir} already exists; choose another --run-name"
            )
        self.profiler = opts.profiler if opts.profiler != "auto" else detect_profiler()
        if opts.decode_fallback not in FALLBACK_MODES:
            raise ValueError(f"decode_fallback must be one of {FALLBACK_MODES}")
        if opts.max_windows < 1:
            raise ValueError(f"max_windows (--max-windows) must be at least 1, got "
                             f"{opts.max_windows}")
        self.workload = build_workload(opts, self.recipe)
        self.store = open_store(self.layout.run_dir)
        self.doors = contextlib.ExitStack()  # closed once the last server is gone
        self.output_dir = self.doors.enter_context(self.store.local_output(OUTPUT_DIR))
        logs = self.doors.enter_context(self.store.local_output(LOGS_DIR))
        self.serve_log = os.path.join(logs, SERVE_LOG_NAME)
        self.serve_config = build_serve_config(opts, self.profiler, self.output_dir)
        self.started_at = utc_now()
        self.t0 = time.monotonic()
        self.status = "running"
        self.error: str | None = None
        self.failed_stage: str | None = None
        self.stage = "setup"
        self.server: ServerProcess | None = None
        self.control: ProfilerControl | None = None
        self.attempts: list[Attempt] = []
        self.windows = Windows(self.store, self.layout.run_dir, self.output_dir,
                               profiler=self.profiler, phase=PHASES[self.recipe],
                               limit=opts.max_windows, log=log)
        self.kv_transfer: KVTransfer | None = None
        self.timings: dict[str, float] = {}
        self.versions: dict[str, str | None] = {
            "vllm_neuron": _own_version(),
            "python": sys.version.split()[0],
        }
        self.teardowns: list[Teardown] = []
        self.spec: RunSpec | None = None

    # -- run spec and launch ------------------------------------------------------------
    def write_spec(self, attempt: int) -> tuple[list[str], dict[str, str]]:
        argv = serve_command(self.serve_config, self.kv_transfer)
        env, prefix = server_environment(self.serve_config, self.settings)
        executable = shutil.which(argv[0], path=env.get("PATH"))
        self.spec = RunSpec(
            run_name=self.run_name,
            phase=PHASES[self.recipe],
            recipe=self.recipe,
            workload=self.workload,
            serve_config=self.serve_config,
            model_env=snapshot_model_env([*DEFAULT_MODEL_ENV, *self.opts.model_env]),
            profiler=self.profiler,
            kv_transfer=self.kv_transfer,
            launch=Launch(
                argv=argv,
                cwd=self.settings.vllm_neuron_dir,
                path_prefix=prefix,
                executable=executable,
                attempt=attempt,
            ),
            project_root=self.settings.project_root,
            created_at=utc_now(),
        )
        write_run_spec(self.store, self.spec)
        return argv, env

    def launch(self, attempt: int) -> None:
        argv, env = self.write_spec(attempt)
        self.stage = "launch"
        self.log(f"launching (attempt {attempt}): {' '.join(argv)}")
        self.server = ServerProcess.launch(
            argv, env=env, cwd=self.settings.vllm_neuron_dir, log_path=self.serve_log
        )
        self.log(f"server pid {self.server.pid}, process group {self.server.pgid}; "
                 f"log {self.layout.serve_log}")
        self.stage = "ready"
        client = VllmClient(self.serve_config.base_url, self.serve_config.request_model)
        waited = self.server.wait_ready(client.models_url, timeout=self.opts.ready_timeout)
        self.timings[f"ready_s_attempt{attempt}"] = round(waited, 3)
        self.versions["vllm"] = client.version()
        self.log(f"server ready after {waited:.1f} s")
        self.control = ProfilerControl(
            client,
            start_timeout=self.opts.start_profile_timeout,
            stop_timeout=self.opts.stop_profile_timeout,
        )

    # -- the recipe ------------------------------------------------------------------------
    def run(self) -> None:
        attempt = 1
        if self.recipe == DECODE and self.opts.decode_fallback == "always":
            self.kv_transfer = KVTransfer(
                config=dict(self.opts.decode_connector),
                reason="requested (--decode-fallback always)",
            )
        while True:
            self.launch(attempt)
            assert self.server is not None and self.control is not None
            assert self.spec is not None
            self.stage = "capture"
            t = time.monotonic()
            try:
                self.windows.capture(attempt, self.control, self.spec, self.run_recipe)
            except NeedsFallback as exc:
                if self.opts.decode_fallback == "never" or self.kv_transfer is not None:
                    raise RecipeFailed(f"decode arming never fired: {exc.reason}") from None
                self.log(f"decode trigger cannot fire ({exc.reason}); falling back to the "
                         f"decode-only connector {self.opts.decode_connector}")
                self.finish_attempt(attempt, "fallback", exc.reason)
                self.kv_transfer = KVTransfer(config=dict(self.opts.decode_connector),
                                              reason=exc.reason)
                attempt += 1
                continue
            self.timings["capture_s"] = round(time.monotonic() - t, 3)
            self.attempts.append(self._attempt_record(attempt, "captured", ""))
            self.status = "ok"
            return

    def run_recipe(self, window: int) -> RecipeResult:
        assert self.control is not None
        if self.recipe == PREFILL:
            return prefill_isolation(
                self.control.client, self.control, self.workload,
                request_timeout=self.opts.request_timeout, window=window,
            )
        return decode_isolation(
            self.control.client,
            self.control,
            self.workload,
            log_store=self.store,
            log_key=SERVE_LOG,
            connector_mode=self.kv_transfer is not None,
            patience=self.opts.fallback_patience,
            tick_seconds=self.opts.stats_interval,
            request_timeout=self.opts.request_timeout,
            window=window,
            log=self.log,
            on_armed=self.windows.armed,
        )

    def _attempt_record(self, attempt: int, outcome: str, reason: str) -> Attempt:
        return Attempt(
            attempt=attempt,
            kv_transfer=self.kv_transfer.config if self.kv_transfer else None,
            outcome=outcome,
            reason=reason,
            serve_log=self.layout.serve_log,
            pgid=self.server.pgid if self.server else None,
        )

    def finish_attempt(self, attempt: int, outcome: str, reason: str) -> None:
        """Tear down a failed attempt's server and keep its log beside the next one."""
        kept = self.layout.attempt_log(attempt)
        with shielded(self.log, reraise=True):  # a Ctrl-C here ends the run after teardown
            self.teardown()
        with contextlib.suppress(OSError):
            self.store.rename(SERVE_LOG, attempt_log_key(attempt))
        record = self._attempt_record(attempt, outcome, reason)
        self.attempts.append(msgspec.structs.replace(record, serve_log=kept))
        # Nothing was armed in this attempt, but clear the output so only one session
        # (the fallback's) can be found there.
        self.windows.clear()

    # -- the finally block -----------------------------------------------------------------
    def stop_owed_profile(self) -> None:
        if self.control is None or not self.control.active:
            return
        if self.server is None or self.server.returncode() is not None:
            self.control.active = False
            return
        try:
            self.control.stop(timeout=min(self.opts.stop_profile_timeout, 60.0))
        except HTTPFailure as exc:
            self.log(f"stop_profile during cleanup failed: {exc}")

    def write_early_manifest(self) -> None:
        write_manifest(self.store, self.manifest(final=False))

    def teardown(self) -> None:
        if self.server is None:
            return
        rec = self.server.teardown(grace=self.opts.teardown_grace)
        self.teardowns.append(
            Teardown(pgid=rec.pgid, signals=rec.signals, exit_code=rec.exit_code,
                     seconds=rec.seconds, survivors=rec.survivors, error=rec.error,
                     clean=rec.clean)
        )
        self.log(f"teardown of process group {rec.pgid}: signals {rec.signals or 'none'}, "
                 f"exit code {rec.exit_code}, {rec.seconds:.1f} s"
                 + (f", SURVIVORS {rec.survivors}" if rec.survivors else "")
                 + (f", killed outside its group: {rec.strays}" if rec.strays else ""))
        self.server = None

    def manifest(self, *, final: bool, validation: Validation | None = None) -> ProfileManifest:
        activities = self.opts.activities if self.profiler == artifacts_mod.NEURON else []
        found = artifacts_mod.collect(self.output_dir, self.profiler, activities=activities)
        executed: list[str] = []
        if self.profiler == artifacts_mod.TORCH and found.device_trace and final:
            with contextlib.suppress(TraceError, OSError):
                executed = [s.name for s in read_trace(found.device_trace).steps]
        timings = dict(self.timings)
        if self.control is not None:
            timings.update(self.control.timings)
        timings["total_s"] = round(time.monotonic() - self.t0, 3)
        return ProfileManifest(
            run_name=self.run_name,
            recipe=self.recipe,
            phase=PHASES[self.recipe],
            status=self.status,
            error=self.error,
            failed_stage=self.failed_stage,
            run_dir=self.layout.run_dir,
            run_spec=self.layout.run_spec,
            serve_log=self.layout.serve_log,
            profile=found,
            neff_hashes=found.neff_hashes,
            executed_graphs=executed,
            trigger=self.windows.result.trigger,
            fallback=(
                {"kv_transfer_config": self.kv_transfer.config, "reason": self.kv_transfer.reason}
                if self.kv_transfer is not None
                else None
            ),
            attempts=list(self.attempts),
            max_windows=self.opts.max_windows,
            windows=list(self.windows.records),
            requests=self.windows.result.requests,
            timings=timings,
            versions=dict(self.versions),
            teardown=self.teardowns[-1] if self.teardowns else None,
            validation=validation,
            started_at=self.started_at,
            finished_at=utc_now() if final else "",
        )

    def fail(self, status: str, error: str) -> None:
        self.status = status
        # The error may quote the server's log, which may echo the server's own secrets.
        self.error = redact_text(error, environment_with(self.serve_config.env))
        self.failed_stage = self.stage


def _own_version() -> str:
    return __version__


def run_capture(
    opts: CaptureOptions, *, log: Callable[[str], None] | None = None
) -> CaptureResult:
    """Run one capture; always returns with a manifest written (see the module docstring)."""
    emit = log or (lambda msg: print(f"vllm-neuron profile: {msg}", file=sys.stderr, flush=True))
    secrets = environment_with(opts.server_env)

    def say(msg: str) -> None:
        """Every line of ours (the server's command line among them) without secrets."""
        emit(redact_text(msg, secrets))

    run = _Run(opts, say)
    say(f"run directory {run.layout.run_dir} (profiler {run.profiler})")
    exit_code = EXIT_FAILED
    try:
        with signals_interrupt():
            try:
                run.run()
                exit_code = EXIT_OK
            except (KeyboardInterrupt, Interrupted) as exc:
                name = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
                run.fail("interrupted", f"interrupted by {name}")
                exit_code = EXIT_INTERRUPTED
            except ServerExited as exc:
                tail = "\n".join(exc.log_tail.strip().splitlines()[-5:])
                run.fail("failed", f"{exc}; last lines of {run.layout.serve_log}:\n{tail}")
            except ReadyTimeout as exc:
                run.fail("failed", str(exc))
            except (RecipeFailed, HTTPFailure, OSError, ValueError) as exc:
                run.fail("failed", f"{type(exc).__name__}: {exc}")
    finally:
        with shielded(say):
            if run.status == "running":  # an unexpected exception is propagating
                run.fail("failed", f"unexpected error in stage {run.stage}")
            for step in (run.stop_owed_profile, run.write_early_manifest):
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - teardown must still happen
                    say(f"cleanup step {step.__name__} failed: {exc}")
            # Written before cleanup (above), so even a teardown that never returns leaves one.
            run.teardown()
            run.doors.close()  # no server writes there any more
            write_manifest(run.store, run.manifest(final=True))
            report = validate_run(run.layout.run_dir)
            validation = Validation(ok=report.ok, failures=report.failures, notes=report.notes)
            manifest = run.manifest(final=True, validation=validation)
            write_manifest(run.store, manifest)
    if exit_code == EXIT_OK and not report.ok:
        exit_code = EXIT_FAILED
    say(f"manifest {run.layout.manifest}: status {manifest.status}, validation "
        f"{'ok' if report.ok else 'FAILED'}")
    return CaptureResult(run.layout.run_dir, manifest, exit_code)
