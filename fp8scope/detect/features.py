"""Feature SQL shared by the offline and online detectors.

``row_features_sql(src)``: per-row derived columns (representable range, saturation ratio,
underflow share, dynamic range, ...) from a tensors table or one step's batch.

``window_features_sql(src, cfg)``: the per-tensor history columns (offline only; the online
detector computes the same columns from rolling state, see online.py). Windows count logged
rows of the tensor, not step numbers, so online and offline agree on runs with gaps.

``group_features_sql(src)``: the cross-layer columns (median / MAD of log2 amax among layers
of the same kind at the same step) used by the ``layer_outlier`` rule.
"""

from __future__ import annotations

from fp8scope.detect.config import DetectConfig

KEY = "key"
MAD_FLOOR_BINADES = 0.1
NUMERIC = ["step", "order", "full", "amax", "min_nonzero", "scale", "scale_inv", "expected_amax", "fp8_max",
           "numel", "zeros", "nonfinite", "overflow", "underflow"]


class KeyMap:
    """Integer ids for (rank, layer, tensor) and for layer kinds, so DuckDB sorts ints, not strings.

    ``narrow(table)`` returns the numeric table the feature SQL reads (``key``, ``rank``,
    ``is_grad``, ``kind``, ``binades`` + NUMERIC columns); ``names(df)`` adds ``layer``,
    ``tensor``, ``fp8_format`` and the kind's name back to the few rows that fired.
    """

    def __init__(self) -> None:
        self.keys: dict[tuple, int] = {}
        self.info: list[tuple] = []  # key -> (rank, layer, tensor, fp8_format, kind_name)
        self.kinds: dict[str, int] = {}
        self.roles: dict[str, int] = {}

    def _kind(self, layer: str) -> int:
        import re

        k = re.sub(r"[0-9]+", "#", layer)
        return self.kinds.setdefault(k, len(self.kinds))

    def narrow(self, t):
        import numpy as np
        import pyarrow as pa

        from fp8scope.formats import get_format

        cols = {c: t[c] for c in NUMERIC}
        # distinct (rank, layer, tensor, fp8_format) combos -> key ids, via a tiny group-by
        combo = t.select(["rank", "layer", "tensor", "fp8_format"]).group_by(
            ["rank", "layer", "tensor", "fp8_format"]).aggregate([])
        for rk, ly, tn, fm in zip(*(combo[c].to_pylist() for c in combo.column_names)):
            if (rk, ly, tn) not in self.keys:
                self.keys[(rk, ly, tn)] = len(self.info)
                self.info.append((rk, ly, tn, fm, self._kind(ly), self.roles.setdefault(tn, len(self.roles))))
        # per row: look the key up through dictionary indices (vectorized)
        lay = t["layer"].combine_chunks().dictionary_encode()
        ten = t["tensor"].combine_chunks().dictionary_encode()
        rank = t["rank"].to_numpy().astype(np.int64)
        ld, td = lay.dictionary.to_pylist(), ten.dictionary.to_pylist()
        li, ti = lay.indices.to_numpy().astype(np.int64), ten.indices.to_numpy().astype(np.int64)
        ranks = np.unique(rank)
        lut = np.full((len(ranks), len(ld), len(td)), -1, dtype=np.int64)
        rpos = {int(r): i for i, r in enumerate(ranks)}
        for (rk, ly, tn), k in self.keys.items():
            if rk in rpos and ly in ld and tn in td:
                lut[rpos[rk], ld.index(ly), td.index(tn)] = k
        ri = np.searchsorted(ranks, rank)
        key = lut[ri, li, ti]
        info = self.info
        kind_of = np.array([i[4] for i in info], dtype=np.int32)
        grad_of = np.array([i[2] == "gradient" for i in info], dtype=bool)
        role_of = np.array([i[5] for i in info], dtype=np.int32)
        bin_of = np.array([_binades(i[3]) for i in info], dtype=float)
        cols.update({
            "key": pa.array(key.astype(np.int32)),
            "rank": t["rank"],
            "kind": pa.array(kind_of[key]),
            "is_grad": pa.array(grad_of[key]),
            "role": pa.array(role_of[key]),
            "binades": pa.array(bin_of[key]),
        })
        return pa.table(cols)

    def names(self, df):
        """Add layer, tensor, fp8_format, kind name columns to rows that carry ``key``."""
        if df is None or df.empty:
            return df
        info = self.info
        kinds = {v: k for k, v in self.kinds.items()}
        k = df["key"].astype(int).tolist()
        return df.assign(layer=[info[i][1] for i in k], tensor=[info[i][2] for i in k],
                         fp8_format=[info[i][3] for i in k], kind=[kinds[info[i][4]] for i in k])


