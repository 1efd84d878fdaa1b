"""Transformer Engine 2.0 -> 2.20: ``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` and
``GroupedLinear`` (so the GEMMs of ``TransformerLayer`` and ``MultiheadAttention``), read as the
installed version lays out its state (``te_layout``). TE is imported lazily, never just to look.

What each recipe gives (docs/integrations.md has the table by version):

- **Delayed scaling**: the scale in use and the amax recorded come from ``fp8_meta`` (TE's own
  numbers, copied when read: TE updates them in place). Tensors we can see (a ``Linear``'s input, a
  high-precision weight, the output gradient) get full stats against TE's scale; tensors made inside
  the module (the LayerNorm output, the MLP's hidden activation and gradient) get amax rows. The
  hidden gradient of a ``LayerNormMLP`` that is the first FP8 module of its autocast is read around
  TE's early backward update (the flag on TE's autograd node), with the scale its GEMM used.
- **Current scaling**: in 2.2-2.15 the quantizer's own buffers (TE's reduced amax and scale); from
  2.16, where they are per-call temporaries, the scale is measured from the tensor with the
  quantizer's options (power-of-two scales, ``amax_epsilon``). The LayerNorm output is recomputed
  from the module's input and norm parameters where TE keeps nothing to read.
- **MXFP8 / Float8BlockScaling**: per-block scales from the visible tensor with TE's block shapes and
  rounding (``emulate.blocks``), rowwise and columnwise (``role@columnwise``).
- **NVFP4** (2.8+): E2M1 rows measured as TE quantizes the visible tensor (``emulate.block_linear.
  nvfp4_scaled``, with the version's block-scale formula): 1x16 blocks rowwise, and columnwise for
  activations and gradients after TE's random Hadamard transform along the tokens (its own tensor
  scale); weights in 16x16 tiles that serve both usages (one row), unless the recipe switches them
  off. Gradients are measured rounded to nearest (TE rounds them stochastically with torch's CUDA
  generator, which the monitor leaves alone; ``Monitor(whatif_recipes=["nvfp4"])`` gives the
  expectation). ``row_scaled_activation`` (2.16+) and 4over6 (2.17+) are not read: one warning, no rows.
- **CustomRecipe, anything else**: one warning, no rows (nothing is labelled as what it is not).

Cached weights (``is_first_microbatch=False``) are reported against the scale of the cached FP8
weight (``_fp8_workspaces``), which TE quantized at the first micro-batch.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fp8scope.capture.adapters.base import Adapter, GradHook, Handle, Sink, guarded
from fp8scope.capture.adapters.te_layout import NEWEST_READ, OLDEST, TeLayout, installed_version, layout_for
from fp8scope.formats import Fp8Format, get_format, recipe_format

_TE_CLASSES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
READABLE = ("delayed", "current", "mxfp8", "block", "nvfp4")
COLUMNWISE = "@columnwise"  # the suffix of a tensor's columnwise copy (the other GEMM's operand)


def te_module_classes() -> tuple[type, ...]:
    if "transformer_engine" not in sys.modules:
        return ()
    try:
        import transformer_engine.pytorch as te
    except Exception:
        return ()
    return tuple(getattr(te, n) for n in _TE_CLASSES if isinstance(getattr(te, n, None), type))


def recipe_kind(recipe: Any) -> str:
    """'delayed', 'current', 'mxfp8', 'block', 'nvfp4', 'custom' or 'unknown', from TE's own predicates
    (``common/recipe/__init__.py``). NVFP4 and custom come first: NVFP4BlockScaling also carries an
    ``fp8_format`` and must not pass for per-tensor FP8."""
    for kind, attr in (("nvfp4", "nvfp4"), ("custom", "custom"), ("delayed", "delayed"),
                       ("current", "float8_current_scaling"), ("mxfp8", "mxfp8"), ("block", "float8_block_scaling")):
        fn = getattr(recipe, attr, None)
        if callable(fn):
            try:
                if fn():
                    return kind
            except Exception:
                pass
    return "unknown"


def recipe_dict(recipe: Any, kind: str) -> dict | None:
    """TE's recipe in the manifest's form (``Recipe.to_dict``: ``kind`` as fp8scope.emulate names it,
    TE's ``block`` being ``block128``, and the fields the report's advice reads), so that a TE run's
    report names its recipe as an emulated run's does; None for a kind fp8scope does not read."""
    if kind not in READABLE:
        return None
    out: dict[str, Any] = {"kind": "block128" if kind == "block" else kind}
    fmt = getattr(getattr(recipe, "fp8_format", None), "name", None)
    if fmt is not None and kind != "nvfp4":  # NVFP4's fp8_format is its block scales' format
        out["fp8_format"] = fmt
    for field in ("margin", "amax_history_len", "amax_compute_algo") if kind == "delayed" else ():
        value = getattr(recipe, field, None)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            out[field] = value
    return out


