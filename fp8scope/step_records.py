"""Turns one step's host-side stats matrix into Arrow record batches (writer-thread work).

This is where micro-batch captures of the same tensor (gradient accumulation) are
merged with each field's rule from ``schema.STAT_FIELDS`` and where the derived
columns are computed (quantization MSE and SQNR from the summed squares). Pure
functions of numpy arrays: no torch, no I/O.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from fp8scope.schema import (FIELD_INDEX, FULL_ONLY, RECIPE_FIELDS, RECIPE_SCHEMA, SCALAR_SCHEMA, STAT_FIELDS,
                             TENSOR_SCHEMA)
from fp8scope.step_payload import CHEAP_FIELDS, TensorKey, nonfinite_flags, widen_cheap_rows

# the integer statistics of each table, from its schema: a count added there is written here too
_COUNT_FIELDS = tuple(n for n, _ in STAT_FIELDS
                      if n in TENSOR_SCHEMA.names and pa.types.is_integer(TENSOR_SCHEMA.field(n).type))
_RECIPE_COUNTS = tuple(n for n in RECIPE_FIELDS if pa.types.is_integer(RECIPE_SCHEMA.field(n).type))


def merge_rows(matrix: np.ndarray, key_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge rows that describe the same tensor within a step.

    Returns (merged matrix, key id per merged row, execution order per merged row, calls per row).
    The order of a merged row is that of its first capture.
    """
    keys = np.asarray(key_ids, dtype=np.int64)
    uniq, first, group, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
    if len(uniq) == len(keys):  # the common case: one capture per tensor
        return matrix, keys, np.arange(len(keys), dtype=np.int32), np.ones(len(keys), dtype=np.int32)
    out = np.empty((len(uniq), matrix.shape[1]), dtype=np.float64)
    for j, (_, how) in enumerate(STAT_FIELDS):
        col = matrix[:, j]
        if how == "sum":
            res = np.zeros(len(uniq))
            np.add.at(res, group, col)
        elif how == "max":
            res = np.full(len(uniq), -np.inf)
            np.fmax.at(res, group, col)
            # NaN must win (a NaN amax in any micro-batch is the news)
            nan_any = np.zeros(len(uniq), dtype=bool)
            np.logical_or.at(nan_any, group, np.isnan(col))
            res[nan_any] = np.nan
        elif how == "min":
            res = np.full(len(uniq), np.inf)
            np.fmin.at(res, group, col)
        else:  # "last"
            res = np.empty(len(uniq))
            res[group] = col  # later rows overwrite earlier ones
        out[:, j] = res
    by_first = np.argsort(first, kind="stable")  # rows in execution order of first capture
    return out[by_first], uniq[by_first], first[by_first].astype(np.int32), counts[by_first].astype(np.int32)


def _int_col(values: np.ndarray) -> pa.Array:
    """Counts as int64, null where the stat was not computed (cheap-stats rows)."""
    mask = np.isnan(values)
    # rounded: an expectation (NVFP4 gradients under stochastic rounding) is a fractional count
    return pa.array(np.rint(np.where(mask, 0, values)).astype(np.int64), mask=mask, type=pa.int64())


def _float_col(values: np.ndarray) -> pa.Array:
    return pa.array(values, type=pa.float64(), from_pandas=True)


def _identity_columns(kids: np.ndarray, keys: Sequence[TensorKey], cache: dict | None) -> dict[str, pa.Array]:
    """layer / tensor / source / fp8_format / recipe / fp8_max for these rows. A training loop logs the same
    tensors in the same order step after step, so a writer passes a ``cache`` and the arrays are
    built once per distinct row list instead of once per step."""
    sig = kids.tobytes() if cache is not None else None
    if sig is not None and sig in cache:
        return cache[sig]
    ks = [keys[k] for k in kids]
    cols = {
        "layer": pa.array([k.layer for k in ks], type=pa.string()),
        "tensor": pa.array([k.role for k in ks], type=pa.string()),
        "source": pa.array([k.source for k in ks], type=pa.string()),
        "fp8_format": pa.array([k.fmt for k in ks], type=pa.string()),
        "recipe": pa.array([k.recipe for k in ks], type=pa.string()),
        "fp8_max": pa.array(np.array([k.fp8_max for k in ks], dtype=np.float64)),
    }
    if sig is not None:
        if len(cache) >= 32:  # bounded: a loop whose row list keeps changing only rebuilds
            cache.clear()
        cache[sig] = cols
    return cols


