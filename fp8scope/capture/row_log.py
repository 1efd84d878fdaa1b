"""The step's what-if rows as the kernel writes them: one flat float64 buffer per monitor.

Why: on a what-if cheap step every activation, weight and gradient of every plain Linear is a
capture, inside hooks where the interpreter is cold after each matmul. With the kernel built, a
capture is a single call of ``fp8s_bank_capture`` (``fp8scope/native/fused_stats.c``): it
measures the amax, records it in the tensor's :class:`~fp8scope.emulate.scaling_bank.HostDelayedBank`
slot and appends the row here, so no tuple, list or float object is made per tensor, and the
step's end reads all rows as one array.

A row is ``WIDTH`` doubles: amax, scale, scale_inv, expected amax, key id, numel, and ``after``,
the number of the collector's other captures (``StepCollector.caps``) that came before it, so
rows from both places merge back into execution order.

The kernel sees the log through ``meta``, an int64 array: row count, capacity, the row buffer's
address, captures refused because the log was full (they went the Python way, and the buffer
grows when the step ends), and the thread count for the amax pass.
"""

from __future__ import annotations

from array import array

WIDTH = 7
AMAX, SCALE, SCALE_INV, EXPECTED, KEY, NUMEL, AFTER = range(WIDTH)
_ROWS, _CAPACITY, _BUFFER, _OVERFLOW, _THREADS = range(5)


class RowLog:
    """Rows the kernel appends during a step; :meth:`take` hands them over at the step's end."""

    def __init__(self, capacity: int = 1024):
        self.meta = array("q", [0, 0, 0, 0, 1])
        self.address = self.meta.buffer_info()[0]  # fixed: the array never changes size
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._rows = array("d", bytes(8 * WIDTH * capacity))
        self.meta[_CAPACITY] = capacity
        self.meta[_BUFFER] = self._rows.buffer_info()[0]

    def set_threads(self, n: int) -> None:
        """Threads the kernel may use for one tensor's amax (torch's setting, read at each step's end)."""
        self.meta[_THREADS] = max(1, int(n))

    def __len__(self) -> int:
        return self.meta[_ROWS]

    def take(self) -> array | None:
        """This step's rows (a copy: an ``array`` of doubles, ``WIDTH`` per row), None if there are
        none; the log is empty afterwards, and larger if a capture found it full.

        An ``array`` slice, not numpy: in the step's end, right after the optimizer, the first call
        of each numpy function costs 10-20 us (its code is out of the caches), ~20x its warm cost."""
        n = self.meta[_ROWS]
        out = self._rows[:n * WIDTH] if n else None
        self.meta[_ROWS] = 0
        refused = self.meta[_OVERFLOW]
        if refused:
            self.meta[_OVERFLOW] = 0
            self._allocate(2 * (self.meta[_CAPACITY] + refused))
        return out
