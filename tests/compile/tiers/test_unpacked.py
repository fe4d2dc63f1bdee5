"""A hit loads from the verified unpacked copy of its package and leaves nothing behind
(vllm_neuron/compile/tiers/unpacked.py).

Real processes (tests/compile/helpers/serve_worker.py: a model served through
``torch.compile(backend="vllm_neuron")``), each with a private ``TMPDIR``, so that "no
``aotinductor_*`` directory appears in the temp dir" is exact; and, in this process, loads
of copies of one built tier whose copy was torn, changed or is missing. Outputs are
compared with those of the same graph loaded from a pristine copy.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import serve_worker  # tests/compile/helpers/serve_worker.py
import torch
from tmpfs_mounts import fill, remount  # tests/tmpfs_mounts.py (its `tmpfs` fixture: conftest)

from vllm_neuron.backends import encode, join, open_store
from vllm_neuron.backends.faults import arm
from vllm_neuron.backends.writable import unwritable_cause
from vllm_neuron.compile.entry.record import ENTRY_RECORD, read_record
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.runtime import _entry_at_fault
from vllm_neuron.compile.tiers import unpacked
from vllm_neuron.compile.tiers.inventory import list_entries
from vllm_neuron.compile.tiers.quarantine import quarantine_entry
from vllm_neuron.compile.tiers.unpacked import (
    UNPACKED_DIR,
    UNPACKED_RECORD,
    UNPACKED_RECORDS,
    copy_name,
    load_entry,
)
from vllm_neuron.compile.toolchains.base import ARTIFACTS, ToolchainError
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.compile.upkeep.collect import plan_gc
from vllm_neuron.compile.upkeep.eviction import withdraw

# Inductor's own cache: the session's (tests/conftest.py), shared by every real compile.
INDUCTOR = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def temp_dirs_of_torch(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("aotinductor_"))


def listed(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def tier_of(root: Path) -> Path:
    return root / "neuron" / "compile_cache"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A cache root where a served model's graph was compiled (and so unpacked) once."""
    root = tmp_path_factory.mktemp("built") / "cache"
    tmpdir = tmp_path_factory.mktemp("built-tmp")
    code, first, err = serve_worker.serve(root, INDUCTOR, TMPDIR=str(tmpdir))
    assert code == 0 and first is not None, err[-3000:]
    assert first["matched"] and first["sources"] == ["compiled"], first
    assert temp_dirs_of_torch(tmpdir) == []  # the compiling process loaded the copy too
    (key,) = first["keys"]
    return root, key


def copy_of(built: tuple[Path, str], to: Path, *, with_copy: bool = True) -> Path:
    """``to`` becomes a copy of the built cache root (without its unpacked copies unless
    `with_copy`); returns its local tier."""
    # The tier's entries, not the builder's node files (headers: a node's own, ~150 MB each).
    shutil.copytree(built[0], to, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".node"))
    if not with_copy:
        shutil.rmtree(tier_of(to) / UNPACKED_DIR)
    return tier_of(to)


def the_copy(tier: Path) -> Path:
    (name,) = os.listdir(tier / UNPACKED_DIR)
    return tier / UNPACKED_DIR / name


