"""The crash matrix: a process killed at every named fault point heals without a hand.

For every point (`vllm_neuron.backends.faults.POINTS`, ``vllm-neuron debug faults``) and
every backend it applies to - a local tier, the NFS profile (leases, fsync), S3 (moto's
real HTTP API) - a real process is started with ``VLLM_NEURON_FAULT=<point>`` and must die
there by SIGKILL. Then:

1. nothing partial is visible: every published entry verifies (`verify_entries`, the
   library of ``cache verify``), every snapshot bundle is complete, every manifest reads;
2. nothing published before is lost: a sentinel published first is still there, intact;
3. what the crash left behind is found: a staging area or an uncommitted version by the
   store's survey (`Store.survey`) and by ``cache gc``'s plan (`plan_gc`), a bundle
   without ``meta.json`` by the snapshot listing, a dead run's ledger segment by the next
   emit; and every file of a cache tier is accounted for: published, the cache's own
   (events, pins, kernel lock files), or listed by ``cache gc`` (a killed writer's temp
   file, a dead holder's lease, ...);
4. a fresh process with no fault finishes the same work, and 1-3 hold again;
5. ``cache gc`` (`plan_gc(...).execute()`) then leaves only published work.

The fake toolchain (tests/compile/helpers/cache_workers.py: deterministic bytes, four files, a
compile that can stop half-way by handshake) stands in for the compiler; the points of the
compile cache are also hit once each with a real Inductor compile through
``torch.compile(backend="vllm_neuron")`` (marked slow), and the points of unpacking a host
entry's package (compile/tiers/unpacked.py) with a real entry loaded by a real process, whose
private ``TMPDIR`` must hold no ``aotinductor_*`` directory once it loaded the copy (slow).
A point that does not apply to a backend (a lease point where the store has kernel locks)
is not generated for it. One worker script does every kind of work
(tests/crash_matrix_worker.py); every wait is a handshake, never a pause on the clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import crash_matrix_worker as worker  # noqa: E402

from vllm_neuron.backends import Store, open_store, router  # noqa: E402
from vllm_neuron.backends.faults import DISK_FAULT_POINTS, POINTS  # noqa: E402
from vllm_neuron.compile.entry.events import EVENTS_STREAM  # noqa: E402
from vllm_neuron.compile.tiers.inventory import verify_entries  # noqa: E402
from vllm_neuron.compile.tiers.promote import promote_entry  # noqa: E402
from vllm_neuron.compile.tiers.unpacked import UNPACKED_DIR, copy_key  # noqa: E402
from vllm_neuron.compile.upkeep.collect import GcPlan, plan_gc  # noqa: E402
from vllm_neuron.compile.upkeep.eviction import PINS_DIR, pin  # noqa: E402

LEASE = 1.5  # seconds: how long a dead holder's lease keeps the healer waiting
KEY = "c0ffee00c0ffee00c0ffee00c0ffee01"
SENTINEL = "5e471e105e471e105e471e105e471e10"

# Which work reaches each point, and the backends it applies to.
ALL = ("local", "nfs", "s3")
LEASES = ("nfs", "s3")  # a local tier with kernel locks takes no lease
WORK: dict[str, tuple[str, tuple[str, ...]]] = {
    "compile.staging-written": ("get", ALL),
    "compile.record-written": ("get", ALL),
    "compile.published": ("get", ALL),
    "promote.mid-upload": ("promote", ALL),
    "promote.uploaded": ("promote", ALL),
    "promote.committed": ("promote", ALL),
    "fetch.mid-copy": ("fetch", ALL),
    "fetch.copied": ("fetch", ALL),
    "lease.acquired": ("get", LEASES),
    "lease.renewed": ("get", LEASES),
    "ledger.appended": ("manifest", ALL),
    "emit.before-write": ("manifest", ALL),
    "emit.after-write": ("manifest", ALL),
    "snapshot.mid-tensors": ("snapshot", ALL),
    "snapshot.before-meta": ("snapshot", ALL),
    "gc.mid-delete": ("gc", ALL),
    "evict.mid-delete": ("evict", ALL),
    "unpack.mid-copy": ("load", ("local", "nfs")),  # copies live in a node's own tier
    "unpack.staged": ("load", ("local", "nfs")),
}
# Points where the crashed step had staged something: the store's survey must find it
# (on the tier named).
STAGED_ON = {
    "compile.staging-written": "local", "compile.record-written": "local",
    "promote.mid-upload": "remote", "promote.uploaded": "remote",
    "fetch.mid-copy": "local", "fetch.copied": "local",
    "unpack.mid-copy": "local", "unpack.staged": "local",
}  # fmt: skip
# The points a compiling process reaches: the compile, the fleet's lease it compiles
# under, the promotion right after it. Slow: a real Inductor compile in the process killed
# (and again in the healer where the compile was lost), on S3, where the fleet takes leases.
# A fetch runs no compiler: its points are the fake matrix's, whatever made the files.
TORCH_POINTS = [p for p in WORK if p.split(".")[0] in ("compile", "promote", "lease")]

# A load is a real host entry loaded by a real process (torch): slow, as the real compiles.
SLOW_WORK = {"load"}


def _marks(point: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.slow] if WORK[point][0] in SLOW_WORK else []


MATRIX = [pytest.param(point, backend, id=f"{point}-{backend}", marks=_marks(point))
          for point, (_, backends) in WORK.items() for backend in backends]  # fmt: skip


# Points whose process is not one the matrix's work runs: covered where named.
ELSEWHERE = {
    # A compile worker (a child of the serving process) killed there: the graph is compiled
    # in the serving process at its first call, and no failure note is left.
    "worker.started": "tests/compile/workers/test_compile_workers.py",
}


def test_the_matrix_covers_every_point() -> None:
    assert set(WORK) | set(ELSEWHERE) == set(POINTS)
    assert not set(WORK) & set(ELSEWHERE)


# Processes ------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without any setting a developer (or another test) exported."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_NEURON_", "NEURON_LIBTORCH_", "VLLM_CACHE_ROOT",
                                "TORCHINDUCTOR_"))}  # fmt: skip
    env.update(extra)
    return env


def run_worker(mode: str, args: dict[str, Any], *, fault: str | None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one worker to its end: killed at `fault` by SIGKILL, or its result."""
    env = dict(env if env is not None else _env())
    if fault is not None:
        env["VLLM_NEURON_FAULT"] = fault
    done = subprocess.run(worker.command(mode, args), env=env, capture_output=True,
                          text=True, timeout=worker.SAFETY)  # fmt: skip
    if fault is not None and "@" not in fault:  # <point>@<disk fault>: the process goes on
        assert done.returncode == -signal.SIGKILL, (
            f"expected death by SIGKILL at {fault}, got exit {done.returncode}:\n"
            f"{done.stdout}\n{done.stderr}")
        return {}
    assert done.returncode == 0, f"worker exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    result = worker.parse_result(done.stdout)
    assert result["ok"], result.get("traceback", result)
    return result


