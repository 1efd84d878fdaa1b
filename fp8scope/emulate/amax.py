"""The amax of a tensor in one pass: what Transformer Engine records, and what a monitor logs.

Two numbers come out of the same pass over ``x``:

- ``logged``: ``max(|x|)`` with NaN propagating. A row whose amax is NaN says "this tensor held a
  NaN", so the first NaN is localized at the step and layer where it appears (an Inf shows as an
  Inf amax). Its non-finiteness is the cheap rows' non-finite flag.
- ``recorded``: TE's amax, reduced with ``fmaxf`` from 0, so NaN elements are ignored and a
  history row is never NaN (``transformer_engine/common/recipe/`` and the cast kernels'
  ``amax`` reduction; ../shared/te-internals.md). With x = [NaN, 3] it is 3, and the next
  delayed scale 448 / 3.

Both come from :data:`AMAX`, compiled ahead (one fused reduction; see ``fp8scope.compiled``).
:data:`AMAX_FAST` is the what-if monitor's: until its compile is ready (or with
``FP8SCOPE_COMPILE=0``) it runs one eager op, ``linalg_vector_norm(x, inf)``, and returns that
NaN-propagating amax for both numbers. The only difference is on a tensor holding a NaN, where
the history then holds 0 for that step (``scaling.delayed_update``) instead of TE's fmaxf amax;
the logged row and its flag are the same.
"""

from __future__ import annotations

import torch

from fp8scope.compiled import CompiledFn

_INF = float("inf")


def _make_pair(key):
    def amax_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.abs()
        logged = a.amax()
        recorded = torch.nan_to_num(a, nan=0.0, posinf=_INF).amax()
        return logged.to(torch.float32), recorded.to(torch.float32)

    return amax_pair


def _make_norm(key):
    def amax_norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.linalg.vector_norm(x, _INF, dtype=torch.float32)
        return raw, raw

    return amax_norm


def _examples(key):
    device, dtype, ndim = key
    return (torch.ones((3,) * ndim, dtype=dtype, device=device),)


AMAX = CompiledFn("amax", _make_pair, _examples)
AMAX_FAST = CompiledFn("amax_fast", _make_pair, _examples, fallback=_make_norm)


def _key(x: torch.Tensor) -> tuple:
    return (x.device.type, x.dtype, x.dim())


def amax_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logged, recorded)`` amaxes of ``x`` as 0-d float32 tensors on its device (0 and 0 for an
    empty tensor). No host sync."""
    x = x.detach()
    if x.numel() == 0:
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return zero, zero
    return AMAX.get(_key(x))(x)


def amax_pair_fast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`amax_pair` at the cost of one eager op while no compiled version is ready (see above)."""
    x = x.detach()
    if x.numel() == 0:
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return zero, zero
    return AMAX_FAST.get(_key(x))(x)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a 0-d float32 tensor, NaN if x holds a NaN, 0 for an empty tensor (the logged amax)."""
    return amax_pair(x)[0]