def _binades(fmt) -> float:
    from fp8scope.formats import get_format

    try:
        return get_format(str(fmt)).binades
    except ValueError:
        return float("nan")


def row_features_sql(src: str, cfg: DetectConfig) -> str:
    rate_min = repr(float(cfg.sat_rate_min_ratio))
    return f"""
    select step, rank, key, is_grad, role, kind, binades, "order", "full", amax,
        case when isfinite(amax) then amax end as amax_f,
        min_nonzero, scale, expected_amax, numel, nonfinite, overflow, underflow,
        case when isfinite(scale_inv) and scale_inv > 0 then scale_inv end as scale_inv_f,
        case when isfinite(fp8_max * scale_inv) and fp8_max * scale_inv > 0 then fp8_max * scale_inv end as rng,
        case when isfinite(amax) and isfinite(fp8_max * scale_inv) and fp8_max * scale_inv > 0
             then amax / (fp8_max * scale_inv) end as sat_ratio,
        cast(overflow as double) / nullif(numel, 0) as ovf_frac,
        cast(underflow as double)
            / nullif(numel - coalesce(zeros, 0) - coalesce(nonfinite, 0), 0) as uf_frac,
        case when isfinite(amax) and amax > 0 and min_nonzero > 0 and isfinite(min_nonzero)
             then log2(amax / min_nonzero) end as dr,
        coalesce(not isfinite(amax), false) as bad_amax,
        coalesce(not isfinite(amax), false) or coalesce(nonfinite, 0) > 0 as bad,
        case when isfinite(amax) and amax > 0 and isfinite(expected_amax) then expected_amax / amax end as stale_r,
        case when isfinite(amax) and amax / nullif(fp8_max * scale_inv, 0) >= {rate_min} then 1 else 0 end as sat_hit,
        case when isfinite(amax) and amax > 0 then log2(amax) end as l2
    from {src}
    """


def window_features_sql(src: str, cfg: DetectConfig, rules=()) -> str:
    w, k, r = int(cfg.spike_window), int(cfg.collapse_window), int(cfg.sat_rate_window)
    o = f"partition by {KEY} order by step"
    return f"""
    with _up as (
        select *, scale_inv_f / lag(scale_inv_f) over ({o}) as si_jump from {src}
    )
    select *,
        max(amax_f) over wp as prev_max,
        count(amax_f) over wp as n_prev,
        lag(bad_amax) over wo as prev_bad_amax,
        lag(scale_inv_f) over wo as prev_scale_inv,
        first_value(scale_inv_f) over wc as si_old,
        max(scale_inv_f) over wc as si_max,
        count(scale_inv_f) over wc as n_si,
        max(si_jump) over wu as max_jump,
        sum(sat_hit) over wr as n_sat,
        count(*) over wr as n_rate{_eval_counts(rules)}
    from _up
    window wo as ({o}),
           wp as ({o} rows between {w} preceding and 1 preceding),
           wc as ({o} rows between {k} preceding and current row),
           wu as ({o} rows between {k - 1} preceding and current row),
           wr as ({o} rows between {r - 1} preceding and current row),
           wa as ({o} rows between unbounded preceding and current row)
    """


def _eval_counts(rules) -> str:
    """Per edge rule: running count of evaluable rows (to find the previous evaluable row)."""
    out = ""
    for r in rules:
        out += f",\n        sum(case when ({r.evaluable}) then 1 else 0 end) over wa as rn_{r.name}"
    return out


def group_features_sql(src: str) -> str:
    """Adds n_kind, z, dev (binades above the median of the kind) to every row of ``src``."""
    g = "step, rank, role, kind"
    return f"""
    with _med as (
        select {g}, median(l2) as med, count(l2) as n_kind from {src} group by {g}
    ), _mad as (
        select s.step, s.rank, s.role, s.kind, median(abs(s.l2 - m.med)) as mad
        from {src} s join _med m using ({g}) group by all
    )
    select s.*, m.n_kind, s.l2 - m.med as dev,
        (s.l2 - m.med) / (1.4826 * greatest(coalesce(d.mad, 0), {MAD_FLOOR_BINADES})) as z
    from {src} s left join _med m using ({g}) left join _mad d using ({g})
    """


SCALAR_FEATURES = ("prev_mean", "n_prev", "prev_bad")


