"""Per-tensor FP8 statistics: one function of (tensor, scales, format), compiled into few kernels.

:func:`full_stats` returns one float64 vector laid out as ``schema.STAT_FIELDS`` on the tensor's
own device, with no host sync. The capture path calls :func:`stats_call`, whose row holds the same
numbers in the order a compiled pass writes them (``step_payload.WIDE_FIELDS``); the collector stacks
a step's rows and moves them to the host in a single transfer, and the host reorders them. The
arithmetic is one function, compiled once per (device type, dtype, format, scale layout) by
``fp8scope.compiled`` (on an accelerator ahead, in a compile child; eager meanwhile), in a form
written for the compiler (:func:`_make_full_fused`): 3 Triton kernels and 3 launches per tensor on a
GPU (``benchmarks/triton_kernels.py`` counts them), one C++ kernel on the CPU. Where a variant is
not compiled (the CPU's default, ``FP8SCOPE_COMPILE=0``), the eager form runs
(:func:`_make_full`): at most 40 aten ops whatever the tensor's size, no chunking, computed in place
in a few scratch copies of the tensor; on the CPU a finite tensor's pass skips what it cannot hold
(:func:`_make_finite_row`: about half the passes and half the scratch).

What each field means:

- ``amax``: ``max |x|`` with NaN propagating, so a NaN amax marks the tensor that held a NaN;
  ``nonfinite`` counts NaN and Inf elements.
- ``overflow`` is counted *before* the cast (``|x * scale| > fp8_max``): torch >= 2.12 saturates
  E4M3 on cast, so after the cast it is invisible. ``underflow`` and ``saturated`` are decided
  analytically from the same scaled magnitudes: with round-to-nearest-even a magnitude at or below
  half the smallest subnormal becomes 0 (underflow: non-zero before, zero after), and a magnitude
  above the midpoint below ``fp8_max`` rounds onto the top code (``saturation_floor``).
  ``underflow_deep`` counts the flushed values 4 binades or more under that threshold
  (``formats.deep_underflow_threshold``): a tail of near-zeros, where a bulk pressed under flushes
  from just below it. ``below_normal`` counts the non-zero values under the format's smallest
  normal (flushed, or a subnormal with fewer mantissa bits): where a tensor's bulk sits. A scale
  an outlier pressed down puts a large part of the tensor there, where a tail of small values that
  crosses the flush threshold (GELU's negative tail) puts there a few % more than it flushes. Each
  pass counts "at or below a threshold" (under, for the normal range), zeros included, in one
  comparison; ``step_payload.wide_stats`` takes the zeros out.
- ``sq_err`` and ``sq_signal``: sums of squares of the quantization error and of ``x`` over the
  finite elements, accumulated in float64 (the real cast, decoded back; or the caller's ``deq``);
  the CPU's eager pass over a finite tensor sums each row's float32 squares in float32 first
  (within a few float32 roundings, about 1e-6).
- ``min_nonzero``: the smallest non-zero ``|x|`` (inf when there is none).
- ``scale``, ``scale_inv``, ``expected_amax``: the scales in use; per-row or per-block scales are
  summarised by their most conservative member (smallest scale, largest scale_inv and amax).

Other recipes (``Monitor(whatif_recipes=[...])``, full steps) are measured in the same function, so
in the same compiled graph: the tensor is quantized under each chosen recipe
(``emulate.recipe_table``: E4M3 / E5M2 casts, or E2M1 rounding for NVFP4, with that recipe's
scales) and decoded back. Each gives one ``schema.RECIPE_FIELDS`` vector, whose counts have one
definition, ``emulate.recipe_table.counts`` (the advisor's baselines call it too):

- ``nonzero``: finite non-zero elements (what can underflow); ``underflow``: non-zero before, zero
  when decoded (a zero code, or a block scale that itself flushed to zero: NVFP4's E4M3 block
  scales under a tensor scale set by a huge outlier); ``underflow_deep``: of those, the ones 4+ binades
  under the element format's threshold (not a block whose scale flushed); ``overflow``: ``|x * scale|``
  above the element format's maximum before the cast (a block scale rounded down can push an element
  past it);
  ``saturated``: landed on the format's largest magnitude;
- ``sq_err``, ``sq_signal``: sums of squares of the error and of ``x`` over the finite elements;
- ``clip_ratio``: the largest ``|x * scale|`` over the format's maximum (above 1: clipped by that much).

The vectors stay on the device and travel with the step's single transfer; the store keeps them
long, one row per (tensor, recipe), in the ``recipes`` table.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from fp8scope.compiled import CompiledFn, tracing
from fp8scope.emulate.amax import readable, reads_on_host, recorded_amax, row_matrix
from fp8scope.emulate.blocks import as_matrix, e2m1_round
from fp8scope.emulate.quantize import quantize_dequantize
from fp8scope.emulate.recipe_table import E2M1, counts as recipe_counts
from fp8scope.formats import Fp8Format, get_format
from fp8scope.schema import RECIPE_FIELDS
from fp8scope.step_payload import N_WIDE, N_WIDE_MAX, WIDE_INDEX, wide_stats

_INF = float("inf")
_RECORDED = WIDE_INDEX["recorded_amax"]


@lru_cache(maxsize=None)
def saturation_floor(fmt: Fp8Format) -> float:
    """Largest float32 magnitude that does NOT quantize to ``fmt.max``.

    Computed once per format by casting the midpoint between the two largest codes,
    so the tie rule of the real cast decides and nothing is hand-derived.
    """
    below = fmt.max - 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    mid = (fmt.max + below) / 2
    if fmt.name == E2M1:  # no torch dtype: the rounding TE's kernels use
        lands_on_max = float(e2m1_round(torch.tensor([mid]))[0]) == fmt.max
    else:
        lands_on_max = float(torch.tensor([mid], dtype=torch.float32).to(fmt.dtype).float()[0]) == fmt.max
    if lands_on_max:  # ties go up: the floor is the float just below the midpoint
        return float(torch.nextafter(torch.tensor(mid, dtype=torch.float32), torch.tensor(0.0)))
    return mid


def _variant(key):
    """The constants of one variant: (format, fp8_max, saturation floor, (underflow threshold, deep
    underflow threshold, smallest normal), cast dtype, per_row, has_deq, recipes, role, whole_given)."""
    _device, _dtype, fmt_name, per_row, has_deq, *more = key
    recipes, role, whole_given = more if more else ((), None, False)
    fmt = get_format(fmt_name)
    dtype8 = None if has_deq else fmt.dtype  # E2M1 rows come with their decoded values (no torch dtype)
    under = (fmt.underflow_threshold, fmt.deep_underflow_threshold, fmt.tiny)
    return fmt, fmt.max, saturation_floor(fmt), under, dtype8, per_row, has_deq, recipes, role, whole_given


def _decoded(a, scale, scale_inv, deq, fmax, dtype8, has_deq):
    """The real cast of ``a`` (float32), decoded back: the quantization error's reference, as the
    compiler traces it (the eager form runs ``emulate.quantize.quantize_dequantize`` in its scratch)."""
    if has_deq:
        return deq.to(torch.float32)
    return (a * scale).clamp(-fmax, fmax).to(dtype8).to(torch.float32) * scale_inv


_EXACT_ROW = 1 << 24  # a float32 sum of ones is exact while it stays below 2**24
_ROUNDING = 2.0 ** -20  # more than a float32 product's rounding (2**-24), as a fraction of it
_F32_MAX = torch.finfo(torch.float32).max
_SQUARES_FLOOR = 2.0 ** -120  # a sum of squares at or above n times this lost < 2**-30 of itself to underflow


def _counting(a: torch.Tensor, masks: int = 2, sums: int = 8):
    """The eager pass's scratch for a float32 matrix ``a``: one block whose first ``masks * a.numel()``
    floats hold 0/1 masks (the general form's two, later its float64 copy for the squared sums),
    and ``parts``, one row per sum (numel, zeros, finite, overflow, underflow or zero, saturated,
    deep underflow or zero, below normal or zero, then the finite form's squared sums) of one sum
    per row of ``a``; with ``row_sums(values, i)``, which sums a matrix's rows into ``parts[i]`` (``i``
    a slice of rows for a stack of matrices: one op for several counts)."""
    rows, cols = a.shape
    n = a.numel()
    block = torch.empty(masks * n + sums * rows, dtype=torch.float32, device=a.device)
    exact = cols < _EXACT_ROW
    parts = (block[masks * n:].view(sums, rows) if exact
             else torch.empty(sums, rows, dtype=torch.float64, device=a.device))

    def row_sums(values, i):
        if exact:
            return torch.sum(values, -1, out=parts[i])
        return torch.sum(values, -1, dtype=torch.float64, out=parts[i])

    return block, parts, row_sums


def _squared_sums(a, err, block):
    """``(sum err**2, sum a**2)`` in float64, through the block's float64 space (``a`` may be strided);
    ``a``'s non-finite elements count as no signal."""
    rows, cols = a.shape
    wide = block[:2 * a.numel()].view(torch.float64)
    sq_err = torch.dot(wide.view(rows, cols).copy_(err).view(-1), wide)
    signal = wide.view(rows, cols).copy_(a).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return sq_err, torch.dot(signal.view(-1), wide)


def _wide_row(logged, min_nonzero, recorded, scale, scale_inv, expected, parts, sq_err, sq_signal, per_row):
    """``step_payload.WIDE_FIELDS`` as one float64 vector, from the eager pass's values."""
    counts = parts.sum(-1, dtype=torch.float64)
    torch.sub(counts[0], counts[2], out=counts[2])  # numel - finite: NaN and Inf
    one = (1,)
    return torch.cat([
        logged.view(one), min_nonzero.view(one), recorded.view(one),  # recorded: for a what-if state
        (scale.amin() if per_row else scale).reshape(one),
        (scale_inv.amax() if per_row else scale_inv).reshape(one),
        *[expected.reshape(one)] * 5,  # expected, then four unused copies
        counts, sq_err.view(one), sq_signal.view(one),
    ])


def _make_full(key):
    """The eager stats function of one variant: the format's limits are constants in its code. A
    variant with other recipes (``recipes``, the tensor's base ``role``) also measures each of them
    on the same tensor (``emulate.recipe_table.counts``) and returns their vectors as a second
    output: ``whole_given`` when the matrix they read is not ``x`` itself (``x`` is then a view of
    blocks). ``x`` is a matrix (``stats_call``'s). At most 40 ops whatever the size, each a pass over
    the tensor at most: what runs while the compiled form (:func:`_make_full_fused`, the same
    numbers) is not ready or not wanted.

    How, and why:

    - Every value is computed in place in a few scratch tensors (the magnitudes, the scaled
      magnitudes, and one block for two masks and the counts, which later holds the float64 copy
      for the squared sums), in an order that reads each before it is overwritten. On a CPU each
      fresh tensor-sized temporary is fresh memory from the OS, whose page faults cost more than
      the passes over it; on a GPU it is memory the training may need.
    - Each count is a comparison written as 0/1 float32, summed per row in float32 (exact while a
      row holds fewer than 2**24 elements; a longer one sums in float64; two masks side by side in
      one sum) and over the rows in float64, all of them in one reduction. On a CPU a comparison
      that writes booleans runs several times slower than one that writes float32, and a float sum
      is faster than ``count_nonzero``
      (docs/benchmarks.md).
    - On the CPU a value is read on the host without a sync (the CPU is the host), so the pass
      first asks whether the tensor is finite and runs :func:`_make_finite_row`'s form for one that
      is: the same numbers in about half the passes and half the scratch, because what a finite
      tensor cannot hold needs no pass (no NaN to clean, every element finite, TE's amax the logged
      one), a count the amaxes already decide needs none either, and its squares fit float32. A
      tensor with a NaN or an Inf, an accelerator (where a read would be a sync per tensor) and
      traced code run :func:`_make_general`'s.

    ``x`` and ``deq`` are the caller's: only read."""
    *_, recipes, role, whole_given = _variant(key)
    finite_row, general = _make_finite_row(key), _make_general(key)

    def full_stats(x, scale, scale_inv, expected, deq, whole=None):
        a = x.to(torch.float32)  # x itself when it is float32
        row, m = finite_row(a, scale, scale_inv, expected, deq) if reads_on_host(a) else (None, None)
        if row is None:
            row = general(a, scale, scale_inv, expected, deq, m)
        return row if not recipes else (row, _recipe_matrix(x, whole, recipes, role, whole_given))

    return full_stats


def _make_general(key):
    """The eager pass for any tensor on any device (``a``: the float32 matrix; ``m``, if given, its
    magnitudes, which it overwrites): at most 38 ops (its seven counts in four sums)."""
    fmt, fmax, sat, (under, deep, tiny), dtype8, per_row, has_deq, *_ = _variant(key)

    def general(a, scale, scale_inv, expected, deq, m=None):
        rows, cols = a.shape
        n = a.numel()
        m = a.abs() if m is None else m  # the magnitudes (``m``: the finite form's, untouched)
        block, parts, row_sums = _counting(a)
        o1, o2 = block[:n].view(rows, cols), block[n:2 * n].view(rows, cols)  # two 0/1 masks
        pair = block[:2 * n].view(2, rows, cols)  # both: two counts in one sum (parts' rows i and i + 1)
        logged = m.amax()  # NaN propagates
        parts[0].fill_(cols)
        torch.eq(m, 0, out=o1)
        torch.lt(m, _INF, out=o2)  # the finite elements (NaN compares false): non-finite below
        row_sums(pair, slice(1, 3))
        y = m * scale  # the scaled magnitudes the cast sees
        # the overflowing, then zero after the cast, the zeros included (NaN compares false;
        # step_payload.wide_stats takes the zeros out), then the saturated, then those flushed from
        # deep under the threshold, then those under the normal range
        torch.gt(y, fmax, out=o1)
        torch.le(y, under, out=o2)
        row_sums(pair, slice(3, 5))
        torch.gt(y, sat, out=o1)
        torch.le(y, deep, out=o2)
        row_sums(pair, slice(5, 7))
        row_sums(torch.lt(y, tiny, out=o2), 7)
        recorded = recorded_amax(m, scratch=True)  # TE's amax (NaN ignored); in m NaN is 0 from here
        zero = torch.eq(m, 0, out=o2.view(-1).view(torch.bool)[:n].view(rows, cols))  # in the free mask's bytes
        min_nonzero = m.masked_fill_(zero, _INF).amin()  # inf if none is non-zero
        # quantization error: the real cast, decoded (or the caller's dequantized copy), in y's place;
        # non-finite elements count as no error and no signal
        q = deq.to(torch.float32) if has_deq else quantize_dequantize(a, scale, scale_inv, fmt, out=y)[1]
        err = (q.sub_(a) if q is y else torch.sub(q, a, out=y)).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        sq_err, sq_signal = _squared_sums(a, err, block)  # in the masks' place, free now
        return _wide_row(logged, min_nonzero, recorded, scale, scale_inv, expected, parts, sq_err, sq_signal, per_row)

    return general


def _make_finite_row(key):
    """The eager pass on the CPU for a tensor with no NaN and no Inf: ``(row, None)``, the general
    form's row, its counts and amaxes value for value and its squared sums to float32's rounding
    (``tests/test_stats.py`` compares them). The general form must run instead when the tensor holds
    a NaN or an Inf (``(None, magnitudes)``: its first pass, for the general form to reuse), or its
    decoded copy or a scale does, or a squared sum leaves float32's range (``(None, None)``). What
    it leaves out, and why that changes no count:

    - one ``aminmax`` of the magnitudes gives the logged amax (``max |x|``, as the general form's
      ``amax``) and the smallest magnitude; finite, the amax is also TE's (no NaN to ignore), and
      every element is finite: no clean-up passes and no count of the finite elements;
    - the scaled magnitudes are at most ``amax * scale`` (with room for the float32 product's
      rounding; per-row scales: their largest), so when that stays at or below the saturation
      floor (``fp8_max``) no element saturates (overflows), and the count is 0 without a pass;
      likewise no element underflows when the smallest non-zero magnitude times the smallest
      scale stays above the underflow threshold. Near a limit the pass counts, so a bound never
      decides a count it could get wrong;
    - with every element finite, "non-zero before the cast" is "not zero", so the underflow count
      is the elements at or below the threshold less the zeros, from sums the pass has;
    - the smallest magnitude is the smallest non-zero one unless it is 0; only then are the zeros
      counted, and lifted out of the way of one ``amin`` and put back;
    - the magnitudes become the scaled magnitudes, then the error, then its squares, in place: one
      tensor-sized scratch beside one mask, where the general form needs four;
    - the squares are float32, summed per row in float32 (torch's pairwise sums: a relative error
      of a few float32 roundings, about 1e-6 at most) and over the rows in float64, where the
      general form copies both tensors to float64 first (twice the bytes, and the largest part of
      its time). A row sum past float32's range (magnitudes above about ``1e19``), or a sum small
      enough that squares may have underflowed (under ``2**-120`` an element: what underflow can
      lose is then below ``2**-30`` of it), sends the tensor to the general form;
    - the values it reads on the host (the extremes with the scales, then the sums and scalars in
      one read) make the row in one op, where the general form's row is a cat of twelve device
      values (some fifty ops on a CPU)."""
    fmt, fmax, sat, (under, deep, tiny), dtype8, per_row, has_deq, *_ = _variant(key)

    def finite_row(a, scale, scale_inv, expected, deq):
        rows, cols = a.shape
        n = a.numel()
        m = a.abs()  # the magnitudes; then the scaled magnitudes, the error and its squares
        if not readable(m):  # a fake tensor (a FakeTensorMode, an export): nothing to read
            return None, m
        ends = torch.aminmax(m)  # NaN propagates
        if per_row:  # a read of host memory, not a sync
            least, peak, s_lo, s_hi = torch.stack([*ends, *torch.aminmax(scale)]).tolist()
        else:
            least, peak, s_lo = torch.stack([*ends, scale]).tolist()
            s_hi = s_lo
        if not math.isfinite(peak):
            return None, m  # untouched: the general form's magnitudes
        block, parts, row_sums = _counting(a, masks=1, sums=10)  # parts' rows that no pass fills are left unread
        mask = block[:n].view(rows, cols)
        counted = []  # the rows of parts a pass filled (the others' counts are 0)
        if least == 0:  # zeros: count them, and lift them to float32's largest for the smallest non-zero
            row_sums(torch.eq(m, 0, out=mask), 1)
            least = m.add_(mask, alpha=_F32_MAX).amin().item()  # exact: m + 0 and 0 + max
            m.sub_(mask, alpha=_F32_MAX)  # exact: back to m (max - max is +0.0)
            least = _INF if peak == 0 else least  # every element zero: none is non-zero (the general form's inf)
            counted.append(1)
        y = m.mul_(scale)  # the scaled magnitudes the cast sees
        # their extremes, bounded with room for the float32 product's rounding
        top, low = peak * s_hi * (1 + _ROUNDING), least * s_lo * (1 - _ROUNDING)
        for i, limit in ((3, fmax), (5, sat)):
            if not top <= limit:  # (a NaN scale is counted)
                row_sums(torch.gt(y, limit, out=mask), i)
                counted.append(i)
        # the elements above a flush threshold (the rest flush), and those in the normal range (the
        # rest are under it)
        for i, limit, above in ((4, under, torch.gt), (6, deep, torch.gt), (7, tiny, torch.ge)):
            if not low > limit:
                row_sums(above(y, limit, out=mask), i)
                counted.append(i)
        # the quantization error, in y's place: the real cast decoded, or the caller's decoded copy
        err = torch.sub(deq, a, out=y) if has_deq else quantize_dequantize(a, scale, scale_inv, fmt, out=y)[1].sub_(a)
        row_sums(err.mul_(err), 8)
        row_sums(torch.mul(a, a, out=mask), 9)
        inv = scale_inv.amax() if per_row else scale_inv
        one = (1,)
        *sums, sq_err, sq_signal, inv, expect = torch.cat([  # every value the row needs, in one read
            parts.sum(-1, dtype=torch.float64), inv.reshape(one), expected.reshape(one)]).tolist()
        if not all(s == 0 and peak == 0 or n * _SQUARES_FLOOR <= s < _INF for s in (sq_err, sq_signal)):
            return None, None  # a non-finite decoded value or scale, a square past float32, or underflow
        counts = [float(n), *(sums[i] if i in counted else 0.0 for i in range(1, 8))]  # [2], non-finite: none
        for i in (4, 6, 7):  # flushed or zero, under the normal range or zero (WIDE_FIELDS): only the zeros
            counts[i] = n - sums[i] if i in counted else counts[1]  # where no pass counted
        return torch.tensor([peak, least, peak, s_lo, inv, *[expect] * 5, *counts, sq_err, sq_signal],
                            dtype=torch.float64), None  # step_payload.WIDE_FIELDS

    return finite_row


def _make_full_fused(key):
    """The same row as :func:`_make_full`, written for inductor (Triton on a GPU, C++ on the CPU, the
    form every compiled variant traces: :func:`traced_form`): ``x`` is a matrix (rows of
    a per-row scale, or any 2-D view of the tensor, ``emulate.amax.row_matrix``), and every value is
    reduced in two stages, each row first and then the rows. Each value is its own reduction, so
    inductor fuses the first stage into one kernel with a program per block of rows that reads each
    element once and keeps one accumulator per value; the second stage reduces a few vectors of
    one value per row, and writes the row's two halves in place (``step_payload.WIDE_FIELDS`` is
    laid out for that). Counts are summed per row as integers, then over the rows in float64; the
    squared norms in float64 throughout.

    Why this shape: a functional eager form compiled to 12 Triton kernels and 17 launches per tensor
    on an H200, each finishing launch of a split reduction costing host time. A first fused form stacked
    the per-element columns into one ``[elements, 8]`` reduction, 3 launches, but Triton gave each
    column programs of its own that computed every column: an H200 ran it several times slower
    than the eager form on large tensors (docs/benchmarks.md). Split reductions stay off
    (:func:`_compile_options`): the rows are the split. Eagerly this form would hold every
    per-element column in memory: it is only ever compiled."""
    _fmt, fmax, sat, (under, deep, tiny), dtype8, per_row, has_deq, recipes, role, whole_given = _variant(key)
    f64 = torch.float64

    def full_stats(x, scale, scale_inv, expected, deq, whole=None):
        a = x.to(torch.float32)
        m = a.abs()
        q = _decoded(a, scale, scale_inv, deq, fmax, dtype8, has_deq)
        err = torch.nan_to_num(q - a, nan=0.0, posinf=0.0, neginf=0.0).to(f64)
        clean = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0).to(f64)
        y = m * scale

        def each(v):  # v at every element, as an expression of x (never true: m is |x| or NaN), so
            return torch.where(m < -1.0, 0.0, v)  # that its row reduction joins the first kernel

        # each row: every value a reduction of its own, all in the first kernel (the scales too, as
        # the extreme of a row of copies, so that they need no kernel of their own)
        maxed = torch.stack([  # amax .. unused9, WIDE_FIELDS' order; the minima negated
            m.amax(1), torch.where(m > 0, m, _INF).amin(1).neg(), recorded_amax(m, dim=1).squeeze(1),
            each(scale).amin(1).neg(), each(scale_inv).amax(1), *[each(expected).amax(1)] * 5,
        ], -1)
        summed = torch.stack([  # numel .. sq_signal
            m.shape[1] - (m < -1.0).sum(1),  # the row's size, counted (never true) to join the kernel
            (m == 0).sum(1), m.shape[1] - (m < _INF).sum(1), (y > fmax).sum(1),
            (y <= under).sum(1),  # zero after the cast, the zeros included (NaN compares false)
            (y > sat).sum(1), (y <= deep).sum(1), (y < tiny).sum(1), (err * err).sum(1), (clean * clean).sum(1),
        ], -1)
        # then the rows
        maxes, sums = maxed.amax(0), summed.sum(0)
        column = torch.arange(N_WIDE_MAX, device=maxes.device)
        maxes = torch.where((column == 1) | (column == 3), maxes.neg(), maxes)  # the two minima
        row = torch.cat([maxes.to(f64), sums])
        return row if not recipes else (row, _recipe_matrix(x, whole, recipes, role, whole_given, fused=True))

    return full_stats


