"""The recipes a tensor can be measured under, as one table: name -> how a tensor of a role is scaled.

The advisor (``fp8scope whatif``) ranks them by the error each makes on the run's own tensors, which
capture measures on full-stats steps (``Monitor(whatif_recipes=...)``, ``capture.stats``).
Each follows a framework's rules (``emulate.blocks``, ``emulate.scaling``):

- ``current``: per-tensor current scaling (TE ``Float8CurrentScaling``, HYBRID: E4M3 forward, E5M2
  gradients), ``scale = fp8_max / amax``;
- ``mxfp8``: TE ``MXFP8BlockScaling``: 1x32 blocks along the last dim, E8M0 scales rounded up, E4M3;
- ``block128``: TE ``Float8BlockScaling`` (DeepSeek-style): 1x128 blocks, 128x128 tiles for weights,
  power-of-two scales, E4M3;
- ``nvfp4``: TE ``NVFP4BlockScaling``: E2M1 values, 1x16 blocks (16x16 for weights) with E4M3 block
  scales under one FP32 tensor scale (gradients: the expectation under TE's stochastic rounding);
- ``rowwise``: torchao's Float8 ``rowwise`` recipe: one power-of-two scale per row (along the
  contraction dim), E4M3 for every tensor, gradients included;
- ``mxfp8_floor``: torchao's MX ``FLOOR`` scales (1x32 blocks, E8M0 from the amax's exponent, so a
  block's top values can saturate): ``to_mx``'s default, and ``MXLinearConfig``'s through 0.16
  (torchao's ``RCEIL``, its default from 0.17, is TE's rule: ``mxfp8``);
- ``bf16``: no FP8: the tensor rounded to bfloat16 (what keeping a layer in BF16 costs).

Only the rowwise usage is measured (the operand of the forward GEMM and of the data gradient), which
TE's NVFP4 never transforms (its random Hadamard transform is for the weight gradient's columnwise
operands). NVFP4 gradients are stochastically rounded in TE (``cvt.rs``): their counts and squared
error are the expectation over the rounding, not one draw.
"""

from __future__ import annotations

import torch

from ..formats import recipe_format
from ..formats import DEEP_UNDERFLOW_BINADES, get_format
from .blocks import (E2M1_MAX, BlockScales, block_amax, e2m1_round, e2m1_round_stochastic, e2m1_stochastic,
                     fp8_block_scaling_blocks, mxfp8_blocks, nvfp4_blocks, torchao_mx_floor_blocks,
                     torchao_rowwise_blocks)
from .scaling import te_scale_from_amax

RECIPES = ("current", "mxfp8", "block128", "nvfp4", "rowwise", "mxfp8_floor", "bf16")
E2M1 = "e2m1"  # the element format name of NVFP4's values (max 6)
# looked up once here: the functions below are traced by torch.compile, which skips lru_caches
_E4M3 = recipe_format("E4M3", "forward")
_HYBRID = {"forward": recipe_format("HYBRID", "forward"), "backward": recipe_format("HYBRID", "backward")}
_ELEMENTS = {name: get_format(name) for name in ("e4m3", "e5m2")}
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
# each element format's flush threshold under formats.DEEP_UNDERFLOW_BINADES: the deep flush (a constant
# here, so that traced code reads a number, not a cached lookup); bf16 flushes at half its smallest
# subnormal (its smallest normal times its epsilon: 2**-133)
_DEEP = {name: get_format(name).deep_underflow_threshold for name in ("e4m3", "e5m2", E2M1)}
_BF16_DEEP = (float(torch.finfo(torch.bfloat16).smallest_normal * torch.finfo(torch.bfloat16).eps) / 2
              / 2.0 ** DEEP_UNDERFLOW_BINADES)


def scaled(x: torch.Tensor, recipe: str, role: str, columnwise: bool = False) -> tuple[BlockScales | None, str]:
    """``x`` under ``recipe`` as a tensor of ``role``: its blocks and their encode / decode factors,
    and the element format (``e4m3``, ``e5m2``, ``e2m1``, or ``bf16`` with no blocks).
    ``columnwise``: the usage TE's backward GEMMs read (MXFP8 32x1 blocks, Float8BlockScaling 128x1;
    a weight's 128x128 tiles serve both)."""
    if columnwise and recipe in ("mxfp8", "block128") and not (recipe == "block128" and role == "weight"):
        return _columnwise(x, recipe)
    if recipe == "current":
        fmt = _HYBRID["backward" if role == "gradient" else "forward"]
        flat = x.detach().reshape(1, -1)
        amax = block_amax(flat)
        scale = te_scale_from_amax(amax, fmt.max)
        return BlockScales(flat, scale, scale.reciprocal(), amax), fmt.name
    e4m3 = _E4M3
    if recipe == "mxfp8":
        return mxfp8_blocks(x, e4m3), e4m3.name
    if recipe == "block128":
        return fp8_block_scaling_blocks(x, e4m3, 2 if role == "weight" else 1), e4m3.name
    if recipe == "nvfp4":
        return nvfp4_blocks(x, block_2d=role == "weight"), E2M1
    if recipe == "rowwise":
        return torchao_rowwise_blocks(x, e4m3), e4m3.name
    if recipe == "mxfp8_floor":
        return torchao_mx_floor_blocks(x), e4m3.name
    if recipe == "bf16":
        return None, "bf16"
    raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")


