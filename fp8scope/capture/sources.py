"""Where a module's FP8 numbers come from: one adapter per kind of layer.

The monitor walks the model and, for each selected module, picks the first adapter
that claims it:

- ``EmulatedSource``: our :class:`fp8scope.emulate.Fp8Linear`. The layer already
  quantized the tensor, so it hands over the dequantized copy and the scales it used
  through its ``fp8scope_tap``; nothing is cast twice.
- ``TorchaoSource``: torchao ``Float8Linear`` (dynamic scaling). The scale is derived
  by torchao's own ``tensor_to_scale`` with the layer's config, so it is the one torchao
  uses (tensorwise, or per row for the rowwise recipes).
- ``TransformerEngineSource``: TE ``Linear`` / ``LayerNormLinear`` / ``LayerNormMLP``;
  delayed scaling is read from ``fp8_meta`` (../shared/fp8-reference.md §3), other
  recipes are derived from the tensor as TE's current scaling does. Imported lazily.
- ``WhatIfSource``: any other ``nn.Linear`` in BF16/FP32. A private
  :class:`~fp8scope.emulate.ScalingState` per tensor simulates the chosen recipe, so the
  stats say what FP8 *would* do to this tensor.

Every adapter reports through ``sink.record(...)`` (the step collector) and never
computes anything when the sink is inactive. Gradients (grad_output) are caught with a
hook on the module's output tensor, which fires with exactly the gradient the layer's
backward receives.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol

import torch
from torch import nn

from fp8scope.formats import Fp8Format, format_of_dtype, get_format, recipe_format


class Sink(Protocol):
    """What adapters report to (implemented by ``collector.StepCollector``)."""

    def wants(self, role: str, grad_enabled: bool | None = None) -> bool: ...

    def fail(self, exc: BaseException) -> None: ...

    def record(
        self,
        layer: str,
        role: str,
        source: str,
        fmt: Fp8Format,
        x: torch.Tensor,
        scale: Any,
        scale_inv: Any,
        expected_amax: Any,
        deq: torch.Tensor | None = None,
    ) -> None: ...


Handle = Callable[[], None]  # undoes one attachment


def guarded(sink: Sink, fn: Callable) -> Callable:
    """Wrap a hook so an error inside the monitor reaches ``sink.fail`` instead of the training loop."""

    def hook(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            sink.fail(exc)
            return None

    return hook


def _first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _hook_output_gradient(output: Any, on_grad: Callable[[torch.Tensor], None]) -> None:
    """Call ``on_grad(grad_output)`` when autograd computes the gradient of ``output``."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    if isinstance(out, torch.Tensor) and out.requires_grad:
        def _hook(grad: torch.Tensor) -> None:  # returning None leaves the gradient untouched
            on_grad(grad)

        out.register_hook(_hook)


# ---------------------------------------------------------------------------------------
class EmulatedSource:
    name = "emulated"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        from fp8scope.emulate import Fp8Linear

        return isinstance(module, Fp8Linear)

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        # The layer quantizes inside an autograd Function, where grad mode reads as off;
        # remember the caller's grad mode at module entry instead.
        called_with_grad = [True]

        def _pre(mod, args):
            called_with_grad[0] = torch.is_grad_enabled()

        def _tap(role, x, deq, scale, scale_inv, expected_amax, fmt):
            if sink.wants(role, grad_enabled=called_with_grad[0] if role != "gradient" else True):
                sink.record(layer, role, "emulated", fmt, x, scale, scale_inv, expected_amax, deq=deq)

        tap = guarded(sink, _tap)
        module.fp8scope_tap = tap
        pre = module.register_forward_pre_hook(_pre)

        def detach() -> None:
            pre.remove()
            if getattr(module, "fp8scope_tap", None) is tap:
                module.fp8scope_tap = None

        return detach


