"""Collects one training step's stats on the device and hands them over as one batch.

Adapters call :meth:`StepCollector.record` from forward and backward hooks; each call
appends one stats vector (still on the device) and the id of the tensor it describes.
:meth:`StepCollector.end_step` stacks the vectors together with the step's scalar
tensors into a single device tensor and starts one copy to the host (non-blocking into
pinned memory on CUDA). Nothing here waits for the device.

Sampling: every captured step gets cheap stats (amax and the scales in use, one pass);
steps where ``step % every == 0`` get full stats. Steps outside ``steps=(lo, hi)`` are
not captured at all (the hooks return at once).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from fp8scope import native
from fp8scope.capture.autograd_phase import in_backward
from fp8scope.capture.row_log import KEY, NUMEL, RowLog
from fp8scope.capture.row_log import WIDTH as ROW_WIDTH
from fp8scope.capture.stats import CHEAP_FIELDS, cheap_row, cheap_vector, full_row
from fp8scope.emulate.device_bank import DeferredRow, DeviceDelayedBank
from fp8scope.formats import Fp8Format
from fp8scope.schema import FIELD_INDEX, N_FIELDS

_AMAX = FIELD_INDEX["amax"]


@dataclass(frozen=True)
class TensorKey:
    """Identity of one monitored tensor; its row in the store carries these strings."""

    layer: str
    role: str
    source: str
    fmt: str
    fp8_max: float
    shape: tuple[int, ...]


@dataclass
class StepPayload:
    """Everything the writer thread needs to turn one step into record batches."""

    step: int
    full: bool
    wall_time: float
    key_ids: list[int]  # one per stats row, in execution order
    n_rows: int
    host: torch.Tensor  # flat float64: n_rows * N_FIELDS stats, then the scalar tensors
    ready: Any  # a CUDA event to wait on, or None when ``host`` is already valid
    scalar_names: list[str]  # names of the scalar tensors at the tail of ``host``
    host_scalars: dict[str, float] = field(default_factory=dict)  # scalars given as Python numbers
    numels: list[int] = field(default_factory=list)  # per stats row (cheap rows carry no numel on device)
    # A cheap step whose rows are all the kernel's captures: the row log's rows (array of doubles,
    # row_log.WIDTH per row), from which expand() makes key_ids, numels and host when a reader
    # needs them; the writer's own fast path (step_records.cheap_log_message) reads them as they are.
    logged: Any = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def expand(self) -> None:
        """Fill ``key_ids``, ``numels`` and ``host`` from ``logged`` (once; a no-op otherwise)."""
        if self.logged is None or self.host is not None:
            return
        rows = np.frombuffer(self.logged, dtype=np.float64).reshape(self.n_rows, ROW_WIDTH)
        self.key_ids = rows[:, KEY].astype(np.int64).tolist()
        self.numels = rows[:, NUMEL].astype(np.int64).tolist()
        self.host = torch.from_numpy(np.ascontiguousarray(rows[:, :len(CHEAP_FIELDS)]).reshape(-1))


class StepCollector:
    """Per-step buffer of on-device stats vectors. One instance per Monitor."""

    row_log_capacity = 1024  # rows the what-if row log starts with (it grows when a step needs more)

    def __init__(self, roles: tuple[str, ...], every: int, steps: tuple[int, int] | None, capture_no_grad: bool):
        self.roles = frozenset(roles)
        self.every = max(1, int(every))
        self.steps = steps
        self.capture_no_grad = capture_no_grad
        self.keys: list[TensorKey] = []
        self._key_ids: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()  # backward hooks may run on autograd's device threads
        # (stats row, key id, numel) in execution order; the what-if kernel captures, which go to
        # ``row_log``, note its length to keep their place
        self.caps: list[tuple[Any, int, int]] = []
        self._recomputed: list[tuple[torch.Tensor, int, int]] = []  # forwards re-run inside backward
        self._banks: dict[int, Any] = {}  # id(recipe) -> HostDelayedBank: what-if states, updated at the step's end
        self.row_log: RowLog | None = None  # rows of the banks' kernel captures (made with the first bank)
        self.bank_capture: Any = None  # the kernel's capture function while there is a bank (see host_bank)
        self._device_banks: dict[tuple, DeviceDelayedBank] = {}  # (id(recipe), device) -> what-if states off the CPU
        self.step = 0
        self.full = True
        self.active = True
        self.enabled = True
        self.new_keys = False  # a tensor was seen for the first time this step (manifest update)
        self.force_full = 0  # the next N steps get full stats (set after a suspicious cheap step)

    # ---- step boundaries ------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.full = step % self.every == 0 or self.force_full > 0
        if self.force_full > 0:
            self.force_full -= 1
        if self.row_log is not None:  # looked up per step: the kernel may finish building, or be switched off
            self.bank_capture = native.bank_capture_fn()
        lo, hi = self.steps if self.steps is not None else (None, None)
        self.active = self.enabled and (lo is None or step >= lo) and (hi is None or step < hi)

    def wants(self, role: str, grad_enabled: bool | None = None) -> bool:
        """Capture this role now? Forwards under no_grad (eval) are skipped unless asked for;
        gradients only exist in training, so they always pass that test."""
        if not (self.active and role in self.roles):
            return False
        if role == "gradient" or self.capture_no_grad:
            return True
        return torch.is_grad_enabled() if grad_enabled is None else grad_enabled

    def key_id(self, layer: str, role: str, source: str, fmt: Fp8Format, shape: tuple[int, ...]) -> int:
        """The id of the tensor (layer, role), made on its first capture: an adapter with a fast path
        of its own keeps it (the what-if tap's kernel captures write it into their rows)."""
        kid = self._key_ids.get((layer, role))
        if kid is None:
            with self._lock:
                kid = self._key_ids.get((layer, role))
                if kid is None:
                    kid = len(self.keys)
                    self.keys.append(TensorKey(layer, role, source, fmt.name, fmt.max, tuple(shape)))
                    self._key_ids[(layer, role)] = kid
                    self.new_keys = True
        return kid

    def _append(self, role: str, vec: torch.Tensor, kid: int, numel: int) -> None:
        # Activation checkpointing re-runs forwards during backward. Those captures go aside and
        # only count for tensors the step has no ordinary capture of (use_reentrant=True runs the
        # first forward under no_grad, where nothing was captured): no double counting either way.
        if role != "gradient" and in_backward():
            self._recomputed.append((vec, kid, numel))
        else:
            self.caps.append((vec, kid, numel))  # one append: atomic, so no lock between hook threads

    def fail(self, exc: BaseException) -> None:
        """Replaced by the Monitor (warn once, stop capturing); the default just stops."""
        self.enabled = False
        self.active = False

    # ---- called from hooks ------------------------------------------------------------
    def record(self, layer, role, source, fmt, x, scale, scale_inv, expected_amax, deq=None, amax=None) -> float | None:
        """One capture; the adapter has already checked ``wants(role)``.

        ``amax``: the tensor's amax when the adapter already has it (a recipe computed it to
        derive the scale); cheap steps then cost no pass over the tensor at all. Returns the amax
        that full stats measured on the host (NaN-propagating), else None: a what-if state can
        record it instead of reading the tensor a second time."""
        kid = self.key_id(layer, role, source, fmt, tuple(x.shape))
        if self.full:
            vec = full_row(x, scale, scale_inv, expected_amax, fmt, deq=deq, amax=amax)
        else:
            vec = cheap_row(x, scale, scale_inv, expected_amax, amax=amax)
        self._append(role, vec, kid, x.numel())
        return vec[_AMAX] if type(vec) is list else None

    def record_values(self, layer, role, source, fmt, x, values: tuple) -> None:
        """A cheap step's capture from a scaling state's ``latest()`` tuple ``(amax, scale,
        scale_inv, expected_amax)``; the adapter has already checked ``wants(role)`` and ``not full``.

        The per-tensor hot path of every cheap step (emulated layers, what-if states), so it does
        the least work: with host floats (CPU states) the tuple itself is the row."""
        kid = self._key_ids.get((layer, role))
        if kid is None:
            kid = self.key_id(layer, role, source, fmt, tuple(x.shape))
        if type(values[0]) is not float:  # device states: one small stack on the device
            values = cheap_vector(x, values[1], values[2], values[3], amax=values[0])
        self._append(role, values, kid, x.numel())

    def host_bank(self, recipe: Any) -> Any:
        """The :class:`~fp8scope.emulate.scaling_bank.HostDelayedBank` shared by the what-if
        tensors under ``recipe``; its pending updates run when each step ends, and its kernel
        captures append to :attr:`row_log`."""
        bank = self._banks.get(id(recipe))
        if bank is None:
            from fp8scope.emulate.scaling_bank import HostDelayedBank

            if self.row_log is None:
                self.row_log = RowLog(self.row_log_capacity)
                self.row_log.set_threads(torch.get_num_threads())
            bank = self._banks[id(recipe)] = HostDelayedBank(recipe)
            bank.attach_log(self.row_log)
            self.bank_capture = native.bank_capture_fn()
        return bank

    def device_bank(self, recipe: Any, device: torch.device) -> DeviceDelayedBank:
        """The :class:`~fp8scope.emulate.device_bank.DeviceDelayedBank` shared by the what-if tensors
        under ``recipe`` on ``device``; its rows and updates are resolved when each step ends."""
        key = (id(recipe), str(device))
        bank = self._device_banks.get(key)
        if bank is None:
            bank = self._device_banks[key] = DeviceDelayedBank(recipe, device)
        return bank

    def record_deferred(self, role: str, row: DeferredRow, kid: int, numel: int) -> None:
        """A cheap capture whose row a device bank fills when the step ends (its place in the step's
        order is taken now); ``kid`` from :meth:`key_id`."""
        self._append(role, row, kid, numel)

    def record_amax(self, layer, role, source, fmt, amax, scale, scale_inv, expected_amax, shape=()) -> None:
        """A row from an amax someone else computed (e.g. TE's amax history), no tensor at hand."""
        kid = self.key_id(layer, role, source, fmt, tuple(shape))
        dev = amax.device if isinstance(amax, torch.Tensor) else torch.device("cpu")
        vec = cheap_vector(torch.zeros(0, device=dev), scale, scale_inv, expected_amax, amax=amax)
        if self.full:  # a full step's rows are full-width; the counts stay unknown (NaN)
            wide = torch.full((N_FIELDS,), float("nan"), dtype=torch.float64, device=dev)
            wide[[FIELD_INDEX[f] for f in CHEAP_FIELDS]] = vec.to(torch.float64)
            vec = wide
        self._append(role, vec, kid, -1)

    # ---- end of step ------------------------------------------------------------------
    def end_step(self, scalars: dict[str, Any]) -> StepPayload:
        """Stack this step's stats and scalar tensors and start the single host transfer."""
        with self._lock:
            caps, recomputed = self.caps, self._recomputed
            self.caps, self._recomputed = [], []
        logged = None
        if self.row_log is not None:
            logged = self.row_log.take()
            self.row_log.set_threads(torch.get_num_threads())
        for bank in self._banks.values():
            # TE's timing: the step's recorded amaxes give the next step's scales
            bank.update(captured=logged is not None)
        for device_bank in self._device_banks.values():
            device_bank.resolve()  # the deferred rows get their values, the updates run
        tensor_scalars, names, host_scalars = self._scalars(scalars)
        if logged is not None and not caps and not recomputed and not tensor_scalars:
            # only the kernel's captures (a what-if model on the CPU): the log is the step's rows,
            # handed over as they are (no numpy here: see RowLog.take)
            return StepPayload(
                step=self.step, full=self.full, wall_time=time.time(), key_ids=None, n_rows=len(logged) // ROW_WIDTH,
                host=None, ready=None, scalar_names=names, host_scalars=host_scalars, numels=None, logged=logged,
            )
        if logged is not None:
            caps = _merge_logged(caps, logged)
        vecs, rows, numels = (list(column) for column in zip(*caps)) if caps else ([], [], [])
        if recomputed:
            seen = set(rows)
            for vec, kid, numel in recomputed:
                if kid not in seen:
                    vecs.append(vec)
                    rows.append(kid)
                    numels.append(numel)
        if self._device_banks:
            vecs = [v.value if type(v) is DeferredRow else v for v in vecs]
        host, ready = self._host_array(vecs, tensor_scalars)
        return StepPayload(
            step=self.step, full=self.full, wall_time=time.time(), key_ids=rows, n_rows=len(rows), host=host,
            ready=ready, scalar_names=names, host_scalars=host_scalars, numels=numels,
        )

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
    def _host_array(vecs: list, tensor_scalars: list[torch.Tensor]):
        """The step's rows then its scalar tensors as one flat float64 host tensor, and the CUDA event
        that says the copy has landed (None when it is valid already)."""
        first = next((v for v in vecs if isinstance(v, torch.Tensor)), None)
        if first is None and not tensor_scalars:
            # everything already on the host (CPU kernel, host scaling states; CPU scalars came as
            # floats): one numpy array, no torch op at all
            flat = np.fromiter(chain.from_iterable(vecs), dtype=np.float64) if vecs else np.zeros(0)
            return torch.from_numpy(flat), None
        parts = tensor_scalars
        if vecs and first is None:
            # every row computed on the host (CPU kernel, host scaling states): one tensor, one call
            parts = [torch.from_numpy(np.array(vecs, dtype=np.float64).reshape(-1))] + tensor_scalars
        elif vecs:  # one stack for all rows: a handful of device ops per step, not per tensor
            vecs = [v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=first.dtype, device=first.device)
                    for v in vecs]
            device = first.device
            if any(v.device != device for v in vecs):
                vecs = [v.to(device, non_blocking=True) for v in vecs]
            parts = [torch.stack(vecs).reshape(-1)] + tensor_scalars
        device = parts[0].device if parts else torch.device("cpu")
        if any(p.device != device or p.dtype != torch.float64 for p in parts):
            parts = [p.to(device=device, dtype=torch.float64, non_blocking=True) for p in parts]
        flat = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else torch.zeros(0, dtype=torch.float64))
        ready = None
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = flat
        return host, ready