def _recipe_matrix(x, whole, recipes, role, whole_given, fused=False):
    """The other recipes' ``RECIPE_FIELDS`` rows, measured on the matrix ``x`` is (or is a view of
    the blocks of), in the same graph as the stats; ``fused``: each recipe's sums reduced per row,
    then over the rows (``recipe_table.counts``)."""
    matrix = whole if whole_given else x
    return torch.stack([recipe_counts(matrix, r, role, fused=fused) for r in recipes])


def _full_examples(key):
    device, dtype, fmt_name, per_row, has_deq, *more = key
    recipes, _role, whole_given = more if more else ((), None, False)
    # Sizes: distinct (dynamo would guard on equal ones: duck sizing) and large, because inductor
    # picks its loop structure (threads on the CPU, block sizes for Triton) from the example's size.
    # With recipes a per-tensor x is the matrix itself, its sides multiples of every block (128).
    shape = (1024, 1025) if per_row else (1024, 1536)
    sshape = (1024, 1) if per_row else ()
    x = torch.randn(shape, device=device).to(dtype)  # a fresh tensor, not a view: no guard on a base
    # three tensors, not one three times: dynamo would guard on the aliasing and no real call would match
    scale, scale_inv, expected = (torch.ones((), dtype=torch.float32, device=device) for _ in range(3))
    if per_row:
        scale, scale_inv = scale.expand(sshape).clone(), scale_inv.expand(sshape).clone()
    deq = x.to(torch.float32, copy=True) if has_deq else None  # a tensor of its own, also for float32 x
    if whole_given:
        return x, scale, scale_inv, expected, deq, torch.randn(1152, 1536, device=device).to(dtype)
    return x, scale, scale_inv, expected, deq


