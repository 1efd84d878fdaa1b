"""Offline detection: ``detect(run, config) -> events DataFrame``, vectorized in numpy.

The tensors table is read in slices of whole steps; per slice the rows are sorted by (tensor, step)
through a permutation and numpy computes the row features, the layer-kind features, the window
features (sliding max and running counts, each tensor's last window rows carried over from the
previous slice) and every rule's predicate (:mod:`fp8scope.detect.rules`); only the rows that fire
become python dicts, where the one-line messages are written. A 10,000-step x 500-tensor run
(5M rows) takes ~2 s in ~0.4 GiB.

The rule predicates, the event construction (:func:`emit_row_events`, :func:`nan_events`) and the
scalar rules (:class:`ScalarState`) are shared with the online detector, which evaluates the
same functions over one step's rows, so both produce the same events for the same run.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from typing import Callable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.features import (TENSOR_COLUMNS, KeyMap, NumpyColumns, WindowCarry, edges_sorted, floats,
                                      group_features, last_evaluable, row_features)
from fp8scope.detect.rules import NONFINITE, SEVERITY_RANK, RowRule, _fmt, _where, row_rules
from fp8scope.schema import EVENT_SCHEMA

EVENT_COLUMNS = list(EVENT_SCHEMA.names)
SHADOW_TABLE = "shadow_compare"


def empty_events() -> pd.DataFrame:
    return EVENT_SCHEMA.empty_table().to_pandas()


def _connect():
    import duckdb

    con = duckdb.connect()
    return con


# ---- shared evaluation (offline and online) ---------------------------------------------------
def flags(c: dict, rules: list[RowRule]) -> tuple[dict, dict]:
    """(f, ev): per rule, the rule holds on the row (bool) / the row can be judged (edge rules)."""
    f, ev = {}, {}
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for r in list(rules) + [NONFINITE]:
            e = np.ones(len(c["key"]), bool) if r.evaluable is None else np.asarray(r.evaluable(c), bool)
            f[r.name] = e & np.asarray(r.cond(c), bool)
            if r.edge:
                ev[r.name] = e
    return f, ev


def edge_rules(rules: list[RowRule]) -> list[str]:
    return [r.name for r in rules if r.edge] + ["nonfinite"]


def emit_row_events(c: dict, fired: dict, rules: list[RowRule], km, nan_rows: list | None = None) -> list[dict]:
    """Events of the rows where ``fired[rule]`` (bool per row of ``c``) is true.

    Only those rows become python dicts. ``nonfinite`` rows are appended to ``nan_rows`` (they
    need the whole run's order to find the NaN origin: :func:`nan_events`).
    """
    out: list[dict] = []
    for rule in list(rules) + [NONFINITE]:
        m = fired.get(rule.name)
        if m is None or not m.any():
            continue
        idx = np.flatnonzero(m)
        sub = {k: v[idx] for k, v in c.items()}
        rows = _rows(sub, km)
        if rule is NONFINITE:
            if nan_rows is not None:
                nan_rows.extend(rows)
            continue
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            val = np.broadcast_to(np.asarray(rule.value(sub), float), idx.shape)
            thr = np.broadcast_to(np.asarray(rule.threshold(sub), float), idx.shape)
            sev = np.broadcast_to(np.asarray(rule.severity(sub)), idx.shape)
        for r, v, t, s in zip(rows, val.tolist(), thr.tolist(), sev.tolist()):
            r["value"], r["threshold"] = _none(v), _none(t)
            out.append(_event(r, rule.name, s, v, t, rule.message(r)))
    return out


def _none(v):
    return None if isinstance(v, float) and v != v else v


def _rows(sub: dict, km) -> list[dict]:
    cols = {k: [_none(x) for x in v.tolist()] for k, v in sub.items()}
    cols.update(km.names(sub["key"].tolist()))
    names = list(cols)
    return [dict(zip(names, vals)) for vals in zip(*cols.values())]


def nan_events(rows: list[dict], state: dict) -> list[dict]:
    """nan_origin (first non-finite row of a rank, in step then execution order) and nonfinite events.

    ``state`` (rank -> origin dict) carries the origin across calls (online: one step at a time).
    """
    out = []
    for r in sorted(rows, key=lambda r: (r["rank"], r["step"], r.get("order") or 0)):
        rank = int(r["rank"])
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


def _isnull(v) -> bool:
    if v is None or v is pd.NA or v is pd.NaT:
        return True
    try:
        return isinstance(v, float) and np.isnan(v)
    except TypeError:
        return False


def _nan_value(r: dict) -> float:
    n = r.get("nonfinite")
    if n is not None:
        return float(n)
    return float("nan")


def _event(r: dict, rule: str, severity: str, value, threshold, message: str) -> dict:
    return {
        "step": int(r["step"]), "rank": int(r["rank"]), "rule": rule, "severity": severity,
        "layer": r.get("layer") or "", "tensor": r.get("tensor") or "",
        "value": float("nan") if value is None else float(value),
        "threshold": float("nan") if threshold is None else float(threshold),
        "message": message, "_order": int(r.get("order") or 0),
    }


class ScalarState:
    """Loss / grad-norm rules, one value at a time (the online detector feeds each step, the
    offline engine the whole series in step order): loss_spike, grad_norm_spike, loss_nonfinite."""

    def __init__(self, cfg: DetectConfig):
        self.cfg = cfg
        self.hist: dict[tuple, deque] = {}
        self.bad: dict[tuple, bool] = {}

    def update(self, step: int, rank: int, name: str, value) -> list[dict]:
        cfg = self.cfg
        if name == cfg.grad_norm_name:
            w, need, factor, rule, what = int(cfg.grad_window), int(cfg.min_history), float(cfg.grad_spike_factor), \
                "grad_norm_spike", "grad norm"
        elif name == cfg.loss_name:
            w, need, factor, rule, what = int(cfg.loss_window), int(cfg.loss_window), float(cfg.loss_spike_factor), \
                "loss_spike", "loss"
        else:
            return []
        key = (rank, name)
        dq = self.hist.get(key)
        if dq is None:
            dq = self.hist[key] = deque(maxlen=w)
        vals = [v for v in dq if v == v]
        n_prev = len(vals)
        prev_mean = sum(vals) / n_prev if n_prev else float("nan")
        v = float("nan") if value is None else float(value)
        fin = math.isfinite(v)
        dq.append(v if fin else float("nan"))
        was_bad, self.bad[key] = self.bad.get(key, False), (not fin and value is not None)
        out = []
        base = {"step": step, "rank": rank, "layer": "", "tensor": name, "order": -1}
        sev = "info" if step < int(cfg.warmup_steps) else "warning"
        if fin and n_prev >= need and prev_mean > 0 and v > factor * prev_mean and rule not in cfg.disabled:
            ratio = v / prev_mean
            if rule == "loss_spike":
                msg = (f"loss {_fmt(v)} is {_fmt(ratio)}x the mean of the previous {n_prev} "
                       f"steps ({_fmt(prev_mean)})")
            else:
                msg = (f"grad norm {_fmt(v)} is {_fmt(ratio)}x its moving average over "
                       f"{n_prev} steps ({_fmt(prev_mean)})")
            out.append(_event(base, rule, sev, ratio, factor, msg))
        if self.bad[key] and not was_bad and "loss_nonfinite" not in cfg.disabled:
            out.append(_event(base, "loss_nonfinite", "critical", v, float("nan"),
                              f"{name} became non-finite ({_fmt(_none(v))}) at step {step}"))
        return out


def to_frame(events: list[dict]) -> pd.DataFrame:
    if not events:
        return empty_events()
    df = pd.DataFrame(events)
    df["_sev"] = df["severity"].map(SEVERITY_RANK)
    df = df.sort_values(["step", "rank", "_order", "rule"], kind="stable").reset_index(drop=True)
    df = df[EVENT_COLUMNS]
    return df.astype({"step": "int64", "rank": "int32", "value": "float64", "threshold": "float64"})


def sort_events(events: list[dict]) -> list[dict]:
    """Events in the frame's order (step, rank, execution order, rule), EVENT_COLUMNS keys only."""
    ev = sorted(events, key=lambda e: (e["step"], e["rank"], e["_order"], e["rule"]))
    return [{k: e[k] for k in EVENT_COLUMNS} for e in ev]


def events_batch_from_records(records: list[dict]) -> pa.RecordBatch:
    """Event dicts (EVENT_COLUMNS keys) -> RecordBatch with EVENT_SCHEMA, without pandas."""
    return pa.RecordBatch.from_pylist(records, schema=EVENT_SCHEMA)


def events_batch(df: pd.DataFrame) -> pa.RecordBatch:
    """Events DataFrame -> RecordBatch with EVENT_SCHEMA (for the store)."""
    t = pa.Table.from_pandas(df[EVENT_COLUMNS], schema=EVENT_SCHEMA, preserve_index=False).combine_chunks()
    batches = t.to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=EVENT_SCHEMA)


