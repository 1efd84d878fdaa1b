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
- ``WhatIfSource``: any other linear-like layer in BF16/FP32 (``nn.Linear``, ``transformers``'
  ``Conv1D``, tensor-parallel wrappers: ``fp8scope.linear_like``). The chosen recipe is simulated on
  the real tensors (delayed scaling in the collector's shared
  :class:`~fp8scope.emulate.device_bank.DeviceDelayedBank` per device; other recipes in a
  :class:`~fp8scope.emulate.ScalingState` per tensor), so the stats say what FP8 *would* do.

Every adapter reports through ``sink.record(...)`` and its siblings (the step collector), and
never computes anything when the sink is inactive. Gradients (grad_output) are caught with a
hook on the module's output tensor, which fires with exactly the gradient the layer's
backward receives.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable, Protocol

import torch
from torch import nn

from fp8scope.formats import Fp8Format, format_of_dtype, get_format, recipe_format
from fp8scope.linear_like import LinearKind, linear_kind, output_tensor, replace_output


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
        amax: torch.Tensor | None = None,
    ) -> Any: ...

    def record_values(self, layer: str, role: str, source: str, fmt: Fp8Format, x: torch.Tensor,
                      values: tuple) -> None: ...

    def key_id(self, layer: str, role: str, source: str, fmt: Fp8Format, shape: tuple[int, ...]) -> int: ...

    def device_bank(self, recipe: Any, device: torch.device) -> Any: ...

    def record_deferred(self, role: str, row: Any, kid: int, numel: int) -> None: ...

    full: bool  # this step takes full stats
    active: bool  # this step is captured at all
    roles: frozenset  # the tensor roles captured
    capture_no_grad: bool  # forwards under no_grad are captured too


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


# ---------------------------------------------------------------------------------------
class EmulatedSource:
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

        def monitor(role, x, deq, amax, scale, scale_inv, expected_amax, fmt, grad_enabled):
            # the layer's scaling state already computed this tensor's amax: on cheap steps the row
            # is those tensors, no op at all
            try:
                if not sink.wants(role, grad_enabled=grad_enabled):
                    return
                if sink.full:
                    sink.record(layer, role, "emulated", fmt, x, scale, scale_inv, expected_amax, deq=deq, amax=amax)
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


# ---------------------------------------------------------------------------------------
class WhatIfSource:
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

    def __init__(self, layer: str, sink: Sink, recipe: Any, kind: LinearKind):
        from fp8scope.emulate import DelayedScaling

        self.layer, self.sink, self.recipe, self.kind = layer, sink, recipe, kind
        fwd, bwd = recipe_format(recipe.fp8_format, "forward"), recipe_format(recipe.fp8_format, "backward")
        self.fmts = {"activation": fwd, "weight": fwd, "output": fwd, "gradient": bwd}
        self.delayed = isinstance(recipe, DelayedScaling)
        self.slots: dict[str, tuple[Any, int, int]] = {}  # role -> (DeviceDelayedBank, slot, key id)
        self.states: dict[str, Any] = {}  # role -> ScalingState (current scaling)
        self._grad_hook = GradHook(self._on_grad)
        from fp8scope import graph_taps

        # under torch.compile the hook hands its tensors to these taps (see graph_taps): one per
        # role, and one taking the forward's tensors in one call of the op (each call is a dispatch)
        self._forward_roles = tuple(r for r in ("activation", "weight", "output") if r in sink.roles)
        self._graph_taps = {role: graph_taps.register(guarded(sink, partial(self._graph_capture, role)))
                            for role in self.fmts}
        self._graph_taps["forward"] = graph_taps.register(
            guarded(sink, lambda *xs: self._graph_capture(self._forward_roles, *xs)))

    def __deepcopy__(self, memo: dict) -> "_WhatIfTap":
        # A copy of the model (a shadow fork's replica, the user's deepcopy) keeps the hook as it
        # would keep a function: the same tap, not a copy of the monitor behind it.
        return self

    def unregister(self) -> None:
        from fp8scope import graph_taps

        for tap in self._graph_taps.values():
            graph_taps.unregister(tap)

    def _graph_capture(self, roles: str | tuple[str, ...], *tensors: torch.Tensor) -> None:
        """Run by the compiled graph's op: one role's tensor, or the forward's tensors in
        ``_forward_roles`` order."""
        if self.sink.active:
            for role, x in zip((roles,) if isinstance(roles, str) else roles, tensors):
                self.capture(role, x)

    def traced_hook(self, mod, args, output):
        """The forward hook as dynamo traces it: the tensors go to the graph taps, whose Python runs
        when the graph runs (nothing here depends on the step). Grad mode is read now: dynamo guards
        on it, and a compiled forward runs its graph with grad off."""
        from fp8scope.graph_taps import GradObserver, observe

        taps = self._graph_taps
        if self._forward_roles and (self.sink.capture_no_grad or torch.is_grad_enabled()):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args)
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
            return replace_output(output, GradObserver.apply(out, taps["gradient"]))
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
                x = args[0] if args and isinstance(args[0], torch.Tensor) else _first_tensor(args)
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

    def capture(self, role: str, x: torch.Tensor) -> None:
        sink, layer, fmt = self.sink, self.layer, self.fmts[role]
        if not self.delayed:  # current scaling: the scale comes from this tensor's own amax
            state = self.states.get(role)
            if state is None:
                from fp8scope.emulate import ScalingState

                state = self.states[role] = ScalingState(self.recipe, fmt, device=x.device)
            scale, scale_inv, expected = state.begin(x, record=True)
            if sink.full:
                sink.record(layer, role, "whatif", fmt, x, scale, scale_inv, expected)
            else:
                sink.record_values(layer, role, "whatif", fmt, x, state.latest())
            return
        slot = self.slots.get(role)
        if slot is None or slot[0].device != x.device:  # first capture, or the model moved
            bank = sink.device_bank(self.recipe, x.device)
            kid = sink.key_id(layer, role, "whatif", fmt, tuple(x.shape))
            slot = self.slots[role] = (bank, bank.add(fmt, like=slot[:2] if slot else None), kid)
        bank, s, kid = slot
        if sink.full:
            # delayed scaling: the scales do not depend on this tensor, so the stats pass measures
            # its amax too and the bank records that one
            scale, scale_inv, expected = bank.scales(s)
            bank.record_amax(s, sink.record(layer, role, "whatif", fmt, x, scale, scale_inv, expected))
        else:
            sink.record_deferred(role, bank.capture(s, x), kid, x.numel())


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
        cls = _torchao_float8_linear_cls()
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
            x = _first_tensor(args)
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


