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

import ctypes
import math
import threading
from functools import lru_cache

import torch

from fp8scope import native
from fp8scope.emulate.scaling import round_f32, tensor_amax  # the one amax definition (NaN-propagating)
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


def _count_above_into(v: torch.Tensor, threshold: float, tmp: torch.Tensor) -> torch.Tensor:
    """Number of elements of ``v`` strictly above ``threshold`` (``v`` has no NaN), using ``tmp``.

    float32 sums of 0/1 are exact for chunks below 2**24 elements; the caller accumulates
    chunks in float64."""
    torch.sub(v, threshold, out=tmp)
    return tmp.clamp_(min=0).sign_().sum().to(torch.float64)


# What a cheap step records per tensor, in this order (``cheap_vector``).
CHEAP_FIELDS = ("amax", "scale", "scale_inv", "expected_amax")
_CHEAP_INDEX = [FIELD_INDEX[f] for f in CHEAP_FIELDS]


def _scalar32(value: torch.Tensor | float, device: torch.device, reduce: str) -> torch.Tensor:
    """0-d float32 on ``device``; per-row / per-block tensors summarised by their most
    conservative member (smallest scale; largest scale_inv and expected amax)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.dtype == torch.float32 and value.device == device:
            return value  # the common case (recipe state tensors): no op at all
        v = value.detach()
        if v.numel() > 1:
            v = v.amin() if reduce == "min" else v.amax()
        return v.reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def cheap_vector(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    scale_inv: torch.Tensor | float,
    expected_amax: torch.Tensor | float,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """``CHEAP_FIELDS`` as one float32 vector, built with a single stack.

    When the recipe already computed ``amax`` (our emulated layers, what-if states) this costs
    no pass over ``x`` at all; otherwise one fused min/max pass."""
    dev = x.device
    a = tensor_amax(x) if amax is None else _scalar32(amax, dev, "max")
    return torch.stack([a, _scalar32(scale, dev, "min"), _scalar32(scale_inv, dev, "max"),
                        _scalar32(expected_amax, dev, "max")])


def cheap_stats(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    scale_inv: torch.Tensor | float,
    expected_amax: torch.Tensor | float,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cheap fields laid out as a full ``STAT_FIELDS`` vector (other fields NaN)."""
    x = x.detach()
    out = torch.full((N_FIELDS,), _NAN, dtype=torch.float64, device=x.device)
    out[_CHEAP_INDEX] = cheap_vector(x, scale, scale_inv, expected_amax, amax=amax).to(torch.float64)
    out[FIELD_INDEX["numel"]] = float(x.numel())
    return out


