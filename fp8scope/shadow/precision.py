"""Switching a model's FP8 layers to high precision, without touching their FP8 state.

* emulated ``Fp8Linear``: ``fp8_disabled(model)``: the layer is exactly ``nn.Linear``
  and neither reads nor records amaxes.
* torchao ``Float8Linear``: its ``forward`` is overridden on the instance by
  ``F.linear(x, module.weight, module.bias)`` (torchao keeps the high-precision weight
  as the parameter; with dynamic scaling it has no state to protect). The override is
  removed on exit.
* Transformer Engine layers: ``te.fp8_autocast(enabled=False)`` around the pass
  (imported lazily, only when TE modules are present); TE then runs its GEMMs in the
  input dtype and does not update ``fp8_meta``.
"""

from __future__ import annotations

import functools
import sys
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch.nn.functional as F
from torch import nn

from fp8scope.capture.sources import (
    EmulatedSource,
    TorchaoSource,
    TransformerEngineSource,
    _te_module_classes,
    _torchao_float8_linear_cls,
    adapter_for,
)


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
    for src in (EmulatedSource, TorchaoSource, TransformerEngineSource):
        if src.claims(module):
            return src.name
    return "plain"


def layer_weights(module: nn.Module) -> list[nn.Parameter]:
    """The module's own weight matrices (``weight``; TE's ``fc1_weight``/``fc2_weight``), not norms/biases."""
    out = []
    for pname, p in module.named_parameters(recurse=False):
        if p.requires_grad and p.dim() >= 2 and pname.endswith("weight"):
            out.append(p)
    return out


def _hp_linear(module: nn.Module, x, *args, **kwargs):
    return F.linear(x, module.weight, module.bias)


def set_torchao_high_precision(module: nn.Module) -> None:
    """Permanently (for a replica) run a torchao Float8Linear as nn.Linear."""
    module.forward = functools.partial(_hp_linear, module)


@contextmanager
def high_precision(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with every FP8 layer in high precision; FP8 state is left untouched."""
    from fp8scope.emulate import fp8_disabled

    with ExitStack() as stack:
        stack.enter_context(fp8_disabled(model))
        ao = _torchao_float8_linear_cls()
        if ao is not None:
            swapped = []
            for m in model.modules():
                if isinstance(m, ao):
                    swapped.append((m, m.__dict__.get("forward")))
                    set_torchao_high_precision(m)

            def _restore() -> None:
                for m, prev in swapped:
                    if prev is None:
                        m.__dict__.pop("forward", None)
                    else:
                        m.forward = prev

            stack.callback(_restore)
        te_classes = _te_module_classes()
        if te_classes and any(isinstance(m, te_classes) for m in model.modules()):
            te = sys.modules.get("transformer_engine.pytorch")
            if te is None:
                import transformer_engine.pytorch as te  # noqa: PLC0415
            autocast = getattr(te, "fp8_autocast", None) or getattr(te, "autocast")
            stack.enter_context(autocast(enabled=False))
        yield
