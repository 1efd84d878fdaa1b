"""Features shared by the offline and online detectors, in numpy (no DuckDB, no pandas).

A *feature row* is one tensor at one logged step: its own statistics with derived columns
(:func:`row_features`: representable range, saturation ratio, underflow share, dynamic range...),
its history (window columns: :func:`window_features_numpy`, over slices of a run carried by
:class:`WindowCarry`, offline and online alike; windows count logged rows of the tensor, not
step numbers, so online and offline agree on runs with gaps) and its layer kind at the same
step (:func:`group_features`: median / MAD of log2 amax, for ``layer_outlier``).

Columns are numpy arrays in a dict; a float column holds NaN where the value is missing
(SQL NULL). The rules (:mod:`fp8scope.detect.rules`) are functions of such a dict.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from fp8scope import derived
from fp8scope.detect.config import DetectConfig
from fp8scope.detect.design_loss import FP8, recipe_of
from fp8scope.detect.design_loss import floors as floors_of
from fp8scope.schema import base_role, simulated_casts

MAD_FLOOR_BINADES = 0.1
# columns of the tensors table the detector reads
TENSOR_COLUMNS = [
    "step", "rank", "layer", "tensor", "order", "fp8_format", "amax", "min_nonzero", "scale", "scale_inv",
    "expected_amax", "fp8_max", "numel", "zeros", "nonfinite", "overflow", "underflow", "underflow_deep",
    "below_normal", "source",
    "recipe",
]


class KeyMap:
    """Integer ids for (rank, layer, tensor) and for layer kinds / roles.

    ``keys_of(table)`` returns the key id of every row (vectorized through dictionary indices;
    the online detector's batches usually repeat the previous step's names, which is cached);
    ``info[key]`` is (rank, layer, tensor, fp8_format, kind id, role id).
    """

    def __init__(self) -> None:
        self.keys: dict[tuple, int] = {}
        self.info: list[tuple] = []
        self.sources: list[str | None] = []  # per key: the row's source (emulated, whatif, te, torchao, ...)
        self.recipes: list[str | None] = []  # per key: the recipe kind its scales come from (None: not logged)
        self.kinds: dict[str, int] = {}
        self.roles: dict[str, int] = {}
        self.kind_names: list[str] = []
        self._kind_of = np.zeros(0, np.int32)
        self._role_of = np.zeros(0, np.int32)
        self._grad_of = np.zeros(0, bool)
        self._bin_of = np.zeros(0, float)
        self._block_of = np.zeros(0, bool)  # per key: scaled per block of values, not per tensor
        # per key: a what-if layer's tensor in a run whose other layers run FP8 (its casts are simulated)
        self.simulated = np.zeros(0, bool)
        self._designs: list[str] = []  # per key: design_loss.recipe_of (a block recipe's kind, or FP8)
        self._uf_floor = np.zeros(0, float)  # per key: what its recipe may lose by design (detect.design_loss)
        self._ovf_floor = np.zeros(0, float)
        self._peer_fmt: list[str | None] = []  # per key: the format most tensors of its (rank, role) use
        self._peer_n = np.zeros(0, np.int64)  # ... and how many do
        self._odd_fmt = np.zeros(0, bool)
        self._peer_bin = np.zeros(0, float)
        self.group_of = np.zeros(0, np.int64)  # key -> id of its (rank, role, kind)
        self._groups: dict[tuple, int] = {}
        self._last = None

    def _kind(self, layer: str) -> int:
        k = re.sub(r"[0-9]+", "#", layer)
        if k not in self.kinds:
            self.kinds[k] = len(self.kinds)
            self.kind_names.append(k)
        return self.kinds[k]

    def _add(self, rk: int, ly: str, tn: str, fm, source=None, recipe=None) -> int:
        k = self.keys.get((rk, ly, tn))
        if k is None:
            k = self.keys[(rk, ly, tn)] = len(self.info)
            self.info.append((rk, ly, tn, fm, self._kind(ly), self.roles.setdefault(tn, len(self.roles))))
            self.sources.append(source)
            self.recipes.append(recipe)
        return k

    def keys_of(self, t) -> np.ndarray:
        rank, lay, ten, fmt = (t.column(c) for c in ("rank", "layer", "tensor", "fp8_format"))
        last = self._last
        if (last is not None and type(last[0]) is type(rank)  # a Table's chunked columns or a batch's arrays
                and last[0].equals(rank) and last[1].equals(lay) and last[2].equals(ten)):
            return last[3]
        n0 = len(self.info)
        r = rank.to_numpy(zero_copy_only=False).astype(np.int64)
        li, ld = _dict(lay)
        ti, td = _dict(ten)
        ranks = np.unique(r)
        ri = np.searchsorted(ranks, r)
        code = (ri * len(ld) + li) * max(len(td), 1) + ti
        size = len(ranks) * len(ld) * max(len(td), 1)
        if size <= 4 * len(code) + 1_000_000:
            first = np.full(size, -1, np.int64)
            first[code[::-1]] = np.arange(len(code) - 1, -1, -1)  # first row of each combination
            combos = np.flatnonzero(first >= 0)
            rows = first[combos]
            lut = np.full(size, -1, np.int64)
        else:
            combos, rows = np.unique(code, return_index=True)
            lut = None
        fmts = fmt.take(pa.array(rows)).to_pylist() if len(rows) else []
        names = t.schema.names
        # what-if rows are simulated casts, not a layer's real format: no peers in format_mismatch
        srcs, recs = ((t.column(n).take(pa.array(rows)).to_pylist() if n in names and len(rows) else [None] * len(rows))
                      for n in ("source", "recipe"))
        lds, tds = ld.to_pylist(), td.to_pylist()
        ids = np.array([self._add(int(ranks[c // (len(ld) * max(len(td), 1))]), lds[(c // max(len(td), 1)) % len(ld)],
                                  tds[c % max(len(td), 1)], fm, sr, rc)
                        for c, fm, sr, rc in zip(combos.tolist(), fmts, srcs, recs)], np.int64)
        if lut is not None:
            lut[combos] = ids
            key = lut[code]
        else:
            key = ids[np.searchsorted(combos, code)]
        if len(self.info) > n0:
            info = self.info
            self._kind_of = np.array([i[4] for i in info], np.int32)
            self._role_of = np.array([i[5] for i in info], np.int32)
            self._grad_of = np.array([base_role(i[2]) == "gradient" for i in info], bool)
            designs = self._designs = [recipe_of(i[3], rc) for i, rc in zip(info, self.recipes)]
            self._block_of = np.array([d != FP8 for d in designs], bool)
            self._bin_of = np.array([_binades(i[3]) if d == FP8 else np.nan for i, d in zip(info, designs)], float)
            # what the key's recipe may lose by design (NVFP4's E2M1, MXFP8 with FLOOR scales;
            # detect.design_loss): the underflow and overflow rules start there
            floors = [floors_of(d, base_role(i[2])) for i, d in zip(info, designs)]
            self._uf_floor = np.array([f[0] for f in floors], float)
            self._ovf_floor = np.array([f[1] for f in floors], float)
            self._peer_formats()
            self.simulated = np.array(simulated_casts(self.sources), bool)
            self.group_of = np.array([self._groups.setdefault((i[0], i[5], i[4]), len(self._groups)) for i in info],
                                     np.int64)
        self._last = (rank, lay, ten, key)
        return key

    def _peer_formats(self) -> None:
        """Per key, the FP8 format most tensors of the same rank and base role use (a gradient cast in E4M3
        where every other gradient is E5M2 is a misconfigured layer, not a recipe choice)."""
        from collections import Counter

        groups: dict[tuple, Counter] = {}
        # what-if rows are simulated casts, and a block recipe's formats are its own choice (MXFP8 casts
        # gradients to E4M3 beside per-tensor layers' E5M2): neither is a peer nor odd
        fmts = [str(i[3]).lower() if i[3] and src != "whatif" and not blk else None
                for i, src, blk in zip(self.info, self.sources, self._block_of)]
        roles = [base_role(i[2]) for i in self.info]
        for i, f, r in zip(self.info, fmts, roles):
            if f is not None:
                groups.setdefault((i[0], r), Counter())[f] += 1
        peer, n = [], []
        for i, r in zip(self.info, roles):
            c = groups.get((i[0], r))
            top = c.most_common(1)[0] if c else (None, 0)
            peer.append(top[0])
            n.append(top[1])
        self._peer_fmt, self._peer_n = peer, np.array(n, np.int64)
        fp8 = ("e4m3", "e5m2")  # only the two FP8 formats: a deliberate NVFP4 / MXFP4 layer is a recipe choice
        self._odd_fmt = np.array([f in fp8 and p in fp8 and f != p for f, p in zip(fmts, peer)], bool)
        self._peer_bin = np.array([_binades(p) if p else np.nan for p in peer], float)

    def names(self, keys) -> dict:
        """layer, tensor, fp8_format, recipe and kind name of each key (for the few rows that fire); the
        recipe is the logged kind, or the block recipe a format implies in runs logged before it."""
        info = self.info
        return {"layer": [info[k][1] for k in keys], "tensor": [info[k][2] for k in keys],
                "fp8_format": [info[k][3] for k in keys],
                "recipe": [self.recipes[k] or (self._designs[k] if self._designs[k] != FP8 else None) for k in keys],
                "kind": [self.kind_names[info[k][4]] for k in keys], "peer_format": [self._peer_fmt[k] for k in keys]}


def _dict(col):
    """(indices as int64 numpy, dictionary) of a string column (plain or dictionary-encoded)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not pa.types.is_dictionary(col.type):
        col = col.dictionary_encode()
    return col.indices.to_numpy(zero_copy_only=False).astype(np.int64), col.dictionary


