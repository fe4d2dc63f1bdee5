"""Toolchains: the host (AOTInductor) compile for real, the Neuron one through its pure parts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.fx
import torch.utils._pytree as pytree

from vllm_neuron import envs
from vllm_neuron.backends import encode
from vllm_neuron.compile.toolchains import (
    CompiledArtifact,
    ToolchainError,
    ToolchainUnavailable,
    select_toolchain,
)
from vllm_neuron.compile.toolchains import neuron as neuron_mod
from vllm_neuron.compile.toolchains.base import ARTIFACTS, format_shape, restore_output_structure
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.compile.toolchains.neuron import (
    INSTALL_HINT,
    NeuronToolchain,
    missing_neuron_packages,
    neuronx_cc_command,
    parse_hlo_entry_result_shapes,
    run_neuronx_cc,
)

PROJECT_ROOT = Path(__file__).resolve().parents[3]


class TinyMLP(torch.nn.Module):
    """2-layer MLP of width 8; returns a tuple with a scalar to exercise shapes/structure."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 8)
        self.l2 = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.l1(x))
        return self.l2(h), h.sum()


@dataclass
class HostCompile:
    gm: torch.fx.GraphModule
    inputs: list[Any]
    eager: Any
    entry_dir: Path
    meta: CompiledArtifact
    seconds: float
    inductor_cache: Path


@pytest.fixture(autouse=True)
def loads_unpack_into_the_tests_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`HostToolchain.load` hands torch's loader the package, which unpacks it into a new
    ``$TMPDIR/aotinductor_*`` kept until the model is destroyed (a process that exits first
    never removes it): here, the test's own directory. (The cache loads entries from an
    unpacked copy: compile/tiers/unpacked.py.)"""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.fixture(scope="session")
def host_compile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostCompile]:
    """One real AOTInductor compile per session, with a private Inductor cache so the
    measured time is a cold compile and the user's cache is untouched."""
    inductor_cache = tmp_path_factory.mktemp("inductor-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
        torch.manual_seed(0)
        captured: list[tuple[torch.fx.GraphModule, list[Any]]] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            captured.append((gm, list(example_inputs)))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(TinyMLP(), backend=backend)(torch.randn(4, 8))
        gm, inputs = captured[0]
        with torch.no_grad():
            eager = gm(*inputs)
        entry_dir = tmp_path_factory.mktemp("entry")
        start = time.perf_counter()
        meta = HostToolchain().compile(gm, inputs, str(entry_dir))
        seconds = time.perf_counter() - start
        yield HostCompile(gm, inputs, eager, entry_dir, meta, seconds, inductor_cache)


# Host toolchain ----------------------------------------------------------------------------


def test_host_compile_writes_the_package_and_metadata(
    host_compile: HostCompile, capsys: pytest.CaptureFixture[str]
) -> None:
    with capsys.disabled():
        print(f"\n[host] cold AOTInductor compile of TinyMLP: {host_compile.seconds:.1f} s")
    meta = host_compile.meta
    assert sorted(os.listdir(host_compile.entry_dir)) == ["graph.pt2"]
    assert (host_compile.entry_dir / "graph.pt2").stat().st_size > 0
    assert meta.toolchain == "host" and meta.target == "cpu-inductor"
    assert meta.files == ("graph.pt2",)
    assert meta.output_shapes == ("4, 8", "")  # the tuple (linear, scalar sum)
    assert meta.num_inputs == len(host_compile.inputs) == 5  # 4 lifted params + x
    assert meta.hlo_file is None
    assert ARTIFACTS.decode(encode(meta)) == meta
    assert any(p.is_file() for p in host_compile.inductor_cache.rglob("*"))


def test_host_artifact_matches_eager_in_process(host_compile: HostCompile) -> None:
    run = HostToolchain().load(str(host_compile.entry_dir), host_compile.meta)
    out = run(*host_compile.inputs)
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, host_compile.eager, strict=True):
        torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match="takes 5 inputs"):
        run(*host_compile.inputs[:-1])


