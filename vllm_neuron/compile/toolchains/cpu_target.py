"""The instructions a host artifact may contain: an explicit compiler target from the CPU's
features, never the compiler's ``native``.

Why: Inductor compiles its C++ with ``-march=native`` unless told otherwise, and what
``native`` means is the CPU model, not the features the key can see: an Ice Lake emits AVX-512
VBMI, GFNI and VAES where a Cascade Lake has none, and both claim AVX2, AVX-512 and VNNI. An
artifact fetched from the shared tier could then kill a serving node with SIGILL. So the host
toolchain compiles for a target named by features (`HostTarget`): the highest x86-64
micro-architecture level (``x86-64-v2``/``-v3``/``-v4``) whose features the CPU has, each
further feature of `FEATURES` it has as its own ``-m`` option (those the compiler does not
know are left out: the compiler could not emit them with ``native`` either), and
``-mtune=generic``. Two CPU models with the same features get the same target, the same code
and the same key; the features the target enables are what a node must have to load the
artifact (`missing_features`).

The target reaches Inductor through its private ``cpp_builder._get_cpu_arch_cflags``, only
where it answers ``march=native`` (Inductor's default: neither ``cpp.march`` nor
``TORCHINDUCTOR_CPP_MARCH`` set) and only in a thread inside `compiling_for`. A torch laid
out otherwise, a ``cpp.march`` of the user's, a CPU whose flags cannot be read or a machine
that is not x86-64 Linux keep torch's own flags, and the key then says what those flags mean
on this node: the compiler's own account of the target options they enable (`torch_meaning`)
- a different key from every explicit target, never a shared one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import platform
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm_neuron.compile.toolchains.torch_internals import cpu_feature, has, resolve, unknown

__all__ = ["FEATURES", "ISA_FLAGS", "LEVELS", "UNSHOWN", "CpuInfo", "HostTarget",
           "compiler_identity", "compiling_for", "cpp_compiler", "host_target",
           "missing_features", "node_token", "read_cpuinfo", "torch_meaning",
           "vector_isa_requires"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

CPUINFO = "/proc/cpuinfo"

# /proc/cpuinfo flag -> the compiler option that lets it emit that feature's instructions.
# The flag names are the kernel's own /proc/cpuinfo spellings (arch/x86/include/asm/
# cpufeatures.h, the quoted name of each X86_FEATURE_*): ``avx512_vnni``, not ``avx512vnni``.
# A feature the kernel does not print (AMX-FP16, AVX-IFMA, AVX-VNNI-INT8, AVX-NE-CONVERT,
# CMPccXADD) is not here: no node could show it, so it is never enabled (`UNSHOWN`).
FEATURES: dict[str, str] = {
    "pni": "msse3", "ssse3": "mssse3", "sse4_1": "msse4.1", "sse4_2": "msse4.2",
    "popcnt": "mpopcnt", "cx16": "mcx16", "lahf_lm": "msahf",
    "avx": "mavx", "avx2": "mavx2", "bmi1": "mbmi", "bmi2": "mbmi2", "f16c": "mf16c",
    "fma": "mfma", "abm": "mlzcnt", "movbe": "mmovbe", "xsave": "mxsave",
    "avx512f": "mavx512f", "avx512bw": "mavx512bw", "avx512cd": "mavx512cd",
    "avx512dq": "mavx512dq", "avx512vl": "mavx512vl",
    "avx512_vnni": "mavx512vnni", "avx512_bf16": "mavx512bf16", "avx512vbmi": "mavx512vbmi",
    "avx512_vbmi2": "mavx512vbmi2", "avx512ifma": "mavx512ifma",
    "avx512_bitalg": "mavx512bitalg", "avx512_vpopcntdq": "mavx512vpopcntdq",
    "avx512_fp16": "mavx512fp16", "avx_vnni": "mavxvnni",
    "gfni": "mgfni", "vaes": "mvaes", "vpclmulqdq": "mvpclmulqdq", "pclmulqdq": "mpclmul",
    "aes": "maes", "sha_ni": "msha", "adx": "madx", "rdrand": "mrdrnd", "rdseed": "mrdseed",
    "fsgsbase": "mfsgsbase", "clflushopt": "mclflushopt", "clwb": "mclwb",
    "xsavec": "mxsavec", "xsaveopt": "mxsaveopt", "xsaves": "mxsaves",
    "3dnowprefetch": "mprfchw", "movdiri": "mmovdiri", "movdir64b": "mmovdir64b",
    "serialize": "mserialize", "sse4a": "msse4a", "clzero": "mclzero", "rdpid": "mrdpid",
    "amx_tile": "mamx-tile", "amx_bf16": "mamx-bf16", "amx_int8": "mamx-int8",
}  # fmt: skip

UNSHOWN: dict[str, str] = {
    "mamx-fp16": "amx_fp16", "mavxifma": "avx_ifma", "mavxvnniint8": "avx_vnni_int8",
    "mavxneconvert": "avx_ne_convert", "mcmpccxadd": "cmpccxadd"}  # fmt: skip
"""Options whose feature /proc/cpuinfo does not print: a node cannot show it has them, so
code built with one requires every instruction-set flag of the node that built it."""

_BASELINE = frozenset({"fpu", "cx8", "cmov", "clflush", "mmx", "fxsr", "sse", "sse2", "lm",
                       "syscall"})  # fmt: skip
_OTHER_ISA = frozenset({
    "mmxext", "3dnow", "3dnowext", "rdtscp", "xop", "fma4", "tbm", "lwp", "mwaitx",
    "monitor", "rtm", "hle", "pku", "waitpkg", "cldemote", "enqcmd", "sgx", "pconfig",
    "tsxldtrk", "wbnoinvd", "rdpru", "avx512pf", "avx512er", "avx512_4vnniw",
    "avx512_4fmaps", "avx512_vp2intersect"})  # fmt: skip
ISA_FLAGS: frozenset[str] = frozenset(FEATURES) | _BASELINE | _OTHER_ISA
"""The /proc/cpuinfo flags that name instructions (x86-64 baseline and levels, `FEATURES`,
and the further extensions a compiler's ``native`` may emit: XOP, FMA4, TBM, RTM, WAITPKG,
...). Where torch's own flags are kept, these are what an artifact requires; the other
flags (``md_clear``, ``flush_l1d``, ``ibpb``, ``hypervisor``, ``tsc_known_freq``...) change
with kernel, microcode and hypervisor and say nothing of the code."""

_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4", _V4), ("x86-64-v3", _V3), ("x86-64-v2", _V2), ("x86-64", frozenset()))
"""The x86-64 micro-architecture levels, highest first, with the features each implies."""

TUNE = "mtune=generic"
_ACTIVE = threading.local()
_INSTALL = threading.Lock()
_MARK = "_vllm_neuron_explicit_target"


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says of the first CPU: its model (never in the key: two models
    with the same features share entries) and its feature flags."""

    model: str
    flags: frozenset[str]


