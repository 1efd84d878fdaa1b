"""The amax of a tensor in one pass: what Transformer Engine records, and what a monitor logs.

Two numbers come out of the same pass over ``x``:

- ``logged``: ``max(|x|)`` with NaN propagating. A row whose amax is NaN says "this tensor held a
  NaN", so the first NaN is localized at the step and layer where it appears (an Inf shows as an
  Inf amax). Its non-finiteness is the cheap rows' non-finite flag.
- ``recorded``: TE's amax, reduced with ``fmaxf`` from 0, so NaN elements are ignored and a
  history row is never NaN (``transformer_engine/common/recipe/`` and the cast kernels'
  ``amax`` reduction; ../shared/te-internals.md). With x = [NaN, 3] it is 3, and the next
  delayed scale 448 / 3.

Both come from :data:`AMAX`: on CUDA compiled (ahead, in a compile child) into one pass over the tensor's
rows and one over the rows (2 launches, called without dynamo: see ``fp8scope.compiled``);
elsewhere eagerly: one pass on the CPU, four ops on an accelerator (:func:`amaxes_of`).

:func:`amax_parts` is the what-if monitor's per-capture pass on cheap steps, and it is one eager
op on every device, ``aminmax``, whose ``(max, min)`` is ``(a, c)``: with ``b = -c`` the logged
amax is ``maximum(a, b)`` (NaN-propagating, exact) and the recorded one ``fmax(a, b)``, which is
TE's except on a tensor holding a NaN: there the history rolls in 0 for that step
(``scaling.delayed_update``) instead of TE's fmaxf amax of the other elements, and is never NaN.
Full steps record TE's exact amax from the stats pass. Why not compiled: through the compiled
pass a cheap capture is a call of dynamo's guarded code and five Triton launches (the reduction is
split at dynamic shapes) where the eager op is one launch, and on a GPU a cheap step costs what its
launches cost the host (``benchmarks/large_model.py``; docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

import functools

import torch

from fp8scope.compiled import CompiledFn, tracing

_INF = float("inf")


def recorded_amax(a: torch.Tensor, dim: int | None = None, scratch: bool = False) -> torch.Tensor:
    """TE's amax of ``a = |x|``: reduced with ``fmaxf`` from 0, so NaN elements are ignored and an
    Inf stays Inf. The one definition, in the fused passes here, in the stats pass and per block
    (``dim``: one amax per row, kept as a column). ``scratch``: ``a`` is the caller's temporary and
    is cleaned in place. Why: on a CPU a second tensor-sized temporary costs more than the passes
    over it (a large one is fresh memory from the OS each time, docs/benchmarks.md), and on a GPU
    it is memory the training may need. Traced, the compiler fuses it away anyway: in place only in
    eager code."""
    if scratch and not tracing():
        clean = a.nan_to_num_(nan=0.0, posinf=_INF)
    else:
        clean = torch.nan_to_num(a, nan=0.0, posinf=_INF)
    return clean.amax() if dim is None else clean.amax(dim=dim, keepdim=True)


_MIN_ROWS = 64


def row_matrix(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view of ``x`` for a reduction whose value does not depend on the layout (the stats of a
    tensor with one scale, its amax): leading dims flattened, the last kept; a vector, or a matrix
    of fewer than 64 rows, refolded into rows of up to 4,096 elements (64 rows or more where its
    size allows). Why: compiled for a GPU, such a reduction runs each row and then the rows, with a
    program per block of rows (``capture.stats._make_full_fused``, :func:`_fused_pair`), so rows are
    its parallelism."""
    if x.dim() == 2 and x.shape[0] >= _MIN_ROWS:
        return x  # already one: no view to make
    v = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
    n = v.numel()
    for cols in (4096, 2048, 1024, 512, 256, 128):
        if v.shape[0] >= _MIN_ROWS:
            break
        if n % cols == 0 and n // cols > v.shape[0]:
            v = v.reshape(-1, cols)
    return v


def reads_on_host(x: torch.Tensor) -> bool:
    """Whether reading a value of ``x`` is a read of host memory, not a device sync: a CPU tensor,
    eagerly (traced code has no value to read). Where it is, the eager forms read what decides
    their work (:func:`amaxes_of`, ``capture.stats``' finite pass)."""
    return x.device.type == "cpu" and not tracing()


def readable(t: torch.Tensor) -> bool:
    """Whether ``t``, an op's result, holds values to read: a plain tensor, not a fake one (a
    ``FakeTensorMode``, an export) nor a subclass's, whose read would raise or mean something else.
    Asked of a result, not of the input: a ``Parameter``'s ops give plain tensors."""
    return type(t) is torch.Tensor


