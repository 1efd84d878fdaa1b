"""Where a resumed run's what-if tensors start: the delayed-scaling state they had when the run
stopped, rebuilt from the run's own log.

A TE module keeps its scales and amax histories in the checkpoint (``get_extra_state``,
``pytorch/module/base.py``), so a resumed TE run quantizes its next step with the scales it had,
and so does an emulated layer (``Fp8Linear.get_extra_state``). The what-if monitor's states live
in the monitor, not in the model: started afresh, every what-if tensor of a resumed run quantized
at scale 1, and the report showed a ``scale_mismatch`` and the gradients' ``underflow`` at every
resume, blaming FP8 for a restart. The log holds what the state is made of: each row has its
tensor's amax and the scale it was quantized with. So a monitor that continues a run folder from
step N (``Monitor(step=N)``) starts each what-if tensor from its rows before N, the later
segment's where segments logged the same step (the store's rule):

- the history holds the last ``amax_history_len - 1`` amaxes that rolled in before the tensor's
  last row, in TE's rolled order (an amax of 0 rolls nothing in; a NaN rolls in as 0);
- the scale and expected amax are the last row's: what that step was quantized with;
- the update that step's end applied, with its amax, is then applied by
  :func:`~fp8scope.emulate.scaling.delayed_update`, the one implementation of TE's rule.

This is the state the monitor held when it logged that row, exactly, for a tensor captured once a
step. A step of several micro-batches logs one row (their largest amax, the last scale), so its
history holds that amax once where the monitor's held each micro-batch's. Only the ``2 *
amax_history_len`` steps before N are read: a tensor that rolled in fewer amaxes there (an expert
that got no token on most steps) starts with the older rows empty.

Online detection continues the same way: :func:`logged_steps` hands it the rank's last logged
steps before N, which it examines without reporting (their events were reported by the run that
logged them), so its windows and edge flags are where an uninterrupted run's would be. Started
empty, it warned ``scale_mismatch`` on a resumed what-if run's first step, about a scale its
window of one row could not explain, which offline detection over the whole log did not.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from fp8scope.emulate.recipes import DelayedScaling
from fp8scope.emulate.scaling import delayed_update, scaled_max
from fp8scope.formats import get_format
from fp8scope.store.layout import StreamFile
from fp8scope.store.merge import SEGMENT, dedup_latest_segment
from fp8scope.store.reader import read_stream

# (layer, role) -> (format name, history [len], scale, scale_inv, expected amax, kept): 0-d float32
# tensors on the CPU but for the history; DeviceDelayedBank.add(state=...) takes the last five
State = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_COLUMNS = ("step", "rank", "layer", "tensor", "source", "fp8_format", "amax", "scale", "expected_amax")
ONLINE_STEPS = 200
"""Logged steps before N that online detection examines again: twice its widest window (100 rows)."""


def _rows(streams: Iterable[StreamFile], table: str, rank: int, lo: int, hi: int,
          columns: Iterable[str] | None = None) -> pa.Table | None:
    """``rank``'s rows of ``table`` logged for steps ``lo <= step < hi``, the later segment's where two
    logged a step (the store's rule: ``dedup_latest_segment``), in the order written; None if none.
    Rows of another rank in the rank's streams (rank 0's aggregate of all ranks, rank -1, under
    ``reduce="aggregate"``) are not its own."""
    parts = []
    for s in streams:
        if s.table != table or s.rank != rank:
            continue
        t = read_stream(s.path)
        if t.num_rows == 0 or (columns is not None and not set(columns) <= set(t.column_names)):
            continue
        if columns is not None:
            t = t.select(list(columns))
        t = t.filter(pc.and_(pc.and_(pc.greater_equal(t["step"], lo), pc.less(t["step"], hi)),
                             pc.equal(t["rank"], rank)))
        if t.num_rows:
            parts.append(t.append_column(SEGMENT, pa.array(np.full(t.num_rows, s.segment, np.int32))))
    if not parts:
        return None
    return dedup_latest_segment(pa.concat_tables(parts, promote_options="default"))


def logged_steps(streams: Iterable[StreamFile], rank: int, start: int,
                 count: int = ONLINE_STEPS) -> list[tuple[int, int, pa.RecordBatch | None, pa.RecordBatch | None]]:
    """``rank``'s last ``count`` logged steps before ``start`` as online detection takes them:
    ``(step, rank, tensors, scalars)`` in step order, each table's rows of that step as one batch."""
    tables = {name: _rows(streams, name, rank, start - count, start) for name in ("tensors", "scalars")}
    by_step: dict[int, dict[str, pa.RecordBatch]] = {}
    for name, t in tables.items():
        if t is None:
            continue
        t = t.drop_columns([SEGMENT]).sort_by([("step", "ascending")])  # a stable sort: the order written
        steps = t["step"].to_numpy()
        edges = np.flatnonzero(np.diff(steps)) + 1
        for lo, hi in zip(np.r_[0, edges], np.r_[edges, len(steps)]):
            batch = t.slice(int(lo), int(hi - lo)).combine_chunks().to_batches()[0]
            by_step.setdefault(int(steps[lo]), {})[name] = batch
    return [(step, rank, got.get("tensors"), got.get("scalars")) for step, got in sorted(by_step.items())]


