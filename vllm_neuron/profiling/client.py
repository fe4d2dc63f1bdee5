"""The few HTTP calls a capture makes to a vLLM server (standard library only)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


class HTTPFailure(RuntimeError):
    """A request to the server failed (connection error or non-2xx status)."""


def _request(url: str, body: Any | None, timeout: float) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"} if body is not None else {},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode("utf-8", "replace")
        raise HTTPFailure(f"{req.method} {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise HTTPFailure(f"{req.method} {url}: {exc}") from None


def get_json(url: str, *, timeout: float = 10.0) -> Any:
    _, raw = _request(url, None, timeout)
    return json.loads(raw) if raw.strip() else None


def post_json(url: str, body: Any, *, timeout: float = 60.0) -> Any:
    _, raw = _request(url, body, timeout)
    return json.loads(raw) if raw.strip() else None


class VllmClient:
    """The routes a capture uses: readiness, profiler control, chat completions."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model

    @property
    def models_url(self) -> str:
        return f"{self.base_url}/v1/models"

    def start_profile(self, *, timeout: float = 60.0) -> float:
        """POST /start_profile; returns the seconds it took."""
        t0 = time.monotonic()
        post_json(f"{self.base_url}/start_profile", {}, timeout=timeout)
        return time.monotonic() - t0

    def stop_profile(self, *, timeout: float = 120.0) -> float:
        """POST /stop_profile (the first one can take ~30 s on CPU); returns seconds."""
        t0 = time.monotonic()
        post_json(f"{self.base_url}/stop_profile", {}, timeout=timeout)
        return time.monotonic() - t0

    def version(self) -> str | None:
        try:
            info = get_json(f"{self.base_url}/version", timeout=5.0)
        except (HTTPFailure, ValueError):
            return None
        return str(info.get("version")) if isinstance(info, dict) else None

    def chat(
        self, prompt: str, *, max_tokens: int, ignore_eos: bool = True, timeout: float = 300.0
    ) -> RequestResult:
        """One synchronous /v1/chat/completions request (the chat template applies)."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            # vLLM extension: generate exactly max_tokens, so decode legs have a known length.
            "ignore_eos": ignore_eos,
        }
        t0 = time.monotonic()
        try:
            out = post_json(f"{self.base_url}/v1/chat/completions", body, timeout=timeout)
        except HTTPFailure as exc:
            return RequestResult(ok=False, seconds=time.monotonic() - t0, error=str(exc))
        usage = (out or {}).get("usage") or {}
        return RequestResult(
            ok=True,
            seconds=time.monotonic() - t0,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    seconds: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
