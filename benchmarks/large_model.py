"""What monitoring costs a model of the size our users train: a ``transformers`` Llama with
TinyLlama-1.1B's shape (1.1 B parameters, random weights from the config, no download), bf16,
AdamW, eager.

Per model (what-if: plain bf16 linears; emulated: ``convert_to_fp8`` with delayed scaling, the head
kept in bf16), the monitored / unmonitored step-time ratio of a cheap step and of a full-stats step
(``every=1``), paired and interleaved as ``benchmarks/overhead.py`` times the demo, and from them
the ratio at ``every=50`` (the product's default: one full-stats step in 50). On a GPU the stats compile to Triton
(``FP8SCOPE_COMPILE=sync``: compiled at first use, so the timed steps run the compiled code from the first one).

    python benchmarks/large_model.py --device cuda             # 1.1 B parameters, on a GPU
    python benchmarks/large_model.py --size tiny --rounds 2    # the same code on a CPU, in seconds
    python benchmarks/large_model.py --size narrow --batch 2 --seq 32 --models off   # 465 tensors, host time
    python benchmarks/large_model.py --ops        # aten ops per cheap step as a GPU runs them (deterministic)

``--ops`` counts the aten ops (about one launch each on a GPU) of one cheap what-if step, plain and
monitored, with the model on the "meta" device: it takes an accelerator's code paths (the weights'
one multi-tensor read) and allocates nothing, so the 1.1B model's counts come in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8scope  # noqa: E402
from fp8scope.emulate import DelayedScaling, convert_to_fp8  # noqa: E402
from overhead import time_interleaved  # noqa: E402

# TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 key-value heads, MLP 5632, vocab 32000)
SIZES = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    # TinyLlama's 22 layers (155 linears, 465 monitored tensors) at tiny widths: nearly all of a step
    # is host time, so on a CPU the monitor's cost per tensor shows as on a host-bound GPU step
    "narrow": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=22,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
}


class Setup:
    """One model, its optimizer and a fixed stream of random token batches."""

    def __init__(self, size: str, fp8: str, device: str, batch: int, seq: int):
        import transformers

        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**SIZES[size], attn_implementation="sdpa")
        with torch.device(device):
            self.model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        self.recipe = DelayedScaling(amax_history_len=16)  # the emulated layers' recipe, or the what-if one
        if fp8 == "delayed":
            convert_to_fp8(self.model, self.recipe, skip=["lm_head"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.batches = [torch.randint(0, cfg.vocab_size, (batch, seq), device=device) for _ in range(4)]
        self.n_params = sum(p.numel() for p in self.model.parameters())


def train_step(s: Setup, step: int, mon) -> None:
    ids = s.batches[step % len(s.batches)]
    loss = s.model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), 1.0, foreach=True)
    s.opt.step()
    s.opt.zero_grad(set_to_none=True)
    if mon is not None:
        mon.step(loss=loss.detach(), grad_norm=grad_norm, lr=1e-4)


def full_steps(run_dir: str) -> list[int]:
    """The steps a run logged with full stats. A timed "cheap" block holds only cheap steps unless the
    monitor's triage took full ones after a flagged step (``full_on_anomaly``), which a fresh model's
    early steps can do: printed beside the ratios so that a reader sees it."""
    t = fp8scope.load_run(run_dir).tensors()
    return sorted(int(s) for s in t[t.full].step.unique())


def ops_on_meta(size: str, batch: int, seq: int) -> tuple[int, int, dict[str, int]]:
    """(plain ops, monitored ops, the monitored step's ops by name) of one cheap what-if step on "meta",
    the capture side wired as the monitor wires it (``tests/meta_training.py``; the writer thread,
    which reads rows on the host, is left out)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import transformers
    from capture_cost import OpCounter
    from meta_training import attach, train

    from fp8scope.capture.collector import StepCollector

    cfg = transformers.LlamaConfig(**SIZES[size], attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)

    def loss_of(m):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="meta")
        return m(input_ids=ids, labels=ids).loss

    plain, watched = OpCounter(), OpCounter()
    train(model, StepCollector((), 100, None, False), loss_of, steps=2, micro=1, last=plain)  # nothing captured
    # step 0 full, step 1 cheap (weights not known yet), step 2 cheap: counted
    train(model, attach(model, DelayedScaling(amax_history_len=16), every=100), loss_of, steps=3, micro=1,
          last=watched)
    return plain.ops, watched.ops, dict(watched.by_name)


