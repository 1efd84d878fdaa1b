"""Offline detection: ``detect(run, config) -> events DataFrame``, vectorized in DuckDB.

One pass of window functions over the tensors table (partitioned by rank, layer, tensor,
ordered by step) computes every rule's features; the predicates run in the same query and
only the rows that fire come back to Python, where the one-line messages are written.
A 10,000-step x 500-tensor run (5M rows) takes a few seconds on two cores.

The per-row evaluation (:func:`emit_row_events`, :func:`emit_scalar_events`) is shared with the
online detector, so both produce the same events for the same run.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.features import (
    group_features_sql,
    row_features_sql,
    scalar_row_sql,
    scalar_window_sql,
    window_features_sql,
    _q,
)
from fp8scope.detect.rules import SEVERITY_RANK, RowRule, _fmt, _where, row_rules
from fp8scope.schema import EVENT_SCHEMA

EVENT_COLUMNS = list(EVENT_SCHEMA.names)
TENSOR_COLUMNS = [
    "step", "rank", "layer", "tensor", "order", "fp8_format", "full", "amax", "min_nonzero", "scale", "scale_inv",
    "expected_amax", "fp8_max", "numel", "zeros", "nonfinite", "overflow", "underflow",
]
SHADOW_TABLE = "shadow_compare"


def empty_events() -> pd.DataFrame:
    return EVENT_SCHEMA.empty_table().to_pandas()


def _connect():
    import duckdb

    con = duckdb.connect()
    return con


# ---- shared evaluation (offline and online) ---------------------------------------------------
NONFINITE = RowRule("nonfinite", cond="bad", value="0", threshold="0", severity="'critical'",
                    message=lambda r: "", edge=True, evaluable="true")


def flag_columns(rules: list[RowRule]) -> str:
    """f_<rule>: the rule holds (never NULL); ev_<rule>: the row can be judged (edge bookkeeping)."""
    cols = []
    for r in list(rules) + [NONFINITE]:
        cols.append(f"coalesce(({r.evaluable}) and ({r.cond}), false) as f_{r.name}")
        if r.edge:
            cols.append(f"coalesce(({r.evaluable}), false) as ev_{r.name}")
    return ", ".join(cols)


def edge_rules(rules: list[RowRule]) -> list[str]:
    return [r.name for r in rules if r.edge] + ["nonfinite"]


def emit_row_events(con, fired: pd.DataFrame, rules: list[RowRule], cfg: DetectConfig,
                    nan_state: dict | None = None) -> list[dict]:
    """Events from rows whose ``e_<rule>`` column is true (the features are in the row).

    ``nan_state`` (rank -> origin dict) carries the NaN origin across calls (online); offline
    passes a fresh dict and all rows at once.
    """
    out: list[dict] = []
    if fired is None or fired.empty:
        return out
    for rule in rules:
        col = f"e_{rule.name}"
        if col not in fired:
            continue
        sub = fired[fired[col].fillna(False).astype(bool)]
        if sub.empty:
            continue
        con.register("_fired", sub)
        try:
            rows = con.execute(
                f"select *, cast({rule.value} as double) as value, cast({rule.threshold} as double) as threshold, "
                f"{rule.severity} as severity from _fired"
            ).df()
        finally:
            con.unregister("_fired")
        for r in rows.to_dict("records"):
            r = {k: (None if _isnull(v) else v) for k, v in r.items()}
            out.append(_event(r, rule.name, r["severity"], r["value"], r["threshold"], rule.message(r)))
    if "e_nonfinite" in fired:
        out.extend(_nan_events(fired[fired["e_nonfinite"].fillna(False).astype(bool)], nan_state
                               if nan_state is not None else {}))
    return out


def _nan_events(bad: pd.DataFrame, state: dict) -> list[dict]:
    out = []
    if bad.empty:
        return out
    bad = bad.sort_values(["rank", "step", "order"])
    for rank, grp in bad.groupby("rank", sort=True):
        rank = int(rank)
        for r in grp.to_dict("records"):
            r = {k: (None if _isnull(v) else v) for k, v in r.items()}
            what = "NaN/Inf amax" if r.get("bad_amax") else f"{int(r.get('nonfinite') or 0)} non-finite values"
            origin = state.get(rank)
            if origin is None:
                state[rank] = origin = {"step": int(r["step"]), "layer": r["layer"], "tensor": r["tensor"]}
                msg = (f"{_where(r)} produced the first non-finite value of the run at step {int(r['step'])} "
                       f"({what}; first in execution order): NaN origin")
                out.append(_event(r, "nan_origin", "critical", _nan_value(r), 0.0, msg))
            else:
                msg = (f"{_where(r)}: {what}, propagated from {origin['layer']} {origin['tensor']} "
                       f"(first non-finite at step {origin['step']})")
                out.append(_event(r, "nonfinite", "warning", _nan_value(r), 0.0, msg))
    return out


def _nan_value(r: dict) -> float:
    n = r.get("nonfinite")
    if n is not None:
        return float(n)
    return float("nan")


def _isnull(v) -> bool:
    if v is None or v is pd.NA or v is pd.NaT:
        return True
    try:
        return isinstance(v, float) and np.isnan(v)
    except TypeError:
        return False


def _event(r: dict, rule: str, severity: str, value, threshold, message: str) -> dict:
    return {
        "step": int(r["step"]), "rank": int(r["rank"]), "rule": rule, "severity": severity,
        "layer": r.get("layer") or "", "tensor": r.get("tensor") or "",
        "value": float("nan") if value is None else float(value),
        "threshold": float("nan") if threshold is None else float(threshold),
        "message": message, "_order": int(r.get("order") or 0),
    }


def scalar_flags_sql(src: str, cfg: DetectConfig) -> str:
    ln, gn = _q(cfg.loss_name), _q(cfg.grad_norm_name)
    warm = int(cfg.warmup_steps)
    return f"""
    select *,
        (name = {ln} and n_prev >= {int(cfg.loss_window)} and prev_mean > 0
            and v_f > {float(cfg.loss_spike_factor)!r} * prev_mean) as f_loss_spike,
        (name = {gn} and n_prev >= {int(cfg.min_history)} and prev_mean > 0
            and v_f > {float(cfg.grad_spike_factor)!r} * prev_mean) as f_grad_norm_spike,
        bad as f_loss_nonfinite,
        case when step < {warm} then 'info' else 'warning' end as spike_severity
    from {src}
    """


def emit_scalar_events(fired: pd.DataFrame, cfg: DetectConfig) -> list[dict]:
    out = []
    if fired is None or fired.empty:
        return out
    for r in fired.to_dict("records"):
        r = {k: (None if _isnull(v) else v) for k, v in r.items()}
        r.setdefault("layer", "")
        r.setdefault("tensor", "")
        base = {**r, "layer": "", "tensor": r["name"], "order": -1}
        if r.get("e_loss_spike") and "loss_spike" not in cfg.disabled:
            v = r["v_f"] / r["prev_mean"]
            out.append(_event(base, "loss_spike", r["spike_severity"], v, cfg.loss_spike_factor,
                              f"loss {_fmt(r['v_f'])} is {_fmt(v)}x the mean of the previous {int(r['n_prev'])} "
                              f"steps ({_fmt(r['prev_mean'])})"))
        if r.get("e_grad_norm_spike") and "grad_norm_spike" not in cfg.disabled:
            v = r["v_f"] / r["prev_mean"]
            out.append(_event(base, "grad_norm_spike", r["spike_severity"], v, cfg.grad_spike_factor,
                              f"grad norm {_fmt(r['v_f'])} is {_fmt(v)}x its moving average over "
                              f"{int(r['n_prev'])} steps ({_fmt(r['prev_mean'])})"))
        if r.get("e_loss_nonfinite") and "loss_nonfinite" not in cfg.disabled:
            out.append(_event(base, "loss_nonfinite", "critical", r["value"], float("nan"),
                              f"{r['name']} became non-finite ({_fmt(r['value'])}) at step {int(r['step'])}"))
    return out


def to_frame(events: list[dict]) -> pd.DataFrame:
    if not events:
        return empty_events()
    df = pd.DataFrame(events)
    df["_sev"] = df["severity"].map(SEVERITY_RANK)
    df = df.sort_values(["step", "rank", "_order", "rule"], kind="stable").reset_index(drop=True)
    df = df[EVENT_COLUMNS]
    return df.astype({"step": "int64", "rank": "int32", "value": "float64", "threshold": "float64"})


def events_batch(df: pd.DataFrame) -> pa.RecordBatch:
    """Events DataFrame -> RecordBatch with EVENT_SCHEMA (for the store)."""
    t = pa.Table.from_pandas(df[EVENT_COLUMNS], schema=EVENT_SCHEMA, preserve_index=False).combine_chunks()
    batches = t.to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=EVENT_SCHEMA)


# ---- offline -------------------------------------------------------------------------------
def detect(run, config: DetectConfig | None = None, progress: Callable[[str], None] | None = None,
           rules: list[str] | None = None) -> pd.DataFrame:
    """Run every rule over a run (a :class:`fp8scope.run.Run` or a path); returns the events frame.

    Columns: step, rank, rule, severity, layer, tensor, value, threshold, message (EVENT_SCHEMA).
    ``progress(phase)`` is called before each phase (the CLI draws a progress bar from it).
    """
    from fp8scope.run import Run, load_run

    if not isinstance(run, Run):
        run = load_run(run)
    cfg = config or DetectConfig()
    if rules:
        from fp8scope.detect.rules import all_rule_names

        keep = set(rules)
        cfg = cfg.with_(disabled=tuple(n for n in all_rule_names(cfg) if n not in keep))
    tick = progress or (lambda phase: None)
    events: list[dict] = []
    con = _connect()
    try:
        tick("reading run")
        names = set(run.table_names())
        if "tensors" in names:
            t = run.table("tensors")
            if t.num_rows:
                tick("tensor rules")
                events += _tensor_events(con, t.select(TENSOR_COLUMNS), cfg)
                tick("cross-rank rules")
                events += _cross_rank_events(t, cfg, run.manifest)
        if "scalars" in names:
            s = run.table("scalars")
            if s.num_rows:
                tick("loss and grad-norm rules")
                con.register("scalars_raw", s.select(["step", "rank", "name", "value"]))
                events += _scalar_events(con, cfg)
        if SHADOW_TABLE in names and "fp8_vs_bf16" not in cfg.disabled:
            tick("shadow rules")
            events += _shadow_events(con, run.table(SHADOW_TABLE), cfg)
    finally:
        con.close()
    tick("done")
    return to_frame(events)


def _tensor_events(con, table: pa.Table, cfg: DetectConfig) -> list[dict]:
    """One window pass (features + running count of evaluable rows per edge rule); only candidate
    rows (some rule holds) come back. A candidate is an edge unless the previous evaluable row of
    the same tensor (running count - 1) is also a candidate for that rule."""
    from fp8scope.detect.features import KeyMap

    import numpy as np

    from fp8scope.detect.features import window_features_numpy

    rules = row_rules(cfg)
    km = KeyMap()
    num = km.narrow(table)
    con.register("tensors_num", num)
    edge = [r for r in rules if r.edge] + [NONFINITE]
    allr = [r.name for r in rules] + ["nonfinite"]
    any_f = " or ".join(f"f_{n}" for n in allr)
    evs = ", ".join(f"coalesce(({r.evaluable}), false) as ev_{r.name}" for r in edge)
    rowf = con.sql(f"select *, {evs} from ({row_features_sql('tensors_num', cfg)})").to_arrow_table()
    con.unregister("tensors_num")
    del num

    def col(name, dtype=float):
        c = rowf[name]
        return c.to_numpy() if dtype is bool else c.to_numpy(zero_copy_only=False).astype(dtype)

    # windows run over the rows sorted by (tensor, step) through a permutation; results go back
    # to the table's order (gathering five columns is far cheaper than sorting the table)
    key = col("key", np.int64)
    order = np.lexsort((col("step", np.int64), key))
    w = window_features_numpy(key[order], {"amax_f": col("amax_f")[order], "scale_inv_f": col("scale_inv_f")[order],
                                           "sat_hit": col("sat_hit", np.int64)[order],
                                           "bad_amax": col("bad_amax", bool)[order]},
                              cfg, {r.name: col(f"ev_{r.name}", bool)[order] for r in edge})

    def unpermute(v):
        out = np.empty_like(v)
        out[order] = v
        return out

    for name, v in w.items():
        if isinstance(v, tuple):
            arr = pa.array(unpermute(v[0]), mask=unpermute(v[1]))
            rowf = rowf.append_column(name, arr)
            continue
        v = unpermute(v)
        if v.dtype.kind == "f":
            arr = pa.array(v, from_pandas=True)
        else:
            arr = pa.array(v)
        rowf = rowf.append_column(name, arr)
    con.register("win", rowf)
    q = f"""
    with feat as ({group_features_sql('win')}),
    flags as (select *, {flag_columns(rules)} from feat)
    select * from flags where {any_f}
    """
    cand = con.execute(q).df()
    con.unregister("win")
    if cand.empty:
        return []
    edge_names = {r.name for r in edge}
    for n in allr:
        f = cand[f"f_{n}"].to_numpy(dtype=bool)
        if n in edge_names:
            hit = cand.loc[f, ["key", f"rn_{n}"]]
            prev = set(zip(hit["key"].astype(int), hit[f"rn_{n}"].astype(int)))
            e = [bool(ff) and (int(k), int(rn) - 1) not in prev
                 for ff, k, rn in zip(f, cand["key"], cand[f"rn_{n}"])]
            cand[f"e_{n}"] = e
        else:
            cand[f"e_{n}"] = f
    fired = km.names(cand[cand[[f"e_{n}" for n in allr]].any(axis=1)])
    return emit_row_events(con, fired, rules, cfg, {})


def _scalar_events(con, cfg: DetectConfig) -> list[dict]:
    q = f"""
    with r as ({scalar_row_sql('scalars_raw')}),
    w as ({scalar_window_sql('r', cfg)}),
    f as ({scalar_flags_sql('w', cfg)}),
    e as (select *, f_loss_spike as e_loss_spike, f_grad_norm_spike as e_grad_norm_spike,
          f_loss_nonfinite and not coalesce(lag(f_loss_nonfinite) over (partition by rank, name order by step), false)
              as e_loss_nonfinite
          from f)
    select * from e where coalesce(e_loss_spike, false) or coalesce(e_grad_norm_spike, false)
        or coalesce(e_loss_nonfinite, false)
    """
    return emit_scalar_events(con.execute(q).df(), cfg)


def _cross_rank_events(table: pa.Table, cfg: DetectConfig, manifest: dict | None = None) -> list[dict]:
    """Same tensor, same step, different scale on ranks that should agree (Megatron-LM PR #442).

    The rule lives in ``fp8scope.distributed.consistency`` (shared with the Monitor's online check):
    it compares only the roles and rank groups that must agree (default: weights, all ranks; the
    Monitor's ``cross_rank_check`` settings in run.json override), ignores the aggregated rank -1 rows.
    """
    from fp8scope.distributed.consistency import RULE_NAME, check_from_manifest, scale_mismatch_events

    if RULE_NAME in cfg.disabled or "cross_rank_scale" in cfg.disabled or "rank" not in table.column_names:
        return []
    df = table.select(["step", "rank", "layer", "tensor", "scale"]).to_pandas()
    df = df[df["rank"] >= 0]
    check = check_from_manifest(manifest or {})
    check.enabled = True
    return scale_mismatch_events(df, check).to_dict("records")


def _has(con, name: str) -> bool:
    try:
        con.execute(f"select 1 from {name} limit 0")
        return True
    except Exception:
        return False


def _shadow_events(con, table: pa.Table, cfg: DetectConfig) -> list[dict]:
    """FP8-vs-BF16 divergence from the shadow tables (skipped silently when absent or unexpected)."""
    cols = set(table.column_names)
    errs = [c for c in ("output_rel_err", "wgrad_rel_err") if c in cols]
    if not errs or not {"step", "layer"} <= cols or table.num_rows == 0:
        return []
    rank = "rank" if "rank" in cols else "0"
    con.register("shadow_raw", table)
    worst = "greatest(" + ", ".join(f"coalesce({c}, 0)" for c in errs) + ")" if len(errs) > 1 else f"coalesce({errs[0]}, 0)"
    thr, crit = float(cfg.shadow_rel_err), float(cfg.shadow_critical_rel_err)
    q = f"""
    with s as (select step, {rank} as rank, layer, {', '.join(errs)}, {worst} as err from shadow_raw),
    f as (select *, err > {thr!r} as bad from s),
    e as (select *, bad and not coalesce(lag(bad) over (partition by rank, layer order by step), false) as fire from f)
    select * from e where fire order by step, rank, layer
    """
    out = []
    for r in con.execute(q).df().to_dict("records"):
        r = {k: (None if _isnull(v) else v) for k, v in r.items()}
        which = max(errs, key=lambda c: r.get(c) or 0)
        r["tensor"] = "output" if which == "output_rel_err" else "wgrad"
        sev = "critical" if r["err"] > crit else "warning"
        out.append(_event(r, "fp8_vs_bf16", sev, r["err"], thr,
                          f"{r['layer']}: FP8 {r['tensor']} differs from the BF16 shadow by {_fmt(100 * r['err'])}% "
                          f"relative error (threshold {_fmt(100 * thr)}%): FP8 is to blame here"))
    con.unregister("shadow_raw")
    return out
