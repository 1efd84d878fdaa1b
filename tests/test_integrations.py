"""Integrations on CPU: plain loop with checkpointing, torchao recipes, and the Transformer Engine
adapter against a stand-in module (the real one needs CUDA: tests/test_integrations_te.py). The
Hugging Face and Lightning callbacks are tested on real models in tests/test_external_models.py."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import fp8scope
from tests.conftest import MLP


# ---- plain loop: gradient accumulation + activation checkpointing ------------------------
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("emulated", [False, True])
def test_checkpointed_forwards_are_counted_once(tmp_path, reentrant, emulated):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = MLP()
    if emulated:
        fp8scope.emulate.convert_to_fp8(m)
    with fp8scope.Monitor(m, tmp_path, every=1) as mon:
        for _ in range(2):
            for _ in range(3):  # micro-batches
                x = torch.randn(4, 16, requires_grad=True)
                h = checkpoint(lambda t: m.down(m.act(m.up(t))), x, use_reentrant=reentrant)
                m.head(h).sum().backward()
            mon.step()
    df = fp8scope.load_run(tmp_path).tensors()
    assert len(df) == 2 * 9
    assert (df["calls"] == 3).all()  # one capture per micro-batch, recomputation ignored
    act = df[(df.tensor == "activation") & (df.layer == "up")]
    assert (act["numel"] == 3 * 4 * 16).all()


# ---- torchao -----------------------------------------------------------------------------
def _torchao_mlp(recipe: str):
    """An MLP converted by torchao with one of its named recipes (emulated casts: runs on the CPU), and
    torchao's own ``tensor_to_scale`` to check scales against."""
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_utils import tensor_to_scale
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    cfg = Float8LinearConfig(**{**cfg.__dict__, "emulate": True})
    torch.manual_seed(0)
    m = MLP(d=16, h=32, out=16)
    convert_to_float8_training(m, config=cfg)
    return m, cfg, tensor_to_scale


def test_torchao_rowwise_with_gw_hp_and_scales_match_torchao(tmp_path):
    m, cfg, tensor_to_scale = _torchao_mlp("rowwise_with_gw_hp")
    x = torch.randn(8, 16)
    with fp8scope.Monitor(m, tmp_path, every=1) as mon:
        m(x).pow(2).mean().backward()
        mon.step()
    df = fp8scope.load_run(tmp_path).tensors()
    # activation, weight, gradient, and the weight's second cast (tensorwise, for the grad_input
    # GEMM); the weight-gradient GEMM runs in high precision: no cast there, no row
    assert set(df.source) == {"torchao"} and len(df) == 3 * 4
    assert set(df.tensor) == {"activation", "weight", "gradient", "weight@dim0"}
    w_gi = m.up.config.cast_config_weight_for_grad_input
    ref_w = tensor_to_scale(m.up.weight.detach(), w_gi.target_dtype or torch.float8_e4m3fn, reduce_amax=False,
                            scaling_granularity=w_gi.scaling_granularity,
                            round_scales_to_power_of_2=m.up.config.round_scales_to_power_of_2)
    assert df[(df.layer == "up") & (df.tensor == "weight@dim0")].iloc[0].scale == pytest.approx(float(ref_w))
    # the per-row scales torchao itself derives for the first layer's input: our row keeps the
    # most conservative (smallest) one
    cc = m.up.config.cast_config_input
    ref = tensor_to_scale(x, cc.target_dtype, reduce_amax=False, scaling_granularity=cc.scaling_granularity,
                          axiswise_dim=-1, round_scales_to_power_of_2=m.up.config.round_scales_to_power_of_2)
    row = df[(df.layer == "up") & (df.tensor == "activation")].iloc[0]
    assert row.scale == pytest.approx(float(ref.min()), rel=1e-6)
    assert row.amax == pytest.approx(float(x.abs().max()), rel=1e-6)
    assert (df.amax * df.scale <= df.fp8_max * (1 + 1e-6)).all()


@pytest.mark.parametrize("every", [1, 2])
def test_torchao_rowwise_logs_each_cast_of_a_role(tmp_path, every):
    """rowwise: torchao casts each role twice, along the two axes, with scales of their own
    (torchao/float8/float8_linear.py); each cast is a row, and its scale is torchao's."""
    m, cfg, tensor_to_scale = _torchao_mlp("rowwise")
    seen = {}
    m.down.register_full_backward_hook(lambda mod, gi, go: seen.__setitem__("g", go[0].detach().clone()))
    with fp8scope.Monitor(m, tmp_path, every=every) as mon:
        for _ in range(2):
            x = torch.randn(8, 16) * torch.linspace(0.1, 10, 16)  # columns of very different size
            m(x).pow(2).mean().backward()
            mon.step()
    df = fp8scope.load_run(tmp_path).tensors()
    assert set(df.tensor) == {"activation", "activation@dim1", "weight", "weight@dim0", "gradient", "gradient@dim1"}
    last = df[(df.step == 1) & (df.layer == "down")].set_index("tensor")
    pow2 = m.down.config.round_scales_to_power_of_2
    g = seen["g"]
    for name, dim in (("gradient", -1), ("gradient@dim1", 0)):
        c = cfg.cast_config_grad_output if dim == -1 else cfg.cast_config_grad_output_for_grad_weight
        ref = tensor_to_scale(g, c.target_dtype, reduce_amax=False, scaling_granularity=c.scaling_granularity,
                              axiswise_dim=dim, round_scales_to_power_of_2=pow2)
        assert last.loc[name, "scale"] == pytest.approx(float(ref.min()), rel=1e-6)
        assert last.loc[name, "amax"] == pytest.approx(float(g.abs().max()), rel=1e-6)