def model_args(ap: argparse.ArgumentParser) -> None:
    """The model's options, shared with ``step_profile.py``."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--models", default="off,delayed", help="off (what-if), delayed (emulated)")
    ap.add_argument("--ops", action="store_true", help="count a cheap what-if step's aten ops on the meta device")
    args = ap.parse_args()
    if args.ops:
        plain, watched, by_name = ops_on_meta(args.size, args.batch, args.seq)
        print(f"Llama {args.size}, batch {args.batch} x {args.seq} tokens, bf16, one cheap what-if step on meta "
              f"(an accelerator's code paths): plain {plain} aten ops, monitored {watched} "
              f"(+{watched - plain}: {by_name.get('aminmax.default', 0)} aminmax, "
              f"{by_name.get('_foreach_norm.Scalar', 0)} _foreach_norm)")
        return 0
    on_gpu = args.device.startswith("cuda")
    os.environ["FP8SCOPE_COMPILE"] = "sync" if on_gpu else "0"
    import logging  # each compile's time (once per variant, at its first use: the first full step)

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("   %(message)s"))
    logging.getLogger("fp8scope.compiled").addHandler(handler)
    logging.getLogger("fp8scope.compiled").setLevel(logging.INFO)
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"torch {torch.__version__}, {name}, Llama {args.size}, batch {args.batch} x {args.seq} tokens, bf16, eager")
    print("   cheap: every timed step a cheap one (every=50 after its first, full, step); full: every=1;")
    print("   every=50: (49 cheap + 1 full) / 50, from those two")
    sync = torch.cuda.synchronize if on_gpu else None
    for fp8, label in (("off", "what-if"), ("delayed", "emulated")):
        if fp8 not in args.models.split(","):
            continue
        plain, watched = (Setup(args.size, fp8, args.device, args.batch, args.seq) for _ in range(2))
        ratio, plain_ms, n_tensors = {}, [], 0
        for every, kind in ((50, "cheap"), (1, "full")):  # one monitor at a time: its threads load no other timing
            with tempfile.TemporaryDirectory() as tmp:
                mon = fp8scope.Monitor(watched.model, os.path.join(tmp, "r"), every=every, recipe=watched.recipe)
                setups = {"plain": (plain, None), "monitored": (watched, mon)}
                medians, paired = time_interleaved(setups, args.rounds, args.block, warmup=3, sync=sync,
                                                   step_fn=train_step)
                mon.close()
                n_tensors = len(fp8scope.load_run(os.path.join(tmp, "r")).tensors().query("step == 0"))
                full = full_steps(os.path.join(tmp, "r")) if kind == "cheap" else [0]
                if full != [0]:
                    print(f"   (the cheap blocks held full steps: {full})")
            ratio[kind] = paired["monitored"]
            plain_ms.append(medians["plain"] * 1e3)
        every50 = (49 * ratio["cheap"] + ratio["full"]) / 50
        per_tensor = (ratio["cheap"] - 1) * min(plain_ms) / max(n_tensors, 1) * 1e3  # a cheap capture's cost, us
        print(f"   {label:9s} {plain.n_params / 1e9:.2f} B params, {n_tensors} tensors/step, plain {min(plain_ms):7.1f} ms/step"
              f"   cheap {ratio['cheap']:.3f}x  full {ratio['full']:.3f}x  every=50 {every50:.3f}x"
              f"   (a cheap step: {per_tensor:.0f} us more per tensor)", flush=True)
        del plain, watched, setups
        if on_gpu:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
