"""Tests for fp8scope.emulate: TE-faithful delayed scaling, quantization, Fp8Linear, conversion.

Expected scales are written out by hand (see docs/emulate.md for the rules) so a
change in semantics shows up as a failing number, not as a changed formula.
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from hypothesis import strategies as st
from torch import nn

from fp8scope.emulate import (
    CurrentScaling,
    DelayedScaling,
    Fp8Linear,
    ScalingState,
    convert_to_fp8,
    dequantize,
    fp8_disabled,
    quantize,
    recipe_from_dict,
)
from fp8scope.emulate.scaling import UpdateGroup
from fp8scope.formats import get_format

E4M3 = get_format("e4m3")
E5M2 = get_format("e5m2")
NAN, INF = float("nan"), float("inf")
FP32_MAX = torch.finfo(torch.float32).max


def run_sequence(state: ScalingState, amaxes):
    """Feed one-element tensors with the given amaxes; return (scales used, histories after)."""
    scales, histories = [], []
    for a in amaxes:
        s = state.begin(torch.tensor([a], dtype=torch.float32))
        scales.append(s.scale.item())
        histories.append(state.amax_history.tolist())
    return scales, histories


def same(a, b):
    """List equality where NaN == NaN."""
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


# --------------------------------------------------------------------------- recipes
def test_recipe_defaults_are_te_defaults():
    r = DelayedScaling()
    assert (r.margin, r.amax_history_len, r.amax_compute_algo, r.fp8_format) == (0, 1024, "max", "HYBRID")
    assert r.forward_format.name == "e4m3" and r.backward_format.name == "e5m2"
    assert DelayedScaling(fp8_format="e4m3").backward_format.name == "e4m3"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(amax_history_len=0),
        dict(amax_history_len=2.5),
        dict(amax_compute_algo="mean"),
        dict(fp8_format="E5M2"),
        dict(fp8_format="fp8"),
        dict(margin=-1),
        dict(margin=NAN),
    ],
)
def test_delayed_recipe_validation(kwargs):
    with pytest.raises(ValueError):
        DelayedScaling(**kwargs)


def test_recipe_dict_round_trip_and_frozen():
    from fp8scope.emulate import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

    for r in (DelayedScaling(margin=1, amax_history_len=16, amax_compute_algo="most_recent"), CurrentScaling("E4M3"),
              MXFP8BlockScaling(), Float8BlockScaling(), NVFP4BlockScaling(disable_rht=True)):
        d = json.loads(json.dumps(r.to_dict()))
        assert recipe_from_dict(d) == r
    assert DelayedScaling().to_dict()["kind"] == "delayed"
    assert CurrentScaling().to_dict()["kind"] == "current"
    assert MXFP8BlockScaling().to_dict() == {"kind": "mxfp8", "fp8_format": "E4M3"}
    with pytest.raises(ValueError):
        recipe_from_dict({"kind": "mxfp4"})  # not a recipe here
    with pytest.raises(ValueError):
        MXFP8BlockScaling(fp8_format="HYBRID")
    with pytest.raises(ValueError):
        recipe_from_dict({"kind": "delayed", "history": 3})
    with pytest.raises(Exception):
        DelayedScaling().margin = 2  # frozen


# --------------------------------------------------------------------------- delayed scaling
SEQ = [2, 8, 1, 1, 1, 0, NAN, 1]


@pytest.mark.parametrize(
    "margin, expected",
    [
        # scale used at each step; 448 = E4M3 max, margin m divides by 2**m.
        (0, [1.0, 224.0, 56.0, 56.0, 56.0, 448.0, 448.0, 448.0]),
        (1, [1.0, 112.0, 28.0, 28.0, 28.0, 224.0, 224.0, 224.0]),
    ],
)
def test_delayed_max_hand_sequence(margin, expected):
    st = ScalingState(DelayedScaling(amax_history_len=3, margin=margin, amax_compute_algo="max"), E4M3)
    scales, hist = run_sequence(st, SEQ)
    assert scales == expected
    # History after recording each step (row 0 = this step's amax). The roll by -1 with
    # row 0 zeroed happens at the next update; an amax of 0 does not roll (TE kernel_bulk).
    assert same(hist[0], [2, 0, 0])
    assert same(hist[1], [8, 0, 2])
    assert same(hist[2], [1, 2, 8])
    assert same(hist[3], [1, 8, 1])
    assert same(hist[4], [1, 1, 1])  # the 8 has left the window -> scale 448 at step 5
    assert same(hist[5], [0, 1, 1])
    # a tensor of one NaN: TE's amax (fmaxf from 0) ignores it, so 0 is recorded and nothing rolls
    assert same(hist[6], [0, 1, 1])
    assert same(hist[7], [1, 1, 1])


def test_nan_elements_are_ignored_by_the_recorded_amax():
    """TE reduces the amax with fmaxf: with x = [NaN, 3] the recorded amax is 3 and the next scale
    448 / 3, while the state's logged amax keeps the NaN (the monitor's row marks it)."""
    st = ScalingState(DelayedScaling(amax_history_len=4), E4M3)
    st.begin(torch.tensor([NAN, 3.0]))
    assert math.isnan(st.last_amax.item()) and st.amax_history.tolist() == [3.0, 0.0, 0.0, 0.0]
    assert st.begin(torch.tensor([1.0])).scale.item() == pytest.approx(448 / 3, rel=1e-7)
    assert not torch.isnan(st.amax_history).any()


@pytest.mark.parametrize(
    "margin, expected",
    [
        (0, [1.0, 224.0, 56.0, 448.0, 448.0, 448.0, 448.0, 448.0]),
        (1, [1.0, 112.0, 28.0, 224.0, 224.0, 224.0, 224.0, 224.0]),
    ],
)
def test_delayed_most_recent_hand_sequence(margin, expected):
    st = ScalingState(DelayedScaling(amax_history_len=3, margin=margin, amax_compute_algo="most_recent"), E4M3)
    seq = [2, 8, 1, 1, 1, 0, NAN, 1, 4]
    scales, _ = run_sequence(st, seq)
    assert scales == expected + [448.0 / 2**margin]  # step 8 uses most_recent=1 again
    # step 6 used the amax 0 of step 5 -> kept; step 7 used NaN -> kept.


def test_delayed_keeps_scale_on_zero_nan_inf():
    st = ScalingState(DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent"), E4M3)
    scales, _ = run_sequence(st, [4, 0, NAN, INF, 7])
    assert scales == [1.0, 112.0, 112.0, 112.0, 112.0]
    assert st.scale_kept.item() is True
    st.begin(torch.tensor([1.0]))  # applies the update from amax 7
    assert st.scale.item() == pytest.approx(64.0) and st.scale_kept.item() is False


def test_delayed_inf_in_history_freezes_scale_under_max():
    # fmaxf(x, inf) = inf: an Inf amax keeps the scale for as long as it stays in the window.
    st = ScalingState(DelayedScaling(amax_history_len=2), E4M3)
    scales, _ = run_sequence(st, [4, INF, 1, 1, 1])
    assert scales == [1.0, 112.0, 112.0, 112.0, 448.0]


def test_delayed_zero_amax_skips_roll():
    # TE skips the roll when this step's amax is 0, so the 8 ages more slowly.
    st = ScalingState(DelayedScaling(amax_history_len=2), E4M3)
    scales, _ = run_sequence(st, [8, 1, 0, 1, 1])
    assert scales == [1.0, 56.0, 56.0, 56.0, 448.0]


def test_delayed_tiny_amax_gives_fp32_max_scale():
    st = ScalingState(DelayedScaling(amax_history_len=1), E4M3)
    st.begin(torch.tensor([1e-45]))  # smallest float32 subnormal: 448 / amax overflows
    s = st.begin(torch.tensor([1.0]))
    assert s.scale.item() == FP32_MAX
    assert s.scale_inv.item() == pytest.approx(1 / FP32_MAX)


def test_e5m2_uses_its_own_max():
    st = ScalingState(DelayedScaling(amax_history_len=4), E5M2)
    scales, _ = run_sequence(st, [2.0, 1.0])
    assert scales == [1.0, E5M2.max / 2]


def test_returned_tensors_are_not_mutated_later():
    st = ScalingState(DelayedScaling(amax_history_len=2), E4M3)
    first = st.begin(torch.tensor([2.0]))
    second = st.begin(torch.tensor([8.0]))
    st.begin(torch.tensor([1.0]))
    st.begin(torch.tensor([1.0]))
    assert (first.scale.item(), first.scale_inv.item(), first.expected_amax.item()) == (1.0, 1.0, 448.0)
    assert (second.scale.item(), second.expected_amax.item()) == (224.0, 2.0)


def test_no_record_applies_pending_update_but_keeps_history():
    st = ScalingState(DelayedScaling(amax_history_len=2), E4M3)
    st.begin(torch.tensor([2.0]))
    s = st.begin(torch.tensor([100.0]), record=False)
    assert s.scale.item() == 224.0 and not st.pending
    assert st.amax_history.tolist() == [0.0, 2.0]


def test_current_scaling():
    st = ScalingState(CurrentScaling(), E4M3)
    s = st.begin(torch.tensor([-4.0, 2.0]))
    assert (s.scale.item(), s.expected_amax.item()) == (112.0, 4.0)
    for bad in (0.0, NAN, INF):
        s = st.begin(torch.tensor([bad]))
        assert s.scale.item() == 1.0  # TE compute_scale_from_amax
    assert st.begin(torch.tensor([1e-45])).scale.item() == FP32_MAX
    assert ScalingState(CurrentScaling(margin=2), E4M3).begin(torch.tensor([4.0])).scale.item() == 28.0


# --------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_saturates(fmt):
    x = torch.tensor([fmt.max * 1.5, -fmt.max * 4, 1e30, INF, -INF, NAN, 1.0])
    q = quantize(x, torch.tensor(1.0), fmt)
    assert q.dtype == fmt.dtype
    out = dequantize(q, torch.tensor(1.0))
    assert out[:5].tolist() == [fmt.max, -fmt.max, fmt.max, fmt.max, -fmt.max]
    assert math.isnan(out[5].item()) and out[6].item() == 1.0


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_underflow(fmt):
    sub = fmt.min_subnormal
    x = torch.tensor([sub * 0.49, sub * 0.5, sub * 0.51, sub, -sub * 0.49])
    out = dequantize(quantize(x, torch.tensor(1.0), fmt), torch.tensor(1.0))
    assert out.tolist() == [0.0, 0.0, sub, sub, 0.0]  # half-way rounds to even (0)


def test_quantize_applies_scale_in_fp32_for_bf16():
    x = torch.tensor([3.0, 300.0], dtype=torch.bfloat16)
    q = quantize(x, torch.tensor(0.5), E4M3)
    assert dequantize(q, torch.tensor(2.0)).tolist() == [3.0, 288.0]  # 150 -> 144 on the e4m3 grid
    assert dequantize(q, torch.tensor(2.0), torch.bfloat16).dtype == torch.bfloat16


# --------------------------------------------------------------------------- Fp8Linear
def _pair(recipe, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(16, 8, bias=bias, dtype=dtype)
    fp8 = Fp8Linear(16, 8, bias=bias, dtype=dtype, recipe=recipe)
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"])
def test_fp8_linear_close_to_linear(recipe):
    ref, fp8 = _pair(recipe)
    for _ in range(3):  # later steps use adapted delayed scales
        x = torch.randn(2, 5, 16)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y = ref(x1), fp8(x2)
        g = torch.randn_like(y_ref)
        y_ref.backward(g)
        y.backward(g)
        assert y.shape == (2, 5, 8)
        assert _rel(y, y_ref) < 0.08
        assert _rel(x2.grad, x1.grad) < 0.15
        assert _rel(fp8.weight.grad, ref.weight.grad) < 0.15
        torch.testing.assert_close(fp8.bias.grad, ref.bias.grad)  # bias grad in high precision
        for p in (*ref.parameters(), *fp8.parameters()):
            p.grad = None


def test_fp8_linear_bf16_dtypes():
    ref, fp8 = _pair(CurrentScaling(), dtype=torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    y = fp8(x)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == fp8.weight.grad.dtype == fp8.bias.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt_name, grad_fmt", [("HYBRID", "e5m2"), ("E4M3", "e4m3")])
def test_gradient_format_and_te_gemms(fmt_name, grad_fmt):
    _, fp8 = _pair(DelayedScaling(amax_history_len=2, fp8_format=fmt_name))
    seen = {}
    fp8.fp8scope_tap = lambda role, x, deq, scale, scale_inv, amax, fmt: seen.__setitem__(role, (deq, scale, fmt))
    x = torch.randn(3, 16, requires_grad=True)
    y = fp8(x)
    g = torch.randn_like(y) * 1e-3
    y.backward(g)
    assert seen["activation"][2].name == seen["weight"][2].name == "e4m3"
    g_deq, g_scale, g_fmt = seen["gradient"]
    assert g_fmt.name == grad_fmt and fp8.gradient_state.fmt.name == grad_fmt
    scaled = g_deq * g_scale  # back on the grid of the gradient's format
    assert torch.equal(scaled.to(g_fmt.dtype).float(), scaled)
    # TE: dgrad = deq(g) @ deq(W), wgrad = deq(g)^T @ deq(x)
    torch.testing.assert_close(x.grad, g_deq @ seen["weight"][0])
    torch.testing.assert_close(fp8.weight.grad, g_deq.t() @ seen["activation"][0])


def test_from_linear_shares_parameters_and_optimizer_keeps_working():
    lin = nn.Linear(16, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    fp8 = Fp8Linear.from_linear(lin, DelayedScaling(amax_history_len=16))
    assert fp8.weight is lin.weight and fp8.bias is lin.bias
    before = lin.weight.detach().clone()
    fp8(torch.randn(4, 16)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(before, fp8.weight)
    assert "amax_history_len=16" in repr(fp8)


def test_fp8_disabled_is_bit_identical_and_leaves_state():
    ref, fp8 = _pair(DelayedScaling(amax_history_len=4))
    model = nn.Sequential(fp8)
    fp8(torch.randn(4, 16)).sum().backward()  # some state to preserve
    snapshot = [(s.amax_history, s.scale, s.updates, s.pending) for s in (fp8.activation_state, fp8.weight_state, fp8.gradient_state)]
    for ctx in (lambda: fp8_disabled(model), lambda: fp8_disabled()):
        x = torch.randn(3, 16)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        with ctx():
            y = fp8(x2)
            y.sum().backward()
        y_ref = ref(x1)
        y_ref.sum().backward()
        assert torch.equal(y, y_ref) and torch.equal(x2.grad, x1.grad)
    after = [(s.amax_history, s.scale, s.updates, s.pending) for s in (fp8.activation_state, fp8.weight_state, fp8.gradient_state)]
    for (h0, s0, u0, p0), (h1, s1, u1, p1) in zip(snapshot, after):
        assert torch.equal(h0, h1) and torch.equal(s0, s1) and u0 == u1 and p0 == p1
    assert fp8.fp8_enabled


def test_fp8_disabled_restores_on_exception():
    model = convert_to_fp8(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(RuntimeError):
        with fp8_disabled(model), fp8_disabled():
            raise RuntimeError("boom")
    assert model[0].fp8_enabled
    x = torch.randn(2, 4)
    assert not torch.equal(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))


def test_no_grad_forward_records_into_the_next_update_without_making_one():
    """TE: a forward under no_grad records its amax (csrc/quantizer.cpp) but no update runs at the
    region's exit (quantization.py: only with grad enabled); the amax merges into the next update."""
    lin = Fp8Linear(1, 1, bias=False, recipe=DelayedScaling(amax_history_len=4))
    st = lin.activation_state

    def train(a: float) -> float:
        used = []
        lin.fp8scope_tap = lambda role, x, deq, scale, *_: role == "activation" and used.append(float(scale))
        lin(torch.tensor([[a]])).sum().backward()
        return used[0]

    assert train(2.0) == 1.0  # the initial scale
    with torch.no_grad():
        y = lin(torch.tensor([[8.0]]))  # applies step 1's update (448/2), records 8, updates nothing
    assert st.updates == 1 and st.pending and st.amax_history.tolist() == [8.0, 0.0, 0.0, 2.0]
    assert not torch.equal(y, nn.functional.linear(torch.tensor([[8.0]]), lin.weight))  # quantized
    assert train(1.0) == 224.0  # still step 1's scale; row 0 is now max(8, 1)
    assert st.amax_history.tolist() == [8.0, 0.0, 0.0, 2.0]
    assert train(1.0) == 56.0  # 448 / max(2, 8): the eval amax entered this update
    assert st.updates == 2


