"""Any other linear-like layer in BF16/FP32 (``fp8scope.linear_like``: ``nn.Linear``,
``transformers``' ``Conv1D``, tensor-parallel wrappers): the chosen recipe is simulated on the real
tensors, so the stats say what FP8 *would* do, and nothing changes. Delayed scaling lives in the
collector's shared :class:`~fp8scope.emulate.device_bank.DeviceDelayedBank` per device; other
recipes keep a :class:`~fp8scope.emulate.ScalingState` per tensor."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from fp8scope.capture.adapters.base import Adapter, GradHook, Handle, Sink, first_tensor, guarded
from fp8scope.formats import recipe_format
from fp8scope.linear_like import LinearKind, linear_kind, output_tensor, replace_output


class WhatIfSource(Adapter):
    """Any other linear-like layer (``fp8scope.linear_like``: ``nn.Linear``, ``transformers``'
    ``Conv1D``, tensor-parallel wrappers, registered classes): simulate the recipe on the real
    tensors, change nothing. Weights are read as ``[out, in]`` whatever the layer stores."""

    name = "whatif"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        return linear_kind(module) is not None

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        tap = _WhatIfTap(layer, sink, recipe, linear_kind(module))
        handle = module.register_forward_hook(tap.forward_hook)
        return lambda: (handle.remove(), tap.unregister()) and None


class _WhatIfTap:
    """One plain Linear's what-if capture, from a single forward hook: the activation, weight
    (and output) when the layer has run, then a pre-hook on the output's autograd node for the
    gradient.

    Delayed scaling lives in the collector's shared
    :class:`~fp8scope.emulate.device_bank.DeviceDelayedBank` of the tensor's device: a cheap
    step's capture is one fused amax pass, and the step's rows and updates are resolved together
    when it ends. Current scaling keeps a :class:`~fp8scope.emulate.ScalingState` per tensor (its
    scale comes from the tensor itself)."""

    def __init__(self, layer: str, sink: Sink, recipe: Any, kind: LinearKind, traced: bool = True):
        from fp8scope.emulate import DelayedScaling

        self.layer, self.sink, self.recipe, self.kind = layer, sink, recipe, kind
        if isinstance(recipe_kind := getattr(recipe, "kind", None), str):  # its rows are the simulated recipe's
            sink.layer_recipe(layer, recipe_kind)
        fwd, bwd = recipe_format(recipe.fp8_format, "forward"), recipe_format(recipe.fp8_format, "backward")
        self.fmts = {"activation": fwd, "weight": fwd, "output": fwd, "gradient": bwd}
        self.delayed = isinstance(recipe, DelayedScaling)
        self.slots: dict[str, tuple[Any, int, int]] = {}  # role -> (DeviceDelayedBank, slot, key id)
        self.states: dict[str, Any] = {}  # role -> ScalingState (current scaling)
        self._grad_hook = GradHook(self._on_grad)
        from fp8scope import graph_taps

        # under torch.compile the hook hands its tensors to these taps (see graph_taps): one per
        # role, and one taking the forward's tensors in one call of the op (each call is a dispatch);
        # each for a training forward and for one under no_grad, as traced: a compiled forward runs
        # its graph with grad off, so the tap cannot ask (the weights' batched read is for training)
        self._forward_roles = tuple(r for r in ("activation", "weight", "output") if r in sink.roles)
        self._graph_taps = {}
        for training in ((True, False) if traced else ()):  # traced=False: a GEMM no compiled graph calls
            for role in (*self.fmts, "forward"):
                roles = self._forward_roles if role == "forward" else role
                self._graph_taps[role, training] = graph_taps.register(
                    guarded(sink, partial(self._graph_capture, roles, training)))

    def __deepcopy__(self, memo: dict) -> "_WhatIfTap":
        # A copy of the model (a shadow fork's replica, the user's deepcopy) keeps the hook as it
        # would keep a function: the same tap, not a copy of the monitor behind it.
        return self

    def unregister(self) -> None:
        from fp8scope import graph_taps

        for tap in self._graph_taps.values():
            graph_taps.unregister(tap)

    def _graph_capture(self, roles: str | tuple[str, ...], training: bool, *tensors: torch.Tensor) -> None:
        """Run by the compiled graph's op: one role's tensor, or the forward's tensors in
        ``_forward_roles`` order; ``training``: the forward was traced with grad on."""
        if self.sink.active:
            for role, x in zip((roles,) if isinstance(roles, str) else roles, tensors):
                self.capture(role, x, training)

    def traced_hook(self, mod, args, output):
        """The forward hook as dynamo traces it: the tensors go to the graph taps, whose Python runs
        when the graph runs (nothing here depends on the step). Grad mode is read now: dynamo guards
        on it, and a compiled forward runs its graph with grad off."""
        from fp8scope.graph_taps import GradObserver, observe

        training = torch.is_grad_enabled()
        taps = {role: tap for (role, t), tap in self._graph_taps.items() if t == training}
        if self._forward_roles and (self.sink.capture_no_grad or training):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else first_tensor(args)
            by_role = {"activation": x, "weight": self.kind.weight(mod, x), "output": output_tensor(output)}
            tensors = [by_role[role] for role in self._forward_roles]
            if all(isinstance(t, torch.Tensor) for t in tensors):
                observe(taps["forward"], *tensors)
            else:  # an input, weight or output that is not one tensor: role by role
                for role, t in zip(self._forward_roles, tensors):
                    if isinstance(t, torch.Tensor):
                        observe(taps[role], t)
        out = output_tensor(output)
        if "gradient" in self.sink.roles and out is not None and out.requires_grad:
            return replace_output(output, GradObserver.apply(out, self._graph_taps["gradient", True]))
        return None

    def forward_hook(self, mod, args, output):
        if torch.compiler.is_compiling():
            return self.traced_hook(mod, args, output)
        sink = self.sink
        if not sink.active:
            return
        try:
            roles = sink.roles
            if sink.capture_no_grad or torch.is_grad_enabled():
                x = args[0] if args and isinstance(args[0], torch.Tensor) else first_tensor(args)
                if x is not None and "activation" in roles:
                    self.capture("activation", x)
                if "weight" in roles:
                    w = self.kind.weight(mod, x)
                    if w is not None:
                        self.capture("weight", w)
                out = output_tensor(output) if "output" in roles else None
                if out is not None:
                    self.capture("output", out)
            if "gradient" in roles:
                self._grad_hook.attach(output)
        except Exception as exc:  # a monitor problem must not reach training
            sink.fail(exc)

    def _on_grad(self, grad: torch.Tensor) -> None:
        sink = self.sink
        if not sink.active:
            return
        try:
            self.capture("gradient", grad)
        except Exception as exc:
            sink.fail(exc)

    def slot(self, role: str, device: torch.device, shape: tuple[int, ...]) -> tuple[Any, int, int]:
        """``(bank, slot, key id)`` of ``role``'s delayed-scaling state on ``device`` (the tensor's
        ``shape`` names the key): made at the first capture, and again when the model moved."""
        slot = self.slots.get(role)
        if slot is None or slot[0].device != device:  # first capture, or the model moved
            bank = self.sink.device_bank(self.recipe, device)
            kid = self.sink.key_id(self.layer, role, "whatif", self.fmts[role], tuple(shape))
            # a resumed run's tensor starts where the run left it (fp8scope.resume), if its format is
            # the one logged
            resumed = None if slot else self.sink.resumed.pop((self.layer, role), None)
            state = resumed[1:] if resumed is not None and resumed[0] == self.fmts[role].name else None
            slot = self.slots[role] = (bank, bank.add(self.fmts[role], like=slot[:2] if slot else None, state=state),
                                       kid)
        return slot

    def capture(self, role: str, x: torch.Tensor, training: bool | None = None) -> None:
        """``training``: ``x`` is from a forward with grad on (None: ask grad mode now, as an eager
        hook can)."""
        sink, layer, fmt = self.sink, self.layer, self.fmts[role]
        if not self.delayed:  # current scaling: the scale comes from this tensor's own amax
            state = self.states.get(role)
            if state is None:
                from fp8scope.emulate import ScalingState

                state = self.states[role] = ScalingState(self.recipe, fmt, device=x.device)
            scale, scale_inv, expected = state.begin(x, record=True)
            if sink.full or layer in sink.focus:
                sink.record(layer, role, "whatif", fmt, x, scale, scale_inv, expected)
            else:
                sink.record_values(layer, role, "whatif", fmt, x, state.latest())
            return
        slot = self.slots.get(role)
        if slot is None or slot[0].device != x.device:  # first capture, or the model moved
            slot = self.slot(role, x.device, x.shape)
        bank, s, kid = slot
        if sink.full or layer in sink.focus:
            # delayed scaling: the scales do not depend on this tensor, so the stats pass measures
            # its amax too and the bank records that one
            scale, scale_inv, expected = bank.scales(s)
            bank.record_amax(s, sink.record(layer, role, "whatif", fmt, x, scale, scale_inv, expected))
        else:
            weight = role == "weight" and (torch.is_grad_enabled() if training is None else training)
            sink.record_deferred(role, bank.capture(s, x, shared=role == "activation", weight=weight),
                               kid, x.numel())
