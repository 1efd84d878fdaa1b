"""fp8scope with a Hugging Face Trainer: a tiny GPT-2 built from a config (no download), on CPU.

Every projection is monitored with what-if stats, GPT-2's Conv1D layers included (9 layers, 27
tensors); loss, lr and grad norm are logged for every optimizer step, whatever logging_steps is.

    pip install "fp8scope[hf]"; python examples/hf_trainer.py && fp8scope info runs/hf_tiny
"""

import torch
import transformers

from fp8scope.integrations.hf import Fp8ScopeCallback

cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
model = transformers.GPT2LMHeadModel(cfg)
data = [{"input_ids": (ids := torch.randint(0, 128, (32,))), "labels": ids} for _ in range(64)]
args = transformers.TrainingArguments(output_dir="runs/hf_tiny_out", per_device_train_batch_size=8,
                                      gradient_accumulation_steps=2, max_steps=20, logging_steps=1,
                                      report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available())
trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                               callbacks=[Fp8ScopeCallback("runs/hf_tiny", every=5)])
trainer.train()
