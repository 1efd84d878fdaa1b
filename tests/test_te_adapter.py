"""The Transformer Engine adapter, version by version, against stand-ins of TE 2.0 -> 2.20
(tests/te_standin.py encodes what each version does, with TE's file and line).

Each test would catch one defect of a reader that knows one TE version only: the LayerNormMLP
backward slots of 2.0-2.3, the current-scaling quantizer that keeps nothing from 2.16, custom
recipes read as per-tensor FP8, the split QKV weights, the early backward update of a LayerNormMLP
that runs first, cached weights, GroupedLinear's two slot layouts, the MXFP8 /
Float8BlockScaling block shapes and rounding, and NVFP4's usages, switches and the block-scale
formula of 2.8-2.13.
"""

from __future__ import annotations

import math
import struct
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fp8scope
from fp8scope.emulate.block_linear import rht16
from fp8scope.emulate.blocks import e8m0_codes, fp8_block_scaling_blocks, mxfp8_blocks, nvfp4_blocks
from fp8scope.emulate.scaling import te_scale_from_amax
from fp8scope.formats import get_format
from tests import te_standin
from tests.te_standin import compute_scale_from_amax, float_to_e8m0, te_amax

VERSIONS = ["2.0.0", "2.3.0", "2.4.0", "2.8.0", "2.12.0", "2.16.0", "2.18.0", "2.20.0.dev0+d0067d0"]
E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")


def train(pt, model, recipe, tmp_path, steps=3, forward=None, every=1):
    """``steps`` TE training steps under a monitor; returns the rows and, per step, TE's state as the
    step used it (scales before the step, each slot's recorded amax after its update)."""
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8scope.Monitor(model, tmp_path, every=every, detect=False) as mon:
            for step in range(steps):
                torch.manual_seed(100 + step)
                before = _state(model)
                with pt.fp8_autocast(enabled=True, fp8_recipe=recipe):
                    y = (forward or (lambda m: m(torch.randn(8, 16, requires_grad=True))))(model)
                y.pow(2).sum().backward()
                states.append((before, _state(model)))
                mon.step()
    df = fp8scope.load_run(tmp_path).tensors()
    return df, states, [str(w.message) for w in caught]


def _state(model):
    out = {}
    for name, m in model.named_modules():
        meta = getattr(m, "fp8_meta", None) or {}
        for key in ("scaling_fwd", "scaling_bwd"):
            if key in meta:
                out[(name, key)] = (meta[key].scale.clone(), meta[key].amax_history.clone())
    return out


def row(df, step, layer, tensor):
    r = df[(df.step == step) & (df.layer == layer) & (df.tensor == tensor)]
    assert len(r) == 1, (step, layer, tensor, len(r))
    return r.iloc[0]


# ---- delayed scaling: the slots of each version ------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_delayed_rows_read_the_slots_this_version_uses(tmp_path, monkeypatch, version):
    """Every row's scale is the one TE used that step, and every amax the one TE recorded, in the
    slots this version uses (LayerNormMLP's backward slots moved twice: 2.0-2.2, 2.3, 2.4+)."""
    pt = te_standin.install(monkeypatch, version)
    torch.manual_seed(0)
    model = nn.Sequential(pt.Linear(16, 16), pt.LayerNormMLP(16, 32))
    df, states, _ = train(pt, model, te_standin.DelayedScaling(amax_history_len=4), tmp_path)
    v = tuple(int(p) for p in version.split(".")[:2])
    fc1_grad, fc2_grad = te_standin.mlp_grad_slots(v)
    slots = {("0", "activation"): ("0", "scaling_fwd", 0), ("0", "weight"): ("0", "scaling_fwd", 1),
             ("0", "gradient"): ("0", "scaling_bwd", 0),
             ("1.fc1", "activation"): ("1", "scaling_fwd", 0), ("1.fc1", "weight"): ("1", "scaling_fwd", 1),
             ("1.fc2", "activation"): ("1", "scaling_fwd", 3), ("1.fc2", "weight"): ("1", "scaling_fwd", 4),
             ("1.fc1", "gradient"): ("1", "scaling_bwd", fc1_grad), ("1.fc2", "gradient"): ("1", "scaling_bwd", fc2_grad)}
    for step, (before, after) in enumerate(states):
        for (layer, tensor), (mod, key, slot) in slots.items():
            r = row(df, step, layer, tensor)
            scale = float(before[(mod, key)][0][slot]) if (mod, key) in before else 1.0  # step 0: TE's initial 1
            recorded = float(after[(mod, key)][1][-1, slot])  # the roll put this step's amax last
            assert r.scale == scale, (layer, tensor, step, r.scale, scale)
            assert r.amax == pytest.approx(recorded, rel=1e-6), (layer, tensor, step)
    assert row(df, 2, "1.fc2", "gradient").scale != 1.0  # the slot really moved (1 is an unused slot's scale)


