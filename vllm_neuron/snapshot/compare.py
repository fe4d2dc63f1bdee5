"""How a replayed output compares with the output captured on the device.

Why per dtype and per tensor: a divergence has to be told apart from rounding, and what
counts as rounding depends on the dtype. Per output the comparison gives max absolute
error, max relative error and cosine similarity, and a pass/fail against ``atol``/``rtol``
(``|actual - expected| <= atol + rtol * |expected|`` elementwise, NaN only where the
reference has NaN). Without explicit tolerances each dtype gets the defaults of
``torch.testing.assert_close`` (exact for integers and bool).

A *reference* comparison (the eager runner: the exported graph run by PyTorch op by op,
against what the compiled artifact returned on the device) also allows for the rounding a
different compiler does differently: a fused kernel keeps a low-precision intermediate in
float32 where eager rounds it after every op, so near a cancellation the relative error is
unbounded while the absolute one is a few units in the last place of the tensor's scale.
Its absolute tolerance is ``atol + REFERENCE_ULPS * eps(dtype) * max|expected|`` (the
finite elements); ``--atol``/``--rtol`` replace both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .bundles import ReplayError

__all__ = ["REFERENCE_ULPS", "OutputComparison", "compare_outputs", "default_tolerances"]

REFERENCE_ULPS = 4  # a reference comparison's allowance, in eps of the output's largest value

# (rtol, atol) per dtype: torch.testing.assert_close's defaults, fp8 by mantissa width.
_TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-3, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
    "float8_e4m3fn": (0.125, 1e-5),
    "float8_e4m3fnuz": (0.125, 1e-5),
    "float8_e5m2": (0.25, 1e-5),
    "float8_e5m2fnuz": (0.25, 1e-5),
    "float8_e8m0fnu": (1.0, 1e-5),
}


def default_tolerances(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for an output of ``dtype`` when none are given: exact for integers."""
    rtol, atol = _TOLERANCES.get(dtype, (0.0, 0.0))
    return atol, rtol


@dataclass(frozen=True)
class OutputComparison:
    """How one replayed output compares with its captured reference."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    max_abs_err: float
    max_rel_err: float
    cosine: float
    atol: float
    rtol: float
    mismatched: int
    passed: bool
    problem: str | None = None


def _scale_allowance(expected: Any) -> float:
    """``REFERENCE_ULPS`` units in the last place of ``expected``'s largest finite value
    (0 for integers, bool and an all-non-finite tensor)."""
    import torch  # heavy optional dependency: only when outputs are compared

    if not (expected.is_floating_point() or expected.is_complex()):
        return 0.0
    wide = expected.detach().cpu().abs().to(torch.float64).flatten()
    finite = wide[torch.isfinite(wide)]
    if finite.numel() == 0:
        return 0.0
    real = expected.real if expected.is_complex() else expected
    return REFERENCE_ULPS * float(torch.finfo(real.dtype).eps) * float(finite.max())


def _compare_one(
    index: int, actual: Any, expected: Any, atol: float | None, rtol: float | None,
    reference: bool = False,
) -> OutputComparison:
    import torch  # heavy optional dependency: only when outputs are compared

    if not isinstance(expected, torch.Tensor):
        same = actual == expected
        return OutputComparison(index, type(expected).__name__, (), 0.0 if same else math.inf,
                                0.0 if same else math.inf, 1.0 if same else 0.0, 0.0, 0.0,
                                0 if same else 1, bool(same),
                                None if same else f"{actual!r} != {expected!r}")  # fmt: skip
    dname = str(expected.dtype).removeprefix("torch.")
    d_atol, d_rtol = default_tolerances(dname)
    if atol is None and reference and expected.numel():
        d_atol += _scale_allowance(expected)
    a_tol = d_atol if atol is None else atol
    r_tol = d_rtol if rtol is None else rtol
    shape = tuple(int(d) for d in expected.shape)

    def fail(problem: str) -> OutputComparison:
        return OutputComparison(index, dname, shape, math.inf, math.inf, 0.0, a_tol, r_tol,
                                int(expected.numel()), False, problem)  # fmt: skip

    if not isinstance(actual, torch.Tensor):
        return fail(f"replay returned {type(actual).__name__}, expected a tensor")
    if tuple(actual.shape) != shape:
        return fail(f"shape {tuple(actual.shape)} != captured {shape}")
    if actual.dtype != expected.dtype:
        return fail(f"dtype {actual.dtype} != captured {expected.dtype}")
    if expected.numel() == 0:
        return OutputComparison(index, dname, shape, 0.0, 0.0, 1.0, a_tol, r_tol, 0, True)
    wide = torch.complex128 if expected.is_complex() else torch.float64
    a = actual.detach().cpu().to(wide).flatten()
    b = expected.detach().cpu().to(wide).flatten()
    both_nan = torch.isnan(a) & torch.isnan(b)
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    equal = both_nan | same_inf
    diff = (a - b).abs().to(torch.float64)
    diff = torch.where(equal, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    ref = b.abs().to(torch.float64)
    ok = (diff <= a_tol + r_tol * ref) | equal
    rel = torch.where(
        ref > 0, diff / torch.where(ref > 0, ref, torch.ones_like(ref)),
        torch.where(diff > 0, torch.full_like(diff, math.inf), torch.zeros_like(diff)),
    )  # fmt: skip
    finite = torch.isfinite(a) & torch.isfinite(b)
    af, bf = a[finite], b[finite]
    dot = (af * bf.conj()).sum().real if a.is_complex() else (af * bf).sum()
    na, nb = af.abs().pow(2).sum().sqrt(), bf.abs().pow(2).sum().sqrt()
    if float(na) == 0.0 and float(nb) == 0.0:
        cosine = 1.0
    elif float(na) == 0.0 or float(nb) == 0.0:
        cosine = 0.0
    else:
        cosine = float(dot / (na * nb))
    mismatched = int((~ok).sum())
    return OutputComparison(
        index=index,
        dtype=dname,
        shape=shape,
        max_abs_err=float(diff.max()),
        max_rel_err=float(rel.max()),
        cosine=cosine,
        atol=a_tol,
        rtol=r_tol,
        mismatched=mismatched,
        passed=mismatched == 0,
    )


def compare_outputs(
    actual: Sequence[Any],
    expected: Sequence[Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    reference: bool = False,
) -> list[OutputComparison]:
    """Elementwise comparison of replayed outputs against the captured ones; ``reference``:
    the replay is the eager reference, not the same artifact (see the module docstring)."""
    if len(actual) != len(expected):
        raise ReplayError(f"replay returned {len(actual)} outputs, captured {len(expected)}")
    pairs = enumerate(zip(actual, expected, strict=True))
    return [_compare_one(i, a, e, atol, rtol, reference) for i, (a, e) in pairs]