# Stores and what may be in them ----------------------------------------------------------------


@dataclass
class Place:
    """One store of the scenario: its URL, its local directory (None on S3)."""

    url: str
    path: str | None

    def store(self) -> Store:
        return open_store(self.url, create=False)


def stored_files(place: Place) -> list[str]:
    """Every file really there, temp files of killed writers included (a store's listing
    hides those: here they must show)."""
    if place.path is None:
        return place.store().list("")
    out = []
    for dirpath, _dirs, files in os.walk(place.path):
        rel = os.path.relpath(dirpath, place.path)
        out += [name if rel == "." else f"{rel}/{name}".replace(os.sep, "/") for name in files]
    return sorted(out)


def gc_plan(place: Place) -> GcPlan:
    """What ``cache gc`` would collect from the tier now, whatever its age: every bound at
    -1 (no held lease is ever collected, however old)."""
    return plan_gc(place.store(), older_than=-1, lease_grace=-1, failure_max_age=-1)


def unaccounted_in_cache(place: Place, *, collectable: bool = True) -> list[str]:
    """Files of a cache tier that are neither a published entry's, the cache's own
    (event segments, pins, kernel lock files), nor something ``cache gc`` lists (to collect,
    or to keep: a lease still held); with ``collectable=False`` nothing counts as listed."""
    store = place.store()
    plan = gc_plan(place)
    listed = [i.where for i in plan.items + plan.kept] if collectable else []

    def accounted(name: str) -> bool:
        top = name.split("/", 1)[0]
        if top in (EVENTS_STREAM, PINS_DIR) or (top == ".locks" and name.endswith(".lock")):
            return True
        if top == UNPACKED_DIR and "/" in name[len(top) + 1:]:
            # An unpacked copy of a published entry's package (a copy without its entry is
            # for ``cache gc``, below).
            copy = name.split("/")[1]
            key = copy_key(copy)
            if (key is not None and store.published(key) is not None
                    and store.published(f"{UNPACKED_DIR}/{copy}") is not None):  # fmt: skip
                return True
        if any(name == where or name.startswith(where + "/") for where in listed):
            return True
        prefix = store.published(top)
        return prefix is not None and (name.startswith(prefix + "/") or name == f"{top}/.commit")

    return [name for name in stored_files(place) if not accounted(name)]


