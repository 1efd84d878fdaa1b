"""What every adapter shares: the sink it reports to, the hook guard, and the gradient hook.

An adapter is a class with static methods (see :class:`Adapter`); ``capture.adapters`` lists them
in the order they are asked to claim a module.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol

import torch
from torch import nn

from fp8scope.formats import Fp8Format


class Sink(Protocol):
    """What adapters report to (implemented by ``collector.StepCollector``)."""

    def wants(self, role: str, grad_enabled: bool | None = None) -> bool: ...

    def fail(self, exc: BaseException) -> None: ...

    def warn(self, key: str, message: str) -> None: ...

    def note_recipe(self, recipe: dict) -> None: ...

    def layer_recipe(self, layer: str, kind: str) -> None: ...

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
        amax: torch.Tensor | None = None,
        original: torch.Tensor | None = None,
    ) -> Any: ...

    def record_values(self, layer: str, role: str, source: str, fmt: Fp8Format, x: torch.Tensor,
                      values: tuple) -> None: ...

    def record_amax(self, layer: str, role: str, source: str, fmt: Fp8Format, amax: Any, scale: Any,
                    scale_inv: Any, expected_amax: Any, shape: tuple[int, ...] = ()) -> None: ...

    def key_id(self, layer: str, role: str, source: str, fmt: Fp8Format, shape: tuple[int, ...]) -> int: ...

    def device_bank(self, recipe: Any, device: torch.device) -> Any: ...

    def record_deferred(self, role: str, row: Any, kid: int, numel: int) -> None: ...

    def record_rows(self, role: str, rows: Any, kids: list[int]) -> None: ...

    full: bool  # this step takes full stats
    focus: frozenset  # on a cheap step, the layers that take full stats (a closer look)
    active: bool  # this step is captured at all
    roles: frozenset  # the tensor roles captured
    capture_no_grad: bool  # forwards under no_grad are captured too
    traced_layers: set  # layers that ran traced where their adapter reads eager forwards only
    # (layer, role) -> the delayed-scaling state a resumed run's what-if tensor starts from
    # (fp8scope.resume); a slot takes its entry when it is made
    resumed: dict


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


def first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


class GradHook:
    """Calls ``on_grad(grad_output)`` when autograd computes the gradient of a layer's output; made
    once per layer (at attach time) and :meth:`attach`-ed to each forward's output.

    A pre-hook on the autograd node that made the output, which sees the gradient as that node's
    backward receives it (after any tensor hook of the user's); registering it is cheaper than
    ``Tensor.register_hook`` (no handle dict, no Python-side checks), and one is kept per
    ``output_nr`` and reused. Eager only: under torch.compile the adapters route gradients through
    ``graph_taps.GradObserver`` instead."""

    def __init__(self, on_grad: Callable[[torch.Tensor], None]):
        self.on_grad = on_grad
        self._pre: dict[int, Callable] = {}

    def attach(self, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return
        node, nr = out.grad_fn, out.output_nr
        if node is None:  # a leaf (cannot come out of a layer, but hook it the tensor way if it does)
            out.register_hook(lambda grad: self.on_grad(grad) and None)
            return
        pre = self._pre.get(nr)
        if pre is None:
            on_grad = self.on_grad

            def pre(grads: tuple) -> None:  # returning None leaves the gradients untouched
                grad = grads[nr]
                if grad is not None:
                    on_grad(grad)

            self._pre[nr] = pre
        node.register_prehook(pre)




class Adapter:
    """One framework's FP8 layers: how to find them, watch them, switch FP8 off, and make a plain
    replica. The monitor asks ``claims`` and ``attach``; the shadow asks the other four, so that it
    knows no framework itself. Each adapter subclasses this and overrides what its framework needs;
    the defaults fit a layer whose weights are its matrices and whose FP8 needs no switching."""

    name: str  # the rows' ``source``

    @staticmethod
    def claims(module: nn.Module) -> bool:
        raise NotImplementedError

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        raise NotImplementedError

    @staticmethod
    def weights(module: nn.Module) -> list[nn.Parameter]:
        """The weight matrices the layer's GEMMs multiply by."""
        return matrix_weights(module)

    @staticmethod
    def high_precision(model: nn.Module) -> AbstractContextManager | None:
        """A context in which this adapter's layers in ``model`` run without FP8 and leave their FP8
        state untouched; None when nothing needs switching."""
        return None

    @staticmethod
    def make_plain(module: nn.Module) -> None:
        """Switch FP8 off for good in a replica's module (its state is the replica's own)."""
        return None

    @staticmethod
    def plain_context(model: nn.Module) -> AbstractContextManager | None:
        """A context a replica ``model`` runs its passes in, for frameworks whose FP8 is switched off
        per pass (TE); None for the others."""
        return None


def matrix_weights(module: nn.Module) -> list[nn.Parameter]:
    """The module's own trainable weight matrices (``weight``, ``fc1_weight``, ``query_weight``...),
    not norms or biases: what a layer's GEMMs multiply by."""
    return [p for name, p in module.named_parameters(recurse=False)
            if p.requires_grad and p.dim() >= 2 and name.endswith("weight")]
