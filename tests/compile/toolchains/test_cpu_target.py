"""Artifacts name the instructions they use (cpu_target.py): the host toolchain compiles for
an explicit target derived from the CPU's features, the key covers it, and a node never loads
an artifact that needs a feature it lacks.

Nothing here depends on the CPU model: "another CPU model" is this CPU's flags under another
model name, "a newer CPU" is this CPU's flags plus one feature it lacks (whichever of
`FEATURES` this CPU has not and the compiler knows: an Intel CPU lacks AMD's ``sse4a``, an
AMD one Intel's AVX-512 or AMX)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from torch._inductor import cpp_builder, cpu_vec_isa

from vllm_neuron.compile.key.cache_key import compute_cache_key
from vllm_neuron.compile.toolchains import aoti_runtime_store, cpu_target
from vllm_neuron.compile.toolchains.aoti_runtime_store import KeptRuntime
from vllm_neuron.compile.toolchains.base import ToolchainError
from vllm_neuron.compile.toolchains.cpu_target import (
    FEATURES,
    ISA_FLAGS,
    CpuInfo,
    explicit_target,
    missing_features,
    read_cpuinfo,
    vector_isa_requires,
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
    # every instruction-set flag native may use, and no other
    assert fallback.requires == tuple(sorted(this_cpu().flags & cpu_target.ISA_FLAGS))
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


# What the kernel prints in /proc/cpuinfo for the instruction sets of `FEATURES`: the quoted
# names of arch/x86/include/asm/cpufeatures.h (Linux 6.12). A Sapphire Rapids prints e.g.
# "avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8", never "avx512vnni".
KERNEL_FLAGS = frozenset("""
    fpu cx8 cmov clflush mmx fxsr sse sse2 syscall lm mmxext rdtscp 3dnowext 3dnow pni
    pclmulqdq monitor ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand
    lahf_lm abm sse4a 3dnowprefetch xop lwp fma4 tbm mwaitx fsgsbase sgx bmi1 hle avx2 bmi2
    rtm avx512f avx512dq rdseed adx avx512ifma clflushopt clwb avx512pf avx512er avx512cd
    sha_ni avx512bw avx512vl xsaveopt xsavec xsaves avx_vnni avx512_bf16 clzero rdpru
    wbnoinvd avx512vbmi pku waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni
    avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b enqcmd avx512_4vnniw
    avx512_4fmaps avx512_vp2intersect serialize tsxldtrk pconfig amx_bf16 avx512_fp16
    amx_tile amx_int8