def wait_out_dead_leases(place: Place) -> None:
    """Wait until no lease of the tier is held. Every process of the scenario has ended, so
    a held lease is a killed holder's: ``cache gc`` keeps it until its last renewal expires
    (at most `LEASE` after the kill), read on the lease's own clock, then collects it."""
    deadline = time.monotonic() + worker.SAFETY
    while any(k.kind == "lease" for k in gc_plan(place).kept):
        assert time.monotonic() < deadline, "a lease is still held after every process ended"
        time.sleep(LEASE / 20)


def assert_cache_clean(place: Place, *, published: set[str]) -> None:
    """Every entry verifies, `published` are among them, nothing is unaccounted for."""
    results = verify_entries(place.store())
    assert all(r.ok for r in results), [(r.key, r.problem) for r in results]
    assert published <= {r.key for r in results}, (published, results)
    assert unaccounted_in_cache(place) == []


# Backends -----------------------------------------------------------------------------------


@pytest.fixture
def nfs_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A directory that every store of this test and its workers takes for an NFS mount."""
    base = str(tmp_path / "nfs")
    monkeypatch.setattr(router, "profile_for", worker.nfs_profile_for(base, router.profile_for))
    yield base


@dataclass
class Backend:
    """Where a scenario's shared stores live, and what a worker needs to reach them."""

    name: str
    base: str  # local directory of node tiers (and, except on S3, the shared stores)
    remote_base: str  # a path or s3:// URL for the shared stores
    worker_args: dict[str, Any] = field(default_factory=dict)

    def shared(self, name: str) -> Place:
        if self.remote_base.startswith("s3://"):
            return Place(f"{self.remote_base}/{name}", None)
        path = os.path.join(self.remote_base, name)
        return Place(path, path)

    def node(self, name: str) -> Place:
        path = os.path.join(self.base, name)
        return Place(path, path)


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The backend named by the test's parameter (``indirect``)."""
    name = request.param
    if name == "local":
        return Backend(name, str(tmp_path / "disk"), str(tmp_path / "disk"))
    if name == "nfs":
        base = request.getfixturevalue("nfs_base")
        return Backend(name, base, base, {"nfs_under": base})
    request.getfixturevalue("s3_env")  # AWS_ENDPOINT_URL for this process and the workers
    return Backend(name, str(tmp_path / "disk"), request.getfixturevalue("s3_store_url"))