def test_layernorm_mlp_first_in_its_autocast_reports_the_scale_its_backward_used(tmp_path, monkeypatch):
    """TE updates the backward scales at the end of the backward of the autocast's first FP8
    module (layernorm_mlp.py v2.18 1804-1805): read after that backward, fc1's gradient would show
    the *next* scale and a zero amax."""
    pt = te_standin.install(monkeypatch, "2.18.0")
    torch.manual_seed(0)
    model = nn.Sequential(pt.LayerNormMLP(16, 32), pt.Linear(16, 16))
    df, states, _ = train(pt, model, te_standin.DelayedScaling(amax_history_len=4), tmp_path, steps=4)
    for step, (before, after) in enumerate(states):
        r = row(df, step, "0.fc1", "gradient")
        assert r.scale == (float(before[("0", "scaling_bwd")][0][0]) if step else 1.0)
        assert r.amax == float(after[("0", "scaling_bwd")][1][-1, 0]) > 0
    assert len({row(df, s, "0.fc1", "gradient").scale for s in range(4)}) > 1


def test_cached_weights_are_reported_against_the_scale_that_quantized_them(tmp_path, monkeypatch):
    """is_first_microbatch=False: the GEMM reuses the FP8 weight cast at the first micro-batch
    (linear.py v2.18 435-441); the quantizer's scale has moved on since."""
    pt = te_standin.install(monkeypatch, "2.18.0")
    torch.manual_seed(0)
    lin = pt.Linear(16, 16)
    rec = te_standin.DelayedScaling(amax_history_len=4)
    calls = iter([True, False, False])
    df, states, _ = train(pt, nn.Sequential(lin), rec, tmp_path,
                          forward=lambda m: m[0](torch.randn(8, 16, requires_grad=True), is_first_microbatch=next(calls)))
    cached = float(lin._fp8_workspaces["weight"]._scale_inv.reciprocal())
    assert cached == 1.0  # cast at step 0, before any update
    for step in (1, 2):
        assert float(states[step][0][("0", "scaling_fwd")][0][1]) != cached  # TE's state has moved on
        assert row(df, step, "0", "weight").scale == cached


def test_split_qkv_weights_are_one_tensor_under_one_scale(tmp_path, monkeypatch):
    """MultiheadAttention's default fuse_qkv_params=False: query/key/value weights, concatenated before
    one quantization (layernorm_linear.py v2.18 1859): one row whose amax covers all three."""
    pt = te_standin.install(monkeypatch, "2.18.0")
    torch.manual_seed(0)
    qkv = pt.LayerNormLinear(16, 48, parameters_split={"query": 16, "key": 16, "value": 16})
    with torch.no_grad():
        qkv.value_weight.mul_(5.0)
    assert not hasattr(qkv, "weight")
    df, states, _ = train(pt, nn.Sequential(qkv), te_standin.DelayedScaling(amax_history_len=4), tmp_path, steps=2)
    w = row(df, 1, "0", "weight")
    assert w.amax == pytest.approx(float(torch.cat([qkv.query_weight, qkv.key_weight, qkv.value_weight]).detach().abs().max()))
    assert w.numel == 48 * 16 and w.scale == float(states[1][0][("0", "scaling_fwd")][0][1])