def test_tap_order_over_two_layers():
    model = convert_to_fp8(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), DelayedScaling(amax_history_len=4))
    calls = []
    for i in (0, 2):
        def tap(role, x, deq, scale, scale_inv, amax, fmt, i=i):
            assert x.shape == deq.shape and scale.ndim == 0
            calls.append((i, role))
        model[i].fp8scope_tap = tap
    model(torch.randn(3, 8)).sum().backward()
    assert calls == [(0, "activation"), (0, "weight"), (2, "activation"), (2, "weight"), (2, "gradient"), (0, "gradient")]


def _train(model, steps=30, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(64, 8)
    target = (x[:, :2] * 2 - x[:, 2:4]).detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


def test_tap_that_raises_does_not_break_training():
    model = convert_to_fp8(_mlp(), DelayedScaling(amax_history_len=16))

    def bad_tap(*args):
        raise KeyError("monitor bug")

    model[0].fp8scope_tap = bad_tap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _train(model, steps=5)
    assert sum("monitor bug" in str(w.message) for w in caught) == 1
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=16), CurrentScaling()], ids=["delayed", "current"])
def test_training_loop_loss_decreases(recipe):
    model = convert_to_fp8(_mlp(), recipe)
    losses = _train(model)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0]
    ref_losses = _train(_mlp())
    assert abs(losses[-1] - ref_losses[-1]) < 0.1 * ref_losses[0]  # tracks the high-precision run


