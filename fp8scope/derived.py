"""The one table of statistics derived from a ``tensors`` row (headroom, underflow %, ...).

Detection, the report's figures, ``fp8scope export`` and the dashboard all read these entries,
so a statistic means the same thing on every screen. Each entry carries its SQL expression (for
DuckDB over the run's Arrow tables) and a numpy function of the same columns (for the
dashboard's rollup and detection's row features); ``tests/test_derived.py`` checks that the two
agree on a real run.

Definitions that matter:

* percentages of *elements* for overflow and saturation (``numel``), but underflow is a share of
  the *non-zero finite* values: zeros cannot underflow, and a tensor that is 90 % exact zeros
  (ReLU, padding) is not "90 % fine"; its *shallow* part leaves out the values flushed from deep
  under the threshold (``underflow_deep``), a tail of near-zeros rather than a bulk pressed under;
  ``below_normal`` says where the bulk sits: the share of the non-zero values under the normal range;
* headroom in binades, ``log2(fp8_max * scale_inv / amax)``: < 0 means the amax overflowed the
  range the scale in use can represent, large means the scale wastes range (a stale scale);
* non-finite, NaN or Inf amaxes and empty tensors give NULL / NaN, never 0: a missing value must
  not look healthy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

Get = Callable[[str], np.ndarray]  # column name -> float64 array (NaN where NULL)


@dataclass(frozen=True)
class Derived:
    key: str
    label: str
    sql: str  # per row, over the tensors table
    fn: Callable[[Get], np.ndarray]  # per row, numpy
    worst: str  # "max" or "min": which end is bad, for bucket aggregates
    columns: tuple[str, ...]  # tensors columns it reads


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1.0), np.nan)


def representable(get: Get) -> np.ndarray:
    """The largest magnitude the scale in use can represent, fp8_max * scale_inv (NaN when unknown)."""
    with np.errstate(invalid="ignore", over="ignore"):
        r = get("fp8_max") * get("scale_inv")
    return np.where(np.isfinite(r) & (r > 0), r, np.nan)


def nonzero_finite(get: Get) -> np.ndarray:
    """Elements that can underflow: neither zero nor non-finite."""
    return get("numel") - np.nan_to_num(get("zeros"), nan=0.0) - np.nan_to_num(get("nonfinite"), nan=0.0)


def underflow_fraction(get: Get) -> np.ndarray:
    return _safe_div(get("underflow"), nonzero_finite(get))


def shallow_underflow_fraction(get: Get) -> np.ndarray:
    """The share of the non-zero finite values that flush from within ``DEEP_UNDERFLOW_BINADES`` of
    the threshold (``underflow - underflow_deep``): the values a scale pressed under. A run logged
    before ``underflow_deep`` existed (null) counts all of its underflow as shallow."""
    return _safe_div(get("underflow") - np.nan_to_num(get("underflow_deep"), nan=0.0), nonzero_finite(get))


def deep_underflow_share(get: Get) -> np.ndarray:
    """The share of the flushed values that flushed from 4+ binades under the threshold (NaN where
    nothing flushed, or in a run logged before ``underflow_deep`` existed)."""
    return _safe_div(get("underflow_deep"), get("underflow"))


def below_normal_fraction(get: Get) -> np.ndarray:
    """The share of the non-zero finite values that the cast leaves under the format's smallest normal
    (flushed, or a subnormal with fewer mantissa bits): where the bulk sits. A scale pressed under by
    an outlier puts a large part of the tensor there; a tail of small values that crosses the flush
    threshold (GELU's negative tail) a few % more than it flushes. NaN in a run logged before
    ``below_normal`` existed."""
    return _safe_div(get("below_normal"), nonzero_finite(get))


def overflow_fraction(get: Get) -> np.ndarray:
    return _safe_div(get("overflow"), get("numel"))


def saturated_fraction(get: Get) -> np.ndarray:
    return _safe_div(get("saturated"), get("numel"))


def amax_over_range(get: Get) -> np.ndarray:
    a = get("amax")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isfinite(a), a / representable(get), np.nan)


def _log2_pos(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isfinite(x) & (x > 0), np.log2(np.where(x > 0, x, 1.0)), np.nan)


def _headroom(get: Get) -> np.ndarray:
    return -_log2_pos(amax_over_range(get))


_RANGE_SQL = "(case when isfinite(fp8_max * scale_inv) and fp8_max * scale_inv > 0 then fp8_max * scale_inv end)"
_AMAX_SQL = "(case when isfinite(amax) and amax > 0 then amax end)"
_NZ_SQL = "nullif(numel - coalesce(zeros, 0) - coalesce(nonfinite, 0), 0)"

DERIVED: dict[str, Derived] = {d.key: d for d in (
    Derived("log2_amax", "amax (log2)", f"log2({_AMAX_SQL})", lambda g: _log2_pos(g("amax")), "max", ("amax",)),
    Derived("headroom", "amax headroom, binades: log2(fp8_max*scale_inv/amax); < 0 = overflow",
            f"log2({_RANGE_SQL} / {_AMAX_SQL})", _headroom, "min", ("amax", "fp8_max", "scale_inv")),
    Derived("amax_over_range", "amax / representable range (> 1 = clipped)",
            f"(case when isfinite(amax) then amax end) / {_RANGE_SQL}", amax_over_range, "max",
            ("amax", "fp8_max", "scale_inv")),
    Derived("overflow_pct", "overflow % of elements", "100.0 * overflow / nullif(numel, 0)",
            lambda g: 100.0 * overflow_fraction(g), "max", ("overflow", "numel")),
    Derived("underflow_pct", "underflow % of non-zero values", f"100.0 * underflow / {_NZ_SQL}",
            lambda g: 100.0 * underflow_fraction(g), "max", ("underflow", "numel", "zeros", "nonfinite")),
    Derived("underflow_shallow_pct", "underflow % pressed under: flushed from just below the threshold",
            f"100.0 * (underflow - coalesce(underflow_deep, 0)) / {_NZ_SQL}",
            lambda g: 100.0 * shallow_underflow_fraction(g), "max",
            ("underflow", "underflow_deep", "numel", "zeros", "nonfinite")),
    Derived("below_normal_pct",
            "% of non-zero values under the normal range (flushed or subnormal): the bulk's precision",
            f"100.0 * below_normal / {_NZ_SQL}", lambda g: 100.0 * below_normal_fraction(g), "max",
            ("below_normal", "numel", "zeros", "nonfinite")),
    Derived("saturated_pct", "saturation % of elements", "100.0 * saturated / nullif(numel, 0)",
            lambda g: 100.0 * saturated_fraction(g), "max", ("saturated", "numel")),
    Derived("sqnr_db", "quantization SQNR dB (low = bad)", "sqnr_db", lambda g: g("sqnr_db"), "min", ("sqnr_db",)),
    Derived("qerr_log10", "quantization error log10(MSE)", "log10(nullif(qerr_mse, 0))",
            lambda g: np.log10(np.where(g("qerr_mse") > 0, g("qerr_mse"), np.nan)), "max", ("qerr_mse",)),
    Derived("nonfinite", "non-finite elements", "cast(nonfinite as double)", lambda g: g("nonfinite"), "max",
            ("nonfinite",)),
)}
