"""Our emulated ``Fp8Linear`` (``fp8scope.emulate``): the layer already quantized each tensor, so
it hands the monitor the dequantized copy and the scales it used through ``fp8scope_monitor``
(eagerly a call, under ``torch.compile`` a graph tap); nothing is cast twice."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from fp8scope.capture.adapters.base import Adapter, Handle, Sink


class EmulatedSource(Adapter):
    name = "emulated"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        from fp8scope.emulate import Fp8Linear

        return isinstance(module, Fp8Linear)

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        from fp8scope import graph_taps

        fmts = {"activation": module.recipe.forward_format, "weight": module.recipe.forward_format,
                "gradient": module.recipe.backward_format}
        sink.layer_recipe(layer, module.recipe.kind)

        def monitor(role, x, deq, amax, scale, scale_inv, expected_amax, fmt, grad_enabled, original=None):
            # the layer's scaling state already computed this tensor's amax: on cheap steps the row
            # is those tensors, no op at all
            try:
                if not sink.wants(role, grad_enabled=grad_enabled):
                    return
                if sink.full or layer in sink.focus:
                    sink.record(layer, role, "emulated", fmt, x, scale, scale_inv, expected_amax, deq=deq, amax=amax,
                                original=original)
                else:
                    sink.record_values(layer, role, "emulated", fmt, x, (amax, scale, scale_inv, expected_amax))
            except Exception as exc:  # a monitor problem must not reach training (see guarded)
                sink.fail(exc)

        def graph_tap(role, grad_enabled):  # the same, run by the compiled graph's opaque op
            return lambda x, deq, amax, scale, scale_inv, expected: monitor(
                role, x, deq, amax, scale, scale_inv, expected, fmts[role], grad_enabled)

        module.fp8scope_monitor = monitor
        module.fp8scope_monitor_taps = {(role, grad): graph_taps.register(graph_tap(role, grad))
                                        for role in fmts for grad in (True, False)}

        def detach() -> None:
            if getattr(module, "fp8scope_monitor", None) is monitor:
                for tap in module.fp8scope_monitor_taps.values():
                    graph_taps.unregister(tap)
                module.fp8scope_monitor = None
                module.fp8scope_monitor_taps = None

        return detach

    @staticmethod
    def high_precision(model: nn.Module) -> AbstractContextManager | None:
        from fp8scope.emulate import fp8_disabled

        return fp8_disabled(model)

    @staticmethod
    def make_plain(module: nn.Module) -> None:
        module.fp8_enabled = False