def logged_on_host(x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """``max |x|`` (NaN propagating; +0.0 for a tensor of zeros, as ``x.abs().amax()`` gives it) as
    a 0-d tensor of ``x``'s dtype, and its value read on the host: :func:`amax_parts`' one pass, no
    copy of ``x``. For a CPU tensor only, where the read is a read of host memory and not a sync:
    both ends are read, and the larger magnitude is the end ``aminmax`` returned (negated when it
    is the minimum), so most tensors cost that one op and two reads (every emulated operand, every
    step: host time, which bounds a small model's step). None when there is nothing to read
    (:func:`readable`); the caller then takes its form that reads nothing."""
    hi, lo = amax_parts(x)
    if not readable(hi):
        return None
    top, low = hi.item(), lo.item()  # both NaN if x holds a NaN
    if low != low:
        return lo, low
    if top > -low:
        return hi, top  # the result aminmax made: no op
    if -low > top:
        return lo.neg(), -low
    if top == 0:  # (-low == top) zeros of either sign: +0.0
        return torch.zeros((), dtype=x.dtype, device=x.device), 0.0
    return hi, top  # NaN, or max == -min


def amaxes_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logged, recorded)`` of ``x`` as 0-d float32 tensors, ``max`` propagating NaN, eagerly.

    On the CPU: one pass, ``aminmax``, gives the logged amax, and it is TE's too unless it is NaN;
    reading that on the host costs no sync there (the CPU is the host), so only a tensor that holds
    a NaN pays for the second pass that ignores its NaN elements. Elsewhere (an accelerator whose
    compiled pair is not ready, or traced code) a read would be a sync per tensor, so both passes
    run: four ops over one temporary, ``|x|``, which TE's amax then cleans in place."""
    read = logged_on_host(x) if reads_on_host(x) else None
    if read is not None:
        logged, value = read
        logged = logged.to(torch.float32)
        if value == value:  # not NaN
            return logged, logged
        return logged, recorded_amax(x.abs(), scratch=True).to(torch.float32)
    a = x.abs()
    logged = a.amax().to(torch.float32)  # before the clean-up below overwrites a
    return logged, recorded_amax(a, scratch=True).to(torch.float32)


def _fused_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`amaxes_of` as inductor should see it: both maxima per row, in
    one kernel that reads each element once, then over the rows, one more (2 launches; the two
    reductions apart were 4 kernels and 5 launches: ``benchmarks/triton_kernels.py``). Only ever
    traced: eagerly it would hold a copy of the tensor. ``x`` has any shape: the compiled variant
    gets a :func:`row_matrix`, and a user's compiled model traces it on the layer's own tensor
    (an activation of shape (batch, tokens, features)), whose leading dims become rows here."""
    m = (x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)).abs()
    per_row = torch.stack([m.amax(1), torch.nan_to_num(m, nan=0.0, posinf=_INF).amax(1)], -1)
    logged, recorded = per_row.amax(0).to(torch.float32).unbind(0)
    return logged, recorded


def fused_when_traced(device: torch.device) -> bool:
    """Whether a traced amax pair on ``device`` is :func:`_fused_pair` (an accelerator's compiled
    code: its 2 launches inside the graph, where an eager call from Python is a compiled call of
    its own, whose host time is most of it), or the plain form (the CPU: inductor's C++ makes that
    one loop, and there an eager ``aminmax`` is faster than inductor's reduction, docs/emulate.md,
    so the emulated layer's compiled backward leaves its gradient's amaxes to the eager tap there:
    ``Fp8Linear._gradient_done``)."""
    return device.type != "cpu"


def _make_pair(key):
    def amax_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tracing() and fused_when_traced(x.device):  # traced for Triton
            return _fused_pair(x)  # (inductor's C++ makes the plain form one loop already)
        return amaxes_of(x)  # plain Python: a call the compiled guards rejected

    return amax_pair


def _examples(key):
    """A large matrix of distinct sides: inductor picks its loop structure (threads, block sizes) from
    the size, and dynamo would guard on equal sides."""
    device, dtype = key
    return (torch.randn(1024, 1536, device=device).to(dtype),)


def _options(key) -> dict:
    """No split reductions: the rows are the split (inductor would finish each stage in two launches)."""
    return {"split_reductions": False}


# eagerly: one pass on the CPU, else its 4 ops (abs, amax, nan_to_num, amax): amaxes_of
AMAX = CompiledFn("amax", _make_pair, _examples, devices=("cuda",), options=_options)


def _empty_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What both passes give for an empty tensor: 0 and 0 (there is nothing to scale)."""
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    return zero, zero


