"""Float tolerances from the arithmetic, not from one machine.

PyTorch and onnxruntime pick their CPU kernels by shape and by CPU (AVX2, AVX-512, AMX), so two fp32
evaluations of the same exact value, a 5-row call and a 2-row one, a module and its graph, differ by
rounding only, and by different amounts on different machines. What bounds them is the arithmetic: a
dot product of n fp32 terms is off by at most about n * u * sum|a_i * b_i| (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., section 3.1; u = 2**-24, fp32's unit roundoff), and a
network chains `depth` such reductions, each adding its own rounding on values of about the output's
size. So each evaluation is within `fp32_bound(magnitude, reduction, depth)` of the exact value, and two
evaluations within twice that of one another (`evaluations=2`, the default of `assert_fp32_close`).

The bound is the worst case of every term rounding the same way; kernels on the machines this suite ran
on stay at 0.05-0.3 of it (a float64 reference in test_qwen3_5_modules measures one). A defect (a wrong
row, a leaked rejected token, a missing norm) moves values by 1e-2 and more, far above it at these
tiny shapes. Where the product promises bit-equality (speculative == plain), tests compare exactly.
"""

from __future__ import annotations

import numpy as np

FP32_UNIT_ROUNDOFF = 2.0 ** -24


def fp32_bound(magnitude: float, reduction: int, depth: int = 1) -> float:
    """Worst-case rounding of one fp32 evaluation: `depth` chained dot products of `reduction` terms whose
    products sum to about `magnitude` in absolute value (use the compared values' largest |value|, at least
    1: normalised activations carry unit-size terms). Returns an absolute error."""
    return depth * reduction * FP32_UNIT_ROUNDOFF * max(float(magnitude), 1.0)


def max_abs_err(got, want) -> float:
    """Largest |got - want| in float64 (0.0 for empty arrays); numpy arrays or torch tensors of one shape."""
    got, want = _f64(got), _f64(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return float(np.max(np.abs(got - want))) if got.size else 0.0


def assert_fp32_close(got, want, *, reduction: int, depth: int, what: str = "", evaluations: int = 2) -> float:
    """Assert that `got` and `want` are `evaluations` fp32 evaluations (2: both rounded; 1: `want` is exact,
    a float64 reference) of the same values within rounding; returns the bound used."""
    magnitude = float(np.max(np.abs(_f64(want)))) if np.size(_f64(want)) else 0.0
    bound = evaluations * fp32_bound(magnitude, reduction, depth)
    err = max_abs_err(got, want)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g} (fp32 rounding of depth {depth}, reduction {reduction})"
    return bound


def _f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (tests import torch; this module does not need to)
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)
