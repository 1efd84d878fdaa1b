"""RunData: every table of a run folder as one Arrow table, merged across ranks and segments.

Sources per table: the compacted parquet (if any) plus every stream file, each stream read
only from the offset compaction already covered. Rows get a `segment` column so that the
dedup rule can be applied and users can see where a row came from.

Dedup rule: a restarted job replays steps it logged before the crash. For each
(rank, step) logged by more than one segment, all rows come from the latest segment.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fp8scope.errors import RunError
from fp8scope.schema import TABLE_KEYS, TABLE_SCHEMAS
from fp8scope.store.layout import StreamFile, list_parquet_tables, list_streams, parquet_path, relative
from fp8scope.store.reader import StreamTail

COVERAGE_KEY = b"fp8scope.compacted"  # parquet schema metadata: {stream relpath: byte offset covered}
SEGMENT = "segment"


def with_segment_schema(schema: pa.Schema) -> pa.Schema:
    if SEGMENT in schema.names:
        return schema
    return schema.append(pa.field(SEGMENT, pa.int32()))


def check_stream_schema(file: StreamFile, schema: pa.Schema) -> None:
    """Refuse, in one line naming the file, a stream that is not its table's: another table's stream
    under this name (its schema's ``fp8scope.table`` says which), or one without the columns that key
    the table's rows (``schema.TABLE_KEYS``; hand-made, foreign): merged, its rows would be rows of nulls
    that no reader can place (a tensors row with no layer broke the report). Extra columns, and nullable
    ones a run predates, are fine."""
    for col in ("step", "rank"):  # every table is keyed by (rank, step)
        i = schema.get_field_index(col)
        if i < 0 or not pa.types.is_integer(schema.field(i).type):
            raise RunError(f"{file.path}: not an fp8scope stream (no integer {col!r} column)")
    said = (schema.metadata or {}).get(b"fp8scope.table")
    if said is not None and said != file.table.encode():
        raise RunError(f"{file.path}: holds the {said.decode(errors='replace')!r} table, not {file.table!r}")
    for col in TABLE_KEYS.get(file.table, ()):
        if col not in schema.names:
            raise RunError(f"{file.path}: not an fp8scope {file.table} stream (no {col!r} column)")


@dataclass
class _StreamState:
    """One stream file's tail plus the rows read from it so far (zero-copy chunks)."""

    file: StreamFile
    tail: StreamTail
    chunks: list[pa.Table] = field(default_factory=list)
    checked: bool = False
    combine: bool = True

    def poll(self) -> bool:
        batches = self.tail.read_new()
        if self.tail.schema is not None and not self.checked:
            check_stream_schema(self.file, self.tail.schema)
            self.checked = True
        batches = [b for b in batches if b.num_rows]
        if not batches:
            return False
        # One chunk per poll, not one per batch: 10k tiny chunks make every later
        # filter/take pay per-chunk overhead (seconds on a 5M-row run). Costs one copy.
        # combine=False (RunData(..., combine_chunks=False)) keeps the zero-copy batches instead: no
        # copy of the whole file into fresh memory (seconds for GBs here), for readers that scan, not filter.
        t = pa.Table.from_batches(batches)
        if len(batches) > 1 and self.combine:
            t = t.combine_chunks()
        # from_buffers: pa.array() on a numpy array would import pandas (~0.2 s per CLI call) to look at it
        seg = pa.Array.from_buffers(pa.int32(), t.num_rows,
                                    [None, pa.py_buffer(np.full(t.num_rows, self.file.segment, dtype=np.int32))])
        self.chunks.append(t.append_column(pa.field(SEGMENT, pa.int32()), seg))
        return True


@dataclass
class _TableState:
    name: str
    parquet: pa.Table | None = None
    parquet_stat: tuple | None = None
    coverage: dict[str, int] = field(default_factory=dict)
    streams: dict[Path, _StreamState] = field(default_factory=dict)
    merged: pa.Table | None = None  # cache, dropped when anything changes


def _stat_key(p: Path) -> tuple | None:
    try:
        st = p.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class RunData:
    """Arrow-level view of a run folder's tables. `refresh()` reads only what is new."""

    def __init__(self, run_dir: str | os.PathLike, combine_chunks: bool = True):
        self.run_dir = Path(run_dir)
        self.combine_chunks = combine_chunks
        self._tables: dict[str, _TableState] = {}
        self.refresh()

    # -- loading -------------------------------------------------------------------------
    def _load_parquet(self, st: _TableState) -> None:
        p = parquet_path(self.run_dir, st.name)
        key = _stat_key(p)
        if key == st.parquet_stat:
            return
        # New or replaced parquet (a compaction ran): rebuild this table from scratch.
        st.parquet_stat = key
        st.streams.clear()
        st.merged = None
        st.parquet, st.coverage = None, {}
        if key is None:
            return
        try:
            t = pq.read_table(p)
        except (pa.ArrowException, OSError) as e:
            raise RunError(f"{p}: unreadable parquet ({str(e).splitlines()[0]})") from None
        meta = t.schema.metadata or {}
        try:
            st.coverage = {k: int(v) for k, v in json.loads(meta.get(COVERAGE_KEY, b"{}")).items()}
        except (ValueError, AttributeError):
            raise RunError(f"{p}: bad {COVERAGE_KEY.decode()} metadata") from None
        st.parquet = t.replace_schema_metadata(None)

    def refresh(self) -> bool:
        """Pick up new streams, new batches and new compactions. True if anything changed."""
        changed = False
        names = set(self._tables) | set(list_parquet_tables(self.run_dir))
        files = list_streams(self.run_dir)
        names |= {f.table for f in files}
        for name in sorted(names):
            st = self._tables.setdefault(name, _TableState(name))
            before = st.parquet_stat
            self._load_parquet(st)
            if st.parquet_stat != before:
                changed = True
        for f in files:
            st = self._tables[f.table]
            ss = st.streams.get(f.path)
            if ss is None:
                off = st.coverage.get(relative(self.run_dir, f.path), 0)
                ss = st.streams[f.path] = _StreamState(f, StreamTail(f.path, offset=off), combine=self.combine_chunks)
            if ss.poll():
                st.merged = None
                changed = True
        return changed

    # -- access --------------------------------------------------------------------------
    def table_names(self) -> list[str]:
        return sorted(n for n, st in self._tables.items() if st.parquet is not None or st.streams)

    def coverage(self, table: str) -> dict[str, int]:
        """Stream bytes the current parquet of `table` already holds ({relpath: offset})."""
        st = self._tables.get(table)
        return dict(st.coverage) if st else {}

    def streams(self, table: str | None = None) -> list[_StreamState]:
        out = [s for n, st in self._tables.items() if table in (None, n) for s in st.streams.values()]
        return sorted(out, key=lambda s: s.file)

    def empty(self, name: str) -> pa.Table:
        schema = TABLE_SCHEMAS.get(name)
        if schema is None:
            raise RunError(f"{self.run_dir}: no table {name!r} (have: {', '.join(self.table_names()) or 'none'})")
        return with_segment_schema(schema).empty_table()

    def table(self, name: str) -> pa.Table:
        """Merged, deduplicated table (parquet + streams), with a `segment` column."""
        st = self._tables.get(name)
        if st is None or (st.parquet is None and not st.streams):
            return self.empty(name)
        if st.merged is None:
            parts = [st.parquet] if st.parquet is not None else []
            for ss in sorted(st.streams.values(), key=lambda s: (s.file.rank, s.file.segment)):
                parts.extend(ss.chunks)
            if not parts:
                st.merged = self.empty(name)
            else:
                try:
                    t = pa.concat_tables(parts, promote_options="default")
                except pa.ArrowException as e:
                    raise RunError(f"{self.run_dir}: table {name!r} has incompatible schemas across files ({str(e).splitlines()[0]})") from None
                if t.num_rows and t.column(0).num_chunks > 64 and self.combine_chunks:
                    t = t.combine_chunks()  # many small polls (live run): keep scans chunk-cheap
                st.merged = with_missing_columns(dedup_latest_segment(t), name)
        return st.merged


def with_missing_columns(t: pa.Table, name: str) -> pa.Table:
    """``t`` with the nullable columns of its table's schema that its files predate, as nulls (a run
    logged before ``underflow_deep`` existed): every reader, SQL included, sees one schema, and a
    statistic the run never logged reads as missing, never as an error."""
    schema = TABLE_SCHEMAS.get(name)
    if schema is None:
        return t
    for f in schema:
        if f.nullable and f.name not in t.column_names:
            t = t.append_column(f, pa.nulls(t.num_rows, f.type))
    return t


def single_segment(t: pa.Table) -> bool:
    """True when every row of ``t`` (with a segment column) comes from the same segment: the case of
    every run that was never restarted. One min/max pass, ~100x cheaper than a group-by on 5M rows."""
    mm = pc.min_max(t[SEGMENT])
    return mm["min"].as_py() == mm["max"].as_py()


def dedup_latest_segment(t: pa.Table) -> pa.Table:
    """Keep, for every (rank, step), only rows of the highest segment that logged it. Order is preserved."""
    if t.num_rows == 0 or not {"rank", "step", SEGMENT} <= set(t.column_names):
        return t
    if single_segment(t):
        return t  # one segment in the whole table: nothing can collide (a min/max, not a group-by per rank)
    per_rank = t.group_by("rank").aggregate([(SEGMENT, "min"), (SEGMENT, "max")])
    if pc.all(pc.equal(per_rank[f"{SEGMENT}_min"], per_rank[f"{SEGMENT}_max"])).as_py():
        return t  # every rank has one segment: nothing can collide (the common, fast case)
    # One int64 key per (rank, step); look up each row's winning segment without a join,
    # because joins do not preserve row order.
    rank = pc.cast(t["rank"], pa.int64())
    key = pc.add(pc.multiply(rank, pa.scalar(1 << 40, pa.int64())), pc.cast(t["step"], pa.int64()))
    keyed = pa.table({"k": key, "s": t[SEGMENT]})
    best = keyed.group_by("k").aggregate([("s", "max")])
    idx = pc.index_in(key, value_set=best["k"])
    winner = pc.take(best["s_max"], idx)
    return t.filter(pc.equal(t[SEGMENT], winner))