# Scenarios: the compile cache -------------------------------------------------------------------


class CacheScenario:
    """Node 1's local tier and a shared remote tier (node 0: where an entry comes from),
    each holding the sentinel before the crash. A subclass says what the work is."""

    def __init__(self, point: str, backend: Backend) -> None:
        self.point, self.backend = point, backend
        self.remote = backend.shared("remote")
        self.node1, self.node0 = backend.node("node1"), backend.node("node0")
        self.key = KEY

    def get_args(self, key: str, node: Place, **extra: Any) -> dict[str, Any]:
        return {"key": key, "cache_dir": node.url, "remote": self.remote.url,
                "lease_seconds": LEASE, **self.backend.worker_args, **extra}  # fmt: skip

    def get_on_node0(self, key: str) -> None:
        worker.run_get({"key": key, "cache_dir": self.node0.url, "lease_seconds": LEASE})

    def setup(self) -> None:
        # The sentinel: published on node 1 and, by the fleet's flow, on the remote.
        worker.run_get(self.get_args(SENTINEL, self.node1))

    def cli(self, *argv: str, fault: str | None) -> dict[str, Any]:
        return run_worker("cli", {"argv": list(argv), **self.backend.worker_args}, fault=fault)

    def places(self) -> list[Place]:
        return [self.remote, self.node1]

    def check(self, *, healed: bool) -> None:
        for place in self.places():
            assert_cache_clean(place, published={SENTINEL} if place is not self.node0 else set())
        if healed:
            self.check_done()

    def check_done(self) -> None:
        assert self.node1.store().published(self.key) is not None

    def debris(self) -> list[str]:
        """What the crash staged, where the point says it must be: found by the store's
        survey and by ``cache gc``'s plan."""
        tier = STAGED_ON.get(self.point)
        if tier is None:
            return []
        place = self.remote if tier == "remote" else self.node1
        store = place.store()
        found = [d.prefix for d in store.survey(older_than=-1.0, lease_grace=-1.0).debris
                 if d.kind != "lease"]  # fmt: skip
        assert found, f"{self.point}: nothing staged is listed on the {tier} tier"
        planned = {item.where for item in gc_plan(place).items}
        assert set(found) <= planned, (found, planned)
        return found

    def still_listed(self, found: list[str]) -> None:
        """What the heal did not need is still listed, for ``cache gc`` to collect."""
        if not found:
            return
        place = self.remote if STAGED_ON[self.point] == "remote" else self.node1
        planned = {item.where for item in gc_plan(place).items}
        assert set(found) <= planned, (found, planned)

    def collect(self) -> None:
        """``cache gc`` of every tier: afterwards only published work is left."""
        for place in self.places():
            wait_out_dead_leases(place)
            outcome = gc_plan(place).execute()
            assert not outcome.failed and not outcome.stayed, outcome
            assert unaccounted_in_cache(place, collectable=False) == []
            assert_cache_clean(place, published=set())