def _sum_squares(t: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """sum(t**2) as float64, ``t`` scaled in place by ``unit`` (a power of two near 1/amax) first:
    a float32 dot of raw values overflows past ~1e19 and loses tiny ones, scaled it does neither."""
    t.mul_(unit)
    return torch.dot(t, t).to(torch.float64) / (unit.to(torch.float64) ** 2)


_CHUNK = 1 << 20  # elements per pass: bounds scratch memory to a few MiB whatever the tensor size
_scratch = threading.local()


def _buffers(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three reusable float32 scratch buffers of ``n`` elements on ``device`` (per thread).

    Fresh multi-MiB temporaries per op cost more than the arithmetic on CPU (every new
    allocation is page-faulted in again); reusing them makes each pass a plain memory pass.
    """
    cache = getattr(_scratch, "bufs", None)
    if cache is None:
        cache = _scratch.bufs = {}
    bufs = cache.get(device)
    if bufs is None or bufs.shape[1] < n:
        bufs = cache[device] = torch.empty((3, max(n, 1024)), dtype=torch.float32, device=device)
    return bufs[0, :n], bufs[1, :n], bufs[2, :n]


def _row_chunks(x: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor):
    """Yield (x_part, scale_part, inv_part) with at most ~_CHUNK elements, splitting along the
    first dim so that a per-row scale and scale_inv stay aligned with their rows."""
    if x.dim() == 0:
        x = x.reshape(1)
    rows = x.shape[0]
    per_row = max(1, x.numel() // max(rows, 1))
    step = max(1, _CHUNK // per_row)

    def part(t: torch.Tensor, r: int) -> torch.Tensor:
        return t[r:r + step] if t.dim() > 0 and t.shape[0] == rows and rows > 1 else t

    for r in range(0, rows, step):
        yield x[r:r + step], part(scale, r), part(inv, r)


def _per_row(t: torch.Tensor, x: torch.Tensor) -> int | None:
    """1 for a single scale, the row count for one scale per row of ``x``, None otherwise."""
    if t.numel() == 1:
        return 1
    rows = x.shape[0] if x.dim() > 0 else 1
    if t.numel() == rows and (t.dim() <= 1 or all(d == 1 for d in t.shape[1:])) and t.shape[0] == rows:
        return rows
    return None


def _host_scalar(v: torch.Tensor | float, reduce: str) -> float:
    """A CPU scale-like value as a float32-rounded Python float (what the torch path stores);
    per-row tensors by their most conservative member."""
    if isinstance(v, torch.Tensor):
        if v.numel() > 1:
            v = v.detach().amin() if reduce == "min" else v.detach().amax()
        v = v.item()
    return round_f32(float(v))


def _f32_buffer(v: torch.Tensor | float) -> torch.Tensor:
    """``v`` as a contiguous float32 CPU tensor whose data the kernel can read (no copy when it already is one)."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
        return v if v.dtype == torch.float32 and v.is_contiguous() else v.to(torch.float32).contiguous()
    return torch.tensor(float(v), dtype=torch.float32)


def _full_native(x, scale, scale_inv, expected_amax, fmt, deq, amax) -> list[float] | None:
    """``full_stats`` by the one-pass CPU kernel as a list of floats, or None where it does not
    apply (another device, dtype or scale layout; kernel unavailable or still building). Plain
    floats: on CPU the small torch ops of the generic path cost more than the pass itself."""
    code = native.dtype_code(x.dtype)
    if x.device.type != "cpu" or code is None or x.numel() == 0:
        return None
    lib = native.kernel(wait=False)
    if lib is None:
        return None
    if type(scale) is float and type(scale_inv) is float:  # host scaling states: no tensor to make
        buf = (ctypes.c_float * 2)(scale, scale_inv)  # alive until the call below returns
        s_ptr, i_ptr, n_scale, n_inv = ctypes.addressof(buf), ctypes.addressof(buf) + 4, 1, 1
    else:
        s, i = _f32_buffer(scale), _f32_buffer(scale_inv)
        if s.device.type != "cpu" or i.device.type != "cpu":
            return None
        n_scale, n_inv = _per_row(s, x), _per_row(i, x)
        s_ptr, i_ptr = s.data_ptr(), i.data_ptr()
    if n_scale is None or n_inv is None or (deq is not None and deq.numel() != x.numel()):
        return None
    xc = x.detach()
    if not xc.is_contiguous():
        xc = xc.contiguous()
    d = None
    if deq is not None:
        d = deq.detach()
        if d.dtype != torch.float32 or not d.is_contiguous():
            d = d.to(torch.float32).contiguous()
    rows = max(n_scale, n_inv)
    n = xc.numel()
    res = (ctypes.c_double * 10)()
    lib.fp8s_full_stats(xc.data_ptr(), code, rows, n // rows, s_ptr, n_scale,
                        i_ptr, n_inv, None if d is None else d.data_ptr(), fmt.max,
                        saturation_floor(fmt), fmt.underflow_threshold, _emin(fmt), fmt.mantissa_bits,
                        torch.get_num_threads(), res)
    n_nan, n_inf, nonzero, over, sat, above_under, sq_err, sq_sig, min_nz, tensor_max = res
    vals = [_NAN] * N_FIELDS
    vals[_F_AMAX] = _NAN if n_nan else (tensor_max if amax is None else _host_scalar(amax, "max"))
    vals[_F_MIN_NZ] = min_nz if nonzero - n_inf > 0 else _INF
    vals[_F_NUMEL] = float(n)
    vals[_F_ZEROS] = n - nonzero - n_nan
    vals[_F_NONFINITE] = n_nan + n_inf
    vals[_F_OVERFLOW] = over
    vals[_F_UNDERFLOW] = nonzero - above_under
    vals[_F_SATURATED] = sat
    vals[_F_SQ_ERR] = sq_err
    vals[_F_SQ_SIGNAL] = sq_sig
    vals[_F_SCALE] = _host_scalar(scale, "min")
    vals[_F_SCALE_INV] = _host_scalar(scale_inv, "max")
    vals[_F_EXPECTED] = _host_scalar(expected_amax, "max")
    return vals


(_F_AMAX, _F_MIN_NZ, _F_NUMEL, _F_ZEROS, _F_NONFINITE, _F_OVERFLOW, _F_UNDERFLOW, _F_SATURATED, _F_SQ_ERR,
 _F_SQ_SIGNAL, _F_SCALE, _F_SCALE_INV, _F_EXPECTED) = (FIELD_INDEX[f] for f in (
    "amax", "min_nonzero", "numel", "zeros", "nonfinite", "overflow", "underflow", "saturated", "sq_err",
    "sq_signal", "scale", "scale_inv", "expected_amax"))


@lru_cache(maxsize=None)
def _emin(fmt: Fp8Format) -> int:
    """Exponent of the smallest normal value of ``fmt``."""
    return int(round(math.log2(fmt.tiny)))


def full_stats(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    scale_inv: torch.Tensor | float,
    expected_amax: torch.Tensor | float,
    fmt: Fp8Format,
    deq: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every field of ``STAT_FIELDS``.

    ``scale`` may be a 0-d tensor, a float, or a tensor broadcastable to ``x`` with one
    entry per row (per-row scaling). ``deq`` is the dequantized tensor when the caller
    already quantized ``x`` (our emulated linear); otherwise ``x`` is quantized here to
    measure the error. Works in chunks through reused scratch buffers.
    """
    fast = _full_native(x, scale, scale_inv, expected_amax, fmt, deq, amax)
    if fast is not None:
        return torch.tensor(fast, dtype=torch.float64)
    out = cheap_stats(x, scale, scale_inv, expected_amax, amax=amax)
    x = x.detach()
    n = x.numel()
    dev = x.device
    if n == 0:
        for name in ("zeros", "nonfinite", "overflow", "underflow", "saturated", "sq_err", "sq_signal"):
            out[FIELD_INDEX[name]] = 0.0
        out[FIELD_INDEX["min_nonzero"]] = _INF
        return out
    scale_t = (scale.detach() if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))).float().to(dev)
    inv_t = (scale_inv.detach() if isinstance(scale_inv, torch.Tensor) else torch.tensor(float(scale_inv))).float()
    inv_t = inv_t.to(dev)
    if scale_t.numel() == 1:
        scale_t, inv_t = scale_t.reshape(()), inv_t.reshape(())
    sat_floor = saturation_floor(fmt)
    # acc: n_nan, n_inf, nonzero, overflow, saturated, above_underflow, sq_err, sq_signal
    acc = torch.zeros(8, dtype=torch.float64, device=dev)
    min_nz = torch.full((), _INF, dtype=torch.float32, device=dev)
    deq_parts = _row_chunks(deq.detach(), torch.zeros(()), torch.zeros(())) if deq is not None else None
    # power of two near 1/amax (1 when amax is 0, inf or NaN) that keeps sums of squares in range
    amax = out[FIELD_INDEX["amax"]].float()
    ok = torch.isfinite(amax) & (amax > 0) & (amax < _FLT_MAX)
    exponent = (-torch.floor(torch.log2(torch.where(ok, amax, 1.0)))).clamp_(-126, 126)
    unit = torch.where(ok, torch.exp2(exponent), 1.0)
    for xp, sp, ip in _row_chunks(x, scale_t, inv_t):
        m = xp.numel()
        a, y, t = _buffers(dev, m)
        a.copy_(xp.reshape(-1))  # float32 copy of x
        # quantization error first, while `a` still holds signed x
        if deq_parts is not None:
            dp, _, _ = next(deq_parts)
            t.copy_(dp.reshape(-1))
        else:
            yv = y.view(xp.shape)
            torch.mul(a.view(xp.shape), sp, out=yv)
            yv.clamp_(-fmt.max, fmt.max)
            t.view(xp.shape).copy_(yv.to(fmt.dtype))  # the real cast, decoded back to float32
            t.view(xp.shape).mul_(ip)
        t.sub_(a).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        sq_err = _sum_squares(t, unit)
        torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0, out=t)
        sq_sig = _sum_squares(t, unit)
        # magnitudes; NaN -> -1 so it falls below every threshold and is counted on its own
        a.abs_().nan_to_num_(nan=-1.0, posinf=_INF)
        torch.mul(a.view(xp.shape), sp, out=y.view(xp.shape))  # scaled magnitudes: what the cast sees
        counts = [
            _count_above_into(torch.neg(a, out=t), 0.0, t),
            _count_above_into(a, _FLT_MAX, t),
            _count_above_into(a, 0.0, t),
            _count_above_into(y, fmt.max, t),
            _count_above_into(y, sat_floor, t),
            _count_above_into(y, fmt.underflow_threshold, t),
        ]
        acc += torch.stack(counts + [sq_err.to(torch.float64), sq_sig.to(torch.float64)])
        # smallest non-zero: zeros and NaNs (-1) pushed to FLT_MAX (inf * 0 would be NaN)
        torch.clamp(a, min=0, out=t).sign_().neg_().add_(1.0).mul_(_FLT_MAX).add_(a)
        min_nz = torch.minimum(min_nz, t.amin())
    return _finish(out, n, acc, min_nz)


def full_row(x, scale, scale_inv, expected_amax, fmt: Fp8Format, deq=None, amax=None) -> list[float] | torch.Tensor:
    """:func:`full_stats` for the collector: a plain list of floats where the CPU kernel computed
    it (the step's rows then become one tensor in one call), else the device tensor."""
    fast = _full_native(x, scale, scale_inv, expected_amax, fmt, deq, amax)
    return fast if fast is not None else full_stats(x, scale, scale_inv, expected_amax, fmt, deq=deq, amax=amax)


def cheap_row(x, scale, scale_inv, expected_amax, amax=None) -> tuple[float, ...] | torch.Tensor:
    """:func:`cheap_vector` for the collector: a tuple when every value is already a host float
    (scaling states on the CPU), else the device vector."""
    if type(amax) is float and type(scale) is float and type(scale_inv) is float and type(expected_amax) is float:
        return (amax, scale, scale_inv, expected_amax)
    return cheap_vector(x, scale, scale_inv, expected_amax, amax=amax)


def _finish(out: torch.Tensor, n: int, acc: torch.Tensor, min_nz: torch.Tensor) -> torch.Tensor:
    """Fill the full-stat fields of ``out`` from the accumulators
    (n_nan, n_inf, nonzero, overflow, saturated, above_underflow, sq_err, sq_signal) and the
    smallest non-zero magnitude (FLT_MAX or inf when there is none)."""
    dev = out.device
    acc = acc.to(dev)
    n_nan, n_inf, nonzero, over, sat, above_under = (acc[i] for i in range(6))
    out[FIELD_INDEX["zeros"]] = n - nonzero - n_nan
    out[FIELD_INDEX["nonfinite"]] = n_nan + n_inf
    out[FIELD_INDEX["overflow"]] = over
    out[FIELD_INDEX["saturated"]] = sat
    out[FIELD_INDEX["underflow"]] = nonzero - above_under
    out[FIELD_INDEX["sq_err"]] = acc[6]
    out[FIELD_INDEX["sq_signal"]] = acc[7]
    mn = min_nz.to(device=dev, dtype=torch.float64)
    # FLT_MAX marks "no finite non-zero element"; a real FLT_MAX element is told apart by the counts
    out[FIELD_INDEX["min_nonzero"]] = torch.where(nonzero - n_inf > 0, mn, _INF)
    # amax must propagate NaN like the recipe's amax does.
    out[FIELD_INDEX["amax"]] = torch.where(n_nan > 0, torch.tensor(_NAN, dtype=torch.float64, device=dev),
                                           out[FIELD_INDEX["amax"]])
    return out
