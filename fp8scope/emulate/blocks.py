"""Transformer Engine's block-scaled FP8 recipes as tensors: which scale each block of a tensor gets.

Two recipes scale blocks instead of tensors (facts read from TE's source; ../shared/te-internals.md):

- **MXFP8** (``MXFP8BlockScaling``, TE 2.0+): 32 consecutive values share one E8M0 scale, rowwise
  (1x32 along the last dim) for one GEMM and columnwise (32x1) for the other. The code is
  ``float_to_e8m0(block_amax * fl(1/fp8_max))``, which rounds *up* to the next power of two and
  saturates to [2^-127, 2^127] (``common/util/ptx.cuh``, ``float_to_e8m0``; v2.18 lines 386-418),
  called from ``cast/mxfp8/quantize_mxfp8.cuh``. An all-zero block stores code 0 (2^-127). The
  elements are multiplied by ``2^(127 - code)`` before the cast (``exp2f_rcp``), except that before
  TE 2.13 a code of 0 multiplied by 1 (``common/util/ptx.cuh``, v2.8 lines 114-118).
- **Float8BlockScaling** (TE 2.3+): 1x128 blocks for activations and gradients (columnwise: 128x1
  blocks of the original), 128x128 tiles for weights (both usages: the same scales). Each block's
  scale is TE's ``compute_scale_from_types``: :func:`te_scale_from_amax` with the quantizer's
  power-of-two option (on by default) and epsilon, and the input dtype's largest value for an
  overflowing division (``common/transpose/quantize_transpose_{vector,square}_blockwise.cu``).

Block amaxes ignore NaN elements (TE reduces with ``fmaxf``). Every function returns the tensor
viewed as rows of one block each, and one ``(scale, scale_inv, amax)`` per row, which is what the
stats pass takes (``capture.stats``: per-row scales). A tensor whose sides are not multiples of the
block is viewed one element per row, each with its block's scales, so no padding enters the counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import Fp8Format
from .amax import recorded_amax
from .scaling import te_scale_from_amax

MX_BLOCK = 32
FP8_BLOCK = 128
_MANTISSA = 0x7FFFFF


def e8m0_codes(v: torch.Tensor) -> torch.Tensor:
    """TE's ``float_to_e8m0`` (the software path; the sm100 ``cvt.rp.satfinite.ue8m0x2.f32`` rounds
    the same way): the biased exponent of the smallest power of two >= ``v``, clamped to [0, 254];
    NaN 255, Inf 254, 0 gives 0. ``v`` float32; returns int32 codes."""
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & _MANTISSA
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + up.to(torch.int32)
    code = torch.where(v == 0, 0, code)
    code = torch.where(torch.isinf(v), 0xFE, code)
    return torch.where(torch.isnan(v), 0xFF, code)


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) as float32 (the decode factor, the block's scale_inv); 255 is NaN."""
    out = torch.ldexp(torch.ones_like(code, dtype=torch.float32), code - 127)
    return torch.where(code == 0xFF, float("nan"), out)


