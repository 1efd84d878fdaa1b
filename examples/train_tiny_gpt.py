"""Train a tiny GPT in emulated FP8 and let fp8scope watch it. Read this file first.

Runs on a laptop CPU in about a minute, no downloads:

    python examples/train_tiny_gpt.py                                   # healthy FP8 run
    python examples/train_tiny_gpt.py --inject outlier:blocks.2.mlp.down:150 --overwrite
    python examples/train_tiny_gpt.py --inject gradscale:blocks.1.attn.qkv:100 --overwrite
    python examples/train_tiny_gpt.py --inject nan:blocks.3.mlp.up:200 --overwrite
    python examples/train_tiny_gpt.py --inject lr:150:100 --overwrite   # not FP8's fault
    python examples/train_tiny_gpt.py --fp8 off                         # BF16/FP32 + what-if FP8 stats

then ask fp8scope what happened (``fp8scope report runs/tiny-gpt``). Every option:
``python examples/train_tiny_gpt.py --help``.

Only the lines marked ``# fp8scope`` are about fp8scope; everything else
is an ordinary PyTorch loop, and that is the point: add those lines to your own.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fp8scope  # fp8scope
from fp8scope.demo.corpus import Batches, make_data
from fp8scope.demo.inject import Injector
from fp8scope.demo.tiny_gpt import GPTConfig, TinyGPT
from fp8scope.demo.train import build_parser, lr_schedule, make_recipe, warmup_steps
from fp8scope.emulate import convert_to_fp8


def main(argv: list[str] | None = None) -> int:
    args = build_parser(prog="train_tiny_gpt.py").parse_args(argv)
    if args.overwrite and Path(args.run_dir).exists():
        shutil.rmtree(args.run_dir)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    # Data: a deterministic synthetic English-like corpus that ships with fp8scope.
    tokenizer, train_ids, _ = make_data(args.corpus_chars, seed=args.seed)
    batches = Batches(train_ids, args.batch_size, args.seq_len, seed=args.seed, device=device)

    # Model: a small pre-norm GPT with SwiGLU; its Linear layers are named like blocks.2.mlp.down.
    cfg = GPTConfig(vocab=tokenizer.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                    n_heads=args.n_heads, seq_len=args.seq_len)
    model = TinyGPT(cfg, seed=args.seed).to(device)

    # FP8: swap nn.Linear -> Fp8Linear in place (emulated: real fp8 casts, fp32 matmul).
    # The recipe is TE's delayed scaling by default; the head stays in high precision.
    recipe = make_recipe(args)  # DelayedScaling(amax_history_len=16, margin=0), CurrentScaling() or None
    if recipe is not None:
        convert_to_fp8(model, recipe=recipe, skip=args.fp8_skip or ["lm_head"])

    # Planted instabilities (demo only): hooks on named modules, attached AFTER conversion.
    injector = Injector(args.inject).attach(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    warmup = warmup_steps(args)

    monitor = None
    if not args.no_monitor:
        monitor = fp8scope.Monitor(model, args.run_dir, every=args.every, recipe=recipe,  # fp8scope
                                   meta={"example": "train_tiny_gpt", "inject": injector.specs})

    def forward_loss(m, batch):  # one training step's forward, as a function: the BF16 shadow replays it
        xb, yb = batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            logits = m(xb)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), yb.reshape(-1))

    # Optional BF16 shadow (--shadow-every K: compare FP8 with BF16 every K steps; --fork-every K: BF16
    # forks from the same state, which answer "would BF16 have survived from here?").
    shadow = None
    if monitor is not None and (args.shadow_every or args.fork_every):
        shadow = fp8scope.Shadow(monitor, model, forward_loss, optimizer,  # fp8scope
                                 compare_every=args.shadow_every, fork_every=args.fork_every,
                                 fork_steps=args.fork_steps, max_grad_norm=args.clip)

    first_nan = None
    try:
        for step in range(args.steps):
            injector.step = step
            lr = lr_schedule(step, args.lr, args.steps, warmup, cycles=args.lr_cycles) * injector.lr_scale()
            for group in optimizer.param_groups:
                group["lr"] = lr

            x, y = injector.corrupt_batch(*batches.next(), vocab=tokenizer.vocab_size)  # demo: bad batches
            if shadow is not None:
                loss = shadow.loss_fn(model, (x, y))  # fp8scope: records what a replay needs
                loss.backward()
                shadow.after_step((x, y))  # fp8scope: compares / forks before the optimizer step
            else:
                loss = forward_loss(model, (x, y))
                loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # a tensor: no sync
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            if monitor is not None:
                monitor.step(loss=loss, grad_norm=grad_norm, lr=lr)  # fp8scope: ends the step

            # Reading a loss on the host forces a GPU sync: only when printing.
            if step % args.log_every == 0 or step == args.steps - 1:
                if not args.quiet:
                    print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}")
            # Stop a few steps after the loss went NaN so the run shows the aftermath.
            # (isfinite() syncs too: free on CPU; on a GPU you would check every N steps.)
            if first_nan is None and not torch.isfinite(loss):
                first_nan = step
                print(f"step {step:5d}  loss is {loss.item()}: stopping in {args.after_nan} steps")
            if first_nan is not None and step - first_nan >= args.after_nan:
                break
    finally:
        if shadow is not None:
            shadow.close()  # fp8scope: a running fork logs its verdict first
        if monitor is not None:
            monitor.close()  # fp8scope: flushes everything, also after a crash

    if monitor is not None and not args.quiet:
        print(f"run written to {args.run_dir}; next: fp8scope report {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