def _full_column(full: bool | None, focus: frozenset, zeros: np.ndarray, kids, keys: Sequence[TensorKey]) -> np.ndarray:
    """Per row, whether it holds full stats (:func:`tensor_batch`'s ``full`` and ``focus``)."""
    if full is None:  # a count is present where every contributing row had one
        return ~np.isnan(zeros)
    if full or not focus:
        return np.full(len(kids), full, dtype=bool)
    return np.fromiter((keys[k].layer in focus for k in kids), dtype=bool, count=len(kids))


def tensor_batch(
    step: int, rank: int, matrix: np.ndarray, key_ids: Sequence[int], keys: Sequence[TensorKey], full: bool | None,
    cache: dict | None = None, focus: frozenset = frozenset(),
) -> pa.RecordBatch:
    """One record batch: a row per tensor captured in ``step`` (``cache``: see ``_identity_columns``).
    ``full``: the step took full stats; else the rows of the layers in ``focus`` did (a closer look
    after a suspicious step, ``StepCollector.look_closer``). None: each row where its full-stats
    counts are present (the ranks' aggregate: a count is summed across ranks, NaN where one rank's
    row was cheap, so a row is full where every rank took full stats of it)."""
    m, kids, order, calls = merge_rows(matrix, key_ids)
    n = len(kids)
    f = {name: m[:, i] for name, i in FIELD_INDEX.items()}
    finite_n = f["numel"] - np.nan_to_num(f["nonfinite"], nan=0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mse = np.where(finite_n > 0, f["sq_err"] / finite_n, np.nan)
        sqnr = np.where(f["sq_err"] > 0, 10 * np.log10(f["sq_signal"] / f["sq_err"]), np.inf)
        sqnr = np.where(np.isnan(f["sq_err"]), np.nan, sqnr)
    cols = {
        "step": pa.array(np.full(n, step, dtype=np.int64)),
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        **_identity_columns(kids, keys, cache),
        "order": pa.array(order, type=pa.int32()),
        "full": pa.array(_full_column(full, focus, f["zeros"], kids, keys)),
        "calls": pa.array(calls, type=pa.int32()),
        "amax": _float_col(f["amax"]),
        "min_nonzero": _float_col(f["min_nonzero"]),
        "scale": _float_col(f["scale"]),
        "scale_inv": _float_col(f["scale_inv"]),
        "expected_amax": _float_col(f["expected_amax"]),
        "numel": _int_col(f["numel"]),
        **{name: _int_col(f[name]) for name in _COUNT_FIELDS if name != "numel"},
        "qerr_mse": _float_col(mse),
        "sqnr_db": _float_col(sqnr),
    }
    return pa.RecordBatch.from_arrays([cols[name] for name in TENSOR_SCHEMA.names], schema=TENSOR_SCHEMA)


# cheap-step columns that only depend on the row list: built once per row list (see cheap_tensor_batch):
# what only full stats fill (a cheap row's nonfinite is the flag its amax implies), and the error they give
_CHEAP_NULLS = (*(n for n in FULL_ONLY if n in TENSOR_SCHEMA.names and n != "nonfinite"), "qerr_mse", "sqnr_db")


def cheap_tensor_batch(
    step: int, rank: int, rows: np.ndarray, key_ids: Sequence[int], numels: Sequence[int],
    keys: Sequence[TensorKey], cache: dict,
) -> pa.RecordBatch:
    """:func:`tensor_batch` for a cheap step, from its narrow rows (one per capture, columns
    ``CHEAP_FIELDS``: amax, scale, scale_inv, expected_amax; ``nonfinite`` is the flag the amax
    implies).

    A cheap step changes four float columns and the step number; everything else (identity,
    order, numel, the null count columns) is the same as the last step with this row list, so
    it is built once and reused. That keeps the writer's work per step (which ``Monitor.step``
    waits for on CPU) to a handful of small arrays. Micro-batch merging takes the general path."""
    kids = np.asarray(key_ids, dtype=np.int64)
    numel = np.asarray(numels, dtype=np.float64)
    sig = ("cheap", rank, kids.tobytes(), numel.tobytes())
    static = cache.get(sig)
    if static is None:
        if len(np.unique(kids)) != len(kids):  # several captures of one tensor: merge rules apply
            return tensor_batch(step, rank, widen_cheap_rows(rows, numels), key_ids, keys, False, cache=cache)
        n = len(kids)
        static = {
            "rank": pa.array(np.full(n, rank, dtype=np.int32)),
            **_identity_columns(kids, keys, cache),
            "order": pa.array(np.arange(n, dtype=np.int32)),
            "full": pa.array(np.zeros(n, dtype=bool)),
            "calls": pa.array(np.ones(n, dtype=np.int32)),
            "numel": _int_col(np.where(numel >= 0, numel, np.nan)),
            **{name: pa.nulls(n, TENSOR_SCHEMA.field(name).type) for name in _CHEAP_NULLS},
        }
        if len(cache) >= 32:
            cache.clear()
        cache[sig] = static
    cols_major = np.ascontiguousarray(rows.T)
    cols = {**static, "step": pa.array(np.full(len(kids), step, dtype=np.int64))}
    for j, name in enumerate(CHEAP_FIELDS):
        cols[name] = _float_col(cols_major[j])
    cols["nonfinite"] = _int_col(nonfinite_flags(cols_major[0]))
    return pa.RecordBatch.from_arrays([cols[name] for name in TENSOR_SCHEMA.names], schema=TENSOR_SCHEMA)


def scalar_batch(
    step: int, rank: int, names: Sequence[str], values: Sequence[float], wall_time: float, cache: dict | None = None,
) -> pa.RecordBatch:
    """One record batch of a step's scalars (``cache``: a writer's dict, keeps the names column)."""
    n = len(names)
    names_col = cache.get(tuple(names)) if cache is not None else None
    if names_col is None:
        names_col = pa.array(list(names), type=pa.string())
        if cache is not None:
            if len(cache) >= 32:
                cache.clear()
            cache[tuple(names)] = names_col
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.full(n, step, dtype=np.int64)),
            pa.array(np.full(n, rank, dtype=np.int32)),
            names_col,
            pa.array(np.asarray(values, dtype=np.float64)),
            pa.array(np.full(n, wall_time, dtype=np.float64)),
        ],
        schema=SCALAR_SCHEMA,
    )


