"""Capture inside a ``torch.compile``'d model without graph breaks.

Dynamo traces a compiled model's module hooks into its graph. The monitor's bookkeeping (rows
appended to the step's list, a what-if bank's slots, a key made on first sight) is Python state
that changes every step: traced, it would break the graph or re-specialise it on every step,
and inside an autograd Function or a tensor hook dynamo refuses side effects outright.

So under compilation a hook hands its tensors to one opaque op, ``fp8scope::observe``, and a
layer's output goes through :class:`GradObserver`, an identity (a view) whose backward hands the
gradient to the same op. Dynamo and inductor keep the op as a call in the graph (it declares a
write to a one-element sink tensor, so it is never dead code) and never look inside; at run time
it calls the tap registered under its id, the same Python capture code that eager hooks run, so
compiled and eager runs log the same rows. Values the tap needs that the graph computes (an
emulated layer's scales) travel as the op's tensor arguments: the Python attributes the graph
writes are only updated after the graph has run.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable

import torch

_TAPS: list = []  # tap id -> the callable, or a weak reference to a bound method
_SINK = torch.zeros(1)


def register(tap: Callable[..., None]) -> int:
    """Register ``tap(*tensors)`` (called eagerly, at run time) and return its id. Call it outside
    compiled code (at attach time). A bound method is held weakly: registering a layer's method
    does not keep the layer alive."""
    _TAPS.append(weakref.WeakMethod(tap) if inspect.ismethod(tap) else tap)
    return len(_TAPS) - 1


def unregister(tap: int) -> None:
    """Drop tap ``tap`` (its monitor detached): a graph still calling it does nothing."""
    _TAPS[tap] = None


def _observe(xs: list[torch.Tensor], sink: torch.Tensor, tap: int) -> None:
    fn = _TAPS[tap]
    if isinstance(fn, weakref.WeakMethod):
        fn = fn()
    if fn is not None:  # None: unregistered, or its owner is gone
        fn(*xs)


# Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: the op is called once
# per captured tensor per step from compiled code, and custom_op's Python wrapper costs several times
# the dispatcher's own call (``benchmarks/capture_cost.py`` counts the taps a compiled step makes).
_LIB = torch.library.Library("fp8scope", "DEF")
_LIB.define("observe(Tensor[] xs, Tensor(a!) sink, int tap) -> ()")
_LIB.impl("observe", _observe, "CompositeExplicitAutograd")
torch.library.register_fake("fp8scope::observe", lib=_LIB)(lambda xs, sink, tap: None)
observe_op = torch.ops.fp8scope.observe.default


def observe(tap: int, *xs: torch.Tensor) -> None:
    """Hand ``xs`` to tap ``tap``: one opaque call in the graph."""
    observe_op(list(xs), _SINK, tap)


class GradObserver(torch.autograd.Function):
    """``x`` unchanged (a view); its gradient goes to tap ``tap`` when autograd computes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tap: int) -> torch.Tensor:  # type: ignore[override]
        ctx.tap = tap
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        observe_op([grad], _SINK, ctx.tap)
        return grad, None
