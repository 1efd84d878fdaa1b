"""Outlier layers: the ``layer_outlier`` rule's own definition, ranked over the whole run.

The rule (fp8scope/detect/rules.py) compares a tensor's log2 amax with the layers of its kind (same
role, layer name equal up to its numbers) at the same step: ``dev`` = binades above the kind's median,
``z`` = the robust z-score (MAD-based, :func:`fp8scope.detect.features.group_features`). This view
computes the same two numbers with the same function, per step bucket of the rollup (per step for runs
of up to ``MAX_POINTS`` steps; the bucket's largest amax otherwise), and keeps each tensor's worst.
A tensor's first bucket has no history (a delayed scale from nothing, step 0's scale of 1) and is
labelled, not scored; buckets inside the rule's warm-up can reach "info" only, as in the rule.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from dashboard.rollup import NoData, _reduce, rollup
from dashboard.runcache import Entry
from fp8scope.detect.config import DetectConfig
from fp8scope.detect.features import group_features
from fp8scope.schema import base_role

SCORE_DOC = (
    "Ranked as the layer_outlier rule judges: z = robust z-score of log2(amax) among the layers of the same kind "
    "and role at the same step, dev = binades above their median; score = min(z / {oz:g}, dev / {ob:g}), how far "
    "past both of the rule's thresholds the tensor's worst step went (>= 1: the rule fires; needs >= {om} peers). "
    "Tensors the rule raises to 'warning' (a forward tensor >= {ow:g} binades above its peers, past warm-up) come "
    "first; then forward tensors (activations, weights) before gradients, whose distance from their peers the rule "
    "treats as info only: a gradient outlier is usually the echo of a forward one in the same block, and the first "
    "block's gradients sit far above the others' in healthy runs (pick the gradient role to rank them alone). "
    "Each tensor's first logged step has no history and is not scored."
)


def score_doc(cfg: DetectConfig | None = None) -> str:
    cfg = cfg or DetectConfig()
    return SCORE_DOC.format(ow=cfg.outlier_warn_binades, oz=cfg.outlier_z, ob=cfg.outlier_min_binades,
                            om=cfg.outlier_min_layers)


def outliers(e: Entry, role: str | None = None, limit: int = 200, events: pd.DataFrame | None = None,
             cfg: DetectConfig | None = None) -> pd.DataFrame:
    """Tensors ranked by the layer_outlier rule's severity, then its z-score (see :data:`SCORE_DOC`)."""
    if not e.has("tensors"):
        raise NoData("no tensors table in this run yet")
    cfg = cfg or DetectConfig()
    ev_key = None if events is None else len(events)
    return e.cached(("outliers", role, limit, ev_key), lambda: _outliers(e, role, limit, events, cfg), rollup=True)


def _outliers(e: Entry, role: str | None, limit: int, events: pd.DataFrame | None, cfg: DetectConfig) -> pd.DataFrame:
    r = rollup(e)
    a = r.a
    nt = len(r.layer)
    kinds: dict[tuple, int] = {}
    group_of = np.array([kinds.setdefault((r.role[t], re.sub(r"[0-9]+", "#", r.layer[t])), len(kinds))
                         for t in range(nt)], np.int64)
    is_grad = np.array([base_role(x) == "gradient" for x in r.role], bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        am = a["amax_fmax"]
        l2 = np.where(np.isfinite(am) & (am > 0), np.log2(np.where(am > 0, am, 1.0)), np.nan)
    c = {"l2": l2, "step": a["b"].astype(np.int64), "key": a["tid"].astype(np.int64)}
    group_features(c, group_of)
    tid, b = a["tid"], a["b"]
    first_b = np.full(nt, np.iinfo(np.int64).max)
    np.minimum.at(first_b, tid, b)
    age = (b - first_b[tid]) * r.g  # rows of history before the bucket (per step: exact)
    scored = age > 0
    fires = scored & (c["n_kind"] >= cfg.outlier_min_layers) & (c["z"] >= cfg.outlier_z) & (c["dev"] >= cfg.outlier_min_binades)
    warn = fires & (c["dev"] >= cfg.outlier_warn_binades) & ~is_grad[tid] & (age >= cfg.warmup_rows)
    sev = np.where(warn, 2, np.where(fires, 1, 0))
    keep = np.isin(tid, [t for t in range(nt) if role is None or r.role[t] == role])
    rows = np.flatnonzero(keep)
    rows = rows[np.lexsort((b[rows], tid[rows]))]
    if not len(rows):
        return pd.DataFrame(columns=["layer", "tensor", "score", "z", "dev", "step", "severity"])
    t = tid[rows]
    st = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
    ends = np.r_[st[1:], len(rows)]
    # how far past the rule's two thresholds (z and binades) the row is: >= 1 where the rule fires. A bare z
    # would rank a 0.5-binade wobble among tightly packed peers (MAD floor) above a 4-binade outlier
    with np.errstate(invalid="ignore"):
        margin = np.fmin(c["z"] / cfg.outlier_z, c["dev"] / cfg.outlier_min_binades)
    margin = np.where(c["n_kind"] >= cfg.outlier_min_layers, margin, np.nan)
    zs = np.where(scored[rows] & np.isfinite(margin[rows]), margin[rows], -np.inf)
    out = []
    for s0, s1 in zip(st, ends):
        seg = rows[s0:s1]
        k = int(np.argmax(zs[s0:s1]))
        best = seg[k]
        has = np.isfinite(zs[s0 + k])
        step = int(a["amax_step"][best]) if has and a["amax_step"][best] >= 0 else None
        out.append({"layer": r.layer[t[s0]], "tensor": r.role[t[s0]], "ord": r.ord[t[s0]],
                    "severity": ("-", "info", "warning")[int(sev[seg].max())],
                    "score": float(margin[best]) if has else np.nan, "z": float(c["z"][best]) if has else np.nan, "dev": float(c["dev"][best]) if has else np.nan,
                    "peers": int(c["n_kind"][best]) if has else 0, "step": step,
                    "first_step": int(a["smin"][seg].min())})
    df = pd.DataFrame(out)
    red = lambda fn, k: _reduce(fn, a[k][rows], st)  # noqa: E731
    # the context columns skip each tensor's first bucket too (step 0's initial scale underflows by design)
    later = lambda k: np.where(scored[rows], a[k][rows], np.nan)  # noqa: E731
    df["max_amax"] = red(np.fmax, "amax_fmax")
    df["min_headroom"] = _reduce(np.fmin, later("headroom_w"), st)
    df["underflow_pct"] = _reduce(np.fmax, later("underflow_pct_w"), st)
    df["saturated_pct"] = _reduce(np.fmax, later("saturated_pct_w"), st)
    df["nonfinite"] = red(np.add, "nf_sum")
    df["critical"] = df["warning"] = 0
    if events is not None and not events.empty:
        ev = events.assign(tensor=events["tensor"].fillna(""))
        g = ev.groupby(["layer", "tensor", "severity"]).size().unstack(fill_value=0)
        key = pd.MultiIndex.from_arrays([df["layer"], df["tensor"]])
        for s in ("critical", "warning"):
            if s in g:
                df[s] = g[s].reindex(key).fillna(0).to_numpy(int)
    df["_s"] = (df["severity"] == "warning").astype(int)
    df["_g"] = df["tensor"].map(lambda x: base_role(x) == "gradient")
    df = df.sort_values(["_s", "_g", "score", "ord"], ascending=[False, True, False, True], na_position="last")
    return df.drop(columns=["_s", "_g"]).head(limit).reset_index(drop=True)
