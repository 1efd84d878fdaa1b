"""What a monitor does not see, and what the report then says: a model with a module holding a
weight matrix of a kind nothing recognises between two emulated FP8 layers, trained with a NaN
planted at that module's output (and, apart, at the first FP8 layer's input); a ``transformers``
Mixtral whose routers stay unmonitored, compiled or not, and whose experts are left where they
run compiled as a loop; a dense Llama, covered whole.

The monitor must say at attach what it left and its share of the GEMM weights, the run must
record it, and the report must neither call the run clean without saying so nor blame FP8 for a
NaN first seen at the FP8 layer just after the unmonitored module; a NaN that starts at a
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
from fp8scope.detect.analysis import analysis
from fp8scope.emulate import convert_to_fp8
from fp8scope.linear_like import expert_weights, is_router

transformers = pytest.importorskip("transformers")

STEPS, NAN_AT = 40, 32


class Projector(nn.Module):
    """A GEMM layer of a kind nothing recognises (its class name does not say Linear)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return x @ self.weight.t()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.proj = Projector(32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.proj(torch.relu(self.a(x)))))


def train(model: nn.Module, run_dir, plant) -> list[str]:
    """``plant(step)`` is called before each step; returns the monitor's attach warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(model, run_dir, every=10)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        plant(step)
        x = torch.randn(32, 16, generator=g)
        loss = (model(x) - x[:, :8]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss)
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


def fp8_net() -> Net:
    torch.manual_seed(0)
    net = Net()
    convert_to_fp8(net)
    return net


def test_a_nan_from_an_unmonitored_module_is_not_blamed_on_fp8_and_the_run_says_what_was_not_seen(tmp_path, capsys):
    net = fp8_net()
    said = train(net, tmp_path, nan_plant(net.proj, NAN_AT))
    assert len(said) == 1, said
    assert "1 module(s) holding a weight matrix" in said[0] and "proj (Projector)" in said[0]

    cov = json.loads((tmp_path / "run.json").read_text())["meta"]["coverage"]
    assert cov["unmonitored"] == [{"module": "proj", "class": "Projector", "kind": "matrix", "params": 32 * 32}]
    assert cov["order"] == ["a", "proj", "b"]
    assert cov["params"]["monitored"] == 16 * 32 + 32 * 8

    _, rep = analysis(tmp_path)
    assert rep["nan_origin"]["layer"] == "b" and rep["nan_origin"]["tensor"] == "activation"
    assert rep["nan_origin"]["step"] == NAN_AT
    assert rep["nan_upstream"] == ["proj"]
    assert rep["blame"]["level"] == "unknown", rep["blame"]
    assert "after proj, which fp8scope did not monitor" in rep["blame"]["why"]
    assert any(f"look at their outputs at step {NAN_AT} first" in a for a in rep["advice"])
    assert rep["coverage"] == "not monitored: 1 other weight matrix (proj, 57 % of the GEMM weights)"

    capsys.readouterr()
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not monitored: 1 other weight matrix (proj" in out and "FP8's part is unknown" in out
    assert cli_main(["info", str(tmp_path)]) == 0
    assert "not monitored: 1 other" in capsys.readouterr().out


def test_a_nan_that_starts_at_a_monitored_fp8_layer_is_still_blamed_on_fp8(tmp_path):
    net = fp8_net()
    train(net, tmp_path, nan_plant(net.a, NAN_AT, pre=True))
    _, rep = analysis(tmp_path)
    assert rep["nan_origin"]["layer"] == "a" and rep["nan_upstream"] == []
    assert rep["blame"]["level"] == "likely", rep["blame"]


def test_a_clean_run_is_clean_in_the_monitored_layers(tmp_path):
    train(fp8_net(), tmp_path, lambda step: None)
    _, rep = analysis(tmp_path)
    assert rep["blame"]["level"] == "clean"
    assert rep["blame"]["why"] == ("no warning or critical events in the monitored layers (not monitored: 1 other weight "
                                   "matrix (proj, 57 % of the GEMM weights))")


def test_a_mixtral_leaves_its_routers_quietly_compiled_or_not(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # routers are no gap worth a warning, the experts are monitored
        fp8scope.Monitor(model, tmp_path / "eager", every=1).close()
    cov = json.loads((tmp_path / "eager" / "run.json").read_text())["meta"]["coverage"]
    assert [(u["module"], u["kind"]) for u in cov["unmonitored"]] == [("model.layers.0.mlp.gate", "router"),
                                                                      ("model.layers.1.mlp.gate", "router")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # compiled first, its experts are monitored too (tests/test_experts.py)
        fp8scope.Monitor(torch.compile(model), tmp_path / "compiled", every=1).close()
    assert not [str(w.message) for w in caught if "not monitored" in str(w.message)]
    assert json.loads((tmp_path / "compiled" / "run.json").read_text())["meta"]["coverage"] == cov


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
    assert not is_router(nn.Linear(4, 8)) and not is_router(Projector(4))


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


def test_experts_that_run_compiled_as_a_loop_are_said_and_left(tmp_path):
    """Compiled, the experts are captured where they run a grouped or batched GEMM
    (tests/test_experts.py). The loop of per-expert GEMMs (``experts_implementation="eager"``) is read
    in eager forwards only: traced, its experts log nothing. The first traced forward tells the monitor
    (a side effect dynamo replays), it warns once, and run.json's coverage leaves them, where it
    counted them as monitored until then."""
    from fp8scope.store.manifest import coverage_text, read_manifest

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    ids = torch.randint(0, 96, (2, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(model, tmp_path / "r", every=1)
        assert coverage_text(read_manifest(tmp_path / "r")) is None  # every module holding GEMM weights, so far
        compiled = torch.compile(model, backend="aot_eager")  # the loop breaks the graph on its routing
        for _ in range(2):
            out = compiled(input_ids=ids, labels=ids)
            out.loss.backward()
            mon.step(loss=out.loss)
        mon.close()
    said = [str(w.message) for w in caught if "MoE expert" in str(w.message)]
    assert len(said) == 1, said
    assert ("2 MoE expert module(s) holding 84 % of the model's GEMM weights ran under torch.compile without a "
            "grouped or batched GEMM") in said[0] and "model.layers.1.mlp.experts (MixtralExperts)" in said[0], said
    assert coverage_text(read_manifest(tmp_path / "r")).startswith(
        "not monitored: 2 MoE expert modules (model.layers.0.mlp.experts, model.layers.1.mlp.experts, 84")
    layers = set(fp8scope.load_run(tmp_path / "r").tensors()["layer"])
    assert "model.layers.0.self_attn.q_proj" in layers and not any(".experts." in n for n in layers)


def test_layers_whose_weight_the_model_uses_directly_are_said_and_left(tmp_path, capsys):
    """``transformers``' Mamba holds ``dt_proj`` as an ``nn.Linear`` but computes
    ``self.dt_proj.weight @ time_step`` (modeling_mamba.py, ``MambaMixer.forward``; with the ``mamba_ssm``
    kernels ``x_proj`` and ``out_proj`` go the same way): the layer's forward never runs, so its hooks
    capture nothing and its emulated FP8 conversion never computes. Before, the run said nothing of it,
    and the report counted 16 layers of a 4-layer Mamba as running FP8 where 12 did. After two steps that
    captured something, the monitor says which layers captured nothing, once, and run.json leaves them."""
    from fp8scope.store.manifest import coverage_text, read_manifest

    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, state_size=4)
    model = transformers.MambaForCausalLM(cfg)
    convert_to_fp8(model, skip=["lm_head"])
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(model, tmp_path, every=1)
        for step in range(4):
            ids = torch.randint(0, 32, (2, 8))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss)
            if step == 0:  # one step is no evidence yet
                assert coverage_text(read_manifest(tmp_path)) is None
        mon.close()
    said = [str(w.message) for w in caught if "did not run" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith("fp8scope: 2 monitored layer(s) holding 2 % of the model's GEMM weights did not run "
                              "their forward in 2 steps: backbone.layers.0.mixer.dt_proj (Fp8Linear), "
                              "backbone.layers.1.mixer.dt_proj (Fp8Linear)"), said
    meta = read_manifest(tmp_path)["meta"]
    assert [(u["module"], u["kind"]) for u in meta["coverage"]["unmonitored"]] == [
        ("backbone.layers.0.mixer.dt_proj", "idle"), ("backbone.layers.1.mixer.dt_proj", "idle")]
    assert meta["sources"] == {"emulated": 6, "whatif": 1}  # in_proj, x_proj and out_proj of 2 layers; the head
    assert not any("dt_proj" in n for n in fp8scope.load_run(tmp_path).tensors()["layer"])
    capsys.readouterr()
    assert cli_main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mixed: 6 layers ran FP8 (6 emulated)" in out
    assert ("not monitored: 2 layers whose forward never ran (backbone.layers.0.mixer.dt_proj, "
            "backbone.layers.1.mixer.dt_proj, 2 % of the GEMM weights)") in out


class Gated(nn.Module):
    """A layer only some batches use (a vision tower on image batches, a task head)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.aux = nn.Linear(16, 16)
        self.use_aux = False

    def forward(self, x):
        h = self.a(x)
        return self.aux(h) if self.use_aux else h


def test_a_layer_left_idle_counts_again_once_it_runs(tmp_path):
    from fp8scope.store.manifest import coverage_text, read_manifest

    torch.manual_seed(0)
    model = Gated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(model, tmp_path, every=1)
        texts = []
        for step in range(5):
            model.use_aux = step == 3
            model(torch.randn(4, 16)).pow(2).mean().backward()
            mon.step()
            texts.append(coverage_text(read_manifest(tmp_path)))
        mon.close()
    assert texts[:3] == [None, "not monitored: 1 layer whose forward never ran (aux, 50 % of the GEMM weights)",
                         "not monitored: 1 layer whose forward never ran (aux, 50 % of the GEMM weights)"], texts
    assert texts[3:] == [None, None]
    assert read_manifest(tmp_path)["meta"]["sources"] == {"whatif": 2}
    assert len([w for w in caught if "did not run" in str(w.message)]) == 1
    rows = fp8scope.load_run(tmp_path).tensors()
    assert sorted(set(rows.loc[rows["layer"] == "aux", "step"])) == [3]
