"""A fresh process's answer to Inductor's CPU probe, for test_vector_isa.py:
``python isa_probe_worker.py ours|inductor|other-layout`` prints one JSON line.

Every test program Inductor builds and loads goes through ``VecISA.check_build``; the
candidates it is called on are recorded, each once, in the order first tested."""

from __future__ import annotations

import json
import os
import sys

from torch._inductor import config, cpu_vec_isa

from vllm_neuron.compile.toolchains.vector_isa import ask_first_valid_only, pick_vector_isa

tested: list[str] = []
_check_build = cpu_vec_isa.VecISA.check_build


def _recording(self: cpu_vec_isa.VecISA, code: str) -> bool:
    if str(self) not in tested:  # the candidates tested, in order
        tested.append(str(self))
    return _check_build(self, code)


cpu_vec_isa.VecISA.check_build = _recording  # type: ignore[method-assign]


def _described(isa: cpu_vec_isa.VecISA) -> dict[str, object]:
    return {"isa": str(isa), "flags": isa.build_arch_flags() if isa else "",
            "bit_width": isa.bit_width() if isa else 0}


def _further_down() -> dict[str, object]:
    """The picks of settings that read further down the list than its first candidate."""
    answers: dict[str, object] = {}
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    answers["capability_avx2"] = _described(cpu_vec_isa.pick_vec_isa())
    del os.environ["ATEN_CPU_CAPABILITY"]
    config.cpp.simdlen = 256
    answers["simdlen_256"] = _described(cpu_vec_isa.pick_vec_isa())
    config.cpp.simdlen = None
    answers["unset_again"] = _described(cpu_vec_isa.pick_vec_isa())
    return answers


def main(mode: str) -> dict[str, object]:
    claimed = cpu_vec_isa.x86_isa_checker()
    candidates = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
                  if all(flag in claimed for flag in str(isa).split())]
    if mode == "inductor":
        answer = {"claimed": candidates, **_described(cpu_vec_isa.pick_vec_isa()),
                  "tested": list(tested)}
        return {**answer, **_further_down()}
    if mode == "other-layout":
        del cpu_vec_isa.x86_isa_checker
        before = cpu_vec_isa.valid_vec_isa_list
        return {"installed": ask_first_valid_only(),
                "untouched": cpu_vec_isa.valid_vec_isa_list is before}
    picked = pick_vector_isa()
    answer = {"claimed": candidates, **_described(picked), "tested": list(tested)}
    installed = cpu_vec_isa.valid_vec_isa_list
    answer["again"] = ask_first_valid_only() and cpu_vec_isa.valid_vec_isa_list is installed
    return {**answer, **_further_down()}  # answered by Inductor's whole list


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