def test_host_artifact_loads_in_a_fresh_process(
    host_compile: HostCompile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The entry is all a new process needs: no dynamo, no graph, no Inductor cache."""
    torch.save([t.detach() for t in host_compile.inputs], tmp_path / "inputs.pt")
    (tmp_path / "meta.json").write_bytes(encode(host_compile.meta))
    script = textwrap.dedent(
        f"""
        import sys, torch
        from vllm_neuron.compile.toolchains.base import ARTIFACTS
        from vllm_neuron.compile.toolchains.host import HostToolchain
        meta = ARTIFACTS.decode(open({str(tmp_path / "meta.json")!r}, "rb").read())
        inputs = torch.load({str(tmp_path / "inputs.pt")!r}, weights_only=True)
        out = HostToolchain().load({str(host_compile.entry_dir)!r}, meta)(*inputs)
        torch.save({{"type": type(out).__name__, "out": list(out)}},
                   {str(tmp_path / "out.pt")!r})
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(PROJECT_ROOT),
        # An empty Inductor cache proves nothing is reused from the compiling process.
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh-inductor-cache"),
    }
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    with capsys.disabled():
        print(f"\n[host] fresh process import+load+run: {time.perf_counter() - start:.1f} s")
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert result["type"] == "tuple"
    for got, want in zip(result["out"], host_compile.eager, strict=True):
        torch.testing.assert_close(got, want)


def test_host_loads_its_package_unpacked_with_the_same_results(
    host_compile: HostCompile, tmp_path: Path
) -> None:
    """`load_unpacked`: what a hit loads (compile/tiers/unpacked.py keeps the verified copy)."""
    import zipfile

    toolchain = HostToolchain()
    assert toolchain.package_of(host_compile.meta) == "graph.pt2"
    with zipfile.ZipFile(host_compile.entry_dir / "graph.pt2") as archive:
        archive.extractall(tmp_path / "unpacked")
    out = toolchain.load_unpacked(str(tmp_path / "unpacked"), host_compile.meta)(
        *host_compile.inputs)
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, host_compile.eager, strict=True):
        torch.testing.assert_close(got, want)
    with pytest.raises(ToolchainError, match="cannot load the unpacked AOTInductor package"):
        toolchain.load_unpacked(str(tmp_path / "empty"), host_compile.meta)


def test_host_load_refuses_another_toolchains_artifact(host_compile: HostCompile) -> None:
    foreign = msgspec.structs.replace(host_compile.meta, toolchain="neuron", target="trn2")
    with pytest.raises(ToolchainError, match="neuron/trn2"):
        HostToolchain().load(str(host_compile.entry_dir), foreign)


def test_host_load_of_a_missing_package_is_a_toolchain_error(
    host_compile: HostCompile, tmp_path: Path
) -> None:
    with pytest.raises(ToolchainError, match="cannot load"):
        HostToolchain().load(str(tmp_path), host_compile.meta)


def test_host_versions_and_args() -> None:
    versions = HostToolchain().versions()
    assert versions["torch"] == torch.__version__
    assert versions["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(versions) == {"torch", "machine", "cpu_capability", "cpu_features",
                             "cpu_target", "cpu_requires", "compiler", "program_rewrites"}
    assert HostToolchain().compiler_args() == []
    configured = HostToolchain({"max_autotune": False, "cpp.threads": 2})
    assert configured.compiler_args() == ["--cpp.threads=2", "--max_autotune=False"]


# Output structure --------------------------------------------------------------------------


def _spec(tree: Any) -> str:
    return pytree.treespec_dumps(pytree.tree_structure(tree))


@pytest.mark.parametrize(
    "structure",
    [
        (1, 2),
        [1, 2, 3],
        1,
        ((1, 2), [3]),
        {"a": 1, "b": (2, 3)},
    ],
)
def test_restore_output_structure(structure: Any) -> None:
    leaves, _ = pytree.tree_flatten(structure)
    tensors = [torch.full((2,), float(v)) for v in leaves]
    expected = pytree.tree_unflatten(tensors, pytree.tree_structure(structure))
    # Whatever a runtime hands back (flat list, flat tuple), the graph's structure returns.
    for runtime_result in (list(tensors), tuple(tensors)):
        got = restore_output_structure(runtime_result, _spec(structure), len(tensors))
        assert type(got) is type(expected)
        assert pytree.tree_structure(got) == pytree.tree_structure(expected)
    if len(tensors) == 1:
        assert restore_output_structure(tensors[0], _spec(structure), 1) is tensors[0]


