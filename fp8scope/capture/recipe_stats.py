"""What another recipe would do to a tensor: the same error counts as the stats pass, per recipe.

On full-stats steps, with ``Monitor(whatif_recipes=[...])``, every captured tensor is also measured
under each chosen recipe (``emulate.recipe_table``): the real quantization (E4M3 / E5M2 casts, or
E2M1 rounding for NVFP4) with that recipe's scales, decoded back. The vector, laid out as
:data:`RECIPE_FIELDS`, stays on the device and travels with the step's single transfer; the store
keeps it long, one row per (tensor, recipe), in the ``recipes`` table.

- ``nonzero``: finite non-zero elements (what can underflow); ``underflow``: non-zero before, zero
  when decoded (a zero code, or a block scale that itself flushed to zero: NVFP4's E4M3 block
  scales under a tensor scale set by a huge outlier); ``overflow``: ``|x * scale|`` above the element
  format's maximum before the cast (a block scale rounded down can push an element past it);
  ``saturated``: landed on the format's largest magnitude;
- ``sq_err``, ``sq_signal``: sums of squares of the error and of ``x`` over the finite elements;
- ``clip_ratio``: the largest ``|x * scale|`` over the format's maximum (above 1: clipped by that much).
"""

from __future__ import annotations

import torch

from fp8scope.compiled import CompiledFn
from fp8scope.emulate.blocks import E2M1_MAX
from fp8scope.emulate.recipe_table import E2M1, quantize, scaled
from fp8scope.formats import get_format
from fp8scope.schema import RECIPE_FIELDS
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_ELEMENT = {name: get_format(name) for name in ("e4m3", "e5m2")}  # no lru_cache call in traced code


def recipe_stats(x: torch.Tensor, recipe: str, role: str) -> torch.Tensor:
    """:data:`RECIPE_FIELDS` of ``x`` under ``recipe`` as a float64 vector on ``x``'s device: one
    function per (device type, dtype, recipe, role), compiled ahead where ``fp8scope.compiled``
    compiles (one generated kernel per recipe: ``tests/test_recipe_advisor.py``), eager until then
    (a constant number of ops, whatever the tensor's size)."""
    x = x.detach()
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x.reshape(1, -1)
    return RECIPE_STATS.get((x.device.type, x.dtype, recipe, role))(x)


def _recipe_stats(x: torch.Tensor, recipe: str, role: str) -> torch.Tensor:
    blocks, elem = scaled(x, recipe, role)
    a = (x.detach() if blocks is None else blocks.x).float()
    m = a.abs()
    if blocks is None:  # bf16: a rounding, no scale
        deq = a.to(torch.bfloat16).float()
        q, y, top = deq, m, _BF16_MAX
    else:
        y = m * blocks.scale
        q, deq = quantize(blocks, elem)
        top = E2M1_MAX if elem == E2M1 else _ELEMENT[elem].max
    err = torch.nan_to_num(deq - a, nan=0.0, posinf=0.0, neginf=0.0)
    clean = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    f64 = torch.float64
    nonzero = (m > 0) & (m < float("inf"))  # what can underflow (derived.nonzero_finite)
    return torch.stack([
        torch.full((), a.numel(), dtype=f64, device=a.device),
        nonzero.sum().to(f64),
        (nonzero & (deq == 0)).sum().to(f64),
        (y > top).sum().to(f64) if blocks is not None else (m > top).sum().to(f64),
        ((q.abs() == top) & (m < float("inf"))).sum().to(f64) if blocks is not None else torch.zeros((), dtype=f64,
                                                                                                       device=a.device),
        torch.linalg.vector_norm(err, 2, dtype=f64).square(),
        torch.linalg.vector_norm(clean, 2, dtype=f64).square(),
        (torch.nan_to_num(y, nan=0.0).amax() / top).to(f64),  # how far the worst value clips (> 1)
    ])


def _make(key):
    _device, _dtype, recipe, role = key

    def stats(x: torch.Tensor) -> torch.Tensor:
        return _recipe_stats(x, recipe, role)

    return stats


def _examples(key):
    """A large matrix whose sides divide every block (128): the common case compiles."""
    device, dtype, _recipe, _role = key
    return (torch.randn(1024, 1536, device=device).to(dtype),)


RECIPE_STATS = CompiledFn("recipe_stats", _make, _examples)