def _binades(fmt) -> float:
    """The binades one scale of ``fmt`` covers; NaN for a block recipe's format (NVFP4's E2M1: each
    block of 16 has its own scale, so a tensor's range says nothing about it)."""
    from fp8scope.formats import get_format

    if recipe_of(fmt, None) != FP8:
        return float("nan")
    try:
        return get_format(str(fmt)).binades
    except ValueError:
        return float("nan")


def floats(col) -> np.ndarray:
    """Arrow column -> float64 numpy, NaN for nulls (Arrow's own conversion of a column with nulls
    gives NaN directly: no cast + fill_null pass over the column first)."""
    return col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


class NumpyColumns:
    """Column getter over whole-table numpy columns (``cols``, ``nulls``: name -> null mask), taking ``rows``:
    ``get(name)`` -> float64 (NaN for nulls), ``ints(name)``, ``present(name)``."""

    def __init__(self, cols: dict, nulls: dict, rows: np.ndarray):
        self.cols, self.nulls, self.rows = cols, nulls, rows

    def get(self, name: str) -> np.ndarray:
        return self.cols[name][self.rows]

    ints = get

    def present(self, name: str):
        m = self.nulls.get(name)
        return True if m is None else ~m[self.rows]


def row_features(src: NumpyColumns, key: np.ndarray, km: KeyMap, cfg: DetectConfig) -> dict:
    """Per-row feature columns of the rows ``src`` selects, whose key ids are ``key``."""
    get = src.get
    c: dict = {"key": key}
    c["step"] = src.ints("step")
    c["rank"] = src.ints("rank")
    c["order"] = get("order")
    amax = get("amax")
    c["amax"] = amax
    for n in ("min_nonzero", "scale", "expected_amax", "numel", "nonfinite"):
        c[n] = get(n)
    c["kind"] = km._kind_of[key]
    c["role"] = km._role_of[key]
    c["is_grad"] = km._grad_of[key]
    c["binades"] = km._bin_of[key]
    c["block"] = km._block_of[key]
    c["uf_floor"] = km._uf_floor[key]
    c["ovf_floor"] = km._ovf_floor[key]
    c["fmt_odd"] = km._odd_fmt[key]
    c["peer_n"] = km._peer_n[key]
    c["peer_binades"] = km._peer_bin[key]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        fin = np.isfinite(amax)
        si = get("scale_inv")
        c["scale_inv_f"] = np.where(np.isfinite(si) & (si > 0), si, np.nan)
        c["amax_f"] = np.where(fin, amax, np.nan)
        c["rng"] = derived.representable(get)
        c["sat_ratio"] = derived.amax_over_range(get)
        c["ovf_frac"] = derived.overflow_fraction(get)
        c["uf_frac"] = derived.underflow_fraction(get)
        c["uf_count"] = get("underflow")
        c["uf_shallow"] = derived.shallow_underflow_fraction(get)
        c["uf_deep_share"] = derived.deep_underflow_share(get)
        c["uf_below_normal"] = derived.below_normal_fraction(get)
        c["ovf_count"] = get("overflow")
        mn = c["min_nonzero"]
        pos = fin & (amax > 0)
        c["dr"] = np.where(pos & (mn > 0) & np.isfinite(mn), np.log2(amax / mn), np.nan)
        c["bad_amax"] = ~fin & src.present("amax")
        c["bad"] = c["bad_amax"] | (_z(c["nonfinite"]) > 0)
        ea = c["expected_amax"]
        c["stale_r"] = np.where(pos & np.isfinite(ea), ea / amax, np.nan)
        c["sat_hit"] = (c["sat_ratio"] >= float(cfg.sat_rate_min_ratio)).astype(np.int64)  # NaN: no hit
        c["l2"] = np.where(pos, np.log2(amax), np.nan)
    return c


