"""Collects one training step's stats on the device and hands them over as one batch.

Adapters call :meth:`StepCollector.record` (and its narrower siblings) from forward and
backward hooks; each call keeps one row (still on the device) and the id of the tensor it
describes. :meth:`StepCollector.end_step` gathers the step's rows with a constant number of ops
(one stack of the narrow rows' values, the what-if banks' blocks, one cat with the scalar
tensors) and starts one copy to the host (non-blocking into pinned memory on CUDA). Nothing here
waits for the device.

Sampling: every captured step gets cheap stats (the amax and the scales in use: no pass over
the tensor where the recipe already computed its amax, one fused pass for what-if tensors);
steps where ``step % every == 0`` get full stats. Steps outside ``steps=(lo, hi)`` are not
captured at all (the hooks return at once).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from fp8scope.autograd_phase import in_backward
from fp8scope.capture.stats import stats_call
from fp8scope.emulate.amax import logged_amax
from fp8scope.emulate.device_bank import DeferredRow, DeferredRows, DeviceDelayedBank
from fp8scope.formats import Fp8Format
from fp8scope.schema import base_role
from fp8scope.step_payload import StepPayload, TensorKey

__all__ = ["StepCollector", "StepPayload", "TensorKey"]

_NO_LAYERS: frozenset = frozenset()


class StepCollector:
    """Per-step buffer of on-device stats vectors. One instance per Monitor."""

    def __init__(self, roles: tuple[str, ...], every: int, steps: tuple[int, int] | None, capture_no_grad: bool):
        self.roles = frozenset(roles)
        self.every = max(1, int(every))
        self.steps = steps
        self.capture_no_grad = capture_no_grad
        self.keys: list[TensorKey] = []
        self._key_ids: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()  # backward hooks may run on autograd's device threads
        # (row, key id, numel) in execution order. A row is a full-stats vector (step_payload.N_WIDE, float64),
        # a narrow tuple of 0-d float32 tensors (CHEAP_FIELDS), or a DeferredRow of a what-if bank; or
        # (DeferredRows, key ids, numel): several tensors' rows, captured together (record_rows).
        self.caps: list[tuple[Any, int, int]] = []
        self._recomputed: list[tuple[Any, int, int]] = []  # forwards re-run inside backward
        self._device_banks: dict[tuple, DeviceDelayedBank] = {}  # (id(recipe), device) -> what-if states
        self.resumed: dict = {}  # (layer, role) -> where a resumed run's what-if tensor starts (fp8scope.resume)
        self.step = 0
        self.full = True
        self.active = True
        self.enabled = True
        self.new_keys = False  # a tensor was seen for the first time this step (manifest update)
        self.recipe_seen: dict | None = None  # the first recipe a framework's layers reported (note_recipe)
        self._layer_recipes: dict[str, str] = {}  # layer -> the recipe kind its scales come from (layer_recipe)
        self.force_full = 0  # the next N steps get full stats (set after a suspicious cheap step)
        self.force_layers: frozenset | None = None  # ... of these layers (None: every one)
        # this step's layers that take full stats on a cheap step: adapters test ``full or layer in focus``
        # (an attribute and a set lookup, no call: a capture's Python is a GPU step's host time)
        self.focus: frozenset = _NO_LAYERS
        self.whatif_recipes: tuple[str, ...] = ()  # other recipes measured on full steps (capture.stats)
        # layers whose module ran traced (torch.compile) with what their adapter reads in eager forwards only
        # (MoE experts run as a loop): not captured; the monitor says so once and updates the coverage
        self.traced_layers: set[str] = set()
        self._recipe_rows: list[tuple[int, tuple[str, ...], torch.Tensor]] = []  # (kid, recipes, [n, RECIPE_FIELDS])

    # ---- step boundaries ------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        forced = self.force_full > 0
        self.full = step % self.every == 0 or (forced and self.force_layers is None)
        self.focus = self.force_layers if forced and not self.full else _NO_LAYERS
        if forced:
            self.force_full -= 1
        lo, hi = self.steps if self.steps is not None else (None, None)
        self.active = self.enabled and (lo is None or step >= lo) and (hi is None or step < hi)

    def look_closer(self, steps: int, layers: frozenset | None) -> None:
        """Full stats on the next ``steps`` steps for ``layers`` (None: every layer), added to a closer
        look already under way (``detect.triage``: the layers a clip was seen in, or all after a NaN)."""
        if steps <= 0:
            return
        if self.force_full > 0:
            layers = None if self.force_layers is None or layers is None else self.force_layers | layers
        self.force_layers = layers
        self.force_full = max(self.force_full, steps)

    def wants(self, role: str, grad_enabled: bool | None = None) -> bool:
        """Capture this role now? Forwards under no_grad (eval) are skipped unless asked for;
        gradients only exist in training, so they always pass that test."""
        role = base_role(role)
        if not (self.active and role in self.roles):
            return False
        if role == "gradient" or self.capture_no_grad:
            return True
        return torch.is_grad_enabled() if grad_enabled is None else grad_enabled

    def key_id(self, layer: str, role: str, source: str, fmt: Fp8Format, shape: tuple[int, ...]) -> int:
        """The id of the tensor (layer, role), made on its first capture."""
        kid = self._key_ids.get((layer, role))
        if kid is None:
            if torch.compiler.is_compiling():  # dynamo traces the hook: no lock (it cannot enter one)
                return self._new_key(layer, role, source, fmt, shape)
            with self._lock:
                kid = self._key_ids.get((layer, role))
                if kid is None:
                    kid = self._new_key(layer, role, source, fmt, shape)
        return kid

    def _new_key(self, layer, role, source, fmt, shape) -> int:
        kid = len(self.keys)
        self.keys.append(TensorKey(layer, role, source, fmt.name, fmt.max, tuple(shape),
                                   self._layer_recipes.get(layer)))
        self._key_ids[(layer, role)] = kid
        self.new_keys = True
        return kid

    def _append(self, role: str, row: Any, kid: int, numel: int) -> None:
        # Activation checkpointing re-runs forwards during backward. Those captures go aside and
        # only count for tensors the step has no ordinary capture of (use_reentrant=True runs the
        # first forward under no_grad, where nothing was captured): no double counting either way.
        # (``startswith``: ``base_role`` inline, as this runs for every capture.)
        if not role.startswith("gradient") and in_backward():
            self._recomputed.append((row, kid, numel))
        else:
            self.caps.append((row, kid, numel))  # one append: atomic, so no lock between hook threads

    def note_recipe(self, recipe: dict) -> None:
        """A framework's layers train under ``recipe`` (the manifest's recipe form: ``kind`` and
        fields): the run's manifest names it when no emulated layer gave one (``Monitor``). The first
        one reported is kept."""
        if self.recipe_seen is None:
            self.recipe_seen = recipe

    def layer_recipe(self, layer: str, kind: str) -> None:
        """``layer``'s tensors are cast under a recipe of ``kind`` (``Recipe.kind``: delayed, current,
        rowwise, mxfp8, block128, nvfp4; a what-if layer's simulated recipe): its rows say so, and the
        detector reads it (one scale per tensor or per block). Adapters call it before the layer's
        first capture; a key keeps the kind it was made with."""
        self._layer_recipes[layer] = kind

    def warn(self, key: str, message: str) -> None:
        """Replaced by the Monitor (one warning per key); the default warns every time."""
        import warnings

        warnings.warn(f"fp8scope: {message}", RuntimeWarning, stacklevel=2)

    def fail(self, exc: BaseException) -> None:
        """Replaced by the Monitor (warn once, stop capturing); the default just stops."""
        self.enabled = False
        self.active = False

    # ---- called from hooks ------------------------------------------------------------
    def record(self, layer, role, source, fmt, x, scale, scale_inv, expected_amax, deq=None, amax=None,
               original=None):
        """One capture; the adapter has already checked ``wants(role)``.

        ``amax``: the tensor's logged amax when the adapter already has it (a recipe computed it to
        derive the scale); cheap steps then read no tensor data at all, else they take one fused
        amax pass. Returns, on full steps, TE's amax of ``x`` (NaN elements ignored) as measured
        by the stats pass, so a what-if state can record it without reading ``x`` again."""
        kid = self.key_id(layer, role, source, fmt, tuple(x.shape))
        if self.full or layer in self.focus:
            recipes = self._recipes_for(role)
            if recipes:
                try:
                    vec, recorded, matrix = stats_call(x, scale, scale_inv, expected_amax, fmt, deq=deq, recipes=recipes,
                                                       role=base_role(role), whole=original)
                    self._recipe_rows.append((kid, recipes, matrix))
                except Exception as exc:  # the recipes are extra: their failure stops them, not the capture
                    self.whatif_recipes = recipes = ()
                    self.warn("whatif-recipes", f"measuring other recipes failed ({type(exc).__name__}: {exc}); "
                              "they are switched off, capture goes on")
            if not recipes:
                vec, recorded, _ = stats_call(x, scale, scale_inv, expected_amax, fmt, deq=deq)
            self._append(role, vec, kid, x.numel())
            return recorded
        if amax is None:
            amax = logged_amax(x)
        self._append(role, (amax, scale, scale_inv, expected_amax), kid, x.numel())
        return None

    def _recipes_for(self, role: str) -> tuple[str, ...]:
        """The other recipes to measure on this full-step capture, in the stats pass itself
        (``original``: the tensor as the layer holds it, where ``x`` is a view of its blocks). A
        columnwise copy is the same values, and a forward re-run inside backward was measured in
        its first run: neither is measured again."""
        if not self.whatif_recipes or "@" in role or (base_role(role) != "gradient" and in_backward()):
            return ()
        return self.whatif_recipes

    def record_values(self, layer, role, source, fmt, x, values: tuple) -> None:
        """A cheap step's capture from a scaling state's ``latest()`` tuple ``(amax, scale,
        scale_inv, expected_amax)`` of 0-d tensors: no op at all (the adapter has already checked
        ``wants(role)`` and ``not full``)."""
        kid = self._key_ids.get((layer, role))
        if kid is None:
            kid = self.key_id(layer, role, source, fmt, tuple(x.shape))
        self._append(role, values, kid, x.numel())

    def device_bank(self, recipe: Any, device: torch.device) -> DeviceDelayedBank:
        """The :class:`~fp8scope.emulate.device_bank.DeviceDelayedBank` shared by the what-if tensors
        under ``recipe`` on ``device``; its rows and updates are resolved when each step ends."""
        key = (id(recipe), str(device))
        bank = self._device_banks.get(key)
        if bank is None:
            bank = self._device_banks[key] = DeviceDelayedBank(recipe, device)
        return bank

    def record_rows(self, role: str, rows: DeferredRows, kids: list[int]) -> None:
        """Cheap captures of ``kids`` (one per row of ``rows``, in order) made together: a grouped
        GEMM's experts. One entry for all of them, so the step's Python stays per GEMM."""
        self._append(role, rows, kids, -1)

    # A cheap capture whose row a device bank fills when the step ends (its place in the step's order
    # is taken now; ``row`` a DeferredRow, ``kid`` from :meth:`key_id`): ``_append`` itself, so a
    # capture costs one call here, not two.
    record_deferred = _append

    def record_amax(self, layer, role, source, fmt, amax, scale, scale_inv, expected_amax, shape=()) -> None:
        """A narrow row from an amax someone else computed (e.g. TE's amax history), no tensor at hand
        (also on full steps: the counts stay unknown)."""
        kid = self.key_id(layer, role, source, fmt, tuple(shape))
        self._append(role, (amax, scale, scale_inv, expected_amax), kid, -1)

    # ---- end of step ------------------------------------------------------------------
    def end_step(self, scalars: dict[str, Any]) -> StepPayload:
        """Gather this step's rows and scalar tensors and start the single host transfer."""
        with self._lock:
            caps, recomputed = self.caps, self._recomputed
            self.caps, self._recomputed = [], []
            recipe_rows, self._recipe_rows = self._recipe_rows, []
        if recomputed:
            def first(kid):  # a block of rows counts as captured by its first tensor: all are captured together
                return kid if type(kid) is int else kid[0]

            seen = {first(kid) for _, kid, _ in caps}
            caps = caps + [c for c in recomputed if first(c[1]) not in seen]
        tensor_scalars, names, host_scalars = self._scalars(scalars)
        wide: list[torch.Tensor] = []
        narrow: list = []  # tuples of four 0-d tensors or floats
        # bank -> (the first row's place in the step, its bank row, the rows' count)
        deferred: dict[DeviceDelayedBank, list[tuple[int, int, int]]] = {}
        order: list[int] = []
        key_ids: list[int] = []
        numels: list[int] = []
        for row, kid, numel in caps:
            kind = type(row)
            if kind is DeferredRows:  # several tensors' rows: their ids, places and counts at once
                deferred.setdefault(row.bank, []).append((len(order), row.index, row.count))
                order.extend([None] * row.count)
                key_ids.extend(kid)
                numels.extend([numel] * row.count)
                continue
            if kind is tuple:
                order.append(-1 - len(narrow))
                narrow.append(row)
            elif kind is DeferredRow:
                deferred.setdefault(row.bank, []).append((len(order), row.index, 1))
                order.append(None)
            else:
                order.append(len(wide))
                wide.append(row)
            key_ids.append(kid)
            numels.append(numel)
        blocks = [self._stack_narrow(narrow)] if narrow else []
        n_narrow = len(narrow)
        for bank in self._device_banks.values():
            rows = bank.take_rows()  # the step's updates run here too (TE's timing: end of step)
            taken = deferred.get(bank)
            if rows is None or not taken:
                continue
            for i, bank_row, count in taken:
                first = -1 - (n_narrow + bank_row)
                if count == 1:
                    order[i] = first
                else:
                    order[i:i + count] = range(first, first - count, -1)
            blocks.append(rows)
            n_narrow += rows.shape[0]
        recipe_keys = [(kid, recipe) for kid, recipes, _ in recipe_rows for recipe in recipes]
        if recipe_rows:  # after the narrow rows, before the scalars: the same single transfer
            blocks.append(torch.cat([m for _, _, m in recipe_rows]) if len(recipe_rows) > 1 else recipe_rows[0][2])
        host, ready = self._host_array(wide, blocks, tensor_scalars)
        return StepPayload(
            step=self.step, full=self.full, wall_time=time.time(), key_ids=key_ids, order=order,
            n_wide=len(wide), n_narrow=n_narrow, host=host, ready=ready, scalar_names=names,
            host_scalars=host_scalars, numels=numels,
            n_recipe=len(recipe_keys), recipe_keys=recipe_keys, focus=self.focus,
        )

    @staticmethod
    def _stack_narrow(narrow: list) -> torch.Tensor:
        """The narrow rows as one [n, 4] tensor: one stack of their 0-d values. Python numbers,
        per-row tensors or values on another device (recipe constants, TE state on the CPU) make
        the stack refuse; then every value is made a 0-d float32 on the step's device first."""
        flat = [v for row in narrow for v in row]
        try:
            return torch.stack(flat).view(len(narrow), 4)
        except (TypeError, RuntimeError):
            device = next((v.device for v in flat if isinstance(v, torch.Tensor) and v.device.type != "cpu"),
                          torch.device("cpu"))
            flat = [_scalar32(v, device, "min" if i % 4 == 1 else "max") for i, v in enumerate(flat)]
            return torch.stack(flat).view(len(narrow), 4)

    @staticmethod
    def _scalars(scalars: dict[str, Any]) -> tuple[list[torch.Tensor], list[str], dict[str, float]]:
        """The step's scalars split into device tensors (they travel with the step's transfer) and
        their names, and host numbers."""
        tensor_scalars: list[torch.Tensor] = []
        names: list[str] = []
        host_scalars: dict[str, float] = {}
        for name, value in scalars.items():
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"scalar {name!r} must be a single number, got shape {tuple(value.shape)}")
                if value.is_cpu:  # reading it is a memory read, not a device sync: it goes as a float
                    host_scalars[name] = float(value.item())
                else:
                    tensor_scalars.append(value.detach().reshape(1))
                    names.append(name)
            else:
                host_scalars[name] = float(value)
        return tensor_scalars, names, host_scalars

    @staticmethod
    def _host_array(wide: list, blocks: list, tensor_scalars: list):
        """The step's wide rows, narrow rows and scalar tensors as one flat float64 host tensor, and
        the CUDA event that says the copy has landed (None when it is valid already).

        The event is blocking: the writer thread that waits on it sleeps until the copy lands. A
        default event's wait spins, and the copy lands when the GPU reaches the end of the step,
        which on a GPU-bound model is most of a step after ``step()`` returned: a core spinning
        beside training and its data loader's workers (an H200 training a 1.1B Llama showed it,
        docs/benchmarks.md, "On a GPU")."""
        parts = ([torch.stack(wide).reshape(-1)] if wide else []) + [b.reshape(-1) for b in blocks] + tensor_scalars
        if not parts:
            return torch.zeros(0, dtype=torch.float64), None
        device = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
        parts = [p if p.device == device else p.to(device, non_blocking=True) for p in parts]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        if flat.dtype != torch.float64:
            flat = flat.to(torch.float64)
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            ready = torch.cuda.Event(blocking=True)
            ready.record()
            return host, ready
        return flat, None


def _scalar32(value: Any, device: torch.device, reduce: str) -> torch.Tensor:
    """0-d float32 on ``device``; per-row / per-block tensors summarised by their most conservative
    member (the smallest scale; the largest amax, scale_inv and expected amax)."""
    if isinstance(value, torch.Tensor):
        v = value.detach()
        if v.numel() > 1:
            v = v.amin() if reduce == "min" else v.amax()
        return v.reshape(()).to(device=device, dtype=torch.float32)
    return torch.full((), float(value), dtype=torch.float32, device=device)  # a fill: no copy from the host