def snapshot(directory: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of every file under `directory`: what a remake would change."""
    return {str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_size,
                                            p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


# Real processes ---------------------------------------------------------------------------------


def test_a_hit_loads_the_unpacked_copy_and_leaves_nothing_in_the_temp_dir(
    built: tuple[Path, str], tmp_path: Path
) -> None:
    tier = copy_of(built, tmp_path / "cache")
    made = snapshot(the_copy(tier))
    for run in range(2):  # two fresh processes, two hits
        tmpdir = tmp_path / f"tmp{run}"
        tmpdir.mkdir()
        code, result, err = serve_worker.serve(tmp_path / "cache", INDUCTOR, TMPDIR=str(tmpdir))
        assert code == 0 and result is not None, err[-3000:]
        assert result["matched"] and result["sources"] == ["local"], result
        assert result["warnings"] == []
        assert temp_dirs_of_torch(tmpdir) == []
        assert snapshot(the_copy(tier)) == made  # loaded where it was, never made again
    assert listed(tier / ".staging") == []


def test_a_copy_killed_half_made_is_made_again_by_the_next_process(
    built: tuple[Path, str], tmp_path: Path
) -> None:
    """SIGKILL at each unpacking point (tests/test_crash_matrix.py has the full matrix)."""
    tier = copy_of(built, tmp_path / "cache", with_copy=False)
    for point in ("unpack.mid-copy", "unpack.staged"):
        code, result, _ = serve_worker.serve(tmp_path / "cache", INDUCTOR,
                                             TMPDIR=str(tmp_path), VLLM_NEURON_FAULT=point)
        assert code == -9 and result is None, (point, code)
        assert listed(tier / UNPACKED_DIR) == []
        assert listed(tier / ".staging"), "the killed copy stays in staging, for gc"
    tmpdir = tmp_path / "fresh"
    tmpdir.mkdir()
    code, result, err = serve_worker.serve(tmp_path / "cache", INDUCTOR, TMPDIR=str(tmpdir))
    assert code == 0 and result is not None, err[-3000:]
    assert result["matched"] and result["sources"] == ["local"] and result["warnings"] == []
    assert temp_dirs_of_torch(tmpdir) == []
    store = open_store(str(tier), create=False)
    assert [i.kind for i in plan_gc(store, older_than=-1).items] == ["staging", "staging"]


def test_a_full_tier_loads_the_package_with_one_warning(
    built: tuple[Path, str], tmp_path: Path, tmpfs: Path
) -> None:
    """Room for the entry, not for its copy: served from the package, unpacked into TMPDIR
    for the load and removed."""
    tier = copy_of(built, tmpfs, with_copy=False)
    remount(tmpfs, f"size={shutil.disk_usage(tmpfs).used // 1024 + 512}k")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # Its node files where this full tier would keep them, not the session's shared ones.
    code, result, err = serve_worker.serve(tmpfs, INDUCTOR, TMPDIR=str(tmpdir),
                                           _VLLM_NEURON_SHARED_NODE_FILES="")  # fmt: skip
    assert code == 0 and result is not None, err[-3000:]
    assert result["matched"] and result["sources"] == ["local"], result
    (said,) = result["warnings"]
    assert "cannot take unpacked packages" in said and "no space left" in said, said
    assert listed(tier / UNPACKED_DIR) == listed(tier / ".staging") == []  # dropped at once
    assert listed(tmpdir) == []  # the package unpacked for the load, then removed


# In this process -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Each test is a new process as far as the warnings said once go; what torch unpacks
    (the fallback's) goes to the test's own temp dir."""
    monkeypatch.setattr(unpacked, "_NO_ROOM", set())
    monkeypatch.setattr(unpacked, "_WARNED", set())
    (tmp_path / "torch-tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "torch-tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "torch-tmp"))
    yield
    arm(None)


class Hit:
    """A local hit of the built key in a copy of the built tier, and how to load it."""

    def __init__(self, tier: Path, key: str) -> None:
        self.tier, self.key = tier, key
        self.cache = TwoTierCache(str(tier))
        found = self.cache.local_tier.lookup(key)
        assert found is not None
        self.result = found
        self.artifact = ARTIFACTS.convert(found.record.meta)
        self.store = self.cache.local

    def load(self) -> Callable[..., Any]:
        return load_entry(HostToolchain(), self.store, self.result, self.artifact)

    def inputs(self) -> list[torch.Tensor]:
        torch.manual_seed(1)
        out = []
        for kind, dtype, shape, stride, *_ in self.result.record.meta["key_inputs"]["inputs"]:
            assert kind == "tensor"
            real = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype.split(".")[1]))
            out.append(real.copy_(torch.randn(shape)))
        return out

    def copy_dir(self) -> Path:
        return self.tier / copy_name(self.key, self.result.record.files["graph.pt2"])


@pytest.fixture
def hit(built: tuple[Path, str], tmp_path: Path) -> Hit:
    return Hit(copy_of(built, tmp_path / "cache"), built[1])


@pytest.fixture
def expected(built: tuple[Path, str], tmp_path: Path) -> Callable[[Hit], Any]:
    """The outputs of the graph, loaded from a pristine copy of the built tier."""
    pristine = Hit(copy_of(built, tmp_path / "pristine"), built[1])
    fn = HostToolchain().load_unpacked(str(pristine.copy_dir()), pristine.artifact)
    return lambda h: fn(*h.inputs())


def so_of(directory: Path) -> Path:
    (found,) = directory.rglob("*.so")
    return found


