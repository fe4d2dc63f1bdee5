"""Artifacts name the instructions they use (cpu_target.py): the host toolchain compiles for
an explicit target derived from the CPU's features, the key covers it, and a node never loads
an artifact that needs a feature it lacks.

Nothing here depends on the CPU model: "another CPU model" is this CPU's flags under another
model name, "a newer CPU" is this CPU's flags plus one feature it lacks (whichever of
`FEATURES` this CPU has not and the compiler knows: an Intel CPU lacks AMD's ``sse4a``, an
AMD one Intel's AVX-512 or AMX)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from torch._inductor import cpp_builder

from vllm_neuron.compile.key.cache_key import compute_cache_key
from vllm_neuron.compile.toolchains import aoti_runtime_store, cpu_target
from vllm_neuron.compile.toolchains.aoti_runtime_store import KeptRuntime
from vllm_neuron.compile.toolchains.base import ToolchainError
from vllm_neuron.compile.toolchains.cpu_target import (
    FEATURES,
    CpuInfo,
    explicit_target,
    missing_features,
    read_cpuinfo,
)
from vllm_neuron.compile.toolchains.host import HostToolchain, cpp_compiler, node_cpu


class Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x) * 2.0 + x.sum()


def this_cpu() -> CpuInfo:
    cpu = node_cpu()
    assert cpu is not None, "/proc/cpuinfo has no flags line"
    return cpu


def a_feature_this_cpu_lacks() -> str:
    """A feature of `FEATURES` this CPU does not claim and the compiler knows."""
    compiler = cpp_compiler()
    for feature, option in FEATURES.items():
        if feature not in this_cpu().flags and cpu_target._accepts(compiler, (option,)):
            return feature
    raise AssertionError("this CPU claims every feature the compiler knows")  # none does


def key_of(toolchain: HostToolchain) -> str:
    gm = torch.fx.symbolic_trace(Tiny())
    return compute_cache_key(gm, [torch.randn(4, 8)], toolchain_versions=toolchain.versions(),
                             compiler_args=toolchain.compiler_args(),
                             target=toolchain.target).key  # fmt: skip


def test_cpuinfo_is_read_model_and_flags() -> None:
    text = ("processor\t: 0\nmodel name\t: Some CPU @ 2GHz\nflags\t\t: fpu avx2 fma\n\n"
            "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")  # fmt: skip
    assert read_cpuinfo(text) == CpuInfo("Some CPU @ 2GHz", frozenset({"fpu", "avx2", "fma"}))
    assert read_cpuinfo("processor\t: 0\n") is None  # no flags: nothing to key on
    assert missing_features(("avx2",), None) == ["avx2"]  # unreadable: fail closed


def test_the_target_is_explicit_and_derived_from_the_features() -> None:
    target = HostToolchain().host_target()
    assert target.cflags[0].startswith("march=x86-64") and "mtune=generic" in target.cflags
    assert not any("native" in c for c in target.cflags)
    assert set(target.requires) <= this_cpu().flags  # what it needs, this CPU has
    versions = HostToolchain().versions()
    assert versions["cpu_target"] == " ".join(f"-{c}" for c in target.cflags)
    assert versions["cpu_requires"] == ",".join(target.requires)
    assert versions["compiler"] == cpu_target.compiler_identity(cpp_compiler())


def test_levels_and_features_the_compiler_does_not_know() -> None:
    v3 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "avx", "avx2",
          "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # fmt: skip
    cpu = CpuInfo("any", frozenset(v3 | {"vaes", "gfni", "fpu"}))
    target = explicit_target(cpu, lambda flags: "mgfni" not in flags)
    assert target.cflags == ("march=x86-64-v3", "mtune=generic", "mvaes")
    assert "gfni" not in target.requires and "vaes" in target.requires  # it emits no GFNI
    assert set(target.requires) == v3 | {"vaes"}
    bare = explicit_target(CpuInfo("old", frozenset({"fpu", "ssse3"})), lambda flags: True)
    assert bare.cflags == ("march=x86-64", "mtune=generic", "mssse3")


def test_two_cpu_models_with_the_same_features_share_every_key() -> None:
    here = HostToolchain()
    other_model = HostToolchain(cpu=CpuInfo("Another CPU model, same features",
                                            this_cpu().flags))  # fmt: skip
    assert other_model.host_target() == here.host_target()
    assert other_model.versions() == here.versions()
    assert key_of(other_model) == key_of(here)


def test_an_entry_for_a_newer_cpu_is_a_miss_here_and_never_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torch's loader would unpack here
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    extra = a_feature_this_cpu_lacks()
    newer = HostToolchain(cpu=CpuInfo("A newer CPU", this_cpu().flags | {extra}))
    assert extra in newer.host_target().requires
    assert key_of(newer) != key_of(HostToolchain())  # a miss: this node looks elsewhere

    commands: list[str] = []
    original = cpp_builder._run_compile_cmd

    def spy(cmd_line: str, cwd: str) -> None:
        commands.append(cmd_line)
        original(cmd_line, cwd)

    monkeypatch.setattr(cpp_builder, "_run_compile_cmd", spy)
    entry = tmp_path / "entry"
    start = time.perf_counter()
    meta = newer.compile(torch.fx.symbolic_trace(Tiny()), [torch.randn(4, 8)], str(entry))
    print(f"\n[cpu_target] compile for a newer CPU: {time.perf_counter() - start:.1f} s")
    assert extra in meta.requires
    # Every command compiled for the explicit target, none for `native`.
    option = f"-{FEATURES[extra]}"
    assert commands and all(option in c.split() and "-march=native" not in c for c in commands)

    loads: list[str] = []
    monkeypatch.setattr("vllm_neuron.compile.toolchains.host._load_package",
                        lambda path: loads.append(path))  # fmt: skip
    monkeypatch.setattr("vllm_neuron.compile.toolchains.host._load_unpacked",
                        lambda path: loads.append(path))  # fmt: skip
    for toolchain in (HostToolchain(), newer):  # whoever asks, on this CPU
        with pytest.raises(ToolchainError, match=f"lacks: {extra}; it is not loaded"):
            toolchain.load(str(entry), meta)
        with pytest.raises(ToolchainError, match=f"lacks: {extra}"):
            toolchain.load_unpacked(str(entry), meta)
    assert loads == []
    # The same artifact, needing only what this CPU has, is loaded (the check is the refusal).
    HostToolchain().load(str(entry), meta.__class__(**{
        **{f: getattr(meta, f) for f in meta.__struct_fields__},
        "requires": tuple(f for f in meta.requires if f != extra)}))  # fmt: skip
    assert loads == [str(entry / "graph.pt2")]


def test_torch_laid_out_otherwise_keeps_its_flags_and_keys_what_they_mean(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    explicit = HostToolchain().versions()
    monkeypatch.delattr(cpp_builder, "_get_cpu_arch_cflags")
    fallback = HostToolchain().host_target()
    assert fallback.cflags == ()  # torch's own behaviour
    assert fallback.describe.startswith("torch march=native: ")
    assert fallback.requires == tuple(sorted(this_cpu().flags))  # everything native may use
    assert HostToolchain().versions()["cpu_target"] != explicit["cpu_target"]


def test_a_users_march_is_kept_and_keyed() -> None:
    target = HostToolchain({"cpp.march": "x86-64-v2"}).host_target()
    assert target.cflags == () and target.describe.startswith("torch march=x86-64-v2: ")


def test_a_compiler_that_does_not_answer_is_a_key_of_its_own(tmp_path: Path) -> None:
    broken = tmp_path / "g++"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    assert cpu_target.compiler_identity(str(broken)).startswith("unreadable")
    assert cpu_target.compiler_identity(str(broken)) != cpu_target.compiler_identity(
        cpp_compiler())


def test_the_kept_runtime_of_a_native_command_is_named_by_what_native_means(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    compiler = cpp_compiler()

    def name(*flags: str) -> str:
        return KeptRuntime("int x;\n", [compiler, *flags, "-c", "a.cpp", "-o", "a.o"], "a.cpp",
                           "a.o").name  # fmt: skip

    native, explicit = name("-march=native"), name("-march=x86-64-v3", "-mtune=generic")
    here: Any = cpu_target.torch_meaning(compiler, ("march=native",))
    monkeypatch.setattr(aoti_runtime_store, "torch_meaning",
                        lambda c, flags: f"{here} on another CPU model")  # fmt: skip
    assert name("-march=native") != native  # the literal string is not the name
    assert name("-march=x86-64-v3", "-mtune=generic") == explicit  # the flags say it all
    done = subprocess.run([compiler, "-march=native", "-Q", "--help=target"],
                          capture_output=True, text=True, check=True)
    assert "-march=" in done.stdout  # what torch_meaning digests names the CPU
