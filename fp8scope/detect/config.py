"""Detection thresholds: one dataclass, every default documented (see docs/detection.md).

Defaults are calibrated on the detection suite (``benchmarks/detection_suite.py``,
docs/detection.md): clean runs of the tiny GPT and of six ``transformers`` architectures (delayed
scaling, history 16) raise no warning or critical event, while each planted failure fires its rule
at the right layer, tensor and step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from fp8scope.errors import UsageError


@dataclass(frozen=True)
class DetectConfig:
    """Thresholds of the detection rules. ``DetectConfig(spike_factor=20)`` changes one."""

    # a tensor with fewer logged rows of its own than this is warming up: its spike-type events are
    # "info" (clipping by sat_critical_ratio or more, non-finite values and NaN origins never are)
    warmup_rows: int = 50
    # rows of a tensor's own history a rule needs before it judges (windows are logged steps)
    min_history: int = 10

    # amax_spike: amax > spike_factor x max(amax over the previous spike_window logged steps)
    spike_factor: float = 10.0
    spike_window: int = 100

    # saturation: amax above the representable range fp8_max * scale_inv of the scale in use.
    # sat_tol absorbs the float rounding of dynamic (current) scaling (amax*scale a hair over max)
    sat_tol: float = 1e-3
    sat_warn_ratio: float = 8.0  # amax / range >= this (clipped by 3 binades or more): warning
    # the same for gradients (E5M2): they spike further above their delayed scale in a clean run (one
    # step of a clean Qwen2's down-projection gradient at 8.7x; 2.5-8.7x at most across 16 clean runs
    # of six architectures) while planted outliers reach 100-1000x; a gradient clipped less than this
    # is a warning on a full-stats row that saw sat_warn_fraction of its elements overflow
    sat_grad_warn_ratio: float = 16.0
    sat_critical_ratio: float = 32.0  # amax / range >= this: critical
    sat_warn_fraction: float = 0.02  # or >= 2% of the elements overflowed (full-stats rows): warning
    # saturation_rate: share of the last sat_rate_window logged steps with amax/range >= sat_rate_min_ratio
    sat_rate_window: int = 100
    sat_rate_min_ratio: float = 1.25
    sat_rate_threshold: float = 0.2

    # stale_scale: the scale still comes from an amax >= stale_ratio x today's amax (delayed scaling,
    # after a spike that sits in the amax history)
    stale_ratio: float = 30.0

    # scale_mismatch: the scale in use comes from an amax >= mismatch_factor x the largest amax the tensor
    # logged in its spike_window (and today): a reset or corrupted scale, seen on cheap rows too
    mismatch_factor: float = 16.0

    # underflow: share of the non-zero values flushed to zero by the cast (full-stats rows)
    underflow_warn: float = 0.02  # activations / weights (E4M3): 2% of non-zeros
    underflow_grad_warn: float = 0.5  # gradients (E5M2): 50% (small gradients flush often)
    underflow_critical: float = 0.9
    # more than this share of the flushed values flushed from 4+ binades under the threshold
    # (underflow_deep), and what flushed from just below it under the threshold: a tail of near-zero
    # values (T5's heads that output ~0: 66-89 % deep), told as info. A bulk the scale pressed under
    # flushes evenly below the threshold (a smooth density: 1/16 of it deep; 7-10 % in the suite's outliers)
    underflow_deep_share: float = 0.5
    # a flush is also a tail when fewer than this many values per flushed one sit under the normal range
    # (below_normal: flushed or subnormal), and under half of the non-zero values: its values thin out
    # above the flush threshold and the median keeps full precision, where a bulk the scale pressed under
    # crowds the range just above it. GELU's negative tail in a clean GPT-2's MLP input (2,000 steps):
    # 2.0-2.6 % flushed, 2.7-3.0 values under the normal range per flushed one; the suite's outliers that
    # flush 2 % or more: 5.4-9 (a T5's float32-kept MLP input pressed by its own outlier: 5.8-7.1)
    underflow_bulk_ratio: float = 4.0

    # dynamic_range: log2(amax / min_nonzero) - format binades (E4M3 17.8, E5M2 31.8) above this
    # is "info" (most tiny values are harmless); it becomes a warning when underflow is also high
    dynamic_range_excess: float = 0.0

    # scale_collapse: scale_inv rose >= collapse_factor x over the last collapse_window logged steps,
    # step after step (not one jump), and is at its highest
    collapse_factor: float = 64.0
    collapse_window: int = 50
    collapse_max_jump: float = 8.0  # and no single step raised it more than 8x (gradual, not one spike)

    # layer_outlier: robust z-score of log2(amax) among layers of the same kind (same role, same
    # name with digits replaced), at the same step
    outlier_z: float = 6.0
    outlier_min_binades: float = 3.0  # and >= 8x the median of its kind ("info")
    outlier_warn_binades: float = 7.0  # >= 128x the median of its kind: "warning"
    outlier_min_layers: int = 3

    # amax_trend: a tensor's log2 amax above its kind's median (as for layer_outlier) rose by trend_binades
    # or more over its last trend_window logged rows, no single row adding more than trend_max_jump_share
    # of that rise (a climb, not one jump: amax_spike's case), and sits at least 2x above the median
    trend_window: int = 50
    trend_binades: float = 1.5
    trend_max_jump_share: float = 0.6

    # A kind of at least spread_min_layers layers (a MoE's experts: hundreds) has a spread to measure, and
    # an expert's amax is the max over the few tokens routed to it, scaled by their routing weights: its
    # amax moves within that spread. There a trend must end spread_z robust z-scores above the kind's
    # median (or it is no event), and a spike that leaves the tensor below that is info (an expert's
    # gradient joining its peers: 1e-9 beside their 5e-5, then 40x on one token). A clean Qwen3-MoE's 512
    # experts wandered up to z 2.6 over 400 steps. A kind of a few layers has no spread to measure (its MAD
    # is mostly the outlier's own), so its rules stand as they are.
    spread_min_layers: int = 16
    spread_z: float = 4.0

    # a share (underflow, overflow) of fewer than share_min_values values is not a rate: a MoE expert that
    # got 3 tokens holds 48 down_proj inputs, so one flushed or clipped value is 2.1 % of them (a clean
    # Qwen3-MoE's experts did that at every full step). From 400 values on (2 %) the share alone decides,
    # so a dense layer's rows are judged as before
    share_min_values: int = 8

    # Optimizer-side rules (detect/scalar_rules.py), over each scalar series of the run.
    # loss_spike / grad_norm_spike: log(value) is loss_spike_z / grad_spike_z robust z-scores above the median of the
    # previous scalar_window values (spread = 1.4826 MAD, at least the noise floor) and the value is at
    # least loss_spike_factor / grad_spike_factor x that median; a series is judged once it has
    # scalar_min_history values, and an excursion is one event
    scalar_window: int = 50
    scalar_min_history: int = 30
    # calibrated on the suite's clean runs (benchmarks/detection_suite.py, 16 clean runs of six
    # architectures): clean losses reach z 7.5 (a hard batch late in a Qwen2's cosine decay, 1.43x) and
    # clean grad norms z 10.9 (a Phi at the end of its lr warm-up, 3.6x, clipped); the planted bad
    # batches and data spikes give z 14-46 on the loss and 19 on the grad norm
    loss_spike_z: float = 10.0
    grad_spike_z: float = 14.0
    loss_spike_factor: float = 1.25
    grad_spike_factor: float = 2.0
    loss_noise_floor: float = 0.02  # in log space: 2 %
    grad_noise_floor: float = 0.05
    # lr_change: one step's lr ratio is >= lr_jump_factor and >= lr_pace_factor x (in log) the largest
    # step-to-step change of the previous scalar_window steps (warm-up and decay move smoothly);
    # judged after lr_min_history changes. Rises past every earlier lr are warnings; drops, and rises back to
    # no more than the earlier peak (a schedule's warm restart), info.
    lr_jump_factor: float = 2.0
    lr_pace_factor: float = 4.0
    lr_min_history: int = 5
    loss_name: str = "loss"
    grad_norm_name: str = "grad_norm"
    lr_name: str = "lr"

    # fp8_vs_bf16 (detect/shadow_rule.py): a compare's relative error of a layer's output or weight
    # gradient is >= shadow_factor x the median of that layer's last shadow_window compares that did not
    # depart (its own recent FP8 noise, which drifts up as the model trains; the first shadow_min_compares
    # compares form the baseline) and >= shadow_rel_err; a warning when it
    # lasts 2 compares, critical at shadow_critical_factor x, info for one compare (measured on the suite's
    # clean runs: at the end of the lr warm-up every layer's wgrad error jumped 4-11x for one compare)
    shadow_rel_err: float = 0.02
    shadow_factor: float = 4.0
    shadow_critical_factor: float = 20.0
    shadow_min_compares: int = 3
    shadow_window: int = 8
    # compares before this step are told as info (unless critical): in the suite's clean runs the
    # weight-gradient error jumps 3-7x for a few compares up to step ~80, while delayed scales catch up
    # with a fresh model's gradients
    shadow_warmup_steps: int = 100

    # cross_rank_scale: the same tensor's scale differs across ranks at the same step
    rank_scale_tol: float = 1e-3

    # rules to skip, by name
    disabled: tuple[str, ...] = ()

    def sat_warn_ratios(self, is_grad):
        """The amax / range from which the saturation rule warns, per row: ``sat_grad_warn_ratio``
        where ``is_grad`` (a numpy array of bools, or one), else ``sat_warn_ratio``. The one
        definition, which the rule and the recipe advisor's faults ask (the cheap-step triage, whose
        rows carry no role, looks closer from the lower of the two)."""
        import numpy as np

        return np.where(is_grad, float(self.sat_grad_warn_ratio), float(self.sat_warn_ratio))

    def near_zero_tail(self, deep_share, shallow, threshold, below_normal=float("nan"), flushed=float("nan")):
        """Per row, whether a flush is a tail of small values rather than a bulk the scale pressed
        under: more than ``underflow_deep_share`` of it from 4+ binades under the flush threshold, and
        what flushed from just below it (``shallow``, a share of the non-zeros) under ``threshold``;
        or, with ``below_normal`` and ``flushed`` the shares of the non-zeros under the normal range
        and flushed (``derived``), fewer than ``underflow_bulk_ratio`` values under the normal range
        per flushed value and under half of them all: the values thin out above the threshold and the
        median keeps full precision. NaN (nothing flushed, or a count not logged) is not a tail. The
        one definition, which the underflow rule (info, not a warning) and the recipe advisor's faults
        ask."""
        import numpy as np

        with np.errstate(invalid="ignore"):
            deep = np.asarray(deep_share, float) > float(self.underflow_deep_share)
            below, flushed = np.asarray(below_normal, float), np.asarray(flushed, float)
            kept = (below < float(self.underflow_bulk_ratio) * flushed) & (below < 0.5)
            return (deep & (np.asarray(shallow, float) < threshold)) | kept

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["disabled"] = list(self.disabled)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "DetectConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise UsageError(f"unknown detection threshold(s) {bad}; known: {', '.join(sorted(known))}")
        if "disabled" in d:
            d["disabled"] = tuple(d["disabled"])
        return cls(**d)

    def with_(self, **kw: Any) -> "DetectConfig":
        return replace(self, **kw)


# The name the issue uses: thresholds are the config.
Thresholds = DetectConfig
