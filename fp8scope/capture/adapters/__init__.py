"""Where a module's FP8 numbers come from: one adapter per framework, one file each.

- :mod:`.emulated`: our :class:`fp8scope.emulate.Fp8Linear`;
- :mod:`.torchao`: torchao ``Float8Linear``;
- :mod:`.te`: Transformer Engine modules, version by version (2.0 -> 2.20);
- :mod:`.experts`: MoE experts stored as 3-D weights (``transformers`` 5.x), each expert's GEMMs
  with the recipe simulated;
- :mod:`.whatif`: any other linear-like layer in high precision, with the recipe simulated.

The monitor walks the model and, for each selected module, takes the first adapter that claims
it (the most specific first; what-if takes any remaining linear-like layer). Every adapter
reports through the step collector (``base.Sink``) and computes nothing when it is inactive. The
shadow asks the adapters, never a framework, how to switch FP8 off (``high_precision``) and how to
make a plain replica (``make_plain``, ``plain_context``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

from torch import nn

from fp8scope.capture.adapters.base import Adapter, GradHook, Handle, Sink, first_tensor, guarded
from fp8scope.capture.adapters.emulated import EmulatedSource
from fp8scope.capture.adapters.experts import ExpertsSource
from fp8scope.capture.adapters.te import TransformerEngineSource
from fp8scope.capture.adapters.torchao import TorchaoSource
from fp8scope.capture.adapters.whatif import WhatIfSource

# Order matters: the most specific adapter first; WhatIf takes any remaining linear-like layer.
ADAPTERS: tuple[type, ...] = (EmulatedSource, TorchaoSource, TransformerEngineSource, ExpertsSource, WhatIfSource)

__all__ = ["ADAPTERS", "Adapter", "GradHook", "Handle", "Sink", "adapter_for", "first_tensor", "guarded",
           "high_precision", "make_plain", "plain_context", "EmulatedSource", "TorchaoSource",
           "TransformerEngineSource", "ExpertsSource", "WhatIfSource"]


def adapter_for(module: nn.Module):
    """The adapter that claims ``module``, or None if it is not a monitored layer type."""
    for adapter in ADAPTERS:
        if adapter.claims(module):
            return adapter
    return None


@contextmanager
def _entered(model: nn.Module, method: str) -> Iterator[None]:
    """Every adapter's ``method(model)`` context entered (None: nothing to enter)."""
    with ExitStack() as stack:
        for adapter in ADAPTERS:
            ctx = getattr(adapter, method)(model)
            if ctx is not None:
                stack.enter_context(ctx)
        yield


def high_precision(model: nn.Module):
    """Run ``model`` with every FP8 layer in high precision; FP8 state is left untouched."""
    return _entered(model, "high_precision")


def make_plain(model: nn.Module) -> None:
    """Switch FP8 off for good in every layer of ``model`` (a replica)."""
    for m in model.modules():
        adapter = adapter_for(m)
        if adapter is not None:
            adapter.make_plain(m)


def plain_context(model: nn.Module):
    """The context a plain replica's passes run in (frameworks switched off per pass)."""
    return _entered(model, "plain_context")
