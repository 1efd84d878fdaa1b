"""Online detection: the offline rules on the steps as they are written, in a thread of their own
(and by default their Python in a child process: :mod:`fp8scope.detect.child`).

``OnlineDetector`` is a step listener (``Monitor.add_step_listener``). It runs the offline engine's
slice pass (:class:`fp8scope.detect.engine.TensorPass`: tensor keys, each tensor's last window rows
and its edge flags carried from slice to slice) over the steps it is given, so online and offline
detection are one code path and give the same events. Events are returned as
``{"events": RecordBatch}`` (the writer stores them), logged with :mod:`logging` (logger
``fp8scope.detect``) and passed to ``on_event(event_dict)`` if given.

Steps are examined in pairs, at the training process's own priority: events for step t must
reach the run and ``on_event`` before step t+2 ends, also when every core is busy (a detector at
lower priority fell tens of steps behind under load, after the very blow-up it should report).
A step waits for the next one (at most ``pair_wait_s``, then it goes alone; a step the monitor's
triage rule flags goes at once), and both are examined in one pass during the step after them: a
pass costs little more for two steps than for one, and every pass is Python that holds the GIL
the training thread needs to launch its work (docs/benchmarks.md, "where a what-if monitor's time
goes"). A pass carries each tensor's last window rows and, for one new step, reduces each window
where it lies (``features._Tail``) instead of sliding it over the carried rows, so a step costs
little beside a training step (``benchmarks/report_speed.py --online``). When steps queue up
anyway (a slow machine, a burst), the backlog is examined in one batch (at most ``max_batch``
steps), so the detector catches up instead of drifting; falling more than ``lag_warn`` steps and
``lag_warn_s`` seconds behind is said once. Both, because a lag is late events: 30 queued steps
of a loop that runs 100 a second are examined a third of a second late, which is no news (a small
model's first pass, while the detector warms up, queues that many).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.engine import TensorPass, in_step_order, nan_events
from fp8scope.detect.events import events_batch_from_records, sort_events, to_frame
from fp8scope.detect.scalar_rules import ScalarState
from fp8scope.detect.triage import suspicious_cheap_step
from fp8scope.detect.features import TENSOR_COLUMNS

if TYPE_CHECKING:  # the online detection child starts without pandas (annotations only here)
    import pandas as pd

log = logging.getLogger("fp8scope.detect")
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}

Step = tuple[int, int, "pa.RecordBatch | None", "pa.RecordBatch | None"]  # step, rank, tensors, scalars


class OnlineDetector:
    """Step listener running the detection rules as the run goes.

    Args:
        config: thresholds (default :class:`DetectConfig`).
        on_event: called with each event (a dict with the EVENT_SCHEMA keys) in the detection
            thread; raise nothing from it (exceptions are caught and warned about once).
    """

    def __init__(self, config: DetectConfig | None = None, on_event: Callable[[dict], Any] | None = None):
        self.cfg = config or DetectConfig()
        self.on_event = on_event
        self.events: list[dict] = []  # everything emitted so far (also written to the store)
        self._pass = TensorPass(self.cfg)
        self._nan_state: dict = {}
        self._scalar = ScalarState(self.cfg)
        self._callback_failed = False

    def __repr__(self) -> str:
        return f"OnlineDetector({len(self._pass.km.info)} tensors, {len(self.events)} events)"

    # ---- listener ------------------------------------------------------------------------
    def __call__(self, step: int, rank: int, tensors: pa.RecordBatch | None, scalars: pa.RecordBatch | None):
        """One step (the listener protocol); see :meth:`process`."""
        return self.process([(step, rank, tensors, scalars)])

    def process(self, steps: Sequence[Step]) -> dict[str, pa.RecordBatch] | None:
        """Examine consecutive logged steps in one pass; ``{"events": batch}`` or None."""
        return self.emit(self.examine(steps))

    def prime(self, steps: Sequence[Step]) -> None:
        """Examine steps a run logged before this detector started (a resumed run's last ones,
        ``fp8scope.resume.logged_steps``) without reporting their events, which the run that logged
        them reported: the windows and edge flags then stand where an uninterrupted run's would."""
        if steps:
            self.examine(steps)

    def examine(self, steps: Sequence[Step]) -> list[dict]:
        """The rules' pass over consecutive logged steps: their events, unsorted (the windows and
        edge flags carried to the next pass are this object's state)."""
        events: list[dict] = []
        tensors = [t for _, _, t, _ in steps if t is not None and t.num_rows]
        if tensors:
            events += self._tensor_steps(tensors)
        for _, _, _, scalars in steps:
            if scalars is not None and scalars.num_rows:
                events += self._scalar_step(scalars)
        return events

    def emit(self, events: list[dict]) -> dict[str, pa.RecordBatch] | None:
        """Report a pass's events: kept in :attr:`events`, logged, handed to ``on_event``, and
        returned as ``{"events": batch}`` for the run (None when there are none)."""
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

    # ---- tensors ---------------------------------------------------------------------------
    def _tensor_steps(self, batches: list[pa.RecordBatch]) -> list[dict]:
        table = pa.Table.from_batches(batches)
        have = set(table.column_names)
        table = table.select([c for c in TENSOR_COLUMNS if c in have])
        rank = np.concatenate([b.column("rank").to_numpy() for b in batches]).astype(np.int64)
        step = np.concatenate([b.column("step").to_numpy() for b in batches])
        out = self._pass.events(table, in_step_order(rank, step))  # a monitor's own steps: always in order
        if self._pass.nan_rows:
            out += nan_events(self._pass.nan_rows, self._nan_state)
            self._pass.nan_rows = []
        return out

    # ---- scalars ---------------------------------------------------------------------------
    def _scalar_step(self, batch: pa.RecordBatch) -> list[dict]:
        names = batch.column("name").to_pylist()
        want = self._scalar.names
        if not any(n in want for n in names):
            return []
        out: list[dict] = []
        cols = [batch.column(c).to_pylist() for c in ("step", "rank", "value")]
        for name, step, rank, value in zip(names, *cols):
            if name in want:
                out += self._scalar.update(int(step), int(rank), name, value)
        return out


