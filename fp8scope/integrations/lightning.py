"""PyTorch Lightning integration.

    from fp8scope.integrations.lightning import Fp8ScopeCallback
    trainer = L.Trainer(callbacks=[Fp8ScopeCallback("runs/fp8", every=10)])

Opens a :class:`fp8scope.Monitor` on the LightningModule when training starts (on every rank;
the Monitor finds rank and world size itself), ends one monitor step per optimizer step
(``trainer.global_step``, so ``accumulate_grad_batches`` micro-batches merge into one step and
resumed runs keep their numbering), and closes when training ends. Scalars: the loss returned
by ``training_step`` (a 0-d tensor: no sync, it travels with the step's single transfer), the
first optimizer's learning rate, and ``grad_norm`` when ``gradient_clip_val`` is not used
(computed on the device in ``on_before_optimizer_step``, never synced by us).
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package name
    import pytorch_lightning as pl  # type: ignore[no-redef]

from fp8scope.integrations._scalars import as_scalar


class Fp8ScopeCallback(pl.Callback):
    def __init__(self, run_dir: str, log_grad_norm: bool = True, **monitor_kwargs: Any):
        super().__init__()
        self.run_dir = run_dir
        self.log_grad_norm = log_grad_norm
        self.monitor_kwargs = monitor_kwargs
        self.monitor = None
        self._loss = None
        self._grad_norm = None
        self._last_step = None

    def on_train_start(self, trainer, pl_module):
        from fp8scope import Monitor

        if self.monitor is None:
            self.monitor = Monitor(pl_module, self.run_dir, step=int(trainer.global_step), **self.monitor_kwargs)
            self._last_step = int(trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.monitor is None or not self.log_grad_norm:
            return
        import torch

        grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
        if grads:  # one fused norm on the device; stays a tensor
            self._grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._loss = as_scalar(loss)
        step = int(trainer.global_step)
        if step == self._last_step:  # still accumulating micro-batches of this optimizer step
            return
        scalars = {"loss": self._loss, "grad_norm": self._grad_norm}
        try:
            scalars["lr"] = float(trainer.optimizers[0].param_groups[0]["lr"])
        except Exception:
            pass
        self.monitor.step(step=step - 1, **scalars)
        self._last_step = step
        self._grad_norm = None

    def on_train_end(self, trainer, pl_module):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
