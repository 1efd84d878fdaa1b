"""Emulated FP8 training on any device, with Transformer-Engine-faithful scaling.

Why: FP8 instabilities (saturating outliers, stale delayed scales, gradient
underflow) should be reproducible and testable on a CPU laptop, without an
H100 or Transformer Engine. This package casts to real torch float8 dtypes
with TE's scaling rules and runs the GEMMs in float32 on the decoded values.

    from fp8scope.emulate import DelayedScaling, convert_to_fp8, fp8_disabled
    model = convert_to_fp8(model, recipe=DelayedScaling(amax_history_len=16))
    with fp8_disabled(model):      # BF16 reference with the same weights
        ref = model(x)

``ScalingState`` also works standalone ("which scale would TE use here?").
Semantics and the mapping to TE: docs/emulate.md.
"""

from .autocast import fp8_autocast
from .convert import convert_to_fp8, fp8_disabled
from .linear import ROLES, Fp8Linear
from .quantize import dequantize, quantize, quantize_dequantize
from .recipes import (CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling,
                      recipe_from_dict)
from .amax import tensor_amax
from .scaling import Scales, ScalingState

__all__ = [
    "DelayedScaling",
    "CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "recipe_from_dict",
    "ScalingState",
    "Scales",
    "tensor_amax",
    "quantize",
    "dequantize",
    "quantize_dequantize",
    "Fp8Linear",
    "ROLES",
    "convert_to_fp8",
    "fp8_disabled",
    "fp8_autocast",
]
