"""Server-side data for the dashboard: cached runs, DuckDB aggregation, downsampling.

The browser never receives raw rows. Every view asks this module for a small frame:
a heatmap is at most ``MAX_COLS`` step buckets x the layers of one tensor role, a line
at most ``MAX_POINTS`` buckets, a table at most a few hundred rows. Aggregates are
computed by DuckDB over the run's in-memory Arrow tables (registered zero-copy) and
cached per run *version* (row counts of every table), so switching views or coming back
to one is a dictionary lookup until the run grows.

Runs are cached per resolved path; :meth:`RunCache.refresh` calls ``Run.refresh()``,
which reads only the bytes appended since the last call (a torn tail is retried later).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from fp8scope.errors import Fp8ScopeError, RunError
from fp8scope.run import Run, disk_usage
from fp8scope.store.layout import list_parquet_tables, list_streams, parquet_path
from fp8scope.store.reader import stream_ended
from fp8scope.store.manifest import read_manifest

MAX_COLS = 400  # heatmap step buckets
MAX_POINTS = 1000  # line-chart step buckets
UPDATE_ROWS = 2_000_000  # a live refresh re-aggregates at most this many tensors rows (see Rollup._open_bucket)
LIVE_SECONDS = 120.0  # a run written to within this long, streams not closed: "live"
REFRESH_MIN_INTERVAL = 1.0

# key -> (label, SQL expression per row, worst-case aggregate, source table)
STATS: dict[str, tuple[str, str, str, str]] = {
    "log2_amax": ("amax (log2)", "log2(amax)", "max", "tensors"),
    "headroom": (
        "amax headroom, binades: log2(fp8_max*scale_inv/amax); < 0 = overflow",
        "log2(fp8_max * scale_inv / amax)",
        "min",
        "tensors",
    ),
    "overflow_pct": ("overflow %", "100.0 * overflow / nullif(numel, 0)", "max", "tensors"),
    "underflow_pct": ("underflow %", "100.0 * underflow / nullif(numel, 0)", "max", "tensors"),
    "saturated_pct": ("saturation %", "100.0 * saturated / nullif(numel, 0)", "max", "tensors"),
    "sqnr_db": ("quantization SQNR dB (low = bad)", "sqnr_db", "min", "tensors"),
    "qerr_log10": ("quantization error log10(MSE)", "log10(qerr_mse)", "max", "tensors"),
    "nonfinite": ("non-finite elements", "nonfinite", "max", "tensors"),
    "shadow_out": ("shadow: FP8 vs BF16 output rel. error", "output_rel_err", "max", "shadow_compare"),
    "shadow_wgrad": ("shadow: FP8 vs BF16 wgrad rel. error", "wgrad_rel_err", "max", "shadow_compare"),
    "shadow_local": ("shadow: layer's own FP8 GEMM rel. error", "local_rel_err", "max", "shadow_compare"),
}
SEVERITIES = ("critical", "warning", "info")


class NoData(Exception):
    """A panel's table is absent; the message says so plainly."""