def _compile_options(key) -> dict:
    """Inductor settings for the fused form. Its per-element expressions must stay inside the
    reductions that read them: by default inductor writes a pointwise node out to memory when it
    reads more than 8 buffers or holds more than 30 ops, which a variant with a dequantized copy or
    per-row scales does (a second pass over the tensor and more launches). Split reductions are
    off: the rows are the split, and inductor would finish each stage in two launches. A variant
    that also measures other recipes keeps them: a recipe's whole-tensor amax (current scaling's,
    NVFP4's tensor scale) would otherwise run in one program.

    Every variant keeps eager's rounding through bf16 and fp16 (``emulate_precision_casts``): by
    default inductor drops a downcast that an upcast follows inside one kernel, which turned the
    ``bf16`` recipe's round trip into the identity, its squared error into 0 and its SQNR into
    infinity (``tests/test_recipe_advisor.py`` compiled). Torch 2.11's Triton dropped it even so
    (an H200), so that recipe's traced round trip is written in integer ops
    (``emulate.recipe_table.bf16_rounded``)."""
    options = {"emulate_precision_casts": True, "realize_opcount_threshold": 1 << 20,
               "realize_acc_reads_threshold": 1 << 20}
    if len(key) <= 5:  # no other recipes: every reduction is a stage of rows
        options["split_reductions"] = False
    return options