def read_cpuinfo(text: str | None = None) -> CpuInfo | None:
    """This node's `CpuInfo` (or that of `text`, /proc/cpuinfo's layout); None when there
    is none to read (not Linux, no ``flags`` line)."""
    if text is None:
        try:
            with open(CPUINFO, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return None
    model, flags = "", None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        name = name.strip()
        if not sep:
            continue
        if name == "model name" and not model:
            model = value.strip()
        elif name == "flags" and flags is None:
            flags = frozenset(value.split())
    return None if flags is None else CpuInfo(model, flags)


@dataclass(frozen=True)
class HostTarget:
    """What the host toolchain compiles for, and what the key says of it.

    ``cflags``: the explicit target in Inductor's form (options without the leading dash),
    or empty when torch's own flags are kept. ``describe``: the key's ``cpu_target``.
    ``requires``: the CPU flags a node must have to run the code (empty when unknown: the
    key's ``describe`` then names this node's CPU precisely)."""

    cflags: tuple[str, ...]
    describe: str
    requires: tuple[str, ...]


def explicit_target(cpu: CpuInfo, accepts: Callable[[tuple[str, ...]], bool]) -> HostTarget:
    """The explicit target of `cpu`: its highest level, its further `FEATURES` the compiler
    `accepts`, generic tuning."""
    level, implied = next((name, feats) for name, feats in LEVELS if feats <= cpu.flags)
    base = (f"march={level}", TUNE)
    extras: list[tuple[str, str]] = []
    candidates = [(f, o) for f, o in FEATURES.items() if f in cpu.flags and f not in implied]
    if accepts(base + tuple(o for _, o in candidates)):
        extras = candidates
    else:  # one the compiler does not know: it cannot emit it with `native` either
        extras = [(f, o) for f, o in candidates if accepts(base + (o,))]
    cflags = base + tuple(o for _, o in extras)
    requires = tuple(sorted(implied | {f for f, _ in extras}))
    return HostTarget(cflags, " ".join(f"-{c}" for c in cflags), requires)


def host_target(compiler: str, inductor_configs: Mapping[str, Any],
                cpu: CpuInfo | None) -> HostTarget:  # fmt: skip
    """The target the host toolchain compiles for with `compiler` and `inductor_configs`:
    `explicit_target` of `cpu` where torch would use ``-march=native`` and the override is
    in place (`_fence_holds`); else torch's own flags, described by `torch_meaning`. Either
    way it requires what Inductor's vector ISA adds (`vector_isa_requires`).

    A CPU whose flags cannot be read (`cpu` None) requires nothing that could be checked,
    so its ``describe`` names this node (`node_token`): its code is never shared."""
    torch_flags = _torch_arch_cflags(compiler, inductor_configs)
    if (cpu is not None and torch_flags == ("march=native",) and _fence_holds()
            and sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")):
        target = explicit_target(cpu, functools.partial(_accepts, compiler))
    elif cpu is None:
        return HostTarget((), f"{torch_meaning(compiler, torch_flags)}; CPU flags unreadable "
                              f"on node {node_token()}", ())  # fmt: skip
    else:
        isa = sorted(cpu.flags & ISA_FLAGS) if torch_flags else []
        target = HostTarget((), torch_meaning(compiler, torch_flags), tuple(isa))
    vector = vector_isa_requires(_vector_isa_options(), cpu)
    return HostTarget(target.cflags, target.describe,
                      tuple(sorted(set(target.requires) | vector)))  # fmt: skip


def vector_isa_requires(options: str, cpu: CpuInfo) -> frozenset[str]:
    """The CPU flags `options` (the build flags of Inductor's vector ISA, which it adds to
    every command itself: ``-mavx512vnni``, ``-mamx-int8``...) let the code use; where one
    names a feature /proc/cpuinfo does not print (`UNSHOWN`) or one unknown here, every
    instruction-set flag of `cpu` (fail closed: no node with less loads it)."""
    by_option = {option: flag for flag, option in FEATURES.items()}
    required: set[str] = set()
    for option in options.split():
        flag = by_option.get(option.lstrip("-"))
        if flag is None:
            return frozenset(cpu.flags & ISA_FLAGS)
        required.add(flag)
    return frozenset(required)


def _vector_isa_options() -> str:
    """The build flags of every vector ISA Inductor could pick on this CPU (those whose
    features the CPU claims, as Inductor's own list tests them, with the extensions it adds
    where torch says the CPU has them): an upper bound of its pick, read without the test
    builds that make the pick itself cost seconds (vector_isa.py)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return ""
    checker = resolve("torch._inductor.cpu_vec_isa.x86_isa_checker")
    candidates = resolve("torch._inductor.cpu_vec_isa.supported_vec_isa_list")
    if checker is None or candidates is None:
        return "-unknown-vector-isa"  # torch laid out otherwise: fail closed
    claimed = checker()
    options = [isa.build_arch_flags() for isa in candidates
               if str(isa).split() and all(f in claimed for f in str(isa).split())]  # fmt: skip
    for claim, probe, option in (("avx512", "_is_avx512_bf16_supported", "-mavx512bf16"),
                                 ("amx_tile", "_is_amx_fp16_supported", "-mamx-fp16")):
        if claim in claimed:
            has = cpu_feature(probe)
            # Unknown: an option unknown here, so every ISA flag is required (fail closed).
            options.append(option if has else f"-unknown-{probe}" if has is None else "")
    return " ".join(o for o in options if o)


def missing_features(requires: tuple[str, ...] | list[str], cpu: CpuInfo | None) -> list[str]:
    """The features of `requires` this CPU does not claim (all of them when its flags cannot
    be read: fail closed)."""
    have = cpu.flags if cpu is not None else frozenset()
    return [f for f in requires if f not in have]


def node_token() -> str:
    """This node's name in a key that must never be shared (a digest of its host name and
    machine id): what could not be read here is not assumed to be as elsewhere."""
    parts = [platform.node()]
    with contextlib.suppress(OSError), open("/etc/machine-id", encoding="utf-8") as f:
        parts.append(f.read().strip())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


# -------------------------------------------------------------------------- the compiler
_PROCESS_TOKEN = secrets.token_hex(8)
"""Names what a compiler did not answer in the key: never equal in another process, so the
code it built is never shared (`_answered`)."""
_T = TypeVar("_T")


def _answered(failed: Callable[..., _T]) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Cache the answers of a compiler probe, never its failures (a timeout, ENOMEM, a
    compiler being replaced): a failure is tried once more, then the call answers
    `failed(*args, exc)` - a key of its own, for this call only."""

    def wrap(probe: Callable[..., _T]) -> Callable[..., _T]:
        answers: dict[tuple[Any, ...], _T] = {}

        @functools.wraps(probe)
        def cached(*args: Any) -> _T:
            if args in answers:
                return answers[args]
            for attempt in (1, 2):
                try:
                    answers[args] = answer = probe(*args)
                    return answer
                except (OSError, subprocess.SubprocessError) as exc:
                    if attempt == 2:
                        logger.warning("vllm_neuron: the C++ compiler did not answer %s (%s); "
                                       "this compile gets a key of its own", args, exc)  # fmt: skip
                        return failed(*args, exc)
            raise AssertionError("unreachable")

        cached.cache_clear = answers.clear  # type: ignore[attr-defined]
        return cached

    return wrap


@_answered(lambda compiler, exc: f"unreadable: {compiler}: {type(exc).__name__} "
                                 f"(process {_PROCESS_TOKEN})")  # fmt: skip
def compiler_identity(compiler: str) -> str:
    """What the key says of `compiler`: a digest of its ``--version`` and target triple (its
    path is left out: the same compiler is installed in different places), or what kept it
    from answering (a key of this process's own, never a shared one)."""
    out = [subprocess.run([compiler, arg], capture_output=True, text=True, check=True,
                          timeout=60).stdout for arg in ("--version", "-dumpmachine")]  # fmt: skip
    return hashlib.sha256("\0".join(out).encode()).hexdigest()[:32]


@_answered(lambda compiler, cflags, exc: False)
def _accepts(compiler: str, cflags: tuple[str, ...]) -> bool:
    done = subprocess.run([compiler, *(f"-{c}" for c in cflags), "-x", "c++",
                           "-fsyntax-only", "/dev/null"], capture_output=True,
                          check=False, timeout=60)  # fmt: skip
    return done.returncode == 0


@_answered(lambda compiler, cflags, exc: f"torch {' '.join(cflags) or '(none)'}: unreadable "
                                         f"{type(exc).__name__} (process {_PROCESS_TOKEN})")
def torch_meaning(compiler: str, cflags: tuple[str, ...]) -> str:
    """What torch's own `cflags` mean on this node: a digest of the compiler's account of
    the target options they enable (``-Q --help=target``: ``native`` expanded to this CPU's
    model and features), or what kept it from answering (a key of this process's own)."""
    args = [compiler, *(f"-{c}" for c in cflags), "-Q", "--help=target"]
    out = subprocess.run(args, capture_output=True, text=True, check=True,
                         timeout=60).stdout  # fmt: skip
    return f"torch {' '.join(cflags) or '(none)'}: {hashlib.sha256(out.encode()).hexdigest()[:32]}"


# --------------------------------------------------------------------- torch, behind a fence
_ARCH_CFLAGS = "torch._inductor.cpp_builder._get_cpu_arch_cflags"


def cpp_compiler() -> str:
    """The C++ compiler Inductor compiles with (its own choice; ``g++`` where torch cannot
    say: a torch laid out otherwise, keyed as unknown by the fence)."""
    choose = resolve("torch._inductor.cpp_builder.get_cpp_compiler")
    try:
        return str(choose()) if choose is not None else "g++"
    except Exception as exc:  # noqa: BLE001 - then the compile itself fails with torch's error
        unknown("torch._inductor.cpp_builder.get_cpp_compiler", f"raised {exc!r}")
        return "g++"


def _torch_arch_cflags(compiler: str, inductor_configs: Mapping[str, Any]) -> tuple[str, ...]:
    """The architecture flags torch itself compiles with, under `inductor_configs`'
    ``cpp.march`` (a torch without the function: ``march=native``, its default)."""
    from torch._inductor import config

    current = resolve(_ARCH_CFLAGS)
    original = getattr(current, "__wrapped__", current)
    if not callable(original):
        return ("march=native",)  # keyed by what it means, and as unknown (the fence)
    patch = {"cpp.march": inductor_configs["cpp.march"]} if "cpp.march" in inductor_configs else {}
    with config.patch(patch):
        return tuple(original(compiler))


def _fence_holds() -> bool:
    """Whether torch is laid out as the override needs: installed (or installable)."""
    return _install()


def _install() -> bool:
    from torch._inductor import config

    with _INSTALL:
        current = resolve(_ARCH_CFLAGS)
        if getattr(current, _MARK, False):
            return True
        if current is None or not has("torch._inductor.config.cpp.march"):
            logger.debug("vllm_neuron: Inductor's architecture flags are not laid out as "
                         "expected; torch's own are used (and keyed)")  # fmt: skip
            return False
        original: Callable[[str], list[str]] = current

        def arch_cflags(cpp_compiler: str) -> list[str]:
            flags = original(cpp_compiler)
            target: tuple[str, ...] | None = getattr(_ACTIVE, "cflags", None)
            if target and flags == ["march=native"] and config.cpp.march is None:
                return list(target)
            return flags

        setattr(arch_cflags, _MARK, True)
        arch_cflags.__wrapped__ = original  # type: ignore[attr-defined]
        from torch._inductor import cpp_builder

        cpp_builder._get_cpu_arch_cflags = arch_cflags
        return True


@contextlib.contextmanager
def compiling_for(cflags: tuple[str, ...], inductor_configs: Mapping[str, Any]) -> Iterator[None]:
    """Within this block, in this thread, Inductor compiles for `cflags` where it would
    compile for ``native`` (nothing changes when `cflags` is empty: torch's own flags).
    Raises ValueError when `cflags` were keyed but torch would no longer compile for
    ``native`` (``cpp.march`` set since): the artifact would not be what its key says."""
    if cflags:
        compiler = cpp_compiler()
        now = _torch_arch_cflags(compiler, inductor_configs)
        if now != ("march=native",) or not _install():
            raise ValueError(f"the key names the explicit target {' '.join(cflags)}, but "
                             f"Inductor now compiles with {' '.join(now) or 'no target'} "
                             "(cpp.march or TORCHINDUCTOR_CPP_MARCH set since)")
    saved = getattr(_ACTIVE, "cflags", None)
    _ACTIVE.cflags = cflags
    try:
        yield
    finally:
        _ACTIVE.cflags = saved