@pytest.mark.parametrize("version", ["2.0.0", "2.3.0", "2.18.0"])
def test_grouped_linear_slots_blocked_then_interleaved(tmp_path, monkeypatch, version):
    pt = te_standin.install(monkeypatch, version)
    torch.manual_seed(0)
    grouped = pt.GroupedLinear(3, 16, 8)
    splits = [2, 5, 1]
    df, states, _ = train(pt, nn.Sequential(grouped), te_standin.DelayedScaling(amax_history_len=4), tmp_path,
                          forward=lambda m: m[0](torch.randn(8, 16, requires_grad=True) * torch.tensor([1.0, 3, 3, 3, 3, 3, 9, 9]
                                                                                                  ).unsqueeze(1), splits))
    v = tuple(int(p) for p in version.split(".")[:2])
    for i in range(3):
        a, w, g = te_standin.grouped_slots(v, i, 3)
        before, after = states[2]
        for tensor, key, slot in (("activation", "scaling_fwd", a), ("weight", "scaling_fwd", w),
                                  ("gradient", "scaling_bwd", g)):
            r = row(df, 2, f"0.gemm{i}", tensor)
            assert r.scale == float(before[("0", key)][0][slot]), (i, tensor)
            assert r.amax == pytest.approx(float(after[("0", key)][1][-1, slot]), rel=1e-6), (i, tensor)


# ---- current scaling: buffers up to 2.15, measured from the tensor from 2.16 --------------------
@pytest.mark.parametrize("version", ["2.8.0", "2.16.0", "2.20.0.dev0"])
def test_current_scaling_rows_follow_te_with_power_of_two_scales(tmp_path, monkeypatch, version):
    pt = te_standin.install(monkeypatch, version)
    torch.manual_seed(0)
    model = nn.Sequential(pt.Linear(16, 16), pt.LayerNormLinear(16, 16), pt.LayerNormMLP(16, 32))
    seen = {}

    def forward(m):
        x = torch.randn(8, 16, requires_grad=True) * 3.7
        seen["x"] = x
        return m(x)

    df, _, warned = train(pt, model, te_standin.Float8CurrentScaling(use_power_2_scales=True), tmp_path, steps=2,
                          forward=forward)
    last = df[df.step == 1]
    assert (np.log2(last.scale) == np.round(np.log2(last.scale))).all()  # TE's pow2: the mantissa cleared
    x = seen["x"]
    r = row(df, 1, "0", "activation")
    assert r.scale == compute_scale_from_amax(te_amax(x), 448.0, True, 0.0)
    # the LayerNorm output TE quantizes: buffers up to 2.15, recomputed from the input after
    ln_in = model[0](x).detach()
    ln_out = te_standin._norm(model[1], ln_in)
    r = row(df, 1, "1", "activation")
    assert r.scale == compute_scale_from_amax(te_amax(ln_out), 448.0, True, 0.0)
    assert r.amax == pytest.approx(te_amax(ln_out), rel=1e-6)
    has_buffers = version.startswith("2.8")
    assert (len(last[(last.layer == "2.fc2") & (last.tensor == "activation")]) == 1) == has_buffers
    if not has_buffers:  # fc2's input exists only inside TE's kernels: no row, said once
        assert any("LayerNormMLP's fc2 input" in w for w in warned)


def test_te_scale_rule_matches_te_on_adversarial_amaxes():
    """compute_scale_from_amax (recipe_common.cuh 14-49): epsilon, 0/Inf/NaN, overflow, pow2."""
    amaxes = [0.0, 1e-45, 1e-40, 1e-38, 1.0, 3.0, 447.99, 448.0, 449.0, 3e38, math.inf, math.nan, 2.0 ** -20,
              2.0 ** 20 * (1 - 2.0 ** -24)]
    rng = np.random.default_rng(0)
    amaxes += [float(np.float32(v)) for v in 10.0 ** rng.uniform(-44, 38, 300)]
    t = torch.tensor(amaxes, dtype=torch.float32)
    for fmax in (448.0, 57344.0):
        for pow2 in (False, True):
            for eps in (0.0, 1e-12):
                got = te_scale_from_amax(t, fmax, pow2=pow2, epsilon=eps).tolist()
                want = [compute_scale_from_amax(a, fmax, pow2, eps) for a in amaxes]
                assert got == want, [(a, g, w) for a, g, w in zip(amaxes, got, want) if g != w][:5]
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    got = te_scale_from_amax(torch.tensor([1e-45]), 448.0, value_for_inf=bf16_max)
    assert float(got) == compute_scale_from_amax(1e-45, 448.0, False, 0.0, bf16_max)