def e8m0_encode_factor(code: torch.Tensor, code0_multiplies_by_one: bool = False) -> torch.Tensor:
    """What the elements are multiplied by before the cast: TE's ``exp2f_rcp``, 2^(127 - code);
    254 gives 2^-127 and 255 NaN (TE 2.13+). ``code0_multiplies_by_one``: TE before 2.13."""
    out = torch.ldexp(torch.ones_like(code, dtype=torch.float32), 127 - code)
    out = torch.where(code == 0xFE, 2.0 ** -127, out)
    out = torch.where(code == 0xFF, float("nan"), out)
    if code0_multiplies_by_one:
        out = torch.where(code == 0, 1.0, out)
    return out


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """TE's view of a tensor as a matrix: leading dims flattened, the last one kept (what every block
    recipe reads, and what capture hands the recipes it measures)."""
    x = x.detach()
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-row amax, NaN elements ignored (``fmaxf`` from 0, ``amax.recorded_amax``), float32, [rows, 1]."""
    return recorded_amax(blocks.abs().float(), dim=1, scratch=True)


def _tiles(x2d: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x2d`` cut into ``rows x cols`` tiles: ``(tiles as [n_tiles, rows*cols], None)`` when the
    sides divide, else ``(zero-padded tiles, the per-element tile index)`` so the caller can
    hand each element its tile's scale without counting the padding."""
    m, k = x2d.shape
    pm, pk = (-m) % rows, (-k) % cols
    padded = F.pad(x2d, (0, pk, 0, pm)) if pm or pk else x2d
    mt, kt = padded.shape[0] // rows, padded.shape[1] // cols
    tiles = padded.reshape(mt, rows, kt, cols).permute(0, 2, 1, 3).reshape(mt * kt, rows * cols)
    if not (pm or pk):
        return tiles, None
    ti = torch.arange(m, device=x2d.device).div(rows, rounding_mode="floor").unsqueeze(1) * kt
    tj = torch.arange(k, device=x2d.device).div(cols, rounding_mode="floor").unsqueeze(0)
    return tiles, (ti + tj).reshape(-1)


