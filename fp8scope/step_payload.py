"""One step's capture as it travels from the training thread to the writer: the contract between
``capture`` (which fills it) and the writer side (``step_records``, ``writer_thread``,
``distributed.writer``), which decode it. Both sides import this module; neither imports the other.

A step's rows come in two widths, both on the device until the step's single transfer:

- *wide* rows, ``N_WIDE`` float64 values laid out as ``WIDE_FIELDS`` (full stats), which the
  host reorders into ``schema.STAT_FIELDS``;
- *narrow* rows, ``CHEAP_FIELDS`` (the logged amax and the scales in use), what a cheap step
  records without reading the tensor where the recipe already did.

``host`` is one flat float64 array: the wide rows, then the narrow rows, then the rows of other
recipes measured on the same tensors (``schema.RECIPE_FIELDS``), then the scalar tensors.
``order`` lists the captures in execution order as indices into the wide rows (``>= 0``) or the
narrow rows (``-1 - i``). A narrow row's ``nonfinite`` is a flag, 1 where its amax is NaN or Inf
(a non-finite amax is exactly a non-finite element); its ``numel`` comes from the host-side shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8scope.schema import FIELD_INDEX, N_FIELDS, RECIPE_FIELDS, STAT_FIELDS

N_RECIPE = len(RECIPE_FIELDS)

# What a wide (full-stats) row holds on the device, in this order: first the values reduced by a
# maximum (the two minima as maxima of their negation, turned back before they are stored), then
# the sums. Why not STAT_FIELDS' order: compiled, a full-stats pass ends in one max and one sum
# reduction, and each writes its half of this row in place; putting the values in STAT_FIELDS'
# order on the device took one more kernel launch per tensor, where reordering on the host is free.
# ``recorded_amax`` (TE's amax, NaN ignored: what a what-if scaling state records) is not logged;
# the four unused slots (copies of the expected amax) give both halves ten columns, so that the
# compiled pass's two reductions over the rows read per-row matrices of one shape. The three
# counts under a threshold hold the zeros too (``|x * scale|`` at or below the flush thresholds,
# under the smallest normal: one comparison a pass, where "non-zero and below" takes two);
# :func:`wide_stats` takes the zeros out on the host.
WIDE_FIELDS = ("amax", "min_nonzero", "recorded_amax", "scale", "scale_inv", "expected_amax", "unused6", "unused7",
               "unused8", "unused9", "numel", "zeros", "nonfinite", "overflow", "underflow_or_zero", "saturated",
               "underflow_deep_or_zero", "below_normal_or_zero", "sq_err", "sq_signal")
N_WIDE = len(WIDE_FIELDS)
N_WIDE_MAX = 10  # the first ten are reduced by a maximum
WIDE_INDEX = {name: i for i, name in enumerate(WIDE_FIELDS)}
_ZERO_HOLDERS = {"underflow": "underflow_or_zero", "underflow_deep": "underflow_deep_or_zero",
                 "below_normal": "below_normal_or_zero"}
_WIDE_TO_STAT = [WIDE_INDEX[_ZERO_HOLDERS.get(name, name)] for name, _ in STAT_FIELDS]
_FLUSH_STAT = [FIELD_INDEX[name] for name in _ZERO_HOLDERS]

# What a narrow (cheap) row holds on the device, in this order.
CHEAP_FIELDS = ("amax", "scale", "scale_inv", "expected_amax")
N_CHEAP = len(CHEAP_FIELDS)
_CHEAP_INDEX = [FIELD_INDEX[f] for f in CHEAP_FIELDS]


@dataclass(frozen=True)
class TensorKey:
    """Identity of one monitored tensor; its row in the store carries these strings."""

    layer: str
    role: str
    source: str
    fmt: str
    fp8_max: float
    shape: tuple[int, ...]
    recipe: str | None = None  # the recipe kind its scales come from (``StepCollector.layer_recipe``)


@dataclass
class StepPayload:
    """Everything the writer thread needs to turn one step into record batches."""

    step: int
    full: bool
    wall_time: float
    key_ids: list[int]  # one per capture, in execution order
    order: list[int]  # per capture: wide row index (>= 0) or -1 - narrow row index
    n_wide: int
    n_narrow: int
    host: Any  # torch tensor, flat float64: wide rows, narrow rows, then the scalar tensors
    ready: Any  # a CUDA event to wait on, or None when ``host`` is already valid
    scalar_names: list[str]  # names of the scalar tensors at the tail of ``host``
    host_scalars: dict[str, float] = field(default_factory=dict)  # scalars given as Python numbers
    numels: list[int] = field(default_factory=list)  # per capture (-1: no tensor at hand)
    # other recipes measured on the same tensors (full steps with whatif_recipes): rows of
    # RECIPE_FIELDS after the narrow rows in ``host``, each (key id, recipe name)
    n_recipe: int = 0
    recipe_keys: list[tuple[int, str]] = field(default_factory=list)
    focus: frozenset = frozenset()  # on a cheap step, the layers that took full stats (a closer look)

    @property
    def n_rows(self) -> int:
        return len(self.key_ids)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def _layout(self) -> tuple[np.ndarray, int, int, int]:
        """``host`` as numpy and where its wide, narrow and recipe rows end."""
        arr = self.host.numpy() if hasattr(self.host, "numpy") else np.asarray(self.host)
        w = self.n_wide * N_WIDE
        n = w + self.n_narrow * N_CHEAP
        return arr, w, n, n + self.n_recipe * N_RECIPE

    def _parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The wide rows (as ``STAT_FIELDS``), the narrow rows and the scalar values."""
        arr, w, n, r = self._layout()
        return wide_stats(arr[:w].reshape(self.n_wide, N_WIDE)), arr[w:n].reshape(self.n_narrow, N_CHEAP), arr[r:]

    def recipe_matrix(self) -> np.ndarray:
        """The (n_recipe, N_RECIPE) rows of the other recipes, in ``recipe_keys`` order."""
        arr, _, n, r = self._layout()
        return arr[n:r].reshape(self.n_recipe, N_RECIPE)

    @property
    def all_narrow(self) -> bool:
        """Every capture is a narrow row (a cheap step's usual shape; ``cheap_rows`` orders them)."""
        return self.n_wide == 0


