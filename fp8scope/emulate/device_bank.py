"""Delayed scaling for many tensors on one device, updated in batches: the what-if monitor's
states, on every device.

Why a bank: with one :class:`~fp8scope.emulate.ScalingState` per tensor, a cheap what-if capture
on a GPU launched ~30 small kernels (the amax, the lazy delayed-scaling update, the row's stack):
about 2,000 launches per step for the tiny GPT's 63 tensors, each costing the training thread
microseconds (``benchmarks/whatif_device_bank.py``). Here a capture is one amax pass
(``amax.amax_parts_into``: one eager ``aminmax`` written into the next row of the step's buffer of
the tensor's dtype; a weight's comes from the step's one batched read of them all,
:mod:`~fp8scope.emulate.weight_reads`) and a returned :class:`DeferredRow`; when the step ends,
:meth:`DeviceDelayedBank.resolve` gathers the step's amaxes in capture order (one cat and one
index_select: a stack of each capture's two 0-d results dispatched a view op per result, host
time on every device), runs the updates of all slots together (~30 ops whatever the slot count)
and keeps the step's rows, in capture order, for :meth:`DeviceDelayedBank.take_rows`.

The numbers are :class:`ScalingState`'s: both run :func:`~fp8scope.emulate.scaling.delayed_update`
(TE's rule on float32 tensors), the bank on a batch of slots, a state on one;
``tests/test_device_bank.py`` checks the bank capture by capture against ``ScalingState``.

Micro-batches (a slot captured twice before the step ends): each capture must see the scales
left by the update of the one before, as ``ScalingState`` does. :meth:`resolve` therefore works
in rounds: round ``r`` takes every slot's ``r``-th capture, reads its row (the scales in use) and
then updates those slots, so a slot's captures are applied in order and slots stay independent.
"""

from __future__ import annotations

import weakref

import torch

from ..formats import Fp8Format
from .recipes import DelayedScaling
from .amax import amax_parts, amax_parts_into, combine_parts
from .scaling import delayed_update, scaled_max
from .weight_reads import _PLAIN, WeightReads


_SPAN = 1 << 24  # codes of a capture's row: a buffer's number times this, plus the row


class DeferredRow:
    """One capture's cheap row ``(amax, scale, scale_inv, expected_amax)``: row ``index`` of the
    rows :meth:`DeviceDelayedBank.take_rows` returns. Immutable: the bank hands out the same object
    for the same index every step."""

    __slots__ = ("bank", "index")

    def __init__(self, bank: "DeviceDelayedBank", index: int) -> None:
        self.bank, self.index = bank, index


class DeferredRows:
    """The rows of ``count`` captures made together (:meth:`DeviceDelayedBank.capture_parts`): rows
    ``index`` to ``index + count - 1`` of those :meth:`DeviceDelayedBank.take_rows` returns. One object
    for all of a grouped GEMM's experts, so a step's Python stays per GEMM, not per expert."""

    __slots__ = ("bank", "index", "count")

    def __init__(self, bank: "DeviceDelayedBank", index: int, count: int) -> None:
        self.bank, self.index, self.count = bank, index, count