# ---- MXFP8 and Float8BlockScaling -------------------------------------------------------------
def test_e8m0_codes_round_up_as_te_does():
    rcp = struct.unpack("<f", struct.pack("<f", 1 / 448))[0]  # TE's max_norm_rcp, a float
    vals = [0.0, 1e-45, 2.0 ** -127, 2.0 ** -126, 3e-39, 1.0, 2.0, 2.0 * (1 + 2.0 ** -23), 448.0, 448.0 * 2 ** 10,
            448.0 * 2 ** 10 * (1 + 2.0 ** -23), 3.4e38, math.inf, math.nan]
    rng = np.random.default_rng(1)
    vals += [float(np.float32(v)) for v in 10.0 ** rng.uniform(-40, 38, 500)]
    products = [struct.unpack("<f", struct.pack("<f", v * rcp))[0] if math.isfinite(v * rcp) else v * rcp
                for v in vals]
    got = e8m0_codes(torch.tensor(vals, dtype=torch.float32) * torch.tensor(rcp)).tolist()
    assert got == [float_to_e8m0(p) for p in products]
    # just above a power of two: one binade up (log2 in float32 rounds these to the power itself)
    assert e8m0_codes(torch.tensor([2.0 ** 20 * (1 + 2.0 ** -23)])).item() == 127 + 21


def test_mxfp8_blocks_rowwise_columnwise_and_zero_blocks():
    x = torch.zeros(64, 64)
    x[0, :32] = torch.linspace(-3, 5, 32)
    x[32:, 1] = 1000.0
    row = mxfp8_blocks(x, E4M3)
    col = mxfp8_blocks(x, E4M3, columnwise=True)
    assert row.x.shape == (128, 32) and col.x.shape == (128, 32)
    # block 0 (row 0, cols 0-31): amax 5 -> 5/448 rounds up to 2^-6: decode 2^-6, encode 2^6
    assert float(row.scale_inv[0]) == 2.0 ** -6 and float(row.scale[0]) == 2.0 ** 6
    assert float(row.scale_inv[1]) == 2.0 ** -127  # an all-zero block stores code 0
    assert float(row.scale[1]) == 2.0 ** 127
    assert float(mxfp8_blocks(x, E4M3, code0_multiplies_by_one=True).scale[1]) == 1.0  # TE < 2.13
    # columnwise: 32 rows of one column share a scale; column 1, rows 32-63 holds 1000
    assert float(col.amax.max()) == 1000.0 and int((col.amax == 1000.0).sum()) == 1
    assert torch.all(row.amax * row.scale <= 448.0)


def test_float8_block_scaling_blocks_128x128_for_weights_1x128_otherwise():
    w = torch.randn(256, 384)
    w[200, 300] = 50.0
    tiles = fp8_block_scaling_blocks(w, E4M3, block_dim=2)
    assert tiles.x.shape == (6, 128 * 128) and tiles.scale.shape == (6, 1)
    assert float(tiles.amax[1 * 3 + 2]) == 50.0  # tile (1, 2)
    assert float(tiles.scale[5]) == compute_scale_from_amax(50.0, 448.0, True, 0.0)
    act = fp8_block_scaling_blocks(w, E4M3, block_dim=1)
    assert act.x.shape == (256 * 3, 128)
    colw = fp8_block_scaling_blocks(w, E4M3, block_dim=1, columnwise=True)
    assert colw.x.shape == (2 * 384, 128)
    odd = fp8_block_scaling_blocks(torch.randn(5, 200), E4M3, block_dim=1)
    assert odd.x.shape == (1000, 1)  # sides that do not divide: one element per row, no padding counted


@pytest.mark.parametrize("recipe_name", ["MXFP8BlockScaling", "Float8BlockScaling"])
def test_block_recipes_log_rowwise_and_columnwise_rows(tmp_path, monkeypatch, recipe_name):
    pt = te_standin.install(monkeypatch, "2.18.0")
    torch.manual_seed(0)
    lin = pt.Linear(128, 256)
    rec = getattr(te_standin, recipe_name)()
    df, _, _ = train(pt, nn.Sequential(lin), rec, tmp_path, steps=1,
                     forward=lambda m: m(torch.randn(64, 128, requires_grad=True)))
    tensors = set(df.tensor)
    assert {"activation", "activation@columnwise", "gradient", "gradient@columnwise", "weight"} <= tensors
    assert ("weight@columnwise" in tensors) == (recipe_name == "MXFP8BlockScaling")  # 128x128: one set of scales
    assert set(df.source) == {"te"} and (np.log2(df.scale) == np.round(np.log2(df.scale))).all()
    assert (df.overflow == 0).all()  # block scales never saturate their block's amax
    w = row(df, 0, "0", "weight")
    assert w.numel == 256 * 128
    if recipe_name == "Float8BlockScaling":  # 128x128 tiles: the row's scale is its most conservative tile
        tiles = fp8_block_scaling_blocks(lin.weight.detach(), E4M3, block_dim=2)
        assert w.scale == float(tiles.scale.min())