def whatif_states(streams: Iterable[StreamFile], rank: int, start: int,
                  recipe: DelayedScaling) -> dict[tuple[str, str], State]:
    """The delayed-scaling state of each what-if tensor of ``rank`` at step ``start``, from that
    rank's ``tensors`` streams (``streams``: its stream files, any table; rows of another rank in
    them, rank 0's aggregate of all ranks under ``reduce="aggregate"``, are not its own)."""
    length = int(recipe.amax_history_len)
    t = _rows(streams, "tensors", rank, start - 2 * length, start, _COLUMNS)
    if t is not None:
        t = t.filter(pc.equal(t["source"], "whatif"))
    if t is None or t.num_rows == 0:
        return {}
    df = t.to_pandas().sort_values(["layer", "tensor", "step"], kind="stable")
    keys, fmts, hist, last, scale, expected = [], [], [], [], [], []
    for (layer, role), g in df.groupby(["layer", "tensor"], sort=False):
        amax = g["amax"].to_numpy(np.float64)
        row = g.iloc[-1]
        if not (np.isfinite(row["scale"]) and row["scale"] > 0 and np.isfinite(row["expected_amax"])):
            continue  # a row that says no scale: nothing to continue from
        before = amax[:-1]
        rolled = before[before != 0]  # NaN != 0: a NaN rolls in (as 0)
        rolled = np.where(np.isnan(rolled), 0.0, rolled)[len(rolled) - min(len(rolled), length - 1):]
        h = np.zeros(length)
        h[length - len(rolled):] = rolled  # rows 1.. in rolled order, the latest last; row 0 stays 0
        keys.append((layer, role))
        fmts.append(row["fp8_format"])
        hist.append(h)
        last.append(amax[-1])
        scale.append(row["scale"])
        expected.append(row["expected_amax"])
    if not keys:
        return {}
    f32 = dict(dtype=torch.float32)
    try:
        maxes = [scaled_max(get_format(f), recipe.margin) for f in fmts]
    except ValueError:  # a format this fp8scope does not know (get_format): start afresh
        return {}
    new = delayed_update(torch.tensor(np.array(hist), **f32), torch.tensor(last, **f32),
                         torch.tensor(maxes, **f32), torch.tensor(scale, **f32), torch.tensor(expected, **f32),
                         recipe.amax_compute_algo != "max")
    rows = zip(*(t.unbind(0) for t in new))
    return {key: (fmt, *row) for key, fmt, row in zip(keys, fmts, rows)}