# ---- offline -------------------------------------------------------------------------------
CHUNK_ROWS = 1 << 18  # rows per slice of the offline pass (whole steps): bounds its memory


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """numpy allocates without asking for transparent huge pages meanwhile; the previous setting comes back after.

    Offline detection makes a few dozen short-lived arrays of tens of MB. numpy advises huge pages for every
    large array, and on a VM a fresh huge page costs far more to fault in than the TLB misses it saves on one
    or two passes: on the 2-core benchmark VM ``fp8scope report`` of a 5M-row run spent 2.2-3.7 s in the
    kernel with the advice and 0.9-1.1 s without (docs/benchmarks.md). Only a hint: nothing else changes.
    """
    setter = _madvise_setter()
    if setter is None:
        yield
        return
    before = setter(False)
    try:
        yield
    finally:
        setter(before)


def _madvise_setter():
    """numpy's switch for its huge-page advice (numpy >= 2: numpy._core; 1.26: numpy.core), None if absent."""
    from importlib import import_module

    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return getattr(import_module(mod), "_set_madvise_hugepage")
        except (ImportError, AttributeError):
            continue
    return None


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
    with small_pages():
        events = _run_rules(run, cfg, tick)
    return to_frame(events)


def _run_rules(run, cfg: DetectConfig, tick: Callable[[str], None]) -> list[dict]:
    """Every rule over every table of ``run``; the events as dicts, unsorted."""
    events: list[dict] = []
    tick("reading run")
    names = set(run.table_names())
    if "tensors" in names:
        t = _read(run, "tensors", TENSOR_COLUMNS)
        if t.num_rows:
            tick("tensor rules")
            events += _tensor_events(t, cfg)
            tick("cross-rank rules")
            events += _cross_rank_events(t, cfg, run.manifest)
        del t
    if "scalars" in names:
        s = _read(run, "scalars", ["step", "rank", "name", "value"])
        if s.num_rows:
            tick("loss and grad-norm rules")
            events += _scalar_events(s, cfg)
    if SHADOW_TABLE in names and "fp8_vs_bf16" not in cfg.disabled:
        tick("shadow rules")
        con = _connect()
        try:
            events += _shadow_events(con, run.table(SHADOW_TABLE), cfg)
        finally:
            con.close()
    tick("done")
    return events