# ---------------------------------------------------------------------------------------
# Transformer Engine 2.x. Every attribute read below was checked against TE's source
# (transformer_engine/pytorch/module/base.py, linear.py, layernorm_linear.py,
# layernorm_mlp.py, tensor/float8_tensor.py, tensor/mxfp8_tensor.py):
#   module.fp8                        bool, FP8 on for this forward (set in init_fp8_metadata)
#   module.fp8_meta["recipe"]         the Recipe: .delayed() .float8_current_scaling() .mxfp8()
#                                     .float8_block_scaling(), .fp8_format, .margin (delayed)
#   module.fp8_meta["num_gemms"]      1 (Linear, LayerNormLinear) or 2 (LayerNormMLP: fc1, fc2)
#   module.fp8_meta["scaling_fwd"/"scaling_bwd"]  a RecipeState; DelayedScalingRecipeState
#                                     has .scale [n] and .amax_history [len, n], row 0 = this step
#   module.quantizers["scaling_fwd"/"scaling_bwd"][idx]   Float8Quantizer (delayed: .scale,
#                                     .amax views into the state) or Float8CurrentScalingQuantizer
#                                     (.scale, .amax: buffers the quantize kernel fills) or
#                                     MXFP8Quantizer / Float8BlockQuantizer (no per-tensor scale)
#   Float8Tensor._scale_inv, MXFP8Tensor._rowwise_scale_inv: scale_inv of quantized tensors
# Index layout (FP8FwdTensors / FP8BwdTensors): forward 3g + {0 input, 1 weight, 2 output},
# backward 2g + {0 grad_output, 1 grad_input}. LayerNormMLP: fc1 = GEMM 0, fc2 = GEMM 1; fc2's
# grad_output is GRAD_OUTPUT2 (index 2), fc1's GRAD_OUTPUT1 (index 0).
_TE_CLASSES = ("Linear", "LayerNormLinear", "LayerNormMLP")
_MX_BLOCK = 32  # MXFP8: one E8M0 scale per 32 consecutive values
_FP8_BLOCK = 128  # Float8BlockScaling: 1x128 tiles (activations, gradients); weights use 128x128


def _te_module_classes() -> tuple[type, ...]:
    if "transformer_engine" not in sys.modules:
        return ()
    try:
        import transformer_engine.pytorch as te
    except Exception:
        return ()
    return tuple(getattr(te, n) for n in _TE_CLASSES if hasattr(te, n))


def _te_kind(meta: dict) -> str:
    """'delayed', 'current', 'mxfp8', 'block' or 'unknown' for the recipe in ``fp8_meta``."""
    rec = meta.get("recipe")
    for kind, attr in (("delayed", "delayed"), ("current", "float8_current_scaling"), ("mxfp8", "mxfp8"),
                       ("block", "float8_block_scaling")):
        fn = getattr(rec, attr, None)
        if callable(fn):
            try:
                if fn():
                    return kind
            except Exception:
                pass
    return "unknown"


