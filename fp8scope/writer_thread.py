"""The monitor's background writer: host stats -> Arrow record batches -> the run's streams.

Training calls :meth:`BackgroundWriter.submit` once per step and goes on. The thread waits
for the step's device-to-host copy, builds the record batches, appends them to the
rank's streams (flushed to the OS, so a SIGKILL after ``write`` returns loses nothing),
keeps the manifest's tensor list current, and runs any per-step listeners (online
detection plugs in here). If anything fails (disk full, folder deleted, read-only), it
warns once, stops logging, and keeps draining so training is never blocked.

A CPU step is on the host already and ``Monitor.step`` must return only once it is
durable, so waking this thread and waiting for it would add two thread hand-offs to a
sub-millisecond append. :meth:`BackgroundWriter.write_now` appends such a step in the
caller's thread when nothing is queued ahead of it, and queues only the rest (manifest
update, listeners) for the thread: listeners still never run on the training thread. That
rest waits in a deque the thread drains every ``after_delay`` seconds (and before any other work,
and at ``sync``/close) instead of waking the thread per step: on a small machine each wake-up
takes a core from the training's own threads mid-step.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
import warnings
from typing import Callable, NamedTuple

import numpy as np
import pyarrow as pa

from fp8scope.capture.collector import StepPayload, TensorKey, cheap_rows, stats_matrix
from fp8scope.schema import SCALAR_SCHEMA, TENSOR_SCHEMA
from fp8scope.step_records import (
    cheap_log_message, cheap_tensor_batch, cheap_tensor_message, scalar_batch, scalar_message, tensor_batch,
)
from fp8scope.store.message_template import batch_of_message

# listener(step, rank, tensors_batch | None, scalars_batch) -> {table: batch} to write too
Listener = Callable[[int, int, "pa.RecordBatch | None", pa.RecordBatch], "dict[str, pa.RecordBatch] | None"]


class _Appended(NamedTuple):
    """Queued by ``write_now``: a step already on disk whose manifest update and listeners remain."""

    payload: StepPayload
    tensors: "pa.RecordBatch | bytes | None"  # bytes: a serialized batch (step_records' message templates)
    scalars: "pa.RecordBatch | bytes"


_SYNC = object()  # queued by sync(): done once everything before it, write_now's rest included, is


class BackgroundWriter:
    def __init__(
        self,
        run_writer,
        rank: int,
        keys: list[TensorKey],
        on_new_keys: Callable[[list[TensorKey]], None] | None = None,
        max_queue: int = 64,
        after_delay: float = 0.25,
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
        self.suspicious_step: int | None = None  # last cheap step that showed clipping or non-finite amax
        self._last_check = time.monotonic()
        self.dropped = 0
        self._identity_cache: dict = {}  # step_records: columns that only depend on the row list
        self._scalar_names: dict = {}  # step_records.scalar_batch's names columns
        self._io = threading.Lock()  # one user of the streams at a time: this thread or write_now's caller
        self.inline = True  # write_now may append in the caller's thread (DistributedWriter: no)
        self._after: collections.deque[_Appended] = collections.deque()  # write_now's rest, in step order
        self.after_delay = float(after_delay)
        self._thread = threading.Thread(target=self._run, name="fp8scope-writer", daemon=True)
        self._thread.start()

    # ---- training side ------------------------------------------------------------
    def submit(self, payload: StepPayload) -> int:
        """Queue one step; returns a ticket for :meth:`wait`. Never blocks: a full queue drops the step."""
        return self._enqueue(payload, "steps")

    def write_now(self, payload: StepPayload) -> bool:
        """Append a host-ready step before returning (the CPU durability wait without a thread
        hand-off); its manifest update and listeners go to the thread. When other work is queued
        or running, the step is queued behind it and waited for instead. True if written."""
        if self.failed:
            return False
        with self._cond:
            self._submitted += 1
            ticket = self._submitted
        if self.inline and self._done == ticket - 1 and self._queue.empty() and self._io.acquire(blocking=False):
            try:
                if self._done == ticket - 1:  # still nothing ahead of this step
                    done = None
                    try:
                        done = self._append_step(payload)
                    except Exception as exc:
                        self._fail(exc)
                    self._mark_done(ticket)
                    if done is not None:  # no wake-up: the thread drains these on its own time
                        self._after.append(_Appended(payload, *done))
                    return done is not None
            finally:
                self._io.release()
        return self._put(ticket, payload, "steps") and self.wait(ticket, timeout=60)

    def sync(self, timeout: float | None = 60) -> bool:
        """Wait until everything handed over so far is done, the manifest updates and listener calls
        of the steps ``write_now`` appended included. True unless logging stopped or it timed out."""
        return self.wait(self._enqueue(_SYNC, "a flush"), timeout=timeout)

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

    def _drain_after(self) -> None:
        """The manifest updates and listener calls of the steps ``write_now`` appended, oldest first."""
        while self._after:
            item = self._after.popleft()
            if self.failed is None:
                with self._io:
                    try:
                        self._after_step(item.payload, item.tensors, item.scalars)
                    except Exception as exc:
                        self._fail(exc)

    def _run(self) -> None:
        while True:
            try:
                ticket, payload = self._queue.get(timeout=self.after_delay)
            except queue.Empty:
                self._drain_after()
                continue
            self._drain_after()  # what write_now appended came before anything queued now
            if payload is None:
                if self.failed is None:  # a folder removed after the last periodic look still gets reported
                    try:
                        self._check_folder(force=True)
                    except Exception as exc:
                        self._fail(exc)
                return
            if self.failed is None:
                with self._io:
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

    @staticmethod
    def _suspicious(amax, scale_inv, fp8_max) -> bool:
        """A cheap step worth a closer look: a non-finite amax, or an amax at least 8x what the
        scale in use can represent (an outlier, as the saturation rule counts it; not the overflow
        of a tensor growing early in training). The monitor then takes full stats next."""
        return bool((~np.isfinite(amax)).any() or (amax > 8 * scale_inv * fp8_max).any())  # NaN compares False

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
        if payload.full:
            matrix, tail = stats_matrix(payload)
            if payload.n_rows:
                tensors = tensor_batch(payload.step, self.rank, matrix, payload.key_ids, self._keys, True,
                                       cache=self._identity_cache)
        elif payload.logged is not None and (
                got := cheap_log_message(payload.step, self.rank, payload.logged, payload.n_rows, self._identity_cache)):
            # a what-if step on the CPU, rows straight from the row log into the last message
            tensors, tail = got[0], ()
            if got[1]:
                self.suspicious_step = payload.step
        else:  # cheap step: the last message with this row list, rewritten; else the cached columns
            rows, tail = cheap_rows(payload)
            if payload.n_rows:
                got = cheap_tensor_message(payload.step, self.rank, rows, payload.key_ids, payload.numels,
                                           self._keys, self._identity_cache, for_log=payload.logged is not None)
                if got is not None:
                    tensors, fp8_max = got
                    amax, scale_inv = rows[:, 0], rows[:, 2]
                else:
                    tensors = cheap_tensor_batch(payload.step, self.rank, rows, payload.key_ids, payload.numels,
                                                 self._keys, self._identity_cache)
                    fp8_max = tensors.column("fp8_max").to_numpy()
                    if len(fp8_max) == len(rows):  # one capture per tensor: the batch's rows are the captures
                        amax, scale_inv = rows[:, 0], rows[:, 2]
                    else:  # micro-batches merged
                        amax, scale_inv = (tensors.column(c).to_numpy(zero_copy_only=False)
                                           for c in ("amax", "scale_inv"))
                if self._suspicious(amax, scale_inv, fp8_max):
                    self.suspicious_step = payload.step
        if isinstance(tensors, bytes):
            self._writer.write_message("tensors", tensors)
        elif tensors is not None:
            self._writer.write("tensors", tensors)
        names = list(payload.scalar_names) + list(payload.host_scalars)
        values = list(tail) + list(payload.host_scalars.values())
        if not names:
            return tensors, scalar_batch(payload.step, self.rank, names, values, payload.wall_time)
        scalars = scalar_message(payload.step, self.rank, names, values, payload.wall_time, self._scalar_names)
        self._writer.write_message("scalars", scalars)
        return tensors, scalars

    def _after_step(self, payload: StepPayload, tensors: "pa.RecordBatch | bytes | None",
                    scalars: "pa.RecordBatch | bytes") -> None:
        """What may lag the step: the manifest's tensor list and the listeners (who get record
        batches: a step appended from a message template is decoded here, off the training thread)."""
        if len(self._keys) > self._known_keys and self._on_new_keys is not None:
            self._known_keys = len(self._keys)
            self._on_new_keys(list(self._keys))
        if self.listeners:
            tensors = batch_of_message(tensors, TENSOR_SCHEMA)
            scalars = batch_of_message(scalars, SCALAR_SCHEMA)
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
