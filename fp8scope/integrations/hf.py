"""Hugging Face ``transformers.Trainer`` integration.

    from fp8scope.integrations.hf import Fp8ScopeCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[Fp8ScopeCallback("runs/fp8", every=10)])

On train begin it opens a :class:`fp8scope.Monitor` on the trainer's model (every rank of a
distributed job: the Monitor finds rank and world size itself), ends one monitor step per
optimizer step (``on_step_end``: gradient-accumulation micro-batches merge into that step),
and closes on train end. Steps are the Trainer's ``state.global_step`` (so a resumed run
continues its numbering).

Scalars are those of the step that ran, every step, whatever ``logging_steps`` is:

- ``loss``: the sum of what ``Trainer.training_step`` returned for the step's micro-batches,
  which is the Trainer's own per-step loss (each micro-batch's loss is already divided by the
  accumulation count, or normalised by the step's token count); NaN and Inf are kept, where the
  Trainer's logs would replace them by an average (``logging_nan_inf_filter``). A device tensor:
  never synced here, it travels with the step's single transfer.
- ``grad_norm``: the norm the Trainer's ``accelerator.clip_grad_norm_`` returned, i.e. before
  clipping (the Trainer asks for it with ``max_norm=inf`` when it does not clip).
- ``lr``: the learning rate the optimizer steps with, read just before ``optimizer.step()``
  (``on_step_end`` comes after the scheduler moved on, so reading it there gives the next one).

The Trainer object is not passed to callbacks; the callback finds it on the call stack when
training begins and wraps ``training_step`` and ``accelerator.clip_grad_norm_`` on that
instance (both restored on train end). If it cannot, it falls back to the Trainer's logged
averages and says so once.
"""

from __future__ import annotations

import inspect
import time
import warnings
from typing import Any

from transformers import Trainer, TrainerCallback

from fp8scope.integrations._scalars import as_scalar, device_grad_norm


def _calling_trainer(depth: int = 12) -> Trainer | None:
    """The Trainer whose callback handler is calling us (a few frames up the stack)."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
        return None
    finally:
        del frame


class Fp8ScopeCallback(TrainerCallback):
    def __init__(self, run_dir: str, **monitor_kwargs: Any):
        self.run_dir = run_dir
        self.monitor_kwargs = monitor_kwargs
        self.monitor = None
        self._trainer: Trainer | None = None
        self._undo: list = []
        self._loss: Any = None  # this step's loss so far (a device tensor)
        self._grad_norm: Any = None
        self._lr: float | None = None
        self._model = None

    # ---- wiring ---------------------------------------------------------------------
    def _watch(self, trainer: Trainer) -> None:
        """Wrap the trainer's per-micro-batch loss and its gradient-norm call (instance attributes,
        restored on train end); a failure here only loses those scalars."""
        training_step = trainer.training_step

        def watched_training_step(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            try:
                value = as_scalar(loss)
                if value is not None:
                    self._loss = value if self._loss is None else self._loss + value
            except Exception:
                pass
            return loss

        trainer.training_step = watched_training_step
        self._undo.append(lambda: trainer.__dict__.pop("training_step", None))
        accelerator = getattr(trainer, "accelerator", None)
        clip = getattr(accelerator, "clip_grad_norm_", None)
        if callable(clip):
            def watched_clip(*args, **kwargs):
                norm = clip(*args, **kwargs)
                try:
                    self._grad_norm = as_scalar(norm)
                except Exception:
                    pass
                return norm

            accelerator.clip_grad_norm_ = watched_clip
            self._undo.append(lambda: accelerator.__dict__.pop("clip_grad_norm_", None))
        self._trainer = trainer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from fp8scope import Monitor

        if self.monitor is None and model is not None:
            self.monitor = Monitor(model, self.run_dir, step=int(state.global_step), **self.monitor_kwargs)
            self._model = model
            trainer = _calling_trainer()
            if trainer is not None:
                try:
                    self._watch(trainer)
                except Exception:
                    trainer = None
            if trainer is None:
                warnings.warn("fp8scope: could not find the Trainer calling this callback; loss and grad_norm are "
                              "taken from the Trainer's logs (averaged over logging_steps)", RuntimeWarning,
                              stacklevel=2)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        # gradients are final and the optimizer has not stepped: its lr is the one this step uses
        if self.monitor is None:
            return
        try:
            opt = optimizer if optimizer is not None else getattr(self._trainer, "optimizer", None)
            if opt is not None:
                self._lr = as_scalar(opt.param_groups[0]["lr"])
        except Exception:
            pass
        if self._trainer is not None and self._grad_norm is None:  # a Trainer path without clip_grad_norm_
            try:
                self._grad_norm = device_grad_norm((model if model is not None else self._model).parameters())
            except Exception:
                pass

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Only when the Trainer could not be watched: its logs' loss / grad norm (averages over
        # logging_steps), attached to the step that just ended.
        if self.monitor is None or self._trainer is not None or not logs:
            return
        names, values = [], []
        for key in ("loss", "grad_norm"):
            value = as_scalar(logs.get(key))
            if value is not None:
                names.append(key)
                values.append(float(value))
        if names:
            from fp8scope.step_records import scalar_batch

            step = int(state.global_step) - 1
            self.monitor.log_table("scalars", scalar_batch(step, self.monitor.rank, names, values, time.time()))

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        scalars = {k: v for k, v in (("loss", self._loss), ("grad_norm", self._grad_norm), ("lr", self._lr))
                   if v is not None}
        self._loss = self._grad_norm = self._lr = None
        # state.global_step was already incremented: the step that just ended is global_step - 1
        self.monitor.step(step=int(state.global_step) - 1, **scalars)

    def on_train_end(self, args, state, control, **kwargs):
        for undo in self._undo:
            try:
                undo()
            except Exception:
                pass
        self._undo.clear()
        self._trainer = None
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
