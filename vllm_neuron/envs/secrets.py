"""What counts as a secret, and how what this package writes is cleaned of it.

Why one module: a credential set in the environment (AWS keys, an HF token) can reach a file
through many doors - a manifest's config (vLLM's resolved config has ``hf_token``), a run
spec's server command line (``--hf-token``) and ``model_env``, a URL with ``user:pass@`` in
an error message, a log line. Each writer deciding for itself what a secret is would miss
one, so the decision is made here and every writer applies it where it writes (not where it
reads). It lives in `vllm_neuron.envs`, the lowest domain layer, so every feature can use
it; like the settings groups it may read the whole process environment (to know which
values are secret right now), which no module outside `envs` does.

A variable (or a config key, or a command-line flag) is secret by its name (`is_secret_name`,
case-insensitive): a known credential (`KNOWN_SECRET_NAMES`), or a name containing
``SECRET``, ``PASSWORD``, ``PASSWD``, ``PASSPHRASE``, ``CREDENTIAL``, ``API_KEY``,
``PRIVATE_KEY``, ``ACCESS_KEY`` or ``ENCRYPTION_KEY``, or with a word ``PASS``, a word
ending in ``TOKEN`` or ``AUTH``, or one starting with ``AUTH`` (not ``AUTHOR``). ``TOKEN``
and ``AUTH`` are matched as words so that ``TOKENIZERS_PARALLELISM``,
``max_num_batched_tokens`` and ``AUTHOR`` are not secrets. Redaction keeps the name, so a
reader still sees that the variable was set, and replaces its value by `REDACTED`.

In free text (`redact_text`) four things are replaced: the current value of every secret
variable (values of at least `MIN_SECRET_LENGTH` characters, a boolean word excepted: too
short a value would hit ordinary text), the user information of a URL
(``s3://KEY:SECRET@bucket`` becomes ``s3://<redacted>@bucket``), the value after a flag or
assignment with a secret name (``--hf-token X``, ``--api-key=X``, ``HF_TOKEN=X``,
``?token=X``), and a quoted ``"name": "value"`` pair with a secret name (JSON, or the
Python dict vLLM logs its arguments as). A value equal to part of `REDACTED` itself cannot
be removed from text that holds the marker; no real credential is.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections import ChainMap
from collections.abc import Iterable, Mapping
from typing import Any, overload

__all__ = [
    "KNOWN_SECRET_NAMES",
    "MIN_SECRET_LENGTH",
    "NOT_SECRET_NAMES",
    "REDACTED",
    "RedactingFilter",
    "PACKAGE_LOGGERS",
    "environment_with",
    "install_log_redaction",
    "has_url_credentials",
    "is_secret_name",
    "redact_argv",
    "redact_config",
    "redact_environment",
    "redact_text",
]

REDACTED = "<redacted>"
MIN_SECRET_LENGTH = 8  # shorter values (EMPTY, 1234) are placeholders, and common text

KNOWN_SECRET_NAMES: frozenset[str] = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN", "HUGGINGFACEHUB_API_TOKEN",
    "WANDB_API_KEY", "OPENAI_API_KEY", "VLLM_API_KEY", "NGC_API_KEY", "GITHUB_TOKEN",
    "GH_TOKEN", "AZURE_CLIENT_SECRET", "GOOGLE_APPLICATION_CREDENTIALS",
})  # fmt: skip
"""Credentials by name (most match the patterns too; listed so they always are secret)."""

NOT_SECRET_NAMES: frozenset[str] = frozenset({
    # This package's token positions of snapshot capture (envs/snapshot.py CAPTURE_TOKEN).
    "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_CAPTURE_TOKEN",
    # huggingface_hub's switch (a boolean) not to send the token implicitly.
    "HF_HUB_DISABLE_IMPLICIT_TOKEN",
})  # fmt: skip
"""Names the patterns match whose values are known not to be secrets."""

_FRAGMENTS = ("SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "APIKEY",
              "PRIVATEKEY", "ACCESSKEY", "ENCRYPTIONKEY")  # fmt: skip
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NON_WORD = re.compile(r"[^A-Z0-9]+")
_BOOLEAN_WORDS = frozenset({"true", "false", "none", "null"})


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a variable, config key or flag called ``name`` holds a secret (see the
    module docstring); leading dashes of a flag are ignored."""
    upper = name.strip().lstrip("-").upper()
    if upper in KNOWN_SECRET_NAMES:
        return True
    if upper in NOT_SECRET_NAMES:
        return False
    words = [w for w in _NON_WORD.split(_CAMEL.sub("_", name).upper()) if w]
    joined = "".join(words)
    if any(fragment in joined for fragment in _FRAGMENTS):
        return True
    return any(
        w == "PASS" or w.endswith(("TOKEN", "AUTH"))
        or (w.startswith("AUTH") and (not w.startswith("AUTHOR") or w.startswith("AUTHORIZ")))
        for w in words
    )  # fmt: skip


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def environment_with(extra: Mapping[str, str | None]) -> Mapping[str, str]:
    """This process's environment plus ``extra`` (a child process's own variables, such as
    a profiled server's ``--server-env``): where a redaction looks the secrets up when a
    record holds values this process never had."""
    own = {name: value for name, value in extra.items() if isinstance(value, str)}
    return ChainMap(own, os.environ)


