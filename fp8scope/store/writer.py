"""RunWriter: appends one record batch per table per step to that table's Arrow IPC stream.

Why this shape:
- Arrow IPC *stream* format has no footer, so an append-only file is valid after every
  message and a reader can stop at the last complete one. A crash leaves at worst a torn
  last message, which the readers skip.
- Each batch is serialized to one buffer and handed to the kernel with os.write on an
  unbuffered fd. Once write() returns the bytes are in the page cache, so SIGKILL of the
  training process cannot lose them (a kernel crash or power loss can: call fsync() for that).
  One syscall per batch also keeps live readers from seeing half-written messages in the
  common case.
- A writer never appends to an existing file: a restarted job gets a new segment, so
  a stream always has exactly one schema message, at its start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa

from fp8scope.errors import RunError, UsageError
from fp8scope.schema import TABLE_SCHEMAS
from fp8scope.store.layout import compacted_path, list_streams, parse_stream_name, stream_path, streams_dir

_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def next_segment(run_dir: str | os.PathLike, rank: int) -> int:
    """The segment a newly opened writer for `rank` should use: one past the highest ever used.

    Streams deleted by compaction still count (via compacted.json): reusing their number
    would let older parquet rows win the later-segment-wins dedup.
    """
    segs = [s.segment for s in list_streams(run_dir) if s.rank == int(rank)]
    try:
        listed = json.loads(compacted_path(run_dir).read_text()).get("streams", {})
    except (OSError, ValueError, AttributeError):
        listed = {}
    for rel in listed:
        parsed = parse_stream_name(rel.rsplit("/", 1)[-1])
        if parsed and parsed[1] == int(rank):
            segs.append(parsed[2])
    return max(segs) + 1 if segs else 0


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class _Stream:
    """One open stream file: an fd plus the schema every batch must match."""

    __slots__ = ("fd", "schema", "path")

    def __init__(self, path: Path, schema: pa.Schema):
        # O_EXCL: appending a second schema message to an existing stream would corrupt it.
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
        except FileExistsError:
            raise RunError(f"{path}: stream already exists (use a new segment: next_segment())") from None
        self.schema = schema
        self.path = path
        _write_all(self.fd, schema.serialize())


class RunWriter:
    """Append-only writer for one rank of one run folder.

    RunWriter(run_dir, rank, segment=None): segment defaults to next_segment(run_dir, rank).
    Use one writer per rank per process; it is not thread-safe (the monitor's single
    background thread owns it).
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, segment: int | None = None):
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        streams_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        self.segment = next_segment(self.run_dir, self.rank) if segment is None else int(segment)
        self._streams: dict[str, _Stream] = {}
        self._closed = False

    def _open(self, table: str) -> _Stream:
        schema = TABLE_SCHEMAS.get(table)
        if schema is None:
            raise UsageError(f"unknown table {table!r}; known: {', '.join(TABLE_SCHEMAS)} (see schema.register_table)")
        s = _Stream(stream_path(self.run_dir, table, self.rank, self.segment), schema)
        self._streams[table] = s
        return s

    def write(self, table: str, batch: pa.RecordBatch | pa.Table) -> None:
        """Append `batch` to `table`'s stream; when this returns the bytes survive SIGKILL."""
        if self._closed:
            raise UsageError("RunWriter is closed")
        s = self._streams.get(table) or self._open(table)
        if isinstance(batch, pa.Table):
            for b in batch.combine_chunks().to_batches():
                self.write(table, b)
            return
        if batch.schema is not s.schema and not batch.schema.equals(s.schema):
            batch = self._conform(table, batch, s.schema)
        if batch.num_rows == 0:
            return
        _write_all(s.fd, batch.serialize())

    @staticmethod
    def _conform(table: str, batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
        # Same columns, different metadata or castable types: fix it here rather than
        # writing a batch readers cannot decode against the stream's schema.
        try:
            return pa.record_batch([batch.column(f.name) for f in schema], schema=schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError):
            pass
        try:
            return batch.select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise UsageError(f"batch for table {table!r} does not match its schema: {e}".splitlines()[0]) from None

    def fsync(self) -> None:
        """Force written batches to stable storage (power loss / kernel crash safety); slow, call rarely."""
        for s in self._streams.values():
            os.fsync(s.fd)

    def close(self) -> None:
        """Write the end-of-stream marker and close; idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in self._streams.values():
            try:
                _write_all(s.fd, _EOS)
            finally:
                os.close(s.fd)
        self._streams.clear()

    def paths(self) -> dict[str, Path]:
        """Stream files opened so far, by table (lets the caller notice a deleted run folder)."""
        return {t: s.path for t, s in self._streams.items()}

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
