"""Integrations on CPU: plain loop with checkpointing and torchao recipes (Transformer Engine, version
by version against stand-ins: tests/test_te_adapter.py; the real one on a GPU:
tests/test_integrations_te.py). The
Hugging Face and Lightning callbacks are tested on real models in tests/test_external_models.py."""

from __future__ import annotations

import warnings

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