def damage_member(hit: Hit) -> None:
    so_of(hit.copy_dir()).unlink()


def truncate_member(hit: Hit) -> None:
    path = so_of(hit.copy_dir())
    path.write_bytes(path.read_bytes()[:4096])


def flip_a_byte(hit: Hit) -> None:
    path = so_of(hit.copy_dir())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def add_a_library(hit: Hit) -> None:
    path = so_of(hit.copy_dir())
    shutil.copyfile(path, path.with_name("extra.so"))


def drop_the_record(hit: Hit) -> None:
    (hit.copy_dir() / UNPACKED_RECORD).unlink()


def record_names_another_key(hit: Hit) -> None:
    path = hit.copy_dir() / UNPACKED_RECORD
    record = UNPACKED_RECORDS.decode(path.read_bytes())
    path.write_bytes(encode(msgspec.structs.replace(record, key="0" * 32)))


@pytest.mark.parametrize("damage", [damage_member, truncate_member, flip_a_byte, add_a_library,
                                    drop_the_record, record_names_another_key])  # fmt: skip
def test_a_torn_or_changed_copy_is_made_again_never_loaded(
    hit: Hit, expected: Callable[[Hit], Any], damage: Callable[[Hit], None],
    cache_warnings: Callable[[], list[str]], tmp_path: Path,
) -> None:
    damage(hit)
    fn = hit.load()
    torch.testing.assert_close(fn(*hit.inputs()), expected(hit))
    # Made again, whole: the record's files and nothing else, each as recorded.
    assert unpacked._sound(hit.store, f"{UNPACKED_DIR}/{hit.copy_dir().name}", hit.key,
                           "graph.pt2", hit.result.record.files["graph.pt2"])  # fmt: skip
    assert [p.name for p in hit.copy_dir().rglob("extra.so")] == []
    assert cache_warnings() == []
    assert temp_dirs_of_torch(tmp_path / "torch-tmp") == []


def test_a_package_that_fails_its_record_is_the_entrys_fault(hit: Hit) -> None:
    shutil.rmtree(hit.tier / UNPACKED_DIR)
    package = hit.tier / hit.key / "graph.pt2"
    data = bytearray(package.read_bytes())
    data[-100] ^= 0xFF  # same size: only a checksum can tell
    package.write_bytes(bytes(data))
    with pytest.raises(ToolchainError, match="graph.pt2 fails its (SHA-256|BLAKE3) check"):
        hit.load()
    assert listed(hit.tier / UNPACKED_DIR) == []


@pytest.mark.parametrize("kind", ["full", "read-only"])
@pytest.mark.parametrize("point", ["unpack.mid-copy", "unpack.staged"])
def test_a_tier_that_cannot_take_the_copy_loads_the_package_with_one_warning(
    hit: Hit, expected: Callable[[Hit], Any], kind: str, point: str,
    cache_warnings: Callable[[], list[str]], tmp_path: Path,
) -> None:
    shutil.rmtree(hit.tier / UNPACKED_DIR)
    arm(point, kind)  # the disk fills up (or turns read-only) as the copy is written
    loaded = [hit.load(), hit.load()]  # said once; kept alive, as a server keeps them
    for fn in loaded:
        torch.testing.assert_close(fn(*hit.inputs()), expected(hit))
    (said,) = cache_warnings()
    reason = "no space left" if kind == "full" else "read-only file system"
    assert "cannot take unpacked packages" in said and reason in said, said
    assert listed(hit.tier / UNPACKED_DIR) == listed(hit.tier / ".staging") == []
    assert os.listdir(tmp_path / "torch-tmp") == []  # unpacked for each load, then removed


def test_a_package_that_cannot_be_unpacked_here_loads_as_a_package_with_one_warning(
    hit: Hit, expected: Callable[[Hit], Any], cache_warnings: Callable[[], list[str]],
    tmp_path: Path,
) -> None:
    import zipfile

    shutil.rmtree(hit.tier / UNPACKED_DIR)
    prefix = hit.result.prefix
    package = hit.tier / hit.key / "graph.pt2"
    with zipfile.ZipFile(package, "a") as archive:  # a member whose name the copy keeps
        archive.writestr(UNPACKED_RECORD, b"{}")
    record = read_record(hit.store, prefix)
    files = {**record.files, "graph.pt2": hit.store.digest(join(prefix, "graph.pt2"))}
    (hit.tier / hit.key / ENTRY_RECORD).write_bytes(
        encode(msgspec.structs.replace(record, files=files)))
    hit = Hit(hit.tier, hit.key)
    torch.testing.assert_close(hit.load()(*hit.inputs()), expected(hit))
    (said,) = cache_warnings()
    assert "loads from its package, not from an unpacked copy" in said, said
    assert os.listdir(tmp_path / "torch-tmp") == []  # unpacked for the load, then removed