# --------------------------------------------------------------------------- convert
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": nn.Linear(4, 4), "mlp": nn.Linear(4, 4)}) for _ in range(2)])
        self.lm_head = nn.Linear(4, 10)


def _fp8_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, Fp8Linear))


def test_convert_all_and_skip():
    net = _Net()
    w = net.lm_head.weight
    out = convert_to_fp8(net, skip=["lm_head"])
    assert out is net
    assert _fp8_names(net) == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    assert type(net.lm_head) is nn.Linear and net.lm_head.weight is w
    first = {n: m for n, m in net.named_modules() if isinstance(m, Fp8Linear)}
    convert_to_fp8(net)  # a second pass converts lm_head and keeps the converted layers as they are
    assert _fp8_names(net) == sorted([*first, "lm_head"])
    assert all(net.get_submodule(n) is m for n, m in first.items())


def test_convert_selection():
    assert _fp8_names(convert_to_fp8(_Net(), layers=r"\.mlp$")) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert _fp8_names(convert_to_fp8(_Net(), layers=["blocks.1.attn"])) == ["blocks.1.attn"]
    assert _fp8_names(convert_to_fp8(_Net(), layers="blocks", skip=r"attn")) == ["blocks.0.mlp", "blocks.1.mlp"]
    recipe = CurrentScaling()
    assert convert_to_fp8(_Net(), recipe=recipe).lm_head.recipe is recipe
    with pytest.raises(ValueError):
        convert_to_fp8(_Net(), layers="decoder")
    with pytest.raises(ValueError):
        convert_to_fp8(_Net(), layers=["lm_head", "no.such"])
    with pytest.raises(ValueError):
        convert_to_fp8(_Net(), skip=["head"])
    with pytest.raises(ValueError):
        convert_to_fp8(_Net(), layers="lm_head", skip="lm_head")
    assert isinstance(convert_to_fp8(nn.Linear(2, 2)), Fp8Linear)