def open_run(path):
    """A run opened for a one-pass read: record batches stay zero-copy over the memory-mapped streams
    (no copy of the whole run on load) where the store supports it."""
    from fp8scope.run import Run

    return Run(path, combine_chunks=False)


def _read(run, name: str, columns: list[str]) -> pa.Table:
    """Only the columns detection needs (a zero-copy selection of the merged table)."""
    t = run.table(name)
    return t.select([c for c in columns if c in t.column_names])


def _tensor_events(table: pa.Table, cfg: DetectConfig) -> list[dict]:
    """Row features, windows (per tensor, rows sorted by step), group features (per step and
    kind) and the rules, in numpy; only the rows that fire become python dicts. The table is
    read in slices of whole steps of about CHUNK_ROWS rows (:class:`TensorPass`), so memory stays
    bounded by the slice, not the run."""
    bounds, ordered = _step_slices(table)
    tp = TensorPass(cfg)
    events: list[dict] = []
    for a, b in bounds:
        events += tp.events(table.slice(a, b - a), ordered)
    return events + nan_events(tp.nan_rows, {})


def in_step_order(rank: np.ndarray, step: np.ndarray) -> bool:
    """Rows sorted by (rank, step), as one rank's stream is written: what :class:`TensorPass` calls ``ordered``."""
    dr, ds = np.diff(rank), np.diff(step)
    return bool(((dr > 0) | ((dr == 0) & (ds >= 0))).all())


def _step_slices(table: pa.Table) -> tuple[list[tuple[int, int]], bool]:
    """Row ranges [a, b) of about CHUNK_ROWS rows, cut between (rank, step) groups, and True, when the
    rows are sorted by (rank, step) (a run is written in step order, one stream per rank); else one range
    over the whole table and False (its rows are then sorted by (tensor, step) in one piece)."""
    n = table.num_rows
    rank = table.column("rank").to_numpy().astype(np.int64, copy=False)
    step = table.column("step").to_numpy().astype(np.int64, copy=False)
    if not in_step_order(rank, step):
        return [(0, n)], False
    dr, ds = np.diff(rank), np.diff(step)
    cuts = np.flatnonzero((dr != 0) | (ds != 0)) + 1  # first row of each (rank, step) group but the first
    bounds = [0]
    while bounds[-1] + CHUNK_ROWS < n:
        i = int(np.searchsorted(cuts, bounds[-1] + CHUNK_ROWS))
        if i == len(cuts):
            break
        bounds.append(int(cuts[i]))
    bounds.append(n)
    return list(zip(bounds[:-1], bounds[1:])), True


