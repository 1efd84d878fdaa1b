"""Capture inside a ``torch.compile``'d model without graph breaks.

Dynamo traces a compiled model's module hooks into its graph. The monitor's bookkeeping (rows
appended to the step's list, a what-if bank's slots, a key made on first sight) is Python state
that changes every step: traced, it would break the graph or re-specialise it on every step,
and inside an autograd Function or a tensor hook dynamo refuses side effects outright.

So under compilation a hook hands its tensors to one opaque op, ``fp8scope::observe``, and a
layer's output goes through :class:`GradObserver`, an identity (a view) whose backward hands the
gradient to its twin, ``fp8scope::observe_grad``. Dynamo and inductor keep both as calls in the
graph and never look inside; at run time they call the tap registered under the id they carry, the
same Python capture code that eager hooks run, so compiled and eager runs log the same rows.

Neither returns anything, so each must say why it is not dead code. ``observe`` declares a write
to a one-element sink tensor. A backward cannot write the sink: it would take it from its forward,
saved there as an input of the graph, and autograd checks a saved tensor's version when the
backward runs. Any other graph that wrote the sink in between (the rest of the forward after a
graph break, the next block of a model compiled block by block, another micro-batch's forward)
failed the user's backward ("modified by an inplace operation"). So ``observe_grad`` is registered
as a side effect (``torch.fx.node.has_side_effect``), which FX's dead-code elimination and
inductor's scheduler both keep, and which costs no kernel. It was an ordered effect before
(``torch.library``'s effect types: AOT autograd threads a token through a graph's effectful
calls), which works too, but inductor's FX graph cache refuses every graph holding one ("Can't
cache HigherOrderOperator: with_effects"): each process recompiled every monitored backward, and an
emulated model's backward, from scratch (docs/benchmarks.md). A torch whose inductor does not keep
a side effect keeps the ordered effect. The forward keeps the sink: as effects, its taps cut
inductor's fused kernels apart (the 1-layer emulated model of ``tests/test_compile_mode.py``
compiled to 18 kernels a step where the unmonitored one has 13 and the sink's form 14). A sink
made fresh for each call is dead code to the compiler, taps and all. Values the tap needs that the
graph computes (an emulated layer's scales) travel as the op's tensor arguments: the Python
attributes the graph writes are only updated after the graph has run.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable

import torch
import torch.fx.node

_TAPS: list = []  # tap id -> the callable, or a weak reference to a bound method
_SINK = torch.zeros(1)


def register(tap: Callable[..., None]) -> int:
    """Register ``tap(*tensors)`` (called eagerly, at run time) and return its id. Call it outside
    compiled code (at attach time). A bound method is held weakly: registering a layer's method
    does not keep the layer alive. A tap may read its tensors during the call, not keep them past
    it: they may be the graph's intermediates, whose memory inductor gives to later values once
    the op has run; a tap that keeps a value keeps a copy (``Fp8Linear._record_gradient_from_graph``)."""
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
_LIB.define("observe_grad(Tensor[] xs, int tap) -> ()")
_LIB.impl("observe_grad", lambda xs, tap: _observe(xs, None, tap), "CompositeExplicitAutograd")
torch.library.register_fake("fp8scope::observe_grad", lib=_LIB)(lambda xs, tap: None)
observe_grad_op = torch.ops.fp8scope.observe_grad.default


def _side_effect(op) -> bool:
    """Register ``op`` with ``torch.fx.node.has_side_effect`` where both of torch's dead-code
    eliminations honour it: FX's always has, inductor's scheduler since it asks
    ``torch._library.utils.is_impure`` (pytorch#169141, late 2025; before, inductor dropped an op
    that FX had kept). Checked by that function's answer, and only from torch 2.11, the first
    release sure to hold the change (2.13 is the one tested here)."""
    side_effect = getattr(torch.fx.node, "has_side_effect", None)
    if side_effect is None or torch.torch_version.TorchVersion(torch.__version__) < (2, 11):
        return False
    try:
        from torch._library.utils import is_impure
    except ImportError:
        return False
    side_effect(op)
    return bool(is_impure(op))


def _keep_in_graphs(op) -> str | None:
    """Tell the compiler to keep ``op``, which returns nothing: as a side effect (:func:`_side_effect`:
    graphs stay cacheable), else as an ordered effect through ``torch.library``
    (``_register_effectful_op``, with its ``EffectType``), where an effect in a backward graph is
    known to compile (``tests/test_compile_mode.py``). Earlier releases have effects only in the
    private ``torch._higher_order_ops.effects``, whose effects in a backward graph no test here has
    compiled: there the backward's taps keep the sink's form (None; see :data:`GRAD_KEPT_AS`)."""
    if _side_effect(op):
        return "side effect"
    register, effect = getattr(torch.library, "_register_effectful_op", None), getattr(torch.library, "EffectType", None)
    if register is None or effect is None:
        return None
    register(op, effect.ORDERED, lib=_LIB)
    return "ordered effect"


GRAD_KEPT_AS = _keep_in_graphs(observe_grad_op)
"""How this torch keeps ``observe_grad``: "side effect", "ordered effect", or None where it can do
neither. Then the compiler would drop every call (it returns nothing), so a backward's taps write
the shared sink as they did before, which holds for a model that compiles to one graph (an emulated
layer's gradient amax feeds its scaling: it must not be dropped), and the monitor says so once
(``fp8scope.monitor``)."""


def observe(tap: int, *xs: torch.Tensor) -> None:
    """Hand ``xs`` to tap ``tap``: one opaque call in the graph (from a forward)."""
    observe_op(list(xs), _SINK, tap)


def observe_in_backward(tap: int, *xs: torch.Tensor) -> None:
    """:func:`observe` from a backward (see the module's docstring for why it is another op)."""
    if GRAD_KEPT_AS is not None:
        observe_grad_op(list(xs), tap)
    else:
        observe_op(list(xs), _SINK, tap)


class GradObserver(torch.autograd.Function):
    """``x`` unchanged (a view); its gradient goes to tap ``tap`` when autograd computes it, followed
    by the forward's ``context`` tensors (a MoE GEMM's routing, which says whose rows are whose)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tap: int, *context: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.tap = tap
        ctx.save_for_backward(*context)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        context = ctx.saved_tensors
        observe_in_backward(ctx.tap, grad, *context)
        return (grad, None, *(None for _ in context))
