"""PyTorch Lightning integration.

    from fp8scope.integrations.lightning import Fp8ScopeCallback
    trainer = L.Trainer(callbacks=[Fp8ScopeCallback("runs/fp8", every=10)])

Opens a :class:`fp8scope.Monitor` on the LightningModule when training starts (on every rank;
the Monitor finds rank and world size itself), ends one monitor step per optimizer step
(``trainer.global_step``, so ``accumulate_grad_batches`` micro-batches merge into one step and
resumed runs keep their numbering), and closes when training ends.

Scalars are those of the step that ran:

- ``loss``: the mean of the step's micro-batch losses as ``training_step`` returned them
  (Lightning hands callbacks each one divided by ``accumulate_grad_batches``; that division is
  undone). Device tensors: no sync, they travel with the step's single transfer.
- ``lr``: the first optimizer's learning rate read in ``on_before_optimizer_step``, before the
  optimizer and any step-interval scheduler moved on.
- ``grad_norm``: the global L2 norm of the gradients in ``on_before_optimizer_step``, which
  Lightning calls before it clips (``gradient_clip_val``): the norm before clipping, computed on
  the device and never synced by us. ``log_grad_norm=False`` turns it off.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package name
    import pytorch_lightning as pl  # type: ignore[no-redef]

from fp8scope.integrations._scalars import as_scalar, device_grad_norm


class Fp8ScopeCallback(pl.Callback):
    def __init__(self, run_dir: str, log_grad_norm: bool = True, **monitor_kwargs: Any):
        super().__init__()
        self.run_dir = run_dir
        self.log_grad_norm = log_grad_norm
        self.monitor_kwargs = monitor_kwargs
        self.monitor = None
        self._loss_sum: Any = None  # this optimizer step's micro-batch losses, summed (device)
        self._loss_count = 0
        self._grad_norm: Any = None
        self._lr: Any = None
        self._last_step: int | None = None

    def on_train_start(self, trainer, pl_module):
        from fp8scope import Monitor

        if self.monitor is None:
            self.monitor = Monitor(pl_module, self.run_dir, step=int(trainer.global_step), **self.monitor_kwargs)
            self._last_step = int(trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.monitor is None:
            return
        try:
            self._lr = as_scalar(optimizer.param_groups[0]["lr"])
        except Exception:
            pass
        if not self.log_grad_norm:
            return
        self._grad_norm = device_grad_norm(pl_module.parameters())  # on the device; stays a tensor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is None:
            return
        loss = as_scalar(outputs.get("loss") if isinstance(outputs, dict) else outputs)
        if loss is not None:
            if pl_module.automatic_optimization:  # Lightning divided it for accumulation: undo that
                loss = loss * int(trainer.accumulate_grad_batches)
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1
        step = int(trainer.global_step)
        if step == self._last_step:  # still accumulating micro-batches of this optimizer step
            return
        scalars = {"grad_norm": self._grad_norm, "lr": self._lr}
        if self._loss_sum is not None:
            scalars["loss"] = self._loss_sum / self._loss_count
        self.monitor.step(step=step - 1, **{k: v for k, v in scalars.items() if v is not None})
        self._last_step = step
        self._grad_norm = self._lr = self._loss_sum = None
        self._loss_count = 0

    def on_train_end(self, trainer, pl_module):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