def _q(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


# ---- one cached run ------------------------------------------------------------------------
@dataclass
class Entry:
    path: Path
    run: Run
    lock: threading.RLock = field(default_factory=threading.RLock)
    version: tuple = ()
    last_refresh: float = 0.0
    con: object = None
    registered: tuple | None = None
    _reg: set = field(default_factory=set)
    cache: OrderedDict = field(default_factory=OrderedDict)
    rollup: "Rollup | None" = None
    warmed: threading.Event = field(default_factory=threading.Event)

    def tables(self) -> list[str]:
        return self.run.table_names()

    def has(self, table: str) -> bool:
        return table in self.run.table_names() and self.run.table(table).num_rows > 0

    def compute_version(self) -> tuple:
        return tuple((n, self.run.table(n).num_rows) for n in self.run.table_names())

    def sql(self, query: str, params: list | None = None) -> pd.DataFrame:
        import duckdb

        with self.lock:
            if self.con is None:
                self.con = duckdb.connect()
                self.con.execute("SET threads TO 2")
            if self.registered != self.version:
                self.registered, self._reg = self.version, set()
            # register only the tables this query names (re-registering the 10M-row tensors table
            # on every live refresh costs ~0.4 s; the tensor views read the rollup instead)
            for n in self.run.table_names():
                if n not in self._reg and re.search(rf"\b{re.escape(n)}\b", query):
                    self.con.register(n, self.run.table(n))
                    self._reg.add(n)
            return self.con.execute(query, params or []).df()

    def cached(self, key: tuple, fn):
        with self.lock:
            k = (self.version, *key)
            if k in self.cache:
                self.cache.move_to_end(k)
                return self.cache[k]
            val = fn()
            self.cache[k] = val
            while len(self.cache) > 64:
                self.cache.popitem(last=False)
            return val


class RunCache:
    """Run objects per resolved path; refresh() reads only new bytes, at most once a second."""

    def __init__(self, max_runs: int = 8, warm: bool = True):
        self.warm = warm  # compute the rollup + default views in a background thread when a run is opened
        self._entries: OrderedDict[Path, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[Path, threading.Lock] = {}
        self.max_runs = max_runs

    def get(self, path: Path) -> Entry:
        path = Path(path)
        with self._lock:
            e = self._entries.get(path)
            if e is not None:
                self._entries.move_to_end(path)
                return e
            load_lock = self._loading.setdefault(path, threading.Lock())
        with load_lock:  # two requests for a cold run load it once
            with self._lock:
                e = self._entries.get(path)
            if e is None:
                run = Run(path, combine_chunks=False)  # zero-copy batches: the rollup scans them once
                e = Entry(path, run)
                e.version = e.compute_version()
                e.last_refresh = time.time()
                with self._lock:
                    self._entries[path] = e
                    while len(self._entries) > self.max_runs:
                        self._entries.popitem(last=False)
                if self.warm:
                    threading.Thread(target=warm_up, args=(e,), daemon=True, name=f"warm {path.name}").start()
                else:
                    e.warmed.set()
            return e

    def peek(self, path: Path) -> Entry | None:
        return self._entries.get(Path(path))

    def refresh(self, path: Path, force: bool = False) -> bool:
        """Read what was appended since the last refresh; True when the run changed."""
        e = self.get(path)
        with e.lock:
            if not force and time.time() - e.last_refresh < REFRESH_MIN_INTERVAL:
                return False
            e.last_refresh = time.time()
            e.run.refresh()
            v = e.compute_version()
            if v != e.version:
                e.version = v
                return True
            return False


# ---- run list summaries (cheap: never loads the tensors table of an uncached run) ----------
def _small_table(path: Path, name: str) -> pa.Table | None:
    from fp8scope.store.reader import read_stream

    parts = []
    if name in list_parquet_tables(path):
        import pyarrow.parquet as pq

        parts.append(pq.read_table(parquet_path(path, name), columns=None).replace_schema_metadata(None))
    for s in list_streams(path):
        if s.table == name:
            parts.append(read_stream(s.path))
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return None
    return pa.concat_tables(parts, promote_options="default")


def run_status(path: Path, cache: RunCache | None = None, now: float | None = None) -> dict:
    """Status row for the Runs view: status, last step, when, size, events by severity."""
    now = time.time() if now is None else now
    out = {"status": "error", "error": None, "last_step": None, "last_write": None, "size": 0,
           "events": None, "steps": None, "created": None}
    try:
        m = read_manifest(path)
        out["created"] = m.get("created")
        size, last = disk_usage(path)
        out["size"], out["last_write"] = size, last
        streams = list_streams(path)
        e = cache.peek(path) if cache else None
        if e is not None:
            # the loaded run's tails know exactly whether each stream saw its end marker
            tails = e.run._data.streams()
            ended = bool(tails) and all(s.tail.ended or stream_ended(s.file.path) for s in tails)
        else:
            ended = bool(streams) and all(stream_ended(s.path) for s in streams)
        if not streams:
            out["status"] = "finished" if list_parquet_tables(path) else "empty"
        elif ended:
            out["status"] = "finished"
        elif last is not None and now - last < LIVE_SECONDS:
            out["status"] = "live"
        else:
            out["status"] = "crashed"
        if e is not None:
            df = e.cached(("laststep",), lambda: _last_step_sql(e))
            out["last_step"] = df
            ev = e.run.table("events") if e.has("events") else None
        else:
            sc = _small_table(path, "scalars")
            if sc is not None:
                import pyarrow.compute as pc

                out["last_step"] = pc.max(sc["step"]).as_py()
            ev = _small_table(path, "events")
        if ev is not None and ev.num_rows:
            import pyarrow.compute as pc

            vc = pc.value_counts(ev["severity"]).to_pylist()
            out["events"] = {d["values"]: d["counts"] for d in vc}
        elif ev is not None or (e is None and any(s.table == "events" for s in streams)):
            out["events"] = {}
        else:
            out["events"] = None  # no events table at all: detection has not run
    except (Fp8ScopeError, OSError, pa.ArrowException, ValueError) as exc:
        out["status"] = "error"
        out["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return out


def _last_step_sql(e: Entry):
    names = [n for n in ("scalars", "tensors") if e.has(n)]
    if not names:
        return None
    return int(e.sql(f"select max(step) as s from {names[0]}")["s"].iloc[0])



# ---- per-(tensor, step-bucket) rollup of the tensors table ---------------------------------
# The tensors table of a big run has ~10M rows; every tensor view only needs per-(tensor, bucket)
# aggregates. One numpy pass builds them (integer tensor ids from dictionary-encoded names, a stable
# sort by (tensor, bucket), reduceat), at a base bucket width g = the line-chart width; views re-bucket
# this ~1M-row rollup to their own width (a multiple of g), which is exact for min/max/sum/count.
# A live refresh recomputes only the buckets from the one holding the previous last step on.
_WORST = {k: v[2] for k, v in STATS.items() if v[3] == "tensors"}


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
        for p, fm, sr in zip(used, fmts, srcs):
            key = (ln[p // max(1, len(rn))], rn[p % max(1, len(rn))])
            tid = self.tids.get(key)
            if tid is None:
                tid = self.tids[key] = len(self.layer)
                self.layer.append(key[0])
                self.role.append(key[1])
                self.ord.append(int(ordc[first[p]]))
                self.fmt.append(fm)
                self.source.append(sr)
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
        amax, fmax, sinv = col("amax"), col("fp8_max"), col("scale_inv")
        numel = col("numel")
        numel[numel == 0] = np.nan
        with np.errstate(all="ignore"):
            makers = {
                "log2_amax": lambda: np.log2(amax),
                "headroom": lambda: np.log2(fmax * sinv / amax),
                "overflow_pct": lambda: 100.0 * col("overflow") / numel,
                "underflow_pct": lambda: 100.0 * col("underflow") / numel,
                "saturated_pct": lambda: 100.0 * col("saturated") / numel,
                "sqnr_db": lambda: col("sqnr_db"),
                "qerr_log10": lambda: np.log10(col("qerr_mse")),
                "nonfinite": lambda: col("nonfinite"),
            }
            big = np.iinfo(np.int64).max
            for k, mk in makers.items():
                v = mk()
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
                if k == "saturated_pct":
                    del numel
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

    def width(self, max_cols: int) -> int:
        """Bucket width for at most max_cols columns: a multiple of g (so re-bucketing is exact)."""
        b = bucket_width(self.span(), max_cols)
        return self.g * math.ceil(b / self.g)

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
    rank and step); filtering all of them costs ~0.1 s per refresh at 6M rows, so only the batches
    whose largest step reaches x (the newest few per rank) are filtered."""
    i = t.schema.get_field_index("step")
    tail = []
    for b in t.to_batches():
        hi = pc.max(b.column(i)).as_py()
        if hi is not None and hi >= x:
            tail.append(b)
    sub = pa.Table.from_batches(tail, schema=t.schema)
    return sub.filter(pc.greater_equal(sub["step"], x))


def rollup(e: Entry) -> Rollup | None:
    """The run's rollup at its current version: built once, then updated from the newest bucket on."""
    with e.lock:
        if not e.has("tensors"):
            return None
        r = e.rollup
        if r is not None and r.version == e.version:
            return r
        t = e.run.table("tensors")
        if r is not None and r.update(t):
            sp = r.span()
            if sp is None or (sp[1] - sp[0] + 1) <= 4 * MAX_POINTS * r.g:
                r.version = e.version
                return r
        mm = pc.min_max(t["step"]).as_py()
        r = Rollup(bucket_width((mm["min"], mm["max"]), MAX_POINTS))
        r.build(t)
        r.version = e.version
        e.rollup = r
        return r


def warm_up(e: Entry) -> None:
    """Background thread started when a run is opened: rollup + what the default views ask first."""
    try:
        rollup(e)
        rl = roles(e)
        names = [n for n in ("loss", "grad_norm") if n in scalar_names(e)]
        jobs = [lambda: verdict(e), lambda: outliers(e, None), lambda: scalars_frame(e, names),
                lambda: e.cached(("info",), e.run.info)]
        if rl:
            r0 = "activation" if "activation" in rl else rl[0]
            jobs.insert(0, lambda: heatmap_frame(e, "headroom", r0))
            jobs.append(lambda: heatmap_frame(e, "headroom", r0, last_steps=300))  # the live view's
        for job in jobs:
            try:
                job()
            except Exception:  # noqa: BLE001 - the page that needs it reports the error
                pass
    except Exception:  # noqa: BLE001
        pass
    finally:
        e.warmed.set()


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

    return e.cached(("tail_rollup", last_steps), f)


def _heatmap_rollup(e: Entry, stat: str, role: str | None, agg: str, layer_re: str | None, max_cols: int,
                    last_steps: int | None = None) -> pd.DataFrame:
    r = _tail_rollup(e, last_steps) if last_steps else rollup(e)
    if not r._n:
        return pd.DataFrame({"layer": [], "step": [], "value": []})
    a = r.a
    tids = _tids_for(r, role, layer_re)
    rows = np.flatnonzero(np.isin(a["tid"], tids)) if len(tids) else np.empty(0, np.int64)
    width = r.width(max_cols)
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


# ---- aggregates ---------------------------------------------------------------------------
def step_span(e: Entry, table: str = "tensors") -> tuple[int, int] | None:
    def f():
        if not e.has(table):
            return None
        if table == "tensors":
            return rollup(e).span()
        d = e.sql(f"select min(step) lo, max(step) hi from {table}")
        return int(d["lo"].iloc[0]), int(d["hi"].iloc[0])

    return e.cached(("span", table), f)


def bucket_width(span: tuple[int, int] | None, max_cols: int) -> int:
    if span is None:
        return 1
    return max(1, math.ceil((span[1] - span[0] + 1) / max(1, max_cols)))


def heatmap_width(e: Entry, table: str = "tensors", max_cols: int = MAX_COLS) -> int:
    """Steps per heatmap column (for the tensors table a multiple of the rollup's base bucket)."""
    if table == "tensors" and e.has("tensors"):
        return rollup(e).width(max_cols)
    return bucket_width(step_span(e, table), max_cols)


def roles(e: Entry) -> list[str]:
    def f():
        if not e.has("tensors"):
            return []
        return sorted(set(rollup(e).role))

    return e.cached(("roles",), f)


def layer_order(e: Entry) -> pd.DataFrame:
    def f():
        if not e.has("tensors"):
            return pd.DataFrame({"layer": [], "ord": []})
        r = rollup(e)
        best: dict[str, int] = {}
        for l, o in zip(r.layer, r.ord):
            best[l] = min(o, best.get(l, o))
        ls = sorted(best, key=lambda l: (best[l], l))
        return pd.DataFrame({"layer": ls, "ord": [best[l] for l in ls]})

    return e.cached(("layer_order",), f)


def heatmap_frame(e: Entry, stat: str, role: str | None, agg: str = "worst", layer_re: str | None = None,
                  max_cols: int = MAX_COLS, last_steps: int | None = None) -> pd.DataFrame:
    """Columns layer, step (first step of the bucket), value; layers in execution order."""
    if stat not in STATS:
        raise NoData(f"unknown statistic {stat!r}")
    label, expr, worst, table = STATS[stat]
    if not e.has(table):
        if table == "shadow_compare":
            raise NoData("no shadow_compare table in this run: the BF16 shadow has not been run for it")
        raise NoData(f"no {table} table in this run yet")

    def f():
        if table == "tensors":
            return _heatmap_rollup(e, stat, role, agg, layer_re, max_cols, last_steps)
        span = step_span(e, table)
        if last_steps and span:
            span = (max(span[0], span[1] - last_steps + 1), span[1])
        b = bucket_width(span, max_cols)
        fn = worst if agg == "worst" else "avg"
        where = [f"step >= {span[0]}"] if span else []
        params: list = []
        if table == "tensors" and role:
            where.append("tensor = ?")
            params.append(role)
        if layer_re:
            where.append("regexp_matches(layer, ?)")
            params.append(layer_re)
        w = ("where " + " and ".join(where)) if where else ""
        q = f"""
            select layer, (step // {b}) * {b} as step, {fn}(v) as value
            from (select layer, step, cast({expr} as double) as v from {table} {w})
            where isfinite(v) group by 1, 2
        """
        try:
            df = e.sql(q, params)
        except Exception as exc:  # bad regex etc.
            raise NoData(f"query failed: {str(exc).splitlines()[0]}") from None
        order = layer_order(e)
        rank = {l: i for i, l in enumerate(order["layer"])}
        df["_o"] = df["layer"].map(rank).fillna(len(rank))
        df = df.sort_values(["_o", "layer", "step"]).drop(columns="_o").reset_index(drop=True)
        df["value"] = df["value"].astype(np.float32)  # half the bytes, plenty of precision for colour
        return df

    return e.cached(("heatmap", stat, role, agg, layer_re, max_cols, last_steps), f)


def events(e: Entry) -> pd.DataFrame | None:
    """All events (None when the run has no events table: detection has not run)."""
    if "events" not in e.tables():
        return None
    return e.cached(("events",), lambda: e.sql("select * exclude (segment) from events order by step, rank"))


def flagged(e: Entry, role: str | None) -> pd.DataFrame | None:
    ev = events(e)
    if ev is None or ev.empty:
        return ev
    m = ev["layer"].notna()
    if role:
        m &= ev["tensor"].isna() | (ev["tensor"] == role) | (ev["tensor"] == "")
    return ev[m]


def nonfinite_cells(e: Entry, role: str | None) -> pd.DataFrame:
    def f():
        if not e.has("tensors"):
            return pd.DataFrame({"layer": [], "step": []})
        r = rollup(e)
        a = r.a
        m = a["nf_step"] != np.iinfo(np.int64).max
        if role:
            m &= np.isin(a["tid"], _tids_for(r, role, None))
        idx = np.flatnonzero(m)
        idx = idx[np.argsort(a["nf_step"][idx], kind="stable")][:2000]
        return pd.DataFrame({"layer": [r.layer[t] for t in a["tid"][idx]], "step": a["nf_step"][idx]})

    return e.cached(("nonfinite", role), f)


def scalars_frame(e: Entry, names=("loss", "grad_norm"), max_points: int = MAX_POINTS, table: str = "scalars",
                  last_steps: int | None = None) -> pd.DataFrame:
    names = list(names)

    def f():
        if not e.has(table):
            return pd.DataFrame({"step": [], "name": [], "value": []})
        span = step_span(e, table)
        if last_steps and span:
            span = (max(span[0], span[1] - last_steps + 1), span[1])
        b = bucket_width(span, max_points)
        inl = ", ".join(_q(n) for n in names)
        return e.sql(f"select (step // {b}) * {b} as step, name, max(value) as value from {table} "
                     f"where name in ({inl}) and step >= {span[0]} group by 1, 2 order by 2, 1")

    return e.cached(("scalars", table, tuple(names), max_points, last_steps), f)


def scalar_names(e: Entry) -> list[str]:
    if not e.has("scalars"):
        return []
    return e.cached(("scalar_names",), lambda: list(e.sql("select distinct name from scalars order by 1")["name"]))


def shadow_loss_frame(e: Entry, max_points: int = MAX_POINTS) -> pd.DataFrame | None:
    """FP8 vs BF16 loss (step, name, value): shadow_compare's loss_fp8/loss_bf16 per compare step, plus each
    shadow fork's two losses (and a legacy shadow_loss table's numeric columns). None when none exists."""
    frames = []
    if e.has("shadow_compare"):
        frames.append(e.cached(("shadow_cmp_loss",), lambda: e.sql(
            "select step, name, value from (select step, avg(loss_fp8) as \"compare: fp8 loss\", "
            "avg(loss_bf16) as \"compare: bf16 loss\" from shadow_compare group by 1) "
            "unpivot (value for name in (\"compare: fp8 loss\", \"compare: bf16 loss\")) order by name, step")))
    if e.has("shadow_fork"):
        frames.append(e.cached(("shadow_fork_loss",), lambda: _fork_long(e)))
    if not e.has("shadow_loss"):
        return pd.concat(frames, ignore_index=True) if frames else None

    def f():
        schema = e.run.table("shadow_loss").schema
        cols = [n for n in schema.names if n not in ("step", "rank", "segment")
                and (pa.types.is_floating(schema.field(n).type) or pa.types.is_integer(schema.field(n).type))]
        if not cols or "step" not in schema.names:
            return pd.DataFrame({"step": [], "name": [], "value": []})
        b = bucket_width(step_span(e, "shadow_loss"), max_points)
        parts = " union all ".join(
            f'select (step // {b}) * {b} as step, {_q(c)} as name, avg(cast("{c}" as double)) as value '
            f"from shadow_loss group by 1" for c in cols)
        return e.sql(f"select * from ({parts}) order by name, step")

    return pd.concat(frames + [e.cached(("shadow_loss", max_points), f)], ignore_index=True)


def _fork_long(e: Entry) -> pd.DataFrame:
    d = e.sql("select fork_id, step, avg(loss_fp8) as f, avg(loss_bf16) as b from shadow_fork group by 1, 2 order by 1, 2")
    parts = [pd.DataFrame({"step": g["step"], "name": f"fork {k}: {lab} loss", "value": g[c]})
             for k, g in d.groupby("fork_id") for c, lab in (("f", "fp8"), ("b", "bf16"))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame({"step": [], "name": [], "value": []})


def fork_verdicts(e: Entry) -> pd.DataFrame | None:
    """Last row of each shadow fork (its verdict); None without a shadow_fork table."""
    if not e.has("shadow_fork"):
        return None
    return e.cached(("forks",), lambda: e.sql(
        "select fork_id, start_step, max(step) as last_step, arg_max(verdict, step) as verdict, "
        "arg_max(reason, step) as reason, arg_max(\"trigger\", step) as \"trigger\" from shadow_fork "
        "group by 1, 2 order by 2"))


def tensor_series(e: Entry, layer: str, role: str, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """One tensor over steps (bucketed; worst value per bucket), from the rollup."""

    def f():
        r = rollup(e)
        tid = r.tids.get((layer, role)) if r is not None else None
        cols = ["step", "amax", "expected_amax", "range", "scale_inv", "min_nonzero", "overflow_pct",
                "underflow_pct", "saturated_pct", "sqnr_db", "nonfinite", "fp8_format", "source"]
        if tid is None:
            return pd.DataFrame({c: [] for c in cols})
        a = r.a
        rows = np.flatnonzero(a["tid"] == tid)  # sorted by bucket
        width = r.width(max_points)
        col = a["b"][rows] // (width // r.g)
        st = np.flatnonzero(np.r_[True, col[1:] != col[:-1]]) if len(rows) else np.empty(0, np.int64)
        red = lambda fn, k: _reduce(fn, a[k][rows], st)  # noqa: E731
        return pd.DataFrame({
            "step": col[st] * width, "amax": red(np.maximum, "amax_max"), "expected_amax": red(np.fmax, "expected_amax"),
            "range": red(np.fmin, "range"), "scale_inv": red(np.fmax, "scale_inv"), "min_nonzero": red(np.fmin, "min_nonzero"),
            "overflow_pct": red(np.fmax, "overflow_pct_w"), "underflow_pct": red(np.fmax, "underflow_pct_w"),
            "saturated_pct": red(np.fmax, "saturated_pct_w"), "sqnr_db": red(np.fmin, "sqnr_db_w"),
            "nonfinite": red(np.fmax, "nonfinite_w"), "fp8_format": r.fmt[tid], "source": r.source[tid]})

    return e.cached(("tensor", layer, role, max_points), f)


# ---- outlier score ------------------------------------------------------------------------
SCORE_DOC = (
    "score = spike + 2 x overflow + underflow/10 + 3 x critical + 1 x warning events + 20 if non-finite. "
    "spike = log2(max amax / median amax): how many binades the tensor's worst amax rose above its typical "
    "level (median over step buckets of the bucket's mean amax; per step for runs of <= 1000 steps); "
    "overflow = binades the worst amax went above the representable range fp8_max*scale_inv "
    "(0 when it always fit); underflow = the worst step's underflow % (10 % adds 1 point); events = detector "
    "events naming this layer and role; non-finite = any NaN/Inf amax or element."
)


def outliers(e: Entry, role: str | None = None, limit: int = 200) -> pd.DataFrame:
    """Tensors ranked by the outlier score (see SCORE_DOC)."""
    if not e.has("tensors"):
        raise NoData("no tensors table in this run yet")

    def f():
        r = rollup(e)
        a = r.a
        rows = np.flatnonzero(np.isin(a["tid"], _tids_for(r, role, None)))
        rows = rows[np.argsort(a["tid"][rows], kind="stable")]  # by (tid, bucket)
        tid = a["tid"][rows]
        st = np.flatnonzero(np.r_[True, tid[1:] != tid[:-1]]) if len(rows) else np.empty(0, np.int64)
        red = lambda fn, k: _reduce(fn, a[k][rows], st)  # noqa: E731
        gmax = red(np.fmax, "amax_fmax")
        ends = np.r_[st[1:], len(rows)]
        am, astep = a["amax_fmax"][rows], a["amax_step"][rows]
        med, worst = np.full(len(st), np.nan), np.full(len(st), np.nan)
        for i, (s0, s1) in enumerate(zip(st, ends)):
            mv = a["amax_mean"][rows[s0:s1]]
            mv = mv[np.isfinite(mv)]
            if len(mv):
                med[i] = np.median(mv)
            if np.isfinite(gmax[i]):
                worst[i] = astep[s0 + int(np.nanargmax(am[s0:s1]))]
        t0 = tid[st]
        df = pd.DataFrame({
            "layer": [r.layer[t] for t in t0], "tensor": [r.role[t] for t in t0],
            "ord": [r.ord[t] for t in t0], "rows": red(np.add, "n"), "max_amax": gmax, "median_amax": med,
            "worst_step": worst, "min_headroom": red(np.fmin, "headroom_w"),
            "overflow_pct": red(np.fmax, "overflow_pct_w"), "underflow_pct": red(np.fmax, "underflow_pct_w"),
            "saturated_pct": red(np.fmax, "saturated_pct_w"), "nonfinite": red(np.add, "nf_sum")})
        ev = events(e)
        crit = warn = None
        if ev is not None and not ev.empty:
            sev = ev.assign(tensor=ev["tensor"].fillna(""))
            g = sev.groupby(["layer", "tensor", "severity"]).size().unstack(fill_value=0)
            crit = g["critical"] if "critical" in g else None
            warn = g["warning"] if "warning" in g else None
        key = pd.MultiIndex.from_arrays([df["layer"], df["tensor"]])
        df["critical"] = crit.reindex(key).fillna(0).to_numpy(int) if crit is not None else 0
        df["warning"] = warn.reindex(key).fillna(0).to_numpy(int) if warn is not None else 0
        with np.errstate(divide="ignore", invalid="ignore"):
            spike = np.log2(df["max_amax"] / df["median_amax"])
        df["spike"] = spike.clip(lower=0).fillna(0)
        df["overflow_binades"] = (-df["min_headroom"]).clip(lower=0).fillna(0)
        df["score"] = (df["spike"] + 2 * df["overflow_binades"] + df["underflow_pct"].fillna(0) / 10
                       + 3 * df["critical"] + df["warning"] + 20 * (df["nonfinite"] > 0))
        df = df.sort_values(["score", "ord"], ascending=[False, True]).head(limit).reset_index(drop=True)
        return df

    return e.cached(("outliers", role, limit), f)


# ---- verdict ------------------------------------------------------------------------------
def verdict(e: Entry) -> tuple[str, str]:
    """(level, text) for the banner: level is ok / warning / critical / unknown."""

    def f():
        parts = []
        level = "ok"
        if e.has("scalars"):
            d = e.sql("select min(step) as s from scalars where name = 'loss' and not isfinite(value)")
            if not d.empty and pd.notna(d["s"].iloc[0]):
                level = "critical"
                parts.append(f"loss became non-finite at step {int(d['s'].iloc[0])}")
        if e.has("tensors"):
            ru = rollup(e)
            nf = ru.a["nf_step"]
            bad = np.flatnonzero(nf != np.iinfo(np.int64).max)
            if len(bad):
                level = "critical"
                ords = np.array(ru.ord)[ru.a["tid"][bad]]
                i = bad[np.lexsort((ords, nf[bad]))[0]]
                t = int(ru.a["tid"][i])
                parts.append(f"first non-finite value: step {int(nf[i])}, {ru.layer[t]} {ru.role[t]}")
        ev = events(e)
        if ev is None:
            parts.append("no detection results yet (no events table): the banner only checks for non-finite values")
            if level == "ok":
                level = "unknown"
        elif not ev.empty:
            n = ev["severity"].value_counts()
            crit = ev[ev["severity"] == "critical"]
            first = (crit if not crit.empty else ev).iloc[0]
            if not crit.empty:
                level = "critical"
            elif level == "ok" and n.get("warning", 0):
                level = "warning"
            counts = ", ".join(f"{int(n.get(s, 0))} {s}" for s in SEVERITIES if n.get(s, 0))
            where = " ".join(str(x) for x in (first.get("layer"), first.get("tensor")) if isinstance(x, str) and x)
            parts.append(f"{counts}; first {first['severity']}: {first['rule']} at step {int(first['step'])}"
                         + (f" in {where}" if where else ""))
        if e.has("shadow_compare"):
            d = e.sql("select layer, max(output_rel_err) as m from shadow_compare group by 1 order by 2 desc limit 1")
            if not d.empty and pd.notna(d["m"].iloc[0]):
                m = float(d["m"].iloc[0])
                if m > 0.01:
                    parts.append(f"FP8 vs BF16 shadow: output error up to {m:.1%} in {d['layer'].iloc[0]} "
                                 "(> 1%: FP8 is a likely cause)")
                    if level in ("ok", "unknown"):
                        level = "warning"
                else:
                    parts.append(f"FP8 vs BF16 shadow agree (max output error {m:.2%})")
        fv = fork_verdicts(e)
        if fv is not None and not fv.empty:
            done = fv[fv["verdict"] != "pending"]
            for _, r in done.tail(3).iterrows():
                parts.append(f"shadow fork from step {int(r['start_step'])}: {r['verdict']}"
                             + (f" ({r['reason']})" if isinstance(r["reason"], str) and r["reason"] else ""))
                if r["verdict"] == "fp8-induced":
                    level = "critical"
        if not parts:
            parts.append("no problems flagged")
        return level, "; ".join(parts)

    return e.cached(("verdict",), f)
