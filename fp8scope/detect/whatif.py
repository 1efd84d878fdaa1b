"""What-if replay: the logged amax series of every tensor through another scaling recipe.

For delayed scaling (TE semantics, as :class:`fp8scope.emulate.ScalingState`): the scale used at
a step comes from the max of the previous ``amax_history_len`` recorded amaxes; an amax of 0
is not recorded (TE does not roll the history) and keeps the scale; NaN/Inf take a history slot
but are ignored by the max; if no valid amax is left the old scale is kept; the first step uses
scale 1. ``range = fp8_max * scale_inv = amax_from_history * 2**margin``. Current scaling:
``range = amax * 2**margin`` (no saturation by construction).

Per tensor it counts *saturation steps* (amax > range: values clipped) and *underflow-risk
steps* (range >= amax * 2**risk_binades: the scale wastes that many binades at the top, so
small values flush to zero sooner). The vectorized DuckDB implementation is checked against
``ScalingState`` step by step in tests/test_detect.py (:func:`replay_reference`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fp8scope.errors import UsageError

SAT_TOL = 1e-6


@dataclass(frozen=True)
class WhatIfRecipe:
    kind: str  # "delayed" | "current" | "logged"
    amax_history_len: int = 1024
    margin: float = 0.0
    algo: str = "max"

    @property
    def label(self) -> str:
        if self.kind == "logged":
            return "logged"
        if self.kind == "current":
            return "current" + (f":{self.margin:g}" if self.margin else "")
        algo = "" if self.algo == "max" else f":{self.algo}"
        return f"delayed:{self.amax_history_len}:{self.margin:g}{algo}"

    def to_emulate(self):
        from fp8scope.emulate import CurrentScaling, DelayedScaling

        m = int(self.margin) if float(self.margin).is_integer() else self.margin
        if self.kind == "current":
            return CurrentScaling(margin=m)
        return DelayedScaling(margin=m, amax_history_len=self.amax_history_len, amax_compute_algo=self.algo)


def parse_recipe(spec: str) -> WhatIfRecipe:
    """``delayed[:HISTORY[:MARGIN[:ALGO]]]``, ``current[:MARGIN]`` or ``logged`` (what the run used)."""
    parts = [p.strip() for p in str(spec).strip().split(":")]
    kind = parts[0].lower()
    try:
        if kind == "logged" and len(parts) == 1:
            return WhatIfRecipe("logged")
        if kind == "current" and len(parts) <= 2:
            return WhatIfRecipe("current", margin=float(parts[1]) if len(parts) > 1 and parts[1] else 0.0)
        if kind == "delayed" and len(parts) <= 4:
            h = int(parts[1]) if len(parts) > 1 and parts[1] else 1024
            m = float(parts[2]) if len(parts) > 2 and parts[2] else 0.0
            algo = parts[3] if len(parts) > 3 and parts[3] else "max"
            r = WhatIfRecipe("delayed", h, m, algo)
            r.to_emulate()  # validates history, margin, algo
            return r
    except ValueError as exc:
        raise UsageError(f"bad recipe {spec!r}: {exc}") from None
    raise UsageError(f"bad recipe {spec!r}; expected delayed[:HISTORY[:MARGIN[:ALGO]]], current[:MARGIN] or logged")


def _range_sql(r: WhatIfRecipe, src: str) -> str:
    """SQL: per tensor row, the representable max ``rng`` under recipe ``r``."""
    key = "rank, layer, tensor"
    mult = repr(2.0 ** float(r.margin))
    if r.kind == "logged":
        return f"select {key}, step, amax, fp8_max * scale_inv as rng from {src}"
    if r.kind == "current":
        return f"select {key}, step, amax, case when isfinite(amax) and amax > 0 then amax * {mult} " \
               f"else fp8_max end as rng from {src}"
    h = 1 if r.algo == "most_recent" else int(r.amax_history_len)
    # Every row's scale comes from the max of the previous h *recorded* amaxes (amax 0 is not
    # recorded: TE does not roll the history). A window whose max is 0 or Inf keeps the old scale:
    # last non-null value before the row; none at all: the initial scale 1 (range = fp8_max).
    return f"""
    with rec as (
        select {key}, step, amax, fp8_max, coalesce(amax <> 0, false) as recorded,
               case when not isnan(amax) and amax > 0 then amax end as a_f
        from {src}
    ), win0 as (
        select *, case when recorded then max(a_f) over (partition by {key}, recorded order by step
                                 rows between {h - 1} preceding and current row) end as v0
        from rec
    ), win as (
        -- NaN is ignored by TE's fmaxf reduction, but an Inf makes the result invalid: scale kept
        select *, case when isfinite(v0) then v0 end as v from win0
    ), prev as (
        select *, last_value(v ignore nulls) over (partition by {key} order by step
                      rows between unbounded preceding and 1 preceding) as hv
        from win
    )
    select {key}, step, amax, coalesce(hv * {mult}, fp8_max) as rng from prev
    """


def replay(run, recipes: list[WhatIfRecipe], risk_binades: float = 4.0, progress=None,
           sat_min_ratio: float | None = None) -> pd.DataFrame:
    """Per (rank, layer, tensor) and recipe: steps, saturation steps, underflow-risk steps, worst clip.

    A saturation step clips by at least ``sat_min_ratio`` (default: the detection rules'
    ``DetectConfig.sat_rate_min_ratio``, 1.25x): an amax a hair over the range (the float rounding of
    a dynamic scale, a weight creeping up by 1 %) is not a problem worth a recipe change.
    Columns: recipe, rank, layer, tensor, order, steps, sat_steps, risk_steps, max_over, first_sat_step.
    Rows of a block recipe's format (NVFP4's ``e2m1``: a scale per 16 values, no per-tensor amax
    history) are left out; a run of only those gives an empty frame.
    """
    if sat_min_ratio is None:
        from fp8scope.detect.config import DetectConfig

        sat_min_ratio = DetectConfig().sat_rate_min_ratio
    sat = repr(max(float(sat_min_ratio), 1.0 + SAT_TOL))
    import duckdb

    tick = progress or (lambda n=1: None)
    t = run.table("tensors")
    if t.num_rows == 0:
        raise UsageError(f"{run.path}: no tensor statistics to replay")
    import pyarrow as pa
    import pyarrow.compute as pc

    from fp8scope.detect.design_loss import FORMAT_RECIPE

    t = t.filter(pc.invert(pc.is_in(t["fp8_format"], value_set=pa.array(list(FORMAT_RECIPE), pa.string()))))
    t = t.select(["step", "rank", "layer", "tensor", "order", "amax", "fp8_max", "scale_inv"])
    if t.num_rows == 0:
        return pd.DataFrame(columns=["recipe", "rank", "layer", "tensor", "order", "steps", "sat_steps", "risk_steps",
                                     "max_over", "first_sat_step"])
    con = duckdb.connect()
    con.register("tensors_raw", t)
    order = con.execute('select rank, layer, tensor, min("order") as "order" from tensors_raw group by all').df()
    risk = repr(2.0 ** float(risk_binades))
    out = []
    for r in recipes:
        q = f"""
        with rr as ({_range_sql(r, 'tensors_raw')})
        select rank, layer, tensor, count(*) as steps,
            count(*) filter (where isfinite(amax) and amax >= rng * {sat}) as sat_steps,
            count(*) filter (where isfinite(amax) and amax > 0 and rng >= amax * {risk}) as risk_steps,
            max(case when isfinite(amax) and rng > 0 then amax / rng end) as max_over,
            min(step) filter (where isfinite(amax) and amax >= rng * {sat}) as first_sat_step
        from rr group by all
        """
        df = con.execute(q).df()
        df.insert(0, "recipe", r.label)
        out.append(df)
        tick()
    con.close()
    res = pd.concat(out, ignore_index=True).merge(order, on=["rank", "layer", "tensor"], how="left")
    return res.sort_values(["order", "tensor", "rank"], kind="stable").reset_index(drop=True)


SAT_WEIGHT = 10  # a clipped step weighs as much as 10 steps with 4+ idle binades


def recommend(res: pd.DataFrame, min_gain: float = 0.5, min_share: float = 0.01) -> dict:
    """The recipe to use, only where one measurably beats what the run logged.

    Each recipe's problems = ``SAT_WEIGHT`` x saturation steps + underflow-risk steps, summed over
    tensors. The best one is recommended when it removes at least ``min_gain`` of the logged
    recipe's problems and at least ``min_share`` of all tensor-steps; otherwise the answer is to keep
    the logged recipe. Returns ``{"recipe": label or None, "why": one sentence, "scores": {...}}``.
    """
    if res.empty:
        return {"recipe": None, "why": "no per-tensor FP8 rows to replay (every layer is block-scaled)", "scores": {}}
    tot = res.groupby("recipe", sort=False)[["steps", "sat_steps", "risk_steps"]].sum()
    tot["score"] = tot["sat_steps"] * SAT_WEIGHT + tot["risk_steps"]
    scores = {k: {"sat_steps": int(r.sat_steps), "risk_steps": int(r.risk_steps), "score": int(r.score)}
              for k, r in tot.iterrows()}
    base = "logged" if "logged" in tot.index else tot.index[0]
    b = tot.loc[base]
    best_label = tot["score"].idxmin()
    best = tot.loc[best_label]
    steps = max(int(b["steps"]), 1)
    gain = b["score"] - best["score"]

    def desc(label, r):
        return f"{label}: {int(r.sat_steps)} clipped and {int(r.risk_steps)} underflow-risk tensor-steps"

    if best_label == base or gain < min_gain * max(b["score"], 1) or gain < min_share * steps:
        return {"recipe": None, "scores": scores,
                "why": f"keep the recipe the run used: no alternative does measurably better ({desc(base, b)}; "
                       f"best alternative {desc(best_label, best)})" if best_label != base else
                       f"keep the recipe the run used: it has the fewest problems ({desc(base, b)})"}
    why = f"{desc(best_label, best)}, against {desc(base, b)}"
    if best_label.startswith("current"):
        why += ("; current scaling cannot clip by construction, at the cost of an amax pass before each cast "
                "(and an amax all-reduce under tensor parallelism)")
    return {"recipe": best_label, "scores": scores, "why": why}


def replay_series(amax: np.ndarray, fp8_max: float, r: WhatIfRecipe) -> np.ndarray:
    """The ranges of one series via the SQL implementation (for tests and small uses)."""
    import duckdb
    import pyarrow as pa

    n = len(amax)
    t = pa.table({"rank": pa.array([0] * n, pa.int32()), "layer": ["x"] * n, "tensor": ["t"] * n,
                  "step": pa.array(np.arange(n), pa.int64()), "amax": pa.array(np.asarray(amax, float)),
                  "fp8_max": pa.array([float(fp8_max)] * n), "scale_inv": pa.array([1.0] * n)})
    con = duckdb.connect()
    con.register("s", t)
    df = con.execute(_range_sql(r, "s") + " order by step").df()
    con.close()
    return df["rng"].to_numpy(dtype=float)


def replay_reference(amax: np.ndarray, fmt: str, r: WhatIfRecipe) -> np.ndarray:
    """The same ranges from :class:`fp8scope.emulate.ScalingState`, one ``begin`` per step (slow, exact)."""
    import torch

    from fp8scope.emulate.scaling import ScalingState
    from fp8scope.formats import get_format

    f = get_format(fmt)
    st = ScalingState(r.to_emulate(), f)
    out = []
    for a in amax:
        x = torch.tensor([float(a)], dtype=torch.float32)
        s = st.begin(x)
        out.append(float(f.max) * float(s.scale_inv))
    return np.array(out)


def pivot(res: pd.DataFrame, by_layer: bool = False) -> pd.DataFrame:
    """One row per tensor (or layer), a ``sat/risk`` column per recipe, plus a total row."""
    keys = ["layer"] if by_layer else ["layer", "tensor"]
    g = res.groupby(keys + ["recipe"], sort=False).agg(sat=("sat_steps", "sum"), risk=("risk_steps", "sum"),
                                                      order=("order", "min")).reset_index()
    recipes = list(dict.fromkeys(res["recipe"]))
    g["cell"] = g["sat"].astype(int).astype(str) + " / " + g["risk"].astype(int).astype(str)
    p = g.pivot_table(index=keys, columns="recipe", values="cell", aggfunc="first")
    p = p.reindex(columns=recipes)
    orders = g.groupby(keys)["order"].min()
    p = p.loc[orders.sort_values(kind="stable").index].reset_index()
    tot = res.groupby("recipe", sort=False)[["sat_steps", "risk_steps"]].sum()
    total = {k: "TOTAL" if k == keys[0] else "" for k in keys}
    for rcp in recipes:
        total[rcp] = f"{int(tot.loc[rcp, 'sat_steps'])} / {int(tot.loc[rcp, 'risk_steps'])}"
    p = pd.concat([p, pd.DataFrame([total])], ignore_index=True)
    p.columns.name = None
    return p


def _finite(v) -> bool:
    return v is not None and isinstance(v, float) and math.isfinite(v)
