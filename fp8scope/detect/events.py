"""Events as the detectors emit them: one dict per event (EVENT_SCHEMA keys plus ``_order``, the
tensor's execution order for sorting, and ``simulated``, a what-if layer's cast), and their frames
and record batches for the store.

Every rule family (tensor rules, optimizer-side scalar rules, NaN provenance, shadow compares,
cross-rank checks), offline and online, builds its events with :func:`event`, so the report,
``fp8scope events`` and the online log see one shape.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from fp8scope.detect.rules import SEVERITY_RANK
from fp8scope.schema import EVENT_SCHEMA

if TYPE_CHECKING:  # imported where a frame is made: the online child never makes one, and pandas costs its start
    import pandas as pd

EVENT_COLUMNS = list(EVENT_SCHEMA.names)


def empty_events() -> pd.DataFrame:
    return EVENT_SCHEMA.empty_table().to_pandas()


def none_if_nan(v):
    return None if isinstance(v, float) and v != v else v


def rows_of(sub: dict, km) -> list[dict]:
    cols = {k: [none_if_nan(x) for x in v.tolist()] for k, v in sub.items()}
    cols.update(km.names(sub["key"].tolist()))
    names = list(cols)
    return [dict(zip(names, vals)) for vals in zip(*cols.values())]


def is_null(v) -> bool:
    if v is None:
        return True
    pd = sys.modules.get("pandas")  # pandas' missing values exist only once pandas is imported
    if pd is not None and (v is pd.NA or v is pd.NaT):
        return True
    try:
        return isinstance(v, float) and np.isnan(v)
    except TypeError:
        return False


def nan_value(r: dict) -> float:
    n = r.get("nonfinite")
    if n is not None:
        return float(n)
    return float("nan")


def event(r: dict, rule: str, severity: str, value, threshold, message: str, simulated: bool = False) -> dict:
    """One event. ``simulated``: it judges a cast that did not happen (a what-if layer trained in high
    precision): ``on_event`` callbacks see it (a ``Shadow`` starts no BF16 fork for it: the layer already
    is BF16); the stored events say it in their message."""
    return {
        "step": int(r["step"]), "rank": int(r["rank"]), "rule": rule, "severity": severity,
        "layer": r.get("layer") or "", "tensor": r.get("tensor") or "",
        "value": float("nan") if value is None else float(value),
        "threshold": float("nan") if threshold is None else float(threshold),
        "message": message, "_order": int(r.get("order") or 0), "simulated": bool(simulated),
    }


def to_frame(events: list[dict]) -> pd.DataFrame:
    if not events:
        return empty_events()
    import pandas as pd

    df = pd.DataFrame(events)
    df["_sev"] = df["severity"].map(SEVERITY_RANK)
    df = df.sort_values(["step", "rank", "_order", "rule"], kind="stable").reset_index(drop=True)
    df = df[EVENT_COLUMNS]
    return df.astype({"step": "int64", "rank": "int32", "value": "float64", "threshold": "float64"})


def sort_events(events: list[dict]) -> list[dict]:
    """Events in the frame's order (step, rank, execution order, rule), EVENT_COLUMNS keys and ``simulated``."""
    ev = sorted(events, key=lambda e: (e["step"], e["rank"], e["_order"], e["rule"]))
    return [{**{k: e[k] for k in EVENT_COLUMNS}, "simulated": bool(e.get("simulated"))} for e in ev]


def events_batch_from_records(records: list[dict]) -> pa.RecordBatch:
    """Event dicts (EVENT_COLUMNS keys) -> RecordBatch with EVENT_SCHEMA, without pandas."""
    return pa.RecordBatch.from_pylist(records, schema=EVENT_SCHEMA)


def events_batch(df: pd.DataFrame) -> pa.RecordBatch:
    """Events DataFrame -> RecordBatch with EVENT_SCHEMA (for the store)."""
    t = pa.Table.from_pandas(df[EVENT_COLUMNS], schema=EVENT_SCHEMA, preserve_index=False).combine_chunks()
    batches = t.to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=EVENT_SCHEMA)
