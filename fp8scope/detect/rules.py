"""The detection rules: each one a small predicate over per-tensor *features*, plus a message.

A feature row is one tensor at one logged step with its own history folded in (max amax of
the previous N steps, the scale N steps ago, ...). Offline the features come from numpy
windows over the whole run (:mod:`fp8scope.detect.features`); online they come from a small
rolling state per tensor (:mod:`fp8scope.detect.online`). Both then call the *same* rule
functions below (elementwise numpy over a dict of feature columns, NaN = missing), so a run
gets the same events online and offline. Each rule's thresholds and message live here only.

Rule kinds:

* :class:`RowRule` - a predicate per tensor row. ``edge=True`` fires only on the first row of a
  run of rows where the predicate holds (per tensor), so a condition that lasts 100 steps is one
  event, not 100. Predicates on full-stats columns are missing (NaN) on cheap rows and then skipped.
* optimizer-side rules (loss / grad-norm spikes, lr changes: :mod:`fp8scope.detect.scalar_rules`),
  FP8-vs-BF16 compares (:mod:`fp8scope.detect.shadow_rule`), NaN provenance and cross-rank rules
  (:mod:`fp8scope.detect.engine`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fp8scope.detect.config import DetectConfig
from fp8scope.formats import DEEP_UNDERFLOW_BINADES
from fp8scope.schema import base_role

SEVERITIES = ("info", "warning", "critical")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


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


def _count(v) -> str:
    try:
        return f"{int(v):,}"
    except (TypeError, ValueError, OverflowError):
        return "?"


def _where(r: dict) -> str:
    return f"{r['layer']} {r['tensor']}"


@dataclass(frozen=True)
class RowRule:
    """One per-tensor-row rule over a dict ``c`` of numpy feature columns (one entry per row).

    Float columns carry NaN where the value is missing (SQL NULL): comparisons with NaN are
    false, so a rule that cannot judge a row does not fire. ``cond``, ``value``, ``threshold``,
    ``severity`` and ``evaluable`` are elementwise functions of ``c``; the offline engine calls
    them over all rows of a run, the online detector over one step's rows.
    """

    name: str
    cond: Callable[[dict], np.ndarray]  # bool per row
    value: Callable[[dict], np.ndarray]  # the measured value
    threshold: Callable[[dict], Any]  # the threshold it was compared with (array or scalar)
    severity: Callable[[dict], Any]  # 'info' / 'warning' / 'critical' (array or scalar)
    message: Callable[[dict], str]
    edge: bool = True
    # the rule can judge this row (row-level, no window columns); None: every row. Edge rules
    # compare with the previous *evaluable* row of the same tensor (full-stats rules skip cheap rows).
    evaluable: Callable[[dict], np.ndarray] | None = None


def _early(cfg: DetectConfig, c: dict, sev):
    """Severity that drops to 'info' while the tensor warms up: fewer than ``warmup_rows`` logged rows of
    its own with data (amax > 0) before this one (per tensor, not a fixed step: a layer first seen late,
    a run resumed, or a MoE expert that rarely gets tokens warms up on its own history)."""
    return np.where(c["n_prev"] < int(cfg.warmup_rows), "info", sev)


def _early_window(cfg: DetectConfig, c: dict, sev, window: int):
    """As :func:`_early` for a rule over a window of rows: the window must lie past the warm-up too
    (a fresh model's tensors drift fast relative to each other and their scales), as far as the
    row count reaches (``n_prev`` counts at most ``spike_window`` rows)."""
    need = min(int(cfg.warmup_rows) + int(window), int(cfg.spike_window))
    return np.where(c["n_prev"] < need, "info", sev)


def _nn(x):
    """Not missing."""
    return ~np.isnan(x)


def _z(x):
    """coalesce(x, 0)."""
    return np.where(np.isnan(x), 0.0, x)


def _div(a, b):
    with np.errstate(invalid="ignore", divide="ignore"):
        return a / b


def row_rules(cfg: DetectConfig) -> list[RowRule]:
    mh = int(cfg.min_history)
    spike, tol, sc = float(cfg.spike_factor), float(cfg.sat_tol), float(cfg.sat_critical_ratio)
    sf, rt, st = float(cfg.sat_warn_fraction), float(cfg.sat_rate_threshold), float(cfg.stale_ratio)
    ufw, ufg, ufc = float(cfg.underflow_warn), float(cfg.underflow_grad_warn), float(cfg.underflow_critical)
    dre, cw, cf, cj = float(cfg.dynamic_range_excess), int(cfg.collapse_window), float(cfg.collapse_factor), float(cfg.collapse_max_jump)
    oz, ob, ow, om = float(cfg.outlier_z), float(cfg.outlier_min_binades), float(cfg.outlier_warn_binades), int(cfg.outlier_min_layers)
    mm, smv = float(cfg.mismatch_factor), float(cfg.share_min_values)
    tb, tj = float(cfg.trend_binades), float(cfg.trend_max_jump_share)
    spn, spz = int(cfg.spread_min_layers), float(cfg.spread_z)

    def within_spread(c):  # in a kind with a spread to measure (a MoE's experts), not above it
        return (c["n_kind"] >= spn) & ~(c["z"] >= spz)

    def uf_thr(c):  # a 4-bit recipe's own loss on a healthy tensor raises the bar (detect.design_loss)
        return np.maximum(np.where(c["is_grad"], ufg, ufw), c["uf_floor"])

    def ovf_thr(c):
        return np.maximum(sf, c["ovf_floor"])

    def overflow_share(c):  # the overflowed share, where enough values overflowed to make it a rate
        return np.where(_z(c["ovf_count"]) >= smv, _z(c["ovf_frac"]), 0.0)

    rules = [
        RowRule(
            "amax_spike",
            cond=lambda c: (c["n_prev"] >= mh) & (c["prev_max"] > 0) & (c["amax_f"] > spike * c["prev_max"]),
            value=lambda c: _div(c["amax_f"], c["prev_max"]),
            threshold=lambda c: spike,
            # within a large kind's spread it is info: an expert's gradient joining its peers
            severity=lambda c: np.where(within_spread(c), "info", _early(cfg, c, "warning")),
            edge=False,
            message=lambda r: (
                f"{_where(r)}: amax {_fmt(r['amax'])} is {_fmt(r['value'])}x the max of its last "
                f"{int(r['n_prev'])} logged steps with data ({_fmt(r['prev_max'])})"
                + (f", not above the spread of the {int(r['n_kind'])} layers of its kind (z {_fmt(r['z'])})"
                   if (r.get("n_kind") or 0) >= spn and not (r.get("z") is not None and r["z"] >= spz) else "")
            ),
        ),
        RowRule(
            "saturation",
            evaluable=lambda c: _nn(c["sat_ratio"]),
            cond=lambda c: (c["sat_ratio"] > 1 + tol) & ((c["sat_ratio"] >= cfg.sat_warn_ratios(c["is_grad"]))
                                                         | (overflow_share(c) >= ovf_thr(c))),
            value=lambda c: c["sat_ratio"],
            threshold=lambda c: cfg.sat_warn_ratios(c["is_grad"]),
            # clipping by a large factor (sat_critical_ratio and up) is never muted by warm-up
            severity=lambda c: np.where(c["sat_ratio"] >= sc, "critical", _early(cfg, c, "warning")),
            message=lambda r: (
                f"{_where(r)}: amax {_fmt(r['amax'])} is {_fmt(r['value'])}x the largest value the scale in use "
                f"can represent ({_fmt(r['rng'])} = fp8_max x scale_inv): values were clipped"
                + (f", {_pct(r['ovf_frac'])} of elements overflowed" if r.get("ovf_frac") is not None else "")
            ),
        ),
        RowRule(
            "saturation_rate",
            cond=lambda c: (c["n_rate"] >= mh) & (c["n_sat"] >= rt * c["n_rate"]),
            value=lambda c: _div(c["n_sat"].astype(float), c["n_rate"]),
            threshold=lambda c: rt,
            # a window rule: a fresh model's gradients outgrow their delayed scales step after step, and
            # a window reaching back into those steps said so again after the warm-up (a clean Phi's
            # q_proj gradient, 21 % of its first 64 rows)
            severity=lambda c: _early_window(cfg, c, "warning", int(cfg.sat_rate_window)),
            message=lambda r: (
                f"{_where(r)}: saturated (amax >= {_fmt(cfg.sat_rate_min_ratio)}x the representable range) in "
                f"{_pct(r['value'])} of its last {int(r['n_rate'])} logged steps: the scale keeps lagging "
                "behind a growing amax"
            ),
        ),
        RowRule(
            "stale_scale",
            evaluable=lambda c: _nn(c["stale_r"]),
            cond=lambda c: (c["n_prev"] >= 1) & (c["stale_r"] >= st) & (c["prev_max"] >= 0.5 * c["expected_amax"]),
            value=lambda c: c["stale_r"],
            threshold=lambda c: st,
            # E4M3 (17.8 binades) has little room to waste: stale_ratio (30x, 5 binades) already underflows a
            # few % of an activation. E5M2 has 31.8: a fresh model's large early gradients kept by a long history
            # (TE's default 1,024) waste 5-7 binades harmlessly, so a wide format warns only when half its range
            # is idle (65,536x: a broken loss scale); below that it is info and the underflow rule flags what
            # it measures
            severity=lambda c: np.where(
                np.log2(np.where(c["stale_r"] > 0, c["stale_r"], 1.0)) >= np.where(c["binades"] > 20, c["binades"] / 2, 0),
                _early(cfg, c, "warning"), "info"),
            message=lambda r: (
                f"{_where(r)}: the scale still comes from amax {_fmt(r['expected_amax'])}, {_fmt(r['value'])}x "
                f"today's amax {_fmt(r['amax'])} (a past spike sits in the amax history)"
                + (f"; {_pct(r['uf_frac'])} of non-zeros underflow" if r.get("uf_frac") is not None else "")
            ),
        ),
        RowRule(
            # The scale comes from an amax this tensor never had (in the whole run, nor today): a reset scale (a
            # checkpoint resumed without its FP8 state gives scale 1), a corrupted or foreign amax history.
            # Read from a cheap row's scale and amax alone, so it is seen on every step, not only on
            # full-stats steps. Not before the tensor's first non-zero amax: until one is recorded, delayed
            # scaling keeps its initial scale 1 (TE updates a scale only where the amax is > 0), so the first
            # row with data uses it, at step 0 or, for a MoE expert that got no token until then, later.
            "scale_mismatch",
            evaluable=lambda c: _nn(c["expected_amax"]) & (c["expected_amax"] > 0) & (c["amax_f"] > 0),
            cond=lambda c: ((c["n_prev"] >= 1) & (c["ever_max"] > 0) & (c["amax_f"] > 0)
                            & (c["expected_amax"] >= mm * np.fmax(c["ever_max"], c["amax_f"]))),
            value=lambda c: _div(c["expected_amax"], np.fmax(c["ever_max"], c["amax_f"])),
            threshold=lambda c: mm,
            severity=lambda c: "warning",
            message=lambda r: (
                f"{_where(r)}: the scale in use (scale {_fmt(r['scale'])}) comes from an amax of "
                f"{_fmt(r['expected_amax'])}, {_fmt(r['value'])}x anything this tensor logged before (today "
                f"{_fmt(r['amax'])}): a reset scale, a corrupted or foreign amax history; its values sit "
                f"{_fmt(math.log2(max(r['value'], 1.0)))} "
                f"binades below the format's range, so small ones flush to zero"
                + (f" ({_pct(r['uf_frac'])} of non-zeros underflow)" if r.get("uf_frac") is not None else "")
            ),
        ),
        RowRule(
            "underflow",
            evaluable=lambda c: _nn(c["uf_frac"]),
            # the first row with data (a non-zero amax before it: ever_max) uses the initial scale; a share
            # of fewer than share_min_values flushed values is not a rate (an expert with few tokens)
            cond=lambda c: ((c["n_prev"] >= 1) & (c["ever_max"] > 0) & (c["uf_frac"] >= uf_thr(c))
                            & (c["uf_count"] >= smv)),
            value=lambda c: c["uf_frac"],
            threshold=uf_thr,
            # the alarm is for values the scale pressed under, which flush evenly from just below the
            # threshold; a flush made mostly of values 4+ binades deeper (heads whose output is ~0: T5's
            # attention, 2-3 % of its output projection's inputs, 66-89 % of them deep), whose shallow
            # part stays under the threshold, is a tail of near-zeros that adds nothing and that no
            # scale keeps: told, not alarmed. So is a flush whose values thin out above the threshold,
            # the bulk in the normal range (GELU's negative tail: under 3 values under the normal range
            # per flushed one), where a scale pressed under crowds the range just above the threshold
            # (5-9 per flushed value in the suite's outliers). All of it counts at the critical
            # share; a run logged without underflow_deep or below_normal judges all of it as before
            severity=lambda c: np.select(
                [c["uf_frac"] >= ufc,
                 cfg.near_zero_tail(c["uf_deep_share"], c["uf_shallow"], uf_thr(c), c["uf_below_normal"],
                                    c["uf_frac"])],
                ["critical", "info"], "warning"),
            message=lambda r: (
                f"{_where(r)} ({r['fp8_format']}): {_pct(r['value'])} of non-zero values flush to zero in the cast "
                f"({_count(r['uf_count'])} values; threshold {_pct(r['threshold'])})"
                + (("" if r["severity"] != "info" else
                    f"; {_pct(r['value'] - r['uf_shallow'])} flush from {DEEP_UNDERFLOW_BINADES}+ binades under the "
                    f"threshold and {_pct(r['uf_shallow'])} from just below it: mostly a tail of near-zero values (a "
                    f"head or channel whose output is ~0), not values the scale pressed under"
                    if cfg.near_zero_tail(r["uf_deep_share"], r["uf_shallow"], r["threshold"]) else
                    f"; {_pct(r['uf_below_normal'])} of the non-zero values sit under the normal range (flushed or "
                    f"subnormal), {_fmt(r['uf_below_normal'] / r['value'])}x what flushed: a tail of small values "
                    f"that thins out above the threshold, not a bulk the scale pressed under (which crowds the range "
                    f"there)"))
            ),
        ),
        RowRule(
            "dynamic_range",
            evaluable=lambda c: _nn(c["dr"]),
            cond=lambda c: (c["n_prev"] >= 1) & (c["dr"] > c["binades"] + dre),
            value=lambda c: c["dr"],
            threshold=lambda c: c["binades"] + dre,
            severity=lambda c: "info",
            message=lambda r: (
                f"{_where(r)}: dynamic range {_fmt(r['value'])} binades (amax {_fmt(r['amax'])} / min non-zero "
                f"{_fmt(r['min_nonzero'])}) exceeds the {_fmt(r['binades'])} binades one {r['fp8_format']} scale covers"
            ),
        ),
        RowRule(
            "scale_kept",
            cond=lambda c: c["prev_bad_amax"] & _nn(c["scale_inv_f"]) & (c["scale_inv_f"] == c["prev_scale_inv"]),
            value=lambda c: c["scale_inv_f"],
            threshold=lambda c: float("nan"),
            severity=lambda c: "warning",
            message=lambda r: (
                f"{_where(r)}: the previous step's amax was NaN/Inf and the recipe silently kept the old scale "
                f"(scale_inv {_fmt(r['value'])}): the scale no longer follows the data"
            ),
        ),
        RowRule(
            # one per-tensor scale collapsing toward zero; a block recipe's row logs its largest block scale,
            # which rises with the tensor's amax (amax_spike and amax_trend see that growth): not judged.
            # A gradient's is info: its scale follows the loss landscape, which moves it by orders of
            # magnitude in healthy training (a clean DeBERTa's attention gradients, near 1e-8, rose 200x in
            # 12 steps and fell back), and what FP8 pays for a gradient's growth is a clip or a flush, which
            # saturation, saturation_rate and underflow judge
            "scale_collapse",
            evaluable=lambda c: _nn(c["scale_inv_f"]) & ~c["block"],
            cond=lambda c: ((c["n_si"] > cw) & (c["si_old"] > 0) & (c["scale_inv_f"] >= cf * c["si_old"])
                            & (c["scale_inv_f"] >= c["si_max"]) & (c["max_jump"] <= cj)),
            value=lambda c: _div(c["scale_inv_f"], c["si_old"]),
            threshold=lambda c: cf,
            severity=lambda c: np.where(c["is_grad"], "info", _early_window(cfg, c, "warning", cw)),
            message=lambda r: (
                f"{_where(r)}: scale_inv rose {_fmt(r['value'])}x over the last {int(cfg.collapse_window)} logged "
                f"steps, at most {_fmt(r['max_jump'])}x in one step (scale {_fmt(r['scale'])}): "
                + ("the gradient grew step after step; a gradient's scale follows the loss, so this is told, not "
                   "alarmed (a clip or a flush it causes is judged by saturation and underflow)"
                   if base_role(r["tensor"]) == "gradient" else "the scale is collapsing toward zero")
            ),
        ),
        RowRule(
            # A slowly growing outlier (SwiGLU amplification, ../shared/fp8-reference.md §4): the tensor climbs
            # away from the layers of its kind step after step. No spike rule sees it; the scale it sets flushes
            # the values beside it to zero, and a delayed scale saturates only once it outruns the amax
            # history. Fires while it grows. Under a block recipe (MXFP8, 1x128, NVFP4) it is info: each
            # block has its own scale, so the outlier costs its own blocks (a Qwen2's down projection input
            # lost 0.26 % under MXFP8 where current scaling flushed 6.8 % of a Llama's), and the underflow
            # rule warns if those blocks flush beyond the recipe's design loss.
            "amax_trend",
            # forward tensors only: gradients wander relative to their peers in healthy training (measured
            # on clean runs: 4-13x over 50 steps), outlier features are an activation's
            evaluable=lambda c: _nn(c["dev"]) & _nn(c["dev_old"]) & ~c["is_grad"],
            # in a large kind (a MoE's experts) the climb must also leave the kind's spread: in the condition,
            # not the severity, so the event's edge is where it leaves it
            cond=lambda c: ((c["n_kind"] >= om) & (c["dev"] - c["dev_old"] >= tb)
                            & (c["dev_jump"] <= tj * (c["dev"] - c["dev_old"])) & (c["dev"] >= 1.0)
                            & ~within_spread(c)),
            value=lambda c: np.exp2(c["dev"] - c["dev_old"]),
            threshold=lambda c: 2.0 ** tb,
            severity=lambda c: np.where(c["block"], "info", _early_window(cfg, c, "warning", int(cfg.trend_window))),
            message=lambda r: (
                f"{_where(r)}: amax {_fmt(r['amax'])} grew {_fmt(r['value'])}x relative to the {int(r['n_kind'])} "
                f"layers of its kind over its last {int(cfg.trend_window)} logged steps, steadily (at most "
                f"{_fmt(2 ** r['dev_jump'])}x in one step), now {_fmt(2 ** r['dev'])}x their median: a growing "
                "outlier feature; "
                + (f"the {r['recipe']} block scales confine it to the blocks that hold it" if r["block"] else
                   "the scale it sets flushes the values beside it to zero, and a delayed scale saturates once it "
                   "outruns the amax history")
            ),
        ),
        RowRule(
            # One tensor cast to another FP8 format than every other tensor of its role (a gradient in E4M3
            # where the rest are E5M2: 14 binades less range, small gradients flush to zero; an activation in
            # E5M2: one mantissa bit less). A per-layer recipe override gone wrong, not a recipe choice: a
            # whole model on TE's E4M3 recipe is consistent and raises nothing. Read from any row (cheap
            # ones too), once per tensor, never muted by warm-up: it is configuration.
            "format_mismatch",
            cond=lambda c: c["fmt_odd"] & (c["peer_n"] >= om),
            value=lambda c: c["binades"] - c["peer_binades"],
            threshold=lambda c: 0.0,
            severity=lambda c: "warning",
            message=lambda r: (
                f"{_where(r)}: cast to {r['fp8_format']} while the other {int(r['peer_n'])} tensors of its role use "
                f"{r['peer_format']} ({_fmt(abs(r['value']))} binades "
                + ("less range: small values flush to zero" if (r["value"] or 0) < 0 else "more range, less precision")
                + "): a per-layer recipe or format override"
            ),
        ),
        RowRule(
            "layer_outlier",
            evaluable=lambda c: _nn(c["l2"]),
            cond=lambda c: (c["n_kind"] >= om) & (c["z"] >= oz) & (c["dev"] >= ob),
            value=lambda c: c["z"],
            threshold=lambda c: oz,
            # gradients: info only. The first block's gradients sit 10-1,300x above their peers in clean runs
            # (the suite's current-scaling run); a gradient fault shows as stale_scale / underflow instead.
            # Block recipes: info too, the outlier sets only its own blocks' scales (as amax_trend)
            severity=lambda c: _early(cfg, c, np.where((c["dev"] >= ow) & ~c["is_grad"] & ~c["block"], "warning",
                                                       "info")),
            message=lambda r: (
                f"{_where(r)}: amax {_fmt(r['amax'])} is {_fmt(2 ** r['dev'])}x the median of the "
                f"{int(r['n_kind'])} layers of its kind ({r['kind']}), robust z {_fmt(r['value'])}"
            ),
        ),
    ]
    return [r for r in rules if r.name not in cfg.disabled]


# NaN / Inf in a tensor (edge per tensor); the events are nan_origin / nonfinite (engine._nan_events).
NONFINITE = RowRule("nonfinite", cond=lambda c: c["bad"], value=lambda c: c["nonfinite"], threshold=lambda c: 0.0,
                    severity=lambda c: "critical", message=lambda r: "", edge=True)


# Rules that are not RowRules, for `--rule` validation and docs.
OTHER_RULES = ("nan_origin", "nonfinite", "loss_spike", "grad_norm_spike", "lr_change", "loss_nonfinite",
               "fp8_vs_bf16", "cross_rank_scale_mismatch")


def all_rule_names(cfg: DetectConfig | None = None) -> list[str]:
    return [r.name for r in row_rules(cfg or DetectConfig())] + list(OTHER_RULES)
