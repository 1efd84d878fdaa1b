"""Compaction: fold the append-only streams into one zstd parquet file per table.

Why: thousands of small IPC batches per rank are cheap to append but slow to scan and
cannot be read by DuckDB/pandas directly; parquet is compact, columnar and universally
readable. Streams are left in place by default, so compaction is always safe to run,
even against a live run.

Crash safety: each parquet file is written under a temp name and os.replace'd, and carries
in its own schema metadata the exact byte offset of every stream it covers. Readers take
that metadata as the truth, so a compaction killed between two tables (or before
compacted.json) leaves every table either fully old or fully new, never doubled.
compacted.json is a human/tool-readable summary written last.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow.parquet as pq

from fp8scope.schema import SCHEMA_VERSION
from fp8scope.store.atomic import atomic_write_bytes, fsync_dir, tmp_name
from fp8scope.store.layout import compacted_path, parquet_dir, parquet_path, relative
from fp8scope.store.merge import COVERAGE_KEY, RunData


def read_compacted(run_dir: str | os.PathLike) -> dict | None:
    """compacted.json as a dict, or None if the run was never compacted (or it is unreadable)."""
    try:
        return json.loads(compacted_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


def compact(run_dir: str | os.PathLike, *, delete_streams: bool = False, compression: str = "zstd") -> dict:
    """Write parquet/{table}.parquet for every table and parquet/compacted.json; return a summary.

    delete_streams=True removes stream files that are fully covered *and* were closed
    cleanly by their writer (a live or crashed writer's stream is kept: it may still grow,
    or its torn tail tells a story).
    """
    run_dir = Path(run_dir)
    data = RunData(run_dir)
    parquet_dir(run_dir).mkdir(parents=True, exist_ok=True)
    streams: dict[str, int] = {}
    tables: dict[str, int] = {}
    for name in data.table_names():
        t = data.table(name)
        covered = {relative(run_dir, s.file.path): s.tail.offset for s in data.streams(name)}
        # Keep coverage of streams an earlier compaction deleted, so nothing is read twice.
        covered = {**data.coverage(name), **covered}
        meta = dict(t.schema.metadata or {})
        meta[COVERAGE_KEY] = json.dumps(covered, sort_keys=True).encode()
        t = t.replace_schema_metadata(meta)
        dest = parquet_path(run_dir, name)
        tmp = tmp_name(dest)
        pq.write_table(t, tmp, compression=compression)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        streams.update(covered)
        tables[name] = t.num_rows
    fsync_dir(parquet_dir(run_dir))
    doomed = [s for s in data.streams() if s.tail.ended] if delete_streams else []
    summary = {
        "schema_version": SCHEMA_VERSION,
        "time": time.time(),
        "tables": tables,
        "streams": dict(sorted(streams.items())),
        "deleted_streams": sorted(relative(run_dir, s.file.path) for s in doomed),
    }
    # compacted.json first, deletions after: next_segment() learns from it which segment numbers
    # the deleted streams used. Deleting first and being killed before this write let a restarted
    # writer reuse a deleted stream's name, whose new bytes readers then skipped (covered offset).
    atomic_write_bytes(compacted_path(run_dir), json.dumps(summary, indent=2).encode() + b"\n")
    for s in doomed:
        s.file.path.unlink(missing_ok=True)
    return summary
