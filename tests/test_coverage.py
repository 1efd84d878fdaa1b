"""What a monitor does not see: a ``transformers`` Mixtral (5.x keeps its experts as 3-D weights,
which no linear-layer hook sees) built from a small config, its attention in emulated FP8, trained
with a NaN planted where its experts hand their output back.

The monitor must say at attach that the experts (most of the GEMM weights) are not monitored, the
run must record it, and the report must neither call the run clean without saying so nor blame
FP8 for a NaN that reached the first monitored layer after the experts; a NaN that starts at a
monitored FP8 layer is still blamed on FP8.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import fp8scope
from fp8scope.cli.main import main as cli_main
from fp8scope.coverage import expert_weights
from fp8scope.detect.analysis import analysis
from fp8scope.emulate import convert_to_fp8

transformers = pytest.importorskip("transformers")

STEPS, NAN_AT = 40, 32


def mixtral(implementation: str = "grouped_mm") -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=implementation)
    head = model.get_output_embeddings()
    convert_to_fp8(model, skip=[n for n, m in model.named_modules() if m is head])
    return model


def train(model: nn.Module, run_dir, plant) -> list[str]:
    """``plant(step)`` is called before each step; returns the monitor's attach warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(model, run_dir, every=10)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        plant(step)
        ids = torch.randint(0, 96, (4, 16), generator=g)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=out.loss)
    mon.close()
    return [str(w.message) for w in caught if "fp8scope" in str(w.message)]


def nan_plant(module: nn.Module, at: int, pre: bool = False):
    """A NaN written into ``module``'s output (its input with ``pre``) at step ``at``."""
    now = [0]

    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[5] = float("nan")
        return t

    if pre:
        module.register_forward_pre_hook(lambda m, args: (poison(args[0]), *args[1:]) if now[0] == at else None)
    else:
        module.register_forward_hook(lambda m, args, out: poison(out) if now[0] == at else None)
    return lambda step: now.__setitem__(0, step)


def test_a_nan_from_unmonitored_experts_is_not_blamed_on_fp8_and_the_run_says_what_was_not_seen(tmp_path, capsys):
    model = mixtral()
    experts = model.model.layers[0].mlp.experts
    said = train(model, tmp_path, nan_plant(experts, NAN_AT))
    assert len(said) == 1, said
    assert "2 MoE expert module(s) holding 8" in said[0] and "model.layers.0.mlp.experts (MixtralExperts)" in said[0]
    assert "model.layers.0.mlp.gate (MixtralTopKRouter)" in said[0]  # the routers hold matrices nothing claims

    cov = json.loads((tmp_path / "run.json").read_text())["meta"]["coverage"]
    left = {u["module"]: u for u in cov["unmonitored"]}
    assert left["model.layers.0.mlp.experts"]["kind"] == "experts"
    assert left["model.layers.0.mlp.experts"]["params"] == experts.gate_up_proj.numel() + experts.down_proj.numel()
    assert left["model.layers.1.mlp.gate"]["kind"] == "matrix"
    order = cov["order"]
    assert order.index("model.layers.0.self_attn.o_proj") < order.index("model.layers.0.mlp.experts") \
        < order.index("model.layers.1.self_attn.q_proj")

    _, rep = analysis(tmp_path)
    assert rep["nan_origin"]["layer"] == "model.layers.1.self_attn.q_proj" and rep["nan_origin"]["step"] == NAN_AT
    assert rep["nan_upstream"] == ["model.layers.0.mlp.gate", "model.layers.0.mlp.experts"]
    assert rep["blame"]["level"] == "unknown", rep["blame"]
    assert "model.layers.0.mlp.experts, which fp8scope did not monitor" in rep["blame"]["why"]
    assert any("look at their outputs at step 32" in a for a in rep["advice"])
    assert rep["coverage"].startswith("not monitored: 2 MoE expert module(s)")

    capsys.readouterr()
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not monitored: 2 MoE expert module(s)" in out and "FP8's part is unknown" in out
    assert cli_main(["info", str(tmp_path)]) == 0
    assert "coverage" in capsys.readouterr().out


def test_a_nan_that_starts_at_a_monitored_fp8_layer_is_still_blamed_on_fp8(tmp_path):
    model = mixtral(implementation="eager")  # the experts' loop of F.linear on slices: not monitored either
    said = train(model, tmp_path, nan_plant(model.model.layers[1].self_attn.o_proj, NAN_AT, pre=True))
    assert "MoE expert module(s)" in said[0]
    _, rep = analysis(tmp_path)
    assert rep["nan_origin"]["layer"] == "model.layers.1.self_attn.o_proj"
    assert rep["nan_upstream"] == []  # v_proj, monitored, ran just before it
    assert rep["blame"]["level"] == "likely", rep["blame"]


def test_which_three_dimensional_weights_are_experts():
    class GroupedExperts(nn.Module):  # torchtitan's shape: w1, w2, w3 stacked per expert
        def __init__(self):
            super().__init__()
            self.num_experts = 8
            self.w1 = nn.Parameter(torch.zeros(8, 16, 4))
            self.w2 = nn.Parameter(torch.zeros(8, 4, 16))

    class Embeddings(nn.Module):  # a ViT's position embedding is 3-D too
        def __init__(self):
            super().__init__()
            self.position_embeddings = nn.Parameter(torch.zeros(1, 17, 4))

    assert len(expert_weights(GroupedExperts())) == 2
    assert expert_weights(Embeddings()) == []
    assert expert_weights(nn.Conv1d(4, 4, 3)) == []


def test_a_dense_model_is_covered_whole(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left: no warning
        mon = fp8scope.Monitor(model, tmp_path, every=1)
    ids = torch.randint(0, 96, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    mon.step()
    mon.close()
    cov = json.loads((tmp_path / "run.json").read_text())["meta"]["coverage"]
    assert cov["unmonitored"] == [] and cov["params"]["unmonitored"] == 0
    assert cov["params"]["monitored"] == sum(p.numel() for n, p in model.named_parameters()
                                             if p.dim() == 2 and "embed_tokens" not in n)
    capsys.readouterr()
    assert cli_main(["info", str(tmp_path)]) == 0
    assert "every module holding GEMM weights" in capsys.readouterr().out
