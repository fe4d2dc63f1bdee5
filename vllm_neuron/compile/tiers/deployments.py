"""What each rank of a deployment loaded, kept on the remote tier, so that a new node of a
known deployment knows before it traces that it will compile nothing.

A node that joins a fleet (a new pod: its local tier empty) cannot tell from its own disk
whether its graphs are compiled already: its first graph is traced only after vLLM has
loaded the model. Without a hint it starts the cold-start machinery (head_start.py:
Inductor's CPU probe, early compile workers: tens of CPU seconds) and then fetches every
graph from the remote in milliseconds. So each rank that finished its start-up writes, on
the remote, the keys it loaded: ``.deployments/<deployment>/rank-<r>.json``. The deployment
is a digest of what makes its graphs (the model's architecture, dtype, parallel sizes and
the versions of what compiles them: `vllm_neuron.plugin.deployment`); the model's path, the
node's name and port are not in it, so every pod of a deployment shares one.

A record is advice, never a promise, and anyone who can write the remote can write one:

* it can decide only what a node starts ahead (a planted record makes a cold node skip its
  head start: a slower start, never a wrong one) and what it fetches in the background,
  each key fetched as any other fetch is (checksums, the trust policy);
* it is read bounded (`RECORD_MAX_BYTES`, regular files only), its keys are checked
  (`KEY_RE`) and capped at `MAX_KEYS`, and a record that does not decode, or names another
  deployment or rank than its path, is ignored (one warning per path);
* it is written only by a process that may publish to the remote (`TrustPolicy.
  may_publish_remote`, a writable remote), and only when what it loaded differs from what
  the record says: a warm fleet's starts write nothing.
"""

from __future__ import annotations

import logging
import socket
import time

from vllm_neuron.backends import Store
from vllm_neuron.backends.records import Record, RecordCodec, RecordError, encode

from ..entry.check import KEY_RE
from ..entry.text import printable

__all__ = ["DEPLOYMENTS_DIR", "MAX_KEYS", "DeploymentRanks", "deployment_keys",
           "deployment_known", "record_path", "remember_keys"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

DEPLOYMENTS_DIR = ".deployments"
"""On the remote tier: one folder per deployment, one record per rank."""
MAX_KEYS = 4096
"""The most keys a rank's record names (a model's pieces times its compile ranges are tens):
what a planted record can make a node fetch is bounded by it."""

_WARNED: set[str] = set()


class DeploymentRanks(Record, frozen=True, tag="deployment-rank"):
    """``.deployments/<deployment>/rank-<rank>.json``: the keys one rank of a deployment
    loaded at its last start that differed from the record (sorted), and who wrote it."""

    deployment: str
    rank: int
    keys: list[str]
    at: float
    host: str


_CODEC = RecordCodec(DeploymentRanks)


def _check_deployment(deployment: str) -> None:
    if not (len(deployment) == 32 and all(c in "0123456789abcdef" for c in deployment)):
        raise ValueError(f"a deployment is 32 lowercase hex digits, not {deployment!r}")


def record_path(deployment: str, rank: int) -> str:
    """Where rank `rank`'s record of `deployment` is, in the remote tier."""
    _check_deployment(deployment)
    if rank < 0:
        raise ValueError(f"a rank is not negative, not {rank}")
    return f"{DEPLOYMENTS_DIR}/{deployment}/rank-{rank}.json"


def deployment_keys(remote: Store, deployment: str, rank: int) -> list[str] | None:
    """The keys rank `rank` of `deployment` loaded at its last recorded start (sorted, each
    a well-formed key, at most `MAX_KEYS`); None when there is no record, or none that can
    be believed (said once per path)."""
    path = record_path(deployment, rank)
    try:
        record = _CODEC.read(remote, path)
    except RecordError as exc:
        _warn_once(remote, path, f"not a deployment record ({exc})")
        return None
    if record is None:
        return None
    if record.deployment != deployment or record.rank != rank:
        _warn_once(remote, path, f"it names deployment {printable(record.deployment, 40)} "
                                 f"rank {record.rank}, not its own path's")  # fmt: skip
        return None
    keys = sorted({k for k in record.keys if isinstance(k, str) and KEY_RE.fullmatch(k)})
    if len(keys) != len(record.keys) or len(keys) > MAX_KEYS:
        _warn_once(remote, path, f"{len(record.keys)} names, {len(keys)} of them keys; the "
                                 f"first {MAX_KEYS} keys are used")  # fmt: skip
    return keys[:MAX_KEYS]


def deployment_known(remote: Store, deployment: str, ranks: int) -> bool:
    """Whether the remote has a record of every one of `deployment`'s `ranks` ranks naming
    at least one key: every rank of it started once with this remote, so a new node of it
    is likely to fetch, not compile."""
    return all(deployment_keys(remote, deployment, rank) for rank in range(ranks))


def remember_keys(remote: Store, deployment: str, rank: int, keys: list[str]) -> bool:
    """Record `keys` (what rank `rank` loaded) as `deployment`'s, unless the record says so
    already; True when it was written. The caller has checked it may write the remote; a
    store that refuses raises."""
    wanted = sorted({k for k in keys if KEY_RE.fullmatch(k)})[:MAX_KEYS]
    if not wanted or deployment_keys(remote, deployment, rank) == wanted:
        return False
    record = DeploymentRanks(deployment=deployment, rank=rank, keys=wanted, at=time.time(),
                             host=socket.gethostname())  # fmt: skip
    remote.write(record_path(deployment, rank), encode(record))
    return True


def _warn_once(remote: Store, path: str, why: str) -> None:
    mark = f"{remote.url}/{path}"
    if mark not in _WARNED:
        _WARNED.add(mark)
        logger.warning("compile cache: %s is ignored: %s", mark, printable(why, 400))