def test_a_full_temporary_directory_is_this_nodes_fault_never_the_entrys(
    hit: Hit, tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No copy in the tier, and no room to unpack the package in TMPDIR either: the load
    fails with the disk's error chained, so the runtime does not withdraw a good entry."""
    shutil.rmtree(hit.tier / UNPACKED_DIR)
    monkeypatch.setattr(unpacked, "_NO_ROOM", {hit.store.url})  # the tier took no copy
    monkeypatch.setenv("TMPDIR", str(tmpfs))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpfs))
    fill(tmpfs)
    with pytest.raises(ToolchainError) as raised:
        hit.load()
    fault = unwritable_cause(raised.value)
    assert fault is not None and fault.errno == errno.ENOSPC, raised.value
    assert not _entry_at_fault(hit.result, raised.value)


# Collected with the entry -----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["quarantine", "evict"])
def test_a_withdrawn_entry_takes_its_copy_with_it(hit: Hit, how: str) -> None:
    assert hit.copy_dir().is_dir()
    if how == "quarantine":
        assert quarantine_entry(hit.store, hit.key, "test", warn=False)
    else:
        (info,) = list_entries(hit.store)
        assert withdraw(hit.store, info) is None
    assert not hit.copy_dir().exists()
    assert plan_gc(hit.store, older_than=-1).items == ()


def test_gc_collects_a_copy_whose_entry_is_gone_and_never_one_whose_entry_is_there(
    hit: Hit,
) -> None:
    store = hit.store
    assert [i for i in plan_gc(store, older_than=-1).items if i.kind == "unpacked"] == []
    assert store.unpublish(hit.key)  # withdrawn behind the cache's back (a crash between)
    young = plan_gc(store)  # the default bound: left for now
    assert [k.kind for k in young.kept if k.kind == "unpacked"] == ["unpacked"]
    plan = plan_gc(store, older_than=-1)
    (item,) = [i for i in plan.items if i.kind == "unpacked"]
    assert item.where == f"{UNPACKED_DIR}/{hit.copy_dir().name}" and item.size > 1 << 20
    assert item.what == "unpacked package without its entry"
    outcome = plan.execute()
    assert outcome.removed == [item] and not outcome.failed
    assert not hit.copy_dir().exists()


def test_gc_keeping_a_manifests_graphs_withdraws_the_others_with_their_copies(hit: Hit) -> None:
    plan = plan_gc(hit.store, older_than=-1, keep=set())
    assert [i.kind for i in plan.items] == ["entry"]
    assert not plan.execute().failed
    assert not hit.copy_dir().exists() and not (hit.tier / hit.key).exists()


