"""Embedded, crash-safe, append-only run store: manifest, per-rank Arrow IPC streams, readers, compaction.

See docs/store.md for the folder layout and the guarantees.
"""

from fp8scope.store.compact import compact, read_compacted
from fp8scope.store.manifest import new_manifest, read_manifest, update_manifest, write_manifest
from fp8scope.store.reader import StreamTail, read_stream
from fp8scope.store.writer import RunWriter, next_segment

__all__ = [
    "RunWriter",
    "StreamTail",
    "compact",
    "new_manifest",
    "next_segment",
    "read_compacted",
    "read_manifest",
    "read_stream",
    "update_manifest",
    "write_manifest",
]