""".split())  # noqa: SIM905 - the kernel's list, as it prints it


def test_feature_names_are_the_kernels_cpuinfo_spellings() -> None:
    assert set(FEATURES) <= KERNEL_FLAGS, set(FEATURES) - KERNEL_FLAGS
    assert ISA_FLAGS <= KERNEL_FLAGS, ISA_FLAGS - KERNEL_FLAGS
    # A Cascade Lake's line (flags as the kernel prints them): VNNI is enabled and required.
    v4 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "avx", "avx2",
          "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "avx512f", "avx512bw",
          "avx512cd", "avx512dq", "avx512vl"}  # fmt: skip
    target = explicit_target(CpuInfo("clx", frozenset(v4 | {"avx512_vnni"})), lambda f: True)
    assert "mavx512vnni" in target.cflags and "avx512_vnni" in target.requires


def test_the_vector_isa_flags_inductor_adds_are_required() -> None:
    """Inductor adds its vector ISA's flags (-mavx512vnni, -mamx-*) to every command itself:
    the artifact requires what they enable, whatever the target."""
    cpu = CpuInfo("any", frozenset({"fpu", "sse2", "avx2", "hypervisor"}))
    amx = vector_isa_requires(cpu_vec_isa.VecAMX().build_arch_flags(), cpu)
    assert {"avx512f", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"} <= amx
    assert vector_isa_requires("-mavx2 -mfma -mf16c", cpu) == {"avx2", "fma", "f16c"}
    # One whose feature /proc/cpuinfo cannot show: every instruction-set flag of the builder.
    assert vector_isa_requires("-mavx2 -mamx-fp16", cpu) == {"fpu", "sse2", "avx2"}


def test_the_chosen_vector_isa_is_guarded_by_check_meta(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(cpu_target, "_vector_isa_options",
                        lambda: cpu_vec_isa.VecAMX().build_arch_flags())  # fmt: skip
    for toolchain in (HostToolchain(cpu=this_cpu()),
                      HostToolchain({"cpp.march": "x86-64-v2"}, cpu=this_cpu())):
        requires = toolchain.host_target().requires
        assert {"avx512_vnni", "amx_tile", "amx_int8"} <= set(requires)


def test_non_isa_flags_stay_out_of_the_fallback_key() -> None:
    """Where torch's own flags are kept, the artifact requires the CPU's instruction sets,
    not flags that change with kernel, microcode or hypervisor."""
    base = this_cpu().flags
    noisy = base | {"md_clear", "flush_l1d", "ibpb", "hypervisor", "tsc_known_freq", "pti"}
    quiet = base - {"md_clear", "flush_l1d", "ibpb", "hypervisor", "tsc_known_freq", "pti"}
    march = {"cpp.march": "x86-64-v2"}
    targets = [HostToolchain(march, cpu=CpuInfo("m", flags)).host_target()
               for flags in (noisy, quiet)]  # fmt: skip
    assert targets[0] == targets[1]
    assert not {"md_clear", "hypervisor", "tsc_known_freq"} & set(targets[0].requires)
    # ...and still every instruction set: one more is one more requirement (fail closed).
    more = HostToolchain(march, cpu=CpuInfo("m", quiet | {"xop"})).host_target()
    assert "xop" in more.requires and "xop" not in targets[0].requires


def _in_another_process(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()  # fmt: skip


def test_what_cannot_be_read_is_never_a_shared_key(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "g++"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    here = (cpu_target.compiler_identity(str(broken)),
            cpu_target.torch_meaning(str(broken), ("march=native",)))
    there = _in_another_process(
        "from vllm_neuron.compile.toolchains import cpu_target as c;"
        f"print(c.compiler_identity({str(broken)!r}));"
        f"print(c.torch_meaning({str(broken)!r}, ('march=native',)))").splitlines()
    assert here[0].startswith("unreadable") and there[0].startswith("unreadable")
    assert here[0] != there[0] and here[1] != there[1]
    # CPU flags that cannot be read: a key naming this node, never another's.
    unreadable = HostToolchain(cpu=None).host_target()
    assert unreadable.requires == () and "unreadable" in unreadable.describe
    monkeypatch.setattr(cpu_target.platform, "node", lambda: "another-node")
    assert HostToolchain(cpu=None).host_target().describe != unreadable.describe


def test_a_compiler_failure_is_retried_and_never_cached(tmp_path: Path) -> None:
    """A transient failure (timeout, ENOMEM) does not give the process another key for
    its whole life: tried once more, and asked again on the next call."""
    fails = tmp_path / "fails"
    flaky = tmp_path / "g++"
    flaky.write_text(f"#!/bin/sh\nif [ -e {fails} ]; then n=$(cat {fails}); "
                     f"[ \"$n\" -gt 0 ] && echo $((n-1)) > {fails} && exit 1; fi\n"
                     "echo flaky 1.0\n")  # fmt: skip
    flaky.chmod(0o755)
    fails.write_text("1")  # the first run fails, the retry answers
    assert not cpu_target.compiler_identity(str(flaky)).startswith("unreadable")
    other = tmp_path / "other" / "g++"
    other.parent.mkdir()
    other.write_bytes(flaky.read_bytes())
    other.chmod(0o755)
    fails.write_text("2")  # both tries fail: this call's own key...
    assert cpu_target.compiler_identity(str(other)).startswith("unreadable")
    # ...and the next call asks again
    assert not cpu_target.compiler_identity(str(other)).startswith("unreadable")
    # The same for the option probe: a compiler not runnable now, runnable later.
    other.chmod(0o644)
    assert cpu_target._accepts(str(other), ("mavx2",)) is False
    other.chmod(0o755)
    assert cpu_target._accepts(str(other), ("mavx2",)) is True