class BlockScales:
    """A tensor as rows of one block (``x``) and one scale per row: what the stats pass takes.
    :meth:`unview` turns a tensor laid out like ``x`` back into the original matrix's layout."""

    __slots__ = ("x", "scale", "scale_inv", "amax", "_tile")

    def __init__(self, x: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor,
                 tile: tuple[int, int, int, int] | None = None):
        self.x, self.scale, self.scale_inv, self.amax = x, scale, scale_inv, amax
        self._tile = tile  # (rows, cols, block rows, block cols) when x holds whole tiles

    def unview(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (shaped like :attr:`x`) as the ``[rows, cols]`` matrix the blocks were cut from."""
        if self._tile is None:
            return t.reshape(-1)  # one element per row, in the matrix's order
        m, k, r, c = self._tile
        return t.reshape(m // r, k // c, r, c).permute(0, 2, 1, 3).reshape(m, k)


def nan_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-row amax with NaN propagating (``torch.amax``: torchao's), float32, [rows, 1]."""
    return blocks.abs().float().amax(dim=1, keepdim=True)


def _per_block(x2d: torch.Tensor, rows: int, cols: int, scales_of, amax_of=block_amax) -> BlockScales:
    tiles, index = _tiles(x2d, rows, cols)
    amax = amax_of(tiles)
    scale, scale_inv = scales_of(amax)
    if index is None:
        return BlockScales(tiles, scale, scale_inv, amax, (x2d.shape[0], x2d.shape[1], rows, cols))
    # sides that do not divide: one element per row, each with its tile's scales
    return BlockScales(x2d.reshape(-1, 1), scale[index], scale_inv[index], amax[index])


def mxfp8_blocks(x: torch.Tensor, fmt: Fp8Format, columnwise: bool = False,
                 code0_multiplies_by_one: bool = False) -> BlockScales:
    """MXFP8 scales of ``x``: rowwise 1x32 blocks along the last dim, or columnwise 32x1 blocks."""
    x2d = as_matrix(x)
    rcp = torch.full((), 1.0 / fmt.max, dtype=torch.float32, device=x2d.device)  # TE's max_norm_rcp, a float

    def scales_of(amax):
        code = e8m0_codes(amax * rcp)
        return e8m0_encode_factor(code, code0_multiplies_by_one), e8m0_value(code)

    return _per_block(x2d, MX_BLOCK, 1, scales_of) if columnwise else _per_block(x2d, 1, MX_BLOCK, scales_of)


def fp8_block_scaling_blocks(x: torch.Tensor, fmt: Fp8Format, block_dim: int = 1, columnwise: bool = False,
                             pow2: bool = True, epsilon: float = 0.0) -> BlockScales:
    """Float8BlockScaling scales of ``x``: ``block_dim`` 1 gives 1x128 blocks (columnwise: 128x1),
    2 gives 128x128 tiles (the same for both usages)."""
    x2d = as_matrix(x)
    dtype = x2d.dtype if x2d.dtype.is_floating_point else torch.float32
    inf_value = float(torch.finfo(dtype).max)  # TE: the input type's largest value

    def scales_of(amax):
        scale = te_scale_from_amax(amax, fmt.max, pow2=pow2, epsilon=epsilon, value_for_inf=inf_value)
        return scale, scale.reciprocal()

    if block_dim == 2:
        return _per_block(x2d, FP8_BLOCK, FP8_BLOCK, scales_of)
    return _per_block(x2d, FP8_BLOCK, 1, scales_of) if columnwise else _per_block(x2d, 1, FP8_BLOCK, scales_of)


# ---- torchao's recipes (pytorch/ao; facts at main 36027d8, the same since v0.12) ---------------------
TORCHAO_EPS = 1e-12  # torchao/float8/float8_utils.py EPS
_E4M3_MAX_POW2 = 8  # torchao/prototype/mx_formats/constants.py F8E4M3_MAX_POW2: 448 = 1.75 * 2^8


def torchao_rowwise_blocks(x: torch.Tensor, fmt: Fp8Format) -> BlockScales:
    """torchao Float8 ``rowwise`` recipe (``Float8LinearConfig.from_recipe_name("rowwise")``): one scale
    per row along the last dim (the GEMM's contraction dim for the forward operands and the data
    gradient's output gradient), ``float32(fp8_max / clamp(float64(amax), 1e-12))`` rounded down to a
    power of two with torch's ``exp2(floor(log2(s)))`` (``float8_utils.amax_to_scale``,
    ``_round_scale_down_to_power_of_2``); the amax propagates NaN (``torch.amax``), so a row with a
    NaN is all NaN, and an Inf amax gives scale 0."""
    x2d = as_matrix(x)

    def scales_of(amax):
        s = (fmt.max / amax.double().clamp(min=TORCHAO_EPS)).float()
        s = torch.exp2(torch.floor(torch.log2(s)))
        return s, s.reciprocal()

    return _per_block(x2d, 1, x2d.shape[1], scales_of, amax_of=nan_amax)


def torchao_mx_floor_blocks(x: torch.Tensor) -> BlockScales:
    """torchao MX ``to_mx`` with ``ScaleCalculationMode.FLOOR`` (E4M3 elements, 1x32 blocks along the
    last dim; the default of ``to_mx`` and of ``MXLinearConfig``'s recipes through torchao 0.16):
    the block's E8M0 code is the amax's float32 exponent minus 8 (``mx_tensor.py``: ``e = ((bits >>
    23) & 0xFF) - 127``, ``unbiased = e - F8E4M3_MAX_POW2``, clamped to [-127, 128]), so a block's
    largest values can land up to 510 and saturate at 448; a non-finite amax gives code 255 (NaN),
    NaN propagates into the amax. (torchao's RCEIL mode, the default from 0.17, rounds like TE:
    the ``mxfp8`` recipe.)"""
    x2d = as_matrix(x)

    def scales_of(amax):
        bits = amax.contiguous().view(torch.int32)
        unbiased = (((bits >> 23) & 0xFF) - 127 - _E4M3_MAX_POW2).clamp(-127, 128)
        code = torch.where(torch.isfinite(amax), unbiased + 127, 0xFF)
        return e8m0_encode_factor(code), e8m0_value(code)

    return _per_block(x2d, 1, MX_BLOCK, scales_of, amax_of=nan_amax)


# ---- NVFP4 (TE 2.8+, NVFP4BlockScaling): E2M1 values, 1x16 blocks with E4M3 scales, one FP32 scale --
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
_FLT_MAX = float(torch.finfo(torch.float32).max)


def _e2m1_step(a: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid's spacing at magnitude ``a`` (0.5 below 2, 1 below 4, 2 up to 6)."""
    return torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """``y`` (float32) rounded to E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6), to nearest with ties to
    even and saturating at 6 (the cast TE's kernels use, ``satfinite``). NaN stays NaN."""
    a = y.abs().clamp(max=E2M1_MAX)
    step = _e2m1_step(a)
    return torch.copysign(torch.round(a / step) * step, y)  # torch.round: ties to even


def e2m1_stochastic(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stochastic rounding of ``|y|`` onto E2M1 (TE's ``cvt.rs.satfinite.e2m1x4.f32`` on NVFP4
    gradients), as its law: ``(a, lo, hi, p_up)`` with ``a = min(|y|, 6)`` between the grid neighbours
    ``lo <= a <= hi`` (equal on the grid, both 6 at or above 6), rounded up to ``hi`` with
    probability ``p_up = (a - lo) / (hi - lo)``. The one definition: the emulated layer draws from it,
    the recipe measurement takes its expectation."""
    a = y.abs().clamp(max=E2M1_MAX)
    step = _e2m1_step(a)
    lo = torch.floor(a / step) * step
    hi = torch.where(lo == a, lo, (lo + step).clamp(max=E2M1_MAX))
    gap = hi - lo
    p_up = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    return a, lo, hi, p_up


def e2m1_round_stochastic(y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``y`` (float32) rounded to E2M1 stochastically with uniform draws ``u`` in [0, 1)
    (:func:`e2m1_stochastic`; TE draws its bits from Philox, the distribution is the same), saturating
    at 6. NaN stays NaN."""
    _, lo, hi, p_up = e2m1_stochastic(y)
    return torch.where(torch.isnan(y), y, torch.copysign(torch.where(u < p_up, hi, lo), y))


def nvfp4_blocks(x: torch.Tensor, block_2d: bool = False, divide_first: bool = False) -> BlockScales:
    """NVFP4 scales of ``x`` as TE 2.14+ computes them (``common/cast/nvfp4/core_nvfp4.cuh`` v2.18
    40-53, 81-95; ``quantize_transpose_nvfp4.cuh`` 426-435, 549-550): a per-tensor encode scale
    ``S_enc = 448 * 6 / amax`` (1 for an all-zero tensor), each block's decode scale
    ``e4m3(block_amax * (S_enc * (1/6)))``, and the elements multiplied by ``1 / (s_block * S_dec)``.
    ``divide_first``: TE 2.8-2.13's ``e4m3(block_amax / 6 * S_enc)`` (``util/nvfp4_transpose.cuh``
    v2.8 line 124, ``core_nvfp4.cuh`` v2.12-v2.13 line 50), which can differ by one float32 ulp and
    so, now and then, by one E4M3 step. Blocks are 1x16 along the last dim (``block_2d``: 16x16,
    TE's default for weights). ``scale`` is the elements' encode factor, ``scale_inv`` their decode
    factor."""
    x2d = as_matrix(x)
    dev = x2d.device
    g = block_amax(x2d.reshape(1, -1)).reshape(())
    s_enc = torch.div(torch.full((), 448.0 * 6.0, device=dev), g).clamp(max=_FLT_MAX)
    s_enc = torch.where((g == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = s_enc.reciprocal()
    sixth = torch.full((), 1.0 / 6.0, dtype=torch.float32, device=dev)

    def scales_of(amax):
        s_dec_b = amax / 6.0 * s_enc if divide_first else amax * (s_enc * sixth)
        s_block = s_dec_b.clamp(max=_FLT_MAX).clamp(max=448.0).to(torch.float8_e4m3fn).float()
        enc = torch.reciprocal(s_block * s_dec).clamp(max=_FLT_MAX)
        return enc, s_block * s_dec

    rows, cols = (NVFP4_BLOCK, NVFP4_BLOCK) if block_2d else (1, NVFP4_BLOCK)
    return _per_block(x2d, rows, cols, scales_of)
