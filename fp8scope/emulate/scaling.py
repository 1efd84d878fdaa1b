"""Per-tensor FP8 scaling state, faithful to Transformer Engine, with no host sync.

One :class:`ScalingState` belongs to one tensor (one per (module, role)). It is
usable on its own: the monitor feeds it the tensors of a plain ``nn.Linear`` to
ask "which scale would TE have used here?".

TE semantics reproduced (TE 2.x, ``transformer_engine/common/recipe/delayed_scaling.cu``,
``kernel_bulk``, the default fused path behind
``tex.fused_amax_and_scale_update_after_reduction``; and ``recipe_common.cuh``,
``compute_scale_from_amax``, for current scaling):

Delayed scaling, one update from history ``h`` (row 0 = most recent amax) and scale ``s``:

1. ``last = h[0]``. If ``last != 0`` (NaN counts as non-zero) the history rolls:
   ``h <- roll(h, -1)``, then ``h[0] = 0``. If ``last == 0`` TE skips the roll
   (the tensor was not used / was all zeros) and keeps the scale.
2. ``amax = max(h)`` ("max", reduced with ``fmaxf`` so NaN rows are *ignored*)
   or ``amax = last`` ("most_recent").
3. ``s <- (fp8_max * 2**-margin) / amax`` if amax is finite and > 0, else ``s`` is
   kept; a result of +inf (amax tiny) becomes float32 max. ``scale_inv = 1 / s``.

TE runs that update at the end of a step; we run it lazily at the start of the
next quantization of the same tensor (:meth:`ScalingState.begin`), which gives
the same scale for the same sequence of amaxes.

Tensors are updated functionally (new tensors, never in place) so the tensors
returned by :meth:`begin` stay valid after later steps: the monitor stacks them
at the end of a step. No ``.item()``, no Python branch on a tensor value.

On the CPU the state lives in Python floats instead (``host`` mode, the default there):
reading a CPU tensor is no device sync, and the ~20 tiny tensor ops of one update cost far
more than the arithmetic (they were most of the what-if monitor's overhead). The float32
results are the same bit for bit: a division or reciprocal computed in float64 and rounded
once to float32 is the correctly rounded float32 result; tests check both modes against each
other. ``scale = scaled_max / amax`` is a true division in both modes, as TE's
``compute_scale_from_amax`` (``python_float / tensor`` in torch is ``reciprocal() * x``,
which differs from the division by an ulp for about a quarter of all amaxes).
"""

from __future__ import annotations

import math
import struct
from collections import deque
from typing import NamedTuple

import torch

from .. import native
from ..formats import Fp8Format, get_format
from .recipes import CurrentScaling, DelayedScaling

_FP32_MAX = float(torch.finfo(torch.float32).max)
_F32 = struct.Struct("f")


def round_f32(v: float) -> float:
    """``v`` rounded to float32 (to nearest, ties to even; past float32's range: +-inf)."""
    try:
        return _F32.unpack(_F32.pack(v))[0]
    except OverflowError:  # struct refuses a finite value that rounds to inf
        return math.copysign(math.inf, v)


def scaled_max(fmt: Fp8Format, margin: float) -> float:
    """``fp8_max * 2**-margin`` rounded once to float32: TE's ``scaled_max``, the amax a scale of 1
    corresponds to and the numerator of every delayed-scaling scale."""
    return round_f32(fmt.max * 2.0 ** (-margin))