class GetScenario(CacheScenario):
    """A rank of node 1 gets a key no tier holds: the fleet's flow (the remote's lease,
    the compile, the promotion). With `torch`, a real compile of a tiny model."""

    def __init__(self, point: str, backend: Backend, *, torch: dict[str, Any] | None = None
                 ) -> None:  # fmt: skip
        super().__init__(point, backend)
        self.torch = torch
        if torch is not None:  # the runtime finds its local tier under VLLM_CACHE_ROOT
            self.key = torch["key"]
            self.cache_root = os.path.join(backend.base, "node1-root")
            path = os.path.join(self.cache_root, "neuron", "compile_cache")
            self.node1 = Place(path, path)

    def run(self, fault: str | None) -> dict[str, Any]:
        hold = {"hold_dir": os.path.join(self.backend.base, "hold")} if (
            fault == "lease.renewed") else {}  # the compile waits for the heartbeat
        if self.torch is None:
            return run_worker("get", self.get_args(self.key, self.node1, **hold), fault=fault)
        env = _env(VLLM_CACHE_ROOT=self.cache_root, VLLM_NEURON_TOOLCHAIN="host",
                   TORCHINDUCTOR_CACHE_DIR=self.torch["inductor_cache"],
                   NEURON_LIBTORCH_REMOTE_CACHE=self.remote.url,
                   VLLM_NEURON_REMOTE_LEASE_SECONDS=str(LEASE))  # fmt: skip
        return run_worker("torch", {**self.backend.worker_args, **hold}, fault=fault, env=env)

    def heal(self) -> None:
        result = self.run(None)
        if self.torch is None:
            assert result["wrong"] is None, result
        else:
            assert result["matches"] and result["keys"] == [self.key], result
        # Whatever the crash, the fleet ends up with the entry: the fleet's flow promotes
        # what it compiles, and a process killed after its local publication owed the
        # promotion, which the healing process paid (compile/upkeep/owed.py).
        assert self.remote.store().published(self.key) is not None


class LoadScenario(CacheScenario):
    """A rank of node 1 serves a model whose real host entry its local tier holds (a local
    hit through ``torch.compile(backend="vllm_neuron")``): its package is unpacked beside
    the entry first, then loaded from there. Every worker has a private ``TMPDIR``."""

    def __init__(self, point: str, backend: Backend, *, torch: dict[str, Any]) -> None:
        super().__init__(point, backend)
        self.torch, self.key = torch, torch["key"]
        self.cache_root = os.path.join(backend.base, "node1-root")
        path = os.path.join(self.cache_root, "neuron", "compile_cache")
        self.node1 = Place(path, path)
        self.tmpdir = Path(backend.base) / "tmp"

    def setup(self) -> None:
        super().setup()
        built = open_store(self.torch["tier"], create=False)
        assert promote_entry(built, open_store(self.node1.url), self.key)  # the entry alone
        assert self.copies() == []
        self.tmpdir.mkdir(parents=True, exist_ok=True)

    def copies(self) -> list[str]:
        return [n for n in self.node1.store().list_dir(UNPACKED_DIR) if copy_key(n) == self.key]

    def run(self, fault: str | None) -> dict[str, Any]:
        env = _env(VLLM_CACHE_ROOT=self.cache_root, VLLM_NEURON_TOOLCHAIN="host",
                   TORCHINDUCTOR_CACHE_DIR=self.torch["inductor_cache"],
                   TMPDIR=str(self.tmpdir))  # fmt: skip
        result = run_worker("torch", dict(self.backend.worker_args), fault=fault, env=env)
        if result:  # what the disk-fault cases ask of every scenario
            result["source"] = result["sources"][0]
            result["wrong"] = None if result["matches"] else "outputs differ from eager"
        return result

    def heal(self) -> None:
        result = self.run(None)
        assert result["matches"] and result["sources"] == ["local"], result
        # Loaded from the copy: torch unpacked nothing into the temp dir.
        assert [p.name for p in self.tmpdir.iterdir() if p.name.startswith("aotinductor_")] == []

    def check_done(self) -> None:
        (copy,) = self.copies()
        assert self.node1.store().published(f"{UNPACKED_DIR}/{copy}") is not None


class FetchScenario(CacheScenario):
    """Node 1 gets a key the remote holds (node 0 compiled and promoted it)."""

    def setup(self) -> None:
        super().setup()
        self.get_on_node0(KEY)
        assert promote_entry(self.node0.store(), open_store(self.remote.url), KEY)

    def run(self, fault: str | None) -> dict[str, Any]:
        return run_worker("get", self.get_args(KEY, self.node1), fault=fault)

    def heal(self) -> None:
        result = self.run(None)
        assert result["wrong"] is None and result["source"] == "remote", result


