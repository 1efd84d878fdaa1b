"""torchao ``Float8Linear`` (dynamic scaling, tensorwise or rowwise): the scale is derived by
torchao's own ``tensor_to_amax`` / ``amax_to_scale`` with the layer's config, so it is the one
torchao uses. torchao is never imported just to look."""

from __future__ import annotations

import functools
import sys
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fp8scope.capture.adapters.base import Adapter, GradHook, Handle, Sink, first_tensor, guarded
from fp8scope.formats import format_of_dtype


def float8_linear_cls():
    """torchao's Float8Linear if torchao is already imported (never import it just to look)."""
    if "torchao" not in sys.modules:
        return None
    try:
        from torchao.float8.float8_linear import Float8Linear
    except Exception:  # torchao without float8, or broken install
        return None
    return Float8Linear


class TorchaoSource(Adapter):
    """torchao ``Float8Linear``: dynamic (current) scaling, tensorwise or rowwise.

    Each distinct cast torchao makes is one logged tensor (torchao/float8/float8_linear.py,
    ``matmul_with_hp_or_float8_args``). The output GEMM casts the input, the weight and (for
    grad_input) the output gradient: ``activation``, ``weight``, ``gradient``. The other GEMMs cast
    a role again with configs of their own (``cast_config_input_for_grad_weight``,
    ``cast_config_weight_for_grad_input``, ``cast_config_grad_output_for_grad_weight``), along the
    other axis under rowwise scaling; where that cast is a different one it is logged as
    ``activation@dim1``, ``weight@dim0`` and ``gradient@dim1``, torchao's own names for those
    casts. A cast with ``ScalingType.DISABLED`` (the high-precision weight-gradient GEMM of
    ``rowwise_with_gw_hp``) is not logged: nothing is quantized there."""

    name = "torchao"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        cls = float8_linear_cls()
        return cls is not None and isinstance(module, cls)

    @staticmethod
    def casts(cfg) -> dict[str, list[tuple[str, Any, int]]]:
        """Per role, the casts torchao makes of it: ``(logged name, cast config, axis its per-row
        scales run along on the tensor as logged)``. Weights are logged ``[out, in]``; torchao casts
        ``weight.t()``, so its axiswise dims are mirrored here."""
        from torchao.float8.config import ScalingGranularity, ScalingType

        def distinct(first, second) -> bool:
            if second is None or second.scaling_type is ScalingType.DISABLED:
                return False
            return second != first or first.scaling_granularity is ScalingGranularity.AXISWISE

        out: dict[str, list[tuple[str, Any, int]]] = {}
        for role, first, second, name in (
            ("activation", cfg.cast_config_input, cfg.cast_config_input_for_grad_weight, "activation@dim1"),
            ("weight", cfg.cast_config_weight, cfg.cast_config_weight_for_grad_input, "weight@dim0"),
            ("gradient", cfg.cast_config_grad_output, cfg.cast_config_grad_output_for_grad_weight, "gradient@dim1"),
        ):
            role_casts = [] if first.scaling_type is ScalingType.DISABLED else [(role, first, -1)]
            if distinct(first, second) or (not role_casts and second is not None
                                           and second.scaling_type is not ScalingType.DISABLED):
                role_casts.append((name, second, 0))
            out[role] = role_casts
        return out

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        cfg = module.config
        pow2 = bool(getattr(cfg, "round_scales_to_power_of_2", False))
        casts = TorchaoSource.casts(cfg)
        # the run's recipe, named as the manifest names recipes: dynamic scaling per tensor ("current")
        # or per row ("rowwise"), HYBRID when the gradients are E5M2
        grad_fmt = format_of_dtype(cfg.cast_config_grad_output.target_dtype or torch.float8_e4m3fn)
        kind = "rowwise" if cfg.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE else "current"
        sink.note_recipe({"kind": kind, "fp8_format": "HYBRID" if grad_fmt.name == "e5m2" else "E4M3"})
        sink.layer_recipe(layer, kind)

        def report(role: str, x: torch.Tensor) -> None:
            x = x.detach()
            if x.dim() > 2:
                x = x.reshape(-1, x.shape[-1])
            for name, cast_cfg, dim in casts[role]:
                dtype = cast_cfg.target_dtype or torch.float8_e4m3fn
                fmt = format_of_dtype(dtype)
                axiswise = cast_cfg.scaling_granularity is ScalingGranularity.AXISWISE
                with torch.no_grad():  # torchao's tensor_to_scale, in its two steps, to keep the amax
                    amax = tensor_to_amax(x, False, None, cast_cfg.scaling_granularity, dim if axiswise else None)
                    scale = amax_to_scale(amax, dtype, round_scales_to_power_of_2=pow2)
                # scales along dim 0 are one per column: the stats see the transposed view, one per row
                t, scale, amax = (x.t(), scale.t(), amax.t()) if axiswise and dim == 0 else (x, scale, amax)
                # the amax the scale was derived from (per row; rows keep the largest); torchao's amax
                # propagates NaN, so it is also the logged amax: a cheap row reads the tensor no more
                amax = amax.float()
                sink.record(layer, name, "torchao", fmt, t, scale, scale.reciprocal(), amax, amax=amax)

        from fp8scope import graph_taps

        def graph_tap(role: str, x: torch.Tensor) -> None:  # run by a compiled graph's opaque op (see graph_taps)
            if sink.active:
                report(role, x)

        taps = {role: graph_taps.register(guarded(sink, partial(graph_tap, role))) for role in casts}
        grad_hook = GradHook(guarded(sink, lambda g: report("gradient", g)))

        def pre_hook(mod, args):
            x = first_tensor(args)
            if torch.compiler.is_compiling():  # traced: hand the tensors over, decide when the graph runs
                if torch.is_grad_enabled() or sink.capture_no_grad:
                    if x is not None and "activation" in sink.roles:
                        graph_taps.observe(taps["activation"], x)
                    if "weight" in sink.roles:
                        graph_taps.observe(taps["weight"], mod.weight)
                return
            if x is not None and sink.wants("activation"):
                report("activation", x)
            if sink.wants("weight"):
                report("weight", mod.weight)

        def post_hook(mod, args, output):
            if torch.compiler.is_compiling():
                if "gradient" in sink.roles and isinstance(output, torch.Tensor) and output.requires_grad:
                    return graph_taps.GradObserver.apply(output, taps["gradient"])
                return None
            if sink.wants("gradient"):
                grad_hook.attach(output)

        h1 = module.register_forward_pre_hook(guarded(sink, pre_hook))
        h2 = module.register_forward_hook(guarded(sink, post_hook))
        return lambda: (h1.remove(), h2.remove(), [graph_taps.unregister(t) for t in taps.values()]) and None

    @staticmethod
    def high_precision(model: nn.Module) -> AbstractContextManager | None:
        cls = float8_linear_cls()
        layers = [m for m in model.modules() if cls is not None and isinstance(m, cls)]
        return _forward_overridden(layers) if layers else None

    @staticmethod
    def make_plain(module: nn.Module) -> None:
        module.forward = functools.partial(_hp_linear, module)



def _hp_linear(module: nn.Module, x, *args, **kwargs):
    """torchao keeps the high-precision weight as the parameter; with dynamic scaling there is no
    state to protect, so ``F.linear`` is the layer without FP8."""
    return F.linear(x, module.weight, module.bias)


@contextmanager
def _forward_overridden(layers: list[nn.Module]) -> Iterator[None]:
    """``forward`` overridden on each instance by :func:`_hp_linear`, removed on exit."""
    swapped = [(m, m.__dict__.get("forward")) for m in layers]
    for m in layers:
        TorchaoSource.make_plain(m)
    try:
        yield
    finally:
        for m, prev in swapped:
            if prev is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = prev
