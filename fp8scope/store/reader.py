"""Readers for append-only Arrow IPC stream files that may be torn, empty, or still growing.

A stream written by RunWriter is a schema message followed by record-batch messages
(and an end-of-stream marker if the writer closed cleanly). After a crash the last
message may be cut anywhere. We walk the message headers ourselves (8-byte prefix plus
the flatbuffer's bodyLength) to find the end of the last *complete* message, and hand
only complete bytes to Arrow. That gives a hard rule instead of guessing from exception
text: an incomplete final message is a torn tail (ignored); bytes that cannot be a
message at all are garbage (RunError naming the file).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pyarrow as pa

from fp8scope.errors import RunError
from fp8scope.schema import TABLE_SCHEMAS
from fp8scope.store.layout import parse_stream_name

_CONT = 0xFFFFFFFF
_MAX_METADATA = 1 << 28  # no real schema or batch header is this big: treat as garbage
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")


class _Garbage(Exception):
    pass


def _body_length(meta: memoryview) -> int:
    """bodyLength (field 3) of a flatbuffer `Message` table, with bounds checks."""
    n = len(meta)
    if n < 8:
        raise _Garbage("message header too short")
    table = _U32.unpack_from(meta, 0)[0]
    if table + 4 > n:
        raise _Garbage("bad message header")
    vtable = table - _I32.unpack_from(meta, table)[0]
    if vtable < 0 or vtable + 4 > n:
        raise _Garbage("bad message header")
    vt_size = _U16.unpack_from(meta, vtable)[0]
    if vt_size < 4 or vtable + vt_size > n:
        raise _Garbage("bad message header")
    if vt_size <= 4 + 2 * 3:
        return 0
    off = _U16.unpack_from(meta, vtable + 4 + 2 * 3)[0]
    if off == 0:
        return 0
    if table + off + 8 > n:
        raise _Garbage("bad message header")
    body = _I64.unpack_from(meta, table + off)[0]
    if body < 0:
        raise _Garbage("negative body length")
    return body


_EOS_MARKER = struct.pack("<Ii", _CONT, 0)  # what RunWriter.close() writes last


def stream_ended(path: str | os.PathLike) -> bool:
    """True when a stream file ends with the end-of-stream marker (its writer closed cleanly),
    read from the last 8 bytes only: cheap enough for listing many runs."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() < len(_EOS_MARKER):
                return False
            f.seek(-len(_EOS_MARKER), 2)
            return f.read(len(_EOS_MARKER)) == _EOS_MARKER
    except OSError:
        return False


def scan_messages(buf, start: int) -> tuple[list[tuple[int, int]], int, bool]:
    """Find complete messages in buf[start:].

    Returns (spans, end, eos): spans are (offset, length) of complete messages, end is the
    offset just past the last complete message (or past the EOS marker), eos says whether
    the end-of-stream marker was reached. Raises _Garbage for bytes that are no message.
    """
    mv = memoryview(buf)
    size = len(mv)
    pos = start
    spans: list[tuple[int, int]] = []
    while pos < size:
        rem = size - pos
        if rem < 4:
            if bytes(mv[pos:]) == b"\xff" * rem or not any(mv[pos:]):
                break  # torn prefix
            raise _Garbage(f"bad message prefix at byte {pos}")
        cont = _U32.unpack_from(mv, pos)[0]
        if cont != _CONT:
            if not any(mv[pos:]):
                break  # zero-filled tail: file extended but data never reached the disk
            raise _Garbage(f"not an Arrow IPC stream message at byte {pos}")
        if rem < 8:
            break
        mlen = _I32.unpack_from(mv, pos + 4)[0]
        if mlen == 0:
            return spans, pos + 8, True
        if mlen < 0 or mlen > _MAX_METADATA:
            raise _Garbage(f"bad message length at byte {pos}")
        if rem < 8 + mlen:
            break
        body = _body_length(mv[pos + 8 : pos + 8 + mlen])
        total = 8 + mlen + body
        if rem < total:
            break
        spans.append((pos, total))
        pos += total
    return spans, pos, False