def _z(x):
    return np.where(np.isnan(x), 0.0, x)


# ---- small array idioms of sorted keys (np.r_ costs more than the arrays it builds here) -------
def starts_of(key: np.ndarray) -> np.ndarray:
    """True at the first row of each run of equal keys."""
    out = np.empty(len(key), bool)
    if len(key):
        out[0] = True
        np.not_equal(key[1:], key[:-1], out=out[1:])
    return out


def ends_of(key: np.ndarray) -> np.ndarray:
    """True at the last row of each run of equal keys."""
    out = np.empty(len(key), bool)
    if len(key):
        out[-1] = True
        np.not_equal(key[1:], key[:-1], out=out[:-1])
    return out


def shifted(x: np.ndarray, fill) -> np.ndarray:
    """``x`` one place later: ``[fill, x[0], ..., x[-2]]``."""
    out = np.empty(len(x), np.result_type(x, fill))
    if len(x):
        out[0] = fill
        out[1:] = x[:-1]
    return out


def appended(a: np.ndarray, tail) -> np.ndarray:
    """``a`` followed by ``tail`` (a value or an array)."""
    return np.concatenate([a, np.atleast_1d(np.asarray(tail, dtype=a.dtype))])


def group_features(c: dict, group_of_key: np.ndarray) -> None:
    """Adds n_kind (layers of the kind with an amax), dev (binades above the kind's median) and z
    (robust z-score) to ``c``; groups are (step, rank, role, kind), ``group_of_key`` maps a tensor
    key to its (rank, role, kind) id (:attr:`KeyMap.group_of`)."""
    l2 = c["l2"]
    n = len(l2)
    has = ~np.isnan(l2)
    ok = np.flatnonzero(has)
    if not len(ok):
        c["n_kind"], c["dev"], c["z"] = np.zeros(n, np.int64), np.full(n, np.nan), np.full(n, np.nan)
        return
    step = c["step"][ok]
    gk = group_of_key[c["key"][ok]].astype(np.int64)
    code = (step - step.min()) * (int(gk.max()) + 1) + gk
    o = np.argsort(code, kind="stable")
    code, v, ok = code[o], l2[ok][o], ok[o]
    start = np.flatnonzero(starts_of(code))
    cnt = np.diff(appended(start, len(code)))
    G = len(start)
    g = np.repeat(np.arange(G), cnt)
    lo, hi = (cnt - 1) // 2, cnt // 2
    mx = int(cnt.max())
    if G * mx <= 4 * len(v) + 1_000_000:  # groups as rows of a matrix, sorted row by row
        slot = np.arange(len(v)) - start[g]
        rg = np.arange(G)

        def medians(x):
            m = np.full((G, mx), np.inf)
            m[g, slot] = x
            m.sort(axis=1)
            return (m[rg, lo] + m[rg, hi]) / 2
    else:
        def medians(x):
            y = x[np.lexsort((x, g))]
            return (y[start + lo] + y[start + hi]) / 2
    med = medians(v)
    mad = medians(np.abs(v - med[g]))
    # per row through its group id: one scatter, then lookups in the small per-group arrays (rows
    # without an amax have l2 NaN, so their dev and z come out NaN whatever group id they hold)
    gid = np.zeros(n, np.int64)
    gid[ok] = g
    c["n_kind"] = np.where(has, cnt[gid], 0)
    c["dev"] = l2 - med[gid]
    c["z"] = c["dev"] / (1.4826 * np.maximum(mad, MAD_FLOOR_BINADES))[gid]


