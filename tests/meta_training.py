"""Training on the "meta" device with the monitor's capture side, for the checks that need a
GPU's code paths but no values: ``test_host_sync.py`` (no host sync) and ``test_capture_budget.py``
(a cheap step's ops as an accelerator runs them)."""

from __future__ import annotations

import contextlib

import torch

from fp8scope.capture.adapters import adapter_for
from fp8scope.capture.collector import StepCollector


def attach(model: torch.nn.Module, recipe, every: int, whatif_recipes=()) -> StepCollector:
    """The monitor's capture side as ``Monitor`` wires it (``Monitor._attach``): every layer an
    adapter claims, reporting to one collector. (Its writer thread would read the step's rows on
    the host, which the "meta" device has not.)"""
    collector = StepCollector(("activation", "weight", "gradient"), every, None, False)
    collector.whatif_recipes = tuple(whatif_recipes)

    def fail(exc: BaseException) -> None:
        raise exc

    collector.fail = fail  # a capture error fails the test instead of switching capture off
    for name, module in model.named_modules():
        adapter = adapter_for(module) if name else None
        if adapter is not None:
            adapter.attach(name, module, collector, recipe)
    return collector


def train(model: torch.nn.Module, collector: StepCollector, loss_of, steps: int = 4, micro: int = 2,
          last=contextlib.nullcontext()) -> int:
    """``steps`` optimizer steps of ``micro`` micro-batches (``loss_of(model)`` each) on "meta",
    each ended as ``mon.step`` ends it, the last one inside the context ``last`` (an op counter);
    returns the number of rows gathered."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = 0
    collector.begin_step(0)
    for step in range(steps):
        with last if step == steps - 1 else contextlib.nullcontext():
            for _ in range(micro):
                loss_of(model).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            payload = collector.end_step({"grad_norm": grad_norm, "lr": 1e-3})
        rows += payload.n_rows
        collector.begin_step(step + 1)
    return rows


def llama(every: int):
    """A 2-layer ``transformers`` Llama (built from a config, random weights) on "meta", what-if
    monitored with delayed scaling: ``(model, collector, loss_of)`` for :func:`train`."""
    import pytest

    transformers = pytest.importorskip("transformers")
    from fp8scope.emulate import DelayedScaling

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("meta")
    collector = attach(model, DelayedScaling(amax_history_len=8), every=every)

    def loss_of(model):
        ids = torch.randint(0, cfg.vocab_size, (2, 16), device="meta")
        return model(input_ids=ids, labels=ids).loss

    return model, collector, loss_of
