"""Scaling recipes for emulated FP8: what to compute a scale from, not how.

The two recipes mirror Transformer Engine's per-tensor recipes so that a run
emulated here can be compared one to one with a TE run:

* :class:`DelayedScaling` - TE ``recipe.DelayedScaling``: the scale used in a
  step comes from an amax *history* of earlier steps.
* :class:`CurrentScaling` - TE ``recipe.Float8CurrentScaling``: the scale comes
  from the tensor's own amax, computed just before the cast.

Both are frozen dataclasses: a recipe is shared by every layer it converts,
and a layer must not see its recipe change under it. ``fp8_format`` is a
recipe-level name (``"HYBRID"`` = E4M3 forward, E5M2 backward; ``"E4M3"``
everywhere); the element formats come from :mod:`fp8scope.formats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..formats import Fp8Format, recipe_format

# TE rejects pure E5M2 training ("Pure E5M2 training is not supported."), so do we.
SUPPORTED_FP8_FORMATS = ("HYBRID", "E4M3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def _normalize_format(value: Any) -> str:
    """Accept "hybrid", "HYBRID" or TE's ``Format.HYBRID`` (by its name) and return "HYBRID"."""
    name = getattr(value, "name", value)  # an Enum member (e.g. TE's Format) has .name
    if not isinstance(name, str):
        raise ValueError(f"fp8_format must be one of {SUPPORTED_FP8_FORMATS}, got {value!r}")
    key = name.upper().split(".")[-1]
    if key not in SUPPORTED_FP8_FORMATS:
        raise ValueError(f"fp8_format must be one of {SUPPORTED_FP8_FORMATS}, got {value!r}")
    return key


def _check_margin(margin: Any) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number, got {margin!r}")
    if margin < 0:
        raise ValueError(f"margin must be >= 0 (a negative margin aims past the FP8 maximum), got {margin!r}")


