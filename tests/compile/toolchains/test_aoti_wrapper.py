"""AOTInductor's wrapper compiled in two parts (toolchains/aoti_wrapper.py and
aoti_runtime_store.py): real compiles.

Each test compiles a graph of its own (a constant no other test uses), so neither Inductor's
cache nor the dynamic loader hands back another test's build. The runtime objects are kept
in a group of node files of this module's own (node_files.py: the session's is shared with
other processes, which keep objects of their own there); each test starts as a new process
would (no split remembered as failed).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.fx

from vllm_neuron.compile.toolchains import aoti_wrapper, node_files
from vllm_neuron.compile.toolchains.aoti_runtime_store import FAILED, private_runtime_dir
from vllm_neuron.compile.toolchains.aoti_wrapper import (
    runtime_objects_dir,
    split_wrapper_source,
)
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.compile.toolchains.private_dirs import why_not_private

_scales = itertools.count(3)
TWO_PARTS = "compiled in two parts"


class Scaled(torch.nn.Module):
    """A small graph with a wrapper of its own: `scale` is baked into its kernel."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.silu(self.linear(x)) * self.scale + r
        return h, torch.nn.functional.rms_norm(h, (8,))


@contextlib.contextmanager
def node_files_in(base: Path) -> Iterator[None]:
    """This process's group of node files (its runtime objects) made anew under `base`, as a
    process whose local tier's ``.node`` is `base` would; the process's own again after.
    Torch's precompiled headers stay where this process first put them (moved once per
    process, private_dirs.py: moving them again would only build them again)."""
    node_files.secure_inductor_dirs()  # the headers' place fixed before the group changes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("_VLLM_NEURON_NODE_FILES", str(base))
        mp.delenv("_VLLM_NEURON_SHARED_NODE_FILES", raising=False)
        node_files.group_dir.cache_clear()
        try:
            yield
        finally:
            node_files.group_dir.cache_clear()


@pytest.fixture(scope="module")
def private_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("aoti-wrapper-tmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(root))
        mp.setattr(tempfile, "tempdir", str(root))
        with node_files_in(root / "tier" / node_files.NODE_DIR):
            yield root


@pytest.fixture
def runtime_dir(private_tmp: Path) -> Iterator[Path]:
    FAILED.clear()
    yield Path(runtime_objects_dir())
    FAILED.clear()


def compile_graph(tmp_path: Path, caplog: pytest.LogCaptureFixture, *, scale: float | None = None,
                  split: bool = True) -> tuple[bool, tuple[torch.Tensor, ...]]:  # fmt: skip
    """Compile and load a new graph; (whether its wrapper was built in two parts, outputs)."""
    scale = float(next(_scales)) if scale is None else scale
    torch.manual_seed(0)
    module = Scaled(scale)
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    out_dir = tmp_path / f"graph-{scale}-{split}"
    caplog.set_level(logging.DEBUG, logger="vllm_neuron.compile")
    caplog.clear()
    toolchain = HostToolchain()
    context = contextlib.nullcontext() if split else _whole()
    with context:
        artifact = toolchain.compile(torch.fx.symbolic_trace(module), inputs, str(out_dir))
    outputs = tuple(toolchain.load(str(out_dir), artifact)(*inputs))
    return any(TWO_PARTS in r.getMessage() for r in caplog.records), outputs


@contextlib.contextmanager
def _whole() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aoti_wrapper, "split_wrapper_builds", contextlib.nullcontext)
        yield


def kept_objects(runtime_dir: Path) -> list[Path]:
    return sorted(runtime_dir.glob("*.o")) if runtime_dir.is_dir() else []


# ---------------------------------------------------------------------------- real compiles
def test_a_wrapper_in_two_parts_gives_the_whole_wrappers_results_bit_for_bit(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    split, ours = compile_graph(tmp_path, caplog, scale=1.5)
    assert split, [r.getMessage() for r in caplog.records]
    whole, torchs = compile_graph(tmp_path, caplog, scale=1.5, split=False)
    assert not whole
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs, strict=True))
    (kept,) = kept_objects(runtime_dir)
    assert sorted(p.name for p in runtime_dir.iterdir() if p.suffix != ".lock") == [kept.name]