# ---------------------------------------------------------------------------------------
class WhatIfSource:
    """Plain ``nn.Linear``: simulate the recipe on the real tensors, change nothing."""

    name = "whatif"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        from fp8scope.emulate import ScalingState

        fwd_fmt = recipe_format(recipe.fp8_format, "forward")
        bwd_fmt = recipe_format(recipe.fp8_format, "backward")
        states: dict[str, ScalingState] = {}

        def report(role: str, x: torch.Tensor, fmt: Fp8Format) -> None:
            state = states.get(role)
            if state is None:
                state = states[role] = ScalingState(recipe, fmt, device=x.device)
            s = state.begin(x.detach(), record=True)
            sink.record(layer, role, "whatif", fmt, x, s.scale, s.scale_inv, s.expected_amax)

        def pre_hook(mod, args):
            x = _first_tensor(args)
            if x is not None and sink.wants("activation"):
                report("activation", x, fwd_fmt)
            if sink.wants("weight"):
                report("weight", mod.weight, fwd_fmt)

        def post_hook(mod, args, output):
            if sink.wants("output") and isinstance(output, torch.Tensor):
                report("output", output, fwd_fmt)
            if sink.wants("gradient"):
                _hook_output_gradient(output, guarded(sink, lambda g: report("gradient", g, bwd_fmt)))

        h1 = module.register_forward_pre_hook(guarded(sink, pre_hook))
        h2 = module.register_forward_hook(guarded(sink, post_hook))
        return lambda: (h1.remove(), h2.remove())


# ---------------------------------------------------------------------------------------
def _torchao_float8_linear_cls():
    """torchao's Float8Linear if torchao is already imported (never import it just to look)."""
    if "torchao" not in sys.modules:
        return None
    try:
        from torchao.float8.float8_linear import Float8Linear
    except Exception:  # torchao without float8, or broken install
        return None
    return Float8Linear


class TorchaoSource:
    """torchao ``Float8Linear``: dynamic (current) scaling, tensorwise or rowwise."""

    name = "torchao"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        cls = _torchao_float8_linear_cls()
        return cls is not None and isinstance(module, cls)

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import tensor_to_scale

        cfg = module.config
        pow2 = bool(getattr(cfg, "round_scales_to_power_of_2", False))

        def report(role: str, x: torch.Tensor, cast_cfg) -> None:
            dtype = cast_cfg.target_dtype or torch.float8_e4m3fn
            fmt = format_of_dtype(dtype)
            x = x.detach()
            if x.dim() > 2:
                x = x.reshape(-1, x.shape[-1])
            axiswise = cast_cfg.scaling_granularity is ScalingGranularity.AXISWISE
            with torch.no_grad():
                scale = tensor_to_scale(
                    x, dtype, reduce_amax=False, scaling_granularity=cast_cfg.scaling_granularity,
                    axiswise_dim=-1 if axiswise else None, round_scales_to_power_of_2=pow2,
                )
            scale_inv = scale.reciprocal()
            # The amax torchao derived the scale from (per row: the largest row amax).
            expected = fmt.max * scale_inv
            sink.record(layer, role, "torchao", fmt, x, scale, scale_inv, expected)

        def pre_hook(mod, args):
            x = _first_tensor(args)
            if x is not None and sink.wants("activation"):
                report("activation", x, cfg.cast_config_input)
            if sink.wants("weight"):
                report("weight", mod.weight, cfg.cast_config_weight)

        def post_hook(mod, args, output):
            if sink.wants("gradient"):
                _hook_output_gradient(
                    output, guarded(sink, lambda g: report("gradient", g, cfg.cast_config_grad_output))
                )

        h1 = module.register_forward_pre_hook(guarded(sink, pre_hook))
        h2 = module.register_forward_hook(guarded(sink, post_hook))
        return lambda: (h1.remove(), h2.remove())


# ---------------------------------------------------------------------------------------
_TE_CLASSES = ("Linear", "LayerNormLinear", "LayerNormMLP")


def _te_module_classes() -> tuple[type, ...]:
    if "transformer_engine" not in sys.modules:
        return ()
    try:
        import transformer_engine.pytorch as te
    except Exception:
        return ()
    return tuple(getattr(te, n) for n in _TE_CLASSES if hasattr(te, n))


