"""FP8 formats: the one place that knows names, torch dtypes and numeric limits.

Every limit comes from ``torch.finfo`` so that no number is written down twice
(see ../shared/fp8-reference.md §1). Other modules ask this one for
``fp8_max``, the smallest subnormal and the recipe-level format names
(``HYBRID`` = E4M3 forward, E5M2 backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Fp8Format:
    """Numeric facts of one FP8 element format."""

    name: str  # short name used in the store: "e4m3", "e5m2", ...
    dtype: torch.dtype
    max: float  # largest finite value
    tiny: float  # smallest normal
    min_subnormal: float  # smallest positive subnormal
    mantissa_bits: int
    has_inf: bool

    @property
    def underflow_threshold(self) -> float:
        """|x| at or below this rounds to zero on the cast (round-to-nearest-even)."""
        return self.min_subnormal / 2

    @property
    def binades(self) -> float:
        """log2(max / min_subnormal): the dynamic range one scale can cover."""
        import math

        return math.log2(self.max / self.min_subnormal)


_DTYPE_NAMES = {
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e4m3fnuz": "float8_e4m3fnuz",
    "e5m2fnuz": "float8_e5m2fnuz",
}
_ALIASES = {"e4m3fn": "e4m3", **{v: k for k, v in _DTYPE_NAMES.items()}}
_MANTISSA = {"e4m3": 3, "e5m2": 2, "e4m3fnuz": 3, "e5m2fnuz": 2}


@lru_cache(maxsize=None)
def get_format(name: str) -> Fp8Format:
    """Look a format up by short name (``e4m3``, ``e5m2``, ``e4m3fnuz``, ``e5m2fnuz``)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(_DTYPE_NAMES)}")
    dtype = getattr(torch, _DTYPE_NAMES[key], None)
    if dtype is None:
        raise ValueError(f"this torch ({torch.__version__}) has no dtype {_DTYPE_NAMES[key]}")
    fi = torch.finfo(dtype)
    mbits = _MANTISSA[key]
    return Fp8Format(
        name=key,
        dtype=dtype,
        max=float(fi.max),
        tiny=float(fi.tiny),
        min_subnormal=float(fi.tiny) * 2.0 ** (-mbits),
        mantissa_bits=mbits,
        has_inf=key == "e5m2",
    )


def format_of_dtype(dtype: torch.dtype) -> Fp8Format:
    """The format that a torch float8 dtype stores."""
    for key, attr in _DTYPE_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return get_format(key)
    raise ValueError(f"{dtype} is not an FP8 dtype")


# Recipe-level formats, Transformer Engine's words: which element format each pass uses.
RECIPE_FORMATS = {
    "HYBRID": {"forward": "e4m3", "backward": "e5m2"},
    "E4M3": {"forward": "e4m3", "backward": "e4m3"},
    "E5M2": {"forward": "e5m2", "backward": "e5m2"},
}


def recipe_format(fp8_format: str, pass_: str) -> Fp8Format:
    """Element format for ``pass_`` ("forward" or "backward") under a recipe format name."""
    key = str(fp8_format).upper().split(".")[-1]
    if key not in RECIPE_FORMATS:
        raise ValueError(f"unknown recipe fp8_format {fp8_format!r}; expected one of {sorted(RECIPE_FORMATS)}")
    return get_format(RECIPE_FORMATS[key][pass_])
