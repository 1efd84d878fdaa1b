"""Other recipes measured on the run's own tensors, and the advisor that ranks them.

The numerics are checked against references written here in float64 numpy, independently of the
torch code: a generic round-to-nearest-even onto a float format's grid (E4M3, E5M2, E2M1), TE's
E8M0 rule on Python integers, and NVFP4's two-level scales, on adversarial tensors (an outlier
channel, a massive-activation token, subnormals, all-zero and NaN blocks, sides that are not block
multiples).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import fp8scope
from fp8scope.capture.recipe_stats import recipe_stats
from fp8scope.detect.advisor import IN_USE, advise, per_step, summed
from fp8scope.emulate.blocks import e2m1_round, mxfp8_blocks, nvfp4_blocks
from fp8scope.emulate.recipe_table import RECIPES
from fp8scope.schema import RECIPE_FIELDS
from tests.te_standin import float_to_e8m0

F32_MAX = float(np.finfo(np.float32).max)


# ---- references (float64 numpy) ---------------------------------------------------------------
def round_to_format(v: np.ndarray, mbits: int, emin: int, top: float) -> np.ndarray:
    """Round-to-nearest-even onto a float format with ``mbits`` mantissa bits and smallest normal
    exponent ``emin`` (subnormals below), saturating at ``top``; NaN stays NaN."""
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.abs(v), top)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(e, emin)
    step = np.exp2(e - mbits)
    q = np.minimum(np.rint(a / step) * step, top)
    return np.where(np.isnan(v), np.nan, np.copysign(q, v))


def e4m3(v):
    return round_to_format(v, 3, -6, 448.0)


def e2m1(v):
    return round_to_format(v, 1, 0, 6.0)


def f32(v):
    return np.float32(v)


def ref_mxfp8(x: np.ndarray) -> np.ndarray:
    """TE's MXFP8 quantize-dequantize, rowwise 1x32 (rows a multiple of 32)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    out = np.empty_like(blocks, dtype=np.float64)
    rcp = f32(1 / 448)
    for i, b in enumerate(blocks):
        amax = np.float32(np.nanmax(np.abs(np.where(np.isnan(b), 0, b))))
        code = float_to_e8m0(float(f32(amax * rcp)))
        enc = 2.0 ** (127 - code) if code < 254 else 2.0 ** -127
        out[i] = e4m3(b.astype(np.float64) * enc) * 2.0 ** (code - 127)
    return out.reshape(x.shape)


@np.errstate(over="ignore", divide="ignore", invalid="ignore")  # float32 overflow is part of the rule
def ref_nvfp4(x: np.ndarray) -> np.ndarray:
    """TE 2.16+ NVFP4, rowwise 1x16: S_enc from the tensor amax, E4M3 block scales, E2M1 values."""
    x32 = x.astype(np.float32)
    g = np.float32(np.max(np.abs(np.nan_to_num(x32, nan=0))))
    s_enc = f32(min(f32(f32(2688.0) / g) if g > 0 else np.inf, F32_MAX)) if g > 0 else f32(1.0)
    s_enc = f32(1.0) if (g == 0 or s_enc == 0) else s_enc
    s_dec = f32(1.0 / s_enc)
    sixth = f32(1.0 / 6.0)
    out = np.empty(x32.size, dtype=np.float64)
    flat = x32.reshape(-1, 16)
    for i, b in enumerate(flat):
        amax = np.float32(np.max(np.abs(np.nan_to_num(b, nan=0))))
        s_block = f32(e4m3(min(f32(amax * f32(s_enc * sixth)), 448.0)))
        enc = f32(min(f32(1.0) / f32(s_block * s_dec), F32_MAX)) if s_block * s_dec > 0 else f32(F32_MAX)
        q = e2m1(np.float64(f32(b * enc)))
        out[i * 16:(i + 1) * 16] = (q * np.float64(f32(s_block * s_dec))).astype(np.float32)  # decoded in float32
    return out.reshape(x.shape)