def test_loading_records_nothing_in_the_temp_dir_in_this_process_either(
    hit: Hit, expected: Callable[[Hit], Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="vllm_neuron.compile")
    shutil.rmtree(hit.tier / UNPACKED_DIR)
    torch.testing.assert_close(hit.load()(*hit.inputs()), expected(hit))  # makes the copy
    torch.testing.assert_close(hit.load()(*hit.inputs()), expected(hit))  # loads it
    assert temp_dirs_of_torch(tmp_path / "torch-tmp") == []
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


def test_a_copy_made_at_a_load_counts_against_the_size_bound_at_once(
    built: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    compile_fn: Callable[..., Any],
) -> None:
    """The bound counts an entry's unpacked copies, and the copy is made at the entry's
    first load on the node - after the publish's eviction pass: the load runs one more."""
    from vllm_neuron.compile.upkeep import eviction

    monkeypatch.setattr(eviction, "RECENT_USE_SECONDS", 0.0)
    tier = copy_of(built, tmp_path / "cache", with_copy=False)
    other = "0f" * 16
    TwoTierCache(str(tier)).get_or_compile(other, compile_fn(other))  # nobody loads it
    sizes = {e.key: e.size for e in list_entries(open_store(str(tier)))}
    cache = TwoTierCache(str(tier), max_size=sum(sizes.values()))  # both fit, uncopied
    assert sorted(e.key for e in list_entries(cache.local)) == sorted([built[1], other])
    found = cache.get_or_compile(built[1], lambda out: pytest.fail("compiled a hit"))
    load_entry(HostToolchain(), cache.local, found, ARTIFACTS.convert(found.record.meta),
               grew=cache.keep_within_bound)  # as the runtime loads
    assert listed(tier / UNPACKED_DIR), "the load made the copy"
    assert [e.key for e in list_entries(cache.local)] == [built[1]]  # the other one went


def test_cache_ls_says_the_bytes_of_the_unpacked_copies(hit: Hit, capsys) -> None:
    import json

    from vllm_neuron.cli import main
    from vllm_neuron.cli.format import human_size

    copied = sum(p.stat().st_size for p in hit.copy_dir().rglob("*") if p.is_file())
    assert main(["cache", "--cache-dir", str(hit.tier), "ls"]) == 0
    assert f"(and {human_size(copied)} of unpacked copies)" in capsys.readouterr().out
    assert main(["cache", "--cache-dir", str(hit.tier), "ls", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["key"] == hit.key and listed["unpacked_size"] == copied > 0


def plant_a_copy(hit: Hit) -> Path:
    """Change the copy's library and rewrite its unpacked.json to match: a copy that passes
    `_sound` (it checks the copy only against its own record, which nobody signs)."""
    copy = hit.copy_dir()
    so = so_of(copy)
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))
    path = copy / UNPACKED_RECORD
    record = UNPACKED_RECORDS.decode(path.read_bytes())
    files = dict(record.files)
    rel = str(so.relative_to(copy))
    files[rel] = open_store(str(copy)).digest(rel)
    path.write_bytes(encode(msgspec.structs.replace(record, files=files)))
    assert unpacked._sound(hit.store, f"{UNPACKED_DIR}/{copy.name}", hit.key, "graph.pt2",
                           hit.result.record.files["graph.pt2"])  # fmt: skip
    return copy


@pytest.mark.parametrize("mode", ["warn", "require"])
def test_a_baked_copy_is_never_loaded_unless_trust_is_off(
    hit: Hit, expected: Callable[[Hit], Any], mode: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_neuron.compile.tiers.baked import ReadOnlyTiers
    from vllm_neuron.compile.trust.policy import TrustPolicy

    planted = plant_a_copy(hit)
    handed: list[str] = []
    real = HostToolchain.load_unpacked

    def spy(self: HostToolchain, directory: str, artifact: Any) -> Any:
        handed.append(directory)
        assert Path(directory) != planted, "the planted copy was loaded"
        return real(self, directory, artifact)

    monkeypatch.setattr(HostToolchain, "load_unpacked", spy)
    tiers = ReadOnlyTiers([hit.store], trust=TrustPolicy(mode=mode),  # type: ignore[arg-type]
                          admit=lambda *a: True, record=lambda e: None)
    assert not tiers.copies_usable and ReadOnlyTiers(
        [hit.store], trust=TrustPolicy(), admit=lambda *a: True,
        record=lambda e: None).copies_usable  # only with trust off
    fn = load_entry(HostToolchain(), hit.store, hit.result, hit.artifact, read_only=hit.store,
                    baked_copies=tiers.copies_usable)
    torch.testing.assert_close(fn(*hit.inputs()), expected(hit))
    assert handed and all(Path(d) != planted for d in handed), handed


def test_cache_bake_replaces_a_copy_already_in_dir(hit: Hit, tmp_path: Path) -> None:
    from vllm_neuron.compile.commands.warm import bake_keys

    planted = plant_a_copy(hit)
    source = open_store(str(tmp_path / "pristine-source"))
    shutil.copytree(hit.tier / hit.key, tmp_path / "pristine-source" / hit.key)
    result = bake_keys(hit.store, [source], [hit.key], toolchain=HostToolchain())
    assert not result.failed and result.unpacked == [hit.key], result
    with zipfile.ZipFile(hit.tier / hit.key / "graph.pt2") as archive:
        member = archive.read(str(so_of(planted).relative_to(planted)))
    assert so_of(planted).read_bytes() == member  # made again from the verified package
