"""MessageTemplate: one record batch serialized once, its fixed-width columns rewritten in place.

A cheap training step logs the same rows as the step before it (same tensors, same order,
same nulls); only the step number and a few float columns change. Building Arrow arrays, a
record batch and its IPC serialization anew costs ~0.3 ms of the training thread per step on
CPU, where ``Monitor.step`` returns only once the step is on disk. The bytes of the next
message differ from the last one's only inside those columns' data buffers, so a template
keeps the serialized message and numpy views onto those buffers: filling the views and
copying the bytes out is a few microseconds, and the result is exactly what
``batch.serialize()`` of the new batch would give.

Where the buffers lie is not computed by hand: the template reads its own bytes back with
pyarrow's IPC reader (zero-copy) and takes each column's data-buffer address, then checks that
the views hold the batch's values. Columns with nulls cannot be rewritten this way (their
validity bitmap and null count would change with the values), so :meth:`MessageTemplate.fill`
is only for values without nulls; the caller keeps the ordinary path for those steps.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa


class TemplateError(ValueError):
    """The batch cannot serve as a template (a column with nulls, not fixed-width, or not found)."""


class MessageTemplate:
    """The IPC message of ``batch``, with ``columns`` (fixed-width, no nulls) rewritable."""

    __slots__ = ("_bytes", "views", "_memory", "num_rows", "schema")

    def __init__(self, batch: pa.RecordBatch, columns: Sequence[str]):
        self._bytes = bytearray(batch.serialize().to_pybytes())
        self.num_rows = batch.num_rows
        self.schema = batch.schema
        buf = pa.py_buffer(self._bytes)
        back = pa.ipc.read_record_batch(pa.ipc.read_message(buf), batch.schema)
        self.views: dict[str, np.ndarray] = {}
        self._memory: dict[str, memoryview] = {}  # the same bytes, for fill_numbers
        for name in columns:
            col = back.column(name)
            if col.null_count or not pa.types.is_primitive(col.type) or pa.types.is_boolean(col.type):
                raise TemplateError(f"column {name!r} ({col.type}, {col.null_count} nulls) cannot be rewritten")
            data = col.buffers()[1]
            offset = data.address - buf.address
            dtype = np.dtype(col.type.to_pandas_dtype())
            if offset < 0 or offset + len(col) * dtype.itemsize > len(self._bytes):
                raise TemplateError(f"column {name!r} is not inside the message (the reader copied it)")
            view = np.frombuffer(self._bytes, dtype=dtype, count=len(col), offset=offset)
            if not np.array_equal(view, batch.column(name).to_numpy(), equal_nan=dtype.kind == "f"):
                raise TemplateError(f"column {name!r}: the view does not hold the batch's values")
            self.views[name] = view
            self._memory[name] = memoryview(self._bytes)[offset:offset + view.nbytes].cast(dtype.char)

    def fill(self, values: dict[str, "np.ndarray | int | float"]) -> bytes:
        """The message of the template's batch with ``values`` in its rewritable columns (arrays of
        ``num_rows`` or scalars; a float column's values must hold no NaN if the column was built
        with NaN as null)."""
        for name, v in values.items():
            self.views[name][:] = v
        return bytes(self._bytes)

    def fill_numbers(self, values: dict[str, "Sequence[float] | int | float"]) -> bytes:
        """:meth:`fill` for a few Python numbers (a step's scalars): plain memoryview stores, no
        numpy, whose first call in ``Monitor.step`` after the optimizer costs more than the copy
        (integer columns take ints, float columns any real number)."""
        for name, v in values.items():
            memory = self._memory[name]
            if isinstance(v, (int, float)):
                for i in range(len(memory)):
                    memory[i] = v
            else:
                for i, x in enumerate(v):
                    memory[i] = x
        return bytes(self._bytes)

    def message(self) -> bytes:
        """The message as its columns hold it now (after a fill, or after the kernel wrote into
        :meth:`address` directly)."""
        return bytes(self._bytes)

    def address(self, name: str) -> int:
        """Where a rewritable column's values lie (for the kernel: ``step_records.cheap_log_message``)."""
        return self.views[name].ctypes.data


def batch_of_message(message: "bytes | pa.RecordBatch | None", schema: pa.Schema) -> "pa.RecordBatch | None":
    """A record batch from bytes that :meth:`MessageTemplate.fill` made (zero-copy); batches and
    None pass through. Readers of a step's rows (listeners) call it off the training thread."""
    if message is None or isinstance(message, pa.RecordBatch):
        return message
    return pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(message)), schema)
