"""Online detection: the offline rules, step by step, inside ``Monitor``'s writer thread.

``OnlineDetector`` is a step listener (``Monitor.add_step_listener``): for every written step
it computes the same features the offline DuckDB windows compute, from a small rolling state
per tensor (ring buffers of the last ``spike_window`` amaxes, ``collapse_window`` scales,
``sat_rate_window`` saturation flags, the previous row and the edge flags), then runs the
*same* SQL predicates and message code as :func:`fp8scope.detect.detect`. Events are returned
as ``{"events": RecordBatch}`` (the writer stores them), logged with :mod:`logging`
(logger ``fp8scope.detect``) and passed to ``on_event(event_dict)`` if given.

Memory: O(tensors x (spike_window + collapse_window + sat_rate_window)) floats
(500 tensors: ~1 MB). Time: a few ms per step.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.engine import (
    TENSOR_COLUMNS,
    edge_rules,
    emit_row_events,
    emit_scalar_events,
    events_batch,
    flag_columns,
    scalar_flags_sql,
    to_frame,
)
from fp8scope.detect.features import group_features_sql, row_features_sql, scalar_row_sql
from fp8scope.detect.rules import row_rules

log = logging.getLogger("fp8scope.detect")
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}


class OnlineDetector:
    """Step listener running the detection rules as the run goes.

    Args:
        config: thresholds (default :class:`DetectConfig`).
        on_event: called with each event (a dict with the EVENT_SCHEMA keys) in the writer
            thread; raise nothing from it (exceptions are caught and warned about once).
    """

    def __init__(self, config: DetectConfig | None = None, on_event: Callable[[dict], Any] | None = None):
        self.cfg = config or DetectConfig()
        self.rules = row_rules(self.cfg)
        self.edge_names = edge_rules(self.rules)
        self.on_event = on_event
        self.events: list[dict] = []  # everything emitted so far (also written to the store)
        self._con = None
        from fp8scope.detect.features import KeyMap

        self._km = KeyMap()
        n0 = 0
        c = self.cfg
        self._W, self._K, self._R = int(c.spike_window), int(c.collapse_window) + 1, int(c.sat_rate_window)
        self._rows = np.zeros(n0, dtype=np.int64)
        self._amax = np.full((n0, self._W), np.nan)
        self._si = np.full((n0, self._K), np.nan)
        self._sat = np.zeros((n0, self._R), dtype=np.int64)
        self._up = np.full((n0, self._K - 1), np.nan)
        self._prev_bad = np.full(n0, np.nan)  # NaN: no previous row
        self._prev_si = np.full(n0, np.nan)
        self._flags = {n: np.zeros(n0, dtype=bool) for n in self.edge_names}
        self._nan_state: dict = {}
        self._scalars: dict[tuple, deque] = {}
        self._scalar_bad: dict[tuple, bool] = {}
        self._callback_failed = False

    def __repr__(self) -> str:
        return f"OnlineDetector({len(self._km.info)} tensors, {len(self.events)} events)"

    # ---- listener ------------------------------------------------------------------------
    def __call__(self, step: int, rank: int, tensors: pa.RecordBatch | None, scalars: pa.RecordBatch | None):
        events: list[dict] = []
        if tensors is not None and tensors.num_rows:
            events += self._tensor_step(tensors)
        if scalars is not None and scalars.num_rows:
            events += self._scalar_step(scalars)
        if not events:
            return None
        df = to_frame(events)
        records = df.to_dict("records")
        self.events.extend(records)
        for ev in records:
            log.log(_LEVELS.get(ev["severity"], logging.WARNING), "fp8scope step %s: [%s] %s",
                    ev["step"], ev["rule"], ev["message"])
            if self.on_event is not None:
                try:
                    self.on_event(dict(ev))
                except Exception as exc:  # a user callback must not stop detection or logging
                    if not self._callback_failed:
                        self._callback_failed = True
                        warnings.warn(f"fp8scope: on_event callback failed ({exc!r})", RuntimeWarning, stacklevel=2)
        return {"events": events_batch(df)}

    def frame(self) -> pd.DataFrame:
        """Events emitted so far as a DataFrame (same columns as ``detect``)."""
        return to_frame([{**e, "_order": 0} for e in self.events]) if self.events else to_frame([])

    # ---- state -----------------------------------------------------------------------------
    @property
    def con(self):
        if self._con is None:
            import duckdb

            self._con = duckdb.connect()
            self._con.execute("set threads to 1")
        return self._con

    def _grow(self, n: int) -> None:
        m = n - len(self._rows)
        self._rows = np.concatenate([self._rows, np.zeros(m, dtype=np.int64)])
        self._amax = np.vstack([self._amax, np.full((m, self._W), np.nan)])
        self._si = np.vstack([self._si, np.full((m, self._K), np.nan)])
        self._sat = np.vstack([self._sat, np.zeros((m, self._R), dtype=np.int64)])
        self._up = np.vstack([self._up, np.full((m, self._K - 1), np.nan)])
        self._prev_bad = np.concatenate([self._prev_bad, np.full(m, np.nan)])
        self._prev_si = np.concatenate([self._prev_si, np.full(m, np.nan)])
        for k in self._flags:
            self._flags[k] = np.concatenate([self._flags[k], np.zeros(m, dtype=bool)])

    # ---- tensors ---------------------------------------------------------------------------
    def _tensor_step(self, batch: pa.RecordBatch) -> list[dict]:
        con, cfg = self.con, self.cfg
        con.register("_batch", self._km.narrow(pa.Table.from_batches([batch])))
        try:
            rowf = con.execute(row_features_sql("_batch", cfg)).df()
        finally:
            con.unregister("_batch")
        if len(self._km.info) > len(self._rows):
            self._grow(len(self._km.info))
        idx = rowf["key"].to_numpy(dtype=np.int64)
        before = self._rows[idx]
        amax_f = _floats(rowf["amax_f"])
        si_f = _floats(rowf["scale_inv_f"])
        sat_hit = rowf["sat_hit"].to_numpy(dtype=np.int64)

        # window over the previous spike_window rows (current excluded)
        ring = self._amax[idx]
        fin = np.isfinite(ring)
        n_prev = fin.sum(axis=1)
        prev_max = np.where(n_prev > 0, np.max(np.where(fin, ring, -np.inf), axis=1), np.nan)
        self._amax[idx, before % self._W] = amax_f

        # scale window: the last collapse_window + 1 rows, current included
        self._si[idx, before % self._K] = si_f
        sring = self._si[idx]
        oldest = np.where(before + 1 <= self._K, 0, (before + 1) % self._K)
        si_old = sring[np.arange(len(idx)), oldest]
        sfin = np.isfinite(sring)
        n_si = sfin.sum(axis=1)
        si_max = np.where(n_si > 0, np.max(np.where(sfin, sring, -np.inf), axis=1), np.nan)

        # saturation-rate window, current included
        self._sat[idx, before % self._R] = sat_hit
        n_sat = self._sat[idx].sum(axis=1)
        n_rate = np.minimum(before + 1, self._R)

        prev_bad = self._prev_bad[idx]
        prev_si = self._prev_si[idx]
        # largest one-step rise of scale_inv over the last collapse_window rows, current included
        with np.errstate(invalid="ignore", divide="ignore"):
            jump = si_f / prev_si  # NaN when either side is missing (SQL: NULL)
        self._up[idx, before % (self._K - 1)] = jump
        ju = self._up[idx]
        jfin = np.isfinite(ju)
        max_jump = np.where(jfin.any(axis=1), np.max(np.where(jfin, ju, -np.inf), axis=1), np.nan)
        self._prev_bad[idx] = rowf["bad_amax"].to_numpy(dtype=bool).astype(float)
        self._prev_si[idx] = si_f
        self._rows[idx] = before + 1

        feat = rowf.assign(
            prev_max=prev_max, n_prev=n_prev, prev_bad_amax=pd.array(
                [None if np.isnan(v) else bool(v) for v in prev_bad], dtype="boolean"),
            prev_scale_inv=prev_si, si_old=si_old, si_max=si_max, n_si=n_si, max_jump=max_jump, n_sat=n_sat, n_rate=n_rate,
        )
        con.register("_feat", pa.Table.from_pandas(feat, preserve_index=False))
        try:
            flags = con.execute(
                f"select *, {flag_columns(self.rules)} from ({group_features_sql('_feat')}) order by \"order\""
            ).df()
        finally:
            con.unregister("_feat")
        fidx = flags["key"].to_numpy(dtype=np.int64)
        any_fired = np.zeros(len(flags), dtype=bool)
        for r in [r.name for r in self.rules] + ["nonfinite"]:
            fv = flags[f"f_{r}"].to_numpy(dtype=bool)
            if r in self._flags:
                ev = flags[f"ev_{r}"].to_numpy(dtype=bool)
                e = fv & ~self._flags[r][fidx]
                self._flags[r][fidx[ev]] = fv[ev]
            else:
                e = fv
            flags[f"e_{r}"] = e
            any_fired |= e
        fired = self._km.names(flags[any_fired])
        return emit_row_events(con, fired, self.rules, cfg, self._nan_state)

    # ---- scalars ---------------------------------------------------------------------------
    def _scalar_step(self, batch: pa.RecordBatch) -> list[dict]:
        cfg = self.cfg
        names = (cfg.loss_name, cfg.grad_norm_name)
        t = pa.Table.from_batches([batch]).select(["step", "rank", "name", "value"])
        con = self.con
        con.register("_s", t)
        try:
            rows = con.execute(scalar_row_sql("_s") + f" where name in ('{_esc(names[0])}', '{_esc(names[1])}')").df()
        finally:
            con.unregister("_s")
        if rows.empty:
            return []
        prev_mean, n_prev, prev_bad = [], [], []
        for r in rows.itertuples(index=False):
            key = (int(r.rank), r.name)
            w = int(cfg.grad_window if r.name == cfg.grad_norm_name else cfg.loss_window)
            dq = self._scalars.setdefault(key, deque(maxlen=w))
            vals = np.array([v for v in dq if np.isfinite(v)], dtype=float)
            n_prev.append(len(vals))
            prev_mean.append(float(np.mean(vals)) if len(vals) else np.nan)
            prev_bad.append(self._scalar_bad.get(key, False))
            v = r.v_f
            dq.append(float(v) if v is not None and not pd.isna(v) else np.nan)
            self._scalar_bad[key] = bool(r.bad)
        feat = rows.assign(prev_mean=prev_mean, n_prev=n_prev)
        con.register("_sf", pa.Table.from_pandas(feat, preserve_index=False))
        try:
            flags = con.execute(scalar_flags_sql("_sf", cfg)).df()
        finally:
            con.unregister("_sf")
        flags["e_loss_spike"] = flags["f_loss_spike"].astype("boolean").fillna(False).to_numpy(dtype=bool)
        flags["e_grad_norm_spike"] = flags["f_grad_norm_spike"].astype("boolean").fillna(False).to_numpy(dtype=bool)
        flags["e_loss_nonfinite"] = flags["f_loss_nonfinite"].to_numpy(dtype=bool) & ~np.array(prev_bad, dtype=bool)
        fired = flags[flags["e_loss_spike"] | flags["e_grad_norm_spike"] | flags["e_loss_nonfinite"]]
        return emit_scalar_events(fired, cfg)


def _floats(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").astype("float64").to_numpy(na_value=np.nan)


def _esc(s: str) -> str:
    return str(s).replace("'", "''")


class BackgroundDetector:
    """Runs an :class:`OnlineDetector` in its own thread so detection never delays ``Monitor.step``.

    Installed by ``Monitor(detect=...)``: as a step listener it only queues the step's record
    batches (the writer thread returns at once); the detection thread writes its events through
    ``submit(table, batch)`` (``Monitor.log_table``). ``close()`` drains the queue. If detection
    falls more than ``max_queue`` steps behind, steps are skipped for detection (warned once);
    the statistics themselves are always written. Attribute access falls through to the detector
    (``.events``, ``.frame()``).
    """

    def __init__(self, detector: OnlineDetector, submit: Callable[[str, pa.RecordBatch], Any], max_queue: int = 256):
        import queue
        import threading

        self.detector = detector
        self._submit = submit
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.skipped = 0
        self._thread = threading.Thread(target=self._run, name="fp8scope-detect", daemon=True)
        self._thread.start()

    def __getattr__(self, name):
        return getattr(self.detector, name)

    def __repr__(self) -> str:
        return f"BackgroundDetector({self.detector!r})"

    def __call__(self, step, rank, tensors, scalars):
        import queue

        try:
            self._q.put_nowait((step, rank, tensors, scalars))
        except queue.Full:
            self.skipped += 1
            if self.skipped == 1:
                warnings.warn("fp8scope: online detection is behind; skipping steps for detection "
                              "(statistics are still written; run `fp8scope events` afterwards)",
                              RuntimeWarning, stacklevel=2)
        return None

    def _run(self) -> None:
        failed = False
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                if failed:
                    continue
                try:
                    out = self.detector(*item)
                    for table, batch in (out or {}).items():
                        self._submit(table, batch)
                except Exception as exc:  # fail open: detection stops, training and logging go on
                    failed = True
                    warnings.warn(f"fp8scope: online detection stopped ({type(exc).__name__}: {exc})",
                                  RuntimeWarning, stacklevel=2)
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until every queued step has been examined."""
        self._q.join()

    def close(self, timeout: float = 60.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)
