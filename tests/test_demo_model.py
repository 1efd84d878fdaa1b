"""Fast tests of the demo: model, shipped corpus, planted instabilities, training loop.

The injections are what later tests of the monitor rely on ("the monitor finds
the outlier we planted at step S in layer L"), so here we check that each one
changes exactly the targeted tensor, at exactly the chosen step, and nothing before.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from fp8scope.demo.corpus import Batches, CharTokenizer, generate_corpus, load_corpus, make_data, shipped_text
from fp8scope.demo.inject import Injection, Injector, outlier_channels, parse_spec
from fp8scope.demo.tiny_gpt import GPTConfig, TinyGPT
from fp8scope.demo import train as demo_train

@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread is as fast, and on a busy shared CPU it avoids
    OpenMP threads spinning against each other (measured 20x slower with 2 threads there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SMALL = dict(d_model=64, n_layers=2, n_heads=4, seq_len=32, batch_size=8, corpus_chars=30_000)


def small_model(seed: int = 0) -> TinyGPT:
    return TinyGPT(GPTConfig(vocab=40, d_model=64, n_layers=3, n_heads=4, seq_len=16), seed=seed)


def tokens(batch: int = 2, t: int = 16, vocab: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(1))


# --- model -----------------------------------------------------------------------------------


def test_model_shapes_and_names():
    model = small_model()
    logits = model(tokens())
    assert logits.shape == (2, 16, 40)
    names = model.linear_names()
    for i in range(3):
        for suffix in ("attn.qkv", "attn.proj", "mlp.gate", "mlp.up", "mlp.down"):
            assert f"blocks.{i}.{suffix}" in names
    assert names[-1] == "lm_head"
    assert names.index("blocks.0.attn.qkv") < names.index("blocks.0.mlp.down") < names.index("blocks.1.attn.qkv")
    assert model.get_submodule("blocks.2.mlp.down").in_features == model.cfg.mlp_hidden
    assert model.cfg.mlp_hidden % 32 == 0


def test_model_init_deterministic_and_causal():
    a, b, c = small_model(0), small_model(0), small_model(1)
    torch.manual_seed(123)  # global RNG must not matter
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)
    x = tokens()
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 40  # changing the last token must not change earlier logits
    with torch.no_grad():
        assert torch.allclose(a(x)[:, :-1], a(x2)[:, :-1], atol=1e-6)
    with pytest.raises(ValueError):
        GPTConfig(d_model=65, n_heads=4)


# --- corpus ----------------------------------------------------------------------------------


def test_corpus_deterministic_and_nontrivial():
    t1, t2, t3 = generate_corpus(20_000, 0), generate_corpus(20_000, 0), generate_corpus(20_000, 1)
    assert t1 == t2 and t1 != t3 and len(t1) >= 20_000
    words = t1.lower().replace(".", " ").replace(",", " ").split()
    assert len(set(words)) > 100  # varied vocabulary
    paragraphs = t1.split("\n\n")
    assert len(set(paragraphs)) == len(paragraphs) > 50  # no repeats or loops
    assert "\n\n" in t1 and t1[0].isupper()
    assert len(shipped_text()) > 1000 and load_corpus(5000).startswith(shipped_text())


def test_tokenizer_and_batches():
    tok, train_ids, val_ids = make_data(20_000, seed=0)
    assert 30 < tok.vocab_size < 80
    assert tok.decode(tok.encode("The old miller.")) == "The old miller."
    with pytest.raises(ValueError):
        CharTokenizer.from_text("abc").encode("abz")
    b1 = Batches(train_ids, 4, 16, seed=3)
    b2 = Batches(train_ids, 4, 16, seed=3)
    x, y = b1.next()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = b2.next()
    assert torch.equal(x, x2)
    assert val_ids.numel() > 0


# --- injection parsing -----------------------------------------------------------------------


def test_parse_specs():
    assert parse_spec("outlier:blocks.2.mlp.down:150") == Injection("outlier", 150, "blocks.2.mlp.down", 1000.0, 1)
    assert parse_spec("outlier:blocks.2.mlp.down:150:50:0").duration is None
    assert parse_spec("outlier:blocks.2.mlp.down:150:50:5").duration == 5
    assert parse_spec("nan:blocks.0.attn.qkv:7").kind == "nan"
    assert parse_spec("gradscale:blocks.0.attn.proj:10").factor == 1e-8
    assert parse_spec("lr:100") == Injection("lr", 100, None, 100.0, None)
    assert parse_spec("lr:100:3").factor == 3.0
    for spec in ("outlier:blocks.2.mlp.down:150:50:5", "nan:x:3", "gradscale:x:3:0.001", "lr:4:2"):
        assert parse_spec(parse_spec(spec).spec) == parse_spec(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty"),
        ("spike:blocks.0.mlp.up:3", "unknown kind"),
        ("outlier:blocks.0.mlp.up", "wrong number of fields"),
        ("outlier:blocks.0.mlp.up:abc", "STEP must be an integer"),
        ("outlier:blocks.0.mlp.up:-1", ">= 0"),
        ("outlier:blocks.0.mlp.up:3:big", "FACTOR must be a number"),
        ("outlier:blocks.0.mlp.up:3:inf", "finite"),
        ("nan:blocks.0.mlp.up:3:4", "wrong number of fields"),
        ("lr", "lr takes STEP"),
        ("outlier::3", "LAYER is empty"),
    ],
)
def test_parse_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_attach_unknown_layer_lists_linears():
    with pytest.raises(ValueError, match="blocks.0.mlp.down"):
        Injector(["outlier:blocks.9.mlp.down:1"]).attach(small_model())


# --- injections act on the right tensor at the right step ------------------------------------


def _capture_inputs(module: nn.Module, store: list):
    """A hook registered AFTER the injector, like a monitor's would be: it must see the injected input."""
    return module.register_forward_pre_hook(lambda m, args: store.append(args[0].detach().clone()))


