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
from fp8scope.store.reader import read_stream

# (layer, role) -> (format name, history [len], scale, scale_inv, expected amax, kept): 0-d float32
# tensors on the CPU but for the history; DeviceDelayedBank.add(state=...) takes the last five
State = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_COLUMNS = ("step", "rank", "layer", "tensor", "source", "fp8_format", "amax", "scale", "expected_amax")


def whatif_states(streams: Iterable[StreamFile], rank: int, start: int,
                  recipe: DelayedScaling) -> dict[tuple[str, str], State]:
    """The delayed-scaling state of each what-if tensor of ``rank`` at step ``start``, from that
    rank's ``tensors`` streams (``streams``: its stream files, any table; rows of another rank in
    them, rank 0's aggregate of all ranks under ``reduce="aggregate"``, are not its own)."""
    length = int(recipe.amax_history_len)
    lo = start - 2 * length
    parts = []
    for s in streams:
        if s.table != "tensors" or s.rank != rank:
            continue
        t = read_stream(s.path)
        if t.num_rows == 0 or not set(_COLUMNS) <= set(t.column_names):
            continue
        t = t.select(list(_COLUMNS))
        keep = pc.and_(pc.and_(pc.greater_equal(t["step"], lo), pc.less(t["step"], start)),
                       pc.and_(pc.equal(t["source"], "whatif"), pc.equal(t["rank"], rank)))
        t = t.filter(keep)
        if t.num_rows:
            parts.append(t.append_column("segment", pa.array(np.full(t.num_rows, s.segment, np.int64))))
    if not parts:
        return {}
    df = pa.concat_tables(parts).to_pandas()
    df = df[df["segment"] == df.groupby("step")["segment"].transform("max")]  # the later segment wins
    df = df.sort_values(["layer", "tensor", "step"], kind="stable")
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
    except (KeyError, ValueError):  # a format this fp8scope does not know: start afresh
        return {}
    new = delayed_update(torch.tensor(np.array(hist), **f32), torch.tensor(last, **f32),
                         torch.tensor(maxes, **f32), torch.tensor(scale, **f32), torch.tensor(expected, **f32),
                         recipe.amax_compute_algo != "max")
    rows = zip(*(t.unbind(0) for t in new))
    return {key: (fmt, *row) for key, fmt, row in zip(keys, fmts, rows)}
