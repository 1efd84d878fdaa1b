"""Which layers the shadow compares, and their weights, as the capture adapters define them.

Switching FP8 off (``high_precision``) is the adapters' job (``fp8scope.capture.adapters``): the
emulated layer is switched by flag, torchao's forward is overridden by ``F.linear`` for the pass, TE
runs under ``fp8_autocast(enabled=False)``; FP8 state is left untouched in every case.
"""

from __future__ import annotations

from torch import nn

from fp8scope.capture.adapters import WhatIfSource, adapter_for, high_precision

__all__ = ["compared_layers", "high_precision", "layer_kind", "layer_weights"]


def compared_layers(model: nn.Module, include=None, exclude=None) -> dict[str, nn.Module]:
    """Layers the shadow compares: the ones the monitor knows (emulated, torchao, TE, nn.Linear)."""
    out = {}
    for name, m in model.named_modules():
        if not name or adapter_for(m) is None:
            continue
        if include is not None and not include(name):
            continue
        if exclude is not None and exclude(name):
            continue
        out[name] = m
    return out


def layer_kind(module: nn.Module) -> str:
    """The adapter's name (``emulated``, ``torchao``, ``te``), or ``plain`` for a high-precision layer."""
    adapter = adapter_for(module)
    return "plain" if adapter is None or adapter.name == WhatIfSource.name else adapter.name  # what-if: plain, experts too


def layer_weights(module: nn.Module) -> list[nn.Parameter]:
    """The module's own weight matrices as its adapter lists them, not norms or biases."""
    adapter = adapter_for(module)
    return adapter.weights(module) if adapter is not None else []
