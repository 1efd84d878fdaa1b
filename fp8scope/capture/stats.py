"""Per-tensor FP8 statistics computed on the tensor's own device, with no host sync.

Each call returns one float64 vector laid out as ``schema.STAT_FIELDS``; the monitor
stacks a step's vectors and moves them to the host in a single transfer.

Why the arithmetic looks unusual: on CPU, comparisons that produce bool tensors and
their sums cost 5-10x a float pass, so counts are taken as
``sum(sign(relu(v - threshold)))`` on float tensors, which is exact for
``v > threshold``. NaNs are first mapped to -1 so they fall below every threshold
and are counted on their own.

Overflow is counted *before* the cast (``|x * scale| > fp8_max``): torch >= 2.12
saturates E4M3 on cast, so after the cast it is invisible. Underflow and saturation
are decided analytically from the same scaled magnitudes: with round-to-nearest-even
a magnitude at or below half the smallest subnormal becomes 0, and a magnitude above
the midpoint below ``fp8_max`` rounds onto the top code (``saturation_floor``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from fp8scope.formats import Fp8Format
from fp8scope.schema import FIELD_INDEX, N_FIELDS

_NAN = float("nan")
_INF = float("inf")
_FLT_MAX = float(torch.finfo(torch.float32).max)


@lru_cache(maxsize=None)
def saturation_floor(fmt: Fp8Format) -> float:
    """Largest float32 magnitude that does NOT quantize to ``fmt.max``.

    Computed once per format by casting the midpoint between the two largest codes,
    so the tie rule of the real cast decides and nothing is hand-derived.
    """
    below = fmt.max - 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    mid = (fmt.max + below) / 2
    lands_on_max = float(torch.tensor([mid], dtype=torch.float32).to(fmt.dtype).float()[0]) == fmt.max
    if lands_on_max:  # ties go up: the floor is the float just below the midpoint
        return float(torch.nextafter(torch.tensor(mid, dtype=torch.float32), torch.tensor(0.0)))
    return mid


def _count_above(v: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Number of elements of ``v`` strictly above ``threshold`` (``v`` has no NaN), as float64."""
    # float32 sums of 0/1 are exact below 2**24 elements and several times faster than float64.
    acc = torch.float32 if v.numel() < 2**24 else torch.float64
    return (v - threshold).clamp_(min=0).sign_().sum(dtype=acc).to(torch.float64)


def _as_f64(t: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.tensor(float(t), dtype=torch.float64, device=device)


def _summary(value: torch.Tensor | float, device: torch.device, reduce: str) -> torch.Tensor:
    """One number for the record. Per-row (or per-block) scales are summarised by their
    most conservative member: the smallest scale, the largest scale_inv and expected amax."""
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        v = value.detach()
        return (v.amin() if reduce == "min" else v.amax()).to(torch.float64)
    return _as_f64(value, device)


def cheap_stats(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    scale_inv: torch.Tensor | float,
    expected_amax: torch.Tensor | float,
) -> torch.Tensor:
    """amax plus the scales in use: one fused min/max pass (cheaper than ``x.abs().amax()``)."""
    x = x.detach()
    dev = x.device
    out = torch.full((N_FIELDS,), _NAN, dtype=torch.float64, device=dev)
    if x.numel():
        lo, hi = torch.aminmax(x)
        out[FIELD_INDEX["amax"]] = torch.maximum(hi.abs(), lo.abs()).to(torch.float64)
    else:
        out[FIELD_INDEX["amax"]] = 0.0
    out[FIELD_INDEX["numel"]] = float(x.numel())
    out[FIELD_INDEX["scale"]] = _summary(scale, dev, "min")
    out[FIELD_INDEX["scale_inv"]] = _summary(scale_inv, dev, "max")
    out[FIELD_INDEX["expected_amax"]] = _summary(expected_amax, dev, "max")
    return out


def full_stats(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    scale_inv: torch.Tensor | float,
    expected_amax: torch.Tensor | float,
    fmt: Fp8Format,
    deq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every field of ``STAT_FIELDS``.

    ``scale`` may be a 0-d tensor, a float, or a tensor broadcastable to ``x`` (per-row
    scaling). ``deq`` is the dequantized tensor when the caller already quantized ``x``
    (our emulated linear); otherwise ``x`` is quantized here to measure the error.
    """
    out = cheap_stats(x, scale, scale_inv, expected_amax)
    x = x.detach()
    n = x.numel()
    if n == 0:
        for name in ("zeros", "nonfinite", "overflow", "underflow", "saturated", "sq_err", "sq_signal"):
            out[FIELD_INDEX[name]] = 0.0
        out[FIELD_INDEX["min_nonzero"]] = _INF
        return out
    x32 = x.float()
    # NaN -> -1: below every threshold, counted on its own; +-inf stays inf (an overflow).
    b = torch.nan_to_num(x32.abs(), nan=-1.0, posinf=_INF)
    n_nan = _count_above(b.neg(), 0.0)
    n_inf = _count_above(b, _FLT_MAX)
    scale_t = scale.detach().float() if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    scale_t = scale_t.to(x.device)
    if scale_t.numel() == 1:
        scale_t = scale_t.reshape(())
    y = b * scale_t  # scaled magnitudes, exactly what the cast sees
    positive = b.clamp(min=0).sign_()  # 1 where |x| > 0 (inf included), else 0
    nonzero = positive.sum(dtype=torch.float32 if n < 2**24 else torch.float64).to(torch.float64)
    out[FIELD_INDEX["zeros"]] = n - nonzero - n_nan
    out[FIELD_INDEX["nonfinite"]] = n_nan + n_inf
    out[FIELD_INDEX["overflow"]] = _count_above(y, fmt.max)
    out[FIELD_INDEX["saturated"]] = _count_above(y, saturation_floor(fmt))
    out[FIELD_INDEX["underflow"]] = nonzero - _count_above(y, fmt.underflow_threshold)
    # Smallest non-zero magnitude: zeros and NaNs pushed to FLT_MAX (not inf: inf * 0 is NaN).
    min_nz = positive.neg_().add_(1.0).mul_(_FLT_MAX).add_(b).amin().to(torch.float64)
    out[FIELD_INDEX["min_nonzero"]] = torch.where(min_nz >= _FLT_MAX, _INF, min_nz)
    if deq is None:
        signed = (x32 * scale_t).clamp_(-fmt.max, fmt.max)
        deq = signed.to(fmt.dtype).float().mul_(
            scale_inv.detach().float().to(x.device) if isinstance(scale_inv, torch.Tensor) else float(scale_inv)
        )
    err = torch.nan_to_num_(deq.detach().float() - x32, nan=0.0, posinf=0.0, neginf=0.0).flatten()
    sig = torch.nan_to_num(x32, nan=0.0, posinf=0.0, neginf=0.0).flatten()
    out[FIELD_INDEX["sq_err"]] = torch.dot(err, err).to(torch.float64)
    out[FIELD_INDEX["sq_signal"]] = torch.dot(sig, sig).to(torch.float64)
    # amax must propagate NaN like the recipe's amax does.
    out[FIELD_INDEX["amax"]] = torch.where(n_nan > 0, torch.tensor(_NAN, dtype=torch.float64, device=x.device),
                                           out[FIELD_INDEX["amax"]])
    return out