def test_outlier_injection():
    model = small_model()
    layer = "blocks.1.mlp.down"
    inj = Injector([f"outlier:{layer}:3:1000:2"]).attach(model)
    seen: list[torch.Tensor] = []
    _capture_inputs(model.get_submodule(layer), seen)
    x = tokens()
    with torch.no_grad():
        for step in range(6):
            inj.step = step
            model(x)
    ref = seen[0]
    ch = outlier_channels(ref.shape[-1])
    assert len(ch) == 4 and 0 not in ch
    others = [i for i in range(ref.shape[-1]) if i not in ch]
    for step in (0, 1, 2, 5):  # before, and after the 2-step window
        assert torch.equal(seen[step], ref), step
    for step in (3, 4):
        assert torch.allclose(seen[step][..., ch], ref[..., ch] * 1000)
        assert torch.equal(seen[step][..., others], ref[..., others])
        assert seen[step].abs().amax() > 100 * ref.abs().amax()
    assert inj.fired == [(3, inj.specs[0]), (4, inj.specs[0])]
    inj.detach()
    inj.step = 3
    with torch.no_grad():
        model(x)
    assert torch.equal(seen[-1], ref)


@pytest.mark.parametrize("fp8", [False, True])
def test_grow_injection_grows_the_input_not_the_function(fp8):
    """``grow`` multiplies the input channels and divides the weight's columns by the same factor: the
    layer's input (what FP8 quantizes) grows, its output in exact arithmetic does not, so the optimizer
    has nothing to shrink back; a copy of the model (a shadow fork's replica) is planted the same way."""
    import copy

    model = small_model()
    if fp8:
        from fp8scope.emulate import convert_to_fp8

        convert_to_fp8(model)
    layer = "blocks.1.mlp.down"
    inj = Injector([f"grow:{layer}:2:256:4"]).attach(model)
    module = model.get_submodule(layer)
    x = torch.randn(2, 16, module.weight.shape[1])
    replica = copy.deepcopy(module)
    seen: list[torch.Tensor] = []
    _capture_inputs(module, seen)
    outs = []
    with torch.no_grad():
        for step in (0, 1, 2, 3, 5, 9):
            inj.step = step
            outs.append((step, module(x), replica(x)))
    ch = outlier_channels(x.shape[-1])
    others = [i for i in range(x.shape[-1]) if i not in ch]
    for (step, y, y_replica), inp in zip(outs, seen):
        factor = 256 ** min(1.0, (step - 2 + 1) / 4) if step >= 2 else 1.0
        assert torch.allclose(inp[..., ch], x[..., ch] * factor) and torch.equal(inp[..., others], x[..., others])
        assert torch.equal(y_replica, y), step
        if not fp8:
            assert torch.allclose(y, outs[0][1], rtol=1e-5, atol=1e-5), step
    inj.detach()
    assert type(module).__name__ in ("Linear", "Fp8Linear") and "weight" in dict(module.named_parameters())


def test_nan_injection_propagates():
    model = small_model()
    inj = Injector(["nan:blocks.0.attn.proj:2"]).attach(model)
    seen: list[torch.Tensor] = []
    _capture_inputs(model.get_submodule("blocks.0.attn.proj"), seen)
    x = tokens()
    outs = []
    with torch.no_grad():
        for step in range(4):
            inj.step = step
            outs.append(model(x))
    assert [int(torch.isnan(s).sum()) for s in seen] == [0, 0, 1, 0]
    assert torch.isfinite(outs[1]).all() and torch.isnan(outs[2]).any() and torch.isfinite(outs[3]).all()


