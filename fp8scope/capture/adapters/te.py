"""Transformer Engine (temporary: moved as it was; rewritten below)."""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fp8scope.capture.adapters.base import GradHook, Handle, Sink, first_tensor, guarded, matrix_weights
from fp8scope.formats import Fp8Format, get_format, recipe_format

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
            x = first_tensor(args)
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

    @staticmethod
    def weights(module: nn.Module) -> list[nn.Parameter]:
        return matrix_weights(module)

    @staticmethod
    def high_precision(model: nn.Module) -> AbstractContextManager | None:
        classes = _te_module_classes()
        if classes and any(isinstance(m, classes) for m in model.modules()):
            return _te_autocast_off()
        return None

    @staticmethod
    def make_plain(module: nn.Module) -> None:
        return None  # TE's FP8 is switched per pass: plain_context

    @staticmethod
    def plain_context(model: nn.Module) -> AbstractContextManager | None:
        return TransformerEngineSource.high_precision(model)


def _te_autocast_off() -> AbstractContextManager:
    """``fp8_autocast(enabled=False)`` (``autocast`` in newer TE): TE runs its GEMMs in the input
    dtype and does not touch ``fp8_meta``."""
    te = sys.modules.get("transformer_engine.pytorch")
    if te is None:
        import transformer_engine.pytorch as te  # noqa: PLC0415
    autocast = getattr(te, "fp8_autocast", None) or getattr(te, "autocast")
    return autocast(enabled=False)


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


