"""The writer thread of a multi-rank run: per-rank rows, then one all_gather, then rank 0's extras.

Why the exchange lives here and not on the training thread: a collective on the training
thread would be a host sync and, worse, would interleave with the job's own collectives
(DDP bucket all-reduces, FSDP all-gathers) whose order must match on every rank. The
monitor instead creates its own gloo process group at start-up and only this thread uses
it, on host memory that already crossed from the device in the step's single transfer.
Per logged step it does exactly one ``all_gather`` of a ``(1 + capacity) x ROW_WIDTH`` float64
matrix (``aggregate.pack``), a few KB. Only when a rank has more rows than ``capacity``
(the first steps, or new layers) does that step gather a second time with a larger,
agreed capacity (everyone sees every header, so everyone agrees without a third exchange).

Fail open: if the exchange fails (a peer died, timeout), it warns once and stops
exchanging; per-rank logging goes on.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from fp8scope.step_payload import StepPayload, TensorKey, stats_matrix
from fp8scope.distributed.aggregate import (
    AGGREGATE_RANK,
    REDUCE_MODES,
    key_hash,
    pack,
    reduce_scalars,
    reduce_tensors,
    rows_needed,
    unpack,
)
from fp8scope.distributed.consistency import CrossRankCheck, OnsetFilter, events_batch, scale_mismatch_events
from fp8scope.schema import FIELD_INDEX, N_FIELDS
from fp8scope.step_records import merge_rows, scalar_batch, tensor_batch
from fp8scope.writer_thread import BackgroundWriter

INITIAL_CAPACITY = 64
DEFAULT_TIMEOUT_S = 60.0


class _PerRankFilter:
    """Wraps the RunWriter; in ``aggregate`` mode drops the per-rank tensors/scalars rows."""

    def __init__(self, inner, drop: frozenset[str]):
        self._inner = inner
        self._drop = drop

    def write(self, table: str, batch) -> None:
        if table in self._drop:
            return
        self._inner.write(table, batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _group_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def new_monitor_group(timeout_s: float = DEFAULT_TIMEOUT_S):
    """A gloo group over all ranks, used only by the monitor's writer threads (collective: every rank calls it)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class DistributedWriter(BackgroundWriter):
    def __init__(
        self,
        run_writer,
        rank: int,
        keys: list[TensorKey],
        on_new_keys: Callable[[list[TensorKey]], None] | None = None,
        *,
        mode: str,
        check: CrossRankCheck,
        group,
        world_size: int,
        max_queue: int = 64,
        suspicious=None,
    ):
        if mode not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {mode!r}")
        self.mode = mode
        self.check = check
        self._group = group
        self._world = world_size
        self._real = run_writer
        self._root = _group_rank(group) == 0
        self._capacity = INITIAL_CAPACITY
        self._hash_of_kid: list[int] = []
        self._kid_of_hash: dict[int, int] = {}
        self._scalar_hash: dict[str, int] = {}
        self._scalar_name: dict[int, str] = {}
        self._onset = OnsetFilter(check.repeat)
        self.exchange_failed: str | None = None
        self._last_exchange = None
        self.exchanges = 0  # collectives issued (tests and overhead reports read it)
        self.unknown_rows = 0
        self._warned: set[str] = set()
        drop = frozenset({"tensors", "scalars"}) if mode == "aggregate" else frozenset()
        super().__init__(_PerRankFilter(run_writer, drop), rank, keys, on_new_keys, max_queue=max_queue,
                         suspicious=suspicious)

    # ---- writer thread -----------------------------------------------------------
    def _write_step(self, payload: StepPayload) -> None:
        try:
            super()._write_step(payload)
        finally:  # peers wait for this rank's contribution even if the local write failed
            if self.exchange_failed is None:
                try:
                    self._exchange(payload)
                except Exception as exc:
                    self.exchange_failed = f"{type(exc).__name__}: {exc}"
                    warnings.warn(
                        f"fp8scope: cross-rank exchange stopped ({self.exchange_failed}); "
                        "per-rank logging continues", RuntimeWarning, stacklevel=2,
                    )

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"fp8scope: {msg}", RuntimeWarning, stacklevel=3)

    def _tensor_hashes(self, kids) -> list[int]:
        while len(self._hash_of_kid) < len(self._keys):
            k = self._keys[len(self._hash_of_kid)]
            h = key_hash("t", k.layer, k.role)
            self._kid_of_hash[h] = len(self._hash_of_kid)
            self._hash_of_kid.append(h)
        return [self._hash_of_kid[int(k)] for k in kids]

    def _scalar_hashes(self, names) -> list[int]:
        out = []
        for n in names:
            h = self._scalar_hash.get(n)
            if h is None:
                h = self._scalar_hash[n] = key_hash("s", n)
                self._scalar_name[h] = n
            out.append(h)
        return out

    def _all_gather(self, wire: np.ndarray) -> np.ndarray:
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(np.ascontiguousarray(wire))
        out = [torch.empty_like(t) for _ in range(self._world)]
        dist.all_gather(out, t, group=self._group)
        # Held until the next exchange: gloo's worker thread lets go of its work (and these tensors)
        # just after the wait returns, and a tensor made from Python that a C++ thread frees last takes
        # the GIL to do it, which aborts the process if that happens during interpreter shutdown
        # (pytorch/pytorch#179291). With this reference a Python thread frees them.
        self._last_exchange = (t, out)
        self.exchanges += 1
        return torch.stack(out).numpy()

    def _exchange(self, payload: StepPayload) -> None:
        payload.wait()
        matrix, tail = stats_matrix(payload)
        if payload.n_rows:
            m, kids, _, _ = merge_rows(matrix, payload.key_ids)
        else:
            m, kids = np.zeros((0, N_FIELDS)), np.zeros(0, dtype=np.int64)
        names = list(payload.scalar_names) + list(payload.host_scalars)
        values = list(tail) + list(payload.host_scalars.values())
        args = (payload.step, payload.full, m, self._tensor_hashes(kids), self._scalar_hashes(names), values)
        wire, _ = pack(*args, capacity=self._capacity)
        gathered = self._all_gather(wire)
        need = rows_needed(gathered)
        if need > self._capacity:  # every rank sees the same headers: all take this branch together
            self._capacity = 1 << max(need - 1, 1).bit_length()
            wire, _ = pack(*args, capacity=self._capacity)
            gathered = self._all_gather(wire)
        if not self._root:
            return
        parts = unpack(gathered)
        aligned = [p for p in parts if p.step == payload.step]
        if len(aligned) < len(parts):
            self._warn_once("align", "ranks logged different step numbers at the same position; "
                            "the aggregate and the cross-rank check use the ranks that agree with rank 0")
        if self.mode in ("aggregate", "both"):
            self._write_aggregate(payload, aligned)
        if self.check.enabled:
            self._check(payload.step, aligned)

    def _write_aggregate(self, payload: StepPayload, parts) -> None:
        m, kids, unknown = reduce_tensors(parts, self._kid_of_hash)
        if unknown:
            self.unknown_rows += unknown
            self._warn_once("unknown", "other ranks monitor tensors rank 0 does not (pipeline stages?); "
                            "the aggregate (rank -1) covers the tensors rank 0 monitors")
        if kids:
            # full per row: where every rank took full stats (ranks may look closer at different layers)
            batch = tensor_batch(payload.step, AGGREGATE_RANK, m, kids, self._keys, None)
            self._real.write("tensors", batch)
        names, values = reduce_scalars(parts, self._scalar_name)
        if names:
            self._real.write("scalars", scalar_batch(payload.step, AGGREGATE_RANK, names, values, payload.wall_time))

    def _check(self, step: int, parts) -> None:
        import pandas as pd

        j = FIELD_INDEX["scale"]
        roles = set(self.check.roles)
        rows = []
        for p in parts:
            for h, vec in zip(p.tensor_hashes.tolist(), p.matrix):
                kid = self._kid_of_hash.get(h)
                if kid is None:
                    continue
                k = self._keys[kid]
                if k.role in roles:
                    rows.append((step, p.rank, k.layer, k.role, float(vec[j])))
        df = pd.DataFrame(rows, columns=["step", "rank", "layer", "tensor", "scale"])
        events = scale_mismatch_events(df, self.check, onset=self._onset)
        if len(events):
            self._real.write("events", events_batch(events))


def make_writer(run_writer, rank: int, keys, on_new_keys, *, reduce: str, check: CrossRankCheck | None,
                world_size: int, warn: Callable[[str, str], None], suspicious=None) -> BackgroundWriter:
    """The writer thread for a Monitor: plain for one rank or ``reduce="none"`` without a check,
    else a :class:`DistributedWriter` (needs an initialised ``torch.distributed``)."""
    wants_exchange = reduce != "none" or (check is not None and check.enabled)
    if world_size > 1 and wants_exchange:
        try:
            import torch.distributed as dist

            ready = dist.is_available() and dist.is_initialized()
        except Exception:
            ready = False
        if ready:
            group = new_monitor_group()
            return DistributedWriter(run_writer, rank, keys, on_new_keys, mode=reduce,
                                     check=check or CrossRankCheck(), group=group,
                                     world_size=dist.get_world_size(group), suspicious=suspicious)
        warn("distributed", f"reduce={reduce!r} needs torch.distributed initialised before the Monitor; "
             "logging per-rank rows only")
    elif world_size == 1 and reduce == "aggregate":
        pass  # one rank: its rows are the aggregate; written with its own rank
    return BackgroundWriter(run_writer, rank, keys, on_new_keys, suspicious=suspicious)
