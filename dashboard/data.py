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
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from fp8scope.errors import Fp8ScopeError, RunError
from fp8scope.run import Run, disk_usage
from fp8scope.store.layout import list_parquet_tables, list_streams, parquet_path
from fp8scope.store.manifest import read_manifest

MAX_COLS = 400  # heatmap step buckets
MAX_POINTS = 1000  # line-chart step buckets
LIVE_SECONDS = 120.0  # a run written to within this long, streams not closed: "live"
REFRESH_MIN_INTERVAL = 1.0
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"

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
    cache: OrderedDict = field(default_factory=OrderedDict)

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
                for n in self.run.table_names():
                    self.con.register(n, self.run.table(n))
                self.registered = self.version
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

    def __init__(self, max_runs: int = 8):
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
                run = Run(path)
                e = Entry(path, run)
                e.version = e.compute_version()
                e.last_refresh = time.time()
                with self._lock:
                    self._entries[path] = e
                    while len(self._entries) > self.max_runs:
                        self._entries.popitem(last=False)
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
def _ends_cleanly(p: Path) -> bool:
    """True when the stream file ends with the Arrow end-of-stream marker RunWriter.close() writes."""
    try:
        with open(p, "rb") as f:
            f.seek(0, 2)
            if f.tell() < 8:
                return False
            f.seek(-8, 2)
            return f.read(8) == _EOS
    except OSError:
        return False


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
            ended = bool(tails) and all(s.tail.ended or _ends_cleanly(s.file.path) for s in tails)
        else:
            ended = bool(streams) and all(_ends_cleanly(s.path) for s in streams)
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


# ---- aggregates ---------------------------------------------------------------------------
def step_span(e: Entry, table: str = "tensors") -> tuple[int, int] | None:
    def f():
        if not e.has(table):
            return None
        d = e.sql(f"select min(step) lo, max(step) hi from {table}")
        return int(d["lo"].iloc[0]), int(d["hi"].iloc[0])

    return e.cached(("span", table), f)


def bucket_width(span: tuple[int, int] | None, max_cols: int) -> int:
    if span is None:
        return 1
    return max(1, math.ceil((span[1] - span[0] + 1) / max(1, max_cols)))


def roles(e: Entry) -> list[str]:
    def f():
        if not e.has("tensors"):
            return []
        return list(e.sql("select distinct tensor from tensors order by 1")["tensor"])

    return e.cached(("roles",), f)


def layer_order(e: Entry) -> pd.DataFrame:
    def f():
        if not e.has("tensors"):
            return pd.DataFrame({"layer": [], "ord": []})
        return e.sql('select layer, min("order") as ord from tensors group by 1 order by 2, 1')

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
        w = "and tensor = ?" if role else ""
        return e.sql(f"select layer, step from tensors where (not isfinite(amax) or nonfinite > 0) {w} "
                     "order by step limit 2000", [role] if role else [])

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
    """One tensor over steps (bucketed; worst value per bucket)."""

    def f():
        b = bucket_width(step_span(e), max_points)
        return e.sql(
            f"""select (step // {b}) * {b} as step,
                   max(amax) as amax, max(expected_amax) as expected_amax,
                   min(fp8_max * scale_inv) as range, max(scale_inv) as scale_inv,
                   min(min_nonzero) as min_nonzero,
                   max(100.0 * overflow / nullif(numel, 0)) as overflow_pct,
                   max(100.0 * underflow / nullif(numel, 0)) as underflow_pct,
                   max(100.0 * saturated / nullif(numel, 0)) as saturated_pct,
                   min(case when isfinite(sqnr_db) then sqnr_db end) as sqnr_db,
                   max(nonfinite) as nonfinite,
                   any_value(fp8_format) as fp8_format, any_value(source) as source
                from tensors where layer = ? and tensor = ? group by 1 order by 1""",
            [layer, role],
        )

    return e.cached(("tensor", layer, role, max_points), f)


# ---- outlier score ------------------------------------------------------------------------
SCORE_DOC = (
    "score = spike + 2 x overflow + underflow/10 + 3 x critical + 1 x warning events + 20 if non-finite. "
    "spike = log2(max amax / median amax): how many binades the tensor's worst amax rose above its typical "
    "level; overflow = binades the worst amax went above the representable range fp8_max*scale_inv "
    "(0 when it always fit); underflow = the worst step's underflow % (10 % adds 1 point); events = detector "
    "events naming this layer and role; non-finite = any NaN/Inf amax or element."
)


def outliers(e: Entry, role: str | None = None, limit: int = 200) -> pd.DataFrame:
    """Tensors ranked by the outlier score (see SCORE_DOC)."""
    if not e.has("tensors"):
        raise NoData("no tensors table in this run yet")

    def f():
        w = "where tensor = ?" if role else ""
        df = e.sql(
            f"""select layer, tensor, min("order") as ord, count(*) as rows,
                   max(amax) filter (where isfinite(amax)) as max_amax,
                   approx_quantile(amax, 0.5) filter (where isfinite(amax) and amax > 0) as median_amax,
                   arg_max(step, amax) filter (where isfinite(amax)) as worst_step,
                   min(log2(fp8_max * scale_inv / amax)) filter (where isfinite(amax) and amax > 0) as min_headroom,
                   max(100.0 * overflow / nullif(numel, 0)) as overflow_pct,
                   max(100.0 * underflow / nullif(numel, 0)) as underflow_pct,
                   max(100.0 * saturated / nullif(numel, 0)) as saturated_pct,
                   coalesce(sum(nonfinite), 0) + count(*) filter (where not isfinite(amax)) as nonfinite
                from tensors {w} group by 1, 2""",
            [role] if role else [],
        )
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
            d = e.sql('select step, layer, tensor from tensors where not isfinite(amax) or nonfinite > 0 '
                      'order by step, "order" limit 1')
            if not d.empty:
                level = "critical"
                r = d.iloc[0]
                parts.append(f"first non-finite value: step {int(r['step'])}, {r['layer']} {r['tensor']}")
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