def adversarial(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 128, generator=g)
    outlier_channel = base.clone()
    outlier_channel[:, 7] *= 400
    massive_token = base.clone()
    massive_token[3] *= 1e6
    tiny = base * 1e-40  # subnormal float32 values
    blocks = base.clone()
    blocks[0, :32] = 0.0  # an all-zero block
    blocks[1, 32:64] = float("nan")  # a NaN block
    blocks[2, :16] = 1e-30
    return {"outlier_channel": outlier_channel, "massive_token": massive_token, "subnormal": tiny,
            "zero_nan_blocks": blocks, "wide_range": base * torch.logspace(-8, 8, 128)}


# ---- numerics --------------------------------------------------------------------------------
def test_e2m1_rounding_matches_the_reference_grid():
    v = np.concatenate([np.linspace(-8, 8, 4001), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, -5.0, 1e-30]])
    got = e2m1_round(torch.tensor(v, dtype=torch.float32)).double().numpy()
    np.testing.assert_array_equal(got, e2m1(np.float32(v).astype(np.float64)))


@pytest.mark.parametrize("name", list(adversarial()))
def test_mxfp8_quantize_dequantize_is_bit_exact(name):
    x = adversarial()[name]
    b = mxfp8_blocks(x, fp8scope.formats.get_format("e4m3"))
    q = (b.x.float() * b.scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * b.scale_inv
    np.testing.assert_array_equal(q.reshape(x.shape).double().numpy(), ref_mxfp8(x.numpy()))


@pytest.mark.parametrize("name", list(adversarial()))
def test_nvfp4_quantize_dequantize_is_bit_exact(name):
    x = adversarial()[name]
    b = nvfp4_blocks(x)
    q = e2m1_round(b.x.float() * b.scale) * b.scale_inv
    np.testing.assert_array_equal(q.reshape(x.shape).double().numpy(), ref_nvfp4(x.numpy()))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_stats_counts_agree_with_the_reference(recipe):
    x = adversarial()["zero_nan_blocks"]
    v = dict(zip(RECIPE_FIELDS, recipe_stats(x, recipe, "activation").tolist()))
    a = x.double().numpy()
    finite = np.isfinite(a)
    nonzero = finite & (a != 0)
    assert v["numel"] == a.size and v["nonzero"] == nonzero.sum()
    if recipe == "mxfp8":
        deq = ref_mxfp8(x.numpy())
    elif recipe == "nvfp4":
        deq = ref_nvfp4(x.numpy())
    elif recipe == "bf16":
        deq = x.to(torch.bfloat16).double().numpy()
    else:
        deq = None
    if deq is not None:
        assert v["underflow"] == (nonzero & (deq == 0)).sum()
        err = np.where(finite, deq - a, 0.0)
        assert v["sq_err"] == pytest.approx(float((err ** 2).sum()), rel=1e-9)
    assert v["sq_signal"] == pytest.approx(float((np.where(finite, a, 0) ** 2).sum()), rel=1e-9)


def test_a_massive_token_flushes_per_tensor_fp8_and_not_block_scales():
    x = adversarial()["massive_token"]
    stats = {r: dict(zip(RECIPE_FIELDS, recipe_stats(x, r, "activation").tolist())) for r in RECIPES}
    share = {r: s["underflow"] / s["nonzero"] for r, s in stats.items()}
    assert share["current"] > 0.5  # one token 1e6 x the others: per-tensor E4M3 flushes most of them
    assert share["mxfp8"] == 0 and share["block128"] == 0 and share["bf16"] == 0
    # NVFP4's E4M3 block scales flush under the tensor scale the token sets: the values come back 0
    assert share["nvfp4"] > 0.5
    assert stats["nvfp4"]["overflow"] < 0.01 * stats["nvfp4"]["numel"]  # flushed, not clipped


# ---- capture and the store -------------------------------------------------------------------
def _gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def _train(model, run, steps, plant=None, every=2, recipes=RECIPES):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    handle = None
    if plant is not None:  # a massive activation on one token at the input of every MLP's c_fc
        def hook(mod, args):
            x = args[0].clone()
            x[:, 0] = x[:, 0] * plant
            return (x,)
        handle = [blk.mlp.c_fc.register_forward_pre_hook(hook) for blk in model.transformer.h]
    g = torch.Generator().manual_seed(1)
    with fp8scope.Monitor(model, run, every=every, whatif_recipes=recipes, detect=False) as mon:
        for _ in range(steps):
            ids = torch.randint(0, 256, (4, 32), generator=g)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
    for h in handle or ():
        h.remove()
    return fp8scope.load_run(run)


def test_recipes_are_measured_on_full_steps_and_stored_long(tmp_path):
    run = _train(_gpt2(), tmp_path, steps=4, every=2)
    rec = run.table("recipes").to_pandas()
    assert sorted(set(rec.step)) == [0, 2]  # full steps only
    t = run.tensors()
    full = t[t.full]
    assert len(rec) == len(full) * len(RECIPES)  # one row per (tensor, recipe)
    assert set(rec.recipe) == set(RECIPES)
    assert run.manifest["meta"]["whatif_recipes"] == list(RECIPES)
    # a recipe is one more dimension for SQL
    by = run.sql("select recipe, sum(underflow) as u from recipes group by recipe order by recipe")
    assert list(by.recipe) == sorted(RECIPES)


def test_unknown_recipe_is_a_usage_error(tmp_path):
    with pytest.raises(fp8scope.UsageError, match="unknown what-if recipe"):
        fp8scope.Monitor(nn.Sequential(nn.Linear(4, 4)), tmp_path, whatif_recipes=["mxfp4"])


# ---- the advisor -----------------------------------------------------------------------------
def test_a_healthy_run_gets_no_advice(tmp_path):
    run = _train(_gpt2(), tmp_path, steps=6)
    advice, summary = advise(per_step(run))
    assert advice == []
    assert any(line.startswith("MXFP8: safe for every layer's activations, weights, gradients") for line in summary)


def test_a_massive_activation_gets_a_block_recipe_that_removes_its_underflow(tmp_path):
    run = _train(_gpt2(), tmp_path, steps=6, plant=1e6)
    rows = per_step(run)
    table = summed(rows)
    advice, _ = advise(rows)
    flagged = {(a.layer, a.tensor): a for a in advice}
    for i in range(2):
        a = flagged[(f"transformer.h.{i}.mlp.c_fc", "activation")]
        assert a.fixes[:2] == ["block128", "mxfp8"], a
        rows = table[(table.layer == a.layer) & (table.tensor == "activation")].set_index("recipe")
        assert rows.loc[IN_USE, "underflow_frac"] > 0.02 and rows.loc["mxfp8", "underflow_frac"] < 0.02
        assert "MXFP8" in a.text() and "underflow" in a.text()
    out = subprocess.run([sys.executable, "-m", "fp8scope", "whatif", str(tmp_path), "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {(a["layer"], a["tensor"]) for a in doc["advice"]} == set(flagged)
    text = subprocess.run([sys.executable, "-m", "fp8scope", "whatif", str(tmp_path)], capture_output=True, text=True,
                          timeout=120).stdout
    assert "transformer.h.0.mlp.c_fc activation: use 1x128 block FP8 or MXFP8" in text


# ---- cost --------------------------------------------------------------------------------------
def test_each_recipe_is_a_constant_number_of_eager_ops_and_one_compiled_kernel():
    """Eager (the CPU default): the same ops for any size, no chunking. Compiled (GPUs by default):
    one generated kernel per recipe per tensor (inductor's C++ here, the same graph is Triton on CUDA)."""
    import re

    from torch._inductor.utils import run_and_get_code
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp8scope.capture import recipe_stats as rs

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    for recipe in RECIPES:
        counts = set()
        for shape in ((256, 512), (2048, 1024)):
            with Count() as c:
                rs._recipe_stats(torch.randn(shape), recipe, "activation")
            counts.add(c.n)
        assert len(counts) == 1 and counts.pop() <= 100, recipe
    for recipe, role in (("mxfp8", "activation"), ("nvfp4", "weight")):
        torch._dynamo.reset()
        key = ("cpu", torch.float32, recipe, role)
        _, codes = run_and_get_code(torch.compile(rs.RECIPE_STATS.eager(key), dynamic=True), *rs._examples(key))
        assert len(re.findall(r"async_compile\.(?:cpp_pybinding|cpp|triton)\(", "\n".join(codes))) == 1, recipe


# ---- the emulated layer under block recipes -----------------------------------------------------
@pytest.mark.parametrize("recipe", ["mxfp8", "block128"])
def test_block_scaled_fp8_linear_reads_each_usage_te_gives_each_gemm(recipe):
    """Forward x_row @ w_row^T; dgrad g_row @ w_col; wgrad g_col^T @ x_col (TE's linear.py usages);
    under Float8BlockScaling a weight's 128x128 tiles serve both usages."""
    from fp8scope.emulate import Float8BlockScaling, MXFP8BlockScaling, convert_to_fp8
    from fp8scope.emulate.recipe_table import quantize_dequantize as qdq

    rec = MXFP8BlockScaling() if recipe == "mxfp8" else Float8BlockScaling()
    torch.manual_seed(0)
    lin = convert_to_fp8(nn.Sequential(nn.Linear(256, 128)), rec)[0]
    assert lin.block_scaled and lin.activation_state is None
    x = (torch.randn(4, 64, 256) * torch.logspace(-3, 2, 256)).requires_grad_(True)
    g = torch.randn(4, 64, 128) * torch.logspace(-2, 2, 64).unsqueeze(1)  # rows of other magnitudes
    y = lin(x)
    y.backward(g)
    x2, g2, w = x.detach().reshape(-1, 256), g.reshape(-1, 128), lin.weight.detach()
    want_y = torch.nn.functional.linear(qdq(x2, recipe, "activation").reshape(x.shape), qdq(w, recipe, "weight"),
                                        lin.bias)
    assert torch.equal(y.detach(), want_y.detach())
    assert torch.equal(x.grad.reshape(-1, 256), qdq(g2, recipe, "gradient") @ qdq(w, recipe, "weight", columnwise=True))
    assert torch.equal(lin.weight.grad, qdq(g2, recipe, "gradient", columnwise=True).t()
                       @ qdq(x2, recipe, "activation", columnwise=True))
    if recipe == "block128":
        assert torch.equal(qdq(w, recipe, "weight", columnwise=True), qdq(w, recipe, "weight"))
    else:
        assert not torch.equal(qdq(g2, recipe, "gradient", columnwise=True), qdq(g2, recipe, "gradient"))


def test_the_advised_recipe_removes_the_fault_when_the_run_is_repeated_with_it(tmp_path):
    """A massive-activation token (planted at every MLP input): the what-if run's advisor names
    block FP8 / MXFP8 for those activations; the same seed trained in emulated FP8 shows it, with
    per-tensor delayed scaling the activations underflow, with MXFP8 they do not."""
    from fp8scope.emulate import DelayedScaling, MXFP8BlockScaling, convert_to_fp8

    advice, _ = advise(per_step(_train(_gpt2(), tmp_path / "whatif", steps=6, plant=1e6)))
    assert any(a.tensor == "activation" and "mxfp8" in a.fixes for a in advice)
    shares = {}
    for name, rec in (("delayed", DelayedScaling(amax_history_len=16)), ("mxfp8", MXFP8BlockScaling())):
        model = convert_to_fp8(_gpt2(), rec, skip=["lm_head"])
        t = _train(model, tmp_path / name, steps=6, plant=1e6, recipes=()).tensors()
        rows = t[t.full & t.layer.str.endswith("mlp.c_fc") & (t.tensor == "activation") & (t.step > 0)]
        shares[name] = float(rows.underflow.sum() / (rows.numel - rows.zeros).sum())
    assert shares["delayed"] > 0.02 > shares["mxfp8"], shares


def test_a_one_step_outlier_is_advised_at_its_step(tmp_path):
    """The demo's planted outlier (1000x on a few channels of one layer's input for one step): delayed
    scaling clips it by far more than the detector's 8x; the advisor scopes the fault to that step and
    names per-tensor current scaling, the cheapest recipe that does not clip it there."""
    from fp8scope.demo.train import main

    main(["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
          "--corpus-chars", "20000", "--every", "2", "--quiet", "--steps", "16", "--run-dir", str(tmp_path),
          "--inject", "outlier:blocks.1.mlp.down:12:1000:1", "--whatif-recipes", "all"])
    advice, _ = advise(per_step(fp8scope.load_run(tmp_path)))
    by = {(a.layer, a.tensor): a for a in advice}
    a = by[("blocks.1.mlp.down", "activation")]
    assert ("overflow" in a.problem or "clipped" in a.problem) and a.problem.endswith("at step 12"), a
    assert a.fixes[0] == "current", a
