"""Per-(tensor, step-bucket) rollup of a run's tensors table: what every tensor view draws from.

The tensors table of a big run has ~10M rows; every tensor view only needs per-(tensor, bucket)
aggregates. One numpy pass builds them (integer tensor ids from dictionary-encoded names, a stable
sort by (tensor, bucket), reduceat), at a base bucket width g = the line-chart width; views re-bucket
this ~1M-row rollup to their own width (a multiple of g), which is exact for min/max/sum/count.
A live refresh recomputes only the buckets from the one holding the previous last step on.
Statistics come from the one table of derived statistics, :mod:`fp8scope.derived`.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dashboard.runcache import Entry
from fp8scope.derived import DERIVED

MAX_COLS = 400  # heatmap step buckets
MAX_POINTS = 1000  # line-chart step buckets
UPDATE_ROWS = 2_000_000  # a live refresh re-aggregates at most this many tensors rows (see Rollup._open_bucket)


class NoData(Exception):
    """A panel's table is absent; the message says so plainly."""


def bucket_width(span: tuple[int, int] | None, max_cols: int) -> int:
    if span is None:
        return 1
    return max(1, math.ceil((span[1] - span[0] + 1) / max(1, max_cols)))


# The tensors table of a big run has ~10M rows; every tensor view only needs per-(tensor, bucket)
# aggregates. One numpy pass builds them (integer tensor ids from dictionary-encoded names, a stable
# sort by (tensor, bucket), reduceat), at a base bucket width g = the line-chart width; views re-bucket
# this ~1M-row rollup to their own width (a multiple of g), which is exact for min/max/sum/count.
# A live refresh recomputes only the buckets from the one holding the previous last step on.
_WORST = {k: d.worst for k, d in DERIVED.items()}
# the derived statistics the rollup keeps per (tensor, bucket): every one but amax / range, which headroom
# already carries, in binades
ROLLED = tuple(k for k in DERIVED if k != "amax_over_range")


def _col(t: pa.Table, name: str, dtype=np.float64) -> np.ndarray:
    c = t[name]
    if c.num_chunks == 0:
        return np.empty(0, dtype)
    # combine in C++ first: ChunkedArray.to_numpy pays Python overhead per chunk (10k record batches)
    a = (c.chunk(0) if c.num_chunks == 1 else c.combine_chunks()).to_numpy(zero_copy_only=False)
    return a.astype(dtype, copy=False)


