"""Whether a tier's entries load on this node: ``vllm-neuron cache verify --load``.

Why: checksums prove that an entry's bytes are the ones its builder recorded, not that this
node can load them (an artifact built against another build of a library, a package a
checksum-recomputing writer truncated). A serving process heals such an entry when it meets
it (compile/runtime.py); an operator asks before the fleet does. Loading runs the artifact's
own toolchain in this Python, exactly as a serving process would, from a local directory:
an entry of a remote tier is first fetched, verified, into a temporary local tier.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from vllm_neuron.backends import Store, open_store

from ..entry.outcomes import CacheResult
from ..entry.record import read_record
from ..tiers.health import not_own_tier
from ..tiers.remote import fetch_entry
from ..tiers.unpacked import load_entry
from ..toolchains.base import ARTIFACTS, ToolchainUnavailable
from ..toolchains.op_libraries import MissingOpLibrary
from ..toolchains.select import select_toolchain
from ..trust.policy import TrustPolicy, UntrustedEntry, refusal, trust_policy

__all__ = ["LoadCheck", "check_loads", "is_own_tier"]


def is_own_tier(store: Store) -> bool:
    """Whether ``store`` is a tier of this node's own - a directory no other local user can
    change (`health.not_own_tier`) - whose entries may be judged as this node's
    (`TrustPolicy.judge_local`: by this node's seal, else by signature) and loaded where
    they are. Decided by the filesystem, never by which option named the tier: a shared
    folder given as ``--cache-dir`` is a shared tier."""
    staging = store.local_dir_of(".staging")
    return staging is not None and not_own_tier(os.path.dirname(staging)) is None


def _load(store: Store, key: str) -> None:
    prefix = store.published(key)
    if prefix is None:
        raise FileNotFoundError(f"{store.url}: no entry {key}")
    record = read_record(store, prefix)
    artifact = ARTIFACTS.convert(record.meta, source=f"{store.url}/{key} meta")
    directory = store.local_dir_of(prefix)
    if directory is None:
        raise RuntimeError(f"{store.url} is not on local disk")
    toolchain = select_toolchain(artifact.toolchain)  # type: ignore[arg-type]
    # As a serving process loads it: from the verified unpacked copy of its package, when
    # its toolchain loads one (made in `store`, the tier checked or the temporary one).
    load_entry(toolchain, store, CacheResult(key, directory, record, "local", 0.0, prefix),
               artifact)  # fmt: skip


@dataclass(frozen=True)
class LoadCheck:
    """Whether an entry loads here: True, False (``detail`` says why not), or None when this
    Python cannot tell (its toolchain or a kernel library the graph calls is missing here:
    the process's lack, not the entry's)."""

    loads: bool | None
    detail: str = ""


def check_loads(store: Store, key: str, *, policy: TrustPolicy | None = None,
                own_tier: bool = False) -> LoadCheck:  # fmt: skip
    """Load entry ``key`` of ``store`` in this process, as a serving process would - never
    one the trust policy (default: the process's) forbids, which is not checked (None).
    ``own_tier``: the caller takes ``store`` for this node's local tier (its own compiles
    need no signature); it is loaded in place only when the filesystem agrees
    (`is_own_tier`), else fetched as any other tier's."""
    policy = trust_policy() if policy is None else policy
    try:
        if own_tier and is_own_tier(store):
            # This node's own tier: loaded where it is. Any other tier (a remote folder
            # too) is fetched first: judged, and every file verified as it is copied.
            why = refusal(policy, store, key, own_tier=own_tier)
            if why is not None:
                return LoadCheck(None, f"not loaded: untrusted ({why})")
            _load(store, key)
            return LoadCheck(True)
        with tempfile.TemporaryDirectory(prefix="vllm-neuron-load-check-") as tmp:
            local = open_store(tmp)
            if fetch_entry(store, key, local, policy=policy, sealed=False) is None:
                return LoadCheck(False, f"{store.url}: no entry {key}")
            _load(local, key)
    except UntrustedEntry as exc:
        return LoadCheck(None, f"not loaded: untrusted ({exc.verdict.reason})")
    except Exception as exc:  # noqa: BLE001 - whatever stops the load is the answer
        said = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ToolchainUnavailable) or isinstance(exc.__cause__, MissingOpLibrary):
            return LoadCheck(None, f"cannot check here: {said}")
        return LoadCheck(False, f"does not load here: {said}")
    return LoadCheck(True)
