"""Online detection: the offline rules, step by step, inside ``Monitor``'s writer thread.

``OnlineDetector`` is a step listener (``Monitor.add_step_listener``): for every written step
it computes the same features the offline engine computes, from a small rolling state
per tensor (numpy ring buffers of the last ``spike_window`` amaxes, ``collapse_window`` scales,
``sat_rate_window`` saturation flags, the previous row and the edge flags, indexed by tensor
key), then runs the *same* rule functions and message code as :func:`fp8scope.detect.detect`,
in numpy over the step's rows; only rows that fire become python dicts. Events are returned
as ``{"events": RecordBatch}`` (the writer stores them), logged with :mod:`logging`
(logger ``fp8scope.detect``) and passed to ``on_event(event_dict)`` if given.

Memory: O(tensors x (spike_window + collapse_window + sat_rate_window)) floats
(500 tensors: ~1 MB). Time: about 1 ms per step for 63 tensors, 2-3 ms for 1000 (2-core CPU).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.engine import (
    ScalarState,
    edge_rules,
    emit_row_events,
    events_batch_from_records,
    flags,
    nan_events,
    sort_events,
    to_frame,
)
from fp8scope.detect.features import KeyMap, group_features, row_features
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
        self._km = KeyMap()
        n0 = 0
        c = self.cfg
        self._W, self._K, self._R = int(c.spike_window), int(c.collapse_window) + 1, int(c.sat_rate_window)
        self._rows = np.zeros(n0, dtype=np.int64)
        self._amax = np.full((n0, self._W), np.nan)
        self._si = np.full((n0, self._K), np.nan)
        self._sat = np.zeros((n0, self._R), dtype=np.int64)
        self._up = np.full((n0, self._K - 1), np.nan)
        self._prev_bad = np.zeros(n0, dtype=bool)  # the previous row's amax was NaN/Inf
        self._prev_si = np.full(n0, np.nan)
        self._flags = {n: np.zeros(n0, dtype=bool) for n in self.edge_names}
        self._nan_state: dict = {}
        self._scalar = ScalarState(self.cfg)
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
        records = sort_events(events)
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
        return {"events": events_batch_from_records(records)}

    def frame(self) -> pd.DataFrame:
        """Events emitted so far as a DataFrame (same columns as ``detect``)."""
        return to_frame([{**e, "_order": 0} for e in self.events]) if self.events else to_frame([])

    # ---- state -----------------------------------------------------------------------------
    def _grow(self, n: int) -> None:
        m = n - len(self._rows)
        self._rows = np.concatenate([self._rows, np.zeros(m, dtype=np.int64)])
        self._amax = np.vstack([self._amax, np.full((m, self._W), np.nan)])
        self._si = np.vstack([self._si, np.full((m, self._K), np.nan)])
        self._sat = np.vstack([self._sat, np.zeros((m, self._R), dtype=np.int64)])
        self._up = np.vstack([self._up, np.full((m, self._K - 1), np.nan)])
        self._prev_bad = np.concatenate([self._prev_bad, np.zeros(m, dtype=bool)])
        self._prev_si = np.concatenate([self._prev_si, np.full(m, np.nan)])
        for k in self._flags:
            self._flags[k] = np.concatenate([self._flags[k], np.zeros(m, dtype=bool)])

    # ---- tensors ---------------------------------------------------------------------------
    def _tensor_step(self, batch: pa.RecordBatch) -> list[dict]:
        cfg, km = self.cfg, self._km
        key = km.keys_of(batch)
        if len(km.info) > len(self._rows):
            self._grow(len(km.info))
        c = row_features(batch, key, km, cfg)
        group_features(c, km.group_of)
        idx = key
        before = self._rows[idx]
        amax_f, si_f = c["amax_f"], c["scale_inv_f"]
        ar = np.arange(len(idx))

        # window over the previous spike_window rows (current excluded)
        ring = self._amax[idx]
        fin = ~np.isnan(ring)
        n_prev = fin.sum(axis=1)
        prev_max = np.where(n_prev > 0, np.max(np.where(fin, ring, -np.inf), axis=1), np.nan)
        self._amax[idx, before % self._W] = amax_f

        # scale window: the last collapse_window + 1 rows, current included
        self._si[idx, before % self._K] = si_f
        sring = self._si[idx]
        oldest = np.where(before + 1 <= self._K, 0, (before + 1) % self._K)
        si_old = sring[ar, oldest]
        sfin = ~np.isnan(sring)
        n_si = sfin.sum(axis=1)
        si_max = np.where(n_si > 0, np.max(np.where(sfin, sring, -np.inf), axis=1), np.nan)

        # saturation-rate window, current included
        self._sat[idx, before % self._R] = c["sat_hit"]
        n_sat = self._sat[idx].sum(axis=1)
        n_rate = np.minimum(before + 1, self._R)

        prev_bad = self._prev_bad[idx]
        prev_si = self._prev_si[idx]
        # largest one-step rise of scale_inv over the last collapse_window rows, current included
        with np.errstate(invalid="ignore", divide="ignore"):
            jump = si_f / prev_si  # NaN when either side is missing
        self._up[idx, before % (self._K - 1)] = jump
        ju = self._up[idx]
        jfin = ~np.isnan(ju)
        max_jump = np.where(jfin.any(axis=1), np.max(np.where(jfin, ju, -np.inf), axis=1), np.nan)
        self._prev_bad[idx] = c["bad_amax"]
        self._prev_si[idx] = si_f
        self._rows[idx] = before + 1
        c.update(prev_max=prev_max, n_prev=n_prev, prev_bad_amax=prev_bad, prev_scale_inv=prev_si, si_old=si_old,
                 si_max=si_max, n_si=n_si, max_jump=max_jump, n_sat=n_sat, n_rate=n_rate)

        f, ev = flags(c, self.rules)
        fired = {}
        for r, fv in f.items():
            if r in ev:
                e = ev[r]
                st = self._flags[r]
                fired[r] = fv & ~st[idx]
                st[idx[e]] = fv[e]
            else:
                fired[r] = fv
        nan_rows: list[dict] = []
        out = emit_row_events(c, fired, self.rules, km, nan_rows)
        if nan_rows:
            out += nan_events(nan_rows, self._nan_state)
        return out

    # ---- scalars ---------------------------------------------------------------------------
    def _scalar_step(self, batch: pa.RecordBatch) -> list[dict]:
        cfg = self.cfg
        names = batch.column("name").to_pylist()
        want = (cfg.loss_name, cfg.grad_norm_name)
        if not any(n in want for n in names):
            return []
        out: list[dict] = []
        cols = [batch.column(c).to_pylist() for c in ("step", "rank", "value")]
        for name, step, rank, value in zip(names, *cols):
            if name in want:
                out += self._scalar.update(int(step), int(rank), name, value)
        return out


def _lower_priority() -> None:
    """Nice the calling thread (Linux: per-thread niceness) so detection yields to training."""
    import os
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError, ValueError):
        pass


class BackgroundDetector:
    """Runs an :class:`OnlineDetector` in its own thread so detection never delays ``Monitor.step``.

    Installed by ``Monitor(detect=...)``: as a step listener it only queues the step's record
    batches (the writer thread returns at once); the detection thread writes its events through
    ``submit(table, batch)`` (``Monitor.log_table``). ``close()`` drains the queue. The thread
    runs at a lower OS priority (nice +10) so it never competes with training. When it falls
    behind it catches up: the whole backlog is processed in one go (one events write). Only
    beyond ``max_queue`` queued steps are steps skipped for detection (warned once); the
    statistics themselves are always written. Attribute access falls through to the detector
    (``.events``, ``.frame()``).
    """

    def __init__(self, detector: OnlineDetector, submit: Callable[[str, pa.RecordBatch], Any], max_queue: int = 1024):
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
        import queue

        _lower_priority()
        failed = False
        while True:
            items = [self._q.get()]
            try:  # behind? take the whole backlog and catch up in one go (one write per table)
                while items[-1] is not None:
                    items.append(self._q.get_nowait())
            except queue.Empty:
                pass
            try:
                outs: dict[str, list] = {}
                for item in items:
                    if item is None or failed:
                        continue
                    try:
                        for table, batch in (self.detector(*item) or {}).items():
                            outs.setdefault(table, []).append(batch)
                    except Exception as exc:  # fail open: detection stops, training and logging go on
                        failed = True
                        warnings.warn(f"fp8scope: online detection stopped ({type(exc).__name__}: {exc})",
                                      RuntimeWarning, stacklevel=2)
                for table, batches in outs.items():
                    try:
                        self._submit(table, batches[0] if len(batches) == 1 else
                                     pa.Table.from_batches(batches).combine_chunks().to_batches()[0])
                    except Exception as exc:
                        warnings.warn(f"fp8scope: online detection could not store events ({exc!r})",
                                      RuntimeWarning, stacklevel=2)
            finally:
                for _ in items:
                    self._q.task_done()
            if items[-1] is None:
                return

    def flush(self) -> None:
        """Wait until every queued step has been examined."""
        self._q.join()

    def close(self, timeout: float = 60.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)
