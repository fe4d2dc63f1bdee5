"""`vllm-neuron profile capture|validate|show|list`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from typing import Any

import msgspec

from vllm_neuron.backends import local_root_missing, open_store
from vllm_neuron.envs import load_profiling_settings
from vllm_neuron.profiling.capture import run_capture
from vllm_neuron.profiling.files import file_size
from vllm_neuron.profiling.layout import artifacts_root
from vllm_neuron.profiling.options import DEFAULT_MAX_WINDOWS, CaptureOptions
from vllm_neuron.profiling.run_record import STATUS_UNRECORDED, read_manifest
from vllm_neuron.profiling.run_spec import DECODE_ONLY_CONNECTOR, DEFAULT_ACTIVITIES
from vllm_neuron.profiling.validate import validate_run

from .format import human_size, print_json, table
from .options import JSON_HELP


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "profile", help="capture prefill-only / decode-only profiles from a vLLM server"
    )
    cmds = parser.add_subparsers(dest="profile_command", required=True)

    cap = cmds.add_parser(
        "capture",
        help="launch a server, capture one phase, tear down, write run_spec.json + manifest.json",
        description="Extra arguments after `--` are passed to the server unchanged "
        "(recorded in serve_config.extra_args).",
    )
    cap.add_argument("--recipe", required=True, choices=["prefill", "decode"],
                     help="the phase to capture")
    cap.add_argument("--model", required=True, help="local model path (no hub downloads)")
    cap.add_argument("--project-root", default=None,
                     help="overrides NEURON_PROJECT_ROOT (default: current directory)")
    cap.add_argument("--run-name", default=None, help="default: <phase>-<UTC time>-<pid>")
    cap.add_argument("--profiler", choices=["auto", "neuron", "torch"], default="auto",
                     help="auto: neuron when Neuron devices are present, else torch")
    srv = cap.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="the server's address")
    srv.add_argument("--port", type=int, default=8041, help="the server's port")
    srv.add_argument("--served-model-name", default=None,
                     help="vLLM's --served-model-name (default: the model path)")
    srv.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="vLLM's --tensor-parallel-size")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="vLLM's --max-model-len")
    srv.add_argument("--max-num-seqs", type=int, default=None,
                     help="vLLM's --max-num-seqs")
    srv.add_argument("--enforce-eager", action="store_true", help="vLLM's --enforce-eager")
    srv.add_argument("--distributed-executor-backend", default=None,
                     help="vLLM's --distributed-executor-backend (mp, ray)")
    srv.add_argument("--server-command", default=None,
                     help="how to start vLLM (default: python -m vllm.entrypoints.openai."
                     "api_server, resolved on the PATH given VLLM_NEURON_VENV_PATH)")
    srv.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                     help="extra environment for the server (recorded in serve_config.env)")
    srv.add_argument("--activities", default=None,
                     help="Neuron profiler activities, comma-separated "
                     "(default: device_profile,system_profile)")
    srv.add_argument("--model-env", action="append", default=[], metavar="NAME",
                     help="declare a model-specific compile variable to snapshot into "
                     "run_spec.json (repeatable; the Neuron debug/headroom ones always are)")
    wl = cap.add_argument_group("workload")
    wl.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    wl.add_argument("--output-len", type=int, default=None, help="decode only (default 256)")
    wl.add_argument("--concurrency", type=int, default=None,
                    help="decode target batch (default 4)")
    wl.add_argument("--num-requests", type=int, default=None,
                    help="decode only (default 2 x concurrency)")
    dec = cap.add_argument_group("decode trigger")
    dec.add_argument("--stats-interval", type=float, default=None,
                     help="sets VLLM_LOG_STATS_INTERVAL for the server (seconds per tick)")
    dec.add_argument("--decode-fallback", choices=["auto", "never", "always"], default="auto",
                     help="serve with the decode-only KV connector when no tick is "
                     "prefill-free (auto), never, or from the start (always)")
    dec.add_argument("--decode-connector", default=None, metavar="JSON",
                     help='kv-transfer config of the fallback (default: '
                     '{"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"})')
    dec.add_argument("--fallback-patience", type=int, default=12,
                     help="busy ticks with prefill in a row before falling back")
    win = cap.add_argument_group("profiling windows")
    win.add_argument("--max-windows", type=int, default=None, metavar="N",
                     help="profiling windows per server launch: a window whose trace misses "
                     "the phase (no model step, a short or mixed window) is set aside under "
                     "windows/ and the workload runs again (default 3)")
    lim = cap.add_argument_group("time limits (seconds)")
    lim.add_argument("--ready-timeout", type=float, default=3600.0,
                     help="for the server to answer (default 3600)")
    lim.add_argument("--request-timeout", type=float, default=600.0,
                     help="for one request (default 600)")
    lim.add_argument("--stop-profile-timeout", type=float, default=180.0,
                     help="for the profiler to write its trace (default 180)")
    lim.add_argument("--teardown-grace", type=float, default=30.0,
                     help="for the server to exit before it is killed (default 30)")
    cap.add_argument("--json", action="store_true", help="print the manifest as JSON")
    cap.add_argument("serve_args", nargs=argparse.REMAINDER,
                     help="after --: extra server arguments")
    cap.set_defaults(handler=cmd_capture)

    val = cmds.add_parser("validate", help="check a run directory; exit 1 with the reasons")
    val.add_argument("run_dir", help="a capture run directory")
    val.add_argument("--json", action="store_true", help=JSON_HELP)
    val.set_defaults(handler=cmd_validate)

    show = cmds.add_parser("show", help="the manifest of a run directory")
    show.add_argument("run_dir", help="a capture run directory")
    show.add_argument("--json", action="store_true", help=JSON_HELP)
    show.set_defaults(handler=cmd_show)

    ls = cmds.add_parser("list", help="the capture runs under the project root")
    ls.add_argument("--project-root", default=None,
                    help="overrides NEURON_PROJECT_ROOT (default: current directory)")
    ls.add_argument("--json", action="store_true", help=JSON_HELP)
    ls.set_defaults(handler=cmd_list)


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--server-env expects NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def options_from_args(args: argparse.Namespace) -> Any:
    extra = list(args.serve_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    connector = dict(DECODE_ONLY_CONNECTOR)
    if args.decode_connector:
        connector = json.loads(args.decode_connector)
        if not isinstance(connector, dict) or "kv_connector" not in connector:
            raise ValueError("--decode-connector must be a JSON object with a kv_connector")
    activities = (
        [a.strip() for a in args.activities.split(",") if a.strip()]
        if args.activities
        else list(DEFAULT_ACTIVITIES)
    )
    return CaptureOptions(
        recipe=args.recipe,
        model=args.model,
        project_root=args.project_root,
        run_name=args.run_name,
        profiler=args.profiler,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        distributed_executor_backend=args.distributed_executor_backend,
        extra_args=extra,
        entrypoint=shlex.split(args.server_command) if args.server_command else None,
        server_env=_env_pairs(args.server_env),
        activities=activities,
        model_env=list(args.model_env),
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        stats_interval=args.stats_interval,
        decode_fallback=args.decode_fallback,
        decode_connector=connector,
        fallback_patience=args.fallback_patience,
        max_windows=DEFAULT_MAX_WINDOWS if args.max_windows is None else args.max_windows,
        ready_timeout=args.ready_timeout,
        request_timeout=args.request_timeout,
        stop_profile_timeout=args.stop_profile_timeout,
        teardown_grace=args.teardown_grace,
    )


def cmd_capture(args: argparse.Namespace) -> int:
    result = run_capture(options_from_args(args))
    if args.json:
        print_json(msgspec.to_builtins(result.manifest))
    else:
        _print_manifest(result.manifest)
    return result.exit_code


def cmd_validate(args: argparse.Namespace) -> int:
    report = validate_run(args.run_dir)
    if args.json:
        print_json({"run_dir": report.run_dir, "ok": report.ok, "failures": report.failures,
                    "notes": report.notes, "steps": report.steps})
        return 0 if report.ok else 1
    for failure in report.failures:
        print(f"FAIL {failure}")
    for note in report.notes:
        print(f"NOTE {note}")
    for path, steps in report.steps.items():
        print(f"steps in {os.path.basename(path)}: {', '.join(steps) or '(none)'}")
    print(f"{report.run_dir}: {'ok' if report.ok else f'{len(report.failures)} failure(s)'}")
    return 0 if report.ok else 1


def _load_manifest(run_dir: str) -> Any:
    if local_root_missing(os.path.abspath(run_dir)):  # a URL is not a run directory either
        raise ValueError(f"{run_dir} is not a directory")
    manifest = read_manifest(open_store(run_dir, create=False))
    if manifest is None:
        raise ValueError(f"{run_dir} has no manifest.json")
    return manifest


def _print_manifest(m: Any) -> None:
    print(f"run {m.run_name}  recipe {m.recipe}  status {m.status}"
          + (f" (at {m.failed_stage})" if m.failed_stage else ""))
    if m.error:
        print(f"error: {m.error}")
    if m.status == STATUS_UNRECORDED:
        print("manifest.json is in the Neuron plugin's form (no schema_version): it records no "
              "capture status; run `profile validate` to judge the artifacts it names")
    p = m.profile
    print(f"profiler {p.profiler}  output {p.output_dir}")
    rows = []
    for key in ("device_trace", "device_ntff", "system_trace_pb", "trace_info_pb", "neff_dir",
                "cpu_util_pb", "host_mem_pb"):
        path = getattr(p, key)
        if path is None and key != "device_trace":
            continue
        found = file_size(path) if path else None
        size = "-" if found is None else human_size(found)
        rows.append((key, path or "(null)", size))
    print(table(["ARTIFACT", "PATH", "SIZE"], rows))
    if m.trigger:
        line = m.trigger.get("line")
        print(f"trigger: {m.trigger.get('kind')}" + (f": {line}" if line else ""))
    if len(m.windows) > 1 or any(w.outcome != "captured" for w in m.windows):
        print(f"profiling windows (max_windows {m.max_windows}):")
        for w in m.windows:
            print(f"  attempt {w.attempt} window {w.window}: {w.outcome}"
                  + (f" ({w.reason})" if w.reason else ""))
    if m.fallback:
        print(f"fallback connector: {json.dumps(m.fallback['kv_transfer_config'])} "
              f"({m.fallback['reason']})")
    if m.executed_graphs:
        print(f"steps: {', '.join(m.executed_graphs)}")
    if m.teardown:
        t = m.teardown
        print(f"teardown: group {t.pgid}, signals {','.join(t.signals) or 'none'}, "
              f"{t.seconds:.1f} s, {'clean' if t.clean else f'NOT CLEAN {t.survivors} {t.error}'}")
    if m.validation:
        v = m.validation
        print(f"validation: {'ok' if v.ok else 'FAILED'}")
        for f in v.failures:
            print(f"  FAIL {f}")
        for n in v.notes:
            print(f"  NOTE {n}")


def cmd_show(args: argparse.Namespace) -> int:
    manifest = _load_manifest(args.run_dir)
    if args.json:
        print_json(msgspec.to_builtins(manifest))
    else:
        _print_manifest(manifest)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    root = load_profiling_settings(project_root=args.project_root).project_root
    profiles = os.path.join(artifacts_root(root), "profiles")
    rows = []
    for name in open_store(profiles, create=False).list_dir(""):  # sorted; none if missing
        run_dir = os.path.join(profiles, name)
        if local_root_missing(run_dir):  # not a directory: not a run
            continue
        try:
            m = read_manifest(open_store(run_dir, create=False))
        except ValueError:
            m = None
        rows.append({
            "run_name": name,
            "recipe": m.recipe if m else "-",
            "status": m.status if m else "(no manifest)",
            "valid": ("yes" if m.validation.ok else "no") if m and m.validation else "-",
            "started_at": m.started_at if m else "-",
        })
    if args.json:
        print_json(rows)
        return 0
    print(table(["RUN", "RECIPE", "STATUS", "VALID", "STARTED"],
                [list(r.values()) for r in rows]))
    return 0