# ---- NVFP4 ------------------------------------------------------------------------------------
def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _e4m3(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32).clamp(max=448.0).to(torch.float8_e4m3fn).float())


def te_nvfp4_block_scale(block_amax: float, tensor_amax: float, divide_first: bool) -> float:
    """A block's E4M3 decode scale, transcribed: ``S_enc = 448 * 6 / amax``, then
    ``block_amax / 6.0f * S_enc`` (``util/nvfp4_transpose.cuh`` v2.8 124; ``core_nvfp4.cuh`` v2.12-2.13 50)
    or ``block_amax * (S_enc * (1.0f / 6.0f))`` (``core_nvfp4.cuh`` v2.14+ 51), each product in float32."""
    s_enc = _f32(_f32(448.0 * 6.0) / tensor_amax)
    prod = _f32(_f32(block_amax / 6.0) * s_enc) if divide_first else _f32(block_amax * _f32(s_enc * _f32(1.0 / 6.0)))
    return _e4m3(prod)


@pytest.mark.parametrize("divide_first", [True, False])
def test_nvfp4_block_scale_formula_of_each_version(divide_first):
    """A block amax whose scaled value is 42 (between the E4M3 codes 40 and 44) in one formula and 42 plus
    one ulp in the other: TE 2.8-2.13 and 2.14+ store different block scales for it."""
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 3.0, 0.28125  # the tensor amax 3 sets S_enc; row 1 is the block in question
    b = nvfp4_blocks(x, divide_first=divide_first)
    s_enc = _f32(_f32(448.0 * 6.0) / 3.0)
    stored = float(b.scale_inv[1, 0]) * s_enc  # the decode factor is s_block / S_enc
    assert stored == pytest.approx(te_nvfp4_block_scale(0.28125, 3.0, divide_first), rel=1e-6)
    assert {te_nvfp4_block_scale(0.28125, 3.0, d) for d in (True, False)} == {40.0, 44.0}


NVFP4_VERSIONS = [("2.8.0", True), ("2.12.0", True), ("2.14.0", False), ("2.18.0", False)]


@pytest.mark.parametrize("version,divide_first", NVFP4_VERSIONS)
def test_nvfp4_rows_follow_te_usages(tmp_path, monkeypatch, version, divide_first):
    """TE's NVFP4 Linear (``pytorch/module/linear.py`` with ``NVFP4Quantizer``): the input and the output
    gradient rowwise in 1x16 blocks and columnwise after the random Hadamard transform along the tokens
    (a tensor amax of its own); the weight in 16x16 tiles that serve both GEMMs (one row)."""
    pt = te_standin.install(monkeypatch, version)
    torch.manual_seed(0)
    lin = pt.Linear(128, 256)
    x = torch.randn(64, 128) * torch.linspace(0.01, 3, 128)  # channels of very different ranges
    x[5, 7] = 40.0
    df, _, msgs = train(pt, nn.Sequential(lin), te_standin.NVFP4BlockScaling(), tmp_path, steps=1,
                        forward=lambda m: m(x.clone().requires_grad_(True)))
    assert not [m for m in msgs if "not read" in m]
    assert set(df.tensor) == {"activation", "activation@columnwise", "gradient", "gradient@columnwise", "weight"}
    assert set(df.fp8_format) == {"e2m1"} and set(df.source) == {"te"}
    act, col = row(df, 0, "0", "activation"), row(df, 0, "0", "activation@columnwise")
    rowwise = nvfp4_blocks(x, divide_first=divide_first)
    assert act.amax == 40.0 and act.numel == x.numel()
    assert act.scale == pytest.approx(float(rowwise.scale.min()), rel=1e-6)
    assert col.amax == pytest.approx(float(rht16(x).abs().max()), rel=1e-6) and col.amax < act.amax  # mixed by H
    w = row(df, 0, "0", "weight")
    assert w.scale == pytest.approx(float(nvfp4_blocks(lin.weight.detach(), block_2d=True,
                                                       divide_first=divide_first).scale.min()), rel=1e-6)
    assert act.underflow > 0  # E2M1 flushes the quiet channels of a block that holds the outlier
    assert row(df, 0, "0", "gradient").numel == 64 * 256


