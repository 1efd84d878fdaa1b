"""Compare mode: the FP8 step and a BF16 re-run of it, layer by layer.

Two phases, on compare steps only (other steps pay nothing):

1. ``FP8Capture`` is armed *before* the FP8 step's forward. Forward hooks keep, per
   compared layer, a fixed random sample (``sample_size`` elements, all of them for
   small tensors) of the layer's output; tensor hooks on the layer's weights keep the
   same kind of sample of this backward's weight gradient. Memory: O(layers x
   sample_size), independent of batch and sequence length; the activations of the
   FP8 step are not kept.
2. ``bf16_pass`` re-runs ``loss_fn(model, batch)`` with FP8 off, the RNG state of
   the FP8 step restored and the real ``.grad`` tensors set aside (restored as the
   same objects afterwards). Forward hooks compare each layer's output with its FP8
   sample as soon as it is produced (plus, for emulated layers, the layer's own FP8
   GEMM on this BF16 input: the *local* error) and drop it; post-accumulate-grad hooks
   compare each weight gradient as soon as it is ready and free it. Peak extra memory
   is one normal forward/backward (the FP8 step's activations are already freed) plus
   one layer's temporaries.

Statistics are accumulated on the device as sums (||a-b||^2, ||a||^2, ||b||^2, <a,b>)
and read back with one transfer at the end.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .precision import high_precision, layer_kind, layer_weights


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            if isinstance(v, torch.Tensor):
                return v
    return None


def sample_index(key: str, numel: int, device: torch.device, size: int | None) -> torch.Tensor | None:
    """Fixed random element indices for ``key`` (None = the whole tensor)."""
    if size is None or numel <= size:
        return None
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}|{numel}".encode()))
    dtype = torch.int32 if numel < 2**31 else torch.int64
    return torch.randint(numel, (size,), generator=g, dtype=dtype).to(device)


def take(t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return (flat if idx is None else flat[idx]).to(torch.float32, copy=True)


class _Acc:
    """Running sums for rel err and cosine over several pieces (calls, weights)."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """a: FP8 side, b: BF16 reference (same shape)."""
        a = a.reshape(-1).float()
        b = b.reshape(-1).float()
        f64 = torch.float64
        s = torch.stack([(a - b).square().sum(dtype=f64), a.square().sum(dtype=f64), b.square().sum(dtype=f64),
                         (a * b).sum(dtype=f64)])
        self.sums = s if self.sums is None else self.sums + s


def rel_cos(d2: float, a2: float, b2: float, ab: float) -> tuple[float, float]:
    """(||a-b|| / ||b||, cos(a, b)) from the sums; NaN propagates."""
    if any(math.isnan(v) for v in (d2, a2, b2, ab)):
        return math.nan, math.nan
    if b2 > 0:
        rel = math.sqrt(d2 / b2)
    else:
        rel = 0.0 if d2 == 0 else math.inf
    if a2 > 0 and b2 > 0:
        cos = ab / math.sqrt(a2 * b2)
    else:
        cos = 1.0 if a2 == b2 == 0 else 0.0
    return rel, cos


# ---- phase 1: the FP8 step ---------------------------------------------------------------
@dataclass
class FP8Capture:
    layers: dict[str, nn.Module]
    sample_size: int | None
    outputs: dict[str, list[tuple[torch.Tensor | None, torch.Tensor]]] = field(default_factory=dict)
    wgrads: dict[tuple[str, int], tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)
    sampled: bool = False
    _handles: list = field(default_factory=list)

    def arm(self) -> None:
        for name, m in self.layers.items():
            self._handles.append(m.register_forward_hook(self._out_hook(name)))
            for i, p in enumerate(layer_weights(m)):
                self._handles.append(p.register_hook(self._grad_hook(name, i)))

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def new_forward(self) -> None:
        """A new forward of the model began (micro-batches): keep only the latest one."""
        self.outputs.clear()

    def _out_hook(self, name: str):
        def hook(mod, args, out):
            y = _first_tensor(out)
            if y is None or not torch.is_grad_enabled():
                return None
            calls = self.outputs.setdefault(name, [])
            idx = sample_index(f"{name}#{len(calls)}", y.numel(), y.device, self.sample_size)
            self.sampled |= idx is not None
            calls.append((idx, take(y, idx)))
            return None

        return hook

    def _grad_hook(self, name: str, i: int):
        def hook(grad):
            idx = sample_index(f"{name}.w{i}", grad.numel(), grad.device, self.sample_size)
            self.sampled |= idx is not None
            self.wgrads[(name, i)] = (idx, take(grad, idx))
            return None

        return hook

    def nbytes(self) -> int:
        n = 0
        for calls in self.outputs.values():
            for idx, s in calls:
                n += s.nbytes + (idx.nbytes if idx is not None else 0)
        for idx, s in self.wgrads.values():
            n += s.nbytes + (idx.nbytes if idx is not None else 0)
        return n


# ---- phase 2: the BF16 pass --------------------------------------------------------------
def _local_fp8_output(m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """Emulated layer: its FP8 GEMM on ``x`` with the scales the FP8 step used (state read, never written)."""
    from fp8scope.emulate import CurrentScaling, ScalingState
    from fp8scope.emulate.quantize import quantize_dequantize

    rec = m.recipe
    fmt = rec.forward_format
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        if getattr(m, "block_scaled", False):  # per-block scales from the operands themselves
            from fp8scope.emulate.block_linear import operand

            x2 = x.detach().reshape(-1, x.shape[-1])
            xd = operand(x2, rec.kind, "activation", recipe=rec)[2].reshape(x.shape)
            wd = operand(m.gemm_weight().detach(), rec.kind, "weight", recipe=rec)[2]
            return F.linear(xd, wd, None if m.bias is None else m.bias.detach().float())
        if isinstance(rec, CurrentScaling):
            sx = ScalingState(rec, fmt, x.device).begin(x)
            sw = ScalingState(rec, fmt, x.device).begin(m.gemm_weight().detach())
        else:
            sx = (m.activation_state.scale, m.activation_state.scale_inv)
            sw = (m.weight_state.scale, m.weight_state.scale_inv)
        _, xd = quantize_dequantize(x.detach(), sx[0], sx[1], fmt)
        _, wd = quantize_dequantize(m.gemm_weight().detach(), sw[0], sw[1], fmt)
        return F.linear(xd, wd, None if m.bias is None else m.bias.detach().float())


@dataclass
class CompareResult:
    step: int
    loss_fp8: float
    loss_bf16: float
    rows: list[dict]
    seconds: float = 0.0  # wall time of the BF16 pass and the comparison
    capture_bytes: int = 0  # what the FP8 step kept for the comparison

    @property
    def loss_diff(self) -> float:
        return self.loss_fp8 - self.loss_bf16

    def most_divergent(self, n: int = 1) -> list[dict]:
        """Layers ranked by their own FP8 error (local where known, else end-to-end output error),
        then by weight-gradient error."""

        def key(r):
            local = r["local_rel_err"]
            first = local if local is not None and not math.isnan(local) else r["output_rel_err"]
            first = math.inf if first is None or math.isnan(first) else first
            w = r["wgrad_rel_err"]
            w = math.inf if w is None or math.isnan(w) else w
            return (first, w)

        return sorted(self.rows, key=key, reverse=True)[:n]


@contextmanager
def grads_set_aside(model: nn.Module):
    """Move every ``.grad`` out of the way (references, no copy) and put the same objects back."""
    saved = [(p, p.grad) for p in model.parameters()]
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, g in saved:
            p.grad = g


def bf16_pass(
    model: nn.Module,
    loss_fn: Callable,
    batch: Any,
    capture: FP8Capture,
    local: bool = True,
) -> tuple[float, list[dict]]:
    """Re-run the step with FP8 off and compare with ``capture``; returns (loss_bf16, rows)."""
    layers = capture.layers
    out_acc = {n: _Acc() for n in layers}
    loc_acc = {n: _Acc() for n in layers}
    w_acc = {n: _Acc() for n in layers}
    calls = {n: 0 for n in layers}
    kinds = {n: layer_kind(m) for n, m in layers.items()}
    handles = []

    def fwd_hook(name):
        def hook(mod, args, out):
            y = _first_tensor(out)
            if y is None:
                return None
            k = calls[name]
            calls[name] += 1
            fp8 = capture.outputs.get(name, [])
            if k < len(fp8):
                idx, a = fp8[k]
                if a.numel() == (y.numel() if idx is None else idx.numel()):
                    out_acc[name].add(a, take(y, idx))
            if local and kinds[name] == "emulated" and flags[name]:
                x = _first_tensor(args)
                if x is not None:
                    loc_acc[name].add(_local_fp8_output(mod, x), y.detach())
            elif local and kinds[name] == "plain":
                loc_acc[name].add(torch.zeros(1), torch.zeros(1))  # no FP8 in this layer: no own error
            return None

        return hook

    owners: dict[int, list[tuple[str, int]]] = {}
    weights: dict[int, nn.Parameter] = {}
    for name, m in layers.items():
        handles.append(m.register_forward_hook(fwd_hook(name)))
        for i, p in enumerate(layer_weights(m)):
            owners.setdefault(id(p), []).append((name, i))
            weights[id(p)] = p

    def grad_hook(p):
        g = p.grad
        if g is not None:
            for name, i in owners.get(id(p), []):
                got = capture.wgrads.get((name, i))
                if got is not None:
                    idx, a = got
                    w_acc[name].add(a, take(g, idx))
        p.grad = None  # free this layer's BF16 gradient right away

    for p in weights.values():
        handles.append(p.register_post_accumulate_grad_hook(grad_hook))

    # fp8_disabled() clears the flags during the pass: read which layers train in FP8 now.
    flags = {n: getattr(m, "fp8_enabled", False) for n, m in layers.items()}
    try:
        with grads_set_aside(model), high_precision(model):
            loss = loss_fn(model, batch)
            loss_t = loss.detach().float()
            if loss.requires_grad and weights:
                torch.autograd.backward(loss, inputs=list(weights.values()))
    finally:
        for h in handles:
            h.remove()

    names = list(layers)
    nan4 = torch.full((4,), math.nan, dtype=torch.float64)
    stacked = []
    for accs in (out_acc, w_acc, loc_acc):
        for n in names:
            s = accs[n].sums
            stacked.append(nan4 if s is None else s.detach().to("cpu", torch.float64))
    host = torch.stack(stacked).tolist() if stacked else []
    loss_bf16 = float(loss_t.cpu())
    rows = []
    L = len(names)
    for j, n in enumerate(names):
        o_rel, o_cos = rel_cos(*host[j])
        w_rel, w_cos = rel_cos(*host[L + j])
        l_rel, l_cos = rel_cos(*host[2 * L + j])
        rows.append({
            "layer": n,
            "output_rel_err": o_rel, "output_cos": o_cos,
            "wgrad_rel_err": w_rel, "wgrad_cos": w_cos,
            "local_rel_err": None if math.isnan(l_rel) else l_rel,
            "local_cos": None if math.isnan(l_cos) else l_cos,
        })
    return loss_bf16, rows
