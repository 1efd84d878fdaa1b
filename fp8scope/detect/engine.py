"""Offline detection: ``detect(run, config) -> events DataFrame``, vectorized in numpy.

The tensors table is read in slices of whole steps; per slice the rows are sorted by (tensor, step)
through a permutation and numpy computes the row features, the layer-kind features, the window
features (sliding max and running counts, each tensor's last window rows carried over from the
previous slice) and every rule's predicate (:mod:`fp8scope.detect.rules`); only the rows that fire
become python dicts, where the one-line messages are written. Memory is bounded by a slice, not
the run (docs/benchmarks.md, "Detection and report", times a 5M-row run).

The rule predicates, the event construction (:func:`emit_row_events`, :func:`nan_events`) and the
scalar rules (:mod:`fp8scope.detect.scalar_rules`) are shared with the online detector, which
evaluates the same functions over one step's rows, so both produce the same events for the same
run. Events are built by :mod:`fp8scope.detect.events`; FP8-vs-BF16 compares are judged in
:mod:`fp8scope.detect.shadow_rule` (offline only: shadow tables are written after their step).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.features import (TENSOR_COLUMNS, KeyMap, NumpyColumns, RunMax, WindowCarry, edges_sorted, floats,
                                      group_features, last_evaluable, row_features)
from fp8scope.detect.rules import NONFINITE, SEVERITY_RANK, RowRule, _fmt, _where, row_rules
from fp8scope.detect.events import (EVENT_COLUMNS, empty_events, event, events_batch, events_batch_from_records,
                                    nan_value, none_if_nan, rows_of, sort_events, to_frame)
from fp8scope.detect.scalar_rules import ScalarState
from fp8scope.detect.shadow_rule import SHADOW_TABLE, shadow_events

if TYPE_CHECKING:  # the online child imports this module, and pandas only costs it start-up time
    import pandas as pd


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


# Rules that judge a tensor's cast (its scale, range, flush), which a what-if layer only simulates: in a
# run whose other layers run FP8, their messages say so. Its amax, growth and NaNs are its own.
SIMULATED_CAST = frozenset({"saturation", "saturation_rate", "stale_scale", "scale_mismatch", "underflow",
                            "dynamic_range", "scale_collapse", "scale_kept"})
SIMULATED_NOTE = " (what-if: this layer runs in high precision; the cast is simulated)"


def emit_row_events(c: dict, fired: dict, rules: list[RowRule], km, nan_rows: list | None = None,
                    info_seen: dict[str, np.ndarray] | None = None) -> list[dict]:
    """Events of the rows where ``fired[rule]`` (bool per row of ``c``, sorted by tensor then step)
    is true.

    Only those rows become python dicts. ``nonfinite`` rows are appended to ``nan_rows`` (they
    need the whole run's order to find the NaN origin: :func:`nan_events`). ``info_seen[rule]``
    (bool per tensor key, updated here): the tensors that had an ``info`` event of that rule, whose
    later ``info`` events are dropped. An info event is evidence about a tensor (its range exceeds
    one scale's, it sits far from its peers), not an incident: a tensor near the threshold crossed
    it again and again between full steps, and a healthy 200-step demo run logged 181
    ``dynamic_range`` events and 25 ``layer_outlier`` events for one gradient. Warnings and
    critical events fire on every edge, as before.
    """
    out: list[dict] = []
    for rule in list(rules) + [NONFINITE]:
        m = fired.get(rule.name)
        if m is None or not m.any():
            continue
        idx = np.flatnonzero(m)
        sub = {k: v[idx] for k, v in c.items()}
        rows = rows_of(sub, km)
        if rule is NONFINITE:
            if nan_rows is not None:
                nan_rows.extend(rows)
            continue
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            val = np.broadcast_to(np.asarray(rule.value(sub), float), idx.shape)
            thr = np.broadcast_to(np.asarray(rule.threshold(sub), float), idx.shape)
            sev = np.broadcast_to(np.asarray(rule.severity(sub)), idx.shape)
        seen = None if info_seen is None else _grown(info_seen, rule.name, len(km.info))
        for r, k, v, t, s in zip(rows, sub["key"].tolist(), val.tolist(), thr.tolist(), sev.tolist()):
            if s == "info" and seen is not None:
                if seen[k]:
                    continue
                seen[k] = True
            r["value"], r["threshold"], r["severity"] = none_if_nan(v), none_if_nan(t), s  # what the message reads
            msg = rule.message(r)
            simulated = rule.name in SIMULATED_CAST and bool(km.simulated[k])
            if simulated:
                msg += SIMULATED_NOTE
            out.append(event(r, rule.name, s, v, t, msg, simulated))
    return out


def _grown(flags: dict[str, np.ndarray], name: str, n: int) -> np.ndarray:
    """``flags[name]``, a bool per tensor key, grown to ``n`` keys (new tensors: False)."""
    have = flags.get(name)
    if have is None or len(have) < n:
        old = have if have is not None else np.zeros(0, bool)
        have = flags[name] = np.concatenate([old, np.zeros(n - len(old), bool)])
    return have


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
            out.append(event(r, "nan_origin", "critical", nan_value(r), 0.0, msg))
        else:
            msg = (f"{_where(r)}: {what}, propagated from {origin['layer']} {origin['tensor']} "
                   f"(first non-finite at step {origin['step']})")
            out.append(event(r, "nonfinite", "warning", nan_value(r), 0.0, msg))
    return out


# ---- offline -------------------------------------------------------------------------------
CHUNK_ROWS = 1 << 18  # rows per slice of the offline pass (whole steps): bounds its memory


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """numpy allocates without asking for transparent huge pages meanwhile; the previous setting comes back after.

    Offline detection makes a few dozen short-lived arrays of tens of MB. numpy advises huge pages for every
    large array, and on a VM a fresh huge page costs far more to fault in than the TLB misses it saves on one
    or two passes: on the 2-core benchmark VM ``fp8scope report`` of a 5M-row run spent twice to three times
    as long in the kernel with the advice (docs/benchmarks.md). Only a hint: nothing else changes.
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
        events += shadow_events(run.table(SHADOW_TABLE), cfg)
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
    have = set(t.column_names)
    return t.select([c for c in columns if c in have])


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
        self.run_max = RunMax()
        self.edge_state = {r: np.zeros(0, bool) for r in edge_rules(self.rules)}  # per tensor key
        self.info_seen: dict[str, np.ndarray] = {}  # per rule, per tensor key: had an info event
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
        c["ever_max"] = self.run_max.before(c["key"], c["amax_f"])
        f, ev = flags(c, self.rules)
        fired = {r: (self._edges(r, c["key"], f[r], ev[r]) if r in ev else f[r]) for r in f}
        return emit_row_events(c, fired, self.rules, self.km, self.nan_rows, self.info_seen)

    def _edges(self, rule: str, key: np.ndarray, f: np.ndarray, ev: np.ndarray) -> np.ndarray:
        """Edges of ``rule`` in this slice against each tensor's flag from the slices before; updates it."""
        state = _grown(self.edge_state, rule, len(self.km.info))
        out = edges_sorted(key, f, ev, state)
        last_evaluable(key, f, ev, state)
        return out


def _keys(km, t: pa.Table) -> np.ndarray:
    """Tensor key of every row. A run read zero-copy has one chunk per logged step, and consecutive steps
    repeat the same names: per chunk they hit keys_of's cache."""
    have = set(t.column_names)
    names = t.select([c for c in ("rank", "layer", "tensor", "fp8_format", "source", "recipe") if c in have])
    if names.column(0).num_chunks > 1:
        return np.concatenate([km.keys_of(b) for b in names.to_batches()])
    return km.keys_of(names)


def _numeric_columns(t: pa.Table) -> tuple[dict, dict]:
    """The numeric columns detection reads, as numpy (step / rank int64, the rest float64 with NaN for
    null), and the null mask of amax; strings stay in arrow (only their dictionary ids are used)."""
    cols, nulls = {}, {}
    for name in TENSOR_COLUMNS:
        if name in ("layer", "tensor", "fp8_format", "source", "recipe"):
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
    st = ScalarState(cfg)
    # one chunk per logged step of a few rows each (zero-copy read): per-chunk overhead would dominate
    table = table.combine_chunks()
    t = table.filter(pc.is_in(table["name"], value_set=pa.array(list(st.names))))
    if not t.num_rows:
        return []
    t = t.sort_by([("rank", "ascending"), ("name", "ascending"), ("step", "ascending")])
    out: list[dict] = []
    steps, ranks, names, values = (t[c].to_pylist() for c in ("step", "rank", "name", "value"))
    start = 0
    for i in range(1, len(steps) + 1):  # each (rank, name) series at once, in step order
        if i == len(steps) or ranks[i] != ranks[start] or names[i] != names[start]:
            out += st.update_series(steps[start:i], int(ranks[start]), names[start], values[start:i])
            start = i
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