def _te_quantizer(mod: nn.Module, key: str, idx: int):
    qs = getattr(mod, "quantizers", None)
    try:
        return qs[key][idx] if qs is not None else None
    except (KeyError, IndexError, TypeError):
        return None


def block_scales(x: torch.Tensor, fmt: Fp8Format, block: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` viewed as rows of ``block`` values, and each block's scale and amax (shape [n_blocks, 1]).

    MXFP8 (pow2=True): the E8M0 scale_inv is the power of two that brings the block amax to at or
    below fp8_max (rounded up, as TE's quantize kernel does, so the block never saturates).
    Block scaling (pow2=False): fp8_max / block amax. A block amax of 0 gives scale 1."""
    flat = x.detach().reshape(-1)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.reshape(-1, block)
    amax = blocks.abs().amax(dim=1, keepdim=True).float()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if pow2:
        scale_inv = torch.exp2(torch.ceil(torch.log2(safe / fmt.max)))
    else:
        scale_inv = safe / fmt.max
    scale_inv = torch.where(amax > 0, scale_inv, torch.ones_like(scale_inv))
    return blocks, scale_inv.reciprocal(), amax


class TransformerEngineSource:
    """Transformer Engine ``Linear`` / ``LayerNormLinear`` / ``LayerNormMLP`` (and so the GEMMs
    inside ``TransformerLayer`` and ``MultiheadAttention``, which are built from them).

    - Delayed scaling: the scale in use and this step's amax come from ``fp8_meta`` (TE's own
      numbers; nothing recomputed). Tensors we can see (a plain Linear's input, a high-precision
      weight, the output gradient) get full stats against TE's scale; tensors produced inside
      the module (LayerNorm output, the MLP's hidden activation, fc1's grad_output) get amax rows.
    - Current scaling: the scale and amax the quantize kernel wrote into the quantizer's
      buffers, else derived from the tensor as TE does.
    - MXFP8 / Float8 block scaling: per-block scales recomputed from the visible tensor (rows
      summarise them by their most conservative block, see ``stats._scalar32``).
    """

    name = "te"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        classes = _te_module_classes()
        return bool(classes) and isinstance(module, classes)

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        is_mlp = type(module).__name__ == "LayerNormMLP"
        gemm_names = ["fc1", "fc2"] if is_mlp else [""]
        sees_input = type(module).__name__ == "Linear"  # others normalise the input first
        first_input: dict[str, torch.Tensor] = {}

        def name_of(g: int) -> str:
            return f"{layer}.{gemm_names[g]}" if gemm_names[g] else layer

        def margin(meta) -> float:
            return float(getattr(meta.get("recipe"), "margin", 0) or 0)

        def weight_of(mod, g: int):
            attr = ("fc1_weight", "fc2_weight")[g] if is_mlp else "weight"
            return getattr(mod, attr, None)

        def report_tensor(mod, meta, kind, g, role, t, fmt, key, idx) -> None:
            """Full stats of a visible high-precision tensor against the scale TE uses."""
            if kind == "delayed":
                scale = meta[key].scale[idx]
                expected = fmt.max / (scale * 2.0 ** margin(meta))
                sink.record(name_of(g), role, "te", fmt, t, scale, scale.reciprocal(), expected)
            elif kind in ("mxfp8", "block"):
                pow2 = kind == "mxfp8" or bool(getattr(getattr(meta.get("recipe"), "fp8_quant_fwd_inp", None),
                                                           "power_2_scale", True))
                blocks, scale, amax = block_scales(t, fmt, _MX_BLOCK if kind == "mxfp8" else _FP8_BLOCK, pow2=pow2)
                sink.record(name_of(g), role, "te", fmt, blocks, scale, scale.reciprocal(), amax)
            else:  # current scaling (or a recipe we do not know): TE's rule, from this tensor
                q = _te_quantizer(mod, key, idx)
                q_scale = getattr(q, "scale", None)
                from fp8scope.emulate import CurrentScaling, ScalingState

                st = ScalingState(CurrentScaling(), fmt, device=t.device).begin(t.detach())
                if isinstance(q_scale, torch.Tensor) and q_scale.numel() == 1 and role != "gradient":
                    # the kernel's own buffer, filled by this forward's quantize
                    scale = q_scale.reshape(()).float()
                    sink.record(name_of(g), role, "te", fmt, t, scale, scale.reciprocal(), st.expected_amax)
                else:
                    sink.record(name_of(g), role, "te", fmt, t, st.scale, st.scale_inv, st.expected_amax)

        def report_amax(mod, meta, kind, g, role, fmt, key, idx) -> None:
            """A tensor made inside the module: TE's recorded amax and scale, no element stats."""
            if kind == "delayed":
                s = meta[key]
                scale = s.scale[idx]
                expected = fmt.max / (scale * 2.0 ** margin(meta))
                sink.record_amax(name_of(g), role, "te", fmt, s.amax_history[0, idx], scale, scale.reciprocal(),
                                 expected)
            elif kind == "current":
                q = _te_quantizer(mod, key, idx)
                amax, scale = getattr(q, "amax", None), getattr(q, "scale", None)
                if isinstance(amax, torch.Tensor) and isinstance(scale, torch.Tensor):
                    sc = scale.reshape(-1)[0].float()
                    sink.record_amax(name_of(g), role, "te", fmt, amax.reshape(-1)[0], sc, sc.reciprocal(),
                                     amax.reshape(-1)[0])
            # MXFP8 / block scaling keep no per-tensor state for hidden tensors: nothing to read

        def pre_hook(mod, args):
            x = _first_tensor(args)
            if x is not None and sees_input:
                first_input["x"] = x

        def post_hook(mod, args, output):
            meta = getattr(mod, "fp8_meta", None) or {}
            x = first_input.pop("x", None)
            if not meta or not getattr(mod, "fp8", False):
                return
            kind = _te_kind(meta)
            fwd_fmt = _te_format(meta, "fp8_max_fwd", "forward")
            bwd_fmt = _te_format(meta, "fp8_max_bwd", "backward")
            for g in range(len(gemm_names)):
                if sink.wants("activation"):
                    if g == 0 and x is not None and not _is_quantized(x):
                        report_tensor(mod, meta, kind, g, "activation", x, fwd_fmt, "scaling_fwd", 0)
                    else:
                        report_amax(mod, meta, kind, g, "activation", fwd_fmt, "scaling_fwd", 3 * g)
                if sink.wants("weight"):
                    w = weight_of(mod, g)
                    if isinstance(w, torch.Tensor) and not _is_quantized(w):
                        report_tensor(mod, meta, kind, g, "weight", w, fwd_fmt, "scaling_fwd", 3 * g + 1)
                    else:  # FP8 primary weights (fp8_model_init): TE's amax / scale
                        report_amax(mod, meta, kind, g, "weight", fwd_fmt, "scaling_fwd", 3 * g + 1)
            if sink.wants("gradient"):
                last = len(gemm_names) - 1

                def on_grad(grad: torch.Tensor) -> None:
                    report_tensor(mod, meta, kind, last, "gradient", grad, bwd_fmt, "scaling_bwd", 2 * last)

                GradHook(guarded(sink, on_grad)).attach(output)

        def backward_hook(mod, grad_input, grad_output):
            # fc1's grad_output (the MLP's hidden gradient) exists only inside TE's backward; once
            # the module's backward is done, TE's state holds its amax.
            meta = getattr(mod, "fp8_meta", None) or {}
            if meta and getattr(mod, "fp8", False) and sink.wants("gradient"):
                kind = _te_kind(meta)
                report_amax(mod, meta, kind, 0, "gradient", _te_format(meta, "fp8_max_bwd", "backward"),
                            "scaling_bwd", 0)

        hooks = [module.register_forward_pre_hook(guarded(sink, pre_hook)),
                 module.register_forward_hook(guarded(sink, post_hook))]
        if is_mlp:
            hooks.append(module.register_full_backward_hook(guarded(sink, backward_hook)))
        return lambda: [h.remove() for h in hooks] and None


def _is_quantized(t: torch.Tensor) -> bool:
    """TE QuantizedTensor (Float8Tensor, MXFP8Tensor, ...): carries its scale_inv, not a high-precision copy."""
    return any(hasattr(t, a) for a in ("_scale_inv", "_rowwise_scale_inv", "_columnwise_scale_inv")) or (
        hasattr(t, "_data") and t.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    )


def _te_format(meta: dict, key: str, pass_: str) -> Fp8Format:
    rec = meta.get("recipe")
    fmt_name = getattr(getattr(rec, "fp8_format", None), "name", "HYBRID")
    try:
        return recipe_format(fmt_name, pass_)
    except ValueError:
        return get_format("e4m3" if pass_ == "forward" else "e5m2")


# Order matters: the most specific adapter first; WhatIf takes any remaining linear-like layer.
ADAPTERS = (EmulatedSource, TorchaoSource, TransformerEngineSource, WhatIfSource)


def adapter_for(module: nn.Module):
    """The adapter that claims ``module``, or None if it is not a monitored layer type."""
    for adapter in ADAPTERS:
        if adapter.claims(module):
            return adapter
    return None