def scalar_row_sql(src: str) -> str:
    return f"""
    select step, rank, name, value, case when isfinite(value) then value end as v_f,
        coalesce(not isfinite(value), false) as bad
    from {src}
    """


def scalar_window_sql(src: str, cfg: DetectConfig) -> str:
    lw, gw = int(cfg.loss_window), int(cfg.grad_window)
    o = "partition by rank, name order by step"
    return f"""
    select *,
        case when name = {_q(cfg.grad_norm_name)} then avg(v_f) over wg else avg(v_f) over wl end as prev_mean,
        case when name = {_q(cfg.grad_norm_name)} then count(v_f) over wg else count(v_f) over wl end as n_prev
    from {src}
    where name in ({_q(cfg.loss_name)}, {_q(cfg.grad_norm_name)})
    window wl as ({o} rows between {lw} preceding and 1 preceding),
           wg as ({o} rows between {gw} preceding and 1 preceding)
    """


def _q(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


# ---- the same window features in numpy (offline fast path) ----------------------------------
def _sliding_max(x, w: int):
    """max over the trailing window x[i-w+1 .. i] (van Herk / Gil-Werman, O(n)); -inf = missing."""
    import numpy as np

    n = len(x)
    m = -(-n // w) * w
    xp = np.full(m, -np.inf)
    xp[:n] = x
    b = xp.reshape(-1, w)
    pre = np.maximum.accumulate(b, axis=1).ravel()
    suf = np.maximum.accumulate(b[:, ::-1], axis=1)[:, ::-1].ravel()
    out = pre[:n].copy()
    j = np.arange(n) - w + 1
    ok = j >= 0
    out[ok] = np.maximum(suf[j[ok]], pre[:n][ok])
    return out


def window_features_numpy(key, cols: dict, cfg: DetectConfig, ev: dict):
    """Window features of rows sorted by (key, step), as numpy arrays (semantics of window_features_sql).

    cols: amax_f, scale_inv_f (NaN = NULL), sat_hit (int), bad_amax (bool); ev: rule -> evaluable bool.
    Windows never cross a tensor: each tensor's rows are preceded by ``pad`` missing values.
    """
    import numpy as np

    W, K, R = int(cfg.spike_window), int(cfg.collapse_window), int(cfg.sat_rate_window)
    n = len(key)
    out: dict = {}
    if n == 0:
        return out
    start = np.r_[True, key[1:] != key[:-1]]
    seg = np.cumsum(start) - 1
    seg_start = np.flatnonzero(start)
    rel = np.arange(n) - seg_start[seg]
    pad = max(W, K, R) + 2
    pos = np.arange(n) + (seg + 1) * pad
    size = n + (seg[-1] + 2) * pad

    def padded(v, fill):
        a = np.full(size, fill, dtype=float)
        a[pos] = v
        return a

    def count_window(valid, width, include_current):
        c = np.cumsum(padded(valid.astype(float), 0.0))
        end = pos if include_current else pos - 1
        return (c[end] - c[end - width]).astype(np.int64)

    def max_window(v, width, include_current):
        a = padded(np.where(np.isnan(v), -np.inf, v), -np.inf)
        mx = _sliding_max(a, width)
        r = mx[pos if include_current else pos - 1]
        return np.where(np.isneginf(r), np.nan, r)

    amax_f, si = cols["amax_f"], cols["scale_inv_f"]
    out["prev_max"] = max_window(amax_f, W, False)
    out["n_prev"] = count_window(~np.isnan(amax_f), W, False)
    first = rel == 0
    prev_bad = np.r_[False, cols["bad_amax"][:-1]]
    out["prev_bad_amax"] = (prev_bad, first)  # (values, null mask)
    prev_si = np.r_[np.nan, si[:-1]]
    prev_si[first] = np.nan
    out["prev_scale_inv"] = prev_si
    out["si_old"] = si[np.arange(n) - np.minimum(rel, K)]
    out["si_max"] = max_window(si, K + 1, True)
    out["n_si"] = count_window(~np.isnan(si), K + 1, True)
    with np.errstate(invalid="ignore", divide="ignore"):
        jump = si / prev_si
    out["max_jump"] = max_window(jump, K, True)
    out["n_sat"] = count_window(cols["sat_hit"].astype(bool), R, True)
    out["n_rate"] = np.minimum(rel + 1, R).astype(np.int64)
    for name, e in ev.items():
        c = np.cumsum(e.astype(np.int64))
        base = np.r_[0, c][seg_start][seg]
        out[f"rn_{name}"] = c - base
    return out
