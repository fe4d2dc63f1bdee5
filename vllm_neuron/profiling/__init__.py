"""Profile capture: prefill-only and decode-only traces from a running vLLM server.

The modules, one job each:

- `layout`     where a run's files go (``$NEURON_PROJECT_ROOT/agent_artifacts/...``)
- `run_spec`   the input contract (``run_spec.json``) and the server command derived from it
- `lifecycle`  launch in an own process group, readiness, guarded group teardown
- `recipes`    prefill isolation and decode isolation, one profiling window per call
               (with `workload` and `client`)
- `stats`      the stats-line decode trigger and the no-prefill-free-tick fallback detector
- `artifacts`  discovery of what the profiler wrote; `run_record` the output manifest
- `trace`      per-step annotations of vLLM torch-profiler traces; `validate` the checks
- `files`      files named by path, read through the store of their directory
- `windows`    the profiling windows: run, judged, set aside (up to ``max_windows``)
- `capture`    one capture end to end: launches, the decode fallback, teardown, manifest
"""

from .capture import CaptureResult, run_capture
from .layout import RunLayout
from .lifecycle import ServerProcess, TeardownRecord, UnsafeSignal, check_signalable_group
from .options import CaptureOptions
from .run_record import ProfileManifest, read_manifest, write_manifest
from .run_spec import (
    DECODE,
    DECODE_ONLY_CONNECTOR,
    PREFILL,
    KVTransfer,
    RunSpec,
    ServeConfig,
    Workload,
    read_run_spec,
    serve_command,
    write_run_spec,
)
from .stats import FallbackDetector, StatsTick, Verdict, is_decode_steady, parse_stats_line
from .trace import Step, check_decode_steps, check_prefill_steps, read_trace
from .validate import ValidationReport, validate_run

__all__ = [
    "DECODE",
    "DECODE_ONLY_CONNECTOR",
    "PREFILL",
    "CaptureOptions",
    "CaptureResult",
    "FallbackDetector",
    "KVTransfer",
    "ProfileManifest",
    "RunLayout",
    "RunSpec",
    "ServeConfig",
    "ServerProcess",
    "StatsTick",
    "Step",
    "TeardownRecord",
    "UnsafeSignal",
    "ValidationReport",
    "Verdict",
    "Workload",
    "check_decode_steps",
    "check_prefill_steps",
    "check_signalable_group",
    "is_decode_steady",
    "parse_stats_line",
    "read_manifest",
    "read_run_spec",
    "read_trace",
    "run_capture",
    "serve_command",
    "validate_run",
    "write_manifest",
    "write_run_spec",
]
