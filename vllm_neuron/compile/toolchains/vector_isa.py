"""Inductor's CPU probe, asked only the question whose answer is used.

Inductor writes its C++ kernels for one vector ISA, `pick_vec_isa`'s: with neither
``ATEN_CPU_CAPABILITY`` nor ``cpp.simdlen`` set, the first of its candidates (AMX,
AVX-512 VNNI, AVX-512, AVX2 on x86) that the CPU claims and for which a test program builds
and loads. But the list it picks from, `valid_vec_isa_list`, builds and loads the test
programs of *every* candidate the CPU claims before the first is taken, and each includes
ATen's vector headers: measured with torch 2.13 on an AMX host, 8 core-seconds for the four
candidates against 2.5 for the first (0.3 s against 1.1 s once the programs are in
Inductor's cache directory). On a cold host start that is the largest single step of the
probe that gates every compile (head_start.py).

`ask_first_valid_only` makes this process's list stop at the first candidate that passes,
tested exactly as Inductor tests it and in its order, so the pick - and every kernel, key
and flag that follows from it - is the one Inductor's own probe makes. Whenever the pick
would read more of the list (``ATEN_CPU_CAPABILITY`` or ``cpp.simdlen`` set, then or
later), or the platform is not x86 Linux, Inductor's own list answers. A torch whose probe
is laid out otherwise is left as it is.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any

from vllm_neuron.compile.toolchains.node_files import secure_inductor_dirs
from vllm_neuron.compile.toolchains.torch_internals import has, resolve
from vllm_neuron.envs import cold_start_without

__all__ = ["ask_first_valid_only", "pick_vector_isa"]

logger = logging.getLogger("vllm_neuron.compile")

_MARK = "_vllm_neuron_first_valid_only"
_VEC_ISA = "torch._inductor.cpu_vec_isa"
_INSTALL = threading.Lock()


def pick_vector_isa() -> Any:
    """Inductor's `pick_vec_isa`, with this process asking only the first valid candidate
    (`ask_first_valid_only`): what a compile worker or the cold start's probe pays once."""
    pick = resolve(f"{_VEC_ISA}.pick_vec_isa")
    if pick is None:
        return None  # a torch without it: its first compile probes as torch does
    secure_inductor_dirs()  # its test programs are built in Inductor's cache directory
    ask_first_valid_only()
    return pick()


def ask_first_valid_only() -> bool:
    """Make Inductor's list of valid vector ISAs, in this process, stop at the first valid
    one whenever only the first is used (see the module). Idempotent; True when it is (or
    was already) in place, False for a torch whose probe has another layout."""
    if cold_start_without("first-valid-isa"):  # the A/B benchmark's other side
        return False
    # Lazy: torch is heavy and optional; only the host toolchain needs it.
    from torch._inductor import config

    with _INSTALL:
        # Through the fence (torch_internals.py): a torch without one of these probes
        # every vector ISA the CPU claims, as it does on its own.
        inductors = resolve(f"{_VEC_ISA}.valid_vec_isa_list")
        if getattr(inductors, _MARK, False):
            return True
        if inductors is None or not _laid_out_as_expected(config):
            logger.debug("vllm_neuron: Inductor's CPU probe is not laid out as expected; "
                         "every vector ISA the CPU claims is probed")  # fmt: skip
            return False
        from torch._inductor import cpu_vec_isa

        replacement = _first_valid_only(inductors, cpu_vec_isa, config)
        cpu_vec_isa.valid_vec_isa_list = replacement  # type: ignore[assignment]
        return True


def _laid_out_as_expected(config: Any) -> bool:
    return (resolve(f"{_VEC_ISA}.x86_isa_checker") is not None
            and resolve(f"{_VEC_ISA}.supported_vec_isa_list") is not None
            and has("torch._inductor.config.cpp.simdlen"))  # fmt: skip


def _first_valid_only(inductors: Callable[[], list[Any]], cpu_vec_isa: Any,
                      config: Any) -> Callable[[], list[Any]]:  # fmt: skip
    """Inductor's `valid_vec_isa_list` cut short at its first valid candidate, whenever
    that is all the pick reads (`inductors` answers otherwise)."""
    asking = threading.Lock()  # a candidate's test sets its own flags while it runs

    @functools.cache
    def first_valid() -> list[Any]:
        # Inductor's own test, in its own order (`valid_vec_isa_list` on x86), cut short:
        # the CPU claims every flag the candidate names, and its test program builds and
        # loads (`bool(isa)`, cached by Inductor per candidate and on disk per program).
        with asking:
            claimed = cpu_vec_isa.x86_isa_checker()
            for isa in cpu_vec_isa.supported_vec_isa_list:
                if all(flag in claimed for flag in str(isa).split()) and isa:
                    return [isa]
            return []

    def valid_vec_isa_list() -> list[Any]:
        if (sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64")
                or config.cpp.simdlen is not None or os.environ.get("ATEN_CPU_CAPABILITY")):
            return inductors()  # the pick reads beyond the first: Inductor's whole list
        return first_valid()

    def cache_clear() -> None:  # as Inductor's own (functools.cache) has
        first_valid.cache_clear()
        getattr(inductors, "cache_clear", lambda: None)()

    setattr(valid_vec_isa_list, _MARK, True)
    valid_vec_isa_list.__wrapped__ = inductors  # type: ignore[attr-defined]
    valid_vec_isa_list.cache_clear = cache_clear  # type: ignore[attr-defined]
    return valid_vec_isa_list
