"""The Runs list: each run's status (live / finished / crashed / empty / error), last step, size and
event counts, cheaply: an uncached run's tensors table is never loaded."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from dashboard.runcache import Entry, RunCache
from fp8scope.errors import Fp8ScopeError
from fp8scope.run import disk_usage
from fp8scope.store.layout import list_parquet_tables, list_streams, parquet_path
from fp8scope.store.manifest import read_manifest
from fp8scope.store.reader import stream_ended

LIVE_SECONDS = 120.0  # a run written to within this long, streams not closed: "live"


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


IPC_CONTINUATION = b"\xff\xff\xff\xff"  # every Arrow IPC stream message starts with it


def _corrupt_stream(streams) -> str | None:
    """The first stream file whose first bytes are no Arrow IPC message (a corrupt or foreign file)."""
    for s in streams:
        try:
            with open(s.path, "rb") as f:
                head = f.read(4)
        except OSError as exc:
            return f"{s.path.name}: {exc.strerror or exc}"
        if head and (len(head) < 4 or head != IPC_CONTINUATION):
            if len(head) < 4 and IPC_CONTINUATION.startswith(head):
                continue  # a writer's first bytes on their way
            return f"{s.path.name} is not an Arrow IPC stream (corrupt or foreign file)"
    return None


def liveness(path: Path, cache: RunCache | None = None, now: float | None = None) -> tuple[str, float | None, int]:
    """(status, last write time, bytes on disk): live / finished / crashed / empty; raises on a run that
    cannot be read (no manifest, a corrupt stream)."""
    now = time.time() if now is None else now
    read_manifest(path)
    size, last = disk_usage(path)
    streams = list_streams(path)
    bad = _corrupt_stream(streams)
    if bad:
        raise ValueError(bad)
    e = cache.peek(path) if cache else None
    if e is not None:
        # the loaded run's tails know exactly whether each stream saw its end marker
        tails = e.run._data.streams()
        ended = bool(tails) and all(s.tail.ended or stream_ended(s.file.path) for s in tails)
    else:
        ended = bool(streams) and all(stream_ended(s.path) for s in streams)
    if not streams:
        status = "finished" if list_parquet_tables(path) else "empty"
    elif ended:
        status = "finished"
    elif last is not None and now - last < LIVE_SECONDS:
        status = "live"
    else:
        status = "crashed"
    return status, last, size


def analysed_counts(path: Path, e: Entry | None) -> tuple[dict | None, str]:
    """Events by severity and where they come from: the run's analysis (the report's counts: cached in
    the run folder, or finished in this dashboard), else the online detector's events table, else None."""
    from fp8scope.detect.analysis import cached_report, data_key
    from fp8scope.detect.config import DetectConfig

    r = e.analyser.state()["result"] if e is not None and e.analyser is not None else None
    rep = r["report"] if r is not None else cached_report(path, data_key(path, DetectConfig()))
    if rep is not None:
        return dict(rep["events"]["by_severity"]), "analysis"
    ev = e.run.table("events") if e is not None and e.has("events") else (_small_table(path, "events") if e is None else None)
    if ev is not None:
        vc = pc.value_counts(ev["severity"]).to_pylist() if ev.num_rows else []
        return {d["values"]: d["counts"] for d in vc}, "online detector"
    return None, "not analysed yet"


def run_status(path: Path, cache: RunCache | None = None, now: float | None = None) -> dict:
    """Status row for the Runs view: status, last step, when, size, events by severity."""
    out = {"status": "error", "error": None, "last_step": None, "last_write": None, "size": 0,
           "events": None, "events_source": None, "steps": None, "created": None}
    try:
        out["created"] = read_manifest(path).get("created")
        out["status"], out["last_write"], out["size"] = liveness(path, cache, now)
        e = cache.peek(path) if cache else None
        if e is not None:
            out["last_step"] = e.cached(("laststep",), lambda: _last_step_sql(e))
        else:
            sc = _small_table(path, "scalars")
            if sc is not None and sc.num_rows:
                out["last_step"] = pc.max(sc["step"]).as_py()
        out["events"], out["events_source"] = analysed_counts(path, e)
    except (Fp8ScopeError, OSError, pa.ArrowException, ValueError) as exc:
        out["status"] = "error"
        out["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return out


def _last_step_sql(e: Entry):
    names = [n for n in ("scalars", "tensors") if e.has(n)]
    if not names:
        return None
    return int(e.sql(f"select max(step) as s from {names[0]}")["s"].iloc[0])