# ---- Transformer Engine adapter against a stand-in ----------------------------------------
class _FakeRecipe:
    def __init__(self, kind: str, margin: int = 0):
        self.kind, self.margin = kind, margin
        self.fp8_format = types.SimpleNamespace(name="HYBRID")

    def delayed(self): return self.kind == "delayed"
    def float8_current_scaling(self): return self.kind == "current"
    def mxfp8(self): return self.kind == "mxfp8"
    def float8_block_scaling(self): return False


def _fake_te(monkeypatch, kind: str):
    """A module tree shaped like transformer_engine.pytorch whose Linear keeps TE 2.x's state layout."""

    class Linear(nn.Linear):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fp8 = True
            fwd = types.SimpleNamespace(scale=torch.tensor([4.0, 2.0, 1.0]), amax_history=torch.zeros(4, 3))
            bwd = types.SimpleNamespace(scale=torch.tensor([8.0, 1.0]), amax_history=torch.zeros(4, 2))
            self.fp8_meta = {"recipe": _FakeRecipe(kind), "num_gemms": 1, "scaling_fwd": fwd, "scaling_bwd": bwd}
            q = types.SimpleNamespace(scale=torch.tensor([16.0]), amax=torch.tensor([0.0]))
            self.quantizers = {"scaling_fwd": [q, q, q], "scaling_bwd": [q, q]}

    class LayerNormMLP(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1_weight = nn.Parameter(torch.randn(2 * d, d))
            self.fc2_weight = nn.Parameter(torch.randn(d, 2 * d))
            self.fp8 = True
            fwd = types.SimpleNamespace(scale=torch.tensor([4.0, 2.0, 1.0, 3.0, 5.0, 1.0]),
                                        amax_history=torch.arange(24.0).reshape(4, 6))
            bwd = types.SimpleNamespace(scale=torch.tensor([8.0, 1.0, 6.0, 1.0]), amax_history=torch.ones(4, 4))
            self.fp8_meta = {"recipe": _FakeRecipe(kind), "num_gemms": 2, "scaling_fwd": fwd, "scaling_bwd": bwd}

        def forward(self, x):
            h = torch.nn.functional.layer_norm(x, x.shape[-1:]) @ self.fc1_weight.t()
            return torch.relu(h) @ self.fc2_weight.t()

    te_pkg = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.Linear, te_pt.LayerNormMLP = Linear, LayerNormMLP
    te_pkg.pytorch = te_pt
    monkeypatch.setitem(sys.modules, "transformer_engine", te_pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    return te_pt


@pytest.mark.parametrize("kind", ["delayed", "current", "mxfp8"])
def test_te_adapter_reads_te_state(tmp_path, monkeypatch, kind):
    te = _fake_te(monkeypatch, kind)
    torch.manual_seed(0)
    model = nn.Sequential(te.Linear(16, 16), te.LayerNormMLP(16))
    x = torch.randn(4, 16, requires_grad=True)
    with fp8scope.Monitor(model, tmp_path, every=1) as mon:
        assert mon.sources == {"te": 2}
        model(x).sum().backward()
        mon.step()
    df = fp8scope.load_run(tmp_path).tensors().set_index(["layer", "tensor"])
    assert set(df.source) == {"te"}
    lin_act = df.loc[("0", "activation")]
    assert lin_act.amax == pytest.approx(float(x.abs().max()))
    if kind == "delayed":
        assert lin_act.scale == 4.0 and df.loc[("0", "weight")].scale == 2.0
        # hidden tensors of the MLP: TE's amax history row 0, scale from fp8_meta
        assert df.loc[("1.fc2", "activation")].amax == 3.0 and df.loc[("1.fc2", "activation")].scale == 3.0
        assert df.loc[("1.fc2", "weight")].scale == 5.0
        assert df.loc[("1.fc2", "gradient")].scale == 6.0  # GRAD_OUTPUT2
        assert df.loc[("1.fc1", "gradient")].scale == 8.0  # GRAD_OUTPUT1, after the module's backward
    elif kind == "current":
        assert lin_act.scale == 16.0  # the quantizer's own buffer
        g = df.loc[("0", "gradient")]
        assert g.amax * g.scale == pytest.approx(57344.0)  # derived as TE does, E5M2 max
    else:
        w = df.loc[("0", "weight")]
        assert np.log2(w.scale) == np.round(np.log2(w.scale))  # E8M0 scales are powers of two
        assert w.overflow == 0


def test_block_scales_never_saturate_and_are_powers_of_two():
    from fp8scope.capture.adapters.te import block_scales
    from fp8scope.formats import get_format

    fmt = get_format("e4m3")
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 64)
    blocks, scale, amax = block_scales(x, fmt, 32, pow2=True)
    assert blocks.shape == (16, 32) and scale.shape == (16, 1)
    assert torch.all(amax * scale <= fmt.max) and torch.all(amax * scale > fmt.max / 2)
    assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))