class TransformerEngineSource:
    """Transformer Engine layers. Delayed scaling: scales and amaxes from ``fp8_meta``.

    Index layout (TE ``FP8FwdTensorIdx`` / ``FP8BwdTensorIdx``): forward ``3g + {0 input,
    1 weight}``, backward ``2g + 0`` for grad_output of GEMM ``g``. During the forward,
    ``amax_history[0]`` holds this step's amax and ``scale`` the scale in use.
    """

    name = "te"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        classes = _te_module_classes()
        return bool(classes) and isinstance(module, classes)

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        gemm_names = ["fc1", "fc2"] if type(module).__name__ == "LayerNormMLP" else [""]
        first_input: dict[str, torch.Tensor] = {}

        def names(g: int) -> str:
            return f"{layer}.{gemm_names[g]}" if gemm_names[g] else layer

        def delayed(meta) -> bool:
            rec = meta.get("recipe")
            return rec is not None and callable(getattr(rec, "delayed", None)) and rec.delayed()

        def margin(meta) -> float:
            return float(getattr(meta.get("recipe"), "margin", 0) or 0)

        def pre_hook(mod, args):
            x = _first_tensor(args)
            if x is not None and type(mod).__name__ == "Linear":  # GEMM input only for plain Linear
                first_input["x"] = x

        def post_hook(mod, args, output):
            meta = getattr(mod, "fp8_meta", None) or {}
            x = first_input.pop("x", None)
            if not meta or not getattr(mod, "fp8", False):
                return
            fwd_fmt = _te_format(meta, "fp8_max_fwd", "forward")
            bwd_fmt = _te_format(meta, "fp8_max_bwd", "backward")
            if delayed(meta):
                s = meta["scaling_fwd"]
                for g in range(len(gemm_names)):
                    for role, off in (("activation", 0), ("weight", 1)):
                        if not sink.wants(role):
                            continue
                        idx = 3 * g + off
                        scale = s.scale[idx]
                        expected = fwd_fmt.max / (scale * 2.0 ** margin(meta))
                        tensor = x if (role == "activation" and g == 0) else None
                        if role == "weight":
                            tensor = getattr(mod, "weight", None) if len(gemm_names) == 1 else None
                        if tensor is not None and not _is_quantized(tensor):
                            sink.record(names(g), role, "te", fwd_fmt, tensor, scale, scale.reciprocal(), expected)
                        else:  # amax only: TE recorded it in history row 0 during this forward
                            sink.record_amax(names(g), role, "te", fwd_fmt, s.amax_history[0, idx], scale,
                                             scale.reciprocal(), expected)
            if sink.wants("gradient"):
                def on_grad(grad: torch.Tensor) -> None:
                    if delayed(meta):
                        sb = meta["scaling_bwd"]
                        scale = sb.scale[2 * (len(gemm_names) - 1)]
                        expected = bwd_fmt.max / (scale * 2.0 ** margin(meta))
                        sink.record(names(len(gemm_names) - 1), "gradient", "te", bwd_fmt, grad, scale,
                                    scale.reciprocal(), expected)
                    else:  # current scaling: TE derives the scale from this tensor's amax
                        from fp8scope.emulate import CurrentScaling, ScalingState

                        st = ScalingState(CurrentScaling(), bwd_fmt, device=grad.device).begin(grad)
                        sink.record(names(len(gemm_names) - 1), "gradient", "te", bwd_fmt, grad, st.scale,
                                    st.scale_inv, st.expected_amax)

                _hook_output_gradient(output, guarded(sink, on_grad))

        h1 = module.register_forward_pre_hook(guarded(sink, pre_hook))
        h2 = module.register_forward_hook(guarded(sink, post_hook))
        return lambda: (h1.remove(), h2.remove())


def _is_quantized(t: torch.Tensor) -> bool:
    return hasattr(t, "_scale_inv") or hasattr(t, "_data") and t.dtype not in (torch.float32, torch.bfloat16)


def _te_format(meta: dict, key: str, pass_: str) -> Fp8Format:
    rec = meta.get("recipe")
    fmt_name = getattr(getattr(rec, "fp8_format", None), "name", "HYBRID")
    try:
        return recipe_format(fmt_name, pass_)
    except ValueError:
        return get_format("e4m3" if pass_ == "forward" else "e5m2")


# Order matters: the most specific adapter first; WhatIf takes any remaining nn.Linear.
ADAPTERS = (EmulatedSource, TorchaoSource, TransformerEngineSource, WhatIfSource)


def adapter_for(module: nn.Module):
    """The adapter that claims ``module``, or None if it is not a monitored layer type."""
    for adapter in ADAPTERS:
        if adapter.claims(module):
            return adapter
    return None
