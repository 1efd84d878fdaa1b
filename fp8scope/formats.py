"""FP8 formats: the one place that knows names, torch dtypes and numeric limits.

Every limit is derived from the format's bit layout (no limit is written down as a number)
and checked against ``torch.finfo`` in the tests (see ../shared/fp8-reference.md §1); torch
itself is imported only when a dtype is asked for, so reading a run never pays its import.
Other modules ask this one for
``fp8_max``, the smallest subnormal and the recipe-level format names
(``HYBRID`` = E4M3 forward, E5M2 backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


DEEP_UNDERFLOW_BINADES = 4  # a flushed value this many binades under the threshold counts as deep


@dataclass(frozen=True)
class Fp8Format:
    """Numeric facts of one FP8 element format."""

    name: str  # short name used in the store: "e4m3", "e5m2", ...
    max: float  # largest finite value
    tiny: float  # smallest normal
    min_subnormal: float  # smallest positive subnormal
    mantissa_bits: int
    has_inf: bool

    @property
    def dtype(self) -> "torch.dtype":
        """The torch dtype (torch is imported here, not at module import: readers never need it)."""
        import torch

        if self.name not in _DTYPE_NAMES:
            raise ValueError(f"{self.name} has no unpacked torch dtype (its values are rounded in float32)")
        dtype = getattr(torch, _DTYPE_NAMES[self.name], None)
        if dtype is None:
            raise ValueError(f"this torch ({torch.__version__}) has no dtype {_DTYPE_NAMES[self.name]}")
        return dtype

    @property
    def underflow_threshold(self) -> float:
        """|x| at or below this rounds to zero on the cast (round-to-nearest-even)."""
        return self.min_subnormal / 2

    @property
    def deep_underflow_threshold(self) -> float:
        """|x| at or below this flushes from ``DEEP_UNDERFLOW_BINADES`` binades or more under the
        flush threshold: what a smooth distribution pressed against the bottom of the range rarely
        holds (its flushed values sit evenly in magnitude below the threshold, 1/16 of them this
        deep), and what a tail of near-zero values spread over many binades (a head that outputs
        ~0, a softmax's far tail) is made of. Detection tells the two apart by it."""
        return self.underflow_threshold / 2.0 ** DEEP_UNDERFLOW_BINADES

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
# Bit layouts (exponent bits, mantissa bits, bias, encoding of the top of the range), from the
# OCP FP8 spec and the FNUZ variants. The limits are derived from these, so the file states
# no limit as a number; tests/test_stats.py checks every derived limit against torch.finfo.
#   "fn":   no infinities; the all-ones exponent is a normal binade except mantissa all-ones (NaN)
#   "ieee": all-ones exponent reserved for inf/NaN
#   "fnuz": no infinities, a single NaN code (negative zero): the whole top binade is finite
#   "finite": no infinities, no NaN: every code is a number (OCP MX E2M1, NVFP4's values; max 6)
_LAYOUTS = {
    "e4m3": (4, 3, 7, "fn"),
    "e5m2": (5, 2, 15, "ieee"),
    "e4m3fnuz": (4, 3, 8, "fnuz"),
    "e5m2fnuz": (5, 2, 16, "fnuz"),
    "e2m1": (2, 1, 1, "finite"),
}


def _derive(name: str) -> Fp8Format:
    ebits, mbits, bias, top = _LAYOUTS[name]
    max_exp = (2**ebits - 1) - (1 if top == "ieee" else 0) - bias
    max_mant = (2**mbits - 1) - (1 if top == "fn" else 0)
    tiny = 2.0 ** (1 - bias)
    return Fp8Format(
        name=name,
        max=2.0**max_exp * (1 + max_mant / 2**mbits),
        tiny=tiny,
        min_subnormal=tiny * 2.0 ** (-mbits),
        mantissa_bits=mbits,
        has_inf=top == "ieee",
    )


@lru_cache(maxsize=None)
def get_format(name: str) -> Fp8Format:
    """Look a format up by short name (``e4m3``, ``e5m2``, ``e4m3fnuz``, ``e5m2fnuz``) or torch dtype name."""
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in _LAYOUTS:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(_LAYOUTS)}")
    return _derive(key)


def format_of_dtype(dtype: "torch.dtype") -> Fp8Format:
    """The format that a torch float8 dtype stores."""
    import torch

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
