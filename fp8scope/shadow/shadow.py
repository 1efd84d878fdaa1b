"""``fp8scope.Shadow``: BF16 shadow steps beside an FP8 training run. See docs/shadow.md.

    shadow = fp8scope.Shadow(mon, model, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                             optimizer=opt, compare_every=50, fork_steps=20)
    for batch in loader:
        loss = shadow.loss_fn(model, batch)
        loss.backward()
        shadow.after_step(batch)        # after backward, BEFORE optimizer.step()
        opt.step(); opt.zero_grad()
        mon.step(loss=loss)
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections import deque
from typing import Any, Callable, Iterable

import pyarrow as pa
import torch
from torch import nn

from fp8scope.capture.adapters import plain_context

from .compare import CompareResult, FP8Capture, bf16_pass
from .fork import Fork, baseline_of, make_replica, replica_bytes, verdict
from .precision import compared_layers
from .tables import COMPARE_TABLE, FORK_TABLE, SHADOW_COMPARE_SCHEMA, SHADOW_FORK_SCHEMA

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _get_rng():
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return torch.get_rng_state(), cuda


def _set_rng(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _name_filter(spec):
    from fp8scope.monitor import _name_filter as f

    return f(spec)


class Shadow:
    """BF16 shadow steps for an FP8 run: per-layer compare and BF16 forks with a verdict.

    Args:
        monitor: the run's ``fp8scope.Monitor`` (results go to its ``shadow_compare`` and
            ``shadow_fork`` tables and use its step numbers), or None (results only in
            ``shadow.compares`` / ``shadow.forks``).
        model: the FP8 model (emulated ``Fp8Linear``, torchao ``Float8Linear`` or TE layers).
        loss_fn: ``loss_fn(model, batch) -> loss``: the forward of one training step. Call it
            through ``shadow.loss_fn(model, batch)`` in your loop (it records the RNG state
            and the loss the shadow passes need).
        optimizer: needed for forks (its state is copied into the replica).
        compare_every: compare at every step ``s`` with ``s % compare_every == 0`` (0: only
            on demand, ``compare_next()``).
        fork_every: start a fork every this many steps (0: only on demand / on events).
        fork_steps: steps a fork trains its BF16 replica.
        diverge_factor, baseline_steps: the divergence test (see docs/shadow.md).
        layers, skip: regex or list of layer names to compare (default: all monitored kinds).
        sample_size: elements kept per tensor from the FP8 step (None: all; exact but one
            copy of every compared output and weight gradient).
        max_grad_norm: the replica clips its gradients like your loop does (None: no clip).
        replica_step: ``replica_step(model, optimizer, batch) -> loss`` to train the replica
            one step if your step is more than forward/backward/clip/step.
        local_error: also measure each emulated layer's own FP8 GEMM error on the BF16 input
            (re-quantizes input and weight: the most expensive part of a compare on CPU).
        keep: compare results kept in ``shadow.compares``.
    """

    def __init__(
        self,
        monitor: Any,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        compare_every: int = 0,
        fork_every: int = 0,
        fork_steps: int = 20,
        diverge_factor: float = 1.5,
        baseline_steps: int = 10,
        layers: str | Iterable[str] | None = None,
        skip: str | Iterable[str] | None = None,
        sample_size: int | None = 65536,
        max_grad_norm: float | None = None,
        replica_step: Callable | None = None,
        local_error: bool = True,
        keep: int = 64,
    ):
        self.monitor = monitor
        self.model = model
        self.optimizer = optimizer
        self.compare_every = int(compare_every or 0)
        self.fork_every = int(fork_every or 0)
        self.fork_steps = max(1, int(fork_steps))
        self.diverge_factor = float(diverge_factor)
        self.baseline_steps = max(1, int(baseline_steps))
        self.sample_size = sample_size
        self.max_grad_norm = max_grad_norm
        self.replica_step = replica_step
        self.local_error = bool(local_error)
        self.rank = int(getattr(monitor, "rank", 0) or 0)
        self.layers = compared_layers(model, _name_filter(layers), _name_filter(skip))
        self.compares: deque[CompareResult] = deque(maxlen=keep)
        self.forks: list[Fork] = []
        self.fork_bytes = 0  # bytes of the latest replica (params + buffers + optimizer state)
        self.enabled = True
        self._user_loss_fn = loss_fn
        self._count = 0
        self._in_shadow = False
        self._wrapper_depth = 0
        self._rng = None
        self._last_loss: torch.Tensor | None = None
        # (step, loss) of recent steps, long enough to reach back before an anomaly that a fork follows
        self._history: deque[tuple[int, torch.Tensor]] = deque(maxlen=max(self.baseline_steps, 256))
        self._anomaly_step: int | None = None  # the first warning / critical event heard of
        self._capture: FP8Capture | None = None
        self._armed_opt_steps = 0
        self._opt_steps = 0
        self._compare_requested = False
        self._fork_request: str | None = None
        self._lock = threading.Lock()
        self._fork: Fork | None = None
        self._warned: set[str] = set()
        # Plain closures, not bound methods: deepcopy (a fork's replica) copies hooks, and a
        # bound method would drag a copy of this Shadow (and its monitor) along.
        self._handles = [model.register_forward_pre_hook(lambda mod, args: self._root_pre_hook(mod, args))]
        if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
            self._handles.append(optimizer.register_step_post_hook(lambda o, a, k: self._opt_post_hook(o, a, k)))
        self._arm_if_due(self._step_now())

    # ---- the loss closure ------------------------------------------------------------
    def loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Your ``loss_fn``, recording what the shadow needs (RNG state before it, its loss)."""
        ours = model is self.model and not self._in_shadow
        if ours:
            self._rng = _get_rng()
        self._wrapper_depth += 1
        try:
            loss = self._user_loss_fn(model, batch)
        finally:
            self._wrapper_depth -= 1
        if ours and isinstance(loss, torch.Tensor):
            self._last_loss = loss.detach()
        return loss

    def _root_pre_hook(self, module, args):
        if self._in_shadow or module is not self.model:
            return None
        if self._wrapper_depth == 0:  # loss_fn called directly: RNG as of the model's forward
            self._rng = _get_rng()
        if self._compare_requested and self._capture is None:
            self._arm_if_due(self._step_now())  # on demand (maybe from another thread): arm here
        if self._capture is not None and torch.is_grad_enabled():  # eval forwards are not captured
            self._capture.new_forward()
            self._armed_opt_steps = self._opt_steps  # the weights this forward sees
        return None

    def _opt_post_hook(self, opt, args, kwargs):
        if opt is self.optimizer:
            self._opt_steps += 1

    # ---- requests (any thread: a detection callback runs in the monitor's writer thread) ----
    def compare_next(self) -> None:
        """Compare the next training step whose forward has not started yet (armed when it starts)."""
        self._compare_requested = True

    def fork(self, trigger: str = "manual") -> None:
        """Start a fork at the next ``after_step`` (ignored while one runs)."""
        with self._lock:
            if self._fork_request is None:
                self._fork_request = trigger

    def on_event(self, event: Any = None, *args: Any, **kwargs: Any) -> None:
        """Callback for online detection: ``Monitor(..., on_event=lambda ev: shadow.on_event(ev))``.
        Any event arms a compare of the next step; a warning or critical one also requests a fork
        (it starts at the next ``after_step``), unless it judges a simulated cast (``simulated``: a
        what-if layer, which trained in high precision, so BF16 is what already ran there; a MoE's
        experts under delayed scaling raise dozens of those). Thread-safe (detection runs in the
        writer thread)."""
        def field(name):
            for getter in (lambda e: e.get(name), lambda e: getattr(e, name, None)):
                try:
                    value = getter(event)
                except Exception:
                    continue
                if value is not None:
                    return value
            return None

        rule, severity, step = field("rule"), field("severity"), field("step")
        self.compare_next()
        if severity != "info" and not field("simulated"):  # info and simulated events only get a compare
            if step is not None:
                with self._lock:
                    if self._anomaly_step is None or int(step) < self._anomaly_step:
                        self._anomaly_step = int(step)
            self.fork(f"event:{rule}" + (f"@{int(step)}" if step is not None else "") if rule else "event")

    @property
    def fork_running(self) -> bool:
        return self._fork is not None

    @property
    def last_compare(self) -> CompareResult | None:
        return self.compares[-1] if self.compares else None

    # ---- per step ----------------------------------------------------------------------
    def _step_now(self) -> int:
        if self.monitor is not None and hasattr(self.monitor, "current_step"):
            return int(self.monitor.current_step)
        return self._count

    def after_step(self, batch: Any, loss: torch.Tensor | float | None = None) -> None:
        """Call once per step after ``loss.backward()`` and BEFORE ``optimizer.step()``, with the
        step's batch (and its loss if you did not call ``shadow.loss_fn``). Runs the compare pass if
        this step was armed, starts/advances a fork, and arms the next step if it is due."""
        if not self.enabled:
            return
        step = self._step_now()
        try:
            if loss is not None:
                loss_t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            else:
                loss_t = self._last_loss
            self._last_loss = None
            if self._capture is not None:
                self._finish_compare(step, batch, loss_t)
            self._advance_fork(step, batch, loss_t)
            if loss_t is not None:
                self._history.append((step, loss_t.reshape(()).float()))
            self._arm_if_due(step + 1)
        except Exception as exc:  # fail open: the user's training goes on
            self._disarm()
            self._fork = None
            self.enabled = False
            self._warn("fail", f"shadow steps disabled after an error ({type(exc).__name__}: {exc}); training continues")
        self._count += 1

    # ---- compare -----------------------------------------------------------------------
    def _arm_if_due(self, step: int) -> None:
        due = self._compare_requested or (self.compare_every > 0 and step % self.compare_every == 0)
        if not due or self._capture is not None or not self.layers:
            return
        self._compare_requested = False
        self._capture = FP8Capture(self.layers, self.sample_size)
        self._capture.arm()
        self._armed_opt_steps = self._opt_steps

    def _disarm(self) -> None:
        if self._capture is not None:
            self._capture.disarm()
            self._capture = None

    def _finish_compare(self, step: int, batch: Any, loss_fp8: torch.Tensor | None) -> None:
        cap = self._capture
        self._disarm()
        if self._opt_steps != self._armed_opt_steps:
            self._warn("order", "after_step() was called after optimizer.step(): the weights changed since the "
                                "FP8 forward, so the compare was skipped. Call it before optimizer.step().")
            return
        if not cap.outputs and not cap.wgrads:
            return  # the armed step ran no forward of the model (or under no_grad)
        t0 = time.perf_counter()
        with self._shadow_pass():
            loss_bf16, rows = bf16_pass(self.model, self._user_loss_fn, batch, cap, local=self.local_error)
        res = CompareResult(step, float(loss_fp8) if loss_fp8 is not None else math.nan, loss_bf16, rows,
                            time.perf_counter() - t0, cap.nbytes())
        self.compares.append(res)
        self._log_compare(res, cap.sampled)

    def _shadow_pass(self):
        shadow = self

        class _Ctx:
            def __enter__(self_):
                shadow._in_shadow = True
                self_.saved_rng = _get_rng()
                if shadow._rng is not None:
                    _set_rng(shadow._rng)
                col = getattr(shadow.monitor, "collector", None)
                self_.col, self_.active = col, getattr(col, "active", None)
                if col is not None:
                    col.active = False  # the monitor must not log the shadow pass as training stats
                return self_

            def __exit__(self_, *exc):
                _set_rng(self_.saved_rng)
                if self_.col is not None:
                    self_.col.active = self_.active
                shadow._in_shadow = False
                return False

        return _Ctx()

    def _log_compare(self, res: CompareResult, sampled: bool) -> None:
        if self.monitor is None or not res.rows:
            return
        n = len(res.rows)
        cols = {k: [r[k] for r in res.rows] for k in res.rows[0]}
        batch = pa.record_batch(
            {
                "step": pa.array([res.step] * n, pa.int64()),
                "rank": pa.array([self.rank] * n, pa.int32()),
                **{k: pa.array(v, pa.string() if k == "layer" else pa.float64()) for k, v in cols.items()},
                "loss_fp8": pa.array([res.loss_fp8] * n, pa.float64()),
                "loss_bf16": pa.array([res.loss_bf16] * n, pa.float64()),
                "sampled": pa.array([sampled] * n, pa.bool_()),
            },
            schema=SHADOW_COMPARE_SCHEMA,
        )
        self.monitor.log_table(COMPARE_TABLE, batch)

    # ---- fork --------------------------------------------------------------------------
    def _advance_fork(self, step: int, batch: Any, loss_fp8: torch.Tensor | None) -> None:
        if self._fork is None:
            with self._lock:
                trigger, self._fork_request = self._fork_request, None
            if trigger is None and self.fork_every > 0 and step > 0 and step % self.fork_every == 0:
                trigger = "every"
            if trigger is None:
                return
            if self.optimizer is None and self.replica_step is None:
                self._warn("noopt", "a fork needs the optimizer: Shadow(..., optimizer=opt)")
                return
            self._start_fork(step, trigger)
        f = self._fork
        with self._shadow_pass():
            loss_bf16 = self._replica_train_step(f, batch)
        if not f.step_ids:  # measured after the first step: optimizers create their state lazily
            f.bytes = replica_bytes(f.replica, f.optimizer)
            self.fork_bytes = f.bytes
        f.step_ids.append(step)
        f.loss_fp8.append(float(loss_fp8) if loss_fp8 is not None else math.nan)
        f.loss_bf16.append(loss_bf16)
        if len(f.loss_bf16) == 1:
            f.baseline = baseline_of(f.baseline_history, f.loss_fp8[0])
        if len(f.step_ids) >= f.steps:
            self._finish_fork(f)
        else:
            self._log_fork(f, len(f.step_ids) - 1)

    def _start_fork(self, step: int, trigger: str) -> None:
        # the baseline comes from before the first anomaly (the steps just before the fork may be broken)
        cut = self._anomaly_step if self._anomaly_step is not None else step
        before = [t for s, t in self._history if s < cut][-self.baseline_steps:]
        history = torch.stack(before).tolist() if before else []
        replica, opt = make_replica(self.model, self.optimizer)
        f = Fork(len(self.forks), step, self.fork_steps, trigger, history, replica, opt)
        self.forks.append(f)
        self._fork = f

    def _replica_train_step(self, f: Fork, batch: Any) -> float:
        if f.optimizer is not None and self.optimizer is not None:
            # Follow the real run's schedule (lr, weight decay...): schedulers change the real groups.
            for g_real, g_rep in zip(self.optimizer.param_groups, f.optimizer.param_groups):
                for k, v in g_real.items():
                    if k != "params":
                        g_rep[k] = v
        with plain_context(f.replica):
            if self.replica_step is not None:
                loss = self.replica_step(f.replica, f.optimizer, batch)
            else:
                loss = self._user_loss_fn(f.replica, batch)
                loss.backward()
                if self.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(f.replica.parameters(), self.max_grad_norm)
                f.optimizer.step()
                f.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach() if isinstance(loss, torch.Tensor) else loss)

    def _finish_fork(self, f: Fork, early: bool = False) -> None:
        f.verdict, f.reason = verdict(f.loss_fp8, f.loss_bf16, f.baseline, self.diverge_factor)
        if early:
            f.reason = f"ended after {len(f.step_ids)} of {f.steps} steps; " + f.reason
        f.release()
        self._fork = None
        if f.step_ids:
            self._log_fork(f, len(f.step_ids) - 1)

    def _log_fork(self, f: Fork, i: int) -> None:
        if self.monitor is None:
            return
        batch = pa.record_batch(
            {
                "fork_id": pa.array([f.fork_id], pa.int32()),
                "start_step": pa.array([f.start_step], pa.int64()),
                "step": pa.array([f.step_ids[i]], pa.int64()),
                "rank": pa.array([self.rank], pa.int32()),
                "loss_fp8": pa.array([f.loss_fp8[i]], pa.float64()),
                "loss_bf16": pa.array([f.loss_bf16[i]], pa.float64()),
                "baseline": pa.array([f.baseline], pa.float64()),
                "verdict": pa.array([f.verdict], pa.string()),
                "reason": pa.array([f.reason], pa.string()),
                "trigger": pa.array([f.trigger], pa.string()),
            },
            schema=SHADOW_FORK_SCHEMA,
        )
        self.monitor.log_table(FORK_TABLE, batch)

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Finish a running fork (verdict on the steps it ran), remove hooks. Call before ``mon.close()``."""
        if self._fork is not None:
            try:
                self._finish_fork(self._fork, early=True)
            except Exception:
                self._fork = None
        self._disarm()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.enabled = False

    def __enter__(self) -> "Shadow":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"fp8scope: {message}", RuntimeWarning, stacklevel=3)