# ---- window features -------------------------------------------------------------------------
class _Padded:
    """Rows sorted by key laid out in one array with ``pad`` missing values before each key's rows, so
    that windows (sliding max, running counts) over the array never reach into another key; the
    features are wanted for every row.

    When every key has the same number of rows (a run logging the same tensors every step) the layout
    is a (keys, pad + rows) matrix and placing and shifting are slice copies instead of fancy indexing,
    ~3x cheaper."""

    def __init__(self, key: np.ndarray, pad: int):
        n = len(key)
        start = starts_of(key)
        seg = np.cumsum(start) - 1
        seg_start = np.flatnonzero(start)
        self.rel = np.arange(n) - seg_start[seg]  # each wanted row's place within its key
        self.rows = np.arange(n)  # the wanted rows (all of them)
        self.pad, n_keys = pad, len(seg_start)
        counts = np.diff(appended(seg_start, n))
        self.grid = (n_keys, int(counts[0])) if (counts == counts[0]).all() else None
        if self.grid is None:
            self.pos = np.arange(n) + (seg + 1) * pad
            self.size = n + (n_keys + 1) * pad

    def mine(self, v: np.ndarray) -> np.ndarray:
        return v

    def _place(self, v: np.ndarray, fill: float) -> np.ndarray:
        """``v`` (one value per row) in the padded layout, ``fill`` in the gaps."""
        if self.grid is None:
            a = np.full(self.size, fill, dtype=float)
            a[self.pos] = v
            return a
        keys, rows = self.grid
        a = np.full((keys, self.pad + rows), fill, dtype=float)
        a[:, self.pad:] = v.reshape(keys, rows)
        return a.reshape(-1)

    def _take(self, a: np.ndarray, shift: int) -> np.ndarray:
        """The values of the padded array ``a`` ``shift`` (< pad) places before each row."""
        if self.grid is None:
            return a[self.pos - shift]
        keys, rows = self.grid
        return a.reshape(keys, self.pad + rows)[:, self.pad - shift:self.pad - shift + rows].reshape(-1)

    def before(self, v: np.ndarray, shift: int) -> np.ndarray:
        """Each wanted row's value ``shift`` rows earlier in its key (NaN where there is none)."""
        return np.where(self.rel >= shift, self._take(self._place(v, np.nan), shift), np.nan)

    def max_window(self, v: np.ndarray, width: int, include_current: bool) -> np.ndarray:
        a = self._place(np.where(np.isnan(v), -np.inf, v), -np.inf)
        return _no_neginf(self._take(_sliding_max(a, width), 0 if include_current else 1))

    def count_window(self, valid: np.ndarray, width: int, include_current: bool) -> np.ndarray:
        c = np.cumsum(self._place(valid.astype(float), 0.0))
        shift = 0 if include_current else 1
        return (self._take(c, shift) - self._take(c, shift + width)).astype(np.int64)