class Scales(NamedTuple):
    """What one quantization uses. Unpacks as ``scale, scale_inv, expected_amax``."""

    scale: torch.Tensor  # 0-d float32: multiply by this before the cast
    scale_inv: torch.Tensor  # 0-d float32: 1 / scale, multiply after the decode
    expected_amax: torch.Tensor  # 0-d float32: the amax the scale was derived from


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a 0-d float32 tensor, NaN if x holds a NaN, 0 for an empty tensor.

    NaN propagates on purpose (TE's ``fmaxf`` reduction would hide it): a
    monitor must see a NaN amax. ``aminmax`` is one pass with no ``abs`` copy.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(hi, lo.neg()).to(torch.float32)


def scale_from_amax(amax: torch.Tensor, scaled_max: torch.Tensor,
                    fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``compute_scale_from_amax`` on tensors: ``scaled_max / amax`` where the amax is finite
    and > 0, else ``fallback``; +inf becomes FLT_MAX. Returns the scales and where they are new."""
    valid = torch.isfinite(amax) & (amax > 0)
    # Divide only where valid; elsewhere divide by 1 so no inf/NaN is produced. A true
    # division (TE's `max_fp8 / amax`), not `float / tensor` (= reciprocal * float).
    sf = torch.div(scaled_max, torch.where(valid, amax, 1.0))
    sf = torch.where(valid, sf, fallback)
    sf = torch.where(torch.isinf(sf), _FP32_MAX, sf)
    return sf, valid


def delayed_update(history: torch.Tensor, scaled_max: torch.Tensor, scale: torch.Tensor, expected: torch.Tensor,
                   most_recent: bool) -> tuple[torch.Tensor, ...]:
    """TE's delayed-scaling update as tensors, for one tensor (``history`` of shape ``[len]``, the
    others 0-d) or ``k`` at once (``[k, len]`` and ``[k]``). Row 0 of a history
    (``history[..., 0]``) is the amax recorded since the last update. Returns the new
    ``(history, scale, scale_inv, expected_amax, kept)``, ``kept`` where the old scale stays
    (amax 0, NaN or Inf).

    Roll (``roll(h, -1)``, the new row 0 cleared) only where the recorded amax is not 0 (NaN rolls);
    the amax is the window's max from 0 ignoring NaN ("max", ``fmaxf``) or the recorded one
    ("most_recent"). :class:`ScalingState` runs it for its tensor, the what-if monitor's
    :class:`~fp8scope.emulate.device_bank.DeviceDelayedBank` for all its tensors in one call."""
    last = history[..., 0]
    roll = last != 0  # NaN != 0 is true: a NaN amax rolls in like any other
    rolled = torch.roll(history, -1, -1)
    rolled[..., 0] = 0.0
    if most_recent:
        amax = last.clone()
    else:  # fmaxf semantics: NaN rows are ignored, the reduction starts from 0
        amax = torch.where(torch.isnan(history), 0.0, history).amax(-1)
        amax = torch.where(roll, amax, 0.0)
    new_scale, valid = scale_from_amax(amax, scaled_max, scale)
    return (torch.where(roll[..., None], rolled, history), new_scale, 1.0 / new_scale,
            torch.where(valid, amax, expected), ~valid)


class ScalingState:
    """Scaling state for one tensor under one recipe and element format.

    ``state.begin(x)`` returns :class:`Scales` for quantizing ``x`` now and, if
    ``record`` is true, records ``x``'s amax for the next update (delayed
    scaling). Under :class:`CurrentScaling` nothing is kept between calls.

    Initial state (as TE): history zeros, scale 1, scale_inv 1. ``expected_amax``
    starts at ``fp8_max * 2**-margin``, the amax a scale of 1 corresponds to.
    """

    def __init__(
        self,
        recipe: DelayedScaling | CurrentScaling,
        fmt: Fp8Format | str,
        device: torch.device | str | None = None,
        host: bool | None = None,
    ) -> None:
        if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
            raise TypeError(f"recipe must be DelayedScaling or CurrentScaling, got {type(recipe).__name__}")
        self.recipe = recipe
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.scaled_max = scaled_max(self.fmt, recipe.margin)
        self.delayed = isinstance(recipe, DelayedScaling)
        self.updates = 0  # how many delayed-scaling updates ran (a host int, not a tensor)
        self._pending = False
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        # host=None: Python floats on the CPU, tensors elsewhere; True/False force a mode on the CPU
        self._host_allowed = host is not False
        self._host = self._device.type == "cpu" and self._host_allowed
        self._init_tensors(self._device)

    @classmethod
    def from_host(cls, recipe: DelayedScaling, fmt: Fp8Format, history: list[float], scale: float,
                  scale_inv: float, expected_amax: float, kept: bool, pending: bool, updates: int) -> "ScalingState":
        """A host-mode state with this history (row 0 first) and these scales (a
        :class:`~fp8scope.emulate.scaling_bank.HostDelayedBank` slot going on alone)."""
        state = cls(recipe, fmt, host=True)
        state._set_host_history(list(history))
        state._s, state._si, state._e, state._k = scale, scale_inv, expected_amax, kept
        state._pending, state.updates = pending, updates
        return state

    # ---- state -------------------------------------------------------------------------
    def _init_tensors(self, device: torch.device) -> None:
        n = self.recipe.amax_history_len if self.delayed else 1
        # host mode: the same state as float32 values in Python floats. The history is a ring
        # (h[i] = _ring[(_head + i) % n]) and "max" keeps a monotonic deque of the recorded amaxes
        # in the window, so an update costs O(1) instead of O(amax_history_len) (TE's default 1024)
        self._set_host_history([0.0] * n)
        self._s, self._si, self._e, self._k = 1.0, 1.0, self.scaled_max, False
        self._scales_cache: Scales | None = None
        self._la = 0.0
        f32 = dict(dtype=torch.float32, device=device)
        self._history = torch.zeros(n, **f32)
        self._scale = torch.ones((), **f32)
        self._scale_inv = torch.ones((), **f32)
        self._expected = torch.full((), self.scaled_max, **f32)
        self._kept = torch.zeros((), dtype=torch.bool, device=device)
        self._last_amax = torch.zeros((), **f32)
        self._scaled_max_t = torch.tensor(self.scaled_max, **f32)  # the numerator of every scale, made once

    def reset(self) -> None:
        """Back to the initial state (history zeros, scale 1)."""
        self.updates = 0
        self._pending = False
        self._init_tensors(self._device)

    def _to(self, device: torch.device) -> None:
        """Follow the tensor to its device (e.g. after ``model.cuda()``); async copies."""
        if self._host and device.type != "cpu":  # leaving the CPU: the float state becomes tensors
            self._sync_tensors()
            self._host = False
        elif not self._host and device.type == "cpu" and self._host_allowed:
            self._sync_floats(self._history.to("cpu"))
            self._host = True
        self._device = device
        for name in ("_history", "_scale", "_scale_inv", "_expected", "_kept", "_last_amax", "_scaled_max_t"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))

    def _sync_tensors(self) -> None:
        """Host floats -> the tensor fields (when leaving host mode or when asked for tensors)."""
        f32 = dict(dtype=torch.float32, device=self._device)
        self._history = torch.tensor(self._host_history(), **f32)
        self._scale = torch.tensor(self._s, **f32)
        self._scale_inv = torch.tensor(self._si, **f32)
        self._expected = torch.tensor(self._e, **f32)
        self._kept = torch.tensor(self._k, device=self._device)

    def _sync_floats(self, history_cpu: torch.Tensor) -> None:
        self._set_host_history([float(v) for v in history_cpu.tolist()])
        self._s, self._si = float(self._scale), float(self._scale_inv)
        self._e, self._k = float(self._expected), bool(self._kept)
        self._scales_cache = None

    def _host_scales(self) -> Scales:
        """The current host scales as 0-d tensors, made once per update."""
        if self._scales_cache is None:
            t = torch.tensor([self._s, self._si, self._e], dtype=torch.float32)
            self._scales_cache = Scales(t[0], t[1], t[2])
        return self._scales_cache

    @property
    def amax_history(self) -> torch.Tensor:
        """Copy of the history, shape [amax_history_len], row 0 = most recent amax."""
        if self._host:
            return torch.tensor(self._host_history(), dtype=torch.float32)
        return self._history.clone()

    @property
    def scale(self) -> torch.Tensor:
        """Scale the next quantization would use if no update were pending."""
        return self._host_scales().scale if self._host else self._scale

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._host_scales().scale_inv if self._host else self._scale_inv

    @property
    def last_amax(self) -> torch.Tensor:
        """amax of the tensor passed to the latest :meth:`begin` (NaN-propagating)."""
        if self._last_amax is None:  # host mode keeps a float until someone asks for a tensor
            self._last_amax = torch.tensor(self._la, dtype=torch.float32)
        return self._last_amax

    @property
    def scale_kept(self) -> torch.Tensor:
        """0-d bool: the latest update kept the old scale (amax 0, NaN or Inf).

        TE does this silently; a monitor should flag it.
        """
        return torch.tensor(self._k) if self._host else self._kept

    @property
    def pending(self) -> bool:
        """An amax has been recorded and its update not yet applied."""
        return self._pending

    # ---- the update ------------------------------------------------------------------
    def _scale_from_amax(self, amax: torch.Tensor, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return scale_from_amax(amax, self._scaled_max_t, fallback)

    def update(self) -> None:
        """Apply the pending delayed-scaling update now (no-op if none is pending).

        :meth:`begin` calls it; call it yourself to mirror TE's end-of-step timing.
        """
        if not (self.delayed and self._pending):
            return
        if self._host:
            self._host_update()
            return
        self._history, self._scale, self._scale_inv, self._expected, self._kept = delayed_update(
            self._history, self._scaled_max_t, self._scale, self._expected, self.recipe.amax_compute_algo != "max")
        self._pending = False
        self.updates += 1

    def _host_scale_from_amax(self, amax: float, fallback: float) -> tuple[float, bool]:
        valid = math.isfinite(amax) and amax > 0
        if not valid:
            return fallback, False
        sf = round_f32(self.scaled_max / amax)
        return (_FP32_MAX if math.isinf(sf) else sf), True

    def _set_host_history(self, h: list[float]) -> None:
        """Host history from ``h`` (row 0 = the current slot): the ring, and the deque holding the
        recorded amaxes h[1], ..., h[n-1] (oldest first) that can still be the window's max."""
        self._ring, self._head, self._seq = list(h), 0, 0
        self._window: deque[tuple[int, float]] = deque()
        for v in h[1:]:
            self._push_recorded(v)

    def _host_history(self) -> list[float]:
        n = len(self._ring)
        return [self._ring[(self._head + i) % n] for i in range(n)]

    def _push_recorded(self, v: float) -> None:
        """``v`` enters the history window (TE's roll); NaN takes a slot but never wins the max."""
        self._seq += 1
        win = self._window
        if v == v:
            while win and win[-1][1] <= v:
                win.pop()
            win.append((self._seq, v))
        while win and win[0][0] <= self._seq - len(self._ring):
            win.popleft()

    def _host_update(self) -> None:
        """:meth:`update` on host floats, step for step the same as the tensor code above."""
        n = len(self._ring)
        last = self._ring[self._head]
        roll = last != 0  # NaN != 0 is true
        if roll:
            self._push_recorded(last)  # the window is now the last n recorded amaxes, `last` included
            self._head = (self._head + 1) % n  # roll(h, -1): row 1 becomes row 0 ...
            self._ring[self._head] = 0.0  # ... and is cleared: the oldest amax falls off
        if self.recipe.amax_compute_algo == "max":
            # fmaxf from 0: NaN ignored; no roll, no amax
            amax = max(0.0, self._window[0][1]) if (roll and self._window) else 0.0
        else:
            amax = last
        scale, valid = self._host_scale_from_amax(amax, self._s)
        self._s = scale
        self._si = round_f32(1.0 / scale)
        if valid:
            self._e = amax
        self._k = not valid
        self._scales_cache = None
        self._pending = False
        self.updates += 1

    def begin(self, x: torch.Tensor, record: bool = True) -> Scales:
        """Scales to quantize ``x`` with now; then record ``x``'s amax if ``record``.

        Delayed: applies the pending update (from the amax recorded last time),
        returns the resulting scale, then writes ``amax(x)`` into history row 0
        and marks an update pending. Current: scale from ``amax(x)`` itself, and
        ``expected_amax`` is that amax (NaN/Inf/0 give scale 1, as TE).
        ``record=False`` (no-grad / eval forwards) still applies a pending
        update but leaves the history untouched.
        """
        if x.device != self._device:
            self._to(x.device)
        if self._host:
            self._host_begin(x, record)
            return self._host_scales()
        amax = tensor_amax(x)
        self._last_amax = amax
        if not self.delayed:
            scale, valid = self._scale_from_amax(amax, torch.ones_like(amax))
            self._scale, self._scale_inv = scale, 1.0 / scale
            self._expected, self._kept = amax, ~valid
            return Scales(self._scale, self._scale_inv, amax)
        self.update()
        out = Scales(self._scale, self._scale_inv, self._expected)
        if record:
            self._history = torch.cat([amax.reshape(1), self._history[1:]])
            self._pending = True
        return out

    def latest(self) -> tuple:
        """``(amax, scale, scale_inv, expected_amax)`` of the latest :meth:`begin`: Python floats in
        host mode, 0-d tensors otherwise (a tap reporting what the layer just used)."""
        if self._host:
            return self._la, self._s, self._si, self._e
        return self._last_amax, self._scale, self._scale_inv, self._expected

    def record_amax(self, amax: float) -> None:
        """Record ``amax`` (NaN-propagating) of the tensor just scaled for the next update."""
        self._la, self._last_amax = float(amax), None
        self._ring[self._head] = float(amax)
        self._pending = True

    def begin_values(self, x: torch.Tensor, record: bool = True) -> tuple:
        """:meth:`begin` returning ``(amax, scale, scale_inv, expected_amax)``: Python floats in
        host mode (no tensor made at all: what the what-if monitor needs per tensor), 0-d tensors
        otherwise."""
        if self._host and x.is_cpu:  # the per-tensor path of a what-if cheap step: no device objects made
            self._host_begin(x, record)
            return self._la, self._s, self._si, self._e
        if x.device != self._device:
            self._to(x.device)
        if self._host:
            self._host_begin(x, record)
        else:
            self.begin(x.detach(), record)  # a hook's tensor may require grad: no graph for the amax
        return self.latest()

    def _host_begin(self, x: torch.Tensor, record: bool) -> None:
        a = native.amax(x)  # one pass over the data, no tensor made; None where the kernel does not apply
        if a is None:
            a = tensor_amax(x.detach()).item()  # a CPU tensor: a memory read, not a device sync
        self._la, self._last_amax = a, None
        if not self.delayed:
            scale, valid = self._host_scale_from_amax(a, 1.0)
            self._s, self._si, self._e, self._k = scale, round_f32(1.0 / scale), a, not valid
            self._scales_cache = None
            return
        self.update()
        if record:
            self.record_amax(a)

    def __repr__(self) -> str:
        return (
            f"ScalingState(recipe={self.recipe!r}, fmt={self.fmt.name}, "
            f"updates={self.updates}, pending={self._pending})"
        )