def _merge_logged(caps: list, logged) -> list:
    """``caps`` with the row log's captures (``logged``: ``RowLog.take()``'s flat rows) put back in
    their places (a row's ``after``: how many of ``caps`` came before it), as ``(row tuple, key id,
    numel)`` entries like theirs."""
    merged: list = []
    taken = 0
    for amax, scale, scale_inv, expected, kid, numel, after in zip(*[iter(logged)] * ROW_WIDTH):
        after = int(after)
        if after > taken:
            merged.extend(caps[taken:after])
            taken = after
        merged.append(((amax, scale, scale_inv, expected), int(kid), int(numel)))
    merged.extend(caps[taken:])
    return merged


def cheap_rows(payload: StepPayload) -> tuple["Any", "Any"]:
    """A cheap step's (n_rows, len(CHEAP_FIELDS)) rows, as captured, and the scalar values."""
    payload.expand()
    arr = payload.host.numpy()
    n = payload.n_rows * len(CHEAP_FIELDS)
    return arr[:n].reshape(payload.n_rows, len(CHEAP_FIELDS)), arr[n:]


def stats_matrix(payload: StepPayload) -> tuple["Any", "Any"]:
    """Split a payload's host tensor into the (n_rows, N_FIELDS) stats matrix and the scalar values.

    Full steps carry full-width rows; cheap steps carry only ``CHEAP_FIELDS`` per row on the
    device, widened here (numel comes from the host-side shapes, the counts stay NaN)."""
    payload.expand()
    if not payload.full:
        rows, tail = cheap_rows(payload)
        return widen_cheap_rows(rows, payload.numels), tail
    arr = payload.host.numpy()
    n = payload.n_rows * N_FIELDS
    return arr[:n].reshape(payload.n_rows, N_FIELDS), arr[n:]


def widen_cheap_rows(rows, numels) -> "Any":
    """Cheap rows (``CHEAP_FIELDS`` columns) as ``STAT_FIELDS`` rows: numel from the captures'
    host-side shapes (-1: no tensor at hand), the full-only fields NaN."""
    matrix = np.full((len(rows), N_FIELDS), np.nan)
    matrix[:, [FIELD_INDEX[f] for f in CHEAP_FIELDS]] = rows
    numel = np.asarray(numels, dtype=np.float64)
    matrix[:, FIELD_INDEX["numel"]] = np.where(numel >= 0, numel, np.nan)
    return matrix