class DeviceDelayedBank:
    """The delayed-scaling state of many tensors under one :class:`DelayedScaling` recipe, as
    float32 tensors on ``device``.

    ``slot = bank.add(fmt)`` adds a tensor (TE's initial state: history zeros, scale 1).
    Cheap steps: ``row = bank.capture(slot, x)`` measures ``x``'s amax (one pass);
    ``bank.take_rows()`` at the step's end applies the updates and returns every row. Full steps:
    ``bank.scales(slot)`` then ``bank.record_amax(slot, amax)`` (the amax full stats measured);
    ``resolve()`` applies those updates too. Nothing here reads a device value on the host.
    """

    # The state is made outside inference mode even when the first capture runs inside it (an eval
    # forward with ``capture_no_grad``): the updates write it in place when the step ends, which an
    # inference tensor refuses outside inference mode.
    @torch.inference_mode(False)
    def __init__(self, recipe: DelayedScaling, device: torch.device | str):
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"DeviceDelayedBank needs a DelayedScaling recipe, got {type(recipe).__name__}")
        self.recipe = recipe
        self.device = torch.device(device)
        self.length = int(recipe.amax_history_len)
        self._most_recent = recipe.amax_compute_algo != "max"
        self.updates: list[int] = []  # updates applied per slot (host ints)
        # history ([slots, length], row 0 of each slot's history first), scale, scale_inv, expected, kept,
        # scaled max: views of the first len(self) slots of stores with room for more
        self._stores: tuple[torch.Tensor, ...] = ()
        self._reserve(0)
        self._view(0)
        # where each capture's amax parts (a, c) are, in capture order: row r of the step's buffer of
        # dtype number d is the code d * _SPAN + r; the k-th pair of ``_extra`` is -1 - k
        self._codes: list[int] = []
        # dtype -> [buffer [rows, 2] (a, c), its rows' (c, a) views, rows used, its first code]
        self._out: dict[torch.dtype, list] = {}
        self._extra: list[torch.Tensor] = []  # parts read elsewhere (the weights' batch, empty tensors): a, c, a, c...
        # parts of several captures measured together ([n, 2] blocks: a grouped GEMM's experts); the k-th
        # pair of the step's blocks is the code -_SPAN - k
        self._part_blocks: list[torch.Tensor] = []
        self._block_pairs = 0
        self._gathers: dict[tuple, torch.Tensor | None] = {}  # (codes, layout) -> the rows' index into the pool
        self._shared: tuple | None = None  # (weak ref, version, code) of the last shared capture's tensor
        self._weights = WeightReads(self.device)  # the step's weight reads, in one batch
        self._captured: list[int] = []  # the slot of each capture
        self._blocks: list[torch.Tensor] = []  # resolved rows [captures, 4] since the last take_rows
        self._taken = 0  # captures since the last take_rows (DeferredRow.index counts from there)
        self._rows: list[DeferredRow] = []  # DeferredRow(self, i) for each i so far: a step's are the last's
        self._recorded: dict[int, torch.Tensor] = {}  # slot -> amax recorded on a full step, update pending
        self._plans: dict[tuple[int, ...], list] = {}  # capture sequence -> its rounds' index tensors
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}  # slots -> their index tensor (a slot keeps its number)

    def __len__(self) -> int:
        return len(self.updates)

    @torch.inference_mode(False)
    def add(self, fmt: Fp8Format, like: tuple["DeviceDelayedBank", int] | None = None,
            state: tuple[torch.Tensor, ...] | None = None) -> int:
        """A new tensor's slot, in the initial state, in the state of slot ``like = (bank, slot)`` of
        another bank (its tensor moved to this device), or in ``state``: ``(history, scale,
        scale_inv, expected_amax, kept)`` (a resumed run's, :mod:`fp8scope.resume`). Captures
        already made this step stay valid: they refer to slots by number."""
        sm = scaled_max(fmt, self.recipe.margin)
        f32 = dict(dtype=torch.float32, device=self.device)
        if state is not None:
            row = tuple(t.reshape(1, -1) if i == 0 else t.reshape(1) for i, t in enumerate(state))
            row = tuple(t.to(self.device, non_blocking=True) for t in row)
            updates = 0
        elif like is None:
            row = (torch.zeros((1, self.length), **f32), torch.ones(1, **f32), torch.ones(1, **f32),
                   torch.full((1,), sm, **f32), torch.zeros(1, dtype=torch.bool, device=self.device))
            updates = 0
        else:
            other, o = like
            other.resolve()
            row = tuple(t[o:o + 1].to(self.device) for t in (other.history, other.scale, other.scale_inv,
                                                            other.expected, other.kept))
            updates = other.updates[o]
        n = len(self.updates)
        if n == len(self._stores[0]):
            self._reserve(max(64, 2 * n))
        for store, value in zip(self._stores, (*row, torch.full((1,), sm, **f32))):
            store[n:n + 1].copy_(value)
        self._view(n + 1)
        self.updates.append(updates)
        self._plans.clear()
        return len(self.updates) - 1

    def _reserve(self, capacity: int) -> None:
        """Room for ``capacity`` slots, the slots so far kept. Capacity doubles, so adding a model's
        slots one at a time copies each about once: a MoE's tens of thousands of experts' tensors made
        the bank quadratic when every add grew each tensor by one row."""
        n = len(self.updates)
        f32 = dict(dtype=torch.float32, device=self.device)
        stores = (torch.zeros((capacity, self.length), **f32), torch.ones(capacity, **f32),
                  torch.ones(capacity, **f32), torch.zeros(capacity, **f32),
                  torch.zeros(capacity, dtype=torch.bool, device=self.device), torch.zeros(capacity, **f32))
        for new, old in zip(stores, self._stores):
            new[:n].copy_(old[:n])
        self._stores = stores

    def _view(self, n: int) -> None:
        """The state's tensors as the first ``n`` slots of the stores (the updates write them in place)."""
        self.history, self.scale, self.scale_inv, self.expected, self.kept, self._scaled_max = (
            t[:n] for t in self._stores)

    # ---- cheap steps -------------------------------------------------------------------
    def capture(self, slot: int, x: torch.Tensor, shared: bool = False, weight: bool = False) -> DeferredRow:
        """Measure ``x``'s amax for ``slot`` (one pass, no host sync); the row's values come with
        :meth:`resolve`. ``shared``: ``x`` may be the input of several layers in a row (a
        ``transformers`` attention's q, k and v projections read one hidden state, its MLP's gate
        and up projections another): the same tensor, unchanged since (its version), is not read
        again. Only the last such tensor is remembered, by a weak reference (holding it would keep
        a layer input alive through the backward), until the next shared capture or the step's end.
        ``weight``: ``x`` is the layer's weight in a training forward (the caller knows: a compiled
        forward runs its graph with grad off), read with the step's other weights in one batch
        (:class:`~fp8scope.emulate.weight_reads.WeightReads`). Not in an eval forward (no grad): it
        may run on weights swapped in through ``.data`` (an EMA), which bumps no version counter, so
        it reads its own."""
        remembered = not x.is_inference()  # an inference tensor has no version counter to check
        memo = self._shared if shared and remembered else None
        if weight and remembered:
            code = self._extra_code(self._weights.parts(slot, x))
        elif memo is not None and memo[0]() is x and memo[1] == x._version:
            code = memo[2]
        else:
            if x.numel() == 0 or type(x) not in _PLAIN:  # (0, 0), or a tensor subclass's (a DTensor's) own parts
                code = self._extra_code(amax_parts(x))
            else:  # into the next row of the step's buffer of x's dtype
                entry = self._out.get(x.dtype)
                if entry is None or entry[2] == len(entry[1]):
                    entry = self._grow(x.dtype)
                r = entry[2]
                entry[2] = r + 1
                amax_parts_into(x, entry[1][r])
                code = entry[3] + r
            if shared and remembered:
                self._shared = (weakref.ref(x), x._version, code)
        self._codes.append(code)
        self._captured.append(slot)
        i = self._taken
        self._taken = i + 1
        rows = self._rows
        if i >= len(rows):  # (a block's rows may have skipped some numbers: each is made once)
            rows.extend(DeferredRow(self, j) for j in range(len(rows), i + 1))
        return rows[i]

    def capture_parts(self, slots: list[int], parts: torch.Tensor) -> DeferredRows:
        """Captures of several slots whose amax parts were measured together: ``parts`` is
        ``[len(slots), 2]``, each row (max, min) of one tensor as :meth:`capture`'s pass gives them
        (a grouped GEMM's experts, from one segmented reduction over the rows of all of them). Their
        rows, in ``slots`` order, as one :class:`DeferredRows`: no Python per slot."""
        start, n = self._block_pairs, len(slots)
        self._part_blocks.append(parts)
        self._block_pairs = start + n
        self._codes.extend(range(-_SPAN - start, -_SPAN - start - n, -1))
        self._captured.extend(slots)
        i = self._taken
        self._taken = i + n
        return DeferredRows(self, i, n)

    def _extra_code(self, parts: tuple[torch.Tensor, torch.Tensor]) -> int:
        """The code of parts read elsewhere than the buffers (kept until the step's rows are gathered)."""
        self._extra.extend(parts)
        return -(len(self._extra) // 2)

    @torch.inference_mode(False)
    def _grow(self, dtype: torch.dtype) -> list:
        """The buffer of ``dtype`` with room for twice its rows (64 at first), what it holds kept."""
        entry = self._out.get(dtype)
        rows = 64 if entry is None else 2 * len(entry[1])
        if rows > _SPAN:
            raise RuntimeError(f"more than {_SPAN} captures of {dtype} in one step")
        buffer = torch.zeros((rows, 2), dtype=dtype, device=self.device)
        if entry is None:  # buffers are numbered as made, never dropped
            entry = self._out[dtype] = [buffer, [], 0, len(self._out) * _SPAN]
        else:
            buffer[:entry[2]].copy_(entry[0][:entry[2]])  # the step's rows so far (read in stream order on a GPU)
            entry[0] = buffer
        entry[1] = [(buffer[i, 1], buffer[i, 0]) for i in range(rows)]  # made once: no view op per capture
        return entry

    def _gathered(self, codes: list[int]) -> torch.Tensor:
        """The captures' parts ``[captures, 2]`` (a, c), in capture order, from the step's buffers and
        extra parts, which are then free for the next captures: one cat and one index_select whatever
        the capture count (the index made once per capture sequence: a training loop repeats it)."""
        blocks, layout = [], []
        for dtype, entry in self._out.items():
            if entry[2]:
                layout.append((entry[3] // _SPAN, entry[2]))
                blocks.append(entry[0][:entry[2]])
                entry[2] = 0
        if self._extra:
            layout.append((-1, len(self._extra) // 2))
            blocks.append(torch.stack(self._extra).view(-1, 2))
            self._extra = []
        if self._part_blocks:
            layout.append((-2, self._block_pairs))
            blocks.append(self._part_blocks[0] if len(self._part_blocks) == 1 else torch.cat(self._part_blocks))
            self._part_blocks, self._block_pairs = [], 0
        pool = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # promoted to the widest dtype, exactly
        key = (tuple(codes), tuple(layout))
        if key not in self._gathers:
            start, offsets = 0, {}
            for kind, n in layout:
                offsets[kind] = start
                start += n
            index = [offsets[-2] - _SPAN - c if c <= -_SPAN else offsets[-1] - 1 - c if c < 0
                     else offsets[c // _SPAN] + c % _SPAN for c in codes]
            if len(self._gathers) >= 16:
                self._gathers.clear()
            self._gathers[key] = None if index == list(range(start)) else self._on_device(index)
        index = self._gathers[key]
        return pool if index is None else pool.index_select(0, index)

    def resolve(self) -> None:
        """Apply every pending update and keep the rows of the captures so far for :meth:`take_rows`
        (the step's end; also before anything that needs the state current)."""
        self._shared = None  # a step's tensors are not the next step's
        self._weights.end_step()
        if self._captured:
            captured, codes = self._captured, self._codes
            self._captured, self._codes = [], []
            ac = self._gathered(codes)
            logged_t, recorded_t = combine_parts(ac[:, 0], ac[:, 1])
            values = None
            for slots, positions in self._plan(tuple(captured)):
                if positions is None:  # one round: every capture, in order
                    amax, rec = logged_t, recorded_t
                else:
                    amax, rec = logged_t.index_select(0, positions), recorded_t.index_select(0, positions)
                got = torch.stack([amax, *self._gather(slots, self.scale, self.scale_inv, self.expected)], 1)
                if positions is None:
                    values = got
                else:
                    if values is None:
                        values = torch.empty((len(captured), 4), dtype=torch.float32, device=self.device)
                    values.index_copy_(0, positions, got)
                self._update(slots, rec)
            self._blocks.append(values)
        if self._recorded:
            slots = list(self._recorded)
            amaxes = torch.stack([self._recorded.pop(s) for s in slots]).to(torch.float32)
            self._update(self._index(slots), amaxes)

    def take_rows(self) -> torch.Tensor | None:
        """The rows ``[captures, 4]`` (logged amax, scale, scale_inv, expected amax) of every capture
        since the last call, in capture order (``DeferredRow.index``); :meth:`resolve` first."""
        self.resolve()
        blocks, self._blocks, self._taken = self._blocks, [], 0
        if not blocks:
            return None
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)

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
                positions = None if len(rounds) == 1 else self._on_device([p for _, p in members])
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
        key = tuple(slots)
        index = self._indices.get(key)
        if index is None:  # made once per slot list: a training loop asks for the same ones every step
            if len(self._indices) >= 256:
                self._indices.clear()
            index = self._indices[key] = self._on_device(slots)
        return slots, index

    def _on_device(self, values: list[int]) -> torch.Tensor:
        """An index list as a tensor on the bank's device, without a host sync: through pinned
        memory and a non-blocking copy on CUDA (a copy from pageable memory waits for the stream,
        so for every kernel queued before it: ``tests/test_host_sync.py``)."""
        index = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return index
        if self.device.type == "cuda":
            index = index.pin_memory()
        return index.to(self.device, non_blocking=True)

    @staticmethod
    def _gather(slots: tuple[list[int], torch.Tensor | None], *tensors: torch.Tensor) -> list[torch.Tensor]:
        index = slots[1]
        return list(tensors) if index is None else [t.index_select(0, index) for t in tensors]

    # ---- full steps ----------------------------------------------------------------------
    def scales(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale, scale_inv, expected_amax)`` to quantize ``slot``'s tensor with now (0-d tensors
        of their own; a pending update of the slot applied first)."""
        if slot in self._recorded:
            self._update(self._index([slot]), self._recorded.pop(slot).reshape(1).to(torch.float32))
        both = torch.stack([self.scale[slot], self.scale_inv[slot], self.expected[slot]])
        return both[0], both[1], both[2]

    def record_amax(self, slot: int, amax: torch.Tensor | float) -> None:
        """Record the amax of the tensor :meth:`scales` was asked for (the update waits for :meth:`resolve`)."""
        # as given (the stats row's float64 view, or a float): made float32 once per step, in the stack
        self._recorded[slot] = amax.reshape(()) if isinstance(amax, torch.Tensor) else torch.full(
            (), float(amax), dtype=torch.float32, device=self.device)  # a fill: no copy from the host

    # ---- the update ----------------------------------------------------------------------
    def _update(self, slots: tuple[list[int], torch.Tensor | None], last: torch.Tensor) -> None:
        """:func:`~fp8scope.emulate.scaling.delayed_update` for ``slots`` (see :meth:`_index`) whose
        recorded amaxes are ``last``."""
        index = slots[1]
        h = self.history if index is None else self.history.index_select(0, index)
        new = delayed_update(h, last, *self._gather(slots, self._scaled_max, self.scale, self.expected),
                             self._most_recent)
        for target, value in zip((self.history, self.scale, self.scale_inv, self.expected, self.kept), new):
            if index is None:
                target.copy_(value)
            else:
                target.index_copy_(0, index, value)
        for s in slots[0]:
            self.updates[s] += 1
