"""The detection rules: each one a small SQL predicate over per-tensor *features*, plus a message.

A feature row is one tensor at one logged step with its own history folded in (max amax of
the previous N steps, the scale N steps ago, ...). Offline the features come from DuckDB
window functions over the whole run (:mod:`fp8scope.detect.features`); online they come
from a small rolling state per tensor (:mod:`fp8scope.detect.online`). Both then run the
*same* predicates below, so a run gets the same events online and offline.

Rule kinds:

* :class:`RowRule` - a predicate per tensor row. ``edge=True`` fires only on the first row of a
  run of rows where the predicate holds (per tensor), so a condition that lasts 100 steps is one
  event, not 100. Predicates on full-stats columns are NULL on cheap rows and then skipped.
* scalar rules (loss / grad-norm spikes), NaN provenance, layer outliers, cross-rank and shadow
  rules are built from the same pieces in :mod:`fp8scope.detect.engine`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from fp8scope.detect.config import DetectConfig
from fp8scope.formats import get_format

SEVERITIES = ("info", "warning", "critical")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def _g(v: float) -> str:
    """A float literal for SQL."""
    return repr(float(v))


def binades_case(col: str = "fp8_format") -> str:
    """SQL: the binades one scale covers, per element format (from torch.finfo via formats.py)."""
    parts = []
    for name in ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"):
        try:
            parts.append(f"when '{name}' then {_g(get_format(name).binades)}")
        except ValueError:
            continue
    return f"(case {col} {' '.join(parts)} else null end)"


def _fmt(v) -> str:
    if v is None:
        return "?"
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


def _pct(v) -> str:
    try:
        return f"{100 * float(v):.2f}%"
    except (TypeError, ValueError):
        return "?"


def _where(r: dict) -> str:
    return f"{r['layer']} {r['tensor']}"


@dataclass(frozen=True)
class RowRule:
    """One per-tensor-row rule: SQL over feature columns (see features.FEATURE_COLUMNS)."""

    name: str
    cond: str  # SQL boolean; NULL means "cannot judge this row" (skipped, edge state unchanged)
    value: str  # SQL: the measured value
    threshold: str  # SQL: the threshold it was compared with
    severity: str  # SQL: 'info' / 'warning' / 'critical'
    message: Callable[[dict], str]
    edge: bool = True
    # row-level SQL (no window columns): the rule can judge this row. Edge rules compare with the
    # previous *evaluable* row of the same tensor (full-stats rules skip cheap rows).
    evaluable: str = "true"


def _early(cfg: DetectConfig, sev: str) -> str:
    """Severity SQL that drops to 'info' during warm-up."""
    return f"(case when step < {int(cfg.warmup_steps)} then 'info' else {sev} end)"


def row_rules(cfg: DetectConfig) -> list[RowRule]:
    mh = int(cfg.min_history)
    uf_thr = f"(case when is_grad then {_g(cfg.underflow_grad_warn)} else {_g(cfg.underflow_warn)} end)"
    rules = [
        RowRule(
            "amax_spike",
            cond=f"n_prev >= {mh} and prev_max > 0 and amax_f > {_g(cfg.spike_factor)} * prev_max",
            value="amax_f / prev_max",
            threshold=_g(cfg.spike_factor),
            severity=_early(cfg, "'warning'"),
            edge=False,
            message=lambda r: (
                f"{_where(r)}: amax {_fmt(r['amax'])} is {_fmt(r['value'])}x the max of its last "
                f"{int(r['n_prev'])} logged steps ({_fmt(r['prev_max'])})"
            ),
        ),
        RowRule(
            "saturation",
            evaluable="sat_ratio is not null",
            cond=(
                f"sat_ratio > 1 + {_g(cfg.sat_tol)} and (sat_ratio >= {_g(cfg.sat_warn_ratio)} "
                f"or coalesce(ovf_frac, 0) >= {_g(cfg.sat_warn_fraction)})"
            ),
            value="sat_ratio",
            threshold=_g(cfg.sat_warn_ratio),
            severity=_early(
                cfg, f"(case when sat_ratio >= {_g(cfg.sat_critical_ratio)} then 'critical' else 'warning' end)"
            ),
            message=lambda r: (
                f"{_where(r)}: amax {_fmt(r['amax'])} is {_fmt(r['value'])}x the largest value the scale in use "
                f"can represent ({_fmt(r['rng'])} = fp8_max x scale_inv): values were clipped"
                + (f", {_pct(r['ovf_frac'])} of elements overflowed" if r.get("ovf_frac") is not None else "")
            ),
        ),
        RowRule(
            "saturation_rate",
            cond=f"n_rate >= {mh} and n_sat >= {_g(cfg.sat_rate_threshold)} * n_rate",
            value="n_sat / n_rate",
            threshold=_g(cfg.sat_rate_threshold),
            severity=_early(cfg, "'warning'"),
            message=lambda r: (
                f"{_where(r)}: saturated (amax >= {_fmt(cfg.sat_rate_min_ratio)}x the representable range) in "
                f"{_pct(r['value'])} of its last {int(r['n_rate'])} logged steps: the scale keeps lagging "
                "behind a growing amax"
            ),
        ),
        RowRule(
            "stale_scale",
            evaluable="stale_r is not null",
            cond=(
                f"n_prev >= 1 and stale_r >= {_g(cfg.stale_ratio)} and prev_max >= 0.5 * expected_amax"
            ),
            value="stale_r",
            threshold=_g(cfg.stale_ratio),
            severity=_early(cfg, "'warning'"),
            message=lambda r: (
                f"{_where(r)}: the scale still comes from amax {_fmt(r['expected_amax'])}, {_fmt(r['value'])}x "
                f"today's amax {_fmt(r['amax'])} (a past spike sits in the amax history)"
                + (f"; {_pct(r['uf_frac'])} of non-zeros underflow" if r.get("uf_frac") is not None else "")
            ),
        ),
        RowRule(
            "underflow",
            evaluable="uf_frac is not null",
            cond=f"n_prev >= 1 and uf_frac >= {uf_thr}",  # the first row uses the recipe's initial scale
            value="uf_frac",
            threshold=uf_thr,
            severity=(f"(case when uf_frac >= {_g(cfg.underflow_critical)} then 'critical' else 'warning' end)"),
            message=lambda r: (
                f"{_where(r)} ({r['fp8_format']}): {_pct(r['value'])} of non-zero values flush to zero in the cast "
                f"(threshold {_pct(r['threshold'])})"
            ),
        ),
        RowRule(
            "dynamic_range",
            evaluable="dr is not null",
            cond=f"n_prev >= 1 and dr > binades + {_g(cfg.dynamic_range_excess)}",
            value="dr",
            threshold=f"binades + {_g(cfg.dynamic_range_excess)}",
            severity="'info'",
            message=lambda r: (
                f"{_where(r)}: dynamic range {_fmt(r['value'])} binades (amax {_fmt(r['amax'])} / min non-zero "
                f"{_fmt(r['min_nonzero'])}) exceeds the {_fmt(r['binades'])} binades one {r['fp8_format']} scale covers"
            ),
        ),
        RowRule(
            "scale_kept",
            cond="prev_bad_amax and scale_inv_f is not null and scale_inv_f = prev_scale_inv",
            value="scale_inv_f",
            threshold="cast(null as double)",
            severity="'warning'",
            message=lambda r: (
                f"{_where(r)}: the previous step's amax was NaN/Inf and the recipe silently kept the old scale "
                f"(scale_inv {_fmt(r['value'])}): the scale no longer follows the data"
            ),
        ),
        RowRule(
            "scale_collapse",
            evaluable="scale_inv_f is not null",
            cond=(
                f"n_si > {int(cfg.collapse_window)} and si_old > 0 and scale_inv_f >= {_g(cfg.collapse_factor)} * si_old "
                f"and scale_inv_f >= si_max and max_jump <= {_g(cfg.collapse_max_jump)}"
            ),
            value="scale_inv_f / si_old",
            threshold=_g(cfg.collapse_factor),
            severity=_early(cfg, "'warning'"),
            message=lambda r: (
                f"{_where(r)}: scale_inv rose {_fmt(r['value'])}x over the last {int(cfg.collapse_window)} logged "
                f"steps, at most {_fmt(r['max_jump'])}x in one step (scale {_fmt(r['scale'])}): the scale is collapsing toward zero"
            ),
        ),
        RowRule(
            "layer_outlier",
            evaluable="l2 is not null",
            cond=(
                f"n_kind >= {int(cfg.outlier_min_layers)} and z >= {_g(cfg.outlier_z)} "
                f"and dev >= {_g(cfg.outlier_min_binades)}"
            ),
            value="z",
            threshold=_g(cfg.outlier_z),
            severity=_early(cfg, f"(case when dev >= {_g(cfg.outlier_warn_binades)} then 'warning' else 'info' end)"),
            message=lambda r: (
                f"{_where(r)}: amax {_fmt(r['amax'])} is {_fmt(2 ** r['dev'])}x the median of the "
                f"{int(r['n_kind'])} layers of its kind ({r['kind']}), robust z {_fmt(r['value'])}"
            ),
        ),
    ]
    return [r for r in rules if r.name not in cfg.disabled]


# Rules that are not RowRules, for `--rule` validation and docs.
OTHER_RULES = ("nan_origin", "nonfinite", "loss_spike", "grad_norm_spike", "loss_nonfinite",
               "fp8_vs_bf16", "cross_rank_scale_mismatch")


def all_rule_names(cfg: DetectConfig | None = None) -> list[str]:
    return [r.name for r in row_rules(cfg or DetectConfig())] + list(OTHER_RULES)
