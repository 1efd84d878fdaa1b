"""Cross-rank reduction of one step's stats, on the host (pure numpy, no torch.distributed).

Wire format of one rank's step (what ``distributed.writer`` all-gathers): a float64 matrix of
``1 + capacity`` rows and ``ROW_WIDTH`` columns.

- row 0, the header: ``[step, n_rows, full, n_tensor_rows, 0...]``;
- then ``n_rows`` rows ``[kind, key_hash, values...]``: ``kind`` 0 is a tensor row whose values
  are its ``schema.STAT_FIELDS`` vector (micro-batches already merged), kind 1 a scalar row
  whose first value is the scalar; the rest is padding (NaN).

Tensors and scalars are identified by a 48-bit hash of their names (exact in float64), so
ranks need not have assigned the same key ids. Reduction rules across ranks follow
``STAT_FIELDS``' merge rules (max for amax, min for min_nonzero, sum for counts and squared
errors, so SQNR of the aggregate is the SQNR over all ranks' elements), and for the
per-rank "last" fields the most conservative value: the smallest scale, the largest
scale_inv and expected amax. NaN wins (a NaN on any rank is the news). Scalars are averaged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fp8scope.schema import FIELD_INDEX, N_FIELDS, STAT_FIELDS

AGGREGATE_RANK = -1  # the `rank` column of rows that stand for all ranks
REDUCE_MODES = ("none", "aggregate", "both")
ROW_WIDTH = 2 + N_FIELDS
TENSOR_ROW, SCALAR_ROW = 0.0, 1.0
# Cross-rank rule of the fields that are "last" within a rank (scales in use).
_CONSERVATIVE = {"scale": "min", "scale_inv": "max", "expected_amax": "max"}


def key_hash(kind: str, *names: str) -> int:
    """A 48-bit id for a tensor (``"t", layer, role``) or a scalar (``"s", name``): exact in float64."""
    h = hashlib.blake2b("\x00".join((kind, *names)).encode(), digest_size=6).digest()
    return int.from_bytes(h, "little")


@dataclass
class RankStep:
    """One rank's step after unpacking."""

    rank: int
    step: int
    full: bool
    tensor_hashes: np.ndarray  # int64 (n,)
    matrix: np.ndarray  # (n, N_FIELDS)
    scalar_hashes: np.ndarray  # int64 (m,)
    scalar_values: np.ndarray  # (m,)


def pack(
    step: int,
    full: bool,
    matrix: np.ndarray,
    tensor_hashes: Sequence[int],
    scalar_hashes: Sequence[int],
    scalar_values: Sequence[float],
    capacity: int,
) -> tuple[np.ndarray, int]:
    """The wire matrix and the number of rows this rank needs (may exceed ``capacity``:
    then only the header is meaningful and the caller gathers again with a larger one)."""
    n_t, n_s = len(tensor_hashes), len(scalar_hashes)
    n = n_t + n_s
    out = np.full((1 + capacity, ROW_WIDTH), np.nan)
    out[0, :4] = (step, n, float(full), n_t)
    if n <= capacity:
        body = out[1 : 1 + n]
        body[:n_t, 0] = TENSOR_ROW
        body[:n_t, 1] = np.asarray(tensor_hashes, dtype=np.float64)
        body[:n_t, 2:] = matrix[:n_t]
        body[n_t:, 0] = SCALAR_ROW
        body[n_t:, 1] = np.asarray(scalar_hashes, dtype=np.float64)
        body[n_t:, 2] = np.asarray(scalar_values, dtype=np.float64)
    return out, n


def rows_needed(gathered: np.ndarray) -> int:
    """Largest ``n_rows`` of any rank in a gathered ``(world, 1 + capacity, ROW_WIDTH)`` array."""
    return int(np.nanmax(gathered[:, 0, 1])) if len(gathered) else 0


def unpack(gathered: np.ndarray, ranks: Sequence[int] | None = None) -> list[RankStep]:
    out = []
    for i, m in enumerate(gathered):
        step, n, full, n_t = m[0, :4]
        n, n_t = int(n), int(n_t)
        body = m[1 : 1 + n]
        out.append(
            RankStep(
                rank=int(ranks[i]) if ranks is not None else i,
                step=int(step),
                full=bool(full),
                tensor_hashes=body[:n_t, 1].astype(np.int64),
                matrix=body[:n_t, 2:],
                scalar_hashes=body[n_t:, 1].astype(np.int64),
                scalar_values=body[n_t:, 2],
            )
        )
    return out


def _nan_wins(values: np.ndarray, how: str) -> float:
    if np.isnan(values).any():
        return float("nan")
    return float(values.max() if how == "max" else values.min())


def reduce_tensors(parts: Sequence[RankStep], hash_to_kid: dict[int, int]) -> tuple[np.ndarray, list[int], int]:
    """All ranks' rows of the tensors named in ``hash_to_kid``, ready for ``step_records.tensor_batch``.

    Rows are concatenated (the first part's rows first, so execution order is rank 0's) and the
    per-rank "last" fields are replaced by their cross-rank conservative value, so that
    ``tensor_batch``'s own merge (max / min / sum / last) yields the cross-rank reduction;
    its ``calls`` column then counts contributing ranks. Also returns how many rows were
    left out because their tensor is unknown here (a layer this rank does not monitor).
    """
    mats, kids, unknown = [], [], 0
    for p in parts:
        for h, row in zip(p.tensor_hashes.tolist(), p.matrix):
            kid = hash_to_kid.get(h)
            if kid is None:
                unknown += 1
                continue
            mats.append(row)
            kids.append(kid)
    if not mats:
        return np.zeros((0, N_FIELDS)), [], unknown
    m = np.array(mats, dtype=np.float64)
    k = np.asarray(kids)
    for name, how in _CONSERVATIVE.items():
        j = FIELD_INDEX[name]
        for kid in np.unique(k):
            sel = k == kid
            m[sel, j] = _nan_wins(m[sel, j], how)
    return m, kids, unknown


def reduce_scalars(parts: Sequence[RankStep], hash_to_name: dict[int, str]) -> tuple[list[str], list[float]]:
    """Mean over the ranks that logged each scalar (names this rank knows)."""
    acc: dict[int, list[float]] = {}
    for p in parts:
        for h, v in zip(p.scalar_hashes.tolist(), p.scalar_values.tolist()):
            if h in hash_to_name:
                acc.setdefault(h, []).append(v)
    names = [hash_to_name[h] for h in acc]
    return names, [float(np.mean(v)) for v in acc.values()]


def cross_rank_rules() -> dict[str, str]:
    """Field -> rule used across ranks (for the docs and the dashboard)."""
    return {name: _CONSERVATIVE.get(name, how) for name, how in STAT_FIELDS}
