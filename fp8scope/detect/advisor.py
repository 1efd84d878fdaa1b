"""The recipe advisor: for each layer and tensor, what each recipe did to this run's own tensors.

Capture measures other recipes on full-stats steps (``Monitor(whatif_recipes=...)``, the run's
``recipes`` table); the recipe in use is the ``tensors`` table's full rows, less the steps a tensor
ran at delayed scaling's initial scale of 1 (before its first update: the first step's weights
and gradients underflow there under any delayed recipe, which says nothing about the recipe). Both are summed over the
run (or a step range) per (layer, tensor, recipe) into the same three numbers, defined once here and
in ``fp8scope.derived``: underflow as a share of the non-zero finite values, overflow as a share of
the elements, and SQNR from the summed squares.

A tensor has a *fault* under a recipe, on a step, when the detector would flag it
(``DetectConfig``): underflow at or above ``underflow_warn`` (``underflow_grad_warn`` for gradients),
overflow at or above ``sat_warn_fraction``, or values clipped ``sat_warn_ratio`` (8x) or more; for a recipe that loses more than that by design on a Gaussian tensor
(NVFP4), from 3x what it loses there (``detect.design_loss``).

The advisor recommends, for each tensor at fault under the recipe in use, on the steps where it is
(all of them: a persistent fault; one: an outlier), the recipes that remove the fault on those
steps, cheapest first (:data:`COST_ORDER`: TE's recipes, fewer bits, then coarser scales, then
torchao's), and says for each
recipe which roles it is safe for across all layers. Where no tensor is
at fault, or no recipe removes a fault, it recommends nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.design_loss import thresholds
from fp8scope.schema import base_role

IN_USE = "in use"
# Transformer Engine's recipes (most FP8 training runs through it) cheapest first: 4-bit, per-tensor FP8, FP8
# with 128-value blocks, FP8 with 32-value blocks; then torchao's: per-row FP8, MXFP8 with FLOOR scales; no FP8
COST_ORDER = ("nvfp4", "current", "block128", "mxfp8", "rowwise", "mxfp8_floor", "bf16")
NAMES = {"nvfp4": "NVFP4", "current": "per-tensor current FP8", "rowwise": "torchao rowwise FP8",
         "block128": "1x128 block FP8", "mxfp8": "MXFP8", "mxfp8_floor": "torchao MXFP8 (FLOOR scales)",
         "bf16": "BF16", IN_USE: "the recipe in use"}
_SUMS = ("numel", "nonzero", "underflow", "overflow", "saturated", "sq_err", "sq_signal")


def per_step(run, steps: tuple[int | None, int | None] | None = None) -> pd.DataFrame:
    """Per (step, layer, tensor, recipe) on full-stats steps: the counts, sums and clip ratio, the
    recipe in use included (``recipe == "in use"``, from the ``tensors`` table). Empty when the run
    measured no other recipe."""
    cols = ["step", "layer", "tensor", "recipe", *_SUMS, "clip_ratio"]
    if "recipes" not in run.table_names():
        return pd.DataFrame(columns=cols)
    rec = run.table("recipes").to_pandas()
    t = run.tensors()
    t = t[t["full"] & t["rank"].ge(0) & ~t["tensor"].str.contains("@", regex=False)]
    rec, t = _in_steps(rec, steps), _in_steps(t, steps)
    # a tensor's steps at delayed scaling's initial scale (1, before any amax was recorded: the first
    # step of a run) say nothing about the recipe: left out on both sides, as are steps one side lacks
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log2(t["fp8_max"] / t["expected_amax"])
    initial = (t["scale"] == 1.0) & np.isfinite(ratio) & (ratio >= 0) & (ratio == np.round(ratio))
    keys = ["step", "layer", "tensor"]
    t = t[~initial].merge(rec[keys].drop_duplicates(), on=keys).copy()
    rec = rec.merge(t[keys].drop_duplicates(), on=keys)
    finite_n = t["numel"] - t["nonfinite"].fillna(0)
    t["nonzero"] = finite_n - t["zeros"].fillna(0)
    t["sq_err"] = t["qerr_mse"] * finite_n
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        t["sq_signal"] = np.where(np.isinf(t["sqnr_db"]), np.nan, t["sq_err"] * 10.0 ** (t["sqnr_db"] / 10.0))
        t["clip_ratio"] = t["amax"] / (t["fp8_max"] * t["scale_inv"])  # derived.amax_over_range
    t["recipe"] = IN_USE
    return pd.concat([t[cols], rec[cols]], ignore_index=True)


def summed(rows: pd.DataFrame) -> pd.DataFrame:
    """``per_step`` rows summed per (layer, tensor, recipe) (the clip ratio: its largest), with the
    derived shares and SQNR; each tensor's recipes together, the recipe in use first, then cheapest
    first, tensors in run order."""
    if rows.empty:
        return rows.assign(underflow_frac=[], overflow_frac=[]).drop(columns=["step"], errors="ignore")
    agg = {**{c: (c, lambda v: v.sum(min_count=1)) for c in _SUMS}, "clip_ratio": ("clip_ratio", "max")}
    out = rows.groupby(["layer", "tensor", "recipe"], sort=False, as_index=False).agg(**agg)
    first = {k: i for i, k in enumerate(dict.fromkeys(zip(out["layer"], out["tensor"])))}
    rank = {r: i for i, r in enumerate((IN_USE, *COST_ORDER))}
    out = out.assign(_t=[first[k] for k in zip(out["layer"], out["tensor"])],
                     _r=out["recipe"].map(lambda r: rank.get(r, len(rank))))
    out = out.sort_values(["_t", "_r"], kind="stable").drop(columns=["_t", "_r"]).reset_index(drop=True)
    return _with_shares(out)


def _with_shares(df: pd.DataFrame) -> pd.DataFrame:
    """The derived columns of counts and sums: underflow as a share of the non-zero finite values,
    overflow of the elements (as ``fp8scope.derived``), SQNR from the squares."""
    df = df.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        df["underflow_frac"] = np.where(df["nonzero"] > 0, df["underflow"] / df["nonzero"], np.nan)
        df["overflow_frac"] = np.where(df["numel"] > 0, df["overflow"] / df["numel"], np.nan)
        df["sqnr_db"] = np.where(df["sq_err"] > 0, 10 * np.log10(df["sq_signal"] / df["sq_err"]), np.inf)
    return df


def _in_steps(df: pd.DataFrame, steps: tuple[int | None, int | None] | None) -> pd.DataFrame:
    lo, hi = steps if steps is not None else (None, None)
    if lo is not None:
        df = df[df["step"] >= lo]
    if hi is not None:
        df = df[df["step"] < hi]
    return df


def fault(row, cfg: DetectConfig) -> str | None:
    """Why ``row`` (one tensor under one recipe) would be flagged, or None."""
    under, over = thresholds(row["recipe"], base_role(row["tensor"]), cfg)
    if row["underflow_frac"] >= under:
        return f"{100 * row['underflow_frac']:.3g} % of non-zero values underflow"
    if row["overflow_frac"] >= over:
        return f"{100 * row['overflow_frac']:.3g} % of values overflow"
    clip = row.get("clip_ratio")
    if clip is not None and clip >= cfg.sat_warn_ratio:  # the detector's saturation: clipped 8x or more
        return f"values clipped {clip:.3g}x past the format's range"
    return None


@dataclass
class Advice:
    layer: str
    tensor: str
    problem: str  # the fault under the recipe in use
    fixes: list[str]  # recipes that remove it, cheapest first
    evidence: str

    def text(self) -> str:
        if not self.fixes:
            return f"{self.layer} {self.tensor}: {self.problem} under the recipe in use; no measured recipe removes it"
        first = " or ".join(NAMES[r] for r in self.fixes[:2])
        return f"{self.layer} {self.tensor}: use {first}: {self.evidence}"


def advise(rows: pd.DataFrame, cfg: DetectConfig | None = None) -> tuple[list[Advice], list[str]]:
    """``rows`` from :func:`per_step`. Per tensor at fault under the recipe in use, on the steps where
    it is (every step: a persistent fault; a few: an outlier), the recipes that remove the fault on
    those steps; and per recipe, over the run, the roles it is safe for across all layers."""
    cfg = cfg or DetectConfig()
    if rows.empty:
        return [], []
    advice: list[Advice] = []
    for (layer, tensor), group in rows.groupby(["layer", "tensor"], sort=False):
        at_fault = _fault_steps(group, cfg)
        if not at_fault:
            continue
        steps = sorted(set(group["step"]))
        where = ("over the run" if at_fault == steps else f"at step {at_fault[0]}" if len(at_fault) == 1
                 else f"at {len(at_fault)} of {len(steps)} full steps ({at_fault[0]}-{at_fault[-1]})")
        advice.append(_advice(layer, tensor, summed(group[group["step"].isin(at_fault)]), where, cfg))
    return advice, _summary(summed(rows), cfg)


def _fault_steps(group: pd.DataFrame, cfg: DetectConfig) -> list[int]:
    """The steps where the recipe in use is at fault on this tensor."""
    now = _with_shares(group[group["recipe"] == IN_USE])
    return [int(r["step"]) for _, r in now.iterrows() if fault(r, cfg) is not None]


def _advice(layer: str, tensor: str, scope: pd.DataFrame, where: str, cfg: DetectConfig) -> Advice:
    by = {r.recipe: r._asdict() for r in scope.itertuples(index=False)}
    problem = f"{fault(by[IN_USE], cfg)} {where}"
    fixes = [r for r in COST_ORDER if r in by and fault(by[r], cfg) is None]
    shown = [IN_USE] + fixes[:2]
    evidence = f"{where}, " + ", ".join(
        f"{NAMES[r]} {_pct(by[r]['underflow_frac'])} underflow, {_pct(by[r]['overflow_frac'])} overflow, "
        f"clipped {_ratio(by[r].get('clip_ratio'))}, SQNR {_db(by[r]['sqnr_db'])}" for r in shown)
    return Advice(layer, tensor, problem, fixes, evidence)


def _summary(table: pd.DataFrame, cfg: DetectConfig) -> list[str]:
    summary = []
    for recipe in COST_ORDER:
        sub = table[table["recipe"] == recipe]
        if sub.empty:
            continue
        roles: dict[str, list] = {}
        for r in sub.itertuples(index=False):
            roles.setdefault(base_role(r.tensor), []).append((r.layer, fault(r._asdict(), cfg)))
        safe = [role for role, items in roles.items() if all(f is None for _, f in items)]
        unsafe = {role: [layer for layer, f in items if f is not None] for role, items in roles.items()
                  if any(f is not None for _, f in items)}
        parts = []
        if safe:
            parts.append(f"safe for every layer's {', '.join(_plural(r) for r in safe)}")
        for role, layers in unsafe.items():
            parts.append(f"not for the {_plural(role)} of {_layers(layers)}")
        summary.append(f"{NAMES[recipe]}: {'; '.join(parts)}")
    return summary


def _plural(role: str) -> str:
    return {"activation": "activations", "weight": "weights", "gradient": "gradients", "output": "outputs"}.get(role,
                                                                                                               role)


def _layers(layers: list[str]) -> str:
    return ", ".join(layers) if len(layers) <= 4 else f"{len(layers)} layers ({', '.join(layers[:3])}, ...)"


def _pct(v: float) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.3g} %"


def _ratio(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else ("no" if v <= 1 else f"{v:.3g}x")


def _db(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.1f} dB"
