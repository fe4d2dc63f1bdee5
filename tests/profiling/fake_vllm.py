"""A stand-in for a vLLM OpenAI server, for fast tests of the capture orchestration.

    python fake_vllm.py --model M --host H --port P --profiler-config JSON
                        [--max-num-seqs N] [--kv-transfer-config JSON] [anything else]

It is a real process serving real HTTP, with a small engine simulation behind it: requests
queue, are admitted up to ``--max-num-seqs``, prefill in one step (one token with a KV
connector, like vLLM's DecodeBenchConnector) and decode one token per step. It logs vLLM's
stats line every ``VLLM_LOG_STATS_INTERVAL`` seconds (and, like vLLM, one idle tick after
activity), serves ``/v1/models``, ``/version``,
``/v1/chat/completions``, ``/start_profile`` and ``/stop_profile``, and writes a torch-
profiler-like ``rank0.<ns>.pt.trace.json.gz`` with vLLM's per-step annotations. It also
forks a child (like vLLM's engine core) into its own process group.

Knobs (environment): FAKE_VLLM_FAIL=1 exits 1 at start-up; FAKE_VLLM_STARTUP_S delays
readiness; FAKE_VLLM_STEP_S is the step time (default 0.005); FAKE_VLLM_IGNORE_TERM=1
makes the server and its child ignore SIGTERM (teardown must escalate to SIGKILL).

The profiler honours ``delay_iterations`` and ``max_iterations`` like vLLM's: with a delay
it starts recording at that step after ``/start_profile``, and a session that never
reached it writes no trace. Three knobs reproduce, deterministically, how a capture's
profiling window misses its phase on a busy host: FAKE_VLLM_EMPTY_WINDOWS=N makes the first
N profiler sessions record no model step (a trace with no step, as an undelayed session
that opened after the batch's last step writes); FAKE_VLLM_LATE_STARTS=N makes the first N
``/start_profile`` calls take effect only once the engine is idle (a start that crossed a
busy server while the batch finished); FAKE_VLLM_STALE_TICKS=N holds the stats lines back
while requests run and logs them in one burst when the engine goes idle, for the first N
batches (the stale burst a starved stats logger and log follower produce).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Req:
    def __init__(self, prompt_len: int, max_tokens: int) -> None:
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.generated = 0
        self.prefilled = False
        self.done = threading.Event()


class Engine:
    def __init__(self, max_num_seqs: int, connector: bool, profiler_cfg: dict) -> None:
        self.max_num_seqs = max_num_seqs
        self.connector = connector
        self.cfg = profiler_cfg
        self.lock = threading.Lock()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.prompt_tokens = 0
        self.gen_tokens = 0
        self.prof_active = False  # /start_profile received, no stop yet
        self.prof_running = False  # recording (after delay_iterations steps, like vLLM)
        self.prof_count = 0
        self.prof_steps: list[dict] = []
        self.step_s = float(os.environ.get("FAKE_VLLM_STEP_S", "0.005"))
        self.empty_windows = int(os.environ.get("FAKE_VLLM_EMPTY_WINDOWS", "0"))
        self.stale_batches = int(os.environ.get("FAKE_VLLM_STALE_TICKS", "0"))
        self.late_starts = int(os.environ.get("FAKE_VLLM_LATE_STARTS", "0"))
        self.sessions = 0
        self.prof_blind = False

    def submit(self, req: Req) -> None:
        with self.lock:
            self.waiting.append(req)

    def loop(self) -> None:
        while True:
            time.sleep(self.step_s)
            with self.lock:
                while self.waiting and len(self.running) < self.max_num_seqs:
                    self.running.append(self.waiting.pop(0))
                if not self.running:
                    continue
                ctx = [r for r in self.running if not r.prefilled]
                gen = [r for r in self.running if r.prefilled]
                ctx_tokens = sum(1 if self.connector else r.prompt_len for r in ctx)
                self.prompt_tokens += ctx_tokens
                self.gen_tokens += len(self.running)
                if self.prof_active:
                    self.prof_count += 1
                    if self.prof_count == self.cfg.get("delay_iterations", 0):
                        self.prof_running = True
                if self.prof_running and not self.prof_blind:
                    self.prof_steps.append({
                        "ph": "X", "cat": "user_annotation", "ts": time.time() * 1e6,
                        "dur": self.step_s * 1e6,
                        "name": f"execute_context_{len(ctx)}({ctx_tokens})_generation_"
                                f"{len(gen)}({len(gen)})",
                    })
                    if len(self.prof_steps) >= self.cfg.get("max_iterations", 0) > 0:
                        self._write_trace()
                for r in ctx:
                    r.prefilled = True
                for r in self.running:
                    r.generated += 1
                finished = [r for r in self.running if r.generated >= r.max_tokens]
                self.running = [r for r in self.running if r.generated < r.max_tokens]
            for r in finished:
                r.done.set()

    def start_profile(self) -> None:
        if self.sessions < self.late_starts:
            # The start crosses a busy server: it lands once the batch has finished.
            while True:
                with self.lock:
                    if not self.running and not self.waiting:
                        break
                time.sleep(self.step_s)
        with self.lock:
            if not self.prof_active:
                self.prof_active = True
                self.prof_running = not self.cfg.get("delay_iterations", 0)
                self.prof_count = 0
                self.prof_steps = []
                self.sessions += 1
                self.prof_blind = self.sessions <= self.empty_windows
                print(f"fake vllm: profiler session {self.sessions} started"
                      + (" (records no step)" if self.prof_blind else ""), flush=True)

    def stop_profile(self) -> None:
        with self.lock:
            if self.prof_running:
                self._write_trace()
            self.prof_active = False  # a delayed session that never started writes nothing

    def _write_trace(self) -> None:  # called with the lock held
        self.prof_active = self.prof_running = False
        out = self.cfg.get("torch_profiler_dir")
        if not out:
            return
        os.makedirs(out, exist_ok=True)
        doc = {"vllm_version": "fake", "distributedInfo": {"rank": 0},
               "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0,
                                "dur": 1.0}, *self.prof_steps]}
        path = os.path.join(out, f"rank0.{time.time_ns()}.pt.trace.json.gz")
        with gzip.open(path + ".tmp", "wt") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)

    def log_stats(self, interval: float) -> None:
        last = time.monotonic()
        held: list[str] = []
        was_busy = False
        while True:
            time.sleep(interval)
            now = time.monotonic()
            with self.lock:
                p, g = self.prompt_tokens, self.gen_tokens
                self.prompt_tokens = self.gen_tokens = 0
                running, waiting = len(self.running), len(self.waiting)
            dt = max(now - last, 1e-6)
            last = now
            busy = bool(p or g or running or waiting)
            if not busy and not was_busy:  # like vLLM: one idle tick after activity, then quiet
                continue
            was_busy = busy
            line = (f"INFO 01-01 00:00:00 [loggers.py:335] Engine 000: Avg prompt throughput: "
                    f"{p / dt:.1f} tokens/s, Avg generation throughput: {g / dt:.1f} tokens/s, "
                    f"Running: {running} reqs, Waiting: {waiting} reqs, CPU KV cache usage: "
                    "0.1%, Prefix cache hit rate: 0.0%")
            if self.stale_batches > 0:
                held.append(line)
                if running or waiting:
                    continue
                self.stale_batches -= 1
            print("\n".join(held or [line]), flush=True)
            held = []


def make_handler(engine: Engine, model: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:
            pass

        def _send(self, code: int, body: object | None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models":
                self._send(200, {"data": [{"id": model}]})
            elif self.path == "/version":
                self._send(200, {"version": "fake"})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path == "/start_profile":
                engine.start_profile()
                self._send(200, None)
            elif self.path == "/stop_profile":
                engine.stop_profile()
                self._send(200, None)
            elif self.path == "/v1/chat/completions":
                if body.get("model") != model:
                    self._send(404, {"error": f"model {body.get('model')!r} not served"})
                    return
                text = " ".join(m["content"] for m in body["messages"])
                req = Req(len(text.split()) + 8, int(body["max_tokens"]))
                engine.submit(req)
                req.done.wait()
                self._send(200, {"usage": {"prompt_tokens": req.prompt_len,
                                           "completion_tokens": req.generated}})
            else:
                self._send(404, {"error": "not found"})

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--profiler-config", default="{}")
    ap.add_argument("--kv-transfer-config", default=None)
    args, _unknown = ap.parse_known_args()
    if os.environ.get("FAKE_VLLM_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A child in the same process group, like vLLM's engine core.
    child_code = "import signal, time\n"
    if os.environ.get("FAKE_VLLM_IGNORE_TERM") == "1":
        child_code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    child_code += "time.sleep(3600)\n"
    subprocess.Popen([sys.executable, "-c", child_code])
    print(f"fake vllm: pid {os.getpid()} cwd {os.getcwd()} "
          f"PATH0 {os.environ.get('PATH', '').split(os.pathsep)[0]}", flush=True)
    if os.environ.get("FAKE_VLLM_FAIL") == "1":
        print("ERROR fake vllm: cannot load model " + args.model, flush=True)
        sys.exit(1)
    if not os.path.isdir(args.model):
        print(f"ERROR fake vllm: no model at {args.model}", flush=True)
        sys.exit(1)
    time.sleep(float(os.environ.get("FAKE_VLLM_STARTUP_S", "0")))
    engine = Engine(args.max_num_seqs, args.kv_transfer_config is not None,
                    json.loads(args.profiler_config))
    threading.Thread(target=engine.loop, daemon=True).start()
    interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    threading.Thread(target=engine.log_stats, args=(interval,), daemon=True).start()
    server = ThreadingHTTPServer((args.host, args.port),
                                 make_handler(engine, args.served_model_name or args.model))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