def _secret_values(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The values of the secret variables of ``environ`` worth looking for in text, the
    longest first (so a value containing another is replaced whole)."""
    found: set[str] = set()
    for name, value in environ.items():
        if not isinstance(value, str) or not value or not is_secret_name(name):
            continue
        for candidate in (value, value.strip()):
            if len(candidate) >= MIN_SECRET_LENGTH and candidate.lower() not in _BOOLEAN_WORDS:
                found.add(candidate)
    return tuple(sorted(found, key=lambda v: (-len(v), v)))


@functools.lru_cache(maxsize=16)
def _values_pattern(values: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(v) for v in values))


# scheme://userinfo@ - user:password up to the last "@" of the word (an AWS secret key
# holds "/" and "+", a password an "@", unencoded), else a user (a token) before the path.
# A scheme starts where a run of scheme characters does: linear in a long run of them.
_URL_USERINFO = re.compile(
    r"((?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://)(?:[^/\s\"'<>:@]*:[^\s\"'<>]*|[^/\s\"'<>]*)@"
)
# "name": "value" and 'name': 'value' (JSON, a Python dict's repr).
_QUOTED_PAIR = re.compile(
    r"(?P<q>[\"'])(?P<name>[^\"'\\\n]{1,128})(?P=q)(?P<sep>\s*:\s*)"
    r"(?P<vq>[\"'])(?P<value>(?:\\.|(?!(?P=vq))[^\\\n])*)(?P=vq)"
)
# --flag=value, --flag value (not when the next word is itself a flag).
_FLAG_VALUE = re.compile(
    r"(?P<name>--[A-Za-z0-9][\w.-]*)(?P<sep>=|[ \t]+(?!--))"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"']+)"
)
# NAME=value (an environment assignment, a URL's query parameter).
_ASSIGNMENT = re.compile(
    r"(?<![\w.-])(?P<name>[A-Za-z_][\w.-]*)=(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"'&;,]+)"
)


def _named_value(match: re.Match[str]) -> str:
    if not is_secret_name(match.group("name")):
        return match.group(0)
    start, end = match.span("value")
    whole = match.group(0)
    offset = match.start()
    return whole[: start - offset] + REDACTED + whole[end - offset :]


def _quoted_pair(match: re.Match[str]) -> str:
    if not is_secret_name(match.group("name")) or not match.group("value"):
        return match.group(0)
    q, vq = match.group("q"), match.group("vq")
    return f"{q}{match.group('name')}{q}{match.group('sep')}{vq}{REDACTED}{vq}"


def has_url_credentials(text: str) -> bool:
    """Whether ``text`` holds a URL with user information (``scheme://user:pass@host``)."""
    return "://" in text and _URL_USERINFO.search(text) is not None


def redact_text(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` with every secret replaced by `REDACTED` (see the module docstring).

    ``environ`` is where the secret variables' values are taken from (default: this
    process's environment).
    """
    if not text:
        return text
    out = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text) if "://" in text else text
    if "=" in out or ":" in out:
        out = _QUOTED_PAIR.sub(_quoted_pair, out)
        out = _ASSIGNMENT.sub(_named_value, out)
    if "--" in out:
        out = _FLAG_VALUE.sub(_named_value, out)
    values = _secret_values(_environ(environ))
    if values:
        out = _values_pattern(values).sub(REDACTED, out)
    return out


def redact_argv(argv: Iterable[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """A command line with the value of every secret flag redacted (``--hf-token X``,
    ``--api-key=X``) and each argument cleaned as free text (`redact_text`)."""
    out: list[str] = []
    value_follows = False
    for arg in argv:
        if value_follows and not arg.startswith("--"):
            out.append(REDACTED)
            value_follows = False
            continue
        value_follows = False
        if arg.startswith("--") and is_secret_name(arg.partition("=")[0]):
            flag, eq, value = arg.partition("=")
            if eq:
                out.append(f"{flag}={REDACTED}" if value else arg)
                continue
            value_follows = True
        out.append(redact_text(arg, environ))
    return out


def redact_config(
    value: Any, environ: Mapping[str, str] | None = None, *, by_key: bool = True
) -> Any:
    """JSON-like data (dicts, lists, strings, numbers) with secrets redacted: every string
    under a key with a secret name is `REDACTED` (numbers and booleans are kept: vLLM's
    ``hf_token: true`` says "use the cached token"), a list of strings is redacted as a
    command line (`redact_argv`), any other string as free text (`redact_text`).
    ``by_key=False`` leaves keys out of it, for output whose keys name no variable (the
    command line's ``private_key`` is the key file's path)."""
    return _redact_tree(value, _environ(environ), secret=False, by_key=by_key)


def _redact_tree(value: Any, env: Mapping[str, str], *, secret: bool, by_key: bool) -> Any:
    if isinstance(value, Mapping):
        return {key: _redact_tree(item, env, by_key=by_key, secret=secret or (
                    by_key and isinstance(key, str) and is_secret_name(key)))
                for key, item in value.items()}  # fmt: skip
    if isinstance(value, list | tuple):
        if not secret and all(isinstance(item, str) for item in value):
            return redact_argv(value, env)
        return [_redact_tree(item, env, secret=secret, by_key=by_key) for item in value]
    if isinstance(value, str):
        return (REDACTED if value else value) if secret else redact_text(value, env)
    return value


@overload
def redact_environment(
    mapping: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> dict[str, str]: ...
@overload
def redact_environment(
    mapping: Mapping[str, str] | Mapping[str, str | None],
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]: ...
def redact_environment(
    mapping: Mapping[str, str] | Mapping[str, str | None],
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Environment variables as they may be written: the value of a secret variable is
    `REDACTED` (its name is kept; an unset or empty value stays as it is), any other value
    is cleaned as free text against the secrets of ``mapping`` and ``environ`` (default:
    this process's environment)."""
    own = {name: value for name, value in mapping.items() if isinstance(value, str)}
    env = ChainMap(own, _environ(environ))  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for name, value in mapping.items():
        if not value:
            out[name] = value
        elif is_secret_name(name):
            out[name] = REDACTED
        else:
            out[name] = redact_text(value, env)
    return out


class RedactingFilter(logging.Filter):
    """A filter that redacts each record's message (and traceback) before it is formatted:
    on every logger of this package (`install_log_redaction`) and on the handlers this
    package installs (the plugin's, the CLI's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
            cleaned = redact_text(message)
            if cleaned != message:
                record.msg, record.args = cleaned, None
            if record.exc_info and not record.exc_text:
                record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        except Exception:  # noqa: BLE001 - a malformed record is logging's own error to report
            pass
        return True


PACKAGE_LOGGERS = ("vllm_neuron", "vllm_neuron.compile", "vllm_neuron.manifest",
                   "vllm_neuron.metrics", "vllm_neuron.plugin", "vllm_neuron.snapshot")  # fmt: skip
"""Every logger this package logs through (tests/test_secrets.py checks the source for any
other): each carries the redaction."""

_REDACTION = RedactingFilter()


def install_log_redaction() -> None:
    """Put `RedactingFilter` on every logger of this package (`PACKAGE_LOGGERS`, and any
    other ``vllm_neuron.*`` logger that exists), once each.

    On the loggers, not on handlers: a logger's filters see every record logged through it
    before any handler does, wherever the record then goes - handlers of ours, vLLM's, the
    root logger's of an application that called ``logging.basicConfig`` first, or handlers
    added later. (A logger's filters do not see its children's records, so each logger
    carries it.) Done when this module is imported, so a line of ours is redacted however
    and whenever logging is configured; idempotent."""
    names = set(PACKAGE_LOGGERS)
    existing = list(logging.Logger.manager.loggerDict.items())
    names.update(name for name, item in existing
                 if name.startswith("vllm_neuron.") and isinstance(item, logging.Logger))
    for name in sorted(names):
        found = logging.getLogger(name)
        if _REDACTION not in found.filters:
            found.addFilter(_REDACTION)


install_log_redaction()