def traced_form(key):
    """The function inductor compiles for a variant, on every device: the fused form. Inductor's C++
    makes it one kernel on the CPU, and Triton 3 launches on a GPU. Not the eager form: it computes
    in place in scratch tensors (:func:`_make_full`), which traced are buffers inductor keeps apart
    (8 C++ kernels instead of 1). With other recipes measured and per-row scales (block and rowwise
    recipes measuring others) the fused form is checked on the CPU (``tests/test_recipe_advisor.py``),
    in ``benchmarks/triton_kernels.py`` (9-12 launches, where the eager form of an earlier tree
    compiled to 31-35) and on a GPU (``tests/test_gpu.py``, an H200)."""
    return _make_full_fused(key)


def _make_compiled(key):
    """The function ``FULL_STATS`` compiles: :func:`traced_form` while it is traced
    (``compiled.tracing``), the eager form when it runs as plain Python: a call the compiled code
    does not fit (a strided view, a dispatch mode) runs it so, and the fused form run eagerly would
    hold each of its per-element values in memory."""
    eager, fused = _make_full(key), _make_full_fused(key)

    def full_stats(x, scale, scale_inv, expected, deq, whole=None):
        if tracing():
            return fused(x, scale, scale_inv, expected, deq, whole)
        return eager(x, scale, scale_inv, expected, deq, whole)

    return full_stats