def cheap_rows(payload: StepPayload) -> tuple[np.ndarray, np.ndarray]:
    """A step whose captures are all narrow: its (n_rows, N_CHEAP) rows in execution order, and the
    scalar values."""
    _, narrow, tail = payload._parts()
    idx = [-1 - o for o in payload.order]
    if idx != list(range(len(idx))):
        narrow = narrow[idx]
    return narrow, tail


def wide_stats(rows: np.ndarray) -> np.ndarray:
    """Wide rows (``WIDE_FIELDS``, one per row) as ``STAT_FIELDS`` rows; works on any array with a
    last axis of ``N_WIDE`` (numpy or torch): reordered, and the zeros taken out of the flush counts."""
    out = rows[..., _WIDE_TO_STAT]
    out[..., _FLUSH_STAT] -= rows[..., WIDE_INDEX["zeros"], None]
    return out


def nonfinite_flags(amax: np.ndarray) -> np.ndarray:
    """A narrow row's ``nonfinite``: 1 where the logged amax is NaN or Inf, else 0."""
    return (~np.isfinite(amax)).astype(np.float64)


def widen_cheap_rows(rows: np.ndarray, numels) -> np.ndarray:
    """Narrow rows as ``STAT_FIELDS`` rows: numel from the captures' host-side shapes (-1: no tensor
    at hand), the non-finite flag from the amax, the other full-only fields NaN."""
    matrix = np.full((len(rows), N_FIELDS), np.nan)
    matrix[:, _CHEAP_INDEX] = rows
    numel = np.asarray(numels, dtype=np.float64)
    matrix[:, FIELD_INDEX["numel"]] = np.where(numel >= 0, numel, np.nan)
    matrix[:, FIELD_INDEX["nonfinite"]] = nonfinite_flags(rows[:, 0]) if len(rows) else 0.0
    return matrix


def stats_matrix(payload: StepPayload) -> tuple[np.ndarray, np.ndarray]:
    """The payload's (n_rows, N_FIELDS) stats matrix in execution order, and the scalar values."""
    wide, narrow, tail = payload._parts()
    if payload.n_narrow == 0:
        if payload.order != list(range(payload.n_wide)):
            wide = wide[payload.order]
        return wide, tail
    narrow_numels = [payload.numels[i] for i, o in enumerate(payload.order) if o < 0]
    narrow_pos = [-1 - o for o in payload.order if o < 0]
    widened = np.empty((payload.n_narrow, N_FIELDS))
    widened[narrow_pos] = widen_cheap_rows(narrow[narrow_pos], narrow_numels)
    if payload.n_wide == 0:
        return widened[[-1 - o for o in payload.order]], tail
    both = np.concatenate([wide, widened])
    return both[[o if o >= 0 else payload.n_wide - 1 - o for o in payload.order]], tail