def test_restore_output_structure_checks_arity() -> None:
    with pytest.raises(ToolchainError, match="returned 1 outputs, expected 2"):
        restore_output_structure([torch.zeros(1)], _spec((1, 2)), 2)


def test_format_shape() -> None:
    assert format_shape(torch.Size([4, 8])) == "4, 8"
    assert format_shape(()) == ""
    assert format_shape([2]) == "2"


@pytest.mark.parametrize("bad", ["/abs/graph.pt2", "../graph.pt2", "a/../../b", ""])
def test_artifact_file_names_must_stay_inside_the_entry(bad: str) -> None:
    with pytest.raises(ValueError, match="relative"):
        CompiledArtifact(
            toolchain="host", target="x", files=(bad,), output_shapes=(), out_spec="", num_inputs=0
        )


# Neuron toolchain --------------------------------------------------------------------------


def _absent(_: str) -> None:
    return None


def test_neuron_unavailable_names_both_packages_and_how_to_install() -> None:
    with pytest.raises(ToolchainUnavailable) as info:
        NeuronToolchain(which=_absent, find_spec=_absent)
    message = str(info.value)
    assert "torch-neuronx" in message and "neuronx-cc" in message
    assert INSTALL_HINT in message
    assert (
        "pip install neuronx-cc torch-neuronx --extra-index-url "
        "https://pip.repos.neuron.amazonaws.com" in message
    )


def test_neuron_unavailable_names_only_what_is_missing() -> None:
    only_cc_missing = missing_neuron_packages(which=_absent, find_spec=lambda n: object())
    assert len(only_cc_missing) == 1 and "neuronx-cc" in only_cc_missing[0]
    only_module_missing = missing_neuron_packages(
        which=lambda n: "/usr/bin/" + n, find_spec=_absent
    )
    assert len(only_module_missing) == 1 and "torch_neuronx" in only_module_missing[0]
    assert missing_neuron_packages(which=lambda n: "/x", find_spec=lambda n: object()) == []


def test_neuron_toolchain_with_packages_present_reports_versions() -> None:
    tc = NeuronToolchain(
        "trn2", ["--model-type=transformer"], which=lambda n: "/x", find_spec=lambda n: object()
    )
    assert (tc.name, tc.target) == ("neuron", "trn2")
    assert tc.compiler_args() == ["--model-type=transformer"]
    versions = tc.versions()
    assert set(versions) == {"torch", "torch-neuronx", "neuronx-cc", "nki"}
    assert versions["torch"].startswith("2.13.0")
    with pytest.raises(ValueError, match="invalid Neuron target"):
        NeuronToolchain("trn2; rm -rf /", which=lambda n: "/x", find_spec=lambda n: object())


def test_neuronx_cc_command_line() -> None:
    assert neuronx_cc_command("m/graph.hlo", "e/graph.neff", "trn2", ["-O1"]) == [
        "neuronx-cc",
        "compile",
        "--framework",
        "XLA",
        "m/graph.hlo",
        "--target",
        "trn2",
        "--output",
        "e/graph.neff",
        "-O1",
    ]


