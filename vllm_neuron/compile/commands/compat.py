"""Would this environment hit an entry? Compatibility before (and after) an upgrade.

A cache key hashes six components (`key/cache_key.py`). Three of them come from the model -
``graph``, ``inputs``, ``replica_groups`` - and three from the environment that compiles:
``versions`` (the toolchain's package versions, and on the host the CPU's features),
``compiler_args`` (the canonical flags) and ``target``. Every entry records its six
component hashes in ``entry.json`` (``components``), so comparing its three environment
components with this process's tells whether any graph could ever be looked up under
its key here: when one differs, no graph of any model can (`check_compat`).
``vllm-neuron cache compat`` shows it per entry; ``cache prune --incompatible`` removes
the entries that could never hit again here.

This environment is the toolchain the compile runtime would use (`current_toolchain`:
``VLLM_NEURON_TOOLCHAIN``, ``auto`` meaning Neuron when installed and the host in host
mode), keyed exactly as `compute_cache_key` keys it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_neuron.backends import Store, join
from vllm_neuron.backends.records import RECORD_MAX_BYTES, RecordError
from vllm_neuron.envs import compile_cache_settings, host_mode_settings

from ..entry.record import ENTRY_RECORD, decode_record
from ..key.compiler_args import canonicalize_compiler_args
from ..tiers.inventory import list_entries
from ..toolchains.base import Toolchain

ENVIRONMENT_COMPONENTS: tuple[str, ...] = ("versions", "compiler_args", "target")
"""The key components an environment decides (the others are the model's)."""


@dataclass(frozen=True)
class Environment:
    """What this process would key a compile with, apart from the graph."""

    toolchain: str
    target: str
    versions: dict[str, str]
    compiler_args: list[str]
    components: dict[str, str] = field(default_factory=dict)  # ENVIRONMENT_COMPONENTS


def environment_of(toolchain: Toolchain) -> Environment:
    """The environment components of `toolchain`, hashed as `compute_cache_key` does."""
    from ..key.graph_canon import digest_json  # lazy: imports torch

    versions = {str(k): str(v) for k, v in toolchain.versions().items()}
    flags = list(toolchain.compiler_args())
    return Environment(
        toolchain=toolchain.name,
        target=str(toolchain.target),
        versions=versions,
        compiler_args=flags,
        components={
            "versions": digest_json(versions),
            "compiler_args": digest_json(canonicalize_compiler_args(flags)),
            "target": digest_json(str(toolchain.target)),
        },
    )


def current_toolchain() -> Toolchain:
    """The toolchain the compile runtime of this process would use (as `build_runtime`)."""
    from ..toolchains.select import select_toolchain

    name = compile_cache_settings().toolchain
    if name == "auto" and host_mode_settings().enabled:
        name = "host"
    return select_toolchain(name)


@dataclass(frozen=True)
class Compatibility:
    """Whether this environment would hit one entry.

    ``compatible`` is None when it cannot be told (an unreadable entry, a record without
    the environment's components); otherwise ``differs`` names the key components that
    differ (and ``toolchain`` when the entry was made by another toolchain).
    """

    key: str
    compatible: bool | None
    differs: tuple[str, ...] = ()
    toolchain: str = "?"
    target: str = "?"
    size: int = 0
    problem: str | None = None

    @property
    def reason(self) -> str:
        if self.problem is not None:
            return self.problem
        return "differs in " + ", ".join(self.differs) if self.differs else ""


def compare(components: Mapping[str, str], toolchain: str, env: Environment) -> tuple[str, ...]:
    """The environment components (and ``toolchain``) in which an entry differs from `env`;
    raises KeyError naming a component the entry does not record."""
    missing = [c for c in ENVIRONMENT_COMPONENTS if c not in components]
    if missing:
        raise KeyError(", ".join(missing))
    differs = tuple(c for c in ENVIRONMENT_COMPONENTS if components[c] != env.components[c])
    if differs and toolchain != env.toolchain:
        differs = ("toolchain", *differs)
    return differs


def check_compat(store: Store, env: Environment) -> list[Compatibility]:
    """Every entry of `store`, oldest first, judged against `env`."""
    out = []
    for info in list_entries(store):
        if info.problem is not None:
            out.append(Compatibility(info.key, None, problem=info.problem))
            continue
        prefix = store.published(info.key)
        try:  # bounded, regular files only: a hostile record is that entry's problem
            data = None if prefix is None else store.read(join(prefix, ENTRY_RECORD),
                                                          max_size=RECORD_MAX_BYTES)  # fmt: skip
        except RecordError as exc:
            out.append(Compatibility(info.key, None, problem=f"unreadable record: {exc}"))
            continue
        if data is None:
            out.append(Compatibility(info.key, None, problem="withdrawn while checking"))
            continue
        try:
            record = decode_record(data)
            differs = compare(record.components, record.toolchain, env)
        except KeyError as exc:
            out.append(Compatibility(info.key, None, toolchain=info.toolchain,
                                     target=info.target, size=info.size,
                                     problem=f"no {exc.args[0]} component recorded"))
            continue
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            out.append(Compatibility(info.key, None, problem=f"unreadable record: {exc}"))
            continue
        out.append(Compatibility(info.key, not differs, differs, record.toolchain,
                                 record.target, info.size))  # fmt: skip
    return out


def incompatible_entries(store: Store, env: Environment) -> dict[str, str]:
    """{key: why} of the entries `env` could never hit (for `plan_prune(incompatible=)`);
    entries that cannot be judged are left out."""
    return {c.key: c.reason for c in check_compat(store, env) if c.compatible is False}