class PromoteScenario(CacheScenario):
    """``vllm-neuron cache promote`` of node 0's entry to the remote."""

    def setup(self) -> None:
        super().setup()
        self.get_on_node0(KEY)

    def places(self) -> list[Place]:
        return [self.remote, self.node1, self.node0]

    def run(self, fault: str | None) -> dict[str, Any]:
        return self.cli("cache", "--cache-dir", self.node0.url, "promote", "--key", KEY,
                        "--to", self.remote.url, fault=fault)  # fmt: skip

    def heal(self) -> None:
        assert self.run(None)["status"] == 0

    def check_done(self) -> None:
        assert self.remote.store().published(KEY) is not None


class GcScenario(CacheScenario):
    """``vllm-neuron cache gc`` of the remote, which holds what three killed builders left
    (and, where there are leases, a released one)."""

    def setup(self) -> None:
        super().setup()
        store = open_store(self.remote.url)
        for i in range(3):  # staged, never committed: a builder killed mid-way
            store.stage(f"{KEY[:-1]}{i}").write("graph.bin", b"x" * 64)
        lock = store.lock("released", lease_duration=LEASE)
        lock.acquire(timeout=0)
        lock.release()

    def run(self, fault: str | None) -> dict[str, Any]:
        return self.cli("cache", "gc", self.remote.url, "--older-than", "0s",
                        "--lease-grace", "0s", fault=fault)  # fmt: skip

    def debris(self) -> list[str]:
        left = [item.where for item in gc_plan(self.remote).items]
        assert len(left) >= 2, left  # killed after its first removal, the rest listed
        return []

    def heal(self) -> None:
        assert self.run(None)["status"] == 0

    def check_done(self) -> None:
        assert gc_plan(self.remote).items == ()


class EvictScenario(CacheScenario):
    """``vllm-neuron cache prune --max-size 1`` of the remote, holding three entries and
    the pinned sentinel."""

    KEYS = tuple(f"{KEY[:-1]}{i}" for i in range(3))

    def setup(self) -> None:
        super().setup()
        for key in self.KEYS:
            worker.run_get(self.get_args(key, self.node1))
        pin(open_store(self.remote.url), SENTINEL, note="the crash matrix's sentinel")

    def run(self, fault: str | None) -> dict[str, Any]:
        return self.cli("cache", "prune", self.remote.url, "--max-size", "1", fault=fault)

    def debris(self) -> list[str]:
        entries = set(self.remote.store().published_children(""))
        assert SENTINEL in entries and 0 < len(entries & set(self.KEYS)) < 3, entries
        return []

    def heal(self) -> None:
        assert self.run(None)["status"] == 0

    def check_done(self) -> None:
        assert set(self.remote.store().published_children("")) == {SENTINEL}


