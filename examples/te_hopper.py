"""A small Transformer Engine stack on one H100, FP8 delayed scaling, monitored by fp8scope.

    pip install "fp8scope[te]"
    python examples/te_hopper.py --steps 50 --run runs/te_hopper
    fp8scope info runs/te_hopper && fp8scope tensors runs/te_hopper --last 1

Multi-GPU: torchrun --nproc-per-node 8 examples/te_hopper.py --reduce both
(every rank logs into the same folder; see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os

import torch

import fp8scope


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", default="runs/te_hopper")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--reduce", default="none", choices=["none", "aggregate", "both"])
    args = p.parse_args()

    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    if "RANK" in os.environ:
        torch.distributed.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(0)
    h = args.hidden
    model = torch.nn.Sequential(
        *[te.TransformerLayer(h, 4 * h, h // 64, params_dtype=torch.bfloat16) for _ in range(args.layers)]
    ).cuda()
    if torch.distributed.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    mon = fp8scope.Monitor(model, args.run, every=args.every, reduce=args.reduce, meta={"example": "te_hopper"})
    seq, batch = 512, 4
    for step in range(args.steps):
        x = torch.randn(seq, batch, h, device="cuda", dtype=torch.bfloat16)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = model(x)
        loss = y.float().pow(2).mean()  # a stand-in objective: enough to exercise every GEMM
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.step(loss=loss.detach(), grad_norm=grad_norm, lr=3e-4)  # tensors: no host sync
    mon.close()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(fp8scope.load_run(args.run).tensors(last=1)[["layer", "tensor", "amax", "scale", "overflow", "sqnr_db"]])


if __name__ == "__main__":
    main()