FULL_STATS = CompiledFn("full_stats", _make_compiled, _full_examples, fallback=_make_full, options=_compile_options)


def _f32(v: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A scale-like value as a float32 tensor on ``device`` (no op when it already is one)."""
    if isinstance(v, torch.Tensor):
        if v.requires_grad:
            v = v.detach()
        if v.dtype != torch.float32 or v.device != device:
            v = v.to(device=device, dtype=torch.float32)
        return v
    return torch.full((), float(v), dtype=torch.float32, device=device)  # a fill: no copy from the host


def _rows_of(t: torch.Tensor, x: torch.Tensor) -> int | None:
    """1 for a single value, the row count for one value per row of ``x``, None otherwise."""
    if t.numel() == 1:
        return 1
    rows = x.shape[0] if x.dim() > 0 else 1
    if t.numel() == rows and t.dim() >= 1 and t.shape[0] == rows:
        return rows
    return None


def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    return t if t.shape == shape else t.reshape(shape)


def stats_call(x, scale, scale_inv, expected_amax, fmt: Fp8Format, deq=None, recipes: tuple[str, ...] = (),
               role: str = "activation", whole: torch.Tensor | None = None):
    """``(row, recorded amax, recipe matrix)``: the row is :func:`full_stats`' numbers laid out as
    ``step_payload.WIDE_FIELDS`` (a float64 device vector; the host reorders it); the recorded amax
    is TE's (NaN elements ignored, a 0-d float64 view of the row), what a what-if delayed-scaling
    state records; the matrix holds one
    ``schema.RECIPE_FIELDS`` row per name in ``recipes`` (None without), measured on ``whole`` (the
    matrix ``x`` is a view of blocks of; default ``x`` itself) as a tensor of ``role``. Empty
    tensors give zero counts."""
    if x.requires_grad:  # the compiled code is guarded on requires_grad: hand it what it was made for
        x = x.detach()
    dev = x.device
    s, si, e = _f32(scale, dev), _f32(scale_inv, dev), _f32(expected_amax, dev)
    # one expected amax: a per-block one (block recipes) is summarised here, so the compiled
    # variants see the 0-d value they were made for (a rank the guards did not see runs eagerly)
    if e.dim() != 0:
        e = e.reshape(()) if e.numel() == 1 else e.amax()
    if x.numel() == 0:
        row = torch.zeros(N_WIDE, dtype=torch.float64, device=dev)  # WIDE_FIELDS
        row[1] = _INF
        row[3], row[4] = s.amin(), si.amax()
        row[5:10] = e.amax()
        matrix = torch.zeros(len(recipes), len(RECIPE_FIELDS), dtype=torch.float64, device=dev) if recipes else None
        return row, row[2], matrix
    rows_s, rows_si = _rows_of(s, x), _rows_of(si, x)
    if rows_s is None or rows_si is None:
        raise ValueError(f"scale of shape {tuple(s.shape)} does not fit a tensor of shape {tuple(x.shape)}")
    rows = max(rows_s, rows_si)
    per_row = rows > 1
    if per_row:
        xv, s, si = x.reshape(rows, -1), _shaped(s, (rows, 1)), _shaped(si, (rows, 1))
    elif recipes:  # the recipes read the matrix (blocks run along its last dim)
        xv, s, si = as_matrix(x), _shaped(s, ()), _shaped(si, ())
    else:
        xv, s, si = row_matrix(x), _shaped(s, ()), _shaped(si, ())
    d = None
    if deq is not None:
        d = _shaped(deq.detach() if deq.requires_grad else deq, xv.shape)
    key = (dev.type, x.dtype, fmt.name, per_row, d is not None)
    if not recipes:
        row = FULL_STATS.get(key)(xv, s, si, e, d)
        return row, row[_RECORDED], None
    if whole is None or whole is x:
        row, matrix = FULL_STATS.get((*key, tuple(recipes), role, False))(xv, s, si, e, d)
    else:
        row, matrix = FULL_STATS.get((*key, tuple(recipes), role, True))(xv, s, si, e, d, as_matrix(whole))
    return row, row[_RECORDED], matrix


def full_stats(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    scale_inv: torch.Tensor | float,
    expected_amax: torch.Tensor | float,
    fmt: Fp8Format,
    deq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every field of ``STAT_FIELDS`` as a float64 vector on ``x``'s device.

    ``scale`` may be a 0-d tensor, a float, or a tensor with one entry per row of ``x`` (per-row
    or per-block scaling, ``x`` viewed as ``[rows, -1]``). ``deq`` is the dequantized tensor when
    the caller already quantized ``x`` (our emulated linear); otherwise ``x`` is quantized here
    to measure the error."""
    return wide_stats(stats_call(x, scale, scale_inv, expected_amax, fmt, deq)[0])