def test_a_second_graph_links_the_kept_runtime_without_compiling_it_again(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compile_graph(tmp_path, caplog)
    (kept,) = kept_objects(runtime_dir)
    before = kept.stat()
    split, _ = compile_graph(tmp_path, caplog)
    assert split
    assert kept_objects(runtime_dir) == [kept]
    after = kept.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_changed_runtime_object_is_never_linked_and_is_made_again(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compile_graph(tmp_path, caplog)
    (kept,) = kept_objects(runtime_dir)
    good = kept.read_bytes()
    kept.write_bytes(good[: len(good) // 2])  # torn: its bytes no longer match its name
    split, outputs = compile_graph(tmp_path, caplog, scale=2.25)
    assert split
    assert kept_objects(runtime_dir) == [kept] and kept.read_bytes() == good
    _, whole = compile_graph(tmp_path, caplog, scale=2.25, split=False)
    assert all(torch.equal(a, b) for a, b in zip(outputs, whole, strict=True))


def test_a_kept_object_that_does_not_link_is_removed_and_the_wrapper_compiled_whole(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that match their name but are no object (a writer that named garbage)."""
    compile_graph(tmp_path, caplog)
    (kept,) = kept_objects(runtime_dir)
    garbage = b"not an object file"
    kept.unlink()
    name = kept.name.split(".")[0]
    forged = runtime_dir / f"{name}.{hashlib.sha256(garbage).hexdigest()[:32]}.o"
    forged.write_bytes(garbage)
    split, outputs = compile_graph(tmp_path, caplog, scale=2.75)
    assert not split and not forged.exists()
    _, whole = compile_graph(tmp_path, caplog, scale=2.75, split=False)
    assert all(torch.equal(a, b) for a, b in zip(outputs, whole, strict=True))
    # Failed once in this process: not tried again at every graph ...
    assert not compile_graph(tmp_path, caplog)[0] and kept_objects(runtime_dir) == []
    FAILED.clear()  # ... but a new process makes it again
    assert compile_graph(tmp_path, caplog)[0]
    assert [p.name for p in kept_objects(runtime_dir)] == [kept.name]


def test_a_runtime_part_that_does_not_compile_is_tried_once_then_wrappers_compile_whole(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another torch whose runtime part will not compile on its own: one try in the
    process, never a second one (nor the model part) before the whole compile."""
    from vllm_neuron.compile.toolchains import aoti_runtime_store

    monkeypatch.setattr(aoti_wrapper, "_INSTANTIATE", "this is not C++;\n")
    commands: list[list[str]] = []

    def counted(cmd: list[str], cwd: str) -> bool:
        commands.append(cmd)
        return real_run(cmd, cwd)

    real_run = aoti_runtime_store.run
    before = kept_objects(runtime_dir)
    monkeypatch.setattr(aoti_runtime_store, "run", counted)
    monkeypatch.setattr(aoti_wrapper, "run", counted)
    for scale in (4.25, 4.5):
        split, outputs = compile_graph(tmp_path, caplog, scale=scale)
        _, whole = compile_graph(tmp_path, caplog, scale=scale, split=False)
        assert not split
        assert all(torch.equal(a, b) for a, b in zip(outputs, whole, strict=True))
    assert len(commands) == 1  # the runtime part, once: no model part, no second graph's try
    assert kept_objects(runtime_dir) == before


def test_a_runtime_dir_another_user_could_write_is_never_used(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compile_graph(tmp_path, caplog)
    kept = kept_objects(runtime_dir)
    runtime_dir.chmod(0o777)
    try:
        split, _ = compile_graph(tmp_path, caplog)
    finally:
        runtime_dir.chmod(0o700)
    assert not split and kept_objects(runtime_dir) == kept
    assert any("not private to this user" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("above", ["group-writable", "world-writable"])
def test_a_runtime_dir_under_a_directory_another_user_could_change_is_never_used(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch, above: str,
) -> None:
    """Another user who can write a directory above it could put another in its place: a
    local tier's node files there (and a temporary directory there) are never used; the
    process's own throwaway group, in this user's private temporary root, keeps the
    runtime objects instead (node_files.py), so the wrapper still splits (compiled once: a
    Kubernetes emptyDir's world-writable, not sticky directory)."""
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o775 if above == "group-writable" else 0o777)  # and not sticky
    monkeypatch.setattr(tempfile, "tempdir", str(loose))
    with node_files_in(loose / "tier" / node_files.NODE_DIR):
        used = Path(runtime_objects_dir())
        assert private_runtime_dir() == str(used)
        if above == "world-writable":
            split, _ = compile_graph(tmp_path, caplog)
            assert split and len(kept_objects(used)) == 1
    assert loose not in used.parents and why_not_private(str(used)) is None, used
    assert used.parent.parent.name.startswith(node_files.THROWAWAY_PREFIX), used
    # Nothing of the node's in the loose directory: at most the tier's directories it made
    # (0700, empty) before finding them not private.
    assert all(p.is_dir() and not p.is_symlink() for p in loose.rglob("*")), sorted(
        loose.rglob("*"))  # fmt: skip


def test_a_runtime_dir_made_under_a_permissive_umask_is_private_and_used(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "fresh").mkdir(mode=0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "fresh"))
    before = os.umask(0o002)
    try:
        split, _ = compile_graph(tmp_path, caplog)
    finally:
        os.umask(before)
    assert split
    assert Path(runtime_objects_dir()).stat().st_mode & 0o777 == 0o700


def test_a_runtime_dir_that_cannot_be_made_compiles_the_wrapper_whole(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    aside = runtime_dir.with_name("aside")
    if runtime_dir.exists():
        runtime_dir.rename(aside)
    runtime_dir.write_bytes(b"")  # a file where the directory would be
    try:
        split, outputs = compile_graph(tmp_path, caplog, scale=3.25)
    finally:
        runtime_dir.unlink()
        if aside.exists():
            aside.rename(runtime_dir)
    assert not split
    _, whole = compile_graph(tmp_path, caplog, scale=3.25, split=False)
    assert all(torch.equal(a, b) for a, b in zip(outputs, whole, strict=True))


def test_a_runtime_being_made_by_a_process_that_hangs_is_waited_for_a_bounded_time(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compile_graph(tmp_path, caplog)
    (kept,) = kept_objects(runtime_dir)
    name = kept.name.split(".")[0]
    kept.unlink()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(runtime_dir / f"{name}.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(aoti_wrapper, "LOCK_SECONDS", 0.2)
        split, _ = compile_graph(tmp_path, caplog)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    assert not split and kept_objects(runtime_dir) == []


def test_the_compile_worker_path_splits_the_wrapper_too(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm_neuron.compile.toolchains.host_jobs import compile_job, export_job

    torch.manual_seed(0)
    module = Scaled(float(next(_scales)))
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    caplog.set_level(logging.DEBUG, logger="vllm_neuron.compile")
    caplog.clear()
    export_job(HostToolchain(), torch.fx.symbolic_trace(module), inputs, str(job_dir))
    artifact = compile_job(str(job_dir), str(tmp_path / "out"))
    assert any(TWO_PARTS in r.getMessage() for r in caplog.records)
    outputs = HostToolchain().load(str(tmp_path / "out"), artifact)(*inputs)
    assert torch.allclose(outputs[0], module(*inputs)[0], atol=1e-5)


def test_preparing_keeps_the_runtime_part_and_compiles_nothing_else(
    runtime_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm_neuron.compile.toolchains.host_jobs import prepare_host_compiles

    for kept in kept_objects(runtime_dir):
        kept.unlink()
    (tmp_path / "scratch").mkdir()
    assert prepare_host_compiles(str(tmp_path / "scratch"))
    (kept,) = kept_objects(runtime_dir)
    assert list((tmp_path / "scratch").iterdir()) == []  # no package: the graph's code not built
    made = kept.stat()
    assert prepare_host_compiles(str(tmp_path / "scratch"))  # kept: nothing made again
    assert kept.stat().st_mtime_ns == made.st_mtime_ns
    assert compile_graph(tmp_path, caplog)[0]  # and a graph then links it


# ---------------------------------------------------------------------------- the text
PREAMBLE = "\n#include <a.h>\n#include <b.h>\n\n"
RUNTIME = ('static int x;\nextern "C" {\nint AOTInductorModelContainerCreate() { return 0; }\n'
           '} // extern "C"\n')
MODEL = "namespace torch::aot_inductor {\nAOTInductorModel::AOTInductorModel() {}\n}\n"


def test_a_wrapper_splits_into_its_runtime_and_its_model() -> None:
    parts = split_wrapper_source(PREAMBLE + RUNTIME + MODEL)
    assert parts is not None
    runtime, model = parts
    assert runtime.startswith(PREAMBLE + RUNTIME)
    assert "template class AOTInductorModelBase<AOTInductorModel>;" in runtime
    assert model.startswith(PREAMBLE) and model.endswith(MODEL)
    assert "extern template class AOTInductorModelBase<AOTInductorModel>;" in model


@pytest.mark.parametrize("text", [
    RUNTIME + MODEL,  # no include lines first
    PREAMBLE + RUNTIME.replace('} // extern "C"', "}") + MODEL,  # no end of the interface
    PREAMBLE + RUNTIME + RUNTIME + MODEL,  # two
    PREAMBLE + RUNTIME + MODEL.replace("AOTInductorModel::AOTInductorModel(", "f("),
    PREAMBLE + RUNTIME.replace("AOTInductorModelContainerCreate", "f") + MODEL,
    PREAMBLE + RUNTIME + MODEL + "AOTInductorModelBase<AOTInductorModel> y;\n",
])  # fmt: skip
def test_a_wrapper_laid_out_otherwise_is_compiled_whole(text: str) -> None:
    assert split_wrapper_source(text) is None