def test_inference_mode_and_autocast():
    model = convert_to_fp8(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), DelayedScaling(amax_history_len=4))
    x = torch.randn(3, 8)
    model(x).sum().backward()
    with torch.inference_mode():
        model(x)  # applies the due update, records an amax that waits for the next one
    assert model[0].activation_state.updates == 1 and model[0].activation_state.pending
    for _ in range(2):  # state created/updated in inference mode stays usable
        model(x).sum().backward()
    assert model[0].gradient_state.updates == 2 and model[0].activation_state.updates >= 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    assert y.dtype == torch.bfloat16  # as nn.Linear under autocast


amax_values = st.one_of(
    st.sampled_from([0.0, NAN, INF, 1e-45, 1e-40, 3.0e38, FP32_MAX, 448.0, 1.0]),
    st.floats(1e-30, 1e30).map(lambda v: float(torch.tensor(v, dtype=torch.float32))),
)


def test_scale_is_a_true_float32_division():
    """TE computes max_fp8 / amax with one rounding; torch's `float / tensor` (reciprocal, then
    a multiply) is off by an ulp for about a quarter of amaxes."""
    import numpy as np

    amaxes = torch.rand(2000, generator=torch.Generator().manual_seed(0)) * 1000 + 1e-3
    st_ = ScalingState(CurrentScaling(), E4M3)
    got = torch.tensor([st_.begin(a.reshape(1)).scale.item() for a in amaxes])
    want = torch.from_numpy(np.float32(448.0) / amaxes.numpy())
    assert bool((got == want).all()), int((got != want).sum())


