"""Detection suite: planted failures and clean runs on eleven architectures, scored against what each
plant expects (layer, role, step, cause).

    .venv/bin/python benchmarks/detection_suite.py [--steps 400] [--jobs 2] [--only NAME,...] [--out results.json]
        [--markdown]                      # the table for docs/detection.md
        [--advisor]                       # also: the recipe advisor on each planted FP8 fault, and a rerun with its advice

Cases train two at a time by default (``--jobs``, one torch thread each: these small models are
bound by Python overhead, so two processes get more done on two cores than one with two threads);
a ``loaded`` case runs alone, after the others.

Architectures: the demo's tiny GPT (fp8scope.demo, d128, 4 blocks) and ten ``transformers``
architectures built from small configs (random weights, no download, width 128, 4 layers; see
``_hf_config``): the decoders Llama (SwiGLU 256, 4 heads, 2 KV heads), Qwen2, Phi, GPT-2, GPT-NeoX,
OPT, Mixtral and Qwen3-MoE (next-token loss), and the encoders DeBERTa-v2 and BERT (masked LM: 15 %
of the positions masked, :class:`MaskedBatches`), all in emulated FP8 (delayed scaling, TE's recipe with history 16 unless a case says otherwise; the
output head in BF16), on the demo corpus, AdamW, linear warm-up then cosine decay, grad
clipping at 1, full stats every 10 steps (cheap rows on the others), online detection on.

Each case plants its failures with ``fp8scope.demo.inject`` (real tensors changed at a chosen step)
and says what a correct answer is. A run is scored offline (``fp8scope.detect`` + the report):

- **localized**: the first warning-or-worse event with a layer names the planted layer and role, at
  the planted step (+-1; a growing outlier: while it grows);
- **first anomaly**: the report's first anomaly (step, rule);
- **verdict**: the report's attribution: ``fp8`` for FP8-caused failures, ``optimizer`` for the
  others (FP8 must not be blamed);
- **lead**: steps between the first detection and the step the loss moved (1.2x its median of the 20
  steps before the plant, or non-finite); positive = seen before the loss moved;
- clean runs: the number of warning and critical events (must be 0); a fault the recipe absorbs
  (a growing outlier under MXFP8's block scales) is such a run, and an info event must name it at its
  layer while it grows.

Cases with ``forks`` run a ``fp8scope.Shadow`` whose forks start on warning events (the report's fork
verdicts are scored); ``shadow_every`` adds BF16 compare steps; ``loaded`` runs two CPU-burning
processes beside training from 30 steps before the plant on, and requires every warning event to
reach ``on_event`` before the step after next ends ("online lag": the training step at arrival
minus the event's step, at most 2).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT_DOWN = "blocks.{}.mlp.down"
LLAMA = "lm.model.layers.{}"
DEBERTA = "lm.deberta.encoder.layer.{}"
T5 = "lm.decoder.block.{}.layer.2.DenseReluDense"


@dataclass
class Case:
    name: str
    arch: str  # "gpt" (the demo's tiny GPT) or an architecture of _hf_config
    inject: list[str] = field(default_factory=list)
    layer: str = ""  # expected layer ("" for optimizer-side causes)
    role: str = ""
    step: int | None = None
    cause: str = "clean"  # "fp8", "not-fp8" or "clean"
    until: int | None = None  # a growing fault: detection anywhere in [step, until] counts
    fp8: str = "delayed"
    history: int = 16
    seed: int = 0
    shadow_every: int = 0  # BF16 compare steps every N steps (0: none)
    forks: bool = False  # warning / critical events start a BF16 fork (Shadow.on_event)
    expect_fork: str | None = None  # the verdict its first fork must reach
    loaded: bool = False  # two CPU-burning processes run beside training (the online lag is measured)
    e4m3_layer: str = ""  # this layer runs TE's all-E4M3 recipe (its gradient in E4M3) beside HYBRID everywhere else
    recipe: str | None = None  # every emulated layer trains under this recipe of train()'s table instead of ``fp8``'s
    # the what-if layers' simulated casts may warn (delayed scaling on MoE experts): a clean case is then judged
    # by the report's verdict, "clean", and no other warning
    whatif_ok: bool = False
    lr_cycles: int = 1  # cosine cycles after the warm-up, each restarting at the peak lr (warm restarts)


def cases(steps: int) -> list[Case]:
    late = max(steps - 80, steps * 3 // 4)
    return [
        # FP8-caused
        Case("gpt-outlier-early", "gpt", [f"outlier:{GPT_DOWN.format(1)}:40:1000"], GPT_DOWN.format(1), "activation", 40, "fp8"),
        Case("gpt-outlier-late", "gpt", [f"outlier:{GPT_DOWN.format(2)}:{late + 3}:1000"], GPT_DOWN.format(2), "activation",
             late + 3, "fp8"),
        Case("gpt-stale-scale", "gpt", [f"outlier:blocks.3.attn.proj:{late - 40}:300"], "blocks.3.attn.proj", "activation",
             late - 40, "fp8", history=1024),
        Case("gpt-scale-reset-cheap", "gpt", ["reset:blocks.1.mlp.up:125"], "blocks.1.mlp.up", "activation", 125, "fp8"),
        Case("gpt-nan-cheap-late", "gpt", [f"nan:blocks.2.attn.proj:{late + 13}"], "blocks.2.attn.proj", "activation",
             late + 13, "fp8"),
        Case("gpt-growing-outlier", "gpt", [f"grow:{GPT_DOWN.format(2)}:150:256:100"], GPT_DOWN.format(2), "activation", 150,
             "fp8", until=260),
        Case("gpt-gradscale-cheap", "gpt", [f"gradscale:{GPT_DOWN.format(3)}:205:1e-8"], GPT_DOWN.format(3), "gradient", 205,
             "fp8"),
        Case("llama-outlier-early", "llama", [f"outlier:{LLAMA.format(1)}.mlp.down_proj:45:1000"],
             f"{LLAMA.format(1)}.mlp.down_proj", "activation", 45, "fp8"),
        Case("llama-outlier-late", "llama", [f"outlier:{LLAMA.format(2)}.mlp.down_proj:{late + 7}:1000"],
             f"{LLAMA.format(2)}.mlp.down_proj", "activation", late + 7, "fp8"),
        Case("llama-nan-cheap", "llama", [f"nan:{LLAMA.format(1)}.self_attn.o_proj:{late - 15}"],
             f"{LLAMA.format(1)}.self_attn.o_proj", "activation", late - 15, "fp8"),
        Case("llama-scale-reset-cheap", "llama", [f"reset:{LLAMA.format(2)}.mlp.down_proj:215"],
             f"{LLAMA.format(2)}.mlp.down_proj", "activation", 215, "fp8"),
        Case("llama-growing-outlier", "llama", [f"grow:{LLAMA.format(1)}.mlp.down_proj:120:256:100"],
             f"{LLAMA.format(1)}.mlp.down_proj", "activation", 120, "fp8", until=230),
        # the same faults in four more architectures
        Case("phi-outlier-early", "phi", ["outlier:lm.model.layers.1.mlp.fc2:55:1000"], "lm.model.layers.1.mlp.fc2",
             "activation", 55, "fp8"),
        Case("gpt2-outlier-late", "gpt2", [f"outlier:lm.transformer.h.2.mlp.c_proj:{late + 5}:1000"],
             "lm.transformer.h.2.mlp.c_proj", "activation", late + 5, "fp8"),
        Case("neox-nan-cheap", "neox", [f"nan:lm.gpt_neox.layers.1.attention.dense:{late - 9}"],
             "lm.gpt_neox.layers.1.attention.dense", "activation", late - 9, "fp8"),
        Case("opt-scale-reset-cheap", "opt", ["reset:lm.model.decoder.layers.2.fc2:235"],
             "lm.model.decoder.layers.2.fc2", "activation", 235, "fp8"),
        # encoders, trained as masked LMs
        Case("deberta-outlier-late", "deberta", [f"outlier:{DEBERTA.format(2)}.output.dense:{late + 5}:1000"],
             f"{DEBERTA.format(2)}.output.dense", "activation", late + 5, "fp8"),
        Case("bert-nan-cheap", "bert", [f"nan:lm.bert.encoder.layer.1.attention.output.dense:{late - 11}"],
             "lm.bert.encoder.layer.1.attention.output.dense", "activation", late - 11, "fp8"),
        # an encoder-decoder, denoising: its decoder's MLP. Early, because T5 v1.1 grows an outlier of its own in
        # its encoder's last MLP input (the layer transformers keeps in float32: T5's _keep_in_fp32_modules):
        # amax 12 -> 83 over 400 steps, pressing 2.2 % of the bulk under the threshold at step 280 (underflow, a
        # finding); its heads that output ~0 flush 2-3 % of the attention output projections' inputs from
        # far under the threshold (underflow, info)
        Case("t5-outlier-early", "t5", [f"outlier:{T5.format(1)}.wo:60:1000"], f"{T5.format(1)}.wo",
             "activation", 60, "fp8"),
        # under the recipes torchao (per-tensor current scaling) and Blackwell (MXFP8) users train with
        Case("llama-growing-outlier-current", "llama", [f"grow:{LLAMA.format(1)}.mlp.down_proj:120:256:100"],
             f"{LLAMA.format(1)}.mlp.down_proj", "activation", 120, "fp8", until=230, fp8="current"),
        Case("gpt2-nan-cheap-current", "gpt2", [f"nan:lm.transformer.h.1.attn.c_proj:{late - 9}"],
             "lm.transformer.h.1.attn.c_proj", "activation", late - 9, "fp8", fp8="current"),
        Case("qwen2-nan-cheap-mxfp8", "qwen2", [f"nan:{LLAMA.format(2)}.self_attn.o_proj:{late + 11}"],
             f"{LLAMA.format(2)}.self_attn.o_proj", "activation", late + 11, "fp8", recipe="mxfp8"),
        # a growing outlier costs MXFP8 only its own blocks (0.26 % of the input flushed at 256x): no
        # warning, and the growth noted at its layer as info
        Case("qwen2-growing-outlier-mxfp8", "qwen2", [f"grow:{LLAMA.format(1)}.mlp.down_proj:120:256:100"],
             f"{LLAMA.format(1)}.mlp.down_proj", "activation", 120, "clean", until=230, recipe="mxfp8"),
        # not FP8
        Case("gpt-gradient-e4m3", "gpt", [], GPT_DOWN.format(2), "gradient", 0, "fp8", e4m3_layer=GPT_DOWN.format(2)),
        Case("llama-gradient-e4m3", "llama", [], f"{LLAMA.format(1)}.self_attn.o_proj", "gradient", 0, "fp8",
             e4m3_layer=f"{LLAMA.format(1)}.self_attn.o_proj"),
        Case("gpt-bad-batch", "gpt", ["batch:220"], "", "loss", 220, "not-fp8"),
        Case("llama-lr-jump-early", "llama", ["lr:45:30"], "", "lr", 45, "not-fp8"),
        Case("llama-data-spike-late", "llama", [f"batch:{late + 20}:3"], "", "loss", late + 20, "not-fp8"),
        Case("qwen2-data-spike-late", "qwen2", [f"batch:{late + 30}:3"], "", "loss", late + 30, "not-fp8"),
        # with BF16 shadows: forks that must answer the question, on a machine whose cores are busy
        Case("gpt-lr-jump-late-fork-loaded", "gpt", [f"lr:{late + 10}:30"], "", "lr", late + 10, "not-fp8", forks=True,
             expect_fork="not-fp8", loaded=True),
        Case("gpt-poisoned-history-fork", "gpt", [f"outlier:{GPT_DOWN.format(3)}:{late - 20}:1e6"], GPT_DOWN.format(3),
             "activation", late - 20, "fp8", forks=True, expect_fork="fp8-induced", shadow_every=25),
        # clean
        Case("gpt-clean-shadow", "gpt", shadow_every=25, forks=True),
        Case("gpt-clean-current-seed1", "gpt", fp8="current", seed=1),
        Case("llama-clean", "llama"),
        # cosine with warm restarts (transformers' cosine_with_restarts): the lr jumps 10x back to its peak
        # at each restart, which lr_change warned about before a rise to an earlier peak was told as info
        Case("llama-clean-restarts", "llama", lr_cycles=3),
        # clean runs that raised warnings before the thresholds were set on them: a Qwen2's gradient
        # clipped 8.7x for one step (seed 0), a Phi's grad norm 3.6x at the end of its warm-up (seed 2)
        Case("qwen2-clean", "qwen2"),
        Case("phi-clean-seed2", "phi", seed=2),
        Case("gpt2-clean", "gpt2"),
        Case("neox-clean", "neox"),
        Case("opt-clean", "opt"),
        Case("deberta-clean", "deberta"),
        Case("bert-clean", "bert"),
        # mixtures of experts: each expert's GEMMs are layers of their own (what-if: transformers keeps
        # the experts in high precision), fed a varying share of the tokens every step
        # under delayed scaling an expert's scale lags its tokens, which change every step: what-if
        # warnings on experts are findings about the recipe, and training itself must stay clean
        Case("mixtral-clean", "mixtral", whatif_ok=True),
        Case("mixtral-nan-cheap", "mixtral", [f"nan:{LLAMA.format(2)}.self_attn.o_proj:{late - 3}"],
             f"{LLAMA.format(2)}.self_attn.o_proj", "activation", late - 3, "fp8", whatif_ok=True),
        Case("qwen3moe-clean-seed1", "qwen3moe", seed=1, whatif_ok=True),
        # Qwen3-30B-A3B's 128 experts, 8 per token: an expert often gets a handful of tokens (or none), and
        # its amax moves within its kind's spread (DetectConfig.spread_min_layers, share_min_values)
        Case("qwen3moe128-clean", "qwen3moe128", whatif_ok=True),
    ]


def _hf_config(arch: str, vocab: int, seq: int, d: int):
    """A small config of ``transformers`` architecture ``arch`` (4 layers, width ``d``; the model gets
    random weights). Eleven architectures the project did not write: their norms (pre- and post-LN),
    activations (SwiGLU, GELU, ReLU), attention (grouped KV, a fused QKV projection, parallel attention
    and MLP, partial rotary, DeBERTa's disentangled relative positions, bidirectional), layer kinds
    (GPT-2's ``Conv1D``, MoE experts as 3-D weights) differ, and so do their tensors' ranges."""
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    if arch == "qwen2":  # Llama's shape with biases on q, k and v
        return transformers.Qwen2Config(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    if arch == "phi":  # attention and MLP in parallel off one LayerNorm, GELU, partial rotary
        return transformers.PhiConfig(vocab_size=vocab, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=4,
                                      num_attention_heads=4, max_position_embeddings=seq)
    if arch == "gpt2":  # Conv1D layers, learned positions, GELU
        return transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=4, n_head=4,
                                       bos_token_id=0, eos_token_id=0)
    if arch == "neox":  # one fused QKV projection, parallel residual
        return transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=4, num_attention_heads=4,
                                          intermediate_size=4 * d, max_position_embeddings=seq)
    if arch == "mixtral":  # MoE: 8 experts as 3-D weights, 2 per token, each expert's GEMMs captured what-if
        return transformers.MixtralConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                          num_experts_per_tok=2, max_position_embeddings=seq)
    if arch == "qwen3moe":  # MoE with q/k norms, 8 small experts, top-2 renormalised
        return transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                                           moe_intermediate_size=d, num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=d // 4, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=seq)
    if arch == "qwen3moe128":  # Qwen3-30B-A3B's expert counts: 128 experts of width 3d/8, 8 per token
        return transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                                           moe_intermediate_size=3 * d // 8, num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=d // 4, num_experts=128,
                                           num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                                           max_position_embeddings=seq)
    if arch == "deberta":  # an encoder (masked LM): disentangled relative-position attention, its own q/k projections
        return transformers.DebertaV2Config(vocab_size=vocab + 1, hidden_size=d, num_hidden_layers=4,
                                            num_attention_heads=4, intermediate_size=4 * d, max_position_embeddings=seq,
                                            relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"])
    if arch == "bert":  # an encoder (masked LM), post-LayerNorm, GELU
        return transformers.BertConfig(vocab_size=vocab + 1, hidden_size=d, num_hidden_layers=4, num_attention_heads=4,
                                       intermediate_size=4 * d, max_position_embeddings=seq)
    if arch == "t5":  # T5 v1.1, an encoder-decoder: gated GELU, relative position buckets, RMSNorm without mean,
        # attention scores not scaled by 1/sqrt(d), so some heads output ~0 (a tail of near-zero values, T5's o inputs)
        return transformers.T5Config(vocab_size=vocab + 1, d_model=d, d_kv=d // 4, d_ff=2 * d, num_layers=4,
                                     num_decoder_layers=4, num_heads=4, feed_forward_proj="gated-gelu",
                                     tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0)
    if arch == "opt":  # ReLU: its MLP's down projection reads mostly exact zeros
        return transformers.OPTConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=4, ffn_dim=4 * d,
                                      num_attention_heads=4, max_position_embeddings=seq, word_embed_proj_dim=d)
    raise ValueError(f"unknown architecture {arch!r}")


MASKED = ("deberta", "bert", "t5")  # encoders (and T5's encoder-decoder), trained as masked LMs on the same corpus


class MaskedBatches:
    """The demo's batches as a masked LM's (BERT's objective, its collator's job): 15 % of the positions
    become the mask token (one past the corpus vocabulary) in the input, and only those are targets (the
    others are -100, which cross-entropy ignores)."""

    def __init__(self, batches, mask_id: int, seed: int, share: float = 0.15):
        import torch

        self.batches, self.mask_id, self.share = batches, mask_id, share
        self.gen = torch.Generator().manual_seed(seed + 1)

    def next(self):
        import torch

        x, _ = self.batches.next()
        masked = (torch.rand(x.shape, generator=self.gen) < self.share).to(x.device)
        return x.masked_fill(masked, self.mask_id), x.masked_fill(~masked, -100)


def _hf_setup(setup, arch: str, d: int = 128, experts: str | None = None):
    """The demo's data and schedule with a ``transformers`` model of ``arch`` (:func:`_hf_config`) in
    place of the tiny GPT (converted to emulated FP8 like the demo: every projection, the output head
    kept in high precision). ``experts``: a MoE's experts implementation (``transformers``' default:
    ``grouped_mm`` where the torch has it)."""
    import torch
    import transformers
    from torch import nn

    from fp8scope.demo.inject import Injector
    from fp8scope.emulate import convert_to_fp8

    class LM(nn.Module):
        def __init__(self, vocab: int, seq: int):
            super().__init__()
            cfg = _hf_config(arch, vocab, seq, d)
            torch.manual_seed(setup.args.seed)
            auto = (transformers.AutoModelForSeq2SeqLM if arch == "t5" else transformers.AutoModelForMaskedLM
                    if arch in MASKED else transformers.AutoModelForCausalLM)
            self.lm = auto.from_config(cfg, **({"experts_implementation": experts} if experts else {}))

        def forward(self, x):
            if arch == "t5":  # the decoder reads the masked input shifted right, and restores the masked tokens
                return self.lm(input_ids=x, decoder_input_ids=self.lm._shift_right(x)).logits
            return self.lm(input_ids=x).logits

    model = LM(setup.cfg.vocab, setup.cfg.seq_len).to(setup.device)
    if arch in MASKED:
        setup.batches = MaskedBatches(setup.batches, mask_id=setup.cfg.vocab, seed=setup.args.seed)
    if setup.recipe is not None:
        head = next(n for n, m in model.named_modules() if m is model.lm.get_output_embeddings())
        convert_to_fp8(model, recipe=setup.recipe, skip=[head])
    setup.model = model
    setup.injector = Injector(setup.args.inject).attach(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    setup.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": setup.args.weight_decay},
                                         {"params": rest, "weight_decay": 0.0}], lr=setup.args.lr, betas=(0.9, 0.95))
    return setup


def train(case: Case, run_dir: Path, steps: int, every: int = 10, whatif_recipes=(), recipe: str | None = None) -> dict:
    """One training run of ``case`` logged to ``run_dir``; returns the loss per step and timing.
    ``whatif_recipes``: the monitor measures them (the advisor's input); ``recipe``: every emulated layer
    trains under this recipe of ``fp8scope.emulate.recipe_table`` instead (the advisor's rerun)."""
    import torch

    import fp8scope
    from fp8scope.demo.train import build, train_step

    gpt = case.arch == "gpt"
    setup = build(steps=steps, inject=list(case.inject) if gpt else [], fp8=case.fp8, amax_history_len=case.history,
                  seed=case.seed, every=every, lr_cycles=case.lr_cycles)
    if not gpt:
        setup.args.inject = list(case.inject)
        setup = _hf_setup(setup, case.arch)
    recipe = recipe or case.recipe
    if recipe is not None:  # the advised recipe, on the same seed: every emulated layer switches to it
        from fp8scope.emulate import CurrentScaling, Float8BlockScaling, Fp8Linear, MXFP8BlockScaling, NVFP4BlockScaling

        new = {"current": CurrentScaling(), "mxfp8": MXFP8BlockScaling(), "block128": Float8BlockScaling(),
               "nvfp4": NVFP4BlockScaling()}[recipe]
        for m in setup.model.modules():
            if isinstance(m, Fp8Linear):
                m._init_fp8(new)
    if case.e4m3_layer:  # a per-layer recipe override gone wrong: the wrong format for one layer's gradients
        import dataclasses

        lay = setup.model.get_submodule(case.e4m3_layer)
        lay._init_fp8(dataclasses.replace(lay.recipe, fp8_format="E4M3"))
    losses: list[float] = []
    now = [0]  # the step being trained
    lags: list[int] = []  # per warning+ event: the step training was at when on_event saw it, minus its step
    shadow_box: list = []

    def on_event(ev: dict) -> None:
        if ev.get("severity") != "info":
            lags.append(now[0] - int(ev["step"]))
        if shadow_box:
            shadow_box[0].on_event(ev)

    burners: list = []  # started 30 steps before the plant: the lag that matters is around the blow-up
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = fp8scope.Monitor(setup.model, run_dir, every=every, recipe=setup.recipe, on_event=on_event,
                               meta={**setup.meta(), "model": case.arch, "suite_case": case.name},
                               whatif_recipes=whatif_recipes)
    shadow = None
    if case.shadow_every or case.forks:
        from fp8scope.demo.train import demo_loss
        from fp8scope.shadow import Shadow

        shadow = Shadow(mon, setup.model, lambda m, b: demo_loss(m, b, setup), setup.optimizer,
                        compare_every=case.shadow_every, fork_steps=20, max_grad_norm=setup.args.clip)
        if case.forks:
            shadow_box.append(shadow)
    bad = None
    for step in range(steps):
        now[0] = step
        if case.loaded and not burners and step >= (case.step or 0) - 30:
            burners = _burn_cpus(2)
        loss, _, _ = train_step(setup, step, monitor=mon, shadow=shadow)
        value = float(loss)
        losses.append(value)
        if not math.isfinite(value):
            bad = step if bad is None else bad
        if bad is not None and step >= bad + 5:  # a NaN run: a few steps more, then stop
            break
    if shadow is not None:
        shadow.close()
    mon.close()
    for b in burners:
        b.kill()
    del torch
    return {"losses": losses, "seconds": time.perf_counter() - t0, "max_lag": max(lags, default=None)}


def _burn_cpus(n: int) -> list:
    """``n`` processes spinning on a core each (a busy training node: data loader workers)."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _logged_losses(run_dir: Path) -> list[float]:
    import fp8scope

    sc = fp8scope.load_run(run_dir).scalars()
    loss = sc[sc["name"] == "loss"].sort_values("step")
    return [float(v) for v in loss["value"]]


def _loss_moved(losses: list[float], start: int) -> int | None:
    """The first step from ``start`` whose loss is non-finite or 1.2x the median of the 20 before ``start``."""
    before = [v for v in losses[max(0, start - 20):start] if math.isfinite(v)]
    if not before:
        return None
    ref = sorted(before)[len(before) // 2]
    for s in range(start, len(losses)):
        if not math.isfinite(losses[s]) or losses[s] > 1.2 * ref:
            return s
    return None


def score(case: Case, run_dir: Path, losses: list[float]) -> dict:
    import fp8scope
    from fp8scope.detect import detect
    from fp8scope.detect.engine import SIMULATED_CAST
    from fp8scope.detect.report import build_report
    from fp8scope.schema import base_role

    run = fp8scope.load_run(run_dir)
    ev = detect(run)
    rep = build_report(run, events=ev)
    serious = ev[ev["severity"] != "info"]
    # what-if layers' simulated casts (in a run whose other layers ran FP8): findings about the recipe on
    # layers that trained in high precision, kept apart from what training did (report.attribution)
    simulated = serious["layer"].isin(rep["whatif_layers"]) & serious["rule"].isin(SIMULATED_CAST)
    out = {"case": case.name, "arch": case.arch, "inject": case.inject, "cause": case.cause,
           "warnings": int((ev["severity"] == "warning").sum()), "criticals": int((ev["severity"] == "critical").sum()),
           "first_anomaly": rep["first_anomaly"], "side": (rep.get("attribution") or {}).get("side"),
           "verdict": rep["verdict"], "blame": rep["blame"]["level"], "harm": (rep.get("harm") or {}).get("how"),
           "whatif_warnings": int(simulated.sum()) if case.whatif_ok else None}
    serious = serious[~simulated]
    if case.cause == "clean":
        out["ok"] = out["warnings"] + out["criticals"] == 0
        if case.whatif_ok:  # the simulated casts' warnings apart: "clean" is the report's verdict on training
            out["ok"] = rep["blame"]["level"] == "clean" and serious.empty
        if case.layer:  # a planted fault the recipe absorbs: its info event must still name it while it lasts
            hi = case.until if case.until is not None else case.step + 1
            noted = ev[(ev["layer"] == case.layer) & (ev["tensor"].map(base_role) == case.role)
                       & ev["step"].between(case.step - 1, hi)]
            n0 = None if noted.empty else noted.iloc[0]
            out["noted"] = (None if n0 is None else
                            {"step": int(n0["step"]), "rule": n0["rule"], "severity": n0["severity"]})
            out["ok"] = out["ok"] and out["noted"] is not None
        out["forks"] = [(f["trigger"], f["verdict"]) for f in rep.get("forks") or []]
        return out
    if case.cause == "fp8":
        tensor_ev = serious[serious["layer"] != ""].sort_values(["step", "rank"], kind="stable")
        first = tensor_ev.iloc[0].to_dict() if len(tensor_ev) else None
        out["detected"] = None if first is None else {k: first[k] for k in ("step", "layer", "tensor", "rule")}
        hi = case.until if case.until is not None else case.step + 1
        out["localized"] = bool(first is not None and first["layer"] == case.layer
                                and base_role(first["tensor"]) == case.role and case.step - 1 <= first["step"] <= hi)
        out["attributed"] = out["side"] == "fp8"
    else:
        opt = serious[serious["layer"] == ""].sort_values("step", kind="stable")
        first = opt.iloc[0].to_dict() if len(opt) else None
        out["detected"] = None if first is None else {k: first[k] for k in ("step", "tensor", "rule")}
        out["localized"] = bool(first is not None and case.step - 1 <= first["step"] <= case.step + 1)
        out["attributed"] = out["side"] == "optimizer"
    moved = _loss_moved(losses, case.step)
    out["loss_moved"] = moved
    out["lead"] = None if (moved is None or first is None) else int(moved - first["step"])
    out["ok"] = out["localized"] and out["attributed"]
    out["forks"] = [(f["trigger"], f["verdict"]) for f in rep.get("forks") or []]
    if case.expect_fork is not None:
        out["ok"] = out["ok"] and bool(out["forks"]) and out["forks"][0][1] == case.expect_fork
    return out


EMULATED = ("nvfp4", "current", "block128", "mxfp8")  # the advised recipes the emulated layer can train with


def advise_case(case: Case, run_dir: Path) -> dict:
    """The advisor's answer for the planted tensor: the fault it saw under the recipe in use, and the
    recipes that remove it (cheapest first)."""
    import fp8scope
    from fp8scope.detect.advisor import advise, per_step

    advice, _ = advise(per_step(fp8scope.load_run(run_dir)))
    mine = [a for a in advice if a.layer == case.layer and a.tensor == case.role]
    if not mine:
        return {"problem": None, "fixes": [], "rerun_with": None}
    a = mine[0]
    return {"problem": a.problem, "fixes": a.fixes, "rerun_with": next((r for r in a.fixes if r in EMULATED), None)}


RECIPE_FAULTS = ("saturation", "saturation_rate", "underflow", "stale_scale")  # what a recipe can cause (an
# amax spike is the data's: it fires under every recipe)


def fault_gone(case: Case, run_dir: Path) -> dict:
    """The rerun under the advised recipe: warning-or-worse events of the rules a recipe can cause
    (:data:`RECIPE_FAULTS`) on the planted tensor around its step."""
    import fp8scope
    from fp8scope.detect import detect
    from fp8scope.schema import base_role

    ev = detect(fp8scope.load_run(run_dir))
    hi = case.until if case.until is not None else case.step + 10
    near = ev[(ev["severity"] != "info") & (ev["layer"] == case.layer) & (ev["tensor"].map(base_role) == case.role)
              & (ev["step"] >= case.step - 1) & (ev["step"] <= hi) & ev["rule"].isin(RECIPE_FAULTS)]
    return {"events_after": int(len(near)), "rules_after": sorted(set(near["rule"]))}


def advisor_markdown(results: list[dict]) -> str:
    rows = ["| case | planted tensor | fault under the recipe in use | advised (cheapest first) | rerun with | "
            "its saturation / underflow / stale-scale events in the rerun |", "|---|---|---|---|---|---|"]
    for r in results:
        a = r.get("advisor")
        if not a:
            continue
        rows.append(f"| {r['case']} | {a['tensor']} | {a['problem'] or 'none seen'} | {', '.join(a['fixes']) or '-'} | "
                    f"{a['rerun_with'] or '-'} | {'-' if a.get('events_after') is None else a['events_after']}"
                    f"{' (' + ', '.join(a['rules_after']) + ')' if a.get('rules_after') else ''} |")
    return "\n".join(rows)


def markdown(results: list[dict], steps: int, seconds: float) -> str:
    header = ("| case | planted | expected | detected (first warning+) | verdict side | blame | forks | lead (steps) | "
              "online lag | warn / crit | ok |")
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        det = r.get("detected")
        det_s = "-" if not det else f"{det['rule']} {det.get('layer', '')} {det['tensor']} @ {det['step']}".replace("  ", " ")
        if r.get("noted"):  # a fault the recipe absorbs: its info event
            det_s = f"{r['noted']['rule']} ({r['noted']['severity']}) @ {r['noted']['step']}"
        exp = "0 warnings" if r["cause"] == "clean" else r["cause"]
        if r.get("whatif_warnings") is not None and r["cause"] == "clean":
            exp = "0 warnings in training (what-if ones allowed)"
        if r["cause"] == "clean" and r.get("noted", False) is not False:
            exp += ", the fault noted as info"
        forks = ", ".join(v for _, v in r.get("forks") or []) or "-"
        lag = "-" if r.get("max_lag") is None else r["max_lag"]
        rows.append(f"| {r['case']} | {', '.join(r['inject']) or '-'} | {exp} | {det_s} | {r['side'] or '-'} | "
                    f"{r.get('blame') or '-'} | {forks} | "
                    f"{'-' if r.get('lead') is None else r['lead']} | {lag} | {r['warnings']} / {r['criticals']}"
                    f"{'' if not r.get('whatif_warnings') else ' (' + str(r['whatif_warnings']) + ' what-if)'} | "
                    f"{'yes' if r['ok'] else '**no**'} |")
    ok = sum(r["ok"] for r in results)
    rows.append("")
    rows.append(f"{ok} of {len(results)} cases correct; {steps} steps per run; {seconds / 60:.1f} min in all.")
    return "\n".join(rows)


def _one_thread(jobs: int) -> None:
    import os

    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // jobs))


def _run_case(job) -> dict:
    """Train (or, with ``rescore``, reread) one case and score it: the unit of work of the pool."""
    case, run_dir, steps, rescore, advisor = job
    run_dir = Path(run_dir)
    recipes = ()
    if advisor and case.cause == "fp8":
        from fp8scope.emulate.recipe_table import RECIPES as recipes
    if rescore:
        trained = {"losses": _logged_losses(run_dir), "seconds": float("nan")}
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        trained = train(case, run_dir, steps, whatif_recipes=recipes)
    r = score(case, run_dir, trained["losses"])
    if recipes:  # the advisor on the planted fault, and the same seed trained with its advice
        a = {"tensor": f"{case.layer} {case.role}", **advise_case(case, run_dir)}
        if a["rerun_with"] is not None:
            rerun = run_dir.with_name(run_dir.name + "-advised")
            shutil.rmtree(rerun, ignore_errors=True)
            train(case, rerun, steps, recipe=a["rerun_with"])
            a.update(fault_gone(case, rerun))
        r["advisor"] = a
    r["seconds"] = round(trained["seconds"], 1)
    r["max_lag"] = trained.get("max_lag")
    if case.loaded:  # the events of step t reached on_event before step t + 2 ended
        r["ok"] = r["ok"] and r["max_lag"] is not None and r["max_lag"] <= 2
    return r


def _show(r: dict) -> dict:
    print(json.dumps({k: r.get(k) for k in ("case", "ok", "detected", "side", "lead", "warnings", "whatif_warnings", "criticals", "forks",
                                            "max_lag", "seconds", "advisor")}, default=str), flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--keep", help="keep the runs in this folder")
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--markdown", action="store_true", help="print the table for docs/detection.md")
    ap.add_argument("--rescore", action="store_true", help="score the runs already in --keep (no training)")
    ap.add_argument("--jobs", type=int, default=2, help="cases trained at once, one torch thread each (a loaded case "
                                                          "always runs alone, after the others)")
    ap.add_argument("--advisor", action="store_true", help="FP8 cases also measure every what-if recipe; the advisor's "
                                                            "answer for the planted tensor is scored, and the case is "
                                                            "trained again with the advised recipe")
    args = ap.parse_args(argv)
    chosen = cases(args.steps)
    if args.only:
        names = set(args.only.split(","))
        chosen = [c for c in chosen if c.name in names]
    if args.rescore and not args.keep:
        ap.error("--rescore needs --keep DIR (the runs to score)")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fp8suite-"))
    results, t0 = {}, time.perf_counter()
    jobs = [(c, str(root / c.name), args.steps, args.rescore, args.advisor) for c in chosen]
    try:
        parallel = [j for j in jobs if not j[0].loaded]
        alone = [j for j in jobs if j[0].loaded]  # its lag is measured against a known load
        if args.jobs > 1 and len(parallel) > 1 and not args.rescore:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(args.jobs, initializer=_one_thread, initargs=(args.jobs,)) as pool:
                for r in pool.imap_unordered(_run_case, parallel):
                    results[r["case"]] = _show(r)
        else:
            for j in parallel:
                results[j[0].name] = _show(_run_case(j))
        for j in alone:
            results[j[0].name] = _show(_run_case(j))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    results = [results[c.name] for c in chosen]
    total = time.perf_counter() - t0
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "seconds": total, "cases": [asdict(c) for c in chosen],
                                              "results": results}, indent=2, default=str))
    if args.markdown:
        print(markdown(results, args.steps, total))
        if args.advisor:
            print()
            print(advisor_markdown(results))
    print(f"{sum(r['ok'] for r in results)} / {len(results)} correct in {total / 60:.1f} min")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