class _RecipeBase:
    """Shared helpers: element formats per pass and JSON round trip."""

    kind: ClassVar[str]
    fp8_format: str
    margin: float

    def format_for(self, pass_: str) -> Fp8Format:
        """Element format for ``pass_`` ("forward" or "backward")."""
        return recipe_format(self.fp8_format, pass_)

    @property
    def forward_format(self) -> Fp8Format:
        """Format of activations and weights (E4M3 under both HYBRID and E4M3)."""
        return self.format_for("forward")

    @property
    def backward_format(self) -> Fp8Format:
        """Format of the output gradient (E5M2 under HYBRID, E4M3 under E4M3)."""
        return self.format_for("backward")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description; ``recipe_from_dict(r.to_dict()) == r``."""
        d: dict[str, Any] = {"kind": self.kind}
        d.update({f.name: getattr(self, f.name) for f in fields(self)})  # type: ignore[arg-type]
        return d


@dataclass(frozen=True)
class DelayedScaling(_RecipeBase):
    """TE-style delayed scaling (defaults are TE's: margin 0, history 1024, "max", HYBRID).

    ``scale = (fp8_max / amax) / 2**margin`` where ``amax`` is the maximum over the
    last ``amax_history_len`` recorded amaxes ("max") or the most recent one
    ("most_recent"). ``reduce_amax`` (TE's default, True): under ``torch.distributed`` with more
    than one rank, each update first takes the MAX of the recorded amax over the ranks, so every
    rank uses the same scale. See ``docs/emulate.md`` for the exact update timeline.
    """

    margin: int | float = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: str = "HYBRID"
    reduce_amax: bool = True

    kind: ClassVar[str] = "delayed"

    def __post_init__(self) -> None:
        _check_margin(self.margin)
        n = self.amax_history_len
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {n!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS} "
                f"(callables are not supported by the emulator), got {self.amax_compute_algo!r}"
            )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"reduce_amax must be True or False, got {self.reduce_amax!r}")
        object.__setattr__(self, "fp8_format", _normalize_format(self.fp8_format))


@dataclass(frozen=True)
class CurrentScaling(_RecipeBase):
    """TE ``Float8CurrentScaling``-like: scale from this tensor's own amax.

    ``scale = (fp8_max / amax) / 2**margin``; an amax of 0, Inf or NaN gives
    scale 1 (TE ``compute_scale_from_amax``). ``margin`` is an fp8scope
    extension (TE's current scaling has none); 0 reproduces TE.
    """

    fp8_format: str = "HYBRID"
    margin: int | float = 0

    kind: ClassVar[str] = "current"

    def __post_init__(self) -> None:
        _check_margin(self.margin)
        object.__setattr__(self, "fp8_format", _normalize_format(self.fp8_format))


class _BlockRecipe(_RecipeBase):
    """A block-scaled recipe: E4M3 values in both passes, scales from each block's own amax."""

    margin: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if _normalize_format(self.fp8_format) != "E4M3":
            raise ValueError(f"{type(self).__name__} uses E4M3 values here, got {self.fp8_format!r}")
        object.__setattr__(self, "fp8_format", "E4M3")


@dataclass(frozen=True)
class MXFP8BlockScaling(_BlockRecipe):
    """TE ``MXFP8BlockScaling``: one E8M0 scale per 32 values (rowwise 1x32 for the forward GEMM,
    columnwise 32x1 for the backward ones), rounded up (``emulate.blocks``). No state between steps."""

    fp8_format: str = "E4M3"
    kind: ClassVar[str] = "mxfp8"


@dataclass(frozen=True)
class Float8BlockScaling(_BlockRecipe):
    """TE ``Float8BlockScaling`` (DeepSeek-style): a power-of-two scale per 1x128 block of
    activations and gradients (128x1 for their backward usage) and per 128x128 tile of weights."""

    fp8_format: str = "E4M3"
    kind: ClassVar[str] = "block128"


@dataclass(frozen=True)
class NVFP4BlockScaling(_BlockRecipe):
    """TE ``NVFP4BlockScaling`` (TE 2.8+; ``common/recipe/__init__.py``): E2M1 values with an E4M3
    scale per 16 values under one FP32 scale per tensor and usage (``emulate.blocks.nvfp4_blocks``).
    TE's defaults, each switchable as with TE's ``NVTE_NVFP4_DISABLE_*`` variables:

    - weights in 16x16 blocks, which serve both of their GEMMs (``disable_2d_quantization``: 1x16);
    - the weight gradient's operands (the columnwise usages of the input and the output gradient)
      pass a 16-point random Hadamard transform along the tokens first, with TE's fixed sign
      vector, rounded to BF16 (``disable_rht``);
    - output gradients are rounded stochastically, in both usages (``disable_stochastic_rounding``);
      the draws come from torch's generator, so a seeded run repeats.

    ``fp8_format`` names the block scales' format (E4M3), as in TE."""

    fp8_format: str = "E4M3"
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    kind: ClassVar[str] = "nvfp4"

    def format_for(self, pass_: str) -> Fp8Format:
        """E2M1 in both passes: what the monitor logs (the block scales are E4M3)."""
        from ..formats import get_format

        return get_format("e2m1")


BLOCK_RECIPES = (MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling)
Recipe = DelayedScaling | CurrentScaling | MXFP8BlockScaling | Float8BlockScaling | NVFP4BlockScaling
_KINDS: dict[str, type] = {"delayed": DelayedScaling, "current": CurrentScaling, "mxfp8": MXFP8BlockScaling,
                           "block128": Float8BlockScaling, "nvfp4": NVFP4BlockScaling}


def recipe_from_dict(d: dict[str, Any]) -> Recipe:
    """Rebuild a recipe from :meth:`to_dict` output (e.g. read back from the run store)."""
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError(f"recipe dict needs a 'kind' key ({sorted(_KINDS)}), got {d!r}")
    kind = d["kind"]
    if kind not in _KINDS:
        raise ValueError(f"unknown recipe kind {kind!r}; expected one of {sorted(_KINDS)}")
    cls = _KINDS[kind]
    fields_ = {k: v for k, v in d.items() if k != "kind"}
    unknown = set(fields_) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} for recipe kind {kind!r}")
    return cls(**fields_)
