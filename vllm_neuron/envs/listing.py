"""Every setting as an operator sees it, and the check every command runs first.

Why here: ``vllm-neuron debug env`` must show each variable this package reads with its
value (secrets redacted, `secrets.redact_environment`), where it came from and what is
wrong with it, and every command must refuse the settings it reads when one is malformed
(``VLLM_NEURON_CACHE_TRUST=requre``), naming the variable and the value. Both ask the
groups' own ``load_*`` functions, so a listing can never call valid what a process refuses.

`GROUPS` maps each settings group to its loader and variables; `setting_rows` lists every
variable; `validate_groups` is what a command calls with the groups it reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import (
    compile_cache,
    faults,
    host_mode,
    identity,
    manifest,
    metrics,
    profiling,
    run,
    snapshot,
    trust,
)
from ._parse import ConfigError, EnvVar, environ_or_default, raw
from .secrets import redact_environment

__all__ = ["GROUPS", "OTHER_READ", "SettingRow", "group_errors", "setting_rows",
           "validate_groups"]


@dataclass(frozen=True)
class Group:
    """One settings group: its loader (pure, takes a mapping) and its variables."""

    load: Callable[[Mapping[str, str]], Any]
    variables: tuple[EnvVar, ...]


GROUPS: dict[str, Group] = {
    "compile_cache": Group(compile_cache.load_compile_cache_settings, compile_cache.VARIABLES),
    "trust": Group(trust.load_trust_settings, trust.VARIABLES),
    "manifest": Group(manifest.load_manifest_settings, manifest.VARIABLES),
    "run": Group(run.load_run_id, run.VARIABLES),
    "snapshot": Group(snapshot.load_snapshot_settings, snapshot.VARIABLES),
    "profiling": Group(profiling.load_profiling_settings, profiling.VARIABLES),
    "host_mode": Group(host_mode.load_host_mode_settings, host_mode.VARIABLES),
    "identity": Group(identity.load_identity_settings, identity.VARIABLES),
    "faults": Group(faults.load_fault_settings, faults.VARIABLES),
    "metrics": Group(metrics.load_metrics_settings, metrics.VARIABLES),
}


OTHER_READ: frozenset[str] = frozenset({
    host_mode.VLLM_USE_AOT_COMPILE,  # vLLM's: host mode turns it off
    metrics.PROMETHEUS_MULTIPROC_DIR,  # where vLLM's /metrics collects from when set
    identity.USER,
    "HOME",  # the standard ones defaults are derived from
    "XDG_CACHE_HOME",
})  # fmt: skip
"""The variables this package reads that are no setting of its own (listed as "other")."""


@dataclass(frozen=True)
class SettingRow:
    """One variable as ``debug env`` shows it: ``value`` as set (redacted when secret;
    None when unset), ``source`` "environment" or "default", ``default`` the documented
    default, ``error`` what its group's loader refuses in it (None: nothing)."""

    name: str
    group: str
    value: str | None
    source: str
    default: str
    error: str | None


def _named_in(message: str, names: Iterable[str]) -> str | None:
    """The variable ``message`` names first (an error names the variable it is about)."""
    found = [(m.start(), n) for n in names
             if (m := re.search(rf"(?<![A-Z0-9_]){n}(?![A-Z0-9_])", message))]  # fmt: skip
    return min(found)[1] if found else None


def group_errors(name: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every error of group ``name`` in ``environ``, by the variable it names.

    A loader stops at its first error; so the variable it named is set aside (read as
    unset) and the group loaded again, until it loads. A variable of another group may be
    named (the snapshot group derives its directory from VLLM_CACHE_ROOT): keyed by that
    name, so the listing shows it once, under its own group. An error naming no variable is
    kept under the group's name."""
    env = dict(environ_or_default(environ))
    group = GROUPS[name]
    errors: dict[str, str] = {}
    for _ in range(len(_all_names()) + 1):
        try:
            group.load(env)
            break
        except ConfigError as exc:
            culprit = _named_in(str(exc), _all_names() - errors.keys())
            errors[culprit or name] = str(exc)
            if culprit is None:
                break
            env.pop(culprit, None)
    return errors


def setting_rows(environ: Mapping[str, str] | None = None) -> list[SettingRow]:
    """Every variable this package reads: the documented ones in the groups' order, each
    with its error if any, then the others it reads (HOME, USER, ...; group "other")."""
    env = environ_or_default(environ)
    documented = _all_names()
    shown = redact_environment({n: env[n] for n in env if n in documented | OTHER_READ}, env)
    rows: list[SettingRow] = []
    for group_name, group in GROUPS.items():
        errors = group_errors(group_name, env)
        for var in group.variables:
            rows.append(_row(var.name, group_name, env, shown, var.default, errors))
        if group_name in errors:  # about the group, no single variable
            rows.append(SettingRow(name=f"({group_name})", group=group_name, value=None,
                                   source="-", default="-", error=errors[group_name]))
    for other in sorted(OTHER_READ - documented):
        rows.append(_row(other, "other", env, shown, "-", {}))
    return rows


def _row(name: str, group: str, env: Mapping[str, str], shown: Mapping[str, str | None],
         default: str, errors: Mapping[str, str]) -> SettingRow:  # fmt: skip
    return SettingRow(name=name, group=group, value=shown.get(name),
                      source="environment" if raw(env, name) is not None else "default",
                      default=default, error=errors.get(name))  # fmt: skip


def _all_names() -> frozenset[str]:
    return frozenset(v.name for g in GROUPS.values() for v in g.variables)


def validate_groups(names: Iterable[str], environ: Mapping[str, str] | None = None) -> None:
    """A ConfigError naming every malformed variable of the groups ``names`` (each message
    names the variable and its value), else nothing: what a command runs before it reads
    its settings, so a typo is refused rather than read as something else."""
    env = environ_or_default(environ)
    problems: dict[str, None] = {}  # in order, each once (groups may name one variable)
    for name in names:
        problems.update(dict.fromkeys(group_errors(name, env).values()))
    if problems:
        raise ConfigError("; ".join(problems))
