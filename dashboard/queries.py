"""What each view asks for, as small frames: the browser never receives raw rows.

A heatmap is at most ``MAX_COLS`` step buckets x the layers of one role, a line at most ``MAX_POINTS``
buckets. Tensor statistics come from the rollup (:mod:`dashboard.rollup`), other tables from DuckDB
over the run's Arrow tables; every result is cached per run version.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from dashboard.rollup import (MAX_COLS, MAX_POINTS, ROLLED, NoData, _heatmap_rollup, _reduce, _tids_for,
                              bucket_width, rollup)
from dashboard.runcache import Entry
from fp8scope.derived import DERIVED
from fp8scope.detect.advisor import COST_ORDER as RECIPES, NAMES as RECIPE_NAMES  # no torch import

# key -> (label, SQL expression per row, worst-case aggregate, source table): the tensor statistics are
# the one table of derived statistics; the shadow ones are per layer
STATS: dict[str, tuple[str, str, str, str]] = {
    **{k: (DERIVED[k].label, DERIVED[k].sql, DERIVED[k].worst, "tensors") for k in ROLLED},
    "shadow_out": ("shadow: FP8 vs BF16 output rel. error", "output_rel_err", "max", "shadow_compare"),
    "shadow_wgrad": ("shadow: FP8 vs BF16 wgrad rel. error", "wgrad_rel_err", "max", "shadow_compare"),
    "shadow_local": ("shadow: layer's own FP8 GEMM rel. error", "local_rel_err", "max", "shadow_compare"),
    # each recipe the run measured on its tensors (Monitor(whatif_recipes=...)): full-stats steps only
    **{f"recipe_{r}_underflow_pct": (f"{RECIPE_NAMES[r]} (what-if): underflow % of non-zeros",
                                     f"case when recipe = '{r}' then 100.0 * underflow / nullif(nonzero, 0) end",
                                     "max", "recipes") for r in RECIPES},
    **{f"recipe_{r}_sqnr_db": (f"{RECIPE_NAMES[r]} (what-if): SQNR dB", f"case when recipe = '{r}' then sqnr_db end",
                               "min", "recipes") for r in RECIPES},
}
SEVERITIES = ("critical", "warning", "info")


def _q(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def step_span(e: Entry, table: str = "tensors") -> tuple[int, int] | None:
    def f():
        if not e.has(table):
            return None
        if table == "tensors":
            return rollup(e).span()
        d = e.sql(f"select min(step) lo, max(step) hi from {table}")
        return int(d["lo"].iloc[0]), int(d["hi"].iloc[0])

    return e.cached(("span", table), f, rollup=table == "tensors")


def heatmap_width(e: Entry, table: str = "tensors", max_cols: int = MAX_COLS) -> int:
    """Steps per heatmap column (for the tensors table a multiple of the rollup's base bucket)."""
    if table == "tensors" and e.has("tensors"):
        return rollup(e).width(max_cols)
    return bucket_width(step_span(e, table), max_cols)


def roles(e: Entry) -> list[str]:
    def f():
        if not e.has("tensors"):
            return []
        return sorted(set(rollup(e).role))

    return e.cached(("roles",), f, rollup=True)


def layer_order(e: Entry) -> pd.DataFrame:
    def f():
        if not e.has("tensors"):
            return pd.DataFrame({"layer": [], "ord": []})
        r = rollup(e)
        best: dict[str, int] = {}
        for l, o in zip(r.layer, r.ord):
            best[l] = min(o, best.get(l, o))
        ls = sorted(best, key=lambda l: (best[l], l))
        return pd.DataFrame({"layer": ls, "ord": [best[l] for l in ls]})

    return e.cached(("layer_order",), f, rollup=True)


def clip_span(e: Entry, span: tuple[int, int] | None, table: str = "tensors") -> tuple[int, int] | None:
    """``span`` (from the URL: any ints, either end None) within the run's steps; None = all of it."""
    full = step_span(e, table)
    if span is None or full is None:
        return None
    lo = full[0] if span[0] is None else max(full[0], int(span[0]))
    hi = full[1] if span[1] is None else min(full[1], int(span[1]))
    if (lo, hi) == full:
        return None
    if lo > hi:
        raise NoData(f"no steps in the range {span[0]}..{span[1]} (this run has steps {full[0]}..{full[1]})")
    return lo, hi


def fine(e: Entry, span: tuple[int, int] | None, max_cols: int) -> bool:
    """True when ``span`` needs finer buckets than the rollup keeps: the view reads raw rows (DuckDB)."""
    r = rollup(e)
    return span is not None and r is not None and bucket_width(span, max_cols) < r.g


def heatmap_frame(e: Entry, stat: str, role: str | None, agg: str = "worst", layer_re: str | None = None,
                  max_cols: int = MAX_COLS, last_steps: int | None = None,
                  span: tuple[int, int] | None = None) -> pd.DataFrame:
    """Columns layer, step (first step of the bucket), value; layers in execution order. ``span``:
    only steps lo..hi, re-bucketed for that range (raw rows when the range is narrower than the
    rollup's buckets), so zooming in resolves single steps."""
    if stat not in STATS:
        raise NoData(f"unknown statistic {stat!r}")
    label, expr, worst, table = STATS[stat]
    if not e.has(table):
        if table == "shadow_compare":
            raise NoData("no shadow_compare table in this run: the BF16 shadow has not been run for it")
        raise NoData(f"no {table} table in this run yet")

    def f():
        nonlocal span
        if table == "tensors" and not fine(e, span, max_cols):
            return _heatmap_rollup(e, stat, role, agg, layer_re, max_cols, last_steps, span)
        if span is None:
            span = step_span(e, table)
        if last_steps and span:
            span = (max(span[0], span[1] - last_steps + 1), span[1])
        b = bucket_width(span, max_cols)
        fn = worst if agg == "worst" else "avg"
        where = [f"step >= {int(span[0])}", f"step <= {int(span[1])}"] if span else []
        params: list = []
        if table in ("tensors", "recipes") and role:
            where.append("tensor = ?")
            params.append(role)
        if layer_re:
            where.append("regexp_matches(layer, ?)")
            params.append(layer_re)
        w = ("where " + " and ".join(where)) if where else ""
        q = f"""
            select layer, (step // {b}) * {b} as step, {fn}(v) as value
            from (select layer, step, cast({expr} as double) as v from {table} {w})
            where isfinite(v) group by 1, 2
        """
        try:
            df = e.sql(q, params)
        except Exception as exc:  # bad regex etc.
            raise NoData(f"query failed: {str(exc).splitlines()[0]}") from None
        order = layer_order(e)
        rank = {l: i for i, l in enumerate(order["layer"])}
        df["_o"] = df["layer"].map(rank).fillna(len(rank))
        df = df.sort_values(["_o", "layer", "step"]).drop(columns="_o").reset_index(drop=True)
        df["value"] = df["value"].astype(np.float32)  # half the bytes, plenty of precision for colour
        return df

    return e.cached(("heatmap", stat, role, agg, layer_re, max_cols, last_steps, span), f, rollup=True)


def recipe_series(e: Entry, layer: str, role: str, span: tuple[int, int] | None = None) -> pd.DataFrame:
    """Per step and measured recipe, one tensor's underflow % (of non-zeros) and SQNR from the
    ``recipes`` table (empty when the run measured none)."""
    def f():
        if not e.has("recipes"):
            return pd.DataFrame({"step": [], "recipe": [], "underflow_pct": [], "sqnr_db": []})
        where = "layer = ? and tensor = ?" + (f" and step >= {int(span[0])} and step <= {int(span[1])}" if span else "")
        return e.sql(f"""select step, recipe, 100.0 * sum(underflow) / nullif(sum(nonzero), 0) as underflow_pct,
                                min(sqnr_db) as sqnr_db
                         from recipes where {where} group by step, recipe order by recipe, step""", [layer, role])

    return e.cached(("recipe_series", layer, role, span), f)


def nonfinite_cells(e: Entry, role: str | None) -> pd.DataFrame:
    def f():
        if not e.has("tensors"):
            return pd.DataFrame({"layer": [], "step": []})
        r = rollup(e)
        a = r.a
        m = a["nf_step"] != np.iinfo(np.int64).max
        if role:
            m &= np.isin(a["tid"], _tids_for(r, role, None))
        idx = np.flatnonzero(m)
        idx = idx[np.argsort(a["nf_step"][idx], kind="stable")][:2000]
        return pd.DataFrame({"layer": [r.layer[t] for t in a["tid"][idx]], "step": a["nf_step"][idx]})

    return e.cached(("nonfinite", role), f, rollup=True)


def scalars_frame(e: Entry, names=("loss", "grad_norm"), max_points: int = MAX_POINTS, table: str = "scalars",
                  last_steps: int | None = None) -> pd.DataFrame:
    names = list(names)

    def f():
        if not e.has(table):
            return pd.DataFrame({"step": [], "name": [], "value": []})
        span = step_span(e, table)
        if last_steps and span:
            span = (max(span[0], span[1] - last_steps + 1), span[1])
        b = bucket_width(span, max_points)
        inl = ", ".join(_q(n) for n in names)
        return e.sql(f"select (step // {b}) * {b} as step, name, max(value) as value from {table} "
                     f"where name in ({inl}) and step >= {span[0]} group by 1, 2 order by 2, 1")

    return e.cached(("scalars", table, tuple(names), max_points, last_steps), f)


def scalar_names(e: Entry) -> list[str]:
    if not e.has("scalars"):
        return []
    return e.cached(("scalar_names",), lambda: list(e.sql("select distinct name from scalars order by 1")["name"]))


def shadow_loss_frame(e: Entry, max_points: int = MAX_POINTS) -> pd.DataFrame | None:
    """FP8 vs BF16 loss (step, name, value): shadow_compare's loss_fp8/loss_bf16 per compare step, plus each
    shadow fork's two losses (and a legacy shadow_loss table's numeric columns). None when none exists."""
    frames = []
    if e.has("shadow_compare"):
        frames.append(e.cached(("shadow_cmp_loss",), lambda: e.sql(
            "select step, name, value from (select step, avg(loss_fp8) as \"compare: fp8 loss\", "
            "avg(loss_bf16) as \"compare: bf16 loss\" from shadow_compare group by 1) "
            "unpivot (value for name in (\"compare: fp8 loss\", \"compare: bf16 loss\")) order by name, step")))
    if e.has("shadow_fork"):
        frames.append(e.cached(("shadow_fork_loss",), lambda: _fork_long(e)))
    if not e.has("shadow_loss"):
        return pd.concat(frames, ignore_index=True) if frames else None

    def f():
        schema = e.run.table("shadow_loss").schema
        cols = [n for n in schema.names if n not in ("step", "rank", "segment")
                and (pa.types.is_floating(schema.field(n).type) or pa.types.is_integer(schema.field(n).type))]
        if not cols or "step" not in schema.names:
            return pd.DataFrame({"step": [], "name": [], "value": []})
        b = bucket_width(step_span(e, "shadow_loss"), max_points)
        parts = " union all ".join(
            f'select (step // {b}) * {b} as step, {_q(c)} as name, avg(cast("{c}" as double)) as value '
            f"from shadow_loss group by 1" for c in cols)
        return e.sql(f"select * from ({parts}) order by name, step")

    return pd.concat(frames + [e.cached(("shadow_loss", max_points), f)], ignore_index=True)


def _fork_long(e: Entry) -> pd.DataFrame:
    d = e.sql("select fork_id, step, avg(loss_fp8) as f, avg(loss_bf16) as b from shadow_fork group by 1, 2 order by 1, 2")
    parts = [pd.DataFrame({"step": g["step"], "name": f"fork {k}: {lab} loss", "value": g[c]})
             for k, g in d.groupby("fork_id") for c, lab in (("f", "fp8"), ("b", "bf16"))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame({"step": [], "name": [], "value": []})


def fork_verdicts(e: Entry) -> pd.DataFrame | None:
    """Last row of each shadow fork (its verdict); None without a shadow_fork table."""
    if not e.has("shadow_fork"):
        return None
    return e.cached(("forks",), lambda: e.sql(
        "select fork_id, start_step, max(step) as last_step, arg_max(verdict, step) as verdict, "
        "arg_max(reason, step) as reason, arg_max(\"trigger\", step) as \"trigger\" from shadow_fork "
        "group by 1, 2 order by 2"))


TENSOR_SERIES = ["step", "amax", "expected_amax", "range", "scale_inv", "min_nonzero", "overflow_pct",
                 "underflow_pct", "underflow_shallow_pct", "below_normal_pct", "saturated_pct", "sqnr_db", "nonfinite",
                 "fp8_format",
                 "source", "recipe"]


def tensor_series(e: Entry, layer: str, role: str, max_points: int = MAX_POINTS,
                  span: tuple[int, int] | None = None) -> pd.DataFrame:
    """One tensor over steps (bucketed; worst value per bucket), from the rollup; ``span`` re-buckets
    lo..hi (raw rows when narrower than the rollup's buckets)."""

    def f():
        r = rollup(e)
        tid = r.tids.get((layer, role)) if r is not None else None
        if tid is None:
            return pd.DataFrame({c: [] for c in TENSOR_SERIES})
        if fine(e, span, max_points):
            return _tensor_raw(e, layer, role, max_points, span, r.fmt[tid], r.source[tid], r.recipe[tid])
        a = r.a
        rows = r.rows_in(np.flatnonzero(a["tid"] == tid), span)  # sorted by bucket
        width = r.width(max_points, span)
        col = a["b"][rows] // (width // r.g)
        st = np.flatnonzero(np.r_[True, col[1:] != col[:-1]]) if len(rows) else np.empty(0, np.int64)
        red = lambda fn, k: _reduce(fn, a[k][rows], st)  # noqa: E731
        return pd.DataFrame({
            "step": col[st] * width, "amax": red(np.maximum, "amax_max"), "expected_amax": red(np.fmax, "expected_amax"),
            "range": red(np.fmin, "range"), "scale_inv": red(np.fmax, "scale_inv"), "min_nonzero": red(np.fmin, "min_nonzero"),
            "overflow_pct": red(np.fmax, "overflow_pct_w"), "underflow_pct": red(np.fmax, "underflow_pct_w"),
            "underflow_shallow_pct": red(np.fmax, "underflow_shallow_pct_w"),
            "below_normal_pct": red(np.fmax, "below_normal_pct_w"),
            "saturated_pct": red(np.fmax, "saturated_pct_w"), "sqnr_db": red(np.fmin, "sqnr_db_w"),
            "nonfinite": red(np.fmax, "nonfinite_w"), "fp8_format": r.fmt[tid], "source": r.source[tid],
            "recipe": r.recipe[tid]})

    return e.cached(("tensor", layer, role, max_points, span), f, rollup=True)


def _tensor_raw(e: Entry, layer: str, role: str, max_points: int, span: tuple[int, int], fmt, source,
                recipe) -> pd.DataFrame:
    b = bucket_width(span, max_points)
    D = DERIVED
    q = f"""
        select (step // {b}) * {b} as step, max(amax) as amax, max(expected_amax) as expected_amax,
               min(fp8_max * scale_inv) as range, max(scale_inv) as scale_inv, min(min_nonzero) as min_nonzero,
               max({D['overflow_pct'].sql}) as overflow_pct, max({D['underflow_pct'].sql}) as underflow_pct,
               max({D['underflow_shallow_pct'].sql}) as underflow_shallow_pct,
               max({D['below_normal_pct'].sql}) as below_normal_pct,
               max({D['saturated_pct'].sql}) as saturated_pct, min(sqnr_db) as sqnr_db,
               max({D['nonfinite'].sql}) as nonfinite
        from tensors where layer = ? and tensor = ? and step between ? and ? group by 1 order by 1"""
    df = e.sql(q, [layer, role, int(span[0]), int(span[1])])
    return df.assign(fp8_format=fmt, source=source, recipe=recipe)


def first_divergence(a: pd.DataFrame, b: pd.DataFrame, rel: float = 0.05, hold: int = 3) -> int | None:
    """The first step where two runs' losses part ways: both logged, and from there on the relative
    difference stays >= ``rel`` for ``hold`` consecutive shared steps (or one of them turns non-finite
    while the other does not). ``a``/``b``: (step, value) frames of the same scalar."""
    m = pd.merge(a[["step", "value"]], b[["step", "value"]], on="step", suffixes=("_a", "_b")).sort_values("step")
    if m.empty:
        return None
    va, vb = m["value_a"].to_numpy(float), m["value_b"].to_numpy(float)
    fa, fb = np.isfinite(va), np.isfinite(vb)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.abs(va - vb) / np.maximum(np.abs(va), np.abs(vb))
    apart = (fa != fb) | (fa & fb & (d >= rel))
    steps = m["step"].to_numpy()
    run = 0
    for i, x in enumerate(apart):
        run = run + 1 if x else 0
        if run >= hold or (x and fa[i] != fb[i]):
            return int(steps[i - run + 1])
    return None


def warm_up(e: Entry) -> None:
    """Background thread started when a run is opened: rollup + what the default views ask first."""
    from dashboard.outliers import outliers
    from dashboard.verdict import ensure

    try:
        ensure(e)  # the analysis (report's verdict) runs in its own thread meanwhile
        rollup(e)
        rl = roles(e)
        names = [n for n in ("loss", "grad_norm") if n in scalar_names(e)]
        jobs = [lambda: outliers(e, None), lambda: scalars_frame(e, names),
                lambda: e.cached(("info",), e.run.info)]
        if rl:
            r0 = "activation" if "activation" in rl else rl[0]
            jobs.insert(0, lambda: heatmap_frame(e, "headroom", r0))
            jobs.append(lambda: heatmap_frame(e, "headroom", r0, last_steps=300))  # the live view's
        for job in jobs:
            try:
                job()
            except Exception:  # noqa: BLE001 - the page that needs it reports the error
                pass
    except Exception:  # noqa: BLE001
        pass
    finally:
        e.warmed.set()


