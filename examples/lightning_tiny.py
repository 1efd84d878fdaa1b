"""fp8scope with PyTorch Lightning: a tiny MLP LightningModule with emulated FP8, on CPU.

    pip install "fp8scope[lightning]"; python examples/lightning_tiny.py && fp8scope info runs/lightning_tiny
"""

import lightning.pytorch as L
import torch
from torch import nn

from fp8scope.emulate import convert_to_fp8
from fp8scope.integrations.lightning import Fp8ScopeCallback


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = convert_to_fp8(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


x = torch.randn(512, 32)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
trainer = L.Trainer(max_steps=50, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                    callbacks=[Fp8ScopeCallback("runs/lightning_tiny", every=5)])
trainer.fit(Tiny(), dl)