def _map(path: Path) -> pa.Buffer | None:
    """Zero-copy view of the file as it is now; None when empty."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise RunError(f"{path}: stream file disappeared") from None
    if size == 0:
        return None
    with pa.memory_map(str(path), "r") as mm:
        return mm.read_buffer(size)


def _schema_for_name(path: Path) -> pa.Schema | None:
    parsed = parse_stream_name(Path(path).name)
    return TABLE_SCHEMAS.get(parsed[0]) if parsed else None


class StreamTail:
    """Incremental reader of one stream file: each read_new() returns only batches appended since the last call.

    Keeps the byte offset just past the last complete message, so a torn or in-progress
    message at the end is retried on the next poll instead of being lost or raising.
    `offset`/`schema` can be given to resume from a known position (used after compaction).
    """

    def __init__(self, path: str | os.PathLike, offset: int = 0, schema: pa.Schema | None = None):
        self.path = Path(path)
        self.offset = int(offset)
        self.schema = schema
        self.ended = False  # end-of-stream marker seen: the writer closed cleanly
        if self.offset > 0 and self.schema is None:
            self._read_schema_only()

    def _garbage(self, why: str) -> RunError:
        return RunError(f"{self.path}: not a readable fp8scope stream ({why})")

    def _read_schema_only(self) -> None:
        buf = _map(self.path)
        if buf is None:
            raise self._garbage("empty file but a resume offset was given")
        try:
            spans, _, _ = scan_messages(buf.slice(0, min(len(buf), self.offset)), 0)
        except _Garbage as e:
            raise self._garbage(str(e)) from None
        if not spans:
            raise self._garbage("no schema message")
        self.schema = self._parse_schema(buf, spans[0])

    def _parse_schema(self, buf: pa.Buffer, span: tuple[int, int]) -> pa.Schema:
        try:
            msg = pa.ipc.read_message(buf.slice(*span))
            if msg.type != "schema":
                raise _Garbage(f"first message is a {msg.type}, not a schema")
            schema = pa.ipc.read_schema(msg)
            schema.names, schema.metadata  # noqa: B018 - decode now: a corrupt name is not UTF-8
            return schema
        except UnicodeDecodeError:
            raise self._garbage("schema names are not UTF-8") from None
        except (pa.ArrowException, OSError, _Garbage) as e:  # ArrowIOError is an OSError
            raise self._garbage(str(e).splitlines()[0]) from None

    def read_new(self) -> list[pa.RecordBatch]:
        """Batches completed since the previous call (possibly none). Never raises on a torn tail."""
        if self.ended:
            return []
        buf = _map(self.path)
        if buf is None or len(buf) <= self.offset:
            return []
        try:
            spans, end, eos = scan_messages(buf, self.offset)
        except _Garbage as e:
            raise self._garbage(str(e)) from None
        if not spans:
            self.ended = eos
            self.offset = end
            return []
        if self.schema is None:
            self.schema = self._parse_schema(buf, spans[0])
            first = spans[0][0] + spans[0][1]
            batches = self._decode_from_start(buf, first, end if not eos else spans[-1][0] + spans[-1][1], len(spans) - 1)
        else:
            batches = self._decode_spans(buf, spans)
        self.offset = end
        self.ended = eos
        return batches

    def _decode_from_start(self, buf: pa.Buffer, first: int, stop: int, n: int) -> list[pa.RecordBatch]:
        # Fast path for a whole file: one C++ stream reader over the complete bytes, zero-copy.
        if n == 0:
            return []
        try:
            reader = pa.ipc.open_stream(buf.slice(0, stop))
            return [_validated(b) for b in reader]
        except (pa.ArrowException, OSError) as e:  # corrupt bodies surface as ArrowIOError (an OSError)
            raise self._garbage(str(e).splitlines()[0]) from None

    def _decode_spans(self, buf: pa.Buffer, spans: list[tuple[int, int]]) -> list[pa.RecordBatch]:
        out = []
        for off, length in spans:
            try:
                msg = pa.ipc.read_message(buf.slice(off, length))
                if msg.type != "record batch":
                    raise _Garbage(f"unexpected {msg.type} message at byte {off}")
                out.append(_validated(pa.ipc.read_record_batch(msg, self.schema)))
            except (pa.ArrowException, OSError, _Garbage) as e:  # ArrowIOError is an OSError
                raise self._garbage(str(e).splitlines()[0]) from None
        return out


def _validated(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Full validation (offsets, lengths, UTF-8) of a decoded batch. Arrow's IPC reader trusts the
    body's buffers; a corrupted stream (bit flips, hand edits) then decodes into arrays whose
    offsets point outside their data, and the first kernel that touches them segfaults."""
    batch.validate(full=True)
    return batch


def read_stream(path: str | os.PathLike, schema: pa.Schema | None = None) -> pa.Table:
    """Everything complete in one stream file as a table; torn tail ignored.

    Empty or header-less files give an empty table with `schema` (or the table's
    registered schema guessed from the file name, or an empty schema).
    """
    tail = StreamTail(path)
    batches = tail.read_new()
    sch = tail.schema or schema or _schema_for_name(Path(path)) or pa.schema([])
    return pa.Table.from_batches(batches, schema=sch)
