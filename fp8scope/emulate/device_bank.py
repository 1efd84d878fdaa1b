"""Delayed scaling for many tensors on one device, updated in batches: the what-if monitor's
states off the CPU (and on the CPU when the compiled kernel is switched off).

Why a bank: with one :class:`~fp8scope.emulate.ScalingState` per tensor, a cheap what-if capture
on a GPU launched ~30 small kernels (the amax, the lazy delayed-scaling update, the row's stack):
about 2,000 launches per step for the tiny GPT's 63 tensors, each costing the training thread
microseconds (``benchmarks/whatif_device_bank.py``). Here a capture is the amax pass (three
kernels, written into this step's amax buffer) and a returned :class:`DeferredRow`; when the step
ends, :meth:`DeviceDelayedBank.resolve` runs the updates of all slots together (~30 launches) and
gives each row its values, in the order the collector keeps.

The numbers are :class:`ScalingState`'s: both run :func:`~fp8scope.emulate.scaling.delayed_update`
(TE's rule on float32 tensors), the bank on a batch of slots, a state on one;
``tests/test_device_bank.py`` checks the bank capture by capture against ``ScalingState``.

Micro-batches (a slot captured twice before the step ends): each capture must see the scales
left by the update of the one before, as ``ScalingState`` does. :meth:`resolve` therefore works
in rounds: round ``r`` takes every slot's ``r``-th capture, reads its row (the scales in use) and
then updates those slots, so a slot's captures are applied in order and slots stay independent.
"""

from __future__ import annotations

import torch

from ..formats import Fp8Format
from .recipes import DelayedScaling
from .scaling import ScalingState, delayed_update, scaled_max