class _Tail:
    """The same windows for only the last ``tail`` rows of each key, when every key has ``rows`` rows
    (the online detector: a tensor's carried rows and one new step). Each window is reduced where it
    lies in the (keys, rows) matrix: keys x tail x width values, against the padded layout's log2(width)
    passes over every row, so only a few wanted rows per key make it the cheaper one
    (:func:`window_features_numpy` picks)."""

    def __init__(self, keys: int, rows: int, tail: int):
        self.shape, self.tail = (keys, rows), tail
        cols = np.arange(rows - tail, rows)
        self.rel = np.tile(cols, keys)
        self.rows = (np.arange(keys)[:, None] * rows + cols).reshape(-1)

    def mine(self, v: np.ndarray) -> np.ndarray:
        return v.reshape(self.shape)[:, -self.tail:].reshape(-1)

    def before(self, v: np.ndarray, shift: int) -> np.ndarray:
        """Each wanted row's value ``shift`` rows earlier in its key (NaN where there is none)."""
        return np.where(self.rel >= shift, v[np.maximum(self.rows - shift, 0)], np.nan)

    def _reduce(self, v: np.ndarray, width: int, include_current: bool, fill, ufunc) -> np.ndarray:
        """``ufunc`` reduced over each wanted row's window, ``fill`` standing for rows before a key's first."""
        keys, rows = self.shape
        off = 0 if include_current else 1
        lo, hi = rows - self.tail - off - width + 1, rows - off
        m = v.reshape(keys, rows)[:, max(lo, 0):max(hi, 0)]
        if lo < 0:
            m = np.concatenate([np.full((keys, max(-lo, 0) - max(-hi, 0)), fill, dtype=m.dtype), m], axis=1)
        cols = [ufunc.reduce(m[:, i:i + width], axis=1) for i in range(self.tail)]
        return (cols[0] if self.tail == 1 else np.stack(cols, axis=1)).reshape(-1)

    def max_window(self, v: np.ndarray, width: int, include_current: bool) -> np.ndarray:
        return _no_neginf(self._reduce(np.where(np.isnan(v), -np.inf, v), width, include_current, -np.inf, np.maximum))

    def count_window(self, valid: np.ndarray, width: int, include_current: bool) -> np.ndarray:
        return self._reduce(valid.astype(np.int64), width, include_current, 0, np.add)


