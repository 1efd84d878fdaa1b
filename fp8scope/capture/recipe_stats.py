"""What another recipe would do to a tensor, compiled ahead like the stats pass: one vector per recipe.

On full-stats steps, with ``Monitor(whatif_recipes=[...])``, every captured tensor is also measured
under each chosen recipe (``emulate.recipe_table``): the real quantization (E4M3 / E5M2 casts, or
E2M1 rounding for NVFP4) with that recipe's scales, decoded back. The vector, laid out as
:data:`RECIPE_FIELDS`, stays on the device and travels with the step's single transfer; the store
keeps it long, one row per (tensor, recipe), in the ``recipes`` table.

The counts are ``emulate.recipe_table.counts`` (one definition, which the advisor's baselines
use too):

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
from fp8scope.emulate.recipe_table import counts as _recipe_stats


def recipe_stats(x: torch.Tensor, recipe: str, role: str) -> torch.Tensor:
    """:data:`RECIPE_FIELDS` of ``x`` under ``recipe`` as a float64 vector on ``x``'s device: one
    function per (device type, dtype, recipe, role), compiled ahead where ``fp8scope.compiled``
    compiles (one generated kernel per recipe: ``tests/test_recipe_advisor.py``), eager until then
    (a constant number of ops, whatever the tensor's size)."""
    x = x.detach()
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1]) if x.dim() > 2 else x.reshape(1, -1)
    return RECIPE_STATS.get((x.device.type, x.dtype, recipe, role))(x)


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
