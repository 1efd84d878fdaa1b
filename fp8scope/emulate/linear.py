"""``Fp8Linear``: an ``nn.Linear`` whose GEMMs see FP8-quantized operands, on any device.

Forward quantizes the activation and the weight to the recipe's forward format
(E4M3); backward quantizes the output gradient to the backward format (E5M2
under HYBRID). Casts use real torch float8 dtypes; the matmuls then run in
float32 on the dequantized values, which is what an FP8 GEMM with float32
accumulation computes up to accumulation order. As in TE:

* dgrad = deq(grad_out) @ deq(W) and wgrad = deq(grad_out)^T @ deq(x): both
  backward GEMMs use the quantized forward operands;
* the bias gradient is reduced from the high-precision grad_out.

Each layer owns three :class:`ScalingState` (activation, weight, gradient).
Update timing is TE's (``autocast.py``): inside :func:`~fp8scope.emulate.fp8_autocast` the
forward scales update once when the region ends, so a layer called twice quantizes both calls
with one scale and records the larger amax; outside one, each grad-enabled call is its own region.
Without grad mode (``torch.no_grad``, evaluation) the layer still quantizes and, as TE, records
its amax into the next update without making one. A forward re-run inside backward (activation
checkpointing) uses the scales of its first run and records nothing. With
``fp8_enabled = False`` or inside ``fp8_disabled()`` the layer is exactly ``nn.Linear`` and
leaves its state alone.

``fp8scope_tap``, when set, is called after each quantization as
``tap(role, x, deq, scale, scale_inv, expected_amax, fmt)`` (eager runs; the monitor has a
hook of its own, ``fp8scope_monitor``, that also works under ``torch.compile``); an exception in
the tap is swallowed (with one warning per layer) so monitoring never breaks training.

Under ``torch.compile`` the layer traces without graph breaks: its scales are tensors, the
activation and weight states update in the forward, the gradient's scales are prepared at
forward time (delayed scaling; current scaling derives them from the gradient in backward), and
the backward records the gradient's amax through one opaque op
(``fp8scope.graph_taps``).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Fp8Format
from .quantize import quantize_dequantize
from .recipes import BLOCK_RECIPES, CurrentScaling, DelayedScaling, Recipe
from ..autograd_phase import in_backward
from .amax import amax_pair, fused_when_traced
from .autocast import autocast_off, fp8_globally_disabled, note_recorded, region_open
from .scaling import Scales, ScalingState, UpdateGroup, current_scales

ROLES = ("activation", "weight", "gradient")

Tap = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Fp8Format], None]

def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """Output dtype ``nn.Linear`` would produce: the autocast dtype if autocast is on."""
    dev = x.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except (TypeError, AttributeError, RuntimeError):  # older torch / unknown device type
        pass
    return x.dtype


class _Fp8LinearFn(torch.autograd.Function):
    """The GEMMs on operands the layer already quantized; backward quantizes the output gradient
    with the scales the layer prepared at forward time and records its amax (the layer's
    :meth:`Fp8Linear._gradient_done`). No state is touched here but through that call, so dynamo
    can trace the Function into a compiled graph."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_deq, w_deq, g_scale, g_scale_inv, g_expected, layer, out_dtype):  # type: ignore[override]
        out = F.linear(x_deq, w_deq, None if bias is None else bias.to(torch.float32))
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Keep the decoded float32 operands: decoding fp8 again in backward is slow on CPU.
        ctx.save_for_backward(x_deq if need_w else None, w_deq if need_x else None, g_scale, g_scale_inv, g_expected)
        ctx.layer = layer
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x_deq, w_deq, g_scale, g_scale_inv, g_expected = ctx.saved_tensors
        layer: Fp8Linear = ctx.layer
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_x = grad_w = grad_b = None
        with autocast_off(grad_out.device.type):
            fmt = layer._formats[1]
            pair = None
            if layer._current_gradient:  # current scaling: the gradient's own amax, as TE's current quantizer
                pair = amax_pair(grad_out)  # measured once: the record below reuses it
                g_scale, g_scale_inv, g_expected, _ = current_scales(pair[1], layer.gradient_state._scaled_max_t)
            _, g_deq = quantize_dequantize(grad_out, g_scale, g_scale_inv, fmt)
            layer._gradient_done(grad_out, g_deq, g_scale, g_scale_inv, g_expected, pair)
            if ctx.needs_input_grad[0]:
                grad_x = (g_deq @ w_deq).to(x_dtype)
            g2d = g_deq.reshape(-1, g_deq.shape[-1])
            if ctx.needs_input_grad[1]:
                x2d = x_deq.reshape(-1, x_deq.shape[-1])
                # in the layout the Parameter is stored in: [out, in], or [in, out] (Conv1D)
                grad_w = (x2d.t() @ g2d if layer.weight_transposed else g2d.t() @ x2d).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                go = grad_out.reshape(-1, grad_out.shape[-1])
                grad_b = go.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


