"""The run of an engine: which ledger segments belong to the manifest being emitted."""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections.abc import Mapping

from ._parse import ConfigError, EnvVar, environ_or_default, raw

__all__ = ["VARIABLES", "VLLM_NEURON_RUN_ID", "load_run_id", "run_id"]

VLLM_NEURON_RUN_ID = "VLLM_NEURON_RUN_ID"

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        VLLM_NEURON_RUN_ID,
        "(set by the first process of a run, inherited by the others)",
        "manifest",
        "Id of one engine run, shared by all its processes; a manifest folds only the ledger "
        "of its own run. Set it yourself only when the ranks of one engine are started as "
        "separate programs (torchrun): the same value for all of them, a new one per run.",
    ),
)

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_run_id_lock = threading.Lock()


def load_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """VLLM_NEURON_RUN_ID, validated (it names a directory of the ledger), or None if unset."""
    env = environ_or_default(environ)
    value = raw(env, VLLM_NEURON_RUN_ID)
    if value is not None and not _RUN_ID.match(value):
        raise ConfigError(
            f"{VLLM_NEURON_RUN_ID}={env[VLLM_NEURON_RUN_ID]!r} is not a run id; use 1 to 64 "
            "letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def run_id() -> str:
    """The id of this engine run, created on first use and exported to ``os.environ``.

    Why an environment variable: one engine run is several processes (API server, engine
    core, one worker per TP rank, forked compile workers), and every one of them writes
    ledger segments that the emitting rank must fold, while segments left by an earlier run
    that crashed before its emit must not be. The first process that needs the id (the
    general plugin in vLLM's first process, before any engine process is started; outside
    vLLM the compile runtime, when the manifest is on) creates one; every process started
    from it, by fork, spawn or vLLM's Ray executor (which copies ``VLLM_*`` variables to
    its workers), inherits it. A new ``vllm serve`` starts from a shell or a supervisor that
    never had it, so it gets a new id. Read at each use rather than cached: a Ray worker
    receives its environment after it has imported this module.
    """
    with _run_id_lock:
        current = load_run_id()
        if current is None:
            current = f"{os.getpid()}-{secrets.token_hex(6)}"
            os.environ[VLLM_NEURON_RUN_ID] = current
        return current
