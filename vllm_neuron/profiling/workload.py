"""The benchmark workload a decode capture runs: N concurrent request streams.

Each of ``concurrency`` workers sends chat requests back to back until ``num_requests``
have been sent in total. Every prompt starts with a unique tag so vLLM's prefix cache
cannot turn a later request's prefill into a cache hit (``tag`` keeps them unique across
the profiling windows of one server, which each run the workload again), and
``ignore_eos`` makes every decode leg exactly ``output_len`` tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .client import RequestResult, VllmClient

_WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "tired", "engineers", "measure", "every", "kernel", "on", "the", "device", "and", "write",
    "down", "what", "they", "saw", "in", "plain", "words",
]


def make_prompt(input_len: int, tag: str) -> str:
    """About `input_len` tokens of text (one common word is about one token)."""
    words = [f"request {tag}:"]
    i = 0
    while len(words) < max(1, input_len - 1):
        words.append(_WORDS[i % len(_WORDS)])
        i += 1
    return " ".join(words)


@dataclass(frozen=True)
class WorkloadSummary:
    sent: int
    ok: int
    failed: int
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class WorkloadRunner:
    """Runs the workload in background threads; `stop` ends it early (in-flight ones finish)."""

    def __init__(
        self,
        client: VllmClient,
        *,
        input_len: int,
        output_len: int,
        concurrency: int,
        num_requests: int,
        request_timeout: float = 300.0,
        tag: str = "",
    ) -> None:
        self.client = client
        self.input_len = input_len
        self.output_len = output_len
        self.concurrency = concurrency
        self.num_requests = num_requests
        self.request_timeout = request_timeout
        self.tag = tag
        self._lock = threading.Lock()
        self._next = 0
        self._in_flight = 0
        self._stop = threading.Event()
        self._results: list[RequestResult] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._worker, name=f"workload-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _take(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self._next >= self.num_requests:
                return None
            self._next += 1
            self._in_flight += 1
            return self._next - 1

    def _worker(self) -> None:
        while (index := self._take()) is not None:
            result = self.client.chat(
                make_prompt(self.input_len, f"{self.tag}{index:06d}"),
                max_tokens=self.output_len,
                timeout=self.request_timeout,
            )
            with self._lock:
                self._results.append(result)
                self._in_flight -= 1

    def in_flight(self) -> int:
        """Requests taken and not yet answered: what the client knows is still running.

        A response is the client's own proof that a request left the batch, so the decode
        recipe refuses to arm while fewer than ``concurrency`` are in flight.
        """
        with self._lock:
            return self._in_flight

    def done(self) -> bool:
        return all(not t.is_alive() for t in self._threads)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every worker; True when all finished within `timeout`."""
        for t in self._threads:
            t.join(timeout)
        return self.done()

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> WorkloadSummary:
        with self._lock:
            results = list(self._results)
        ok = [r for r in results if r.ok]
        return WorkloadSummary(
            sent=len(results),
            ok=len(ok),
            failed=len(results) - len(ok),
            prompt_tokens=sorted({r.prompt_tokens for r in ok}),
            completion_tokens=sorted({r.completion_tokens for r in ok}),
            errors=[r.error for r in results if r.error][:5],
        )