class Fp8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` with emulated FP8 (TE-faithful per-tensor scaling).

    ``recipe`` defaults to ``DelayedScaling()`` (TE defaults). Build one from an
    existing layer with :meth:`from_linear` (parameters are shared, not copied).
    ``weight_transposed``: the weight Parameter is stored ``[in, out]`` (a converted
    ``transformers`` ``Conv1D``, whose Parameter and checkpoint layout are kept); the GEMM
    reads it as ``[out, in]`` through :meth:`gemm_weight`.
    """

    weight_transposed = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: Recipe | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe)

    def _init_fp8(self, recipe: Recipe | None) -> None:
        self.recipe = recipe if recipe is not None else DelayedScaling()
        self._formats = (self.recipe.forward_format, self.recipe.backward_format)  # looked up once
        dev = self.weight.device
        self._current_gradient = isinstance(self.recipe, CurrentScaling)
        # block-scaled recipes (MXFP8, Float8BlockScaling) keep no state: every block from its own amax
        self.block_scaled = isinstance(self.recipe, BLOCK_RECIPES)
        states = (None, None, None) if self.block_scaled else (
            ScalingState(self.recipe, self.recipe.forward_format, dev),
            ScalingState(self.recipe, self.recipe.forward_format, dev),
            ScalingState(self.recipe, self.recipe.backward_format, dev))
        self.activation_state, self.weight_state, self.gradient_state = states
        self.join_update_group(UpdateGroup())
        self.fp8_enabled = True
        self.fp8scope_tap: Tap | None = None
        # the monitor's hook: monitor(role, x, deq, amax, scale, scale_inv, expected_amax, fmt, grad_enabled)
        # eagerly, or under torch.compile the ids of its graph taps per (role, grad_enabled)
        self.fp8scope_monitor: Callable | None = None
        self.fp8scope_monitor_taps: dict | None = None
        self._tap_warned = False
        self.prepare_compile()

    @classmethod
    def from_linear(cls, linear: nn.Module, recipe: Recipe | None = None) -> "Fp8Linear":
        """Wrap the layer's own Parameter objects, so an existing optimizer keeps working.

        ``linear``: an ``nn.Linear`` or a ``transformers`` ``Conv1D`` (its ``[in, out]`` weight is
        kept as it is stored; see ``weight_transposed``)."""
        from fp8scope.linear_like import linear_kind

        kind = linear_kind(linear)
        if kind is None or not kind.convertible:
            raise TypeError(f"expected an nn.Linear or a transformers Conv1D, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight_transposed = kind.layout == "in_out"
        new.in_features, new.out_features = kind.weight(linear).shape[1], kind.weight(linear).shape[0]
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.train(linear.training)
        new._init_fp8(recipe)
        return new

    def gemm_weight(self) -> torch.Tensor:
        """The weight as the GEMM reads it, ``[out, in]`` (a view of the Parameter)."""
        return self.weight.t() if self.weight_transposed else self.weight

    def scaling_state(self, role: str) -> ScalingState | None:
        """The state for ``role`` in ("activation", "weight", "gradient"); None under a block-scaled
        recipe, which keeps none."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return getattr(self, f"{role}_state")

    def join_update_group(self, group: UpdateGroup) -> None:
        """Have this layer's states updated together with the other states of ``group`` (a model's
        layers: ``convert_to_fp8`` does it; see :class:`~fp8scope.emulate.scaling.UpdateGroup`)."""
        for state in self._states():
            group.join(state)

    def reset_scaling(self) -> None:
        """Forget all amax history and scales (e.g. after loading new weights)."""
        for state in self._states():
            state.reset()

    def _states(self) -> list[ScalingState]:
        """The layer's scaling states (none under a block-scaled recipe)."""
        return [s for s in (self.activation_state, self.weight_state, self.gradient_state) if s is not None]

    def _emit(self, role: str, x: torch.Tensor, deq: torch.Tensor, amax: torch.Tensor, s: Scales,
              fmt: Fp8Format, grad: bool, original: torch.Tensor | None = None) -> None:
        if torch.compiler.is_compiling():
            taps = self.fp8scope_monitor_taps
            if taps is not None:  # one opaque op in the graph; the monitor's Python runs at run time
                from fp8scope.graph_taps import observe

                observe(taps[(role, grad)], x, deq, amax, s.scale, s.scale_inv, s.expected_amax)
            return
        monitor, tap = self.fp8scope_monitor, self.fp8scope_tap
        if monitor is None and tap is None:
            return
        try:  # x detached (forward) or a gradient: nothing the tap does is recorded by autograd
            if monitor is not None:
                monitor(role, x, deq, amax, s.scale, s.scale_inv, s.expected_amax, fmt, grad, original)
            if tap is not None:
                tap(role, x, deq, s.scale, s.scale_inv, s.expected_amax, fmt)
        except Exception as exc:  # noqa: BLE001 - a monitoring bug must not stop training
            if not self._tap_warned:
                self._tap_warned = True
                warnings.warn(
                    f"fp8scope tap on {self.__class__.__name__} raised {exc!r}; "
                    "ignoring tap errors on this layer from now on",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _emit_blocks(self, role: str, x2d: torch.Tensor, blocks, deq_blocks: torch.Tensor, grad: bool) -> None:
        """Report a block-scaled operand: its blocks, their dequantized values and per-block scales."""
        if self.fp8scope_monitor is None and self.fp8scope_tap is None:
            return
        from .block_linear import block_scales

        amax, scales = block_scales(x2d, blocks)
        fmt = self._formats[1] if role == "gradient" else self._formats[0]
        self._emit(role, blocks.x, deq_blocks, amax, scales, fmt, grad, original=x2d)

    def _gradient_done(self, grad_out: torch.Tensor, g_deq: torch.Tensor, scale: torch.Tensor,
                       scale_inv: torch.Tensor, expected: torch.Tensor, pair=None) -> None:
        """Backward: the gradient was quantized with the scales prepared at forward time (or, under current
        scaling, from its own amax ``pair``, already measured); record its amax for the next update and
        report it. Under torch.compile this runs as one opaque op. Its amaxes are measured in the
        graph where they are already (current scaling) or where the traced pair is an accelerator's
        fused one (``amax.fused_when_traced``): its two launches in the graph, where the op's Python
        made a compiled call of its own. On the CPU the op measures them eagerly, faster there."""
        if torch.compiler.is_compiling():
            from fp8scope.graph_taps import observe_in_backward

            if pair is None and fused_when_traced(grad_out.device):
                pair = amax_pair(grad_out)
            observe_in_backward(self._gradient_tap(), grad_out, g_deq, scale, scale_inv, expected, *(pair or ()))
            return
        if pair is None:
            pair = amax_pair(grad_out)
        self._record_gradient(grad_out, g_deq, scale, scale_inv, expected, *pair)

    def _record_gradient_from_graph(self, grad_out, g_deq, *values) -> None:
        """The compiled backward's tap: :meth:`_record_gradient` on a copy of the graph's values (the
        scales, and the amaxes where the graph measured them; one stack). They may be the graph's
        intermediates, whose memory inductor hands to later values once the op has read them (its
        plan knows no reader after the call), while the state keeps the recorded amax for its next
        update and the monitor the row until the step ends: without the copy, a compiled backward
        under current scaling logged other layers' scales in its gradient rows."""
        kept = torch.stack(values).unbind()
        if len(kept) == 3:  # the amaxes are measured here (see _gradient_done)
            kept += amax_pair(grad_out)
        self._record_gradient(grad_out, g_deq, *kept)

    def _record_gradient(self, grad_out, g_deq, scale, scale_inv, expected, logged, recorded) -> None:
        state = self.gradient_state
        state.observe(logged, recorded)
        self._emit("gradient", grad_out, g_deq, logged, Scales(scale, scale_inv, expected), self._formats[1], True)

    def _gradient_tap(self) -> int:
        if self.__dict__.get("_gradient_tap_for") != id(self):  # a copy never run eagerly
            raise RuntimeError("this Fp8Linear is a copy: call layer.prepare_compile() before compiling it")
        return self.__dict__["_gradient_tap_id"]

    def prepare_compile(self) -> None:
        """Register the graph tap through which a compiled backward records the gradient's amax
        (outside compiled code: at construction, and again for a copy at its first eager forward)."""
        if self.__dict__.get("_gradient_tap_for") != id(self):
            from fp8scope.graph_taps import register

            self.__dict__["_gradient_tap_id"] = register(self._record_gradient_from_graph)
            self.__dict__["_gradient_tap_for"] = id(self)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled or fp8_globally_disabled():
            return F.linear(input, self.gemm_weight(), self.bias)
        if not torch.compiler.is_compiling():
            self.prepare_compile()  # a no-op but for a copy's first forward
        out_dtype = _autocast_dtype(input)
        if self.block_scaled:
            from .block_linear import block_forward

            return block_forward(self, input, out_dtype)
        grad = torch.is_grad_enabled()
        eager = not torch.compiler.is_compiling()
        # a forward re-run inside backward (activation checkpointing) uses the scales of its first
        # run and records nothing (TE's recompute buffers); no update can have run in between
        recompute = eager and in_backward()
        region = eager and region_open()
        due = grad and not region  # see autocast.py: when a forward's update falls due
        with autocast_off(input.device.type):
            fmt = self._formats[0]
            x = input.detach()
            w = self.gemm_weight().detach()
            if recompute:
                s_x, s_w = self.activation_state.peek(x), self.weight_state.peek(w)
            else:
                s_x, s_w = self.activation_state.begin(x, True, due), self.weight_state.begin(w, True, due)
                if region:
                    note_recorded(self.activation_state)
                    note_recorded(self.weight_state)
            _, x_deq = quantize_dequantize(x, s_x.scale, s_x.scale_inv, fmt)
            _, w_deq = quantize_dequantize(w, s_w.scale, s_w.scale_inv, fmt)
            # the gradient's scales are known now (delayed: from the amaxes recorded so far), so the
            # backward reads no state: TE's order for a forward followed by its backward
            # (a re-run applies its own due update only: the others' may be this backward's records)
            s_g = self.gradient_state.prepare(alone=recompute, device=x.device) if grad else None
            # the monitor last, after both round trips and the gradient's update: compiled, a call
            # between them is an opaque op that inductor orders its kernels around, splitting them
            # into kernels of their own
            self._emit("activation", x, x_deq, self.activation_state.last_amax, s_x, fmt, grad)
            self._emit("weight", w, w_deq, self.weight_state.last_amax, s_w, fmt, grad)
        if s_g is None:  # no backward can follow: no autograd Function needed
            return F.linear(x_deq, w_deq, None if self.bias is None else self.bias.to(torch.float32)).to(out_dtype)
        return _Fp8LinearFn.apply(input, self.weight, self.bias, x_deq, w_deq, s_g.scale, s_g.scale_inv,
                                  s_g.expected_amax, self, out_dtype)

    # ---- checkpoints ---------------------------------------------------------------------
    def get_extra_state(self) -> torch.Tensor:
        """The scaling state a checkpoint keeps, as TE's modules keep theirs (``get_extra_state`` in
        ``pytorch/module/base.py``: the scales and amax histories of the forward and backward
        tensors, v2.0 to 2.18 alike), so that a resumed run quantizes its first steps with the
        scales it had rather than with scale 1: one float32 tensor, a row per role (activation,
        weight, gradient) of :meth:`ScalingState.state_tensor`. Empty where the recipe keeps no
        state between steps (current and block scaling), as TE's is."""
        states = self._states()
        if not states or not states[0].delayed:
            return torch.empty(0)
        return torch.stack([s.state_tensor() for s in states])

    def set_extra_state(self, state) -> None:
        """Restore :meth:`get_extra_state`'s tensor (see :meth:`ScalingState.load_state_tensor`). An
        empty one, or one saved under a recipe that keeps no state, leaves the state as it is."""
        states = self._states()
        if not isinstance(state, torch.Tensor) or state.numel() == 0 or not states or not states[0].delayed:
            return
        if state.dim() != 2 or state.shape[0] != len(states) or state.shape[1] < 3 or not state.is_floating_point():
            te = " (Transformer Engine's pickled extra state is not read)" if state.dtype == torch.uint8 else ""
            raise ValueError(f"an Fp8Linear's scaling state is a float [{len(states)}, 2 + amax_history_len] tensor, "
                             f"got {str(state.dtype).removeprefix('torch.')} of shape {list(state.shape)}{te}")
        for s, row in zip(states, state):
            s.load_state_tensor(row)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """A checkpoint of the ``nn.Linear`` this layer replaced (pretrained weights) has no scaling
        state: it loads under ``strict=True`` too, and the state stays as it is (as TE's when a
        checkpoint holds none)."""
        key = prefix + "_extra_state"
        had = key in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if not had and key in missing_keys:
            missing_keys.remove(key)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe!r}"