def _no_neginf(r: np.ndarray) -> np.ndarray:
    return np.where(np.isneginf(r), np.nan, r)


def _sliding_max(x, w: int):
    """max over the trailing window x[i-w+1 .. i] (-inf = missing; rows before the start count as missing).

    By doubling: after k rounds m[i] is the max of the 2^k values ending at i, and a window of w is the
    max of two overlapping power-of-two windows. log2(w) passes of contiguous maxima: ~3x faster than
    the block prefix/suffix scans (van Herk / Gil-Werman) numpy can only do as strided accumulates."""
    m, span = x, 1
    while 2 * span <= w:
        wider = m.copy()
        np.maximum(m[span:], m[:-span], out=wider[span:])
        m, span = wider, 2 * span
    rest = w - span
    out = m.copy()
    if rest:
        np.maximum(m[rest:], m[:-rest], out=out[rest:])
    return out


def window_features_numpy(key, cols: dict, cfg: DetectConfig, tail: int | None = None) -> dict:
    """Window features of rows sorted by (key, step), as numpy arrays: prev_max / n_prev (previous
    spike_window rows; n_prev counts those with data, amax > 0), prev_bad_amax, prev_scale_inv, si_old / si_max / n_si (last collapse_window + 1
    rows), max_jump (largest one-step rise of scale_inv over the last collapse_window rows), n_sat /
    n_rate (last sat_rate_window rows), dev_old / dev_jump (trend_window rows).

    cols: amax_f, scale_inv_f (NaN = missing), sat_hit (int), bad_amax (bool), dev.
    Windows never cross a tensor. ``tail``: every key has the same number of rows and only the features
    of each key's last ``tail`` rows are wanted (returned in that order); otherwise every row's.
    """
    W, K, R, T = int(cfg.spike_window), int(cfg.collapse_window), int(cfg.sat_rate_window), int(cfg.trend_window)
    n = len(key)
    out: dict = {}
    if n == 0:
        return out
    pad = max(W, K, R, T) + 2
    start = starts_of(key)
    keys = int(np.count_nonzero(start))
    if tail is not None and tail * pad <= 4 * (n // keys):  # a few wanted rows per key: their windows alone
        lay = _Tail(keys, n // keys, tail)
    else:
        lay = _Padded(key, pad)
    rel, rows, mine = lay.rel, lay.rows, lay.mine

    def prev_rows(v, fill):  # each row's previous row of its key (every row: windows are taken over it)
        p = shifted(v, fill)
        p[start] = fill
        return p

    amax_f, si, dev = cols["amax_f"], cols["scale_inv_f"], cols["dev"]
    out["prev_max"] = lay.max_window(amax_f, W, False)
    # rows with data (amax > 0): an idle MoE expert's rows (no token: amax 0) are no history to judge a
    # spike or a warm-up by (a clean Qwen3-MoE's rarely routed experts "spiked" 17-1,000x over the one or
    # two steps in a hundred they got tokens)
    out["n_prev"] = lay.count_window(amax_f > 0, W, False)
    out["prev_bad_amax"] = mine(prev_rows(cols["bad_amax"], False))
    prev_si = prev_rows(si, np.nan)
    out["prev_scale_inv"] = mine(prev_si)
    out["si_old"] = si[rows - np.minimum(rel, K)]
    out["si_max"] = lay.max_window(si, K + 1, True)
    out["n_si"] = lay.count_window(~np.isnan(si), K + 1, True)
    with np.errstate(invalid="ignore", divide="ignore"):
        jump = si / prev_si
    out["max_jump"] = lay.max_window(jump, K, True)
    out["n_sat"] = lay.count_window(cols["sat_hit"].astype(bool), R, True)
    out["n_rate"] = np.minimum(rel + 1, R).astype(np.int64)
    # amax_trend: this tensor's distance above its kind's median (dev, binades) now against T rows ago,
    # and the largest one-row rise of it over those rows (a steady climb, not one jump)
    out["dev_old"] = lay.before(dev, T)
    out["dev_jump"] = lay.max_window(dev - prev_rows(dev, np.nan), T, True)
    if tail is not None and isinstance(lay, _Padded):  # every row's features: keep the wanted ones
        out = {k: v.reshape(keys, -1)[:, -tail:].reshape(-1) for k, v in out.items()}
    return out


class RunMax:
    """Per tensor, the largest finite amax of every row before this one, over the whole run (slices and
    online batches carry it in one float per tensor). What ``scale_mismatch`` compares a scale with:
    a delayed scale may legitimately come from an amax older than any window (TE keeps 1,024 steps of
    history), never from one the tensor never had."""

    def __init__(self) -> None:
        self.best = np.zeros(0)

    def before(self, key: np.ndarray, amax_f: np.ndarray) -> np.ndarray:
        """For rows sorted by (key, step) coming after every row seen so far: the max amax of each
        tensor's earlier rows (NaN where there is none); then remembers these rows."""
        n = len(key)
        if n == 0:
            return np.zeros(0)
        top = int(key.max()) + 1
        if len(self.best) < top:
            self.best = appended(self.best, np.full(top - len(self.best), -np.inf))
        start = starts_of(key)
        seg = np.cumsum(start) - 1
        # a segmented running max: log2 values shifted by segment so one accumulate never crosses tensors
        with np.errstate(divide="ignore", invalid="ignore"):
            lv = np.where(np.isfinite(amax_f) & (amax_f > 0), np.log2(amax_f), -1e4)
        shift = seg * 1e5
        run = np.maximum.accumulate(lv + shift) - shift
        prev = shifted(run, -np.inf)
        prev[start] = -np.inf
        with np.errstate(over="ignore"):
            mine = np.where(prev > -1e3, np.exp2(prev), -np.inf)
        out = np.fmax(mine, self.best[key])
        last = np.flatnonzero(ends_of(key))
        self.best[key[last]] = np.fmax(self.best[key[last]], np.where(run[last] > -1e3, np.exp2(run[last]), -np.inf))
        return np.where(np.isneginf(out), np.nan, out)


class WindowCarry:
    """Window features of a run read slice by slice (rows in step order, a slice of whole steps at a time)
    equal to :func:`window_features_numpy` over the whole run, in memory bounded by the slice.

    Between slices it keeps each tensor's last ``keep`` rows of the window inputs; no window reaches further
    back (spike_window / sat_rate_window rows, collapse_window + 1 for the scale), so a slice's rows see the
    same history as in one pass over the run.
    """

    INPUTS = ("amax_f", "scale_inv_f", "sat_hit", "bad_amax", "dev")

    def __init__(self, cfg: DetectConfig):
        self.cfg = cfg
        self.keep = max(int(cfg.spike_window), int(cfg.collapse_window) + 1, int(cfg.sat_rate_window),
                        int(cfg.trend_window) + 1) + 1
        self.key = np.zeros(0, np.int64)
        self.cols: dict = {}
        self._grid: tuple[np.ndarray, int] | None = None  # _grid_of(self.key)

    def features(self, key: np.ndarray, cols: dict) -> dict:
        """Window features of rows sorted by (key, step) that come after every row seen so far."""
        cols = {c: cols[c] for c in self.INPUTS}
        old, new = self._grid, _grid_of(key)
        if not len(self.key):
            mkey, mcols, out = key, cols, window_features_numpy(key, cols, self.cfg)
            grid = new
        elif old is not None and new is not None and np.array_equal(old[0], new[0]):
            mkey, mcols = self._stack(old[1], new[1], key, cols)
            out = window_features_numpy(mkey, mcols, self.cfg, tail=new[1])  # only the new rows' features
            grid = (new[0], old[1] + new[1])
        else:
            mkey, mcols, mine = self._merge(key, cols)
            out = {k: mine(v) for k, v in window_features_numpy(mkey, mcols, self.cfg).items()}
            grid = _grid_of(mkey)
        self._keep_tail(mkey, mcols, grid)
        return out

    def _stack(self, n_old: int, n_new: int, key: np.ndarray, cols: dict):
        """Carried and new rows when both hold the same tensors, n_old / n_new rows each (a run logging the
        same tensors every step): side by side as (tensors, rows) matrices, no searching or scattering."""
        keys = len(key) // n_new

        def stack(a, b):
            return np.hstack([a.reshape(keys, n_old), b.reshape(keys, n_new)]).reshape(-1)

        return stack(self.key, key), {c: stack(self.cols[c], cols[c]) for c in self.INPUTS}

    def _merge(self, key: np.ndarray, cols: dict):
        """Carried rows merged in front of each tensor's new rows (both sorted by key), in general."""
        n0 = len(self.key)
        pos_old = np.searchsorted(key, self.key, side="left") + np.arange(n0)
        pos_new = np.searchsorted(self.key, key, side="right") + np.arange(len(key))
        mcols = {c: _merged(self.cols[c], cols[c], pos_old, pos_new) for c in self.INPUTS}
        return _merged(self.key, key, pos_old, pos_new), mcols, lambda v: v[pos_new]

    def _keep_tail(self, key: np.ndarray, cols: dict, grid: tuple[np.ndarray, int] | None) -> None:
        """The last ``keep`` rows of each tensor of merged rows sorted by (key, step); ``grid``: their
        :func:`_grid_of`."""
        n = len(key)
        if n == 0:
            return
        if grid is not None:  # the last columns of the (tensors, rows) matrix
            rows = grid[1]
            k = min(rows, self.keep)
            self.key = key.reshape(-1, rows)[:, rows - k:].reshape(-1)
            self.cols = {c: v.reshape(-1, rows)[:, rows - k:].reshape(-1) for c, v in cols.items()}
            self._grid = (grid[0], k)
            return
        end = np.flatnonzero(ends_of(key))  # last row of each tensor
        seg = np.cumsum(starts_of(key)) - 1
        tail = end[seg] - np.arange(n) < self.keep
        self.key = key[tail]
        self.cols = {c: v[tail] for c, v in cols.items()}
        self._grid = _grid_of(self.key)


def _grid_of(key: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(the keys, rows per key) of rows sorted by key when every key has the same number of rows, else None."""
    if not len(key):
        return None
    starts = np.flatnonzero(starts_of(key))
    rows = len(key) // len(starts)
    if rows * len(starts) != len(key) or not (np.diff(appended(starts, len(key))) == rows).all():
        return None
    return key[starts], rows


def _merged(a: np.ndarray, b: np.ndarray, pos_a: np.ndarray, pos_b: np.ndarray) -> np.ndarray:
    """``a`` and ``b`` placed at positions ``pos_a`` / ``pos_b`` of one array."""
    out = np.empty(len(a) + len(b), b.dtype)
    out[pos_a] = a
    out[pos_b] = b
    return out


def edges_sorted(key: np.ndarray, f: np.ndarray, ev: np.ndarray, before: np.ndarray | None = None) -> np.ndarray:
    """Edge of ``f`` over rows sorted by (key, step): true where f holds and did not hold on the
    previous *evaluable* row of the same tensor (the online detector keeps that flag per tensor).
    ``before[key]``: the flag at each tensor's last evaluable row before these rows (None: no rows before)."""
    n = len(f)
    if n == 0 or not f.any():
        return f
    i = np.arange(n)
    last = np.maximum.accumulate(np.where(ev, i, -1))
    prev = shifted(last, -1)
    seg_start = np.maximum.accumulate(np.where(starts_of(key), i, 0))
    ok = prev >= seg_start
    prevf = np.zeros(n, bool)
    prevf[ok] = f[prev[ok]]
    if before is not None:
        prevf[~ok] = before[key[~ok]]
    return f & ~prevf


def last_evaluable(key: np.ndarray, f: np.ndarray, ev: np.ndarray, state: np.ndarray) -> None:
    """``state[k]`` = ``f`` at tensor k's last evaluable row among rows sorted by (key, step), for the
    tensors that have one (the ``before`` of the next slice's :func:`edges_sorted`)."""
    idx = np.flatnonzero(ev)
    if len(idx):
        k = key[idx]
        last = idx[ends_of(k)]
        state[key[last]] = f[last]