def _call(fns: CompiledFn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach()
    if x.numel() == 0:
        return _empty_pair(x)
    key = (x.device.type, x.dtype)
    if torch.compiler.is_compiling():  # traced into a user's compiled model: the plain function, no cache
        return fns.traced(key)(x)
    fn, eager = fns.get(key), fns.fallback(key)
    if fn is eager or not x.is_contiguous():  # eager, or a strided view: read in place, no copy
        return eager(x)
    return fn(row_matrix(x))  # one compiled variant per (device, dtype): a matrix view of any shape


def amax_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logged, recorded)`` amaxes of ``x`` as 0-d float32 tensors on its device (0 and 0 for an
    empty tensor). No host sync."""
    return _call(AMAX, x)


def amax_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, c)``: with ``b = -c``, ``maximum(a, b)`` is the logged amax and ``fmax(a, b)`` the
    recorded one (see above; :func:`combine_parts` does it for many). One op, any strides, no
    host sync; ``(0, 0)`` for an empty tensor."""
    if x.numel() == 0:
        return _empty_pair(x)
    lo, hi = torch.aminmax(x.detach() if x.requires_grad else x)  # detach is a dispatch too: only where needed
    return hi, lo


def amax_parts_into(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """:func:`amax_parts` of a non-empty ``x`` written into ``out = (c, a)``, two 0-d tensors of
    ``x``'s dtype (rows of a buffer the caller keeps): the same one op, with no output to allocate
    and no stack of the step's 0-d results later (a stack dispatches a view op per tensor: host
    time on every device)."""
    torch.aminmax(x.detach() if x.requires_grad else x, out=out)


def amax_parts_many(xs: list[torch.Tensor],
                    multi_tensor: bool | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`amax_parts` of each of ``xs`` (non-empty tensors on one device), as one multi-tensor
    call where torch has multi-tensor kernels for the device (CUDA: ``torch._foreach_norm`` at
    ``inf``, two launches for all of them), else one ``aminmax`` each (on a CPU torch's multi-tensor
    norm is a loop of norms, each slower than an ``aminmax``). The multi-tensor form gives ``(n, -n)``
    with ``n = max(|x|)``: the same logged and recorded amaxes, as its CUDA kernel propagates NaN
    (``max_propagate_nan`` in ``ForeachReduceOp.cu`` and ``block_reduce.cuh``'s ``WarpReduceMax``).
    ``multi_tensor``: which form (None: the device's), so a CPU test checks both."""
    if not xs:
        return []
    if multi_tensor is None:
        multi_tensor = xs[0].device.type in _multi_tensor_devices()
    with torch.no_grad():  # weights require grad: no graph for a reading (and no detach op each)
        if not multi_tensor:
            return [torch.aminmax(x)[::-1] for x in xs]
        out: list = [None] * len(xs)
        by_dtype: dict[torch.dtype, list[int]] = {}  # one dtype per call keeps torch's fast path
        for i, x in enumerate(xs):
            by_dtype.setdefault(x.dtype, []).append(i)
        for idx in by_dtype.values():
            norms = torch._foreach_norm([xs[i] for i in idx], _INF)
            for i, n, neg in zip(idx, norms, torch._foreach_neg(norms)):
                out[i] = (n, neg)
    return out


@functools.cache
def _multi_tensor_devices() -> tuple[str, ...]:
    """Device types with torch's multi-tensor kernels (as ``torch.optim`` decides its default), and
    "meta", which takes an accelerator's code paths in the host-sync and op-count tests."""
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        return (*_get_foreach_kernels_supported_devices(), "meta")
    except ImportError:  # an older torch: CUDA had them first
        return ("cuda", "meta")


def combine_parts(a: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logged, recorded)`` float32 amaxes from :func:`amax_parts`' ``(a, c)`` (any shapes). ``b`` is
    ``0.0 - c``, never -0.0, and goes first: ``maximum`` keeps its first argument on a tie of zeros,
    so a tensor of zeros logs +0.0 whatever their signs, as ``max |x|`` (and :func:`logged_on_host`)
    gives it."""
    a, b = a.to(torch.float32), 0.0 - c.to(torch.float32)
    return torch.maximum(b, a), torch.fmax(b, a)


def logged_amax(x: torch.Tensor) -> torch.Tensor:
    """The logged (NaN-propagating) amax of ``x``, by :func:`amax_parts` (a cheap row's amax)."""
    return combine_parts(*amax_parts(x))[0]


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a 0-d float32 tensor, NaN if x holds a NaN, 0 for an empty tensor (the logged amax)."""
    return amax_pair(x)[0]
