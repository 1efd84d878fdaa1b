"""FP8 against its BF16 shadow, judged against each layer's own FP8 noise (``fp8_vs_bf16``).

A compare step measures, per layer, how far the FP8 step's output and weight gradient are from the
same step re-run in BF16. Healthy FP8 is not within 1 % of BF16: on a clean run the output's
relative error has a median of a few percent and the weight gradient's up to ~20 %, depending on
the layer, its recipe and its data. So a layer is judged against *its own* recent compares:

- its baseline is the median of the errors of its last ``shadow_window`` compares that did not
  depart (the first ``shadow_min_compares`` compares of a layer only form the baseline and are
  labelled so: the first of them is often step 0, where delayed scaling has no amax history yet).
  Recent, because a healthy layer's error drifts as the model trains: in the suite's clean GPT
  (400 steps, a compare every 25) the output head's error rose from 0.6 % to 2.7 % and blocks.3's
  attention projection's 3x, smoothly, and against the median of all earlier compares (most of
  them early) the head "departed" 4.1x for three compares in a row: a false warning. Without the
  departing compares, so that a lasting fault does not become its own baseline;
- a compare *departs* when its error is ``shadow_factor`` times that baseline and above the
  absolute floor ``shadow_rel_err``; every compare is judged, and a departure is one event per
  excursion (it fires again after the layer came back), so a fault late in a run is not hidden
  by an early one. The event is a warning when the excursion lasts two compares or more, critical
  when it reaches ``shadow_critical_factor``, info for a single compare (one step's FP8 noise);
- "where FP8 hurts" ranks layers by departure (error / baseline), not by raw error.

:func:`departures` is the one definition; the offline engine turns its rows into events and the
report ranks layers with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.events import event
from fp8scope.detect.rules import _fmt

if TYPE_CHECKING:  # the online detection child starts without pandas (imported where a frame is made here)
    import pandas as pd

SHADOW_TABLE = "shadow_compare"
METRICS = {"output_rel_err": "output", "wgrad_rel_err": "wgrad"}
COMPARE_ORDER = 1 << 29  # after a step's tensor events, before its scalar ones


def departures(table: pa.Table | pd.DataFrame, cfg: DetectConfig) -> pd.DataFrame:
    """One row per (compare step, rank, layer, metric): ``err``, ``baseline`` (median of the layer's
    last ``shadow_window`` errors of that metric that did not depart; NaN while it forms), ``n_prev``
    (the compares in that median), ``departure`` (err / baseline), ``departs`` (bool) and ``fires`` (first departure of an excursion)."""
    import pandas as pd

    df = table.to_pandas() if isinstance(table, pa.Table) else table
    cols = [c for c in METRICS if c in df.columns]
    if df.empty or not cols or not {"step", "layer"} <= set(df.columns):
        return pd.DataFrame(columns=["step", "rank", "layer", "metric", "err", "baseline", "n_prev", "departure",
                                     "departs", "fires"])
    if "rank" not in df.columns:
        df = df.assign(rank=0)
    long = df.melt(id_vars=["step", "rank", "layer"], value_vars=cols, var_name="metric", value_name="err")
    long["metric"] = long["metric"].map(METRICS)
    long = long.dropna(subset=["err"]).sort_values(["rank", "layer", "metric", "step"], kind="stable")
    need, factor, floor = int(cfg.shadow_min_compares), float(cfg.shadow_factor), float(cfg.shadow_rel_err)
    window = max(int(cfg.shadow_window), need, 1)
    parts = []
    for _, g in long.groupby(["rank", "layer", "metric"], sort=False):
        err = g["err"].to_numpy(float)
        base = np.full(len(err), np.nan)
        n_base = np.zeros(len(err), np.int64)  # compares in the baseline
        departs = np.zeros(len(err), bool)
        kept: list[float] = []  # the errors of the layer's earlier compares that did not depart
        for i, e in enumerate(err):
            if i >= need and kept:
                base[i] = np.median(kept[-window:])
                n_base[i] = min(len(kept), window)
                departs[i] = e >= factor * base[i] and e >= floor
            if not departs[i]:
                kept.append(e)
        fires = departs & ~np.r_[False, departs[:-1]]
        departure = np.divide(err, base, out=np.full(len(err), np.nan), where=base > 0)
        # each excursion (consecutive departing compares): its length and worst departure, on its first row
        run_id = np.cumsum(fires)
        length = np.zeros(len(err), np.int64)
        worst = np.full(len(err), np.nan)
        for r in np.unique(run_id[departs]):
            m = departs & (run_id == r)
            first = np.flatnonzero(m)[0]
            length[first], worst[first] = int(m.sum()), float(np.nanmax(departure[m]))
        parts.append(g.assign(baseline=base, n_prev=n_base, departure=departure, departs=departs,
                              fires=fires, excursion=length, worst=worst))
    out = pd.concat(parts, ignore_index=True)
    return out.sort_values(["step", "rank", "layer", "metric"], kind="stable").reset_index(drop=True)


def shadow_events(table: pa.Table, cfg: DetectConfig) -> list[dict]:
    """``fp8_vs_bf16`` events: the first compare of each excursion of a layer above its own baseline."""
    if "fp8_vs_bf16" in cfg.disabled:
        return []
    d = departures(table, cfg)
    if d.empty:
        return []
    crit = float(cfg.shadow_critical_factor)
    out = []
    for r in d[d["fires"]].to_dict("records"):
        # one compare off its baseline is FP8 noise of that step (a fresh model's gradients overrun their
        # delayed scales at the end of the lr warm-up: every layer's wgrad error 4-10x for one compare);
        # a departure that lasts, or a huge one, is FP8 hurting the layer
        lasting = r["excursion"] >= 2
        sev = "critical" if r["worst"] >= crit else "warning" if lasting else "info"
        if r["step"] < int(cfg.shadow_warmup_steps) and sev != "critical":
            sev = "info"  # early training: delayed scales still chase a fresh model's growing gradients
        msg = (f"{r['layer']}: FP8 {r['metric']} differs from the BF16 shadow by {_fmt(100 * r['err'])}% relative "
               f"error, {_fmt(r['departure'])}x this layer's usual {_fmt(100 * r['baseline'])}% (median of its "
               f"last {int(r['n_prev'])} compares that did not depart)"
               + (f", for {int(r['excursion'])} compares in a row: FP8 hurts this layer here" if lasting
                  else "" if sev == "critical" else ", at this compare only"))
        # a compare is judged after the step's own tensors: at equal steps they sort first (the report's
        # first anomaly is the tensor that moved, not the downstream layers whose BF16 pass differs with it)
        out.append(event({**r, "tensor": r["metric"], "order": COMPARE_ORDER}, "fp8_vs_bf16", sev, r["departure"],
                         float(cfg.shadow_factor), msg))
    return out
