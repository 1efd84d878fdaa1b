"""Delayed scaling for many tensors at once, in host floats: the what-if monitor's CPU states.

Why a bank: the what-if monitor simulates delayed scaling for every activation, weight and
gradient of every plain ``nn.Linear`` on every step. With one :class:`ScalingState` per tensor,
each capture ran a chain of Python calls and each step ran one update per tensor, inside hooks
where the interpreter is cold after the layer's matmul. Here a capture is one call that stores
the amax and returns the row, and the step's updates run as a handful of numpy operations over
all tensors at the step's end (TE's own timing).

The numbers are :class:`ScalingState`'s (``fp8scope/emulate/scaling.py`` documents TE's update
rule): the same roll, ``fmaxf``-style max that ignores NaN, kept scale on a zero / NaN / Inf
amax, float32 rounding of ``scaled_max / amax`` and of ``1 / scale`` (a float64 division or
reciprocal of float32 values rounded once to float32 is the correctly rounded float32 result).
``tests/test_scaling_bank.py`` checks them against ``ScalingState`` sequence by sequence.

Layout: flat ``array.array`` buffers, which a capture reads and writes as cheaply as lists and the
kernel (``fp8s_delayed_update`` in ``fp8scope/native/fused_stats.c``) updates in place: slot ``i``
keeps a ring of ``amax_history_len`` floats at ``ring[i * len:]`` with the current (row 0) slot at
``head[i]``, and the amax recorded this step waits in ``cur[i]`` until the update writes it there.
Without the kernel, numpy views onto the same buffers do the update.
"""

from __future__ import annotations

from array import array

import numpy as np

from .. import native
from ..formats import Fp8Format
from .recipes import DelayedScaling
from .scaling import _FP32_MAX, ScalingState, scaled_max