def test_gradscale_injection_scales_grad_output():
    layer = "blocks.1.attn.qkv"
    factor = 1e-3
    model = small_model()
    inj = Injector([f"gradscale:{layer}:2:{factor}"]).attach(model)
    module = model.get_submodule(layer)
    grad_outs: list[torch.Tensor] = []
    module.register_full_backward_pre_hook(lambda m, g: grad_outs.append(g[0].detach().clone()))
    x = tokens()
    weight_grads = []
    for step in range(4):
        inj.step = step
        model.zero_grad()
        model(x).square().mean().backward()  # same loss every step (no optimizer): only the hook differs
        weight_grads.append(module.weight.grad.clone())
    assert torch.equal(grad_outs[0], grad_outs[1]) and torch.equal(weight_grads[0], weight_grads[1])
    for step in (2, 3):
        assert torch.allclose(grad_outs[step], grad_outs[0] * factor, rtol=1e-5, atol=0)
        assert torch.allclose(weight_grads[step], weight_grads[0] * factor, rtol=1e-4, atol=1e-12)
    assert inj.fired[0] == (2, inj.specs[0])
    later = model.get_submodule("blocks.2.mlp.down")  # downstream of the hook: untouched
    model.zero_grad()
    inj.step = 0
    model(x).square().mean().backward()
    g0 = later.weight.grad.clone()
    model.zero_grad()
    inj.step = 3
    model(x).square().mean().backward()
    assert torch.equal(later.weight.grad, g0)


def test_lr_injection():
    setup = demo_train.build(fp8="off", inject=["lr:5:10"], steps=20, **SMALL)
    assert setup.injector.lr_scale(4) == 1.0 and setup.injector.lr_scale(5) == 10.0
    assert setup.lr_at(6) == pytest.approx(10 * demo_train.lr_schedule(6, setup.args.lr, 20, 2))


# --- training --------------------------------------------------------------------------------


def test_loss_decreases_plain():
    setup = demo_train.build(fp8="off", steps=30, lr=3e-3, **SMALL)
    result = demo_train.train_steps(setup, 30)
    assert result.steps == 30 and result.first_nonfinite_step is None
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert first > math.log(setup.cfg.vocab) - 0.3  # starts near uniform
    assert last < first - 0.8, (first, last)
    assert all(math.isfinite(g) for g in result.grad_norms)


def test_nan_run_stops_after_a_few_steps():
    setup = demo_train.build(fp8="off", steps=40, inject=["nan:blocks.0.mlp.up:4"], after_nan=2, **SMALL)
    result = demo_train.train_steps(setup, 40)
    assert result.first_nonfinite_step == 4
    assert result.steps == 7 and result.stopped_early
    assert all(math.isfinite(v) for v in result.losses[:4]) and math.isnan(result.losses[4])


def test_main_cli_plain(tmp_path, capsys):
    argv = ["--fp8", "off", "--no-monitor", "--steps", "3", "--d-model", "32", "--n-layers", "1",
            "--seq-len", "16", "--batch-size", "4", "--corpus-chars", "5000", "--run-dir", str(tmp_path / "r")]
    assert demo_train.main(argv) == 0
    assert "3 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        demo_train.main(["--inject", "bogus:1"])


def _emulate_available() -> bool:
    try:
        from fp8scope.emulate import convert_to_fp8  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _emulate_available(), reason="fp8scope.emulate not available")
def test_injection_survives_fp8_conversion():
    """build() converts first, then attaches: the hook must sit on the Fp8Linear that runs."""
    setup = demo_train.build(fp8="delayed", steps=5, inject=["outlier:blocks.1.mlp.down:2"], **SMALL)
    down = setup.model.get_submodule("blocks.1.mlp.down")
    assert type(down).__name__ == "Fp8Linear"
    assert type(setup.model.get_submodule("lm_head")) is nn.Linear
    result = demo_train.train_steps(setup, 4)
    assert result.steps == 4
    assert setup.injector.fired == [(2, setup.injector.specs[0])]


def _monitor_available() -> bool:
    import fp8scope

    return _emulate_available() and hasattr(fp8scope, "Monitor") and hasattr(fp8scope, "load_run")


@pytest.mark.skipif(not _monitor_available(), reason="fp8scope.Monitor not available")
def test_monitored_cli_run_records_planted_outlier(tmp_path):
    """End to end: the CLI writes a run in which the planted outlier's amax jump is visible."""
    import fp8scope

    run_dir = tmp_path / "run"
    argv = ["--steps", "6", "--every", "1", "--d-model", "32", "--n-layers", "2", "--seq-len", "16",
            "--batch-size", "4", "--corpus-chars", "5000", "--run-dir", str(run_dir), "--quiet",
            "--inject", "outlier:blocks.1.mlp.down:4"]
    assert demo_train.main(argv) == 0
    df = fp8scope.load_run(run_dir).tensors()
    amax = df[(df.layer == "blocks.1.mlp.down") & (df.tensor == "activation")].set_index("step")["amax"]
    assert sorted(amax.index) == list(range(6))
    assert amax[4] > 50 * amax[3] and amax[5] < 5 * amax[3]


def test_train_step_marks_the_phases_of_a_step():
    """``marks`` (benchmarks/overhead.py --phases) gets five timestamps, in order: start, after the
    forward with the loss, the backward, the optimizer and the monitor's step."""
    setup = demo_train.build(fp8="off", quiet=True, steps=2, **SMALL)
    marks: list[float] = []
    loss, _, _ = demo_train.train_step(setup, 0, None, marks=marks)
    assert len(marks) == 5 and marks == sorted(marks) and math.isfinite(float(loss))