def test_current_scaling_scales_the_gradient_by_its_own_amax(tmp_path):
    """TE's current scaling quantizes each tensor with a scale from that tensor's own amax: the gradient
    too, although its scale cannot be known at forward time (the delayed-scaling path prepares it there)."""
    import fp8scope
    from fp8scope.emulate import CurrentScaling, Fp8Linear

    torch.manual_seed(0)
    layer = Fp8Linear(16, 8, recipe=CurrentScaling())
    model = torch.nn.Sequential(layer)
    seen = []
    layer.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].detach().clone()))
    with fp8scope.Monitor(model, tmp_path, every=1) as mon:
        for step in range(3):
            x = torch.randn(4, 16, requires_grad=True)
            (layer(x) * (10.0 ** -step)).sum().backward()  # gradients of very different sizes
            mon.step()
    g = fp8scope.load_run(tmp_path).tensors(tensor="gradient").sort_values("step")
    assert len(g) == len(seen) == 3
    fmax = layer.recipe.backward_format.max
    for (_, row), grad in zip(g.iterrows(), seen):
        assert row.scale == pytest.approx(fmax / float(grad.abs().max()), rel=1e-6)
        assert row.overflow == 0 and row.underflow / row.numel < 0.01


def test_batched_updates_give_each_state_its_own_sequence_of_scales():
    """Eagerly, the first state that needs its update applies those of every pending state of its
    kind in one batch. Each state must still see exactly the scales it would see alone: run five
    states interleaved (in a shuffled order each step, so different states trigger the batch) and
    each alone, on adversarial amaxes, and compare bit for bit."""
    import random

    rng = random.Random(0)
    pool = [0.0, NAN, INF, 1e-45, 1e-40, 3.0e38, FP32_MAX, 448.0, 1.0, 2.5e-3]
    seqs = [[rng.choice(pool) if rng.random() < 0.4 else rng.uniform(1e-3, 1e3) for _ in range(40)] for _ in range(5)]
    recipes = [DelayedScaling(amax_history_len=8, margin=m) for m in (0, 1, 0, 2, 0)]
    fmts = [E4M3, E4M3, E5M2, E5M2, E4M3]

    def make():
        return [ScalingState(r, f) for r, f in zip(recipes, fmts)]

    together, seen = make(), [[] for _ in seqs]
    group = UpdateGroup()
    for state in together:  # one model's states (alone is the default: the reference below)
        state.update_group = group
    for t in range(40):
        order = list(range(5))
        rng.shuffle(order)
        for i in order:
            seen[i].append(together[i].begin(torch.tensor([seqs[i][t]], dtype=torch.float32)).scale.item())
    for i, (state, seq) in enumerate(zip(make(), seqs)):
        assert same(run_sequence(state, seq)[0], seen[i]), i
        together[i].update()
        state.update()
        assert same(together[i].amax_history.tolist(), state.amax_history.tolist())