class Rollup:
    """Per (tensor id, step // g) aggregates of a tensors table, rows in (bucket, tid) order."""

    def __init__(self, g: int):
        self.g = g
        self.tids: dict[tuple[str, str], int] = {}
        self.layer: list[str] = []
        self.role: list[str] = []
        self.ord: list[int] = []
        self.fmt: list[str | None] = []
        self.source: list[str | None] = []
        self.recipe: list[str | None] = []  # the recipe kind its scales come from (the tensors table's column)
        self._buf: dict[str, np.ndarray] = {}  # arrays with spare capacity, rows in (bucket, tid) order
        self._n = 0
        self.version: tuple = ()
        self.rank_last: dict[int, int] = {}  # each rank's newest step seen: where a live update starts
        self.updates = 0  # live refreshes applied in place (a rebuild makes a new Rollup)

    # -- build -----------------------------------------------------------------------------
    def _tid(self, t: pa.Table) -> np.ndarray:
        lay = pc.dictionary_encode(t["layer"]).combine_chunks()
        rol = pc.dictionary_encode(t["tensor"]).combine_chunks()
        ln, rn = lay.dictionary.to_pylist(), rol.dictionary.to_pylist()
        nr = max(1, len(rn))
        it = np.int32 if len(ln) * nr < 2**31 else np.int64
        pair = lay.indices.to_numpy(zero_copy_only=False).astype(it) * it(nr)
        pair += rol.indices.to_numpy(zero_copy_only=False).astype(it)
        used = np.flatnonzero(np.bincount(pair, minlength=len(ln) * nr))
        remap = np.full(len(ln) * nr, -1, it)
        # first row of each (layer, role) pair, for order/format/source: usually all within the first steps
        first = np.full(len(remap), -1, np.int64)
        m = min(len(pair), max(1 << 16, 4 * len(used)))
        while True:
            first[pair[:m][::-1]] = np.arange(m - 1, -1, -1)
            if (first[used] >= 0).all() or m == len(pair):
                break
            m = len(pair)
        ordc = _col(t.slice(0, m), "order", np.int64)
        head = t.slice(0, m)
        rows = pa.array(first[used])
        fmts = head["fp8_format"].take(rows).to_pylist() if "fp8_format" in t.column_names else [None] * len(used)
        srcs = head["source"].take(rows).to_pylist() if "source" in t.column_names else [None] * len(used)
        recs = head["recipe"].take(rows).to_pylist() if "recipe" in t.column_names else [None] * len(used)
        for p, fm, sr, rc in zip(used, fmts, srcs, recs):
            key = (ln[p // max(1, len(rn))], rn[p % max(1, len(rn))])
            tid = self.tids.get(key)
            if tid is None:
                tid = self.tids[key] = len(self.layer)
                self.layer.append(key[0])
                self.role.append(key[1])
                self.ord.append(int(ordc[first[p]]))
                self.fmt.append(fm)
                self.source.append(sr)
                self.recipe.append(rc)
            else:
                self.ord[tid] = min(self.ord[tid], int(ordc[first[p]]))
            remap[p] = tid
        return remap[pair]

    def _aggregate(self, t: pa.Table) -> dict[str, np.ndarray]:
        tid = self._tid(t)
        step = _col(t, "step", np.int64)
        n = len(step)
        # Fast path: rows are whole steps, each step the same tensors in the same order, steps
        # ascending (what RunWriter produces for one rank). Then a (steps, tensors) grid is reduced
        # along axis 0 in blocks of buckets: no sort, no gather, small reused temporaries.
        T = int(np.argmax(step != step[0])) if n and (step != step[0]).any() else n
        grid = False
        if T and n % T == 0:
            t2, s2 = tid.reshape(-1, T), step.reshape(-1, T)
            grid = (bool((t2 == t2[0]).all()) and bool((s2 == s2[:, :1]).all())
                    and bool((np.diff(s2[:, 0]) > 0).all()) and len(np.unique(t2[0])) == T)
        if not grid:
            return self._aggregate_sorted(t, tid, step)
        rb = s2[:, 0] // self.g
        bst = np.flatnonzero(np.r_[True, rb[1:] != rb[:-1]])
        bend = np.r_[bst[1:], len(rb)]
        per_block = max(1, (1 << 18) // T)  # ~256k rows per block
        parts: list[dict] = []
        for i in range(0, len(bst), max(1, per_block // max(1, self.g))):
            j = min(len(bst), i + max(1, per_block // max(1, self.g)))
            r0, r1 = int(bst[i]), int(bend[j - 1])
            blk = t.slice(r0 * T, (r1 - r0) * T)
            starts = bst[i:j] - r0
            counts = bend[i:j] - bst[i:j]
            steps = np.repeat(s2[r0:r1, :1], T, axis=1)
            parts.append(self._reduce(lambda name: _col(blk, name).reshape(-1, T), steps, starts, counts))
        order = np.argsort(t2[0], kind="stable")
        out = {k: np.concatenate([p[k] for p in parts], axis=0)[:, order].ravel() for k in parts[0]}
        out["tid"] = np.tile(t2[0][order], len(bst))
        out["b"] = np.repeat(rb[bst], T)
        return out

    def _aggregate_sorted(self, t: pa.Table, tid: np.ndarray, step: np.ndarray) -> dict[str, np.ndarray]:
        bkt = step // self.g
        b0 = int(bkt.min())
        nb = int(bkt.max()) - b0 + 1
        key = tid.astype(np.int64) * nb + (bkt - b0)
        perm = np.argsort(key, kind="stable")
        ks = key[perm]
        starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        counts = np.diff(np.r_[starts, len(ks)])
        out = self._reduce(lambda name: _col(t, name)[perm], step[perm], starts, counts)
        out["tid"] = ks[starts] // nb
        out["b"] = ks[starts] % nb + b0
        o = np.lexsort((out["tid"], out["b"]))  # (bucket, tid) order: a live update rewrites only the end
        return {k: v[o] for k, v in out.items()}

    def _reduce(self, get, step_s: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
        """Group reductions along axis 0 (rows 1-D, or a (steps, tensors) grid) at group starts."""
        names = set(self._names)

        def col(name):
            if name not in names:
                return np.full(step_s.shape, np.nan)
            v = get(name)
            return v if v.flags.writeable else v.copy()

        c0 = int(counts[0]) if len(counts) else 0
        uniform = c0 > 0 and bool((counts == c0).all())

        def red(fn, v, **kw):
            if uniform:  # equal groups (whole buckets): a reshape + reduce is much faster than reduceat
                return fn.reduce(v.reshape((len(starts), c0) + v.shape[1:]), axis=1, **kw)
            return fn.reduceat(v, starts, axis=0, **kw)

        shape = (len(starts),) + step_s.shape[1:]
        cnt = counts.reshape((-1,) + (1,) * (step_s.ndim - 1))
        out: dict[str, np.ndarray] = {"n": np.broadcast_to(cnt, shape).astype(np.int64)}
        out["smin"] = red(np.minimum, step_s)
        out["smax"] = red(np.maximum, step_s)
        out["segsum"] = red(np.add, col("segment").astype(np.int64)) if "segment" in names else np.zeros(shape, np.int64)
        amax = col("amax")
        cache: dict[str, np.ndarray] = {}

        def column(name):  # each column converted once for all the derived statistics that read it
            if name not in cache:
                cache[name] = col(name).astype(np.float64, copy=False)
            return cache[name]

        with np.errstate(all="ignore"):
            big = np.iinfo(np.int64).max
            for k in ROLLED:
                v = DERIVED[k].fn(column)
                if not v.flags.writeable or any(v is c for c in cache.values()):
                    v = v.copy()  # a column itself (sqnr_db, nonfinite): the cache must stay intact
                fin = np.isfinite(v)
                if k == "nonfinite":
                    bad = ~np.isfinite(amax) | (np.nan_to_num(v, nan=0.0) > 0)
                    out["nf_sum"] = red(np.add, np.nan_to_num(v, nan=0.0)) + red(np.add, ~np.isfinite(amax), dtype=np.int64)
                    out["nf_step"] = red(np.minimum, np.where(bad, step_s, big))
                v[~fin] = np.nan
                out[f"{k}_w"] = red(np.fmax if _WORST[k] == "max" else np.fmin, v)
                v[~fin] = 0.0
                out[f"{k}_sum"] = red(np.add, v)
                out[f"{k}_n"] = red(np.add, fin, dtype=np.int64)
            fmax, sinv = column("fp8_max"), column("scale_inv")
            afin = np.isfinite(amax)
            out["amax_max"] = red(np.maximum, amax)  # NaN wins, as in SQL max over NaN
            a_f = np.where(afin, amax, -np.inf)
            gm = red(np.maximum, a_f)
            out["amax_fmax"] = np.where(np.isneginf(gm), np.nan, gm)
            hit = afin & (a_f == np.repeat(gm, counts, axis=0))
            st = red(np.minimum, np.where(hit, step_s, big))
            out["amax_step"] = np.where(st == big, -1, st)
            pos = afin & (amax > 0)
            npos = red(np.add, pos, dtype=np.int64)
            out["amax_mean"] = red(np.add, np.where(pos, amax, 0.0)) / np.where(npos == 0, np.nan, npos)
            out["expected_amax"] = red(np.fmax, col("expected_amax"))
            out["range"] = red(np.fmin, fmax * sinv)
            out["scale_inv"] = red(np.fmax, sinv)
            out["min_nonzero"] = red(np.fmin, col("min_nonzero"))
        return out

    @property
    def a(self) -> dict[str, np.ndarray]:
        """The rollup rows (views), sorted by (bucket, tid)."""
        return {k: v[: self._n] for k, v in self._buf.items()}

    def _put(self, at: int, part: dict[str, np.ndarray]) -> None:
        m = len(part["n"])
        need = at + m
        if not self._buf or need > len(self._buf["n"]):
            cap = max(need, int(need * 1.25) + 1024)
            old = self._buf
            self._buf = {}
            for k, v in part.items():
                buf = np.empty(cap, v.dtype if k not in old else old[k].dtype)
                if k in old:
                    buf[:at] = old[k][:at]
                self._buf[k] = buf
        for k, v in part.items():
            self._buf[k][at:need] = v
        self._n = need

    def build(self, t: pa.Table) -> None:
        self._names = t.column_names
        self._buf, self._n = {}, 0
        self.rank_last = {}
        if t.num_rows:
            self._put(0, self._aggregate(t))
            self._note_ranks(t)

    def _note_ranks(self, t: pa.Table) -> None:
        """Remember each rank's newest step among ``t``'s rows (ranks absent from ``t`` keep theirs)."""
        if "rank" not in t.column_names or not t.num_rows:
            return
        last = t.group_by("rank").aggregate([("step", "max")])
        for r, st in zip(last["rank"].to_pylist(), last["step_max"].to_pylist()):
            if st is not None and st > self.rank_last.get(r, -(1 << 62)):
                self.rank_last[r] = st

    def _open_bucket(self) -> int:
        """The oldest bucket a live update recomputes: the one holding the last step of the rank
        furthest behind. Each rank logs its steps in ascending order, so older buckets are final;
        with one stream per rank written independently, the ranks of a live run are a few steps
        apart, and starting at the newest bucket (the lead rank's) would count the other ranks'
        next rows as changes to final buckets and rebuild the whole rollup on every refresh.
        A rank so far behind that recomputing from its bucket would re-read more than
        ``UPDATE_ROWS`` rows is taken for stalled and left out; if it logs again, ``update``'s row
        count check sees rows land in a final bucket and the caller rebuilds, as before."""
        a = self.a
        b = a["b"]
        newest = int(b[-1])
        for bucket in sorted({s // self.g for s in self.rank_last.values()}):
            if bucket >= newest:
                break
            k = int(np.searchsorted(b, bucket))
            if int(a["n"][k:].sum()) <= UPDATE_ROWS:
                return bucket
        return newest

    def update(self, t: pa.Table) -> bool:
        """Recompute the buckets from the oldest one a rank may still add rows to (``_open_bucket``);
        False when rows before it changed (a restarted segment replayed steps, a compaction, a
        stalled rank came back): the caller rebuilds."""
        if not self._n:
            return False
        a = self.a
        xb = self._open_bucket()
        x = xb * self.g
        keep = int(np.searchsorted(a["b"], xb))
        new = _rows_from_step(t, x)
        n_old = t.num_rows - new.num_rows
        seg_old = ((pc.sum(t["segment"]).as_py() or 0) - (pc.sum(new["segment"]).as_py() or 0)
                   if "segment" in t.column_names else 0)
        if n_old != int(a["n"][:keep].sum()) or seg_old != int(a["segsum"][:keep].sum()):
            return False
        self._names = t.column_names
        if new.num_rows:
            self._put(keep, self._aggregate(new))
            self._note_ranks(new)
        else:
            self._n = keep
        self.updates += 1
        return True

    # -- queries ---------------------------------------------------------------------------
    def span(self) -> tuple[int, int] | None:
        if not self._n:
            return None
        a = self.a
        return int(a["smin"].min()), int(a["smax"].max())

    def width(self, max_cols: int, span: tuple[int, int] | None = None) -> int:
        """Bucket width for at most max_cols columns over ``span`` (default: the whole run): a multiple of
        g, so re-bucketing is exact."""
        b = bucket_width(span or self.span(), max_cols)
        return self.g * math.ceil(b / self.g)

    def rows_in(self, rows: np.ndarray, span: tuple[int, int] | None) -> np.ndarray:
        """The rows whose bucket overlaps ``span`` (all of them without one)."""
        if span is None or not len(rows):
            return rows
        b = self.a["b"][rows]
        return rows[(b >= span[0] // self.g) & (b <= span[1] // self.g)]

    def rebucket(self, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(starts into rows, bucket step) for rows (indices, sorted by tid, b) re-bucketed to width."""
        k = width // self.g
        a = self.a
        tid = a["tid"][rows]
        col = a["b"][rows] // k
        starts = np.flatnonzero(np.r_[True, (tid[1:] != tid[:-1]) | (col[1:] != col[:-1])]) if len(rows) else np.empty(0, int)
        return starts, col[starts] * width


def _rows_from_step(t: pa.Table, x: int) -> pa.Table:
    """The rows of ``t`` with step >= x. A live run's table is thousands of record batches (one per
    rank and step), and filtering all of them on every refresh grows with the run, so only the
    batches whose largest step reaches x (the newest few per rank) are filtered."""
    i = t.schema.get_field_index("step")
    tail = []
    for b in t.to_batches():
        hi = pc.max(b.column(i)).as_py()
        if hi is not None and hi >= x:
            tail.append(b)
    sub = pa.Table.from_batches(tail, schema=t.schema)
    return sub.filter(pc.greater_equal(sub["step"], x))


def rollup(e: Entry) -> Rollup | None:
    """The run's rollup at its current version: built once, then updated from the newest bucket on.
    Only under ``e.rollup_lock`` (other views' lookups go on meanwhile)."""
    with e.rollup_lock:
        if not e.has("tensors"):
            return None
        with e.lock:
            version, t = e.version, e.run.table("tensors")  # the rows of that version
        r = e.rollup
        if r is not None and r.version == version:
            return r
        if r is not None and r.update(t):
            sp = r.span()
            if sp is None or (sp[1] - sp[0] + 1) <= 4 * MAX_POINTS * r.g:
                r.version = version
                return r
        mm = pc.min_max(t["step"]).as_py()
        r = Rollup(bucket_width((mm["min"], mm["max"]), MAX_POINTS))
        r.build(t)
        r.version = version
        e.rollup = r
        return r



def _reduce(fn, v: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return fn.reduceat(v, starts) if len(v) else np.empty(0, v.dtype)


def _tids_for(r: Rollup, role: str | None, layer_re: str | None) -> np.ndarray:
    ok = np.ones(len(r.layer), bool)
    if role:
        ok &= np.array([x == role for x in r.role], bool)
    if layer_re:
        try:
            rx = re.compile(layer_re)
        except re.error as exc:
            raise NoData(f"query failed: bad layer regex {layer_re!r}: {exc}") from None
        ok &= np.array([bool(rx.search(x)) for x in r.layer], bool)
    return np.flatnonzero(ok)


def _layer_rank(r: Rollup) -> dict[str, int]:
    best: dict[str, int] = {}
    for l, o in zip(r.layer, r.ord):
        best[l] = min(o, best.get(l, o))
    return {l: i for i, l in enumerate(sorted(best, key=lambda l: (best[l], l)))}


def _tail_rollup(e: Entry, last_steps: int) -> Rollup:
    """A per-step rollup of the last `last_steps` steps only (the live view's heatmap)."""

    def f():
        t = e.run.table("tensors")
        hi = rollup(e).span()[1]
        step = _col(t, "step", np.int64)
        idx = np.flatnonzero(step >= hi - last_steps + 1)
        if len(idx) and idx[0] + len(idx) == len(step):
            sub = t.slice(int(idx[0]))  # the usual case: the newest steps are the table's tail, zero-copy
        else:
            sub = t.take(pa.array(idx))
        r = Rollup(1)
        r.build(sub)
        return r

    return e.cached(("tail_rollup", last_steps), f, rollup=True)


def _heatmap_rollup(e: Entry, stat: str, role: str | None, agg: str, layer_re: str | None, max_cols: int,
                    last_steps: int | None = None, span: tuple[int, int] | None = None) -> pd.DataFrame:
    r = _tail_rollup(e, last_steps) if last_steps else rollup(e)
    if not r._n:
        return pd.DataFrame({"layer": [], "step": [], "value": []})
    a = r.a
    tids = _tids_for(r, role, layer_re)
    rows = np.flatnonzero(np.isin(a["tid"], tids)) if len(tids) else np.empty(0, np.int64)
    rows = r.rows_in(rows, span)
    width = r.width(max_cols, span)
    lname = sorted(set(r.layer))
    lid_of = {l: i for i, l in enumerate(lname)}
    lid = np.array([lid_of[l] for l in r.layer], np.int64)[a["tid"][rows]] if len(rows) else np.empty(0, np.int64)
    col = a["b"][rows] // (width // r.g)
    o = np.lexsort((col, lid))
    rows, lid, col = rows[o], lid[o], col[o]
    starts = np.flatnonzero(np.r_[True, (lid[1:] != lid[:-1]) | (col[1:] != col[:-1])]) if len(rows) else np.empty(0, np.int64)
    if agg == "worst":
        v = _reduce(np.fmax if _WORST[stat] == "max" else np.fmin, a[f"{stat}_w"][rows], starts)
    else:
        n = _reduce(np.add, a[f"{stat}_n"][rows], starts)
        with np.errstate(all="ignore"):
            v = _reduce(np.add, a[f"{stat}_sum"][rows], starts) / np.where(n == 0, np.nan, n)
    keep = np.isfinite(v)
    glid, gstep = lid[starts][keep], col[starts][keep] * width
    rank = _layer_rank(r)
    lrank = np.array([rank[l] for l in lname], np.int64)
    o = np.lexsort((gstep, lrank[glid])) if len(glid) else np.empty(0, np.int64)
    return pd.DataFrame({"layer": np.array(lname, object)[glid[o]] if len(o) else np.empty(0, object),
                         "step": gstep[o].astype(np.int64), "value": v[keep][o].astype(np.float32)})


