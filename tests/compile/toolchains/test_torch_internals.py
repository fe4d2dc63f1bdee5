"""Torch's private names behind one fence (toolchains/torch_internals.py).

The canary: at the pinned torch every fenced name is there with the signature we expect,
and the functions we replace are still read only where the replacement is seen (a scan of
torch's source). Forced missing: each name the fence knows is hidden in turn (as after a
rename in a later torch) and a real small host compile still succeeds with correct output,
without the shortcut; the names that feed the key fail closed (a key unlike the normal one
and unlike the one of the feature being absent).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_neuron.compile.toolchains import torch_internals
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.compile.toolchains.torch_internals import FENCED, resolve

WORKER = Path(__file__).parents[1] / "helpers" / "fence_worker.py"
RUN_CMD = "torch._inductor.cpp_builder._run_compile_cmd"
ARCH = "torch._inductor.cpp_builder._get_cpu_arch_cflags"
VEC = "torch._inductor.cpu_vec_isa"
# Keyed as the compiled program's: read (and warned) by a compile, not by the key's versions.
PROGRAM_KEYED = ["torch._C._autograd._get_data_attr", "torch._ops.OpOverload",
                 "torch._ops.OpOverloadPacket"]  # fmt: skip
KEYED = sorted(q for q, e in FENCED.items() if e.feeds_key and q not in PROGRAM_KEYED)


@pytest.fixture(autouse=True)
def fresh_fence() -> Iterator[None]:
    torch_internals._forget()
    yield
    torch_internals._forget()


def _hide(monkeypatch: pytest.MonkeyPatch, qualname: str) -> None:
    entry = FENCED[qualname]
    monkeypatch.setitem(FENCED, qualname, dataclasses.replace(entry, name=entry.name + "_gone"))


# ---------------------------------------------------------------------------------- canary
def test_every_fenced_name_is_there_with_its_signature_at_the_pinned_torch() -> None:
    # A fresh process: nothing of ours replaced yet, so torch's own functions are read.
    code = ("import json; from vllm_neuron.compile.toolchains import torch_internals as t; "
            "print(json.dumps({q: t._problem(e) for q, e in t.FENCED.items()}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip
    problems = json.loads(done.stdout.splitlines()[-1])
    assert problems == dict.fromkeys(FENCED), problems
    assert all(e.purpose and e.without for e in FENCED.values())


@functools.cache
def _torch_sources() -> dict[str, str]:
    root = Path(torch.__file__).parent
    return {str(p.relative_to(root)): p.read_text(encoding="utf-8", errors="replace")
            for p in root.rglob("*.py") if "testing" not in p.parts}  # fmt: skip


@pytest.mark.parametrize("module, name", [
    ("_inductor/cpp_builder.py", "_run_compile_cmd"),
    ("_inductor/cpp_builder.py", "_get_cpu_arch_cflags"),
    ("_inductor/cpu_vec_isa.py", "valid_vec_isa_list"),
])  # fmt: skip
def test_what_we_replace_is_read_only_by_its_own_module_by_name(module: str, name: str) -> None:
    """Our replacement is seen only if torch looks the name up in its module at each call:
    every mention is in `module`, its definition or a call by name (no alias, no import
    elsewhere that would keep torch's own function)."""
    pattern = re.compile(rf"(?<![\w.]){name}\b")
    mentions = {path: text for path, text in _torch_sources().items() if pattern.search(text)}
    assert list(mentions) == [module]
    lines = [line.strip() for line in mentions[module].splitlines() if pattern.search(line)]
    defs = [line for line in lines if line.startswith(f"def {name}(")]
    others = [line for line in lines if not line.startswith(f"def {name}(")]
    assert len(defs) == 1 and others, lines
    assert all(re.search(rf"(?<![\w.]){name}\(", line) for line in others), others


# ------------------------------------------------------------------ forced missing: compiles
@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fence-tmp")  # Inductor's cache shared by the compiles


def _compile(shared_tmp: Path, scale: float, *hidden: str) -> dict[str, Any]:
    env = {**os.environ, "TMPDIR": str(shared_tmp)}
    done = subprocess.run([sys.executable, str(WORKER), str(scale), *hidden], env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.splitlines()[-1]))


VEC_AND_KEY = [f"{VEC}.valid_vec_isa_list", f"{VEC}.x86_isa_checker",
               f"{VEC}.supported_vec_isa_list", f"{VEC}.pick_vec_isa",
               "torch._inductor.cpp_builder.get_cpp_compiler",
               *(q for q in FENCED if q.startswith("torch.cpu."))]  # fmt: skip


# Not read by a compile: the probe run ahead (workers, head start); read only on a CPU that
# claims AVX-512 or AMX tiles (then warned too).
ONLY_SOMETIMES = {f"{VEC}.pick_vec_isa"}
SOMETIMES = {"torch.cpu._is_avx512_bf16_supported", "torch.cpu._is_amx_fp16_supported"}