@pytest.mark.parametrize("version,divide_first", NVFP4_VERSIONS)
def test_nvfp4_rows_use_the_block_scale_formula_of_the_installed_version(tmp_path, monkeypatch, version,
                                                                           divide_first):
    """Blocks whose scale is 40 under TE 2.8-2.13's formula and 44 under 2.14+'s (see above): the logged
    quantization error is the installed version's."""
    from fp8scope.emulate.recipe_table import E2M1, quantize

    x = torch.zeros(16, 16)
    x[0, 0] = 3.0
    x[1:, 0], x[1:, 1] = 0.28125, 0.1

    def mse(first):
        b = nvfp4_blocks(x, divide_first=first)
        return float(((b.unview(quantize(b, E2M1)[1]).reshape(x.shape) - x) ** 2).mean())

    assert mse(True) != pytest.approx(mse(False), rel=1e-3)
    pt = te_standin.install(monkeypatch, version)
    df, _, _ = train(pt, nn.Sequential(pt.Linear(16, 16)), te_standin.NVFP4BlockScaling(), tmp_path, steps=1,
                     forward=lambda m: m(x.clone().requires_grad_(True)))
    assert row(df, 0, "0", "activation").qerr_mse == pytest.approx(mse(divide_first), rel=1e-5)


def test_nvfp4_switches_are_read_from_the_recipe(tmp_path, monkeypatch):
    pt = te_standin.install(monkeypatch, "2.18.0")
    torch.manual_seed(0)
    lin = pt.Linear(32, 48)
    x = torch.randn(32, 32)
    rec = te_standin.NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True)
    df, _, _ = train(pt, nn.Sequential(lin), rec, tmp_path, steps=1, forward=lambda m: m(x.clone().requires_grad_(True)))
    assert "weight@columnwise" in set(df.tensor)  # 1x16 blocks: the transposed weight has scales of its own
    act, col = row(df, 0, "0", "activation"), row(df, 0, "0", "activation@columnwise")
    assert col.amax == act.amax  # no transform: the columnwise copy holds the same values


def test_nvfp4_cheap_steps_log_the_amax_and_scales_without_quantizing(tmp_path, monkeypatch):
    pt = te_standin.install(monkeypatch, "2.18.0")
    torch.manual_seed(0)
    x = torch.randn(32, 32)
    df, _, _ = train(pt, nn.Sequential(pt.Linear(32, 48)), te_standin.NVFP4BlockScaling(), tmp_path, steps=2, every=2,
                     forward=lambda m: m(x.clone().requires_grad_(True)))
    full, cheap = row(df, 0, "0", "activation"), row(df, 1, "0", "activation")
    assert full.full and not cheap.full and np.isnan(cheap.underflow)
    assert cheap.amax == full.amax == float(x.abs().max()) and cheap.scale == full.scale


@pytest.mark.parametrize("option", [dict(row_scaled_activation=True), dict(nvfp4_4over6="all")])
def test_nvfp4_options_not_read_warn_and_log_nothing(tmp_path, monkeypatch, option):
    pt = te_standin.install(monkeypatch, "2.18.0")
    df, _, msgs = train(pt, nn.Sequential(pt.Linear(16, 16)), te_standin.NVFP4BlockScaling(**option), tmp_path,
                        steps=2)
    assert len([m for m in msgs if "NVFP4 with" in m and "not read" in m]) == 1
    assert df.empty