class ManifestScenario:
    """An engine run: ledger lines, then the emit; a sentinel engine's manifest beside it."""

    KEYS = ("a" * 32, "b" * 32, "c" * 32)

    def __init__(self, point: str, backend: Backend) -> None:
        from vllm_neuron.identity import get_server_prefix

        self.point, self.backend = point, backend
        self.place = backend.shared("manifests")
        self.prefix = get_server_prefix()

    def setup(self) -> None:
        from vllm_neuron.manifest.emit import emit_manifest
        from vllm_neuron.manifest.schema import ManifestConfig

        emit_manifest(open_store(self.place.url), ManifestConfig(model="sentinel"),
                      cache_root=None, prefix="sentinel-engine", run="sentinel-run")  # fmt: skip

    def run(self, fault: str | None) -> dict[str, Any]:
        args = {"root": self.place.url, "keys": list(self.KEYS), **self.backend.worker_args}
        return run_worker("manifest", args, fault=fault)

    def _manifest(self, prefix: str) -> Any:
        from vllm_neuron.manifest.schema import MANIFEST_FILE, decode_manifest

        data = self.place.store().read(f"{prefix}/{MANIFEST_FILE}")
        return None if data is None else decode_manifest(data, source=prefix)

    def check(self, *, healed: bool) -> None:
        assert self._manifest("sentinel-engine").config.model == "sentinel"
        manifest = self._manifest(self.prefix)
        if healed or self.point == "emit.after-write":
            assert sorted(g.graph_hash for g in manifest.graphs) == sorted(self.KEYS)
        else:
            assert manifest is None
        files = stored_files(self.place)
        assert not [f for f in files if f.endswith(".partial")], files
        if healed:  # the emit removed the ledger, the crashed run's segments included
            assert files == sorted([f"{self.prefix}/manifest.json",
                                    "sentinel-engine/manifest.json"]), files  # fmt: skip

    def debris(self) -> list[str]:
        # The crashed run's segment: never folded into another run's manifest, removed by
        # the next emit of the engine (its fold names it stale).
        from vllm_neuron.manifest.fold import fold_ledger

        stale = fold_ledger(self.place.store(), self.prefix, run="a-later-run").stale
        assert stale, f"{self.point}: the crashed run's ledger segment is not found"
        return stale

    def heal(self) -> None:
        result = self.run(None)
        assert result["prefix"] == self.prefix and result["graphs"] == sorted(self.KEYS)

    def still_listed(self, found: list[str]) -> None:
        pass  # the emit removed them (checked: the ledger is empty)

    def collect(self) -> None:
        pass  # the emit collected the dead run's ledger


class SnapshotScenario:
    """One captured call of an executable; a sentinel bundle of another graph beside it."""

    HASH = "feedfacefeedfacefeedfacefeedface"
    OTHER = "0ddba11a0ddba11a0ddba11a0ddba11a"

    def __init__(self, point: str, backend: Backend) -> None:
        self.point, self.backend = point, backend
        self.place = backend.shared("snapshots")

    def setup(self) -> None:
        from vllm_neuron.snapshot.capture_spec import _STORES

        _STORES.clear()  # opened again under this test's profile
        worker.run_snapshot({"root": self.place.url, "hash": self.OTHER})

    def run(self, fault: str | None) -> dict[str, Any]:
        args = {"root": self.place.url, "hash": self.HASH, **self.backend.worker_args}
        return run_worker("snapshot", args, fault=fault)

    def check(self, *, healed: bool) -> None:
        from vllm_neuron.snapshot.bundles import list_bundles, load_bundle

        store = self.place.store()
        listing = list_bundles(store)
        expected = [f"{self.OTHER}/rank0/call0"] + ([f"{self.HASH}/rank0/call0"] if healed else [])
        assert sorted(b.prefix for b in listing.bundles) == sorted(expected), listing
        assert listing.unreadable == ()
        for prefix in expected:
            x, w, n = load_bundle(store, prefix).load_inputs()
            assert x.shape == (2, 4) and w.shape == (4, 4) and n == 3
        if healed:
            assert listing.incomplete == ()
        files = stored_files(self.place)
        assert not [f for f in files if f.endswith(".partial")], files

    def debris(self) -> list[str]:
        from vllm_neuron.snapshot.bundles import list_bundles

        incomplete = list(list_bundles(self.place.store()).incomplete)
        assert incomplete == [f"{self.HASH}/rank0/call0"], incomplete
        return incomplete

    def heal(self) -> None:
        assert self.run(None)["captured"] == [f"{self.HASH}/rank0/call0"]

    def still_listed(self, found: list[str]) -> None:
        pass  # the capture of the same call replaced them (checked: nothing incomplete)

    def collect(self) -> None:
        pass  # the capture of the same call replaced the incomplete bundle


DISK_FAULTS = [pytest.param(point, kind, backend, id=f"{point}@{kind}-{backend}",
                            marks=_marks(point))
               for point in DISK_FAULT_POINTS for kind in ("full", "read-only")
               for backend in ("local", "nfs")]  # fmt: skip