def _format(meta: dict, pass_: str) -> Fp8Format:
    fmt_name = getattr(getattr(meta.get("recipe"), "fp8_format", None), "name", "HYBRID")
    try:
        return recipe_format(fmt_name, pass_)
    except ValueError:
        return get_format("e4m3" if pass_ == "forward" else "e5m2")


def _is_quantized(t: Any) -> bool:
    """A TE QuantizedTensor (Float8Tensor, MXFP8Tensor, ...): carries scales, not high-precision data."""
    return isinstance(t, torch.Tensor) and (
        any(hasattr(t, a) for a in ("_scale_inv", "_rowwise_scale_inv", "_columnwise_scale_inv"))
        or (hasattr(t, "_data") and t.dtype not in (torch.float32, torch.bfloat16, torch.float16)))


_E2M1 = get_format("e2m1")  # NVFP4's elements (its block scales are E4M3)


def _nvfp4_options_not_read(recipe: Any) -> str:
    """The NVFP4BlockScaling options set that change TE's quantization in ways not read here, or ''."""
    unread = []
    if getattr(recipe, "row_scaled_activation", False):
        unread.append("row_scaled_activation")
    if str(getattr(recipe, "nvfp4_4over6", "none") or "none").lower() != "none":
        unread.append(f"nvfp4_4over6={recipe.nvfp4_4over6!r}")
    return " and ".join(unread)


def _quantizer(mod: nn.Module, key: str, idx: int):
    try:
        return mod.quantizers[key][idx]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _scalar(t: Any) -> torch.Tensor | None:
    return t.detach().reshape(-1)[0].float().clone() if isinstance(t, torch.Tensor) and t.numel() >= 1 else None


class _Gemm:
    """One GEMM of a module: its name, where its operands live, and its slots."""

    __slots__ = ("name", "input_slot", "weight_slot", "grad_slot", "weights", "workspace", "hidden_input",
                 "visible_grad")

    def __init__(self, name, input_slot, weight_slot, grad_slot, weights, workspace, hidden_input, visible_grad):
        self.name, self.input_slot, self.weight_slot, self.grad_slot = name, input_slot, weight_slot, grad_slot
        self.weights: Callable[[nn.Module], list] = weights
        self.workspace, self.hidden_input, self.visible_grad = workspace, hidden_input, visible_grad


def _named_weights(names: tuple[str, ...]) -> Callable[[nn.Module], list]:
    return lambda mod: [getattr(mod, n, None) for n in names]


def _split_weights(mod: nn.Module) -> list:
    """A Linear's / LayerNormLinear's weights: ``weight``, or the split parameters TE concatenates
    before its one quantization (``weight_names``: ``query_weight``, ``key_weight``, ``value_weight``
    of ``MultiheadAttention`` with ``fuse_qkv_params=False``; ``layernorm_linear.py``, v2.18 line 1859)."""
    names = getattr(mod, "weight_names", None) or ["weight"]
    return [getattr(mod, n, None) for n in names]


