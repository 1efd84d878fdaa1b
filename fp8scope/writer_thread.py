"""The monitor's background writer: host stats -> Arrow record batches -> the run's streams.

Training calls :meth:`BackgroundWriter.submit` once per step and goes on. The thread waits
for the step's device-to-host copy, builds the record batches, appends them to the
rank's streams (flushed to the OS, so a SIGKILL after ``write`` returns loses nothing),
keeps the manifest's tensor list current, and runs any per-step listeners (online
detection plugs in here). If anything fails (disk full, folder deleted, read-only), it
warns once, stops logging, and keeps draining so training is never blocked.

Durability is the same on every device: ``Monitor.step`` waits for the *previous* step's
append, so step ``t`` is on disk by the time ``step(t + 1)`` (or ``close()``) returns; the
current step's copy and append overlap with the next step's compute.

Which cheap steps deserve full stats next, and of which layers, is decided by ``detect`` (the
monitor hands ``detect.triage.closer_look`` in); this module only applies it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
from typing import Callable

import pyarrow as pa

from fp8scope.step_payload import StepPayload, TensorKey, cheap_rows, stats_matrix
from fp8scope.step_records import cheap_tensor_batch, recipe_batch, scalar_batch, tensor_batch

# listener(step, rank, tensors_batch | None, scalars_batch) -> {table: batch} to write too
Listener = Callable[[int, int, "pa.RecordBatch | None", pa.RecordBatch], "dict[str, pa.RecordBatch] | None"]
# suspicious(amax, scale_inv, fp8_max) -> None, or (a bool per row, every layer?): numpy arrays of a cheap
# step's rows (detect.triage.closer_look)
Suspicious = Callable[..., "tuple[object, bool] | None"]

_SYNC = object()  # queued by sync(): done once everything before it is


class BackgroundWriter:
    def __init__(
        self,
        run_writer,
        rank: int,
        keys: list[TensorKey],
        on_new_keys: Callable[[list[TensorKey]], None] | None = None,
        max_queue: int = 64,
        suspicious: Suspicious | None = None,
    ):
        self._writer = run_writer
        self.rank = rank
        self._keys = keys  # the collector's list: append-only, read here
        self._on_new_keys = on_new_keys
        self._known_keys = 0
        self.listeners: list[Listener] = []
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self.failed: str | None = None
        # cheap steps the ``suspicious`` predicate flagged -> the layers of their flagged rows (None after
        # a non-finite amax: every layer deserves the closer look); taken by the training thread
        # (take_suspicious)
        self._suspicious_steps: dict[int, frozenset | None] = {}
        self.suspicious = suspicious
        self._last_check = time.monotonic()
        self.dropped = 0
        self._identity_cache: dict = {}  # step_records: columns that only depend on the row list
        self._scalar_names: dict = {}  # step_records.scalar_batch's names columns
        self._thread = threading.Thread(target=self._run, name="fp8scope-writer", daemon=True)
        self._thread.start()

    # ---- training side ------------------------------------------------------------
    def submit(self, payload: StepPayload) -> int:
        """Queue one step; returns a ticket for :meth:`wait`. Never blocks: a full queue drops the step."""
        return self._enqueue(payload, "steps")

    def sync(self, timeout: float | None = 60) -> bool:
        """Wait until everything handed over so far is done. True unless logging stopped or it timed out."""
        return self.wait(self._enqueue(_SYNC, "a flush"), timeout=timeout)

    def take_suspicious(self, before: int) -> tuple[bool, frozenset | None]:
        """The flagged steps before ``before`` (all written: the caller waited for them), taken:
        ``(any, their layers merged)``, the layers None where a step wants every layer. A step's own
        verdict is taken at the next step's end, whether or not this thread was done with it sooner,
        so a run's closer looks fall on the same steps whatever the timing (a resumed run's included)."""
        if not self._suspicious_steps:  # the common step: nothing flagged, nothing built
            return False, frozenset()
        flagged = [s for s in list(self._suspicious_steps) if s < before]
        layers: frozenset | None = frozenset()
        for s in flagged:
            got = self._suspicious_steps.pop(s)
            layers = None if got is None or layers is None else layers | got
        return bool(flagged), layers

    def submit_table(self, table: str, batch: pa.RecordBatch) -> None:
        """Queue extra rows for another table (shadow results, events): written in order with the steps."""
        self._enqueue((table, batch), f"{table} rows")

    def _enqueue(self, item, what: str) -> int:
        if self.failed:
            return self._done
        with self._cond:
            self._submitted += 1
            ticket = self._submitted
        self._put(ticket, item, what)
        return ticket

    def _put(self, ticket: int, item, what: str) -> bool:
        try:
            self._queue.put_nowait((ticket, item))
            return True
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                warnings.warn(f"fp8scope: writer is behind; dropping {what} rather than slowing training", stacklevel=5)
            self._mark_done(ticket)
            return False

    def wait(self, ticket: int, timeout: float | None = None) -> bool:
        """Block until step ``ticket`` is written (or logging has stopped). True if written."""
        with self._cond:
            self._cond.wait_for(lambda: self._done >= ticket or self.failed is not None, timeout=timeout)
            return self._done >= ticket and self.failed is None

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put((None, None))
        self._thread.join(timeout)
        try:
            self._writer.close()
        except Exception as exc:  # closing a broken stream must not raise into training
            self._fail(exc)

    # ---- writer thread ----------------------------------------------------------
    def _mark_done(self, ticket: int) -> None:
        with self._cond:
            self._done = max(self._done, ticket)
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"fp8scope: logging stopped ({self.failed}); training continues, steps already written are kept",
                RuntimeWarning,
                stacklevel=2,
            )
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            ticket, payload = self._queue.get()
            if payload is None:
                if self.failed is None:  # a folder removed after the last periodic look still gets reported
                    try:
                        self._check_folder(force=True)
                    except Exception as exc:
                        self._fail(exc)
                return
            if self.failed is None:
                try:
                    if payload is _SYNC:
                        pass
                    elif isinstance(payload, tuple):  # (table, batch) from submit_table
                        self._writer.write(*payload)
                    else:
                        self._write_step(payload)
                except Exception as exc:
                    self._fail(exc)
            self._mark_done(ticket)

    def _check_folder(self, force: bool = False) -> None:
        """Writes into a deleted folder succeed silently (the files are unlinked, not closed):
        look, at most once a second and once more at close, whether our streams are still there."""
        now = time.monotonic()
        if not force and now - self._last_check < 1.0:
            return
        self._last_check = now
        for path in self._writer.paths().values():
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} was removed while training wrote to it")

    def _write_step(self, payload: StepPayload) -> None:
        self._after_step(payload, *self._append_step(payload))

    def _append_step(self, payload: StepPayload) -> tuple["pa.RecordBatch | None", pa.RecordBatch]:
        """The durable part of a step: its batches appended to the streams."""
        self._check_folder()
        payload.wait()
        tensors = None
        if payload.full or not payload.all_narrow:
            matrix, tail = stats_matrix(payload)
            if payload.n_rows:
                tensors = tensor_batch(payload.step, self.rank, matrix, payload.key_ids, self._keys, payload.full,
                                       cache=self._identity_cache, focus=payload.focus)
        else:  # a cheap step: four float columns change, the rest is cached per row list
            rows, tail = cheap_rows(payload)
            if payload.n_rows:
                tensors = cheap_tensor_batch(payload.step, self.rank, rows, payload.key_ids, payload.numels,
                                             self._keys, self._identity_cache)
                if self.suspicious is not None:
                    cols = [tensors.column(c).to_numpy(zero_copy_only=False) for c in ("amax", "scale_inv", "fp8_max")]
                    look = self.suspicious(*cols)
                    if look is not None:
                        rows, every_layer = look
                        self._suspicious_steps[payload.step] = None if every_layer else frozenset(
                            tensors.column("layer").filter(pa.array(rows)).to_pylist())
        if tensors is not None:
            self._writer.write("tensors", tensors)
        if payload.n_recipe:
            self._writer.write("recipes", recipe_batch(payload.step, self.rank, payload.recipe_matrix(),
                                                       payload.recipe_keys, self._keys))
        names = list(payload.scalar_names) + list(payload.host_scalars)
        values = list(tail) + list(payload.host_scalars.values())
        scalars = scalar_batch(payload.step, self.rank, names, values, payload.wall_time, self._scalar_names)
        if names:
            self._writer.write("scalars", scalars)
        return tensors, scalars

    def _after_step(self, payload: StepPayload, tensors: "pa.RecordBatch | None", scalars: pa.RecordBatch) -> None:
        """What may lag the step: the manifest's tensor list and the listeners."""
        if len(self._keys) > self._known_keys and self._on_new_keys is not None:
            self._known_keys = len(self._keys)
            self._on_new_keys(list(self._keys))
        for listener in list(self.listeners):
            try:
                extra = listener(payload.step, self.rank, tensors, scalars)
            except Exception as exc:  # a broken listener is dropped; logging goes on
                self.listeners.remove(listener)
                warnings.warn(f"fp8scope: step listener {listener!r} failed ({exc!r}); it is switched off",
                              RuntimeWarning, stacklevel=2)
                continue
            for table, batch in (extra or {}).items():
                if batch is not None and batch.num_rows:
                    self._writer.write(table, batch)