class TensorPass:
    """The tensor rules over a run, one slice of whole steps at a time. Tensor keys, each tensor's last
    window rows (:class:`~fp8scope.detect.features.WindowCarry`) and edge flags carry over from slice to
    slice, so the events equal those of one pass over the whole run; layer-kind groups never span steps."""

    def __init__(self, cfg: DetectConfig):
        self.cfg, self.rules, self.km = cfg, row_rules(cfg), KeyMap()
        self.windows = WindowCarry(cfg)
        self.edge_state = {r: np.zeros(0, bool) for r in edge_rules(self.rules)}  # per tensor key
        self.nan_rows: list[dict] = []

    def events(self, part: pa.Table, ordered: bool) -> list[dict]:
        """Events of one slice; ``ordered``: its rows are sorted by (rank, step)."""
        key = _keys(self.km, part)
        cols, nulls = _numeric_columns(part)
        # rows sorted by (tensor, step): within (rank, step) order a stable sort by key suffices
        perm = np.argsort(key, kind="stable") if ordered else np.lexsort((cols["step"], key))
        c = row_features(NumpyColumns(cols, nulls, perm), key[perm], self.km, self.cfg)
        del cols, nulls
        group_features(c, self.km.group_of)
        c.update(self.windows.features(c["key"], c))
        f, ev = flags(c, self.rules)
        fired = {r: (self._edges(r, c["key"], f[r], ev[r]) if r in ev else f[r]) for r in f}
        return emit_row_events(c, fired, self.rules, self.km, self.nan_rows)

    def _edges(self, rule: str, key: np.ndarray, f: np.ndarray, ev: np.ndarray) -> np.ndarray:
        """Edges of ``rule`` in this slice against each tensor's flag from the slices before; updates it."""
        state = self.edge_state[rule]
        if len(state) < len(self.km.info):
            state = self.edge_state[rule] = np.r_[state, np.zeros(len(self.km.info) - len(state), bool)]
        out = edges_sorted(key, f, ev, state)
        last_evaluable(key, f, ev, state)
        return out


def _keys(km, t: pa.Table) -> np.ndarray:
    """Tensor key of every row. A run read zero-copy has one chunk per logged step, and consecutive steps
    repeat the same names: per chunk they hit keys_of's cache."""
    names = t.select(["rank", "layer", "tensor", "fp8_format"])
    if names.column(0).num_chunks > 1:
        return np.concatenate([km.keys_of(b) for b in names.to_batches()])
    return km.keys_of(names)


def _numeric_columns(t: pa.Table) -> tuple[dict, dict]:
    """The numeric columns detection reads, as numpy (step / rank int64, the rest float64 with NaN for
    null), and the null mask of amax; strings stay in arrow (only their dictionary ids are used)."""
    cols, nulls = {}, {}
    for name in TENSOR_COLUMNS:
        if name in ("layer", "tensor", "fp8_format"):
            continue
        col = t.column(name)
        if name in ("step", "rank"):
            cols[name] = col.to_numpy().astype(np.int64, copy=False)
        else:
            cols[name] = floats(col)
        if name == "amax" and col.null_count:
            nulls[name] = np.asarray(col.is_null())
    return cols, nulls


def _scalar_events(table: pa.Table, cfg: DetectConfig) -> list[dict]:
    names = pa.array([cfg.loss_name, cfg.grad_norm_name])
    # one chunk per logged step of a few rows each (zero-copy read): per-chunk overhead would dominate
    table = table.combine_chunks()
    t = table.filter(pc.is_in(table["name"], value_set=names))
    if not t.num_rows:
        return []
    t = t.sort_by([("rank", "ascending"), ("name", "ascending"), ("step", "ascending")])
    st = ScalarState(cfg)
    out: list[dict] = []
    for step, rank, name, value in zip(*(t[c].to_pylist() for c in ("step", "rank", "name", "value"))):
        out += st.update(int(step), int(rank), name, value)
    return out


def _cross_rank_events(table: pa.Table, cfg: DetectConfig, manifest: dict | None = None) -> list[dict]:
    """Same tensor, same step, different scale on ranks that should agree (Megatron-LM PR #442).

    The rule lives in ``fp8scope.distributed.consistency`` (shared with the Monitor's online check):
    it compares only the roles and rank groups that must agree (default: weights, all ranks; the
    Monitor's ``cross_rank_check`` settings in run.json override), ignores the aggregated rank -1 rows.
    """
    from fp8scope.distributed.consistency import RULE_NAME, check_from_manifest, scale_mismatch_events

    if RULE_NAME in cfg.disabled or "cross_rank_scale" in cfg.disabled or "rank" not in table.column_names:
        return []
    if _ranks_at_least(table["rank"], 0) < 2:
        return []  # one rank agrees with itself; spares a pandas copy of five columns of every row
    df = table.select(["step", "rank", "layer", "tensor", "scale"]).to_pandas()
    df = df[df["rank"] >= 0]
    check = check_from_manifest(manifest or {})
    check.enabled = True
    return scale_mismatch_events(df, check).to_dict("records")


def _ranks_at_least(rank, lowest: int) -> int:
    """Number of distinct ranks >= ``lowest`` in a rank column."""
    ranks = pc.unique(rank)
    return len(pc.filter(ranks, pc.greater_equal(ranks, lowest)))


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