def recipe_batch(step: int, rank: int, matrix: np.ndarray, recipe_keys: Sequence[tuple[int, str]],
                 keys: Sequence[TensorKey]) -> pa.RecordBatch:
    """The ``recipes`` rows of one step: one per (tensor, recipe), the captures of a tensor within the
    step (micro-batches) summed (every field is a count or a sum but the clip ratio, which keeps its
    largest)."""
    merged: dict[tuple[int, str], np.ndarray] = {}
    clip = RECIPE_FIELDS.index("clip_ratio")
    for (kid, recipe), values in zip(recipe_keys, matrix):
        prev = merged.get((kid, recipe))
        if prev is None:
            merged[(kid, recipe)] = values.copy()
        else:
            both = prev + values
            both[clip] = max(prev[clip], values[clip])  # the worst capture's, not a sum
            merged[(kid, recipe)] = both
    rows = list(merged.items())
    m = np.array([v for _, v in rows]).reshape(len(rows), len(RECIPE_FIELDS))
    f = {name: m[:, i] for i, name in enumerate(RECIPE_FIELDS)}
    with np.errstate(divide="ignore", invalid="ignore"):
        sqnr = np.where(f["sq_err"] > 0, 10 * np.log10(f["sq_signal"] / f["sq_err"]), np.inf)
    n = len(rows)
    cols = {
        "step": pa.array(np.full(n, step, dtype=np.int64)),
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "layer": pa.array([keys[k].layer for (k, _), _ in rows], type=pa.string()),
        "tensor": pa.array([keys[k].role for (k, _), _ in rows], type=pa.string()),
        "recipe": pa.array([r for (_, r), _ in rows], type=pa.string()),
        **{name: _int_col(f[name]) for name in _RECIPE_COUNTS},
        "sq_err": _float_col(f["sq_err"]),
        "sq_signal": _float_col(f["sq_signal"]),
        "sqnr_db": _float_col(sqnr),
        "clip_ratio": _float_col(f["clip_ratio"]),
    }
    return pa.RecordBatch.from_arrays([cols[name] for name in RECIPE_SCHEMA.names], schema=RECIPE_SCHEMA)
