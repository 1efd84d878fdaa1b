"""The GEMMs of an ``Fp8Linear`` under a block-scaled recipe (MXFP8, Float8BlockScaling, NVFP4), as TE runs them.

Each operand is quantized per block from its own amaxes (``recipe_table``, ``blocks``: TE's block
shapes and scale rounding), nothing is kept between steps, and each GEMM reads the usage TE gives it
(``pytorch/module/linear.py``: rowwise for the forward, columnwise copies for the backward):

- forward ``y = x_row @ w_row^T``;
- data gradient ``dx = g_row @ w_col`` (the weight's blocks run along the output dim);
- weight gradient ``dw = g_col^T @ x_col`` (blocks along the tokens).

Under Float8BlockScaling a weight's 128x128 tiles serve both usages, as do NVFP4's 16x16 ones. NVFP4
(``NVFP4BlockScaling``) adds TE's two steps: the weight gradient's operands pass the random Hadamard
transform along the tokens (:func:`rht16`; orthogonal, so their product is still ``g^T x`` up to the
quantization), and the output gradient is rounded stochastically. The bias gradient is reduced
from the high-precision gradient, as in TE. Eager only (``torch.compile`` of a block-scaled layer is
not supported here). The monitor sees each operand as its blocks: one scale per block, summarised
in cheap rows by the most conservative one.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from .autocast import autocast_off
from .amax import amax_pair
from .blocks import NVFP4_BLOCK, nvfp4_blocks
from .recipe_table import E2M1, quantize, scaled
from .scaling import Scales

# TE's fixed sign vector of the 16-point random Hadamard transform (``get_wgrad_sign_vector``,
# ``pytorch/custom_recipes/quantization_ref_nvfp4.py`` v2.18 lines 335-341; the kernels' mask 0xD7E8)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@lru_cache(maxsize=None)
def rht_matrix(device: torch.device) -> torch.Tensor:
    """``diag(signs) @ H16 / 4`` (Sylvester's Hadamard, natural order): TE's transform, orthogonal.
    Built once per device (a block layer is eager only: nothing traces this cache)."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device).unsqueeze(1) * h * 0.25


def rht16(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d`` [tokens, n] with each column's groups of 16 tokens mixed by :func:`rht_matrix`, rounded
    to BF16 as TE's kernels store it; tokens are zero-padded to a multiple of 16 (zero rows add
    nothing to the weight gradient)."""
    pad = (-x2d.shape[0]) % NVFP4_BLOCK
    xt = F.pad(x2d.float(), (0, 0, 0, pad)).t()  # [n, tokens]: TE transforms the columnwise (transposed) data
    y = (xt.reshape(-1, NVFP4_BLOCK) @ rht_matrix(x2d.device)).to(torch.bfloat16).float()
    return y.reshape(xt.shape).t()


def operand(x2d: torch.Tensor, kind: str, role: str, columnwise: bool = False, recipe=None):
    """``x2d`` under the recipe ``kind`` for one GEMM: ``(blocks, dequantized blocks, dequantized
    matrix)``; ``recipe`` the layer's (NVFP4's switches)."""
    if kind == "nvfp4":
        return nvfp4_operand(x2d, role, columnwise, recipe)
    b, elem = scaled(x2d, kind, role, columnwise)
    _, deq = quantize(b, elem)
    return b, deq, b.unview(deq).reshape(x2d.shape)


def nvfp4_tiles(role: str, recipe) -> bool:
    """Whether TE quantizes this tensor of NVFP4 in 16x16 tiles that serve both of its usages (weights,
    unless the recipe's ``disable_2d_quantization``); else in 1x16 blocks per usage."""
    return role == "weight" and not getattr(recipe, "disable_2d_quantization", False)


def _nvfp4_matrix(x2d, role, columnwise, recipe) -> tuple[torch.Tensor, bool]:
    """The matrix TE quantizes for one usage (blocks run along its last dim), and whether it is the
    transpose of ``x2d``: columnwise, activations and gradients first pass the transform along the
    tokens (unless ``disable_rht``), and the blocks then run along the tokens."""
    if columnwise and role != "weight" and not getattr(recipe, "disable_rht", False):
        x2d = rht16(x2d)
    transposed = columnwise and not nvfp4_tiles(role, recipe)
    return (x2d.t().contiguous() if transposed else x2d), transposed


def nvfp4_scaled(x2d, role, columnwise, recipe, divide_first: bool = False):
    """TE's NVFP4 blocks and scales of one usage of ``x2d`` (``pytorch/module/linear.py`` with
    ``NVFP4Quantizer``), not yet rounded: what the TE adapter measures. ``recipe``: an
    ``NVFP4BlockScaling`` (ours or TE's: the same three switches); ``divide_first``: TE 2.8-2.13's
    block-scale formula (:func:`~fp8scope.emulate.blocks.nvfp4_blocks`)."""
    t, _ = _nvfp4_matrix(x2d, role, columnwise, recipe)
    return nvfp4_blocks(t, block_2d=nvfp4_tiles(role, recipe), divide_first=divide_first)


def nvfp4_operand(x2d, role, columnwise, recipe):
    """TE's NVFP4 usages: weights in 16x16 blocks serving both GEMMs; activations and gradients 1x16
    along the row rowwise, along the tokens columnwise (after the transform; its own tensor scale);
    gradients rounded stochastically, with torch's generator. A columnwise matrix comes back in
    ``x2d``'s layout (transformed, and padded to 16 tokens)."""
    t, transposed = _nvfp4_matrix(x2d, role, columnwise, recipe)
    b = nvfp4_blocks(t, block_2d=nvfp4_tiles(role, recipe))
    stochastic = role == "gradient" and not getattr(recipe, "disable_stochastic_rounding", False)
    _, deq = quantize(b, E2M1, stochastic)
    matrix = b.unview(deq).reshape(t.shape)
    return b, deq, matrix.t() if transposed else matrix


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
        recipe = layer.recipe
        kind = recipe.kind
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        with autocast_off(grad_out.device.type):
            gb, g_blocks, g_row = operand(g2, kind, "gradient", recipe=recipe)
            layer._emit_blocks("gradient", g2, gb, g_blocks, True)
            if ctx.needs_input_grad[0]:
                _, _, w_col = operand(w, kind, "weight", columnwise=True, recipe=recipe)
                grad_x = (g_row @ w_col).reshape(*grad_out.shape[:-1], w.shape[1]).to(x_dtype)
            if ctx.needs_input_grad[1]:
                _, _, g_col = operand(g2, kind, "gradient", columnwise=True, recipe=recipe)
                _, _, x_col = operand(x2, kind, "activation", columnwise=True, recipe=recipe)
                dw = g_col.t() @ x_col  # [out, in]
                grad_w = (dw.t() if layer.weight_transposed else dw).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = g2.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def block_forward(layer, input: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The forward of ``layer`` (an ``Fp8Linear``) under its block recipe (see the module docstring)."""
    recipe = layer.recipe
    kind = recipe.kind
    grad = torch.is_grad_enabled()
    with autocast_off(input.device.type):
        x = input.detach()
        x2 = x.reshape(-1, x.shape[-1])
        xb, x_blocks, x_row = operand(x2, kind, "activation", recipe=recipe)
        layer._emit_blocks("activation", x2, xb, x_blocks, grad)
        w = layer.gemm_weight().detach()
        wb, w_blocks, w_row = operand(w, kind, "weight", recipe=recipe)
        layer._emit_blocks("weight", w, wb, w_blocks, grad)
        x_row = x_row.reshape(*x.shape[:-1], x.shape[-1])
    if not grad:
        return F.linear(x_row, w_row, None if layer.bias is None else layer.bias.to(torch.float32)).to(out_dtype)
    return _BlockLinearFn.apply(input, layer.weight, layer.bias, x_row, w_row, layer, out_dtype)


def block_scales(tensor: torch.Tensor, blocks) -> tuple[torch.Tensor, Scales]:
    """The logged amax of ``tensor`` and its blocks' scales as :class:`Scales` (per block)."""
    return amax_pair(tensor)[0], Scales(blocks.scale, blocks.scale_inv, blocks.amax)
