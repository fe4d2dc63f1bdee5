"""Inductor's CPU probe asked only the question whose answer is used
(toolchains/vector_isa.py): in fresh processes with a private Inductor cache, the pick, its
flags and its bit width are Inductor's own, and test programs are built only for the
picked ISA; whatever reads further down the list gets Inductor's whole list."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cache_workers import SAFETY

from vllm_neuron.compile.toolchains import vector_isa

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "isa_probe_worker.py"

x86_linux = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the first-valid probe applies on x86 Linux only; elsewhere Inductor's list answers")


def _probe(mode: str, inductor_cache: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_VEC_ISA_OK")}  # fmt: skip
    env.update(TORCHINDUCTOR_CACHE_DIR=str(inductor_cache), TMPDIR=str(inductor_cache.parent))
    done = subprocess.run([sys.executable, str(WORKER), mode], env=env, capture_output=True,
                          text=True, timeout=2 * SAFETY, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Ours first in a fresh Inductor cache, then Inductor's own in the same cache (it
    reuses the picked ISA's programs and builds the others)."""
    inductor_cache = tmp_path_factory.mktemp("isa") / "inductor"
    ours = _probe("ours", inductor_cache)
    return {"ours": ours, "inductor": _probe("inductor", inductor_cache)}


@x86_linux
@pytest.mark.timeout(5 * SAFETY)
def test_the_pick_is_inductors_and_only_its_programs_are_built(answers):
    ours, inductor = answers["ours"], answers["inductor"]
    assert ours["claimed"] == inductor["claimed"] and ours["claimed"], ours
    for field in ("isa", "flags", "bit_width"):
        assert ours[field] == inductor[field], (field, ours, inductor)
    # The claimed candidates up to the picked one, in Inductor's order (the picked one
    # first, unless a CPU claims one its kernel or compiler refuses); Inductor's list tests
    # every claimed one.
    picked_at = ours["claimed"].index(ours["isa"])
    assert ours["tested"] == ours["claimed"][:picked_at + 1], ours
    assert inductor["tested"] == ours["claimed"], inductor
    assert ours["again"] is True  # idempotent: installed once


@x86_linux
@pytest.mark.timeout(5 * SAFETY)
def test_what_reads_further_down_the_list_gets_inductors_whole_list(answers):
    ours, inductor = answers["ours"], answers["inductor"]
    # ATEN_CPU_CAPABILITY=avx2 and cpp.simdlen=256 pick AVX2 on any host that has it, below
    # the first valid candidate on an AVX-512 one: the same picks as Inductor's own list.
    for setting in ("capability_avx2", "simdlen_256", "unset_again"):
        assert ours[setting] == inductor[setting], (setting, ours, inductor)
    assert ours["unset_again"]["isa"] == ours["isa"]  # unset: the first again


@pytest.mark.timeout(2 * SAFETY)
def test_a_torch_laid_out_otherwise_is_left_as_it_is(tmp_path):
    answer = _probe("other-layout", tmp_path / "inductor")
    assert answer == {"installed": False, "untouched": True}


# ------------------------------------------------------------------ the decision, any CPU
class _Candidate:
    """Stands in for one of Inductor's vector ISAs: its name, whether its test passes."""

    def __init__(self, name: str, passes: bool, asked: list[str]) -> None:
        self.name, self.passes, self.asked = name, passes, asked

    def __str__(self) -> str:
        return self.name

    def __bool__(self) -> bool:
        self.asked.append(self.name)
        return self.passes


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str], Any]:
    """A first-valid list over stand-in candidates, on x86 Linux: AMX claimed but refused
    (a kernel without AMX state), AVX-512 VNNI the first that passes."""
    asked: list[str] = []
    names = ["avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2"]
    candidates = [_Candidate(n, i > 0, asked) for i, n in enumerate(names)]
    inductor = SimpleNamespace(x86_isa_checker=lambda: ["avx2", "avx512", "avx512_vnni",
                                                        "amx_tile"],
                               supported_vec_isa_list=candidates)  # fmt: skip
    config = SimpleNamespace(cpp=SimpleNamespace(simdlen=None))
    monkeypatch.setattr(vector_isa.sys, "platform", "linux")
    monkeypatch.setattr(vector_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    whole = ["Inductor's whole list"]
    valid = vector_isa._first_valid_only(lambda: whole, inductor, config)
    return valid, asked, config


def test_the_list_stops_at_the_first_candidate_that_passes(stand_ins, monkeypatch):
    valid, asked, _ = stand_ins
    (first,) = valid()
    assert str(first) == "avx512 avx512_vnni"
    assert asked == ["avx512 avx512_vnni amx_tile", "avx512 avx512_vnni"]  # not the rest
    valid()
    assert len(asked) == 2  # asked once per process
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "")  # empty: Inductor takes the first too
    assert [str(isa) for isa in valid()] == ["avx512 avx512_vnni"]


@pytest.mark.parametrize("setting", ["avx2", "avx512", "default", "bogus", "simdlen", "arm"])
def test_whatever_reads_further_gets_inductors_whole_list(stand_ins, monkeypatch, setting):
    valid, asked, config = stand_ins
    if setting == "simdlen":
        config.cpp.simdlen = 256
    elif setting == "arm":
        monkeypatch.setattr(vector_isa.platform, "machine", lambda: "aarch64")
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", setting)
    assert valid() == ["Inductor's whole list"] and asked == []
    valid.cache_clear()  # as Inductor's own list has