def _resumable(seed: int = 0, history: int = 4, recipe=None) -> nn.Sequential:
    torch.manual_seed(seed)
    return convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)),
                          recipe or DelayedScaling(amax_history_len=history))


def _sgd_steps(model: nn.Module, opt, xs) -> list[torch.Tensor]:
    outs = []
    for x in xs:
        y = model(x)
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    return outs


def test_a_checkpoint_keeps_the_scaling_state_and_a_resumed_run_goes_on_bit_for_bit(tmp_path):
    """TE's modules keep their scales and amax histories in a checkpoint (``get_extra_state``,
    ``pytorch/module/base.py``), so a resumed TE run quantizes its next step with the scales it had.
    An Fp8Linear's ``state_dict`` holds its three states the same way (``<layer>._extra_state``, a
    float32 tensor that ``torch.load(weights_only=True)`` reads): five steps, a checkpoint on disk, a
    model built with other weights that loads it, and five more steps give the uninterrupted run's
    outputs bit for bit, gradient history included (its row 0 waits for the next update). Without
    the state, the resumed run starts from scale 1 and differs."""
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) * (1 + i) for i in range(10)]
    straight = _resumable()
    reference = _sgd_steps(straight, torch.optim.SGD(straight.parameters(), 0.1), xs)

    first = _resumable()
    opt = torch.optim.SGD(first.parameters(), 0.1)
    _sgd_steps(first, opt, xs[:5])
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["model"]["0._extra_state"].shape == (3, 2 + 4)
    assert saved["model"]["0._extra_state"][2, 2] > 0  # the gradient's amax, recorded since its last update

    def resumed(model_state: dict) -> list[torch.Tensor]:
        model = _resumable(seed=5)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        model.load_state_dict(model_state)
        opt.load_state_dict(saved["opt"])
        return _sgd_steps(model, opt, xs[5:]), model

    outs, model = resumed(saved["model"])
    assert all(torch.equal(a, b) for a, b in zip(outs, reference[5:]))
    for layer, other in ((model[0], straight[0]), (model[2], straight[2])):
        for role in ("activation", "weight", "gradient"):
            ours, theirs = layer.scaling_state(role), other.scaling_state(role)
            assert torch.equal(ours.amax_history, theirs.amax_history) and torch.equal(ours.scale, theirs.scale)
    without, _ = resumed({k: v for k, v in saved["model"].items() if not k.endswith("_extra_state")})
    assert not all(torch.equal(a, b) for a, b in zip(without, reference[5:]))