# Two real compiles (each costs half a minute or more): the wrapper split's name missing, and
# every other fenced name missing at once. A changed signature takes the same path as a
# missing name (`resolve` answers None: test_a_changed_signature_is_not_used).
@pytest.mark.parametrize("scale, hidden", [
    (5.25, [RUN_CMD]),
    (6.25, [ARCH, *VEC_AND_KEY]),
], ids=["run_compile_cmd-missing", "arch_cflags-vec_isa-compiler-cpu_probes-missing"])  # fmt: skip
def test_a_compile_without_a_fenced_name_succeeds_whole_and_correct(
    shared_tmp: Path, scale: float, hidden: list[str]
) -> None:
    got = _compile(shared_tmp, scale, *hidden)
    assert got["correct"]
    names = [h.partition("=")[0] for h in hidden]
    for name in names:  # one warning per missing name a compile reads, naming it
        expected = (0,) if name in ONLY_SOMETIMES else (1,) if name not in SOMETIMES else (0, 1)
        assert sum(name in w for w in got["warnings"]) in expected, (name, got["warnings"])
    if RUN_CMD in names:
        assert not got["split"]  # torch compiled the wrapper whole
    else:
        assert got["split"]  # what is still there keeps working
    if ARCH in names:
        assert got["cflags"] == []  # torch's own -march=native, keyed as such
        assert got["versions"]["cpu_target"].startswith("torch march=native: ")
    keyed = sorted(n for n in names if FENCED[n].feeds_key)
    assert got["versions"].get("torch_internals", "") == ",".join(f"unknown:{n}" for n in keyed)


# --------------------------------------------------------------- forced missing: the key
@pytest.fixture(scope="module")
def normal_versions() -> dict[str, str]:
    torch_internals._forget()
    versions = HostToolchain().versions()
    assert torch_internals.unreadable() == ""
    return versions


def _absent(monkeypatch: pytest.MonkeyPatch, qualname: str) -> None:
    """The feature `qualname` reads, absent (torch answers, and says no)."""
    entry = FENCED[qualname]
    module = sys.modules[entry.module]
    value: Any = [] if entry.kind is list else (lambda: [])
    if entry.module == "torch.cpu":
        value = lambda: False  # noqa: E731
    monkeypatch.setattr(module, entry.name, value)