def check_recipes(names) -> tuple[str, ...]:
    """``names`` validated (a typo must not silently measure nothing)."""
    names = tuple(names or ())
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise ValueError(f"unknown what-if recipe(s) {unknown}; known: {', '.join(RECIPES)}")
    return names


def quantize(blocks: BlockScales, elem: str, stochastic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' values cast to ``elem`` with their scales: ``(codes as float32, in the scaled
    domain, saturating; dequantized values)``, both laid out like ``blocks.x``. The one cast of
    the block recipes, for the error capture measures and for the emulated layer alike.
    ``stochastic``: E2M1 rounded stochastically (TE's NVFP4 gradients), with torch's generator."""
    y = blocks.x.float() * blocks.scale
    if elem == E2M1 and stochastic:
        q = e2m1_round_stochastic(y, torch.rand_like(y))
    elif elem == E2M1:
        q = e2m1_round(y)
    else:
        fmt = _ELEMENTS[elem]
        q = y.clamp(-fmt.max, fmt.max).to(fmt.dtype).float()
    return q, q * blocks.scale_inv


def quantize_dequantize(x: torch.Tensor, recipe: str, role: str, columnwise: bool = False) -> torch.Tensor:
    """``x`` (2-D) quantized under ``recipe`` as a tensor of ``role`` and decoded, in ``x``'s layout
    and float32: ``columnwise`` takes the usage TE's backward GEMMs read (blocks along dim 0)."""
    if recipe == "bf16":
        return x.detach().to(torch.bfloat16).float()
    blocks, elem = scaled(x, recipe, role, columnwise)
    _, deq = quantize(blocks, elem)
    return blocks.unview(deq).reshape(x.shape)


def _columnwise(x: torch.Tensor, recipe: str) -> tuple[BlockScales, str]:
    if recipe == "mxfp8":
        return mxfp8_blocks(x, _E4M3, columnwise=True), _E4M3.name
    if recipe == "block128":
        return fp8_block_scaling_blocks(x, _E4M3, 1, columnwise=True), _E4M3.name
    raise ValueError(f"recipe {recipe!r} has no columnwise usage here")


def bf16_rounded(a: torch.Tensor) -> torch.Tensor:
    """``a`` (float32) rounded to bfloat16 to nearest even, as float32, in integer ops on its bits:
    ``a.to(torch.bfloat16).float()`` for every number and infinity (NaN gives an infinity, which
    ``counts`` masks as it masks NaN). The compiled form's round trip, because a compiler may drop
    a downcast that an upcast follows: torch 2.11's inductor did so on an H200 even with
    ``emulate_precision_casts`` set, and the ``bf16`` recipe's squared error came out 0."""
    bits = a.view(torch.int32)
    mag = (bits & 0x7FFFFFFF).clamp_max(0x7F800000)  # NaN as infinity: the sum below stays in int32
    rounded = (mag + (0x7FFF + ((mag >> 16) & 1))) & 0x7FFF0000
    return (rounded | (bits & -0x80000000)).view(torch.float32)


def count(mask: torch.Tensor) -> torch.Tensor:
    """The true elements of a boolean mask, as int64: ``count_nonzero``, one op on every device (a
    bool ``sum`` promotes each element to int64 first, which on the CPU costs twice the pass). The
    stats pass's eager form counts its six values otherwise, in one reduction
    (``capture.stats._make_full``)."""
    return torch.count_nonzero(mask)


def counts(x: torch.Tensor, recipe: str, role: str, fused: bool = False) -> torch.Tensor:
    """``x`` (2-D) under ``recipe``: ``schema.RECIPE_FIELDS`` as a float64 vector on its device (see
    ``capture.stats`` for what each count means). NVFP4 gradients: expected counts and squared error
    under TE's stochastic rounding.

    The seven sums are per-element columns (masks, values, or values to square). Eagerly each is
    reduced alone, so no stacked copy of the tensor is held; ``fused`` sums each per row and then
    the rows, the form inductor compiles on a GPU (``capture.stats._make_full_fused``: the row sums
    of all seven are one kernel, one pass, and the rows a kernel or two more). The same numbers
    either way, but for the sums of squares' last bits."""
    blocks, elem = scaled(x, recipe, role)
    a = (x.detach() if blocks is None else blocks.x).float()
    m = a.abs()
    f64 = torch.float64
    nonzero = (m > 0) & (m < float("inf"))  # what can underflow (derived.nonzero_finite)
    if blocks is None:  # bf16: a rounding, no scale
        deq = bf16_rounded(a) if fused else a.to(torch.bfloat16).float()
        q, y, top = deq, m, _BF16_MAX
        deep = nonzero & (m <= _BF16_DEEP)
    else:
        # a block whose own scale flushed to zero (NVFP4's E4M3 block scale under a tensor scale set by
        # a far larger value) decodes to 0: its values underflow, they are not clipped
        y = torch.where(blocks.scale_inv > 0, m * blocks.scale, 0.0)
        q, deq = quantize(blocks, elem)
        top = E2M1_MAX if elem == E2M1 else _ELEMENTS[elem].max
        # flushed from 4+ binades under the element format's threshold (capture.stats' underflow_deep); a
        # block whose scale flushed is not a tail of near-zeros: its values were the scale's to lose
        deep = nonzero & (y <= _DEEP[elem]) & (blocks.scale_inv > 0)
    clean = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    over = y > top if blocks is not None else m > top
    if elem == E2M1 and role == "gradient":
        underflow, saturated, sq_err = ((_SUM, c) for c in _stochastic_e2m1(a, y, blocks, nonzero))
    else:
        err = torch.nan_to_num(deq - a, nan=0.0, posinf=0.0, neginf=0.0)
        underflow = (_COUNT, nonzero & (deq == 0))
        # bf16 has no top code its rounding lands on: nothing saturates (no column to read)
        saturated = (_COUNT, (q.abs() == top) & (m < float("inf"))) if blocks is not None else (_NONE, m)
        sq_err = (_SQUARES, err)
    columns = [(_COUNT, nonzero), underflow, (_COUNT, deep), (_COUNT, over), saturated, sq_err, (_SQUARES, clean)]
    if fused:  # each column per row of x (all in one kernel, a program per block of rows), then the rows
        per_row = [_summand(kind, c).reshape(x.shape[0], -1).sum(1) for kind, c in columns]
        sums = torch.stack(per_row, -1).sum(0)
    else:
        sums = torch.stack([_reduced(kind, c) for kind, c in columns])
    return torch.cat([
        torch.full((1,), a.numel(), dtype=f64, device=a.device),
        sums,
        (torch.nan_to_num(y, nan=0.0).amax() / top).to(f64).reshape(1),  # how far the worst value clips (> 1)
    ])


# how a column of ``counts`` sums: a mask's true elements, values, squares of values; or nothing
_COUNT, _SUM, _SQUARES, _NONE = "count", "sum", "squares", "none"


def _reduced(kind: str, column: torch.Tensor) -> torch.Tensor:
    """One column summed alone, as a float64 0-d tensor (the eager form)."""
    f64 = torch.float64
    if kind == _COUNT:
        return count(column).to(f64)
    if kind == _SUM:
        return column.sum(dtype=f64)
    if kind == _SQUARES:
        return torch.linalg.vector_norm(column, 2, dtype=f64).square()
    return torch.zeros((), dtype=f64, device=column.device)


def _summand(kind: str, column: torch.Tensor) -> torch.Tensor:
    """What one element adds to its column's sum, in float64 (the fused form)."""
    f64 = torch.float64
    if kind == _SQUARES:
        c = column.to(f64)
        return c * c
    if kind == _NONE:  # 0, as an expression of the column (never true), so it joins its kernel
        return (column < -float("inf")).to(f64)
    return column.to(f64)


def _stochastic_e2m1(a, y, blocks, nonzero):
    """Per element, the expected underflow, saturation and squared error of E2M1 with stochastic rounding
    (``blocks.e2m1_stochastic``): a value flushes with probability ``1 - p_up`` when its lower
    neighbour is 0, lands on 6 with ``p_up`` when its upper one is, and its expected squared error is
    ``(a - lo)(hi - a)`` in the scaled domain, plus what clipping at 6 takes."""
    c, lo, hi, p_up = e2m1_stochastic(y)
    dec = blocks.scale_inv
    live = blocks.scale_inv > 0  # a block whose own scale flushed decodes to 0: all its values are lost
    flushed = torch.where(nonzero & live, (lo == 0).float() * (1.0 - p_up), 0.0) + (nonzero & ~live).float()
    on_top = torch.where(hi == E2M1_MAX, p_up, 0.0) + (y >= E2M1_MAX).float()
    over = (y - E2M1_MAX).clamp(min=0) * dec  # the part clipped at 6 (deterministic)
    sq = torch.where(live, (c - lo) * (hi - c) * dec * dec, a * a) + over * over
    sq = torch.nan_to_num(sq, nan=0.0, posinf=0.0, neginf=0.0)
    finite = (a.abs() < float("inf")).float()
    return flushed * finite, on_top * finite, sq * finite