# ---- recipes fp8scope does not read, and versions it has not read ----------------------------
@pytest.mark.parametrize("recipe_name", ["CustomRecipe"])
def test_recipes_that_are_not_per_tensor_fp8_warn_and_log_nothing(tmp_path, monkeypatch, recipe_name):
    pt = te_standin.install(monkeypatch, "2.12.0")
    lin = nn.Sequential(pt.Linear(16, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8scope.Monitor(lin, tmp_path, every=1, detect=False) as mon:
            for _ in range(2):
                with pt.fp8_autocast(enabled=True, fp8_recipe=getattr(te_standin, recipe_name)()):
                    y = lin(torch.randn(4, 16, requires_grad=True))
                y.sum().backward()
                mon.step()
    msgs = [str(w.message) for w in caught if recipe_name in str(w.message)]
    assert len(msgs) == 1 and "not read" in msgs[0]
    assert fp8scope.load_run(tmp_path).tensors().empty


def test_a_version_outside_the_read_range_is_said(tmp_path, monkeypatch):
    pt = te_standin.install(monkeypatch, "3.1.0")
    with pytest.warns(RuntimeWarning, match="Transformer Engine 3.1"):
        with fp8scope.Monitor(nn.Sequential(pt.Linear(16, 16)), tmp_path, every=1, detect=False):
            pass


def test_the_gpu_self_check_passes_on_a_stand_in_and_catches_a_wrong_scale(tmp_path, monkeypatch):
    """examples/te_hopper.py --check (run on a GPU by tests/test_integrations_te.py) checks the rows
    against TE's state with the installed version's slots: its checker, run here on a stand-in."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("te_hopper", Path(__file__).parents[1] / "examples" / "te_hopper.py")
    te_hopper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(te_hopper)
    pt = te_standin.install(monkeypatch, "2.3.0")
    torch.manual_seed(0)
    model = nn.Sequential(pt.LayerNormLinear(16, 16), pt.LayerNormMLP(16, 32))
    df, states, _ = train(pt, model, te_standin.DelayedScaling(amax_history_len=4), tmp_path, steps=3)
    assert te_hopper.check_run("delayed", model, df, states) == []
    wrong = df.copy()
    wrong.loc[(wrong.layer == "1.fc2") & (wrong.tensor == "gradient") & (wrong.step == 2), "scale"] = 3.0
    assert any("1.fc2 gradient step 2" in p for p in te_hopper.check_run("delayed", model, wrong, states))


# ---- the run's recipe ---------------------------------------------------------------------------
@pytest.mark.parametrize("recipe, manifest_recipe", [
    (lambda: te_standin.DelayedScaling(margin=1, amax_history_len=16),
     {"kind": "delayed", "fp8_format": "HYBRID", "margin": 1, "amax_history_len": 16, "amax_compute_algo": "max"}),
    (lambda: te_standin.Float8CurrentScaling(), {"kind": "current", "fp8_format": "HYBRID"}),
    (lambda: te_standin.MXFP8BlockScaling(), {"kind": "mxfp8", "fp8_format": "E4M3"}),
    (lambda: te_standin.Float8BlockScaling(), {"kind": "block128", "fp8_format": "E4M3"}),
])
def test_a_te_runs_manifest_and_report_name_its_recipe(tmp_path, monkeypatch, recipe, manifest_recipe):
    """TE layers carry no recipe of their own (it comes with ``fp8_autocast``): the adapter reads it at
    the first forward and the run's manifest names it, so the report's recipe line and its advice (a
    delayed recipe's margin and history, a block recipe's confined outliers) are the run's, not those
    of a run without a recipe."""
    from fp8scope.detect.analysis import analysis

    pt = te_standin.install(monkeypatch, "2.18.0")
    torch.manual_seed(0)
    train(pt, nn.Sequential(pt.Linear(128, 128), pt.LayerNormMLP(128, 256)), recipe(), tmp_path, steps=2,
          forward=lambda m: m(torch.randn(64, 128, requires_grad=True)))
    run = fp8scope.load_run(tmp_path)
    assert run.manifest["recipe"] == manifest_recipe
    # and each tensor's rows and manifest entry, a LayerNormMLP's two GEMMs too (the detector reads a
    # block recipe's per-block scales there)
    rows = run.tensors()
    assert set(rows["layer"]) == {"0", "1.fc1", "1.fc2"} and set(rows["recipe"]) == {manifest_recipe["kind"]}
    assert {t["recipe"] for t in run.manifest["tensors"]} == {manifest_recipe["kind"]}
    _, rep = analysis(tmp_path)
    assert rep["recipe"] == manifest_recipe
