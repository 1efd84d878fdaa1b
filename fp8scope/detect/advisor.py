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
overflow at or above ``sat_warn_fraction``, or values clipped ``sat_warn_ratio`` (8x; gradients
``sat_grad_warn_ratio``, 16x) or more; for a
recipe that loses more than that by design on healthy tensors (NVFP4), from what it loses there
(``detect.design_loss``).

The advisor recommends, for each tensor at fault under the recipe in use, on the steps where it is
(all of them: a persistent fault; one: an outlier), the recipes that remove the fault on those
steps without flushing or clipping more there than the recipe in use (beyond what the detector
lets FP8 lose), cheapest first
(:data:`COST_ORDER`: TE's recipes, fewer bits, then coarser scales, then torchao's), and says for
each recipe which roles it is safe for across all layers. Where no tensor is at fault, or no recipe
removes a fault, it recommends nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fp8scope import derived
from fp8scope.detect.config import DetectConfig
from fp8scope.detect.design_loss import FP8, thresholds
from fp8scope.schema import base_role

IN_USE = "in use"
# Transformer Engine's recipes (most FP8 training runs through it) cheapest first: 4-bit, per-tensor FP8, FP8
# with 128-value blocks, FP8 with 32-value blocks; then torchao's: per-row FP8, MXFP8 with FLOOR scales; no FP8
COST_ORDER = ("nvfp4", "current", "block128", "mxfp8", "rowwise", "mxfp8_floor", "bf16")
NAMES = {"nvfp4": "NVFP4", "current": "per-tensor current FP8", "rowwise": "torchao rowwise FP8",
         "block128": "1x128 block FP8", "mxfp8": "MXFP8", "mxfp8_floor": "torchao MXFP8 (FLOOR scales)",
         "bf16": "BF16", IN_USE: "the recipe in use"}
_SUMS = ("numel", "nonzero", "underflow", "overflow", "saturated", "sq_err", "sq_signal")


_TENSOR_COLS = ("step", "rank", "layer", "tensor", "full", "fp8_max", "expected_amax", "scale", "scale_inv", "amax",
                "numel", "nonfinite", "zeros", "underflow", "underflow_deep", "below_normal", "overflow", "saturated",
                "qerr_mse", "sqnr_db")


def per_step(run, steps: tuple[int | None, int | None] | None = None) -> pd.DataFrame:
    """Per (step, layer, tensor, recipe) on full-stats steps: the counts, sums and clip ratio, the
    recipe in use included (``recipe == "in use"``, from the ``tensors`` table). Empty when the run
    measured no other recipe. Names come back categorical: a long run has millions of rows."""
    import pyarrow.compute as pc

    # underflow_deep: null in a run logged before it existed (the store's readers give it the column;
    # both tables then judge all of a flush). below_normal: the recipe in use's only (the tensors
    # table's); the other recipes judge their flush without it
    cols = ["step", "layer", "tensor", "recipe", *_SUMS, "clip_ratio", "underflow_deep", "below_normal"]
    if "recipes" not in run.table_names():
        return pd.DataFrame(columns=cols)
    rec_t = _arrow_in_steps(run.table("recipes").select(cols[:-1]), steps)
    t = run.table("tensors").select(list(_TENSOR_COLS))
    keep = pc.and_(pc.and_(t["full"], pc.greater_equal(t["rank"], 0)),
                   pc.invert(pc.match_substring(t["tensor"], "@")))
    t = _arrow_in_steps(t.filter(keep), steps)
    rec = rec_t.to_pandas(strings_to_categorical=True)
    t = t.to_pandas(strings_to_categorical=True)
    # a tensor's steps at delayed scaling's initial scale (1, before any amax was recorded: the first
    # step of a run) say nothing about the recipe: left out on both sides, as are steps one side lacks
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log2(t["fp8_max"] / t["expected_amax"])
    initial = (t["scale"] == 1.0) & np.isfinite(ratio) & (ratio >= 0) & (ratio == np.round(ratio))
    t = t[~initial]
    both = _key_codes(t, rec)
    t = t[np.isin(both[0], both[1])].copy()
    rec = rec[np.isin(both[1], both[0])]
    finite_n = t["numel"] - t["nonfinite"].fillna(0)
    t["nonzero"] = finite_n - t["zeros"].fillna(0)
    t["sq_err"] = t["qerr_mse"] * finite_n
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        t["sq_signal"] = np.where(np.isinf(t["sqnr_db"]), np.nan, t["sq_err"] * 10.0 ** (t["sqnr_db"] / 10.0))
        t["clip_ratio"] = t["amax"] / (t["fp8_max"] * t["scale_inv"])  # derived.amax_over_range
    t["recipe"] = IN_USE
    rec["below_normal"] = np.nan
    t, rec = t[cols].copy(), rec[cols].copy()
    for c in ("layer", "tensor", "recipe"):  # one set of categories on both sides: the concat stays categorical
        a, b = pd.Categorical(t[c]), pd.Categorical(rec[c])
        cats = a.categories.union(b.categories, sort=False)
        t[c], rec[c] = a.set_categories(cats), b.set_categories(cats)
    return pd.concat([t, rec], ignore_index=True)


