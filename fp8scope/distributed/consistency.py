"""``cross_rank_scale_mismatch``: the same tensor's FP8 scale differing between ranks that should agree.

Why it matters: Megatron-LM PR #442 reduced the amax over the wrong process group; tensor-parallel
ranks then quantized the same logical tensor with different scales and a 40B run diverged after
~1000 iterations, with nothing in the loss curve pointing at FP8 (../shared/fp8-reference.md §5.10).

Which ranks "should agree" is configuration (:class:`CrossRankCheck`):

- ``groups``: lists of ranks that must hold identical scales (data-parallel replicas, or the
  members of the amax-reduction group). Default: all ranks form one group.
- ``roles``: which tensors to compare. Default ``("weight",)``: replicas hold identical weights
  under DDP/FSDP, so their weight scales agree under every recipe. Activations and gradients
  differ between data-parallel ranks (different data) unless the amax is all-reduced across the
  group (TE delayed scaling with ``reduce_amax=True``, the Megatron case): then pass all roles
  with the amax-reduction group as ``groups``. With tensor parallelism, weights are shards: use
  the data-parallel groups (or the TP group only if the amax is reduced over it).
- ``rtol``: relative tolerance (replicas compute bit-identical scales; the default only absorbs
  float printing noise).

Within a group and step the reference scale is the majority value (ties: the lowest rank's);
every rank off by more than ``rtol`` gets a critical event naming the rank, at the onset of a
mismatch and again every ``repeat`` steps while it lasts (so a persistent split is one row per
``repeat`` steps, not one per step). The same code runs online (writer thread of rank 0, from
the all-gathered scales) and offline over per-rank rows of a run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from fp8scope.schema import EVENT_SCHEMA

RULE_NAME = "cross_rank_scale_mismatch"
SEVERITY = "critical"


@dataclass
class CrossRankCheck:
    """Configuration of the cross-rank scale check (stored in ``run.json`` under ``meta.distributed``)."""

    groups: list[list[int]] | None = None
    roles: tuple[str, ...] = ("weight",)
    rtol: float = 1e-6
    repeat: int = 100
    enabled: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["roles"] = list(self.roles)
        return d

    @classmethod
    def from_value(cls, value: "CrossRankCheck | dict | bool | None") -> "CrossRankCheck":
        if isinstance(value, CrossRankCheck):
            return value
        if isinstance(value, dict):
            v = dict(value)
            if "roles" in v and v["roles"] is not None:
                v["roles"] = tuple(v["roles"])
            return cls(**{k: v[k] for k in v if k in cls.__dataclass_fields__})
        return cls(enabled=bool(value) if value is not None else True)


def _group_of(ranks: pd.Series, groups: list[list[int]] | None) -> pd.Series:
    if not groups:
        return pd.Series(np.zeros(len(ranks), dtype=np.int64), index=ranks.index)
    mapping = {int(r): g for g, members in enumerate(groups) for r in members}
    return ranks.map(mapping)


def mismatches(df: pd.DataFrame, check: CrossRankCheck) -> pd.DataFrame:
    """Rows of ``df`` (columns step, rank, layer, tensor, scale; ranks >= 0) whose scale differs from
    their group's reference, with columns ref, ref_rank, group_ranks added."""
    cols = ["step", "rank", "layer", "tensor", "scale"]
    d = df.loc[(df["rank"] >= 0) & df["tensor"].isin(list(check.roles)), cols].copy()
    if d.empty:
        return d.assign(ref=[], ref_rank=[], group=[])
    d["group"] = _group_of(d["rank"], check.groups)
    d = d[d["group"].notna()]
    keys = ["step", "group", "layer", "tensor"]
    # Quick exit (the normal case): every group has one distinct scale value per tensor.
    spread = d.groupby(keys, dropna=False)["scale"].agg(["min", "max", "count"])
    n_nan = d["scale"].isna().groupby([d[k] for k in keys], dropna=False).sum()
    suspicious = (
        (spread["max"] - spread["min"]).abs() > check.rtol * spread[["min", "max"]].abs().max(axis=1)
    ) | ((n_nan > 0) & (n_nan < spread["count"] + n_nan))
    if not suspicious.any():
        return d.iloc[0:0].assign(ref=[], ref_rank=[])
    bad = suspicious[suspicious].index
    d = d.set_index(keys).loc[bad].reset_index()
    # Majority value per group (ties -> lowest rank); NaN counts as a value of its own.
    d["_v"] = d["scale"].fillna(np.inf * -1)  # a sortable stand-in for NaN
    stats = d.groupby(keys + ["_v"], dropna=False)["rank"].agg(["size", "min"]).reset_index()
    stats = stats.sort_values(keys + ["size", "min"], ascending=[True] * len(keys) + [False, True])
    ref = stats.drop_duplicates(keys)[keys + ["_v", "min"]].rename(columns={"_v": "ref", "min": "ref_rank"})
    d = d.merge(ref, on=keys)
    both_nan = np.isneginf(d["_v"]) & np.isneginf(d["ref"])
    close = np.isclose(d["_v"], d["ref"], rtol=check.rtol, atol=0.0) | both_nan
    out = d[~close].drop(columns="_v")
    out["ref"] = out["ref"].replace(-np.inf, np.nan)
    return out.reset_index(drop=True)


