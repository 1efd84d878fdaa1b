"""Where every file of a run folder lives. The only module that builds or parses paths.

Keeping the layout in one place means the writer, the readers, compaction and the docs
cannot drift apart, and a change of layout is one edit.

    run_dir/
      run.json                                   manifest (atomic replace)
      streams/{table}-r{rank:05d}-s{segment:04d}.arrows   append-only Arrow IPC streams
      parquet/{table}.parquet                    compacted tables (optional)
      parquet/compacted.json                     what compaction covered
      analysis/report.json, analysis/events.parquet   cached offline analysis (derived, safe to delete)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "run.json"
STREAMS_DIR = "streams"
PARQUET_DIR = "parquet"
COMPACTED = "compacted.json"
ANALYSIS_DIR = "analysis"
STREAM_SUFFIX = ".arrows"

# Table names may contain '-' or '_'; the rank/segment suffix is anchored at the end.
_STREAM_RE = re.compile(r"^(?P<table>[A-Za-z0-9_.\-]+)-r(?P<rank>\d{5,})-s(?P<segment>\d{4,})\.arrows$")
_TABLE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")


@dataclass(frozen=True, order=True)
class StreamFile:
    """One stream file, identified by what its name encodes."""

    table: str
    rank: int
    segment: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


def check_table_name(table: str) -> str:
    """Refuse names that would produce unparsable or escaping file names."""
    if not _TABLE_RE.match(table):
        raise ValueError(f"invalid table name {table!r}: use letters, digits, '_' and '-'")
    return table


def manifest_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / MANIFEST


def streams_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / STREAMS_DIR


def stream_name(table: str, rank: int, segment: int) -> str:
    return f"{check_table_name(table)}-r{int(rank):05d}-s{int(segment):04d}{STREAM_SUFFIX}"


def stream_path(run_dir: str | os.PathLike, table: str, rank: int, segment: int) -> Path:
    return streams_dir(run_dir) / stream_name(table, rank, segment)


def parse_stream_name(name: str) -> tuple[str, int, int] | None:
    """(table, rank, segment) for a stream file name, None for anything else in the folder."""
    m = _STREAM_RE.match(name)
    if m is None:
        return None
    return m["table"], int(m["rank"]), int(m["segment"])


def list_streams(run_dir: str | os.PathLike) -> list[StreamFile]:
    """All stream files, sorted by (table, rank, segment); unrelated files are ignored."""
    d = streams_dir(run_dir)
    out = []
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return []
    for e in entries:
        parsed = parse_stream_name(e.name)
        if parsed is not None and e.is_file():
            out.append(StreamFile(parsed[0], parsed[1], parsed[2], Path(e.path)))
    return sorted(out)


def parquet_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / PARQUET_DIR


def parquet_path(run_dir: str | os.PathLike, table: str) -> Path:
    return parquet_dir(run_dir) / f"{check_table_name(table)}.parquet"


def list_parquet_tables(run_dir: str | os.PathLike) -> list[str]:
    d = parquet_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.parquet") if _TABLE_RE.match(p.stem))


def analysis_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / ANALYSIS_DIR


def compacted_path(run_dir: str | os.PathLike) -> Path:
    return parquet_dir(run_dir) / COMPACTED


def relative(run_dir: str | os.PathLike, path: Path) -> str:
    """Path as recorded in compacted.json: relative, '/'-separated, so a moved run stays valid."""
    return Path(path).relative_to(Path(run_dir)).as_posix()