def _key_codes(a: pd.DataFrame, b: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(step, layer, tensor) of each row of ``a`` and of ``b`` as one int64 both can compare (from the
    categorical names' codes: no string is touched per row)."""
    cols = {c: (pd.Categorical(a[c]), pd.Categorical(b[c])) for c in ("layer", "tensor")}
    union = {c: x.categories.union(y.categories, sort=False) for c, (x, y) in cols.items()}
    n_t = len(union["tensor"])
    n_lt = len(union["layer"]) * n_t
    out = []
    for i, df in enumerate((a, b)):
        lay, ten = (union[c].get_indexer(cols[c][i].categories)[cols[c][i].codes].astype(np.int64)
                    for c in ("layer", "tensor"))
        out.append(df["step"].to_numpy(np.int64) * n_lt + lay * n_t + ten)
    return out[0], out[1]


def _run_order(rows: pd.DataFrame) -> list[tuple[str, str]]:
    """The (layer, tensor) pairs of ``rows`` in the order they first appear (run order)."""
    first = rows[["layer", "tensor"]].drop_duplicates()
    return list(zip(first["layer"].astype(str), first["tensor"].astype(str)))


def _arrow_in_steps(t, steps):
    import pyarrow.compute as pc

    lo, hi = steps if steps is not None else (None, None)
    if lo is not None:
        t = t.filter(pc.greater_equal(t["step"], lo))
    if hi is not None:
        t = t.filter(pc.less(t["step"], hi))
    return t


def summed(rows: pd.DataFrame) -> pd.DataFrame:
    """``per_step`` rows summed per (layer, tensor, recipe) (the clip ratio: its largest), with the
    derived shares and SQNR; each tensor's recipes together, the recipe in use first, then cheapest
    first, tensors in run order."""
    if rows.empty:
        return rows.assign(underflow_frac=[], overflow_frac=[]).drop(columns=["step"], errors="ignore")
    g = rows.groupby(["layer", "tensor", "recipe"], sort=False, observed=True)
    sums = [*_SUMS, *(c for c in ("underflow_deep", "below_normal") if c in rows)]
    out = g[sums].sum(min_count=1).join(g[["clip_ratio"]].max()).reset_index()
    out = out.astype({"layer": str, "tensor": str, "recipe": str})
    first = {k: i for i, k in enumerate(_run_order(rows))}
    rank = {r: i for i, r in enumerate((IN_USE, *COST_ORDER))}
    out = out.assign(_t=[first[k] for k in zip(out["layer"], out["tensor"])],
                     _r=out["recipe"].map(lambda r: rank.get(r, len(rank))))
    out = out.sort_values(["_t", "_r"], kind="stable").drop(columns=["_t", "_r"]).reset_index(drop=True)
    return _with_shares(out)


def _with_shares(df: pd.DataFrame) -> pd.DataFrame:
    """The derived columns of counts and sums: underflow as a share of the non-zero finite values,
    overflow of the elements (as ``fp8scope.derived``), SQNR from the squares."""
    df = df.copy()
    if "underflow_deep" in df:  # the share flushed from deep and the shallow part, as fp8scope.derived defines them
        def get(name):
            if name == "nonfinite":  # nonzero already leaves them out
                return np.zeros(len(df))
            if name == "zeros":
                return (df["numel"] - df["nonzero"]).to_numpy(dtype=float, na_value=np.nan)
            return df[name].to_numpy(dtype=float, na_value=np.nan)

        df["deep_share"] = derived.deep_underflow_share(get)
        df["shallow_frac"] = derived.shallow_underflow_fraction(get)
        if "below_normal" in df:
            df["below_normal_frac"] = derived.below_normal_fraction(get)
    with np.errstate(divide="ignore", invalid="ignore"):
        df["underflow_frac"] = np.where(df["nonzero"] > 0, df["underflow"] / df["nonzero"], np.nan)
        df["overflow_frac"] = np.where(df["numel"] > 0, df["overflow"] / df["numel"], np.nan)
        df["sqnr_db"] = np.where(df["sq_err"] > 0, 10 * np.log10(df["sq_signal"] / df["sq_err"]), np.inf)
    return df


_UNDERFLOW, _OVERFLOW, _CLIPPED = 1, 2, 3  # why a row is at fault (0: it is not), in the order judged


def fault_codes(df: pd.DataFrame, cfg: DetectConfig) -> np.ndarray:
    """Why each row of ``df`` (one tensor under one recipe, with its shares) is at fault, as a code:
    underflow at or above the recipe's threshold for the role (not a near-zero tail: the rule's info,
    ``DetectConfig.near_zero_tail``), else overflow, else values clipped
    by the detector's saturation ratio for the role or more (``DetectConfig.sat_warn_ratios``), else
    0. The one definition of a fault, judged for all rows at once (a long run has millions)."""
    if df.empty:
        return np.zeros(0, np.int8)
    recipe, tensor = pd.Categorical(df["recipe"]), pd.Categorical(df["tensor"])
    roles = pd.Categorical([base_role(str(t)) for t in tensor.categories])
    # the thresholds per (recipe, role) pair, looked up through the category codes
    limits = np.array([[thresholds(str(r), str(o), cfg) for o in roles.categories] for r in recipe.categories])
    pick = (recipe.codes, roles.codes[tensor.codes])
    under, over = limits[..., 0][pick], limits[..., 1][pick]
    clip_limit = cfg.sat_warn_ratios(np.asarray(roles.categories == "gradient")[pick[1]])
    clip = df["clip_ratio"].to_numpy(dtype=float, na_value=np.nan) if "clip_ratio" in df else np.full(len(df), np.nan)
    # a flush of near-zeros is not a fault, as it is the rule's info
    def share(name):
        return df[name].to_numpy(dtype=float, na_value=np.nan) if name in df else np.full(len(df), np.nan)

    tail = (cfg.near_zero_tail(share("deep_share"), share("shallow_frac"), under, share("below_normal_frac"),
                               share("underflow_frac"))
            if "deep_share" in df else np.zeros(len(df), bool))
    with np.errstate(invalid="ignore"):
        return np.select([(df["underflow_frac"].to_numpy(dtype=float) >= under) & ~tail,
                          df["overflow_frac"].to_numpy(dtype=float) >= over, clip >= clip_limit],
                         [_UNDERFLOW, _OVERFLOW, _CLIPPED], 0).astype(np.int8)


def faults(df: pd.DataFrame, cfg: DetectConfig) -> np.ndarray:
    """Whether each row of ``df`` is at fault (:func:`fault_codes`)."""
    return fault_codes(df, cfg) > 0


def fault(row, cfg: DetectConfig) -> str | None:
    """Why ``row`` (one tensor under one recipe) would be flagged, or None (:func:`fault_codes`)."""
    code = fault_codes(pd.DataFrame([row]), cfg)[0]
    if code == _UNDERFLOW:
        return f"{100 * row['underflow_frac']:.3g} % of non-zero values underflow"
    if code == _OVERFLOW:
        return f"{100 * row['overflow_frac']:.3g} % of values overflow"
    if code == _CLIPPED:
        return f"values clipped {row['clip_ratio']:.3g}x past the format's range"
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
    now = _with_shares(rows[rows["recipe"] == IN_USE])
    flagged = now[faults(now, cfg)]
    if flagged.empty:
        return [], _summary(summed(rows), cfg)
    n_steps = now.groupby(["layer", "tensor"], observed=True, sort=False)["step"].nunique()
    by_tensor = rows.groupby(["layer", "tensor"], observed=True, sort=False)
    advice: list[Advice] = []
    order = _run_order(rows)
    at = {k: sorted(set(v)) for k, v in flagged.groupby(["layer", "tensor"], observed=True, sort=False)["step"]}
    for layer, tensor in order:
        at_fault = at.get((layer, tensor))
        if not at_fault:
            continue
        n = int(n_steps[(layer, tensor)])
        where = ("over the run" if len(at_fault) == n else f"at step {at_fault[0]}" if len(at_fault) == 1
                 else f"at {len(at_fault)} of {n} full steps ({at_fault[0]}-{at_fault[-1]})")
        group = by_tensor.get_group((layer, tensor))
        advice.append(_advice(layer, tensor, summed(group[group["step"].isin(at_fault)]), where, cfg))
    return advice, _summary(summed(rows), cfg)


def _advice(layer: str, tensor: str, scope: pd.DataFrame, where: str, cfg: DetectConfig) -> Advice:
    by = {r.recipe: r._asdict() for r in scope.itertuples(index=False)}
    problem = f"{fault(by[IN_USE], cfg)} {where}"
    role = base_role(tensor)
    fixes = [r for r in COST_ORDER
             if r in by and fault(by[r], cfg) is None and not _worse(by[r], by[IN_USE], role, cfg)]
    shown = [IN_USE] + fixes[:2]
    evidence = f"{where}, " + ", ".join(
        f"{NAMES[r]} {_pct(by[r]['underflow_frac'])} underflow, {_pct(by[r]['overflow_frac'])} overflow, "
        f"clipped {_ratio(by[r].get('clip_ratio'))}, SQNR {_db(by[r]['sqnr_db'])}" for r in shown)
    return Advice(layer, tensor, problem, fixes, evidence)


def _worse(candidate: dict, now: dict, role: str, cfg: DetectConfig) -> bool:
    """Whether ``candidate`` flushes or clips more than the recipe in use on the same steps, beyond
    what the detector lets FP8 lose (``underflow_warn`` / ``sat_warn_fraction``): a recipe within
    its own design loss (NVFP4 flushes 7-27 % of healthy values) is no fix for a fault that costs
    less than that (an FP8 outlier flushing 6 % for two steps). (SQNR cannot say it: it is weighted
    by energy, so the few large values an outlier fault keeps decide it.)"""
    under, over = thresholds(FP8, role, cfg)
    with np.errstate(invalid="ignore"):
        return bool(candidate["underflow_frac"] > max(now["underflow_frac"], under)
                    or candidate["overflow_frac"] > max(now["overflow_frac"], over))


def _summary(table: pd.DataFrame, cfg: DetectConfig) -> list[str]:
    summary = []
    table = table.assign(_fault=faults(table, cfg))
    for recipe in COST_ORDER:
        sub = table[table["recipe"] == recipe]
        if sub.empty:
            continue
        roles: dict[str, list] = {}
        for layer, tensor, bad in zip(sub["layer"], sub["tensor"], sub["_fault"]):
            roles.setdefault(base_role(tensor), []).append((layer, "fault" if bad else None))
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
