"""Hugging Face ``transformers.Trainer`` integration.

    from fp8scope.integrations.hf import Fp8ScopeCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[Fp8ScopeCallback("runs/fp8", every=10)])

On train begin it opens a :class:`fp8scope.Monitor` on the trainer's model (every rank of a
distributed job: the Monitor finds rank and world size itself), ends one monitor step per
optimizer step (``on_step_end``: gradient-accumulation micro-batches merge into that step),
and closes on train end. Steps are the Trainer's ``state.global_step`` (so a resumed run
continues its numbering). Scalars: the learning rate from the scheduler (a host number, no
sync), and loss and grad norm when the Trainer logs them (``on_log``: values the Trainer has
already moved to the host, so nothing is synced for us); they are attached to the logged step.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from fp8scope.integrations._scalars import as_scalar


class Fp8ScopeCallback(TrainerCallback):
    def __init__(self, run_dir: str, **monitor_kwargs: Any):
        self.run_dir = run_dir
        self.monitor_kwargs = monitor_kwargs
        self.monitor = None
        self._pending: dict[str, Any] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from fp8scope import Monitor

        if self.monitor is None and model is not None:
            self.monitor = Monitor(model, self.run_dir, step=int(state.global_step), **self.monitor_kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Called after on_step_end with the loss / grad norm of the step that just ended,
        # already host numbers (the Trainer syncs them for its own logging, not for us).
        if self.monitor is None or not logs:
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

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if self.monitor is None:
            return
        scalars = {}
        if lr_scheduler is not None:
            try:
                scalars["lr"] = float(lr_scheduler.get_last_lr()[0])
            except Exception:
                pass
        # state.global_step was already incremented: the step that just ended is global_step - 1
        self.monitor.step(step=int(state.global_step) - 1, **scalars)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
