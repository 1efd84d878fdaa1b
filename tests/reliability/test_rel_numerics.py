"""Stats numerics against an independent float64 reference (hypothesis + adversarial cases).

Reference conventions (documented in docs/reliability.md):
- counts are defined on the float32 product ``x.float() * scale``, which is what the cast sees;
  the reference computes that product with numpy float32 (not torch) and decides underflow and
  saturation with the *real* torch FP8 cast of the clamped product, not with thresholds;
- amax / min_nonzero / zeros / nonfinite / sq_signal are computed in float64 from the input's values;
- sq_err is sum((dequant(quant(x)) - x)^2) over finite x, in float64 (the product computes it in float32:
  relative tolerance 1e-3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8scope.capture.stats import full_stats
from fp8scope.emulate.amax import amax_pair, logged_amax
from fp8scope.formats import get_format
from fp8scope.schema import FIELD_INDEX

# every test here runs on both stats paths (compiled, eager)
pytestmark = pytest.mark.usefixtures("stats_path")

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")
FLT_MAX = float(np.finfo(np.float32).max)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def as_dict(v: torch.Tensor) -> dict:
    return {k: float(v[i]) for k, i in FIELD_INDEX.items()}


def reference(x: torch.Tensor, scale: float, fmt) -> dict:
    x32 = x.float().numpy().astype(np.float32)
    xd = x32.astype(np.float64)
    nan = np.isnan(xd)
    finite = np.isfinite(xd)
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.abs(x32) * np.float32(scale)  # float32 product, as the cast sees it
        signed = np.clip(x32 * np.float32(scale), -fmt.max, fmt.max)
    q = torch.from_numpy(signed.astype(np.float32)).to(fmt.dtype).float().numpy().astype(np.float64)
    nonzero = (xd != 0) & ~nan
    absd = np.abs(xd)
    deq = q * np.float64(np.float32(1.0 / scale)) if scale else q * 0
    with np.errstate(over="ignore", invalid="ignore"):
        err = np.where(finite, deq - xd, 0.0)
        sq_err = float(np.sum(err * err))
        sq_signal = float(np.sum(np.where(finite, xd, 0.0) ** 2))
    return {
        "numel": x.numel(),
        "amax": (math.nan if nan.any() else float(absd.max())) if x.numel() else 0.0,
        "min_nonzero": float(absd[nonzero].min()) if nonzero.any() else math.inf,
        "zeros": int((xd == 0).sum()),
        "nonfinite": int((~finite).sum()),
        "overflow": int((y > fmt.max).sum()),
        "underflow": int((nonzero & (q == 0)).sum()),
        "saturated": int((np.abs(q) == fmt.max).sum()),
        "sq_err": sq_err,
        "sq_signal": sq_signal,
    }


def check(x: torch.Tensor, scale: float, fmt) -> None:
    got = as_dict(full_stats(x, torch.tensor(scale), torch.tensor(np.float32(1.0 / scale) if scale else 0.0), 1.0, fmt))
    ref = reference(x, scale, fmt)
    for k in ("numel", "zeros", "nonfinite", "overflow", "underflow", "saturated"):
        assert got[k] == ref[k], (k, got[k], ref[k])
    for k in ("amax", "min_nonzero"):
        assert (math.isnan(got[k]) and math.isnan(ref[k])) or got[k] == ref[k], (k, got[k], ref[k])
    for k in ("sq_err", "sq_signal"):
        if ref[k] < FLT_MAX / 4:  # a float32 sum of values near FLT_MAX itself can still overflow
            # dequantization runs in float32 (as the cast's consumer does): per element it may differ
            # from the float64 reference by |x| * 2^-24, i.e. sq_err by up to ~sq_signal * 2^-46
            floor = 1e-30 + ref["sq_signal"] * 2.0**-44
            assert got[k] == pytest.approx(ref[k], rel=1e-3, abs=floor), (k, got[k], ref[k])
    for logged in (amax_pair(x)[0], logged_amax(x)):  # the cheap rows' amax: the same number
        assert same_float(float(logged), ref["amax"]) if ref["numel"] else float(logged) == 0.0


finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
scales = st.one_of(st.integers(-20, 20).map(lambda k: 2.0 ** k),
                   st.floats(1e-6, 1e6, allow_subnormal=False).map(lambda v: float(np.float32(v))))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(finite_or_not, min_size=0, max_size=200), dtype=st.sampled_from(list(DTYPES)),
       scale=scales, fmt=st.sampled_from([E4M3, E5M2]))
def test_hypothesis_tensors_match_reference(values, dtype, scale, fmt):
    x = torch.tensor(values, dtype=torch.float32).to(DTYPES[dtype])
    check(x, scale, fmt)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 5000), log_spread=st.floats(0, 30), seed=st.integers(0, 2**31), dtype=st.sampled_from(list(DTYPES)),
       scale=scales, fmt=st.sampled_from([E4M3, E5M2]))
def test_random_wide_range_tensors_match_reference(n, log_spread, seed, dtype, scale, fmt):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.rand(n, generator=g) * log_spread - log_spread / 2)
    check(x.to(DTYPES[dtype]), scale, fmt)


def _adversarial():
    sub32 = float(np.finfo(np.float32).smallest_subnormal)
    yield "all-zeros", torch.zeros(1000)
    yield "negative-zeros", -torch.zeros(64)
    yield "all-subnormal-fp32", torch.full((500,), sub32) * torch.arange(1, 501)
    yield "all-subnormal-fp16", torch.full((300,), 2.0 ** -24, dtype=torch.float16) * 3
    yield "all-subnormal-bf16", torch.full((300,), 1e-39).to(torch.bfloat16)
    x = torch.randn(10000) * 1e-3
    x[1234] = 1e30
    yield "one-huge-outlier", x
    yield "flt-max", torch.tensor([FLT_MAX, -FLT_MAX, 1.0])
    yield "only-flt-max", torch.tensor([FLT_MAX])
    yield "alternating-signs", torch.tensor([(-1.0) ** i * (i + 1) for i in range(4096)])
    yield "empty", torch.zeros(0)
    yield "empty-2d", torch.zeros(0, 16, dtype=torch.bfloat16)
    yield "nan-only", torch.full((10,), math.nan)
    yield "inf-and-nan", torch.tensor([math.inf, -math.inf, math.nan, 0.0, 1.0])
    yield "at-fp8-max", torch.tensor([448.0, -448.0, 464.0, 480.0, 57344.0, 61440.0])
    yield "at-underflow-edge", torch.tensor([2.0 ** -10, 2.0 ** -10 * 1.0001, 2.0 ** -17, 2.0 ** -17 * 1.0001])


@pytest.mark.parametrize("name, x", list(_adversarial()), ids=[n for n, _ in _adversarial()])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 10, 0.37])
def test_adversarial_tensors_match_reference(name, x, fmt, scale):
    check(x, scale, fmt)


def test_per_row_scale_matches_per_row_reference():
    torch.manual_seed(3)
    x = torch.randn(8, 64) * torch.logspace(-6, 4, 8)[:, None]
    scale = (E4M3.max / x.abs().amax(dim=1, keepdim=True)).float()
    got = as_dict(full_stats(x, scale, 1 / scale, x.abs().amax(dim=1, keepdim=True), E4M3))
    refs = [reference(x[i], float(scale[i, 0]), E4M3) for i in range(8)]
    for k in ("zeros", "nonfinite", "overflow", "underflow", "saturated"):
        assert got[k] == sum(r[k] for r in refs), k
    assert got["sq_err"] == pytest.approx(sum(r["sq_err"] for r in refs), rel=1e-3)


def test_sq_sums_stay_finite_for_huge_and_tiny_values():
    """sq_err/sq_signal are summed on a power-of-two rescaled copy (unit ~ 1/amax), so neither
    |x| ~ 1e20 (float32 squares overflow) nor |x| ~ 1e-25 (squares underflow) loses the sum."""
    for x in (torch.tensor([1e20, 1.0]), torch.tensor([3e-25, -1e-25])):
        got = as_dict(full_stats(x, torch.tensor(1.0), torch.tensor(1.0), 1.0, E4M3))
        ref = reference(x, 1.0, E4M3)
        assert got["sq_signal"] == pytest.approx(ref["sq_signal"], rel=1e-5)


def test_min_nonzero_of_flt_max():
    got = as_dict(full_stats(torch.tensor([0.0, FLT_MAX]), 1.0, 1.0, 1.0, E4M3))
    assert got["min_nonzero"] == FLT_MAX
