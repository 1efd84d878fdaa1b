"""One registry of linear layers (fp8scope.linear_like): transformers' Conv1D, tensor-parallel
wrappers, classes named *Linear, registered classes; and the warning for what nobody claims."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8scope
from fp8scope.emulate import Fp8Linear, convert_to_fp8
from fp8scope.linear_like import _registered, linear_kind

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D


class ColumnParallelLinear(nn.Module):
    """Shaped like Megatron-LM's (megatron/core/tensor_parallel/layers.py): an nn.Module holding a
    [out, in] weight shard, calling F.linear, returning (output, bias) when the bias is skipped."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class FusedDenseLinear(nn.Module):
    """Another library's linear, weight stored [in, out]: recognised by name, orientation inferred."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in ** 0.5)

    def forward(self, x):
        return x @ self.weight


class Projector(nn.Module):
    """A GEMM layer nothing recognises."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        return x @ self.weight


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Embedding(10, d)
        self.col = ColumnParallelLinear(d, 2 * d)
        self.fused = FusedDenseLinear(2 * d, 24)
        self.conv = Conv1D(d, 24)  # nf=16 out, nx=24 in: weight [24, 16]
        self.proj = Projector(d)

    def forward(self, x):
        out, bias = self.col(x)
        return self.proj(self.conv(self.fused(torch.relu(out + bias))))


def test_kinds():
    net = Net()
    assert linear_kind(net.col).name == "tensor-parallel linear"
    assert linear_kind(net.fused).layout == "infer"
    assert linear_kind(net.conv).layout == "in_out" and linear_kind(net.conv).convertible
    assert linear_kind(net.proj) is None and linear_kind(net.emb) is None
    assert linear_kind(nn.Linear(2, 3)).convertible and not linear_kind(Fp8Linear(2, 3)).convertible
    x = torch.randn(3, 32)
    assert linear_kind(net.fused).weight(net.fused, x).shape == (24, 32)  # read as [out, in]
    assert linear_kind(net.conv).weight(net.conv).shape == (16, 24)


def test_monitor_captures_every_linear_like_and_names_what_it_skips(tmp_path):
    torch._dynamo.reset()  # compiled code of an earlier test would add the monitor's warning about it
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 16, requires_grad=True)
    grads = {}
    net.col.register_full_backward_hook(lambda m, gi, go: grads.__setitem__("col", go[0].detach().clone()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(net, tmp_path, every=1)
    msgs = [str(w.message) for w in caught if "fp8scope" in str(w.message)]
    assert len(msgs) == 1 and "proj (Projector)" in msgs[0] and "emb" not in msgs[0]
    assert mon.layers == ["col", "fused", "conv"]
    net(x).sum().backward()
    mon.step()
    mon.close()
    df = fp8scope.load_run(tmp_path).tensors()
    assert len(df) == 9
    row = df.set_index(["layer", "tensor"])
    assert row.loc[("col", "gradient"), "amax"] == pytest.approx(float(grads["col"].abs().max()), rel=1e-6)
    assert row.loc[("conv", "weight"), "amax"] == pytest.approx(float(net.conv.weight.detach().abs().max()), rel=1e-6)
    shapes = {(t["layer"], t["tensor"]): t["shape"] for t in fp8scope.load_run(tmp_path).manifest["tensors"]}
    assert shapes[("conv", "weight")] == [16, 24] and shapes[("fused", "weight")] == [24, 32]


def test_register_linear_like(tmp_path):
    torch.manual_seed(0)
    net = Net()
    try:
        fp8scope.register_linear_like(Projector, layout="in_out")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing left unclaimed: no warning
            mon = fp8scope.Monitor(net, tmp_path, every=1)
        assert "proj" in mon.layers
        net(torch.randn(4, 16)).sum().backward()
        mon.step()
        mon.close()
    finally:
        _registered.clear()
    with pytest.raises(ValueError):
        fp8scope.register_linear_like(Projector, layout="sideways")


def test_monitor_of_compiled_tuple_returning_layer_logs_the_eager_rows(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential()
    net.col = ColumnParallelLinear(16, 8)

    def run(path, compiled):
        torch.manual_seed(1)
        model = torch.compile(net) if compiled else net
        with fp8scope.Monitor(model, path, every=1) as mon:
            for _ in range(2):
                out, bias = model(torch.randn(4, 16))
                (out + bias).pow(2).sum().backward()
                mon.step()
        return fp8scope.load_run(path).tensors().sort_values(["step", "layer", "tensor"]).reset_index(drop=True)

    eager, compiled = run(tmp_path / "e", False), run(tmp_path / "c", True)
    assert len(eager) == 6
    for col in ("amax", "scale", "numel"):
        assert eager[col].tolist() == pytest.approx(compiled[col].tolist(), rel=1e-6)


def test_convert_conv1d_matches_linear_and_keeps_its_parameter():
    torch.manual_seed(0)
    conv = Conv1D(24, 16)  # in 16, out 24: weight [16, 24]
    lin = nn.Linear(16, 24)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    model_c, model_l = nn.Sequential(conv), nn.Sequential(lin)
    param = conv.weight
    convert_to_fp8(model_c)
    convert_to_fp8(model_l)
    assert isinstance(model_c[0], Fp8Linear) and model_c[0].weight is param and model_c[0].weight_transposed
    assert model_c.state_dict()["0.weight"].shape == (16, 24)  # the checkpoint layout is unchanged
    for step in range(3):
        x = torch.randn(4, 5, 16) * (1 + step)
        yc, yl = model_c(x), model_l(x)
        assert torch.equal(yc, yl)
        yc.pow(2).sum().backward()
        yl.pow(2).sum().backward()
        assert torch.equal(param.grad, model_l[0].weight.grad.t())
        for role in ("activation", "weight", "gradient"):
            assert torch.equal(model_c[0].scaling_state(role).scale, model_l[0].scaling_state(role).scale)


def test_convert_warns_about_linear_layers_it_leaves():
    net = Net()
    with pytest.warns(RuntimeWarning, match=r"left 2 linear-like layer.*col \(ColumnParallelLinear\)"):
        convert_to_fp8(net)
    assert isinstance(net.conv, Fp8Linear) and isinstance(net.col, ColumnParallelLinear)