def test_a_plain_checkpoint_loads_strictly_and_a_saved_history_fits_another_length():
    """Pretrained weights (the replaced ``nn.Linear``'s checkpoint) load under ``strict=True`` and
    leave the state as it is; a history saved at another ``amax_history_len`` keeps its pending row
    and its latest rows; a tensor of the wrong shape is one clear error; recipes that keep no state
    between steps save an empty one, as TE's."""
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    model = _resumable()
    model.load_state_dict(plain.state_dict(), strict=True)
    assert torch.equal(model[0].weight, plain[0].weight) and float(model[0].activation_state.scale) == 1.0

    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    _sgd_steps(model, torch.optim.SGD(model.parameters(), 0.1), xs)
    state = model.state_dict()["0._extra_state"]  # rows 1..3 hold three updates' amaxes, row 0 the pending one
    for length, kept in ((2, state[:, -1:]), (6, torch.cat([torch.zeros(3, 2), state[:, 3:]], 1))):
        other = _resumable(history=length)
        other.load_state_dict(model.state_dict())
        for i, role in enumerate(("activation", "weight", "gradient")):
            s = other[0].scaling_state(role)
            assert torch.equal(s.amax_history, torch.cat([state[i, 2:3], kept[i]])), (length, role)
            assert torch.equal(s.scale, state[i, 0]) and torch.equal(s.scale_inv, state[i, 0].reciprocal())
            assert torch.equal(s.expected_amax, state[i, 1])

    with pytest.raises(ValueError, match=r"\[3, 2 \+ amax_history_len\] tensor, got float32 of shape \[2, 6\]$"):
        _resumable().load_state_dict({**model.state_dict(), "0._extra_state": state[:2]})
    te = torch.frombuffer(bytearray(b"pickled"), dtype=torch.uint8)  # a TE checkpoint's extra state
    with pytest.raises(ValueError, match=r"got uint8 of shape \[7\] \(Transformer Engine's pickled"):
        _resumable().load_state_dict({**model.state_dict(), "0._extra_state": te})
    current = _resumable(recipe=CurrentScaling())
    assert current.state_dict()["0._extra_state"].numel() == 0
    current.load_state_dict(model.state_dict())  # a delayed-scaling state means nothing to current scaling


def test_a_training_step_updates_every_emulated_state_in_one_batch():
    """Four Fp8Linear layers hold twelve delayed-scaling states; an eager training step applies all
    their updates as one batch (one ``constant_pad_nd``: the history roll of ``delayed_update``),
    not twelve."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), DelayedScaling())
    x = torch.randn(8, 16)
    model(x).sum().backward()  # every state now has an update pending
    with Count() as c:
        model(x).sum().backward()
    assert c.ops.count("constant_pad_nd.default") == 1
    assert all(m.activation_state.updates == m.gradient_state.updates == 1 for m in model)


def test_a_repeated_batch_stacks_only_the_recorded_amaxes_and_restacks_a_changed_state():
    """A training loop updates the same states every step: the batch then reads the last batch's
    outputs, which the states hold as rows, and stacks only the amaxes recorded since (one stack
    instead of six). A state changed in between (a reset here) makes it stack again, and every
    state still sees the scales it would see alone, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Stacks(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.__name__ == "stack.default"
            return func(*args, **(kwargs or {}))

    rng = torch.Generator().manual_seed(0)
    amaxes = torch.rand(12, 4, generator=rng) * 100
    recipe = DelayedScaling(amax_history_len=4)
    together, alone = [ScalingState(recipe, E4M3) for _ in range(4)], [ScalingState(recipe, E4M3) for _ in range(4)]
    group = UpdateGroup()
    for state in together:
        group.join(state)
    stacks = []
    for t in range(12):
        if t == 6:  # one state starts over: its values are no longer the last batch's rows
            together[2].reset()
            alone[2].reset()
        with Stacks() as c:
            got = [s.begin(torch.tensor([float(a)])).scale.item() for s, a in zip(together, amaxes[t])]
        stacks.append(c.n)
        want = [s.begin(torch.tensor([float(a)])).scale.item() for s, a in zip(alone, amaxes[t])]
        assert got == want, t
    # step 0: nothing pending; 1: the first batch; 6: the three states the reset left pending; 7: all
    # four again (not the last batch's states); from then on the same batch
    assert stacks == [0, 6, 1, 1, 1, 1, 6, 6, 1, 1, 1, 1], stacks


def test_a_models_batched_update_leaves_other_models_alone():
    """Two models: training one must not apply the other's pending updates (its ``scale`` still
    says what its last step used, which the shadow's compare reads)."""
    torch.manual_seed(0)
    a = convert_to_fp8(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), DelayedScaling())
    b = copy.deepcopy(a)  # a copy gets a group of its own
    x = torch.randn(4, 8)
    a(x).sum().backward()
    b(x).sum().backward()
    b(x).sum().backward()
    assert all(m.activation_state.pending and m.activation_state.updates == 0 for m in a)
    assert all(m.activation_state.updates == 1 for m in b)


