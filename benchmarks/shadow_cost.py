"""Cost of fp8scope.Shadow on the demo's tiny GPT (emulated FP8, CPU or CUDA).

Compare mode: extra wall time of a compare step (FP8 step with capture + BF16 re-run and
per-layer comparison) relative to a normal step, measured *interleaved* in one run
(normal, compare, normal, compare, ...) so drift and machine noise hit both alike.
Fork mode: bytes of the replica (parameters + buffers + optimizer state) and the time of
one replica step relative to a normal step.

    python benchmarks/shadow_cost.py                      # demo defaults: d128, 4 layers, b16 x 64
    python benchmarks/shadow_cost.py --device cuda --d-model 512 --n-layers 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--pairs", type=int, default=20, help="interleaved (normal, compare) pairs")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--fork-steps", type=int, default=10)
    p.add_argument("--no-local", action="store_true", help="Shadow(local_error=False)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from fp8scope.demo import train as T
    from fp8scope.shadow import Shadow

    args = T.default_args(d_model=a.d_model, n_layers=a.n_layers, batch_size=a.batch_size, seq_len=a.seq_len,
                          device=a.device, corpus_chars=100_000, steps=10_000)
    setup = T.build(args)
    model, opt = setup.model, setup.optimizer
    shadow = Shadow(None, model, T.demo_loss, opt, fork_steps=a.fork_steps, max_grad_norm=args.clip,
                    local_error=not a.no_local)
    dev = torch.device(a.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step(batch, with_shadow: bool) -> float:
        sync()
        t0 = time.perf_counter()
        loss = shadow.loss_fn(model, batch)
        loss.backward()
        if with_shadow:
            shadow.after_step(batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        step(setup.batches.next(), False)
    normal, compare, bf16_pass = [], [], []
    for _ in range(a.pairs):
        normal.append(step(setup.batches.next(), False))
        shadow.compare_next()  # armed when the next forward starts
        compare.append(step(setup.batches.next(), True))
        bf16_pass.append(shadow.last_compare.seconds)
    n, c = statistics.median(normal), statistics.median(compare)
    cap = shadow.last_compare.capture_bytes

    # Fork: one fork of fork_steps; time the steps that carry a replica step.
    shadow.fork("benchmark")
    forked = [step(setup.batches.next(), True) for _ in range(a.fork_steps)]
    f = shadow.forks[-1]
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fk = statistics.median(forked)

    print(f"model: tiny GPT d{a.d_model} x{a.n_layers} layers, {n_params / 1e6:.2f}M params, batch {a.batch_size}x"
          f"{a.seq_len}, {a.device}, {torch.get_num_threads()} thread(s), {len(shadow.layers)} compared layers, local_error={shadow.local_error}")
    print(f"normal step           median {n * 1e3:8.1f} ms  ({a.pairs} interleaved samples)")
    print(f"compare step          median {c * 1e3:8.1f} ms  -> extra {(c - n) / n:.2f} x a normal step "
          f"(ratio {c / n:.2f}); BF16 pass + comparison {statistics.median(bf16_pass) * 1e3:.1f} ms")
    print(f"compare capture       {cap / 1e6:.2f} MB kept from the FP8 step (sample_size {shadow.sample_size})")
    print(f"fork step             median {fk * 1e3:8.1f} ms  -> extra {(fk - n) / n:.2f} x a normal step")
    print(f"fork replica memory   {f.bytes / 1e6:.2f} MB = {f.bytes / param_bytes:.2f} x parameter bytes "
          f"({param_bytes / 1e6:.2f} MB params; AdamW state + buffers + FP8 scaling state); verdict {f.verdict}")


if __name__ == "__main__":
    main()