class OnsetFilter:
    """Keeps a persistent mismatch to one event per ``repeat`` steps; state carries across calls."""

    def __init__(self, repeat: int):
        self.repeat = max(1, int(repeat))
        self._last_mismatch: dict[tuple, int] = {}
        self._last_emit: dict[tuple, int] = {}
        self._prev_step: int | None = None

    def __call__(self, step: int, keys: Iterable[tuple]) -> set[tuple]:
        out = set()
        for k in keys:
            onset = self._prev_step is None or self._last_mismatch.get(k) != self._prev_step
            if onset or step - self._last_emit.get(k, -(10**18)) >= self.repeat:
                out.add(k)
                self._last_emit[k] = step
            self._last_mismatch[k] = step
        self._prev_step = step
        return out


def _message(r, check: CrossRankCheck) -> str:
    grp = f"group {check.groups[int(r.group)]}" if check.groups else "all ranks"
    return (
        f"{r.layer} {r.tensor} scale on rank {int(r.rank)} is {r.scale:.6g}, rank {int(r.ref_rank)} "
        f"and the majority of {grp} use {r.ref:.6g}: ranks that should agree quantize this tensor "
        "differently (amax reduced over the wrong group, or a replica out of sync)"
    )


def _to_events(rows: pd.DataFrame, check: CrossRankCheck) -> pd.DataFrame:
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (rows["scale"] - rows["ref"]).abs() / rows["ref"].abs()
    return pd.DataFrame(
        {
            "step": rows["step"].astype(np.int64),
            "rank": rows["rank"].astype(np.int32),
            "rule": RULE_NAME,
            "severity": SEVERITY,
            "layer": rows["layer"].astype(str),
            "tensor": rows["tensor"].astype(str),
            "value": rel.astype(np.float64).fillna(np.inf),
            "threshold": float(check.rtol),
            "message": [_message(r, check) for r in rows.itertuples()],
        },
        columns=EVENT_SCHEMA.names,
    )


def scale_mismatch_events(
    df: pd.DataFrame, check: CrossRankCheck | None = None, onset: OnsetFilter | None = None
) -> pd.DataFrame:
    """Events (``schema.EVENT_SCHEMA`` columns) for per-rank rows ``df`` (step, rank, layer, tensor, scale)."""
    check = check or CrossRankCheck()
    empty = pd.DataFrame({n: pd.Series(dtype=object) for n in EVENT_SCHEMA.names})
    if df.empty or not check.enabled or df["rank"].nunique() < 2:
        if onset is not None and not df.empty:
            onset(int(df["step"].max()), ())
        return empty
    mis = mismatches(df, check)
    onset = onset or OnsetFilter(check.repeat)
    keep = np.zeros(len(mis), dtype=bool)
    by_step = {s: idx for s, idx in mis.groupby("step").groups.items()} if len(mis) else {}
    for step in sorted(df["step"].unique().tolist()):
        idx = by_step.get(step)
        rows = mis.loc[idx] if idx is not None else mis.iloc[0:0]
        emit = onset(int(step), [(r.layer, r.tensor, int(r.rank)) for r in rows.itertuples()])
        if idx is not None:
            keep[np.asarray([mis.index.get_loc(i) for i in idx])] = [
                (r.layer, r.tensor, int(r.rank)) in emit for r in rows.itertuples()
            ]
    if not keep.any():
        return empty
    return _to_events(mis[keep], check)


def events_batch(events: pd.DataFrame) -> pa.RecordBatch:
    return pa.RecordBatch.from_pandas(events, schema=EVENT_SCHEMA, preserve_index=False)


def check_from_manifest(manifest: dict) -> CrossRankCheck:
    cfg = ((manifest.get("meta") or {}).get("distributed") or {}).get("cross_rank_check")
    return CrossRankCheck.from_value(cfg if isinstance(cfg, dict) else None)


def cross_rank_scale_mismatch(
    run, groups: Sequence[Sequence[int]] | None = None, roles: Sequence[str] | None = None,
    rtol: float | None = None, repeat: int | None = None,
) -> pd.DataFrame:
    """Offline rule over a run's per-rank rows (``fp8scope.load_run(...)``): events as a DataFrame.

    Defaults come from the check configuration the Monitor stored in ``run.json``, else
    :class:`CrossRankCheck`'s defaults.
    """
    check = check_from_manifest(getattr(run, "manifest", {}) or {})
    if groups is not None:
        check.groups = [list(map(int, g)) for g in groups]
    if roles is not None:
        check.roles = tuple(roles)
    if rtol is not None:
        check.rtol = float(rtol)
    if repeat is not None:
        check.repeat = int(repeat)
    check.enabled = True
    t = run.table("tensors")
    cols = ["step", "rank", "layer", "tensor", "scale"]
    if t.num_rows == 0:
        return scale_mismatch_events(pd.DataFrame(columns=cols), check)
    df = t.select(cols).to_pandas()
    return scale_mismatch_events(df[df["rank"] >= 0], check)