# ---- TE's update timing: autocast regions, repeated calls, eval forwards, recompute ------------
def _scales_used(layer: Fp8Linear, log: list) -> None:
    layer.fp8scope_tap = lambda role, x, deq, scale, scale_inv, amax, fmt: log.append((role, float(scale),
                                                                                        float(x.abs().max())))


def test_a_layer_run_twice_in_one_autocast_uses_one_scale_and_records_the_larger_amax():
    """TE (quantization.py, fp8_autocast exit): one forward update per outermost region, whatever the
    number of calls; row 0 keeps the max of the calls' amaxes (atomicMaxFloat); the backward
    records both gradients' amaxes into one update too."""
    from fp8scope.emulate import fp8_autocast

    torch.manual_seed(0)
    lin = convert_to_fp8(nn.Linear(8, 8, bias=False), DelayedScaling(amax_history_len=8))
    log: list = []
    _scales_used(lin, log)
    amax_rows = []
    for step in range(4):
        log.clear()
        with fp8_autocast():
            y = lin(lin(torch.randn(4, 8) * (step + 1)))
        y.sum().backward()
        acts = [(s, a) for role, s, a in log if role == "activation"]
        grads = [(s, a) for role, s, a in log if role == "gradient"]
        assert len(acts) == 2 and acts[0][0] == acts[1][0]  # one scale for both calls
        assert len(grads) == 2 and grads[0][0] == grads[1][0]
        amax_rows.append((max(a for _, a in acts), max(a for _, a in grads)))
    st_a, st_g = lin.activation_state, lin.gradient_state
    assert st_a.updates == 3 and st_g.updates == 3  # one per step (the 4th is pending)
    hist = st_a.amax_history.tolist()  # [row 0 = step 4, 0..., step 1, step 2, step 3]
    assert hist[0] == amax_rows[3][0] and hist[-3:] == [r[0] for r in amax_rows[:3]]
    assert st_g.amax_history.tolist()[-3:] == [r[1] for r in amax_rows[:3]]
    assert float(st_a.scale) == pytest.approx(448 / max(r[0] for r in amax_rows[:3]), rel=1e-7)


def test_outside_a_region_each_training_call_is_its_own_region():
    torch.manual_seed(0)
    lin = convert_to_fp8(nn.Linear(8, 8, bias=False), DelayedScaling(amax_history_len=8))
    log: list = []
    _scales_used(lin, log)
    lin(lin(torch.randn(4, 8))).sum().backward()
    acts = [s for role, s, _ in log if role == "activation"]
    assert acts[0] == 1.0 and acts[1] != 1.0  # the second call uses the first call's update


def test_a_no_grad_region_makes_no_update():
    from fp8scope.emulate import fp8_autocast

    lin = convert_to_fp8(nn.Linear(4, 4), DelayedScaling(amax_history_len=4))
    with torch.no_grad(), fp8_autocast():
        lin(torch.ones(2, 4))
        lin(torch.ones(2, 4))
    assert lin.activation_state.updates == 0 and lin.activation_state.pending
    with fp8_autocast(enabled=False):
        x = torch.randn(2, 4)
        assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_changes_nothing(reentrant):
    """A forward re-run by torch.utils.checkpoint quantizes with its first run's scales and records
    nothing (TE stashes and restores around the recompute): gradients, losses and every scale are
    bit-identical to the same training without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    def run(ckpt: bool):
        torch.manual_seed(0)
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(3))
        convert_to_fp8(blocks, DelayedScaling(amax_history_len=4))
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        out = []
        for step in range(4):
            x = torch.randn(8, 16, requires_grad=reentrant) * (1 + step)
            for b in blocks:
                x = x + (checkpoint(b, x, use_reentrant=reentrant) if ckpt else b(x))
            loss = x.pow(2).mean()
            loss.backward()
            out.append(loss.detach())
            out += [p.grad.clone() for p in blocks.parameters()]
            opt.step()
            opt.zero_grad()
        out += [t for m in blocks.modules() if isinstance(m, Fp8Linear)
                for s in (m.activation_state, m.weight_state, m.gradient_state) for t in (s.scale, s.amax_history)]
        return out

    plain, ckpt = run(False), run(True)
    assert len(plain) == len(ckpt) and all(torch.equal(a, b) for a, b in zip(plain, ckpt))