SCENARIOS: dict[str, Any] = {
    "get": GetScenario, "fetch": FetchScenario, "promote": PromoteScenario, "load": LoadScenario,
    "gc": GcScenario, "evict": EvictScenario, "manifest": ManifestScenario,
    "snapshot": SnapshotScenario,
}  # fmt: skip


def crash_and_heal(scenario: Any, point: str) -> None:
    scenario.setup()
    scenario.run(point)  # dies by SIGKILL at the point
    scenario.check(healed=False)
    found = scenario.debris()
    scenario.heal()
    scenario.check(healed=True)
    scenario.still_listed(found)
    scenario.collect()


# The matrix ---------------------------------------------------------------------------------


def scenario_for(point: str, backend: Backend, request: pytest.FixtureRequest) -> Any:
    work = WORK[point][0]
    if work == "load":  # a real entry, built once per module
        return LoadScenario(point, backend, torch=request.getfixturevalue("real_compile"))
    return SCENARIOS[work](point, backend)


@pytest.mark.timeout(4 * worker.SAFETY)
@pytest.mark.parametrize(("point", "backend"), MATRIX, indirect=["backend"])
def test_a_crash_heals(point: str, backend: Backend, request: pytest.FixtureRequest) -> None:
    crash_and_heal(scenario_for(point, backend, request), point)


@pytest.mark.timeout(4 * worker.SAFETY)
@pytest.mark.parametrize(("point", "kind", "backend"), DISK_FAULTS, indirect=["backend"])
def test_a_disk_fault_degrades(point: str, kind: str, backend: Backend,
                               request: pytest.FixtureRequest) -> None:
    """The local disk fills up (or turns read-only) at the point: the process still gets a
    right artifact, says nothing failed (no failure note for waiters, no remote outage),
    leaves nothing partial, and the next process finishes the work."""
    from vllm_neuron.compile.entry.events import RemoteUnavailable, read_stats
    from vllm_neuron.compile.entry.failure_notes import recent_failure

    scenario = scenario_for(point, backend, request)
    scenario.setup()
    result = scenario.run(f"{point}@{kind}")
    assert result["wrong"] is None, result
    scenario.check(healed=False)
    store = scenario.node1.store()
    assert recent_failure(store, scenario.key, since=0.0) is None
    assert read_stats(scenario.node1.url).remote_outages == 0, RemoteUnavailable
    again = scenario.run(None)  # the next process: the entry from one tier or the other
    assert again["wrong"] is None and again["source"] in ("local", "remote"), again
    scenario.check(healed=True)
    scenario.collect()


# The same points, reached by a real Inductor compile ----------------------------------------------


@pytest.fixture(scope="module")
def real_compile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The key of the slow cases' graph, and the Inductor cache its first compile warmed
    (every slow case shares it: its compiles are real, only faster)."""
    base = tmp_path_factory.mktemp("real-entry")
    inductor = str(base / "inductor")
    env = _env(VLLM_CACHE_ROOT=str(base / "root"), VLLM_NEURON_TOOLCHAIN="host",
               TORCHINDUCTOR_CACHE_DIR=inductor)  # fmt: skip
    result = run_worker("torch", {}, fault=None, env=env)
    assert result["matches"] and result["sources"] == ["compiled"], result
    return {"key": result["keys"][0], "inductor_cache": inductor,
            "tier": str(base / "root" / "neuron" / "compile_cache")}


@pytest.mark.slow
@pytest.mark.timeout(4 * worker.SAFETY)
@pytest.mark.parametrize("point", TORCH_POINTS)
def test_a_crash_in_a_real_compile_heals(
    point: str, real_compile: dict[str, Any], tmp_path: Path, s3_env: str, s3_store_url: str
) -> None:
    backend = Backend("s3", str(tmp_path / "disk"), s3_store_url)
    crash_and_heal(GetScenario(point, backend, torch=real_compile), point)