def gemm_slots(layer: str, module: nn.Module, layout: TeLayout) -> list[_Gemm]:
    kind = type(module).__name__
    if kind == "LayerNormMLP":
        fc1_grad, fc2_grad = layout.mlp_grad_slots
        return [_Gemm(f"{layer}.fc1", 0, 1, fc1_grad, _named_weights(("fc1_weight",)), "fc1_weight", "norm", False),
                _Gemm(f"{layer}.fc2", 3, 4, fc2_grad, _named_weights(("fc2_weight",)), "fc2_weight", "inner", True)]
    if kind == "GroupedLinear":
        n = int(getattr(module, "num_gemms", 0) or 0)
        out = []
        for i in range(n):
            a, w, g = layout.grouped_slots(i, n)
            out.append(_Gemm(f"{layer}.gemm{i}", a, w, g, _named_weights((f"weight{i}",)), f"weight{i}", None, True))
        return out
    hidden = "norm" if kind == "LayerNormLinear" else None
    return [_Gemm(layer, 0, 1, 0, _split_weights, "weight", hidden, True)]


def _norm_output(mod: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The LayerNorm / RMSNorm output TE quantizes, recomputed from the input and the module's norm
    parameters (in float32, returned in the input's dtype, as TE's norm kernels write it)."""
    w = getattr(mod, "layer_norm_weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    eps = float(getattr(mod, "eps", 1e-5))
    b = getattr(mod, "layer_norm_bias", None)
    w = w.detach().float() + (1.0 if getattr(mod, "zero_centered_gamma", False) else 0.0)
    xf = x.detach().float()
    if str(getattr(mod, "normalization", "LayerNorm")) == "RMSNorm":
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w
    else:
        y = F.layer_norm(xf, xf.shape[-1:], w, None if b is None else b.detach().float(), eps)
    return y.to(x.dtype)


class _Reader:
    """Reads one TE module's FP8 state around its forward and backward and reports it to the sink."""

    def __init__(self, layer: str, module: nn.Module, sink: Sink, layout: TeLayout):
        self.layer, self.sink, self.layout = layer, sink, layout
        self.kind = type(module).__name__
        self.gemms = gemm_slots(layer, module, layout)
        self.sees_input = self.kind in ("Linear", "GroupedLinear")
        self._recipe, self._recipe_kind = None, "unknown"  # the last recipe seen and its kind

    # ---- forward ---------------------------------------------------------------------
    def forward_hook(self, mod, args, kwargs, output) -> None:
        sink = self.sink
        meta = getattr(mod, "fp8_meta", None) or {}
        if not sink.active or not meta or not getattr(mod, "fp8", False):
            return
        recipe = meta.get("recipe")
        if recipe is not self._recipe:  # a run keeps one recipe object: its kind is read once
            self._recipe, self._recipe_kind = recipe, recipe_kind(recipe)
            if (as_dict := recipe_dict(recipe, self._recipe_kind)) is not None:
                sink.note_recipe(as_dict)
                for g in self.gemms:  # each GEMM's rows (LayerNormMLP's fc1 and fc2, GroupedLinear's gemmN)
                    sink.layer_recipe(g.name, as_dict["kind"])
        kind = self._recipe_kind
        if kind not in READABLE:
            sink.warn(f"te-recipe-{kind}", f"Transformer Engine recipe {type(meta.get('recipe')).__name__} is not "
                      f"read by fp8scope (only per-tensor FP8, FP8 block and NVFP4 recipes are): layer {self.layer} and "
                      "the others under it log no rows (docs/integrations.md)")
            return
        if kind == "nvfp4" and (unread := _nvfp4_options_not_read(recipe)):
            sink.warn("te-nvfp4-options", f"Transformer Engine NVFP4 with {unread} is not read by fp8scope: layer "
                      f"{self.layer} and the others under it log no rows (docs/integrations.md)")
            return
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("inp")
        first_mb = kwargs.get("is_first_microbatch", args[2] if self.kind == "GroupedLinear" and len(args) > 2
                              else args[1] if self.kind != "GroupedLinear" and len(args) > 1 else None)
        cached = first_mb is False
        fwd, bwd = _format(meta, "forward"), _format(meta, "backward")
        state = _Snapshot(meta, "scaling_fwd") if kind == "delayed" else None
        inputs = self._inputs(mod, args, kwargs, x)
        for g, gemm in enumerate(self.gemms):
            if sink.wants("activation"):
                xi = inputs[g] if inputs is not None else None
                if xi is not None and not _is_quantized(xi):
                    self.report_tensor(mod, meta, kind, gemm.name, "activation", xi, fwd, "scaling_fwd",
                                       gemm.input_slot, state)
                else:
                    # the LayerNorm output, recomputed only where TE keeps nothing to read (report_hidden)
                    recompute = (lambda: _norm_output(mod, x)) if gemm.hidden_input == "norm" and x is not None else None
                    self.report_hidden(mod, meta, kind, gemm.name, "activation", fwd, "scaling_fwd", gemm.input_slot,
                                       state, recompute)
            if sink.wants("weight"):
                ws = [w for w in gemm.weights(mod) if isinstance(w, torch.Tensor)]
                if ws and not any(_is_quantized(w) for w in ws):
                    w = ws[0] if len(ws) == 1 else torch.cat([w.detach() for w in ws])
                    scale = _cached_scale(mod, gemm.workspace) if cached and kind in ("delayed", "current") else None
                    self.report_tensor(mod, meta, kind, gemm.name, "weight", w, fwd, "scaling_fwd", gemm.weight_slot,
                                       state, scale=scale)
                else:  # FP8 primary weights (fp8_model_init / quantized_model_init): TE's state
                    self.report_hidden(mod, meta, kind, gemm.name, "weight", fwd, "scaling_fwd", gemm.weight_slot,
                                       state, None)
        if sink.wants("gradient") and torch.is_grad_enabled():
            self._hook_gradients(mod, meta, kind, bwd, output, kwargs, args)

    def _inputs(self, mod, args, kwargs, x) -> list | None:
        """The visible input of each GEMM (None where TE makes it inside the module)."""
        if not self.sees_input or x is None:
            return [None] * len(self.gemms)
        if self.kind == "GroupedLinear":
            return _split(x, _m_splits(args, kwargs), len(self.gemms))
        return [x]

    # ---- backward --------------------------------------------------------------------
    def _hook_gradients(self, mod, meta, kind, bwd, output, kwargs, args) -> None:
        gemms = [g for g in self.gemms if g.visible_grad]
        splits = _m_splits(args, kwargs) if self.kind == "GroupedLinear" else None

        def on_grad(grad: torch.Tensor) -> None:
            state = _Snapshot(meta, "scaling_bwd") if kind == "delayed" else None
            parts = _split(grad, splits, len(gemms)) if splits is not None else [grad]
            for gemm, part in zip(gemms, parts):
                if part is not None:
                    self.report_tensor(mod, meta, kind, gemm.name, "gradient", part, bwd, "scaling_bwd",
                                       gemm.grad_slot, state)

        GradHook(guarded(self.sink, on_grad)).attach(output)
        if self.kind == "LayerNormMLP":
            self._hook_hidden_gradient(mod, meta, kind, bwd, output)

    def _hook_hidden_gradient(self, mod, meta, kind, bwd, output) -> None:
        """fc1's gradient exists only inside TE's backward: read TE's state around the backward node.
        When this module is the first FP8 module of its autocast, TE's backward update runs at the end
        of this node (``layernorm_mlp.py``, v2.18 lines 1804-1805): the scale is then taken before
        the node and the amax from the history's newest row after the roll."""
        gemm, sink = self.gemms[0], self.sink
        node = _te_node(output, "LayerNormMLP")
        if node is None:
            return
        early = bool(getattr(node, "reduce_and_update_bwd_fp8_tensors", False))
        slot, fmt = gemm.grad_slot, bwd
        seen: dict[str, Any] = {}

        def before(grad_outputs) -> None:
            if kind == "delayed":
                s = meta["scaling_bwd"]
                seen["scale"] = s.scale[slot].detach().clone()
                if early:
                    seen["history"] = s.amax_history[:, slot].detach().clone()

        def after(grad_inputs, grad_outputs) -> None:
            if not sink.wants("gradient"):
                return
            if kind == "delayed" and "scale" in seen:
                s = meta["scaling_bwd"]
                scale = seen["scale"]
                h = s.amax_history[:, slot].detach()
                if early:
                    before_h = seen["history"]
                    rolled = ~(h == before_h).all()
                    if h.shape[0] > 1:
                        amax = torch.where(rolled, h[-1], before_h[0])
                    else:  # a history of one row keeps nothing after the roll: the amax behind the new scale
                        new = s.scale[slot].detach()
                        amax = torch.where(new != scale, _scaled_max(meta, fmt) / new, before_h[0])
                else:
                    amax = h[0].clone()
                sink.record_amax(gemm.name, "gradient", "te", fmt, amax, scale, scale.reciprocal(),
                                 _scaled_max(meta, fmt) / scale)
            elif kind == "current" and self.layout.current_buffers:
                q = _quantizer(mod, "scaling_bwd", slot)
                amax, scale = _scalar(getattr(q, "amax", None)), _scalar(getattr(q, "scale", None))
                if amax is not None and scale is not None:
                    sink.record_amax(gemm.name, "gradient", "te", fmt, amax, scale, scale.reciprocal(), amax)
            else:
                sink.warn(f"te-hidden-grad-{kind}", f"Transformer Engine {'.'.join(map(str, self.layout.version))} "
                          f"{kind} scaling keeps no state for LayerNormMLP's fc1 gradient: no row for it "
                          "(docs/integrations.md)")

        node.register_prehook(guarded(sink, lambda grad_outputs: before(grad_outputs) and None))
        node.register_hook(guarded(sink, lambda gi, go: after(gi, go) and None))

    # ---- one tensor ------------------------------------------------------------------
    def report_tensor(self, mod, meta, kind, name, role, t, fmt, key, slot, state, scale=None) -> None:
        """Full stats (cheap steps: amax) of a visible high-precision tensor against TE's scale."""
        sink = self.sink
        t = t.detach()
        # the columnwise copy feeds the backward GEMMs: a gradient always has one, a forward tensor in training
        both = role == "gradient" or torch.is_grad_enabled()
        if kind == "delayed":
            s = scale if scale is not None else state.scale(slot)
            sink.record(name, role, "te", fmt, t, s, s.reciprocal(), _scaled_max(meta, fmt) / s)
        elif kind == "current":
            q = _quantizer(mod, key, slot)
            if scale is None and self.layout.current_buffers and role != "gradient":
                scale = _scalar(getattr(q, "scale", None))  # this forward's cast wrote it (TE's reduced amax)
                amax = _scalar(getattr(q, "amax", None))
                if scale is not None and amax is not None:
                    sink.record(name, role, "te", fmt, t, scale, scale.reciprocal(), amax)
                    return
            from fp8scope.emulate.amax import amax_pair
            from fp8scope.emulate.scaling import te_scale_from_amax

            recorded = amax_pair(t)[1]
            if scale is None:
                if getattr(q, "with_amax_reduction", False):
                    sink.warn("te-current-reduction", "Transformer Engine reduces some current-scaling amaxes over its "
                              "tensor-parallel group; fp8scope measures each rank's own (docs/integrations.md)")
                scale = te_scale_from_amax(recorded, fmt.max, pow2=_pow2(q, meta, role), epsilon=_epsilon(q))
            sink.record(name, role, "te", fmt, t, scale, scale.reciprocal(), recorded)
        elif kind == "mxfp8":
            from fp8scope.emulate.blocks import mxfp8_blocks

            for columnwise in (False, True) if both else (False,):
                b = mxfp8_blocks(t, fmt, columnwise, code0_multiplies_by_one=self.layout.mx_code0_is_one)
                sink.record(name, role + (COLUMNWISE if columnwise else ""), "te", fmt, b.x, b.scale, b.scale_inv,
                            b.amax, original=t)
        elif kind == "block":
            from fp8scope.emulate.blocks import fp8_block_scaling_blocks

            q = _quantizer(mod, key, slot)
            dim = int(getattr(q, "block_scaling_dim", 0) or _recipe_block_dim(meta, role))
            usages = (False, True) if both and dim != 2 else (False,)
            for columnwise in usages:
                b = fp8_block_scaling_blocks(t, fmt, dim, columnwise, pow2=_pow2(q, meta, role), epsilon=_epsilon(q))
                sink.record(name, role + (COLUMNWISE if columnwise else ""), "te", fmt, b.x, b.scale, b.scale_inv,
                            b.amax, original=t)
        elif kind == "nvfp4":
            from fp8scope.emulate.block_linear import nvfp4_scaled, nvfp4_tiles
            from fp8scope.emulate.blocks import as_matrix
            from fp8scope.emulate.recipe_table import E2M1, quantize

            rec = meta.get("recipe")
            for columnwise in (False, True) if both and not nvfp4_tiles(role, rec) else (False,):
                b = nvfp4_scaled(as_matrix(t), role, columnwise, rec, divide_first=self.layout.nvfp4_divides_first)
                # full steps only (a cheap row reads the amax): rounded to nearest, gradients too, so the
                # monitor never draws from the user's generator (TE rounds them stochastically)
                deq = quantize(b, E2M1)[1] if sink.full or name in sink.focus else None
                sink.record(name, role + (COLUMNWISE if columnwise else ""), "te", _E2M1, b.x, b.scale, b.scale_inv,
                            b.amax, deq=deq, original=t)

    def report_hidden(self, mod, meta, kind, name, role, fmt, key, slot, state, recompute) -> None:
        """A tensor made inside the module: TE's recorded amax and scale where TE keeps them, else
        the recomputed tensor (the LayerNorm output) measured as TE would, else no row."""
        sink = self.sink
        if kind == "delayed":
            s = state.scale(slot)
            sink.record_amax(name, role, "te", fmt, state.amax(slot), s, s.reciprocal(), _scaled_max(meta, fmt) / s)
        elif kind == "current" and self.layout.current_buffers:
            q = _quantizer(mod, key, slot)
            amax, scale = _scalar(getattr(q, "amax", None)), _scalar(getattr(q, "scale", None))
            if amax is not None and scale is not None:
                sink.record_amax(name, role, "te", fmt, amax, scale, scale.reciprocal(), amax)
        elif recompute is not None and (recomputed := recompute()) is not None:
            self.report_tensor(mod, meta, kind, name, role, recomputed, fmt, key, slot, state)
        else:
            sink.warn(f"te-hidden-{kind}-{role}", f"Transformer Engine {'.'.join(map(str, self.layout.version))} "
                      f"{kind} scaling keeps no state for tensors made inside a module (LayerNormMLP's fc2 input): "
                      "no row for them (docs/integrations.md)")


class _Snapshot:
    """TE's delayed-scaling state of one direction, copied once when first read: TE updates
    ``scale`` and ``amax_history`` in place, and rows are gathered when the step ends."""

    __slots__ = ("_state", "_scale", "_row0")

    def __init__(self, meta: dict, key: str):
        self._state = meta[key]
        self._scale = self._row0 = None

    def scale(self, slot: int) -> torch.Tensor:
        if self._scale is None:
            self._scale = self._state.scale.detach().clone()
        return self._scale[slot]

    def amax(self, slot: int) -> torch.Tensor:
        if self._row0 is None:
            self._row0 = self._state.amax_history[0].detach().clone()
        return self._row0[slot]


def _scaled_max(meta: dict, fmt: Fp8Format) -> float:
    """``fp8_max * 2**-margin``: the amax a scale of 1 stands for (delayed scaling's numerator)."""
    from fp8scope.emulate.scaling import scaled_max

    return scaled_max(fmt, float(getattr(meta.get("recipe"), "margin", 0) or 0))


_RECIPE_QPARAMS = {"activation": "fp8_quant_fwd_inp", "weight": "fp8_quant_fwd_weight", "gradient": "fp8_quant_bwd_grad"}


def _pow2(q, meta: dict, role: str) -> bool:
    """The quantizer's power-of-two option (TE's modules set it per slot from the recipe's QParams)."""
    v = getattr(q, "force_pow_2_scales", None)
    if v is None:
        v = getattr(getattr(meta.get("recipe"), _RECIPE_QPARAMS.get(role, ""), None), "power_2_scale", False)
    return bool(v)


def _epsilon(q) -> float:
    return float(getattr(q, "amax_epsilon", 0.0) or 0.0)


def _recipe_block_dim(meta: dict, role: str) -> int:
    attr = {"activation": "x_block_scaling_dim", "weight": "w_block_scaling_dim"}.get(role, "grad_block_scaling_dim")
    return int(getattr(meta.get("recipe"), attr, 2 if role == "weight" else 1))


def _cached_scale(mod: nn.Module, key: str) -> torch.Tensor | None:
    """The scale of the cached FP8 weight a GEMM reuses when ``is_first_microbatch=False``: its own
    ``_scale_inv`` (``module/base.py``, ``_fp8_workspaces``), not the quantizer's newer scale."""
    ws = (getattr(mod, "_fp8_workspaces", None) or {}).get(key)
    inv = getattr(ws, "_scale_inv", None)
    return inv.detach().reshape(-1)[0].float().reciprocal() if isinstance(inv, torch.Tensor) else None


def _m_splits(args: tuple, kwargs: dict) -> list[int] | None:
    splits = kwargs.get("m_splits", args[1] if len(args) > 1 else None)
    return [int(v) for v in splits] if isinstance(splits, (list, tuple)) else None


def _split(t: torch.Tensor, splits: list[int] | None, n: int) -> list:
    if splits is None or len(splits) != n or sum(splits) != t.shape[0]:
        return [None] * n
    return list(torch.split(t, splits, dim=0))


def _te_node(output: Any, name: str, depth: int = 3):
    """TE's autograd node for ``output`` (``_<name>Backward``), looking through a few nodes made after
    it (an unfused bias add)."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    frontier = [getattr(out, "grad_fn", None)]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            if node is None:
                continue
            if name in type(node).__name__:
                return node
            nxt += [f for f, _ in getattr(node, "next_functions", ())]
        frontier = nxt
    return None


class TransformerEngineSource(Adapter):
    """Transformer Engine modules; see the module docstring."""

    name = "te"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        classes = te_module_classes()
        return bool(classes) and isinstance(module, classes)

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        version = installed_version() or NEWEST_READ
        if not OLDEST <= version <= NEWEST_READ:
            sink.warn("te-version", f"Transformer Engine {'.'.join(map(str, version))}: fp8scope reads TE "
                      f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST_READ[0]}.{NEWEST_READ[1]}; this one is read with the "
                      "nearest layout (docs/integrations.md)")
        reader = _Reader(layer, module, sink, layout_for(version))
        handle = module.register_forward_hook(guarded(sink, reader.forward_hook), with_kwargs=True)
        return handle.remove

    @staticmethod
    def high_precision(model: nn.Module) -> AbstractContextManager | None:
        classes = te_module_classes()
        if classes and any(isinstance(m, classes) for m in model.modules()):
            return _autocast_off()
        return None

    @staticmethod
    def make_plain(module: nn.Module) -> None:
        return None  # TE's FP8 is switched per pass: plain_context

    @staticmethod
    def plain_context(model: nn.Module) -> AbstractContextManager | None:
        return TransformerEngineSource.high_precision(model)


def _autocast_off() -> AbstractContextManager:
    """``fp8_autocast(enabled=False)`` (``autocast`` in TE 2.9+, where ``fp8_autocast`` is a deprecated
    wrapper): TE runs its GEMMs in the input dtype and leaves ``fp8_meta`` alone."""
    te = sys.modules.get("transformer_engine.pytorch")
    if te is None:
        import transformer_engine.pytorch as te  # noqa: PLC0415
    autocast = getattr(te, "autocast", None) or getattr(te, "fp8_autocast")
    return autocast(enabled=False)