_FLUSH = object()  # queued by flush(): examine what is queued now, do not wait for more


def _is_step(item) -> bool:
    return item is not None and item is not _FLUSH


class BackgroundDetector:
    """Runs an :class:`OnlineDetector` in its own thread so detection never delays ``Monitor.step``.

    Installed by ``Monitor(detect=...)``: as a step listener it only queues the step's record
    batches (the writer thread returns at once); the detection thread writes its events through
    ``submit(table, batch)`` (``Monitor.log_table``). It examines steps two at a time (a step waits
    up to ``pair_wait_s`` for the next; 0 examines each alone), and a backlog in one pass and one
    events write (at most ``max_batch`` steps). ``prime``: a resumed run's earlier steps (a
    callable, read in this thread), examined first without reporting
    (:meth:`OnlineDetector.prime`). A backlog of more than ``lag_warn`` steps whose oldest step has
    waited more than ``lag_warn_s`` seconds (since it was queued, or since the detector became
    ready if it was queued before) is warned about once. Only beyond ``max_queue`` queued steps are
    steps skipped for detection (warned once); the statistics themselves are always written.
    ``flush()`` and ``close()`` examine everything queued at once. Attribute access falls through
    to the detector (``.events``, ``.frame()``). ``detector`` may also be any per-step listener
    callable.
    """

    def __init__(self, detector: OnlineDetector, submit: Callable[[str, pa.RecordBatch], Any], max_queue: int = 1024,
                 max_batch: int = 64, lag_warn: int = 8, pair_wait_s: float = 1.0, lag_warn_s: float = 5.0,
                 prime: Callable[[], Sequence[Step]] | None = None):
        self.detector = detector
        self._prime = prime  # the run's earlier steps, read and examined in this thread before any new one
        self.pair_wait_s = float(pair_wait_s)
        self._submit = submit
        self.lag_warn = int(lag_warn)
        self.lag_warn_s = float(lag_warn_s)
        self.max_lag = 0  # the largest backlog seen, in steps
        self.max_wait_s = 0.0  # the longest a step waited for its examination to start
        self._ready_at = 0.0  # when the detector could start (monotonic time; a child process imports first)
        self.max_batch = max(1, int(max_batch))
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.skipped = 0
        self._lag_warned = False
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="fp8scope-detect", daemon=True)
        self._thread.start()

    def __getattr__(self, name):
        return getattr(self.detector, name)

    def __repr__(self) -> str:
        return f"BackgroundDetector({self.detector!r})"

    def __call__(self, step, rank, tensors, scalars):
        try:
            self._q.put_nowait((time.monotonic(), (step, rank, tensors, scalars)))
        except queue.Full:
            self.skipped += 1
            if self.skipped == 1:
                warnings.warn("fp8scope: online detection is behind; skipping steps for detection "
                              "(statistics are still written; run `fp8scope events` afterwards)",
                              RuntimeWarning, stacklevel=2)
        return None

    def _collect(self) -> list:
        """The next batch: the first item queued and, if it is a step, the next one (waited for up to
        ``pair_wait_s``), then whatever else is queued already (a backlog, up to ``max_batch``); a
        flush or the close sentinel ends it. Each queued entry is ``(time queued, item)``; the items
        are returned."""
        entries = [self._q.get()]
        if self.pair_wait_s > 0 and _is_step(entries[-1][1]) and not self._urgent(entries[-1][1]):
            try:
                entries.append(self._q.get(timeout=self.pair_wait_s))
            except queue.Empty:  # the run paused (an eval, a checkpoint): this step goes alone
                pass
        while len(entries) < self.max_batch and _is_step(entries[-1][1]):
            try:
                entries.append(self._q.get_nowait())
            except queue.Empty:
                break
        items = [it for _, it in entries]
        queued = [t for t, it in entries if it is not None and it is not _FLUSH]
        lag = len(queued) + self._q.qsize()
        waited = time.monotonic() - max(queued[0], self._ready_at) if queued else 0.0
        self.max_lag, self.max_wait_s = max(self.max_lag, lag), max(self.max_wait_s, waited)
        if lag > self.lag_warn and waited > self.lag_warn_s and not self._lag_warned:
            self._lag_warned = True
            warnings.warn(f"fp8scope: online detection fell {lag} steps ({waited:.1f} s) behind the run; it examines "
                          "the backlog in batches to catch up (events may arrive late)", RuntimeWarning, stacklevel=2)
        return items

    def _urgent(self, item: Step) -> bool:
        """A step that does not wait for a pair: one the monitor's triage rule flags (a non-finite or
        clipped amax: ``detect.triage``, the rule that also asks for full stats) or with a non-finite
        scalar (the loss), so that what may be a blow-up's first step is reported at once, and an
        event fork (``fp8scope.Shadow``) starts as early as before."""
        _, _, tensors, scalars = item
        try:
            cfg = getattr(self.detector, "cfg", None)
            if cfg is not None and tensors is not None and tensors.num_rows:
                cols = [tensors.column(c).to_numpy(zero_copy_only=False) for c in ("amax", "scale_inv", "fp8_max")]
                if suspicious_cheap_step(cfg, *cols):
                    return True
            if scalars is not None and scalars.num_rows:
                return not np.isfinite(scalars.column("value").to_numpy(zero_copy_only=False)).all()
        except Exception:  # a batch of another shape: look at it now rather than guess
            return True
        return False

    def _examine(self, steps: list) -> dict[str, list]:
        process = getattr(self.detector, "process", None)
        outs: dict[str, list] = {}
        results = [process(steps)] if process is not None else [self.detector(*s) for s in steps]
        for res in results:
            for table, batch in (res or {}).items():
                outs.setdefault(table, []).append(batch)
        return outs

    def _run(self) -> None:
        wait_ready = getattr(self.detector, "wait_ready", None)
        if wait_ready is not None:  # a child process starting (fp8scope.detect.child)
            wait_ready()
        if self._prime is not None and getattr(self.detector, "prime", None) is not None:
            try:
                self.detector.prime(self._prime())
            except Exception as exc:  # fail open: detection starts with empty windows
                warnings.warn(f"fp8scope: online detection starts without the run's earlier steps "
                              f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
            self._prime = None
        self._ready_at = time.monotonic()
        while True:
            items = self._collect()
            try:
                steps = [it for it in items if it is not None and it is not _FLUSH]
                if steps and not self._failed:
                    try:
                        outs = self._examine(steps)
                    except Exception as exc:  # fail open: detection stops, training and logging go on
                        self._failed, outs = True, {}
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
        self._put_marker(_FLUSH)
        self._q.join()

    def _put_marker(self, marker) -> None:
        self._q.put((time.monotonic(), marker))

    def close(self, timeout: float = 60.0) -> None:
        self._put_marker(None)
        self._thread.join(timeout)
        close = getattr(self.detector, "close", None)
        if close is not None:  # a child process: every step it was sent has been examined
            close()