def _fake_compiler(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "neuronx-cc"
    exe.write_text(f"#!{sys.executable}\nimport sys, os, json\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe)


def test_run_neuronx_cc_runs_in_a_scratch_dir(tmp_path: Path) -> None:
    record = tmp_path / "argv.json"
    exe = _fake_compiler(
        tmp_path,
        f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
        "open('log-neuron-cc.txt', 'w').write('chatter')\n"
        "out = sys.argv[sys.argv.index('--output') + 1]\n"
        "open(out, 'wb').write(b'NEFF')\n",
    )
    entry = tmp_path / "entry"
    entry.mkdir()
    neff = entry / "graph.neff"
    command = run_neuronx_cc("model", str(neff), "trn2", ["-O1"], executable=exe)
    assert command[0] == exe
    assert json.loads(record.read_text()) == command[1:]
    assert neff.read_bytes() == b"NEFF"
    assert os.listdir(entry) == ["graph.neff"]  # compiler litter stays out of the entry


def test_run_neuronx_cc_failure_carries_the_compiler_output(tmp_path: Path) -> None:
    exe = _fake_compiler(tmp_path, "sys.stderr.write('ERROR: unsupported op foo\\n'); sys.exit(3)")
    with pytest.raises(ToolchainError, match=r"exited with 3.*unsupported op foo"):
        run_neuronx_cc("m", str(tmp_path / "g.neff"), "trn2", executable=exe)
    silent = _fake_compiler(tmp_path, "pass")
    with pytest.raises(ToolchainError, match="wrote no"):
        run_neuronx_cc("m", str(tmp_path / "g.neff"), "trn2", executable=silent)


# HLO text ----------------------------------------------------------------------------------

HLO_TUPLE = """\
HloModule SyncTensorsGraph.5, entry_computation_layout={(f32[4,8]{1,0})->(f32[4,8]{1,0}, s32[4]{0})}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main.5 (p0: f32[4,8]) -> (f32[4,8], s32[4]) {
  %p0 = f32[4,8]{1,0} parameter(0)
  %c = s32[4]{0} iota(), iota_dimension=0
  ROOT %tuple.4 = (f32[4,8]{1,0}, s32[4]{0}) tuple(f32[4,8]{1,0} %p0, s32[4]{0} %c)
}
"""


@pytest.mark.parametrize(
    "hlo,expected",
    [
        (HLO_TUPLE, ["4, 8", "4"]),
        ("ENTRY %main.3 (p0: f32[]) -> f32[] {\n ROOT %p0 = f32[] parameter(0)\n}", [""]),
        ("ENTRY %m (p: bf16[2,3]{1,0}) -> bf16[2,3]{1,0} {\n}", ["2, 3"]),
        (
            "ENTRY %g (p0.1: (f32[2], s32[]), p1: pred[3]) -> (bf16[1,4], bf16[1], "
            "bf16[1], bf16[1,4], bf16[1], /*index=5*/bf16[1,4], (f32[2], s32[])) {\n}",
            ["1, 4", "1", "1", "1, 4", "1", "1, 4", "2", ""],
        ),
        # No signature in the header: fall back to the ENTRY's ROOT instruction.
        (
            "%c (a: f32[9]) -> f32[9] {\n ROOT %a = f32[9] parameter(0)\n}\n"
            "ENTRY %main {\n  %p = f32[7,2]{1,0} parameter(0)\n"
            "  ROOT %t = (f32[7,2]{1,0}, u8[]) tuple(%p, %k)\n}",
            ["7, 2", ""],
        ),
        ("ENTRY %d (p: f32[<=16,8]) -> f32[<=16,8] {\n}", ["<=16, 8"]),
    ],
)
def test_parse_hlo_entry_result_shapes(hlo: str, expected: list[str]) -> None:
    assert parse_hlo_entry_result_shapes(hlo) == expected


def test_parse_hlo_without_entry_is_an_error() -> None:
    with pytest.raises(ValueError, match="no ENTRY"):
        parse_hlo_entry_result_shapes("HloModule m\n%f (a: f32[]) -> f32[] {\n}")


# Selection ---------------------------------------------------------------------------------


def test_select_auto_is_host_without_neuron_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(neuron_mod, "_find_spec", _absent)
    assert isinstance(select_toolchain("auto"), HostToolchain)
    assert isinstance(select_toolchain("host"), HostToolchain)
    with pytest.raises(ToolchainUnavailable, match="pip install neuronx-cc torch-neuronx"):
        select_toolchain("neuron")


def test_select_auto_prefers_neuron_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(neuron_mod, "_find_spec", lambda name: object())
    monkeypatch.setattr(neuron_mod.shutil, "which", lambda name: f"/opt/bin/{name}")
    chosen = select_toolchain("auto")
    assert isinstance(chosen, NeuronToolchain) and chosen.target == "trn2"
    assert isinstance(select_toolchain("host"), HostToolchain)  # explicit host still wins


def test_select_reads_the_environment_when_no_name_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(neuron_mod, "_find_spec", lambda name: object())
    monkeypatch.setattr(neuron_mod.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    envs.reset_for_tests()
    try:
        assert isinstance(select_toolchain(), HostToolchain)
    finally:
        monkeypatch.undo()
        envs.reset_for_tests()


def test_select_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown toolchain 'gpu'"):
        select_toolchain("gpu")  # type: ignore[arg-type]
