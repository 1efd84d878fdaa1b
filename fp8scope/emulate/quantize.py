"""Per-tensor FP8 quantize / dequantize with real torch float8 dtypes.

``quantize`` saturates: ``|x * scale| > fp8_max`` becomes ``±fp8_max``, for E4M3
*and* E5M2, because TE's casts use ``__NV_SATFINITE`` for both. Torch's own
cast saturates E4M3 but overflows E5M2 to inf, so we clamp explicitly before
the cast. NaN stays NaN (clamp propagates it; E4M3 and E5M2 both have a NaN).
Values below half the smallest subnormal round to zero in the cast itself.

The scaling multiply runs in float32 whatever the input dtype: a bf16 tensor
times a 0-d float32 scale would otherwise be computed in bf16 (0-d tensors do
not take part in type promotion) and lose bits before the cast.
"""

from __future__ import annotations

import torch

from ..formats import Fp8Format


def _scaled_f32(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.float() * scale`` as a float32 tensor that may be modified in place: fresh, or ``out``."""
    if out is not None:  # x is copied first unless float32: a bf16 x * a 0-d scale would compute in bf16
        return torch.mul(x, scale, out=out) if x.dtype == torch.float32 else out.copy_(x).mul_(scale)
    if x.dtype == torch.float32:
        return x * scale  # new tensor; x is untouched
    y = x.to(torch.float32)  # a copy already, so scale in place
    return y.mul_(scale)


def _clamped_scaled(x: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``clamp(x * scale, -max, max)`` in float32, a fresh tensor or ``out``: what the cast reads."""
    y = _scaled_f32(x, scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32), out)
    return y.clamp_(-fmt.max, fmt.max)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format) -> torch.Tensor:
    """``cast_fp8(clamp(x * scale, -max, max))`` as a tensor of ``fmt.dtype``."""
    return _clamped_scaled(x, scale, fmt).to(fmt.dtype)


def dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * scale_inv``, returned in ``dtype``.

    Decoding fp8 on CPU is slow (several times the encode), so callers that need
    both the fp8 tensor and its value should decode once and keep the result.
    """
    y = q.to(torch.float32).mul_(scale_inv)
    return y if dtype == torch.float32 else y.to(dtype)


def quantize_dequantize(
    x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, dequantize(q))`` in one go: the float32 value after the FP8 round trip. The decoded
    values are written into the float32 buffer the cast read, so the round trip holds one
    tensor-sized float32 temporary, not two (the emulated layer runs it on every operand; on a CPU
    a fresh large buffer is fresh memory from the OS each time). ``out``: that buffer, a float32
    tensor of ``x``'s shape the caller has free (the stats pass's scratch), else a new one."""
    y = _clamped_scaled(x, scale, fmt, out)
    q = y.to(fmt.dtype)
    return q, y.copy_(q).mul_(scale_inv)
