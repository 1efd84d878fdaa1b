"""Per-tensor FP8 scaling state, faithful to Transformer Engine, as tensors on any device.

One :class:`ScalingState` belongs to one tensor (one per (module, role)): our emulated
``Fp8Linear`` holds three, and it is usable on its own ("which scale would TE have used here?").
The what-if monitor keeps the same state for many tensors in a
:class:`~fp8scope.emulate.device_bank.DeviceDelayedBank`; both run :func:`delayed_update`, the one
implementation of TE's rule.

TE semantics reproduced (TE 2.x, ``transformer_engine/common/recipe/delayed_scaling.cu``,
``kernel_bulk``, the default fused path behind
``tex.fused_amax_and_scale_update_after_reduction``; and ``recipe_common.cuh``,
``compute_scale_from_amax``, for current scaling):

Delayed scaling, one update from history ``h`` (row 0 = the amax recorded since the last update)
and scale ``s``:

1. ``last = h[0]``. If ``last != 0`` the history rolls: ``h <- roll(h, -1)``, then ``h[0] = 0``.
   If ``last == 0`` TE skips the roll (the tensor was not used / was all zeros) and keeps the scale.
2. ``amax = max(h)`` ("max", reduced with ``fmaxf`` from 0) or ``amax = last`` ("most_recent").
3. ``s <- (fp8_max * 2**-margin) / amax`` if amax is finite and > 0, else ``s`` is kept; a result
   of +inf (amax tiny) becomes float32 max. ``scale_inv = 1 / s``.

The recorded amax is TE's (``amax.amax_pair``: NaN elements ignored), so a history row is never
NaN; the amax the monitor logs keeps the NaN, and the non-finite flag with it.

TE runs that update at the end of a step; we run it lazily at the start of the next quantization
of the same tensor (:meth:`ScalingState.begin`), which gives the same scale for the same sequence
of amaxes. Every value is a float32 tensor on the tensor's device: no ``.item()``, no Python
branch on a tensor value, and compiled code reads no Python flag (:meth:`ScalingState._set_flags`),
so the state neither syncs a GPU nor breaks or re-specialises a ``torch.compile`` graph: a model
compiles once. Tensors are replaced, never modified in place, so the tensors returned by
:meth:`begin` stay valid after later steps (the monitor gathers them when the step ends).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..formats import Fp8Format, get_format
from ..compiled import CompiledFn
from .amax import amax_pair
from .recipes import CurrentScaling, DelayedScaling

_FP32_MAX = float(torch.finfo(torch.float32).max)
_INF_POS = float("inf")


def round_f32(v: float) -> float:
    """``v`` rounded to float32 (to nearest, ties to even; past float32's range: +-inf), in plain
    arithmetic so that dynamo can fold it inside a traced hook."""
    if v == 0 or not math.isfinite(v):
        return v
    m, e = math.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1
    bits = 24 if e >= -125 else e + 149  # subnormals keep fewer mantissa bits
    if bits < 0:  # below half the smallest subnormal: 0
        return math.copysign(0.0, v)
    r = math.ldexp(round(math.ldexp(m, bits)), e - bits)  # round() ties to even
    return r if abs(r) <= _FP32_MAX else math.copysign(math.inf, v)


def scaled_max(fmt: Fp8Format, margin: float) -> float:
    """``fp8_max * 2**-margin`` rounded once to float32: TE's ``scaled_max``, the amax a scale of 1
    corresponds to and the numerator of every delayed-scaling scale."""
    return round_f32(fmt.max * 2.0 ** (-margin))


class Scales(NamedTuple):
    """What one quantization uses. Unpacks as ``scale, scale_inv, expected_amax``."""

    scale: torch.Tensor  # 0-d float32: multiply by this before the cast
    scale_inv: torch.Tensor  # 0-d float32: 1 / scale, multiply after the decode
    expected_amax: torch.Tensor  # 0-d float32: the amax the scale was derived from


def scale_from_amax(amax: torch.Tensor, scaled_max: torch.Tensor, fallback: torch.Tensor,
                    usable: torch.Tensor | None = None,
                    value_for_inf: float = _FP32_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``compute_scale_from_amax`` on tensors: ``scaled_max / amax`` where the amax is finite
    and > 0 (and ``usable``, where given), else ``fallback``; +inf becomes ``value_for_inf``
    (FLT_MAX but for block scaling, see :func:`te_scale_from_amax`). Returns the scales and where
    they are new."""
    valid = (amax > 0) & (amax < _INF_POS)  # finite and > 0 (NaN fails both)
    if usable is not None:
        valid = usable & valid
    # A true division (TE's `max_fp8 / amax`), not `float / tensor` (= reciprocal * float). Where
    # the amax is not valid the quotient (inf, 0 or NaN) is discarded by the where below; where it
    # is valid and tiny the quotient is +inf, which TE turns into FLT_MAX (the clamp).
    sf = torch.div(scaled_max, amax)
    sf = sf.clamp_(max=_FP32_MAX) if value_for_inf == _FP32_MAX else torch.where(torch.isinf(sf), value_for_inf, sf)
    return torch.where(valid, sf, fallback), valid


_POW2_MASK = -8388608  # 0xFF800000 as an int32: sign and exponent, no mantissa


def te_scale_from_amax(amax: torch.Tensor, fp8_max: float | torch.Tensor, pow2: bool = False, epsilon: float = 0.0,
                       value_for_inf: float = _FP32_MAX) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (``common/recipe/recipe_common.cuh``, v2.8+ lines 14-49; v2.2
    gives the same results) on float32 tensors, for current and block scaling: the amax is first
    raised to ``epsilon``; an amax of 0, Inf or NaN gives 1; else ``fp8_max / amax`` (IEEE
    division), an infinite quotient becomes ``value_for_inf`` (FLT_MAX for per-tensor current
    scaling, the input dtype's largest value for block scaling), and ``pow2`` clears the mantissa
    bits (rounds down to a power of two: FLT_MAX becomes 2^127)."""
    a = torch.where(amax < epsilon, epsilon, amax) if epsilon > 0 else amax
    if not isinstance(fp8_max, torch.Tensor):
        fp8_max = torch.full_like(a, fp8_max)
    scale, _ = scale_from_amax(a, fp8_max, torch.ones_like(a), value_for_inf=value_for_inf)
    if pow2:  # the mask leaves the fallback 1 as it is
        scale = (scale.contiguous().view(torch.int32) & _POW2_MASK).view(torch.float32)
    return scale


def current_scales(recorded: torch.Tensor, scaled_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """Current scaling from a tensor's own (TE-recorded, NaN-ignoring) amax: ``(scale, scale_inv,
    expected_amax, kept)``; NaN/Inf/0 give scale 1, as TE. Pure tensor math (a compiled backward
    traces it)."""
    scale, valid = scale_from_amax(recorded, scaled_max, torch.ones_like(recorded))
    return scale, scale.reciprocal(), recorded, ~valid


def delayed_update(history: torch.Tensor, last: torch.Tensor, scaled_max: torch.Tensor, scale: torch.Tensor,
                   expected: torch.Tensor, most_recent: bool) -> tuple[torch.Tensor, ...]:
    """:func:`delayed_update_eager`, compiled (``fp8scope.compiled``) into one fused kernel per
    (device type, algo, one tensor or a batch, history length): 17 small ops eagerly, which on a
    CPU cost more than the arithmetic and on a GPU are as many launches. The history length is part
    of the variant (a recipe's constant): with it fixed the trace assumes nothing of the sizes, so
    the code is called directly and compiles ahead like the stats pass."""
    return UPDATE.get((history.device.type, bool(most_recent), history.dim(), history.shape[-1]))(
        history, last, scaled_max, scale, expected)


def delayed_update_eager(history: torch.Tensor, last: torch.Tensor, scaled_max: torch.Tensor, scale: torch.Tensor,
                         expected: torch.Tensor, most_recent: bool) -> tuple[torch.Tensor, ...]:
    """TE's delayed-scaling update as tensors, for one tensor (``history`` of shape ``[len]``, the
    others 0-d) or ``k`` at once (``[k, len]`` and ``[k]``). ``last`` is the amax recorded since
    the last update: it stands for row 0 of the history, whatever that row holds (so a caller
    need not write it there first). Returns the new ``(history, scale, scale_inv, expected_amax,
    kept)``, ``kept`` where the old scale stays (amax 0 or Inf).

    Roll (``roll(h, -1)``, the new row 0 cleared) only where the recorded amax is not 0; the amax
    is the window's max from 0 ("max", ``fmaxf``) or the recorded one ("most_recent").
    A NaN recorded amax (only the what-if monitor's one-op eager amax makes one) rolls in as 0:
    the history never holds a NaN. :class:`ScalingState` runs this for its tensor, the what-if
    monitor's :class:`~fp8scope.emulate.device_bank.DeviceDelayedBank` for all its tensors at once."""
    roll = last != 0  # NaN != 0 is true: a NaN (from the eager what-if amax) rolls in, as 0
    recorded = torch.nan_to_num(last, nan=0.0, posinf=_INF_POS)  # the only row that can hold a NaN
    clean = torch.cat([recorded.unsqueeze(-1), history[..., 1:]], -1)  # the window TE reduces
    # fmaxf semantics: the reduction starts from 0, and a step that rolls nothing in keeps the scale
    amax = last if most_recent else clean.amax(-1)
    new_scale, valid = scale_from_amax(amax, scaled_max, scale, usable=roll)
    # TE's roll(h, -1) with the new row 0 cleared: [0, h2, ..., h_{n-1}, recorded] (h1 leaves)
    if history.shape[-1] > 1:
        rolled = F.pad(torch.cat([history[..., 2:], recorded.unsqueeze(-1)], -1), (1, 0))
    else:
        rolled = torch.zeros_like(history)
    return (torch.where(roll.unsqueeze(-1), rolled, clean), new_scale, new_scale.reciprocal(),
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
    ) -> None:
        if not isinstance(recipe, (DelayedScaling, CurrentScaling)):
            raise TypeError(f"recipe must be DelayedScaling or CurrentScaling, got {type(recipe).__name__}")
        self.recipe = recipe
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.scaled_max = scaled_max(self.fmt, recipe.margin)
        self.delayed = isinstance(recipe, DelayedScaling)
        self._most_recent = recipe.amax_compute_algo != "max" if self.delayed else False
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._init_tensors(self._device)
        self._set_flags(False, False)
        self.update_group: UpdateGroup | None = None  # None: this state updates alone
        self._seq = 0  # its place in the group: batches run in this order on every rank

    # ---- state -------------------------------------------------------------------------
    def _init_tensors(self, device: torch.device) -> None:
        n = self.recipe.amax_history_len if self.delayed else 1
        f32 = dict(dtype=torch.float32, device=device)
        self._history = torch.zeros(n, **f32)  # row 0 is 0 after every update: the recorded amax is _last
        self._last = torch.zeros((), **f32)  # TE's amax recorded since the last update (pending)
        self._scale = torch.ones((), **f32)
        self._scale_inv = torch.ones((), **f32)
        self._expected = torch.full((), self.scaled_max, **f32)
        self._kept = torch.zeros((), dtype=torch.bool, device=device)
        self._last_amax = torch.zeros((), **f32)  # logged (NaN-propagating) amax of the latest begin
        self._updates = torch.zeros((), dtype=torch.int64, device=device)
        self._scaled_max_t = torch.full((), self.scaled_max, **f32)  # the numerator of every scale, made once
        # made once, this state's own: "an update is due" False and True (see _set_flags), and the
        # recorded amax when none is (0: every recorded amax is >= 0, so fmax(0, amax) = amax)
        self._ready_values = (torch.zeros((), dtype=torch.bool, device=device),
                              torch.ones((), dtype=torch.bool, device=device))
        self._unset = torch.zeros((), **f32)

    def _set_flags(self, pending: bool, due: bool) -> None:
        """Eagerly: whether an amax was recorded since the last update (``_pending``; ``_last`` is 0
        when not) and whether its update is due at the next use (``_due``: TE's training region
        ended), and the latter as a 0-d tensor, ``_ready`` (pending and due: this state's own,
        assigned, not written: no op). Compiled code reads only ``_ready`` and ``_last``
        (:meth:`_traced_update`): dynamo guards on every Python value a trace reads, and these flags
        differ between a model's first forward (nothing recorded yet) and every later one, so
        reading them compiled the user's model a second time."""
        self._pending, self._due = pending, due
        self._ready = self._ready_values[pending and due]

    def reset(self) -> None:
        """Back to the initial state (history zeros, scale 1)."""
        self._init_tensors(self._device)
        self._set_flags(False, False)

    def _to(self, device: torch.device) -> None:
        """Follow the tensor to its device (e.g. after ``model.cuda()``); async copies."""
        self._device = device
        for name in ("_history", "_last", "_scale", "_scale_inv", "_expected", "_kept", "_last_amax", "_updates",
                     "_scaled_max_t", "_ready", "_unset"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        self._ready_values = tuple(t.to(device, non_blocking=True) for t in self._ready_values)

    @property
    def amax_history(self) -> torch.Tensor:
        """Copy of the history, shape [amax_history_len], row 0 = the amax recorded since the last update."""
        if self._pending:
            return torch.cat([self._last.reshape(1), self._history[1:]])
        return self._history.clone()

    @property
    def scale(self) -> torch.Tensor:
        """Scale the next quantization would use if no update were pending."""
        return self._scale

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._scale_inv

    @property
    def expected_amax(self) -> torch.Tensor:
        return self._expected

    @property
    def last_amax(self) -> torch.Tensor:
        """Logged amax of the tensor passed to the latest :meth:`begin` (NaN-propagating)."""
        return self._last_amax

    @property
    def scale_kept(self) -> torch.Tensor:
        """0-d bool: the latest update kept the old scale (amax 0 or Inf).

        TE does this silently; a monitor should flag it.
        """
        return self._kept

    @property
    def pending(self) -> bool:
        """An amax has been recorded and its update not yet applied."""
        return self._pending

    @property
    def updates(self) -> int:
        """How many delayed-scaling updates ran (reads the device counter: for tests and tools)."""
        return int(self._updates)

    # ---- the update ------------------------------------------------------------------
    def update(self, alone: bool = False) -> None:
        """Apply the update due now (no-op if none is due); ``alone``: this state only, no batch.

        :meth:`begin` calls it; call it yourself to mirror TE's end-of-step timing. Eagerly, every
        other state of the same kind with an update pending is updated in the same batch
        (:func:`_update_pending`); traced by ``torch.compile``, this state alone, inside the graph.
        """
        if self.delayed and torch.compiler.is_compiling():
            return self._traced_update()
        if not (self.delayed and self._pending and self._due):
            return
        # inference mode: alone, since tensors made there can never be saved for a backward, and a
        # gradient state of the batch would be
        batched = not (alone or self.update_group is None or torch.is_inference_mode_enabled())
        if batched and _update_pending(self):
            return
        last = reduced_amax(self._last, self.recipe, self.update_group)
        self._history, self._scale, self._scale_inv, self._expected, self._kept = delayed_update(
            self._history, last, self._scaled_max_t, self._scale, self._expected, self._most_recent)
        self._updates = self._updates + 1
        self._last = self._unset
        self._set_flags(False, False)

    def _traced_update(self) -> None:
        """:meth:`update` as ``torch.compile`` traces it: this state alone, inside the graph, with no
        Python branch on the flags (see :meth:`_set_flags`). Where ``_ready`` does not hold, the
        update runs on a recorded amax of 0, which TE's rule makes a no-op but for ``kept``: no roll,
        the scale and expected amax kept, and the history as it was (its row 0 is 0 between updates).
        So one selection before and one after, not one per value: inductor puts the states' small
        outputs in as few kernels as it can. The Python flags are only written: a forward records
        right after (:meth:`begin`), and a gradient state, the one prepared without a record, is
        never pending without being due."""
        go = self._ready
        last = torch.where(go, reduced_amax(self._last, self.recipe, self.update_group), 0.0)
        self._history, self._scale, self._scale_inv, self._expected, kept = delayed_update(
            self._history, last, self._scaled_max_t, self._scale, self._expected, self._most_recent)
        self._kept = torch.where(go, kept, self._kept)
        self._updates = self._updates + go.to(torch.int64)
        self._last = torch.where(go, 0.0, self._last)
        self._ready = go & ~go  # False: nothing is due after an update
        self._pending = self._due = False

    def _batch_key(self) -> tuple:
        """States that can share one batched update: same device, algorithm and history length."""
        return self._device, self._most_recent, self._history.shape[-1], getattr(self.recipe, "reduce_amax", False)

    def begin(self, x: torch.Tensor, record: bool = True, due: bool = True) -> Scales:
        """Scales to quantize ``x`` with now; then record ``x``'s amax if ``record``.

        Delayed: applies the update due (from the amaxes recorded so far), returns the
        resulting scale, then records ``amax(x)`` into history row 0 (the maximum of every
        amax recorded since the last update, as TE's atomic max) with its update ``due`` at the
        next use. ``due=False`` is TE's forward inside an autocast region that has not ended,
        or under ``no_grad``: the amax waits and merges into the next update. Current: scale
        from ``amax(x)`` itself, and ``expected_amax`` is that amax (NaN/Inf/0 give scale 1,
        as TE). ``record=False`` still applies an update due but leaves the history untouched.
        """
        if x.device != self._device:
            self._to(x.device)
        logged, recorded = amax_pair(x)
        self._last_amax = logged
        if not self.delayed:
            self._scale, self._scale_inv, self._expected, self._kept = current_scales(recorded, self._scaled_max_t)
            return Scales(self._scale, self._scale_inv, self._expected)
        out = self.prepare()
        if record:
            self.record(recorded, due)
        return out

    def peek(self, x: torch.Tensor) -> Scales:
        """Scales as they stand, for ``x``, with nothing updated or recorded: a forward re-run inside
        backward (activation checkpointing) quantizes with the scale its first run used, and TE
        restores the history its re-run recorded (``quantization.py``, the recompute buffers).
        Current scaling: the scale comes from ``x``, as in :meth:`begin`. A record waiting for its
        update falls due: the re-run says its first run trained (``use_reentrant=True`` runs the
        first one under ``no_grad``)."""
        if not self.delayed:
            return self.begin(x, record=False)
        self._set_flags(self._pending, self._due or self._pending)
        if x.device != self._device:
            self._to(x.device)
        self._last_amax = amax_pair(x)[0]
        return self.scales()

    def prepare(self, alone: bool = False, device: torch.device | None = None) -> Scales:
        """Apply a pending update and return the scales the next quantization will use, without
        measuring anything: the emulated layer asks this of its gradient state at forward time, so
        its backward reads no state (then :meth:`observe` records the gradient's amax). Delayed
        scaling only: under current scaling the scale comes from the tensor itself
        (:func:`current_scales`, which the emulated backward applies to the gradient). ``device``:
        where the tensor to come lives (the layer's input's): the state follows it there, as
        :meth:`begin` follows the tensor it measures, so a model moved after conversion (converted
        on the CPU, then ``.cuda()``) keeps every state of a batched update on one device."""
        if device is not None and device != self._device:
            self._to(device)
        self.update(alone)
        return self.scales()

    def scales(self) -> Scales:
        """The scales as they stand (no update applied)."""
        return Scales(self._scale, self._scale_inv, self._expected)

    def observe(self, logged: torch.Tensor, recorded: torch.Tensor) -> None:
        """Note a tensor quantized with :meth:`prepare`'s scales: its logged amax, and TE's amax
        recorded for the next update (delayed scaling; current scaling keeps nothing)."""
        self._last_amax = logged
        if self.delayed:
            self.record(recorded)

    def record(self, amax: torch.Tensor, due: bool = True) -> None:
        """Record ``amax`` (TE's, a 0-d float32 tensor) of the tensor just scaled for the next update:
        row 0 keeps the largest amax recorded since the last update (TE's ``atomicMaxFloat``).
        ``due``: the update applies at the next use (else it waits for a record that is due)."""
        if amax.device != self._device:  # the tensor moved (model.cuda()): the state follows it
            self._to(amax.device)
        if torch.compiler.is_compiling():  # no Python flag is read (see _set_flags): _last is 0 if none
            self._last = torch.fmax(self._last, amax)
            self._pending = True
            if due:
                self._ready, self._due = torch.ones_like(self._ready), True
            return
        self._last = torch.fmax(self._last, amax) if self._pending else amax
        self._set_flags(True, self._due or due)
        if self.update_group is not None:
            with _PENDING_LOCK:  # eager: the next update of its group and kind takes this one along
                pending = self.update_group.pending.get(key := self._batch_key())
                if pending is None:
                    pending = self.update_group.pending[key] = weakref.WeakValueDictionary()
                pending[id(self)] = self

    # ---- checkpoints ---------------------------------------------------------------------
    def state_tensor(self) -> torch.Tensor:
        """What a checkpoint keeps of a delayed-scaling state, as TE's ``get_extra_state`` keeps a
        tensor's ``scale`` and ``amax_history`` (``pytorch/module/base.py``): one float32 row
        ``[scale, expected_amax, history...]`` whose history row 0 is the amax recorded since the
        last update (TE's row 0), on the state's device (no copy to the host, no sync). ``_last`` is
        that amax, or 0 when none waits, eagerly and compiled alike."""
        return torch.cat([self._scale.reshape(1), self._expected.reshape(1), self._last.reshape(1), self._history[1:]])

    def load_state_tensor(self, row: torch.Tensor) -> None:
        """Restore a :meth:`state_tensor` row, as TE's ``set_extra_state`` restores its scale and
        history: the next quantization uses the saved scale, and the saved row 0 waits for the next
        update as a recorded amax. A history of another length (``amax_history_len`` changed since)
        keeps its row 0 and as many of its latest rows as fit (TE's rolled order puts the latest
        last). Reads row 0 on the host once (a load is not a training step)."""
        row = row.detach().to(device=self._device, dtype=torch.float32)
        saved, n = row[2:], self._history.shape[-1]
        rest = saved[1:][max(0, saved.numel() - n):]
        self.reset()
        self._history = torch.cat([torch.zeros(n - rest.numel(), dtype=torch.float32, device=self._device), rest])
        self._scale, self._expected = row[0].clone(), row[1].clone()
        self._scale_inv = self._scale.reciprocal()
        if float(saved[0]) != 0:
            self.record(saved[0].clone())

    def latest(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logged amax, scale, scale_inv, expected_amax)`` of the latest :meth:`begin`, 0-d tensors
        (a tap reporting what the layer just used)."""
        return self._last_amax, self._scale, self._scale_inv, self._expected

    def __repr__(self) -> str:
        return f"ScalingState(recipe={self.recipe!r}, fmt={self.fmt.name}, pending={self._pending})"


class UpdateGroup:
    """The delayed-scaling states of one model (``convert_to_fp8`` makes one per call, an ``Fp8Linear``
    built on its own one for its three states), whose updates are applied together.

    TE updates every tensor of an autocast region in one bulk kernel when the region ends
    (``delayed_scaling.cu``, ``kernel_bulk``). Here, eagerly, the first state of a group that needs
    its update applies those of every state of the group and kind (device, algorithm, history
    length) whose update is due, in one batch: about 30 ops a training step for the whole model
    instead of 17 per tensor. Each state's update depends only on its own history and recorded
    amax, and each is still applied exactly once between a record and the next use of its scale,
    so the scales are those of one update per state. Within a training step that first state is
    the step's first quantization, so after it every state's ``scale`` is the one its tensor was
    quantized with this step, as with per-state updates. States traced by ``torch.compile`` update
    inside their graph and are skipped here once they are no longer pending. A copy of a model
    (``copy.deepcopy``, a checkpoint) gets a group of its own.

    ``process_group``: the group whose ranks' amaxes are all-reduced (MAX) before an update when
    the recipe's ``reduce_amax`` is on and ``torch.distributed`` runs with more than one rank
    (TE's ``amax_reduction_group``; None: the default group)."""

    def __init__(self, process_group=None) -> None:
        self.pending: dict[tuple, "weakref.WeakValueDictionary[int, ScalingState]"] = {}
        # per batch key: the last batched update's states (their ids), its outputs, and the views each
        # state got (``_batch_inputs``)
        self.batches: dict[tuple, tuple] = {}
        self.process_group = process_group
        self._joined = 0

    def join(self, state: ScalingState) -> None:
        """Make ``state`` a member; members batch in the order they joined, the same on every rank."""
        state.update_group = self
        self._joined += 1
        state._seq = self._joined

    def __reduce__(self):
        return (UpdateGroup, ())


def reduced_amax(last: torch.Tensor, recipe, group: UpdateGroup | None) -> torch.Tensor:
    """``last`` all-reduced (MAX) across the ranks of the group's process group, when the recipe
    asks (``reduce_amax``, TE's default) and ``torch.distributed`` runs with more than one rank:
    every rank then records the same amax and uses the same scale, as under TE
    (``quantization.py``, ``reduce_and_update_fp8_tensors``). Functional collectives, so a
    compiled update traces it; the amaxes are TE's (never NaN), so MAX is exact."""
    if not getattr(recipe, "reduce_amax", False):
        return last
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return last
    pg = group.process_group if group is not None and group.process_group is not None else dist.group.WORLD
    if dist.get_world_size(pg) == 1:
        return last
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_reduce(last, "max", pg)
    return out if torch.compiler.is_compiling() else funcol.wait_tensor(out)


_PENDING_LOCK = threading.Lock()  # backward hooks may record on autograd's device threads


def _update_pending(state: ScalingState) -> bool:
    """Apply the due updates of ``state``'s group and kind in one batch; False when ``state`` is the
    only one due (its own update is then the batch). States whose update is not due yet (a forward
    under ``no_grad``, or in an autocast region still open) stay pending."""
    key = state._batch_key()
    group = state.update_group
    with _PENDING_LOCK:
        pending = group.pending.pop(key, None)
        members = [s for s in (list(pending.values()) if pending is not None else ()) if s._pending]
        waiting = [s for s in members if not s._due]
        if waiting:  # back in the registry for a later batch
            again = group.pending.setdefault(key, weakref.WeakValueDictionary())
            for s in waiting:
                again[id(s)] = s
    states = [s for s in members if s._due and s._batch_key() == key]
    if state not in states:
        states.append(state)
    if len(states) == 1:
        return False
    states.sort(key=lambda s: s._seq)
    lasts = reduced_amax(torch.stack([s._last for s in states]), state.recipe, group)
    ids = [id(s) for s in states]  # the group keeps ids, never the states: it keeps no layer alive
    inputs = _batch_inputs(group.batches.get(key), ids, states)
    new = delayed_update(inputs[0], lasts, *inputs[1:4], state._most_recent)
    updates = inputs[4] + 1
    views = [t.unbind(0) for t in (*new, updates)]
    for s, hist, scale, scale_inv, expected, kept, n in zip(states, *views):
        s._history, s._scale, s._scale_inv, s._expected, s._kept, s._updates = hist, scale, scale_inv, expected, kept, n
        s._last = s._unset
        s._set_flags(False, False)
    hist, scale, scale_inv, expected, kept, n = views
    group.batches[key] = (ids, (new[0], inputs[1], new[1], new[3], updates), (hist, scale, expected, n))
    return True


def _batch_inputs(last: tuple | None, ids: list[int], states: list[ScalingState]) -> tuple[torch.Tensor, ...]:
    """``(history, scaled_max, scale, expected, updates)`` of ``states`` stacked, for one batched
    update. A training loop updates the same states every step, and each then holds the rows of
    the last batch's outputs (views that :func:`_update_pending` gave it): where that still holds,
    those outputs are the stacks, and no state's values are stacked again (five stacks of one 0-d
    tensor a state, host time every step). A state changed since (a reset, an update of its own,
    one traced by ``torch.compile``, a moved model) holds other tensors, and the batch is stacked.
    ``last``: the group's record of its last batch of this kind; ``ids``: the states'."""
    if last is not None and last[0] == ids:
        stacked, (hist, scale, expected, n) = last[1], last[2]
        if all(s._history is h and s._scale is c and s._expected is e and s._updates is u
               for s, h, c, e, u in zip(states, hist, scale, expected, n)):
            return stacked
    return tuple(torch.stack([getattr(s, a) for s in states])
                 for a in ("_history", "_scaled_max_t", "_scale", "_expected", "_updates"))


def _make_update(key):
    most_recent = key[1]

    def update(history, last, scaled_max, scale, expected):
        return delayed_update_eager(history, last, scaled_max, scale, expected, most_recent)

    return update


def _update_examples(key):
    device, _, ndim, length = key
    shape = (length,) if ndim == 1 else (5, length)  # the batch: 5 states (a symbol; the length is fixed)
    f32 = dict(dtype=torch.float32, device=device)
    history = torch.rand(shape, **f32)
    history[..., 0] = 0.0
    rest = shape[:-1]
    last = torch.rand(rest, **f32)
    return history, last, torch.full(rest, 448.0, **f32), torch.ones(rest, **f32), torch.full(rest, 448.0, **f32)


def _update_static(key):
    """The history's length stays a constant of the trace (``key[3]``)."""
    return ((0, -1),)


UPDATE = CompiledFn("delayed_update", _make_update, _update_examples, static=_update_static)