class DeferredRow:
    """One capture's cheap row ``(amax, scale, scale_inv, expected_amax)``: ``value`` is a float32
    device tensor once the bank has resolved the step (None before)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class DeviceDelayedBank:
    """The delayed-scaling state of many tensors under one :class:`DelayedScaling` recipe, as
    float32 tensors on ``device``.

    ``slot = bank.add(fmt)`` adds a tensor (TE's initial state: history zeros, scale 1).
    Cheap steps: ``row = bank.capture(slot, x)`` measures ``x``'s amax into the step's buffer;
    ``bank.resolve()`` at the step's end fills every row and applies the updates. Full steps:
    ``bank.scales(slot)`` then ``bank.record_amax(slot, amax)`` (the amax full stats measured);
    ``resolve()`` applies those updates too. Nothing here reads a device value on the host.
    """

    def __init__(self, recipe: DelayedScaling, device: torch.device | str):
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"DeviceDelayedBank needs a DelayedScaling recipe, got {type(recipe).__name__}")
        self.recipe = recipe
        self.device = torch.device(device)
        self.length = int(recipe.amax_history_len)
        self._most_recent = recipe.amax_compute_algo != "max"
        f32 = dict(dtype=torch.float32, device=self.device)
        self.history = torch.zeros((0, self.length), **f32)  # row 0 of each slot's history first
        self.scale = torch.ones(0, **f32)
        self.scale_inv = torch.ones(0, **f32)
        self.expected = torch.zeros(0, **f32)
        self.kept = torch.zeros(0, dtype=torch.bool, device=self.device)
        self._scaled_max = torch.zeros(0, **f32)
        self.updates: list[int] = []  # updates applied per slot (host ints)
        self._amax = torch.zeros(64, **f32)  # this step's captured amaxes, in capture order
        self._captured: list[int] = []  # the slot of each capture
        self._rows: list[DeferredRow] = []
        self._recorded: dict[int, torch.Tensor] = {}  # slot -> amax recorded on a full step, update pending
        self._plans: dict[tuple[int, ...], list] = {}  # capture sequence -> its rounds' index tensors

    def __len__(self) -> int:
        return len(self.updates)

    def add(self, fmt: Fp8Format) -> int:
        """A new tensor's slot, in the initial state (captures already made this step stay valid:
        they refer to slots by number)."""
        sm = scaled_max(fmt, self.recipe.margin)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.history = torch.cat([self.history, torch.zeros((1, self.length), **f32)])
        self.scale = torch.cat([self.scale, torch.ones(1, **f32)])
        self.scale_inv = torch.cat([self.scale_inv, torch.ones(1, **f32)])
        self.expected = torch.cat([self.expected, torch.full((1,), sm, **f32)])
        self.kept = torch.cat([self.kept, torch.zeros(1, dtype=torch.bool, device=self.device)])
        self._scaled_max = torch.cat([self._scaled_max, torch.full((1,), sm, **f32)])
        self.updates.append(0)
        self._plans.clear()
        return len(self.updates) - 1

    # ---- cheap steps -------------------------------------------------------------------
    def capture(self, slot: int, x: torch.Tensor) -> DeferredRow:
        """Measure ``x``'s amax (as ``tensor_amax``: NaN-propagating, 0 for an empty tensor) for ``slot``;
        the row's values come with :meth:`resolve`."""
        i = len(self._captured)
        if i == self._amax.numel():
            self._amax = torch.cat([self._amax, torch.zeros_like(self._amax)])
        if x.numel():
            # tensor_amax's one pass, written into the buffer (torch.linalg.vector_norm(x, inf) would
            # be one kernel fewer, but is ~10x slower on the CPU)
            lo, hi = torch.aminmax(x.detach())
            torch.maximum(hi, lo.neg(), out=self._amax[i])
        else:
            self._amax[i].zero_()
        self._captured.append(slot)
        row = DeferredRow()
        self._rows.append(row)
        return row

    def resolve(self) -> None:
        """Fill this step's rows and apply every pending update (the step's end; also before
        anything that needs the state current)."""
        if self._captured:
            captured, rows = self._captured, self._rows
            self._captured, self._rows = [], []
            values = None
            for slots, positions in self._plan(tuple(captured)):
                if positions is None:  # one round: every capture, in order
                    amax = self._amax[: len(captured)]
                else:
                    amax = self._amax.index_select(0, positions)
                got = torch.stack([amax, *self._gather(slots, self.scale, self.scale_inv, self.expected)], 1)
                if positions is None:
                    values = got
                else:
                    if values is None:
                        values = torch.empty((len(captured), 4), dtype=torch.float32, device=self.device)
                    values.index_copy_(0, positions, got)
                self._update(slots, amax)
            for row, value in zip(rows, values.unbind(0)):
                row.value = value
        if self._recorded:
            slots = list(self._recorded)
            amaxes = torch.stack([self._recorded.pop(s) for s in slots])
            self._update(self._index(slots), amaxes)

    def _plan(self, captured: tuple[int, ...]) -> list:
        """The rounds of a capture sequence: (slots, capture positions as an index tensor, or None
        when the round is every capture in order), made once per sequence (a training loop repeats
        it, so the index tensors reach the device once)."""
        plan = self._plans.get(captured)
        if plan is None:
            seen: dict[int, int] = {}
            rounds: list[list[tuple[int, int]]] = []
            for pos, slot in enumerate(captured):
                r = seen.get(slot, 0)
                seen[slot] = r + 1
                if r == len(rounds):
                    rounds.append([])
                rounds[r].append((slot, pos))
            plan = []
            for members in rounds:
                positions = None if len(rounds) == 1 else torch.tensor([p for _, p in members], device=self.device)
                plan.append((self._index([s for s, _ in members]), positions))
            if len(self._plans) >= 16:
                self._plans.clear()
            self._plans[captured] = plan
        return plan

    def _index(self, slots: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Slots as the update takes them: the host list, and its index tensor on the device
        (None when the slots are all of them in order: no gather needed)."""
        if slots == list(range(len(self.updates))):
            return slots, None
        return slots, torch.tensor(slots, dtype=torch.long, device=self.device)

    @staticmethod
    def _gather(slots: tuple[list[int], torch.Tensor | None], *tensors: torch.Tensor) -> list[torch.Tensor]:
        index = slots[1]
        return list(tensors) if index is None else [t.index_select(0, index) for t in tensors]

    # ---- full steps ----------------------------------------------------------------------
    def scales(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale, scale_inv, expected_amax)`` to quantize ``slot``'s tensor with now (0-d tensors
        of their own; a pending update of the slot applied first)."""
        if slot in self._recorded:
            self._update(self._index([slot]), self._recorded.pop(slot).reshape(1))
        both = torch.stack([self.scale[slot], self.scale_inv[slot], self.expected[slot]])
        return both[0], both[1], both[2]

    def record_amax(self, slot: int, amax: torch.Tensor | float) -> None:
        """Record the amax of the tensor :meth:`scales` was asked for (the update waits for :meth:`resolve`)."""
        self._recorded[slot] = torch.as_tensor(amax, dtype=torch.float32, device=self.device).reshape(())

    def to_state(self, slot: int, fmt: Fp8Format) -> ScalingState:
        """``slot``'s state as a :class:`ScalingState` of its own (its tensor moved to another
        device). Reads the slot on the host: once, when the tensor moves."""
        self.resolve()
        return ScalingState.from_host(self.recipe, fmt, self.history[slot].tolist(), float(self.scale[slot]),
                                      float(self.scale_inv[slot]), float(self.expected[slot]),
                                      bool(self.kept[slot]), False, self.updates[slot])

    # ---- the update ----------------------------------------------------------------------
    def _update(self, slots: tuple[list[int], torch.Tensor | None], last: torch.Tensor) -> None:
        """:func:`~fp8scope.emulate.scaling.delayed_update` for ``slots`` (see :meth:`_index`) whose
        recorded amaxes are ``last``."""
        index = slots[1]
        h = self.history.clone() if index is None else self.history.index_select(0, index)
        h[:, 0] = last
        new = delayed_update(h, *self._gather(slots, self._scaled_max, self.scale, self.expected), self._most_recent)
        for target, value in zip((self.history, self.scale, self.scale_inv, self.expected, self.kept), new):
            if index is None:
                target.copy_(value)
            else:
                target.index_copy_(0, index, value)
        for s in slots[0]:
            self.updates[s] += 1
