"""The GEMMs of an ``Fp8Linear`` under a block-scaled recipe (MXFP8, Float8BlockScaling), as TE runs them.

Each operand is quantized per block from its own amaxes (``recipe_table``, ``blocks``: TE's block
shapes and scale rounding), nothing is kept between steps, and each GEMM reads the usage TE gives it
(``pytorch/module/linear.py``: rowwise for the forward, columnwise copies for the backward):

- forward ``y = x_row @ w_row^T``;
- data gradient ``dx = g_row @ w_col`` (the weight's blocks run along the output dim);
- weight gradient ``dw = g_col^T @ x_col`` (blocks along the tokens).

Under Float8BlockScaling a weight's 128x128 tiles serve both usages. The bias gradient is reduced
from the high-precision gradient, as in TE. Eager only (``torch.compile`` of a block-scaled layer is
not supported here). The monitor sees each operand as its blocks: one scale per block, summarised
in cheap rows by the most conservative one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .amax import amax_pair
from .recipe_table import quantize, scaled
from .scaling import Scales


def operand(x2d: torch.Tensor, kind: str, role: str, columnwise: bool = False):
    """``x2d`` under the recipe ``kind`` for one GEMM: ``(blocks, dequantized blocks, dequantized
    matrix)``."""
    b, elem = scaled(x2d, kind, role, columnwise)
    _, deq = quantize(b, elem)
    return b, deq, b.unview(deq).reshape(x2d.shape)


class _BlockLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, x_row, w_row, layer, out_dtype):  # type: ignore[override]
        ctx.layer, ctx.dtypes = layer, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(x.detach(), layer.gemm_weight().detach())
        out = F.linear(x_row, w_row, None if bias is None else bias.to(torch.float32))
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, w = ctx.saved_tensors
        layer = ctx.layer  # the Fp8Linear
        kind = layer.recipe.kind
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            gb, g_blocks, g_row = operand(g2, kind, "gradient")
            layer._emit_blocks("gradient", g2, gb, g_blocks, True)
            if ctx.needs_input_grad[0]:
                _, _, w_col = operand(w, kind, "weight", columnwise=True)
                grad_x = (g_row @ w_col).reshape(*grad_out.shape[:-1], w.shape[1]).to(x_dtype)
            if ctx.needs_input_grad[1]:
                _, _, g_col = operand(g2, kind, "gradient", columnwise=True)
                _, _, x_col = operand(x2, kind, "activation", columnwise=True)
                dw = g_col.t() @ x_col  # [out, in]
                grad_w = (dw.t() if layer.weight_transposed else dw).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = g2.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def block_forward(layer, input: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The forward of ``layer`` (an ``Fp8Linear``) under its block recipe (see the module docstring)."""
    kind = layer.recipe.kind
    grad = torch.is_grad_enabled()
    with torch.autocast(input.device.type, enabled=False):
        x = input.detach()
        x2 = x.reshape(-1, x.shape[-1])
        xb, x_blocks, x_row = operand(x2, kind, "activation")
        layer._emit_blocks("activation", x2, xb, x_blocks, grad)
        w = layer.gemm_weight().detach()
        wb, w_blocks, w_row = operand(w, kind, "weight")
        layer._emit_blocks("weight", w, wb, w_blocks, grad)
        x_row = x_row.reshape(*x.shape[:-1], x.shape[-1])
    if not grad:
        return F.linear(x_row, w_row, None if layer.bias is None else layer.bias.to(torch.float32)).to(out_dtype)
    return _BlockLinearFn.apply(input, layer.weight, layer.bias, x_row, w_row, layer, out_dtype)


def block_scales(tensor: torch.Tensor, blocks) -> tuple[torch.Tensor, Scales]:
    """The logged amax of ``tensor`` and its blocks' scales as :class:`Scales` (per block)."""
    return amax_pair(tensor)[0], Scales(blocks.scale, blocks.scale_inv, blocks.amax)
