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
Without grad mode (``torch.no_grad``, evaluation) the layer still quantizes
(so eval numbers are FP8 numbers) but records no amax: evaluation batches must
not move the training scales. With ``fp8_enabled = False`` or inside
``fp8_disabled()`` the layer is exactly ``nn.Linear`` and leaves its state alone.

``fp8scope_tap``, when set, is called after each quantization as
``tap(role, x, deq, scale, scale_inv, expected_amax, fmt)`` (inside the autograd Function,
where grad mode is off; ``layer.fp8_forward_grad`` says whether the latest forward was
entered with grad mode on); an exception in the tap is swallowed (with one warning per
layer) so monitoring never breaks training.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Fp8Format
from .quantize import quantize_dequantize
from .recipes import CurrentScaling, DelayedScaling
from .scaling import Scales, ScalingState

ROLES = ("activation", "weight", "gradient")

Tap = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Fp8Format], None]

# Global (per-thread) off switch used by ``fp8_disabled()``; see convert.py.
_switch = threading.local()


def fp8_globally_disabled() -> bool:
    """True inside ``fp8_disabled()`` (no model given) in this thread."""
    return getattr(_switch, "disabled", False)


def _set_globally_disabled(value: bool) -> None:
    _switch.disabled = value


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
    """Emulated FP8 GEMMs; the layer object carries the scaling states and the tap."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer: "Fp8Linear", record: bool):  # type: ignore[override]
        out_dtype = _autocast_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            fmt = layer.recipe.forward_format
            s_x = layer.activation_state.begin(x, record)
            _, x_deq = quantize_dequantize(x, s_x.scale, s_x.scale_inv, fmt)
            layer._emit("activation", x, x_deq, s_x, fmt)
            s_w = layer.weight_state.begin(weight, record)
            _, w_deq = quantize_dequantize(weight, s_w.scale, s_w.scale_inv, fmt)
            layer._emit("weight", weight, w_deq, s_w, fmt)
            out = F.linear(x_deq, w_deq, None if bias is None else bias.to(torch.float32))

        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Keep the decoded float32 operands: decoding fp8 again in backward is slow on CPU.
        ctx.save_for_backward(x_deq if need_w else None, w_deq if need_x else None)
        ctx.layer = layer
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x_deq, w_deq = ctx.saved_tensors
        layer: Fp8Linear = ctx.layer
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            fmt = layer.recipe.backward_format
            s_g = layer.gradient_state.begin(grad_out, True)
            _, g_deq = quantize_dequantize(grad_out, s_g.scale, s_g.scale_inv, fmt)
            layer._emit("gradient", grad_out, g_deq, s_g, fmt)
            if ctx.needs_input_grad[0]:
                grad_x = (g_deq @ w_deq).to(x_dtype)
            g2d = g_deq.reshape(-1, g_deq.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_w = (g2d.t() @ x_deq.reshape(-1, x_deq.shape[-1])).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                go = grad_out.reshape(-1, grad_out.shape[-1])
                grad_b = go.sum(0, dtype=torch.float32).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None


class Fp8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` with emulated FP8 (TE-faithful per-tensor scaling).

    ``recipe`` defaults to ``DelayedScaling()`` (TE defaults). Build one from an
    existing layer with :meth:`from_linear` (parameters are shared, not copied).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: DelayedScaling | CurrentScaling | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe)

    def _init_fp8(self, recipe: DelayedScaling | CurrentScaling | None) -> None:
        self.recipe = recipe if recipe is not None else DelayedScaling()
        dev = self.weight.device
        self.activation_state = ScalingState(self.recipe, self.recipe.forward_format, dev)
        self.weight_state = ScalingState(self.recipe, self.recipe.forward_format, dev)
        self.gradient_state = ScalingState(self.recipe, self.recipe.backward_format, dev)
        self.fp8_enabled = True
        self.fp8scope_tap: Tap | None = None
        self.fp8_forward_grad = True  # grad mode at the latest forward's entry (see forward)
        self._tap_warned = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: DelayedScaling | CurrentScaling | None = None) -> "Fp8Linear":
        """Wrap ``linear``'s own Parameter objects, so an existing optimizer keeps working."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.train(linear.training)
        new._init_fp8(recipe)
        return new

    def scaling_state(self, role: str) -> ScalingState:
        """The state for ``role`` in ("activation", "weight", "gradient")."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return getattr(self, f"{role}_state")

    def reset_scaling(self) -> None:
        """Forget all amax history and scales (e.g. after loading new weights)."""
        for role in ROLES:
            self.scaling_state(role).reset()

    def _emit(self, role: str, x: torch.Tensor, deq: torch.Tensor, s: Scales, fmt: Fp8Format) -> None:
        tap = self.fp8scope_tap
        if tap is None:
            return
        try:  # x as the Function received it: grad mode is off here, so nothing the tap does is recorded
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

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled or fp8_globally_disabled():
            return F.linear(input, self.weight, self.bias)
        grad = torch.is_grad_enabled()
        # Grad mode at this forward's entry, for the tap (inside the autograd Function it reads as
        # off). Written to __dict__ directly: Module.__setattr__ costs microseconds per call.
        self.__dict__["fp8_forward_grad"] = grad
        return _Fp8LinearFn.apply(input, self.weight, self.bias, self, grad)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe!r}"