@pytest.mark.parametrize("qualname", KEYED)
def test_a_key_feeding_name_that_is_missing_fails_closed(
    qualname: str, normal_versions: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")
    with monkeypatch.context() as absent:
        if qualname.startswith(("torch.cpu.", VEC)):
            _absent(absent, qualname)
            absent_versions = HostToolchain().versions()
        else:  # not a feature: nothing to be absent
            absent_versions = normal_versions
    torch_internals._forget()
    _hide(monkeypatch, qualname)
    missing = HostToolchain().versions()
    again = HostToolchain().versions()
    assert missing == again  # stable: the same torch gets the same key
    assert missing != normal_versions and missing != absent_versions
    assert missing["torch_internals"] == f"unknown:{qualname}"
    if qualname.startswith("torch.cpu.") and qualname.rsplit(".", 1)[1] in dict(
            (p, n) for n, p in _FEATURES):  # fmt: skip
        assert f"unknown:{qualname}" in missing["cpu_features"].split(",")
    warned = [r.getMessage() for r in caplog.records if qualname in r.getMessage()]
    assert len(warned) == 1, warned


_FEATURES = [("avx2", "_is_avx2_supported"), ("avx512", "_is_avx512_supported"),
             ("avx512_bf16", "_is_avx512_bf16_supported"), ("vnni", "_is_vnni_supported"),
             ("amx_tile", "_is_amx_tile_supported"), ("amx_fp16", "_is_amx_fp16_supported")]


def test_a_cpu_probe_that_raises_is_unknown_never_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("cpuinfo unavailable")

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", broken)
    assert torch_internals.cpu_feature("_is_avx512_supported") is None
    assert "unknown:torch.cpu._is_avx512_supported" in torch_internals.unreadable()


def test_a_changed_signature_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import cpp_builder

    original = cpp_builder._get_cpu_arch_cflags
    monkeypatch.setattr(cpp_builder, "_get_cpu_arch_cflags",
                        lambda cpp_compiler, march=None: original(cpp_compiler))
    assert resolve(ARCH) is None
    assert torch_internals.unreadable() == f"unknown:{ARCH}"


def test_without_pick_vec_isa_the_probe_runs_nothing_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_neuron.compile.toolchains.vector_isa import pick_vector_isa

    _hide(monkeypatch, f"{VEC}.pick_vec_isa")
    assert pick_vector_isa() is None
    assert torch_internals.unreadable() == ""  # not in the key


# ------------------------------------------- the names fenced later (no compile: unit tests)
def test_the_graph_keys_operator_classes_are_there_and_fail_closed_when_hidden(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm_neuron.compile.key import torch_ops
    from vllm_neuron.compile.key.graph_canon import graph_digest

    assert {q: torch_ops._problem(e) for q, e in torch_ops.FENCED.items()} == dict.fromkeys(
        torch_ops.FENCED)  # the canary, at the pinned torch
    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")
    gm = torch.fx.symbolic_trace(_AddOne())
    normal = graph_digest(gm)
    for qualname, entry in torch_ops.FENCED.items():
        torch_ops._forget()
        with monkeypatch.context() as gone:
            gone.setitem(torch_ops.FENCED, qualname, entry._replace(name=entry.name + "_gone"))
            hidden, again = graph_digest(torch.fx.symbolic_trace(_AddOne())), graph_digest(
                torch.fx.symbolic_trace(_AddOne()))
            assert torch_ops.unreadable() == f"unknown:{qualname}"
        assert hidden == again != normal, qualname  # a key of its own, stable
        assert sum(qualname in r.getMessage() for r in caplog.records) <= 1
    assert graph_digest(torch.fx.symbolic_trace(_AddOne())) == normal


class _AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.add.Tensor(x, 1)


@pytest.mark.parametrize("qualname", PROGRAM_KEYED)
def test_a_host_program_name_that_is_missing_is_keyed_unknown(
    qualname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hide(monkeypatch, qualname)
    assert resolve(qualname) is None
    assert HostToolchain().versions()["torch_internals"] == f"unknown:{qualname}"


def test_without_pytree_the_host_toolchain_is_unavailable_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_neuron.compile.toolchains import base

    _hide(monkeypatch, "torch.utils._pytree.tree_leaves")
    base._pytree.cache_clear()
    try:
        with pytest.raises(base.ToolchainUnavailable, match=r"_pytree\.tree_leaves"):
            base.restore_output_structure([torch.ones(1)], "", 1)
    finally:
        base._pytree.cache_clear()


def test_without_the_package_loader_class_the_package_is_loaded_instead(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from vllm_neuron.compile.toolchains import base, host

    _hide(monkeypatch, "torch._C._aoti.AOTIModelPackageLoader")
    with pytest.raises(base.ToolchainUnavailable, match="AOTIModelPackageLoader"):
        host._load_unpacked(str(tmp_path))  # tiers/unpacked.py: the package instead


def test_without_fake_tensor_every_input_is_exported_from_a_real_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_neuron.compile.toolchains import host

    gm = torch.fx.symbolic_trace(_AddOne())
    x = torch.ones(2)
    assert host._export_plan(gm, (x,)).gm is gm  # nothing fake, nothing symbolic: as is
    _hide(monkeypatch, "torch._subclasses.fake_tensor.FakeTensor")
    plan = host._export_plan(gm, (x,))
    assert plan.gm is not gm and plan.args[0] is not x and plan.args[0].shape == x.shape
    _hide(monkeypatch, "torch._guards.tracing")
    with host._outside_tracing():  # the caller's context, warned
        pass


def test_without_the_inductor_settings_there_is_no_shortcut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._inductor import config

    from vllm_neuron.compile.toolchains import vector_isa

    assert torch_internals.has("torch._inductor.config.cpp.simdlen")
    assert torch_internals.has("torch._inductor.config.cpp.march")
    assert vector_isa._laid_out_as_expected(config)
    _hide(monkeypatch, "torch._inductor.config.cpp.simdlen")
    assert not torch_internals.has("torch._inductor.config.cpp.simdlen")
    assert not vector_isa._laid_out_as_expected(config)


def test_without_dynamos_registry_the_backend_is_not_registered_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS

    from vllm_neuron import dynamo_backend

    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")
    monkeypatch.delitem(_COMPILER_FNS, dynamo_backend.BACKEND_NAME, raising=False)
    _hide(monkeypatch, "torch._dynamo.backends.registry.register_backend")
    assert dynamo_backend.register_backend() is False
    assert dynamo_backend.register_backend() is False
    assert dynamo_backend.BACKEND_NAME not in _COMPILER_FNS
    warned = [r.getMessage() for r in caplog.records if "register_backend" in r.getMessage()]
    assert len(warned) == 1 and "not registered" in warned[0], warned
    monkeypatch.undo()
    assert dynamo_backend.register_backend() is True
    # Registered, or left to dynamo's resolution of our entry point when an earlier test of
    # this process made dynamo discover it (register_backend's docstring): either way
    # torch's own lookup finds this very function.
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend(dynamo_backend.BACKEND_NAME) is dynamo_backend.vllm_neuron_backend