class HostDelayedBank:
    """The delayed-scaling state of many tensors under one :class:`DelayedScaling` recipe.

    ``slot = bank.add(fmt)`` adds a tensor (initial state as TE: history zeros, scale 1,
    expected amax ``fp8_max * 2**-margin``). Per capture, ``bank.record(slot, amax)`` returns
    ``(amax, scale, scale_inv, expected_amax)``: the scales in use now, and ``amax`` recorded
    for the next update. ``bank.update()`` applies every pending update (the step's end).
    A second capture of a slot before ``update()`` (micro-batches) first applies that slot's
    own pending update, as ``ScalingState`` does when it quantizes the same tensor again.
    """

    def __init__(self, recipe: DelayedScaling):
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"HostDelayedBank needs a DelayedScaling recipe, got {type(recipe).__name__}")
        self.recipe = recipe
        self.length = int(recipe.amax_history_len)
        self._most_recent = recipe.amax_compute_algo != "max"
        self._ring = array("d")
        self._head = array("q")
        self._scaled_max = array("d")
        self.scale = array("d")
        self.scale_inv = array("d")
        self.expected = array("d")
        self.kept = array("b")  # the latest update kept the old scale (amax 0, NaN or Inf)
        self.cur = array("d")  # amax recorded since the last update (history row 0)
        self.pending = array("b")
        self.updates = array("q")  # updates applied
        self._wmax = array("d")  # max of each ring without its row 0 (from 0, NaN ignored): the window max in O(1)
        self._any_pending = False
        self._buffers = (self._ring, self._head, self.cur, self.pending, self._scaled_max, self.scale,
                         self.scale_inv, self.expected, self.kept, self.updates, self._wmax)  # the kernel's order
        self._strides = tuple(a.itemsize * (self.length if a is self._ring else 1) for a in self._buffers)
        # the kernel's view of the bank (fp8s_bank_capture's bank_t): the buffers' addresses (set by
        # add(), which may move them), then len, most_recent and the row log's address; this array
        # never changes size, so its own address holds
        self._ctx = array("q", [0] * 14)
        self._ctx[11], self._ctx[12] = self.length, int(self._most_recent)
        self.ctx_address = self._ctx.buffer_info()[0]
        self._log = None  # kept alive here: the kernel writes to it through a raw address

    def add(self, fmt: Fp8Format) -> int:
        """A new tensor's slot, in the initial state."""
        sm = scaled_max(fmt, self.recipe.margin)
        self._ring.extend([0.0] * self.length)
        self._head.append(0)
        self._scaled_max.append(sm)
        self.scale.append(1.0)
        self.scale_inv.append(1.0)
        self.expected.append(sm)
        self.kept.append(0)
        self.cur.append(0.0)
        self.pending.append(0)
        self.updates.append(0)
        self._wmax.append(0.0)
        self._ctx[:11] = array("q", (a.buffer_info()[0] for a in self._buffers))  # the buffers may have moved
        return len(self.scale) - 1

    def attach_log(self, log) -> None:
        """Where the kernel's captures of this bank's slots append their rows (a
        :class:`~fp8scope.capture.row_log.RowLog`; see ``native.bank_capture_fn``)."""
        self._log = log
        self._ctx[13] = log.address

    # ---- captures ------------------------------------------------------------------------
    def record(self, slot: int, amax: float) -> tuple[float, float, float, float]:
        """Record ``amax`` (NaN-propagating, a float32 value) for ``slot``; returns the capture's
        row ``(amax, scale, scale_inv, expected_amax)`` with the scales in use now.

        :meth:`scales` then :meth:`record_amax`, written out: the per-tensor hot path of every
        what-if cheap step, where each Python call costs microseconds."""
        if self.pending[slot]:
            self._update_one(slot)
        self.cur[slot] = amax
        self.pending[slot] = 1
        self._any_pending = True
        return amax, self.scale[slot], self.scale_inv[slot], self.expected[slot]

    def scales(self, slot: int) -> tuple[float, float, float]:
        """``(scale, scale_inv, expected_amax)`` to quantize ``slot``'s tensor with now (a pending
        update applied first); :meth:`record_amax` then records the amax measured with them."""
        if self.pending[slot]:
            self._update_one(slot)
        return self.scale[slot], self.scale_inv[slot], self.expected[slot]

    def record_amax(self, slot: int, amax: float) -> None:
        """Second half of :meth:`scales`: record the amax of the tensor just scaled."""
        self.cur[slot] = amax
        self.pending[slot] = 1
        self._any_pending = True

    def to_state(self, slot: int, fmt: Fp8Format) -> ScalingState:
        """``slot``'s state as a :class:`ScalingState` of its own (a tensor that left the CPU goes
        on there, on its device, from the same history and scales)."""
        return ScalingState.from_host(self.recipe, fmt, self.history(slot), self.scale[slot], self.scale_inv[slot],
                                      self.expected[slot], bool(self.kept[slot]), bool(self.pending[slot]),
                                      self.updates[slot])

    def history(self, slot: int) -> list[float]:
        """``slot``'s amax history, row 0 (the amax recorded since the last update) first."""
        base, head, n = slot * self.length, self._head[slot], self.length
        return [self.cur[slot]] + [self._ring[base + (head + i) % n] for i in range(1, n)]

    # ---- the update ----------------------------------------------------------------------
    def update(self, captured: bool = False) -> None:
        """Apply every pending update: one kernel call (or one numpy pass) over all slots.
        ``captured``: the kernel's captures (which Python does not see) recorded some this step."""
        if not (self._any_pending or captured):
            return
        self._any_pending = False
        self._update_all()

    def _update_one(self, slot: int) -> None:
        # a second capture before the step's end (micro-batches): this slot's update alone, in
        # O(1), since every capture of a gradient-accumulation step comes here
        self._update_slots(slot, slot + 1)

    def _update_all(self) -> None:
        self._update_slots(0, len(self.scale))

    def _update_slots(self, lo: int, hi: int) -> None:
        """The pending updates of slots ``lo`` to ``hi - 1``."""
        if hi <= lo:
            return
        fn = native.delayed_update_fn()
        if fn is None:
            self._update_numpy(lo, hi)
            return
        fn(hi - lo, self.length, int(self._most_recent),
           *(p + lo * stride for p, stride in zip(self._ctx[:11], self._strides)))

    def _update_numpy(self, lo: int, hi: int) -> None:
        """The kernel's update as numpy operations on views of the same buffers (no C compiler)."""
        f64, n, length = np.float64, len(self.scale), self.length
        idx = lo + np.flatnonzero(np.frombuffer(self.pending, dtype=np.int8)[lo:hi])
        ring = np.frombuffer(self._ring, dtype=f64).reshape(n, length)
        head = np.frombuffer(self._head, dtype=np.int64)
        cur = np.frombuffer(self.cur, dtype=f64)
        scale, scale_inv = np.frombuffer(self.scale, dtype=f64), np.frombuffer(self.scale_inv, dtype=f64)
        expected = np.frombuffer(self.expected, dtype=f64)
        last = cur[idx]
        roll = last != 0  # NaN != 0: a NaN amax rolls in like any other
        amax = last.copy() if self._most_recent else np.zeros(len(idx))  # 0 where nothing rolled
        r = idx[roll]
        ring[r, head[r]] = last[roll]  # row 0 takes the recorded amax: the window is complete
        if not self._most_recent and len(r):
            # fmaxf from 0 over the last `length` recorded amaxes: NaN rows never win
            amax[roll] = np.fmax(np.fmax.reduce(ring[r], axis=1), 0.0)
        head[r] = (head[r] + 1) % length  # roll(h, -1): the oldest row becomes row 0 ...
        ring[r, head[r]] = 0.0  # ... and is cleared
        if len(r):  # the kernel's running window max, kept true for it
            np.frombuffer(self._wmax, dtype=f64)[r] = np.fmax(np.fmax.reduce(ring[r], axis=1), 0.0)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            valid = np.isfinite(amax) & (amax > 0)
            sf = (np.frombuffer(self._scaled_max, dtype=f64)[idx] / np.where(valid, amax, 1.0)).astype(np.float32).astype(f64)
            sf[np.isinf(sf)] = _FP32_MAX
            scale[idx] = np.where(valid, sf, scale[idx])
            scale_inv[idx] = (1.0 / scale[idx]).astype(np.float32)
        expected[idx] = np.where(valid, amax, expected[idx])
        np.frombuffer(self.kept, dtype=np.int8)[idx] = ~valid
        cur[idx] = 0.0
        np.frombuffer(self.pending, dtype=np.int8)[idx] = 0
        np.frombuffer(self.updates, dtype=np.int64)[idx] += 1
