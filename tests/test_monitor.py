"""The monitor on real models and real training steps: what it captures, when, and how it fails."""

from __future__ import annotations

import math
import re
import shutil
import time
import warnings

import pandas as pd
import numpy as np
import pytest
import torch

import fp8scope
from fp8scope.emulate import CurrentScaling, DelayedScaling, convert_to_fp8
from tests.conftest import MLP, train


def test_emulated_and_whatif_layers_are_captured_in_execution_order(mlp, tmp_path):
    convert_to_fp8(mlp, recipe=DelayedScaling(amax_history_len=4), skip=["head"])
    with fp8scope.Monitor(mlp, tmp_path / "r", every=1) as mon:
        assert mon.layers == ["up", "down", "head"]
        train(mlp, mon, steps=3)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert sorted(df.step.unique()) == [0, 1, 2]
    step0 = df[df.step == 0].sort_values("order")
    assert list(zip(step0.layer, step0.tensor)) == [
        ("up", "activation"), ("up", "weight"), ("down", "activation"), ("down", "weight"),
        ("head", "activation"), ("head", "weight"),
        ("head", "gradient"), ("down", "gradient"), ("up", "gradient"),
    ]
    src = dict(zip(step0.layer, step0.source))
    assert src == {"up": "emulated", "down": "emulated", "head": "whatif"}
    grads = step0[step0.tensor == "gradient"]
    assert set(grads.fp8_format) == {"e5m2"}
    assert set(step0[step0.tensor != "gradient"].fp8_format) == {"e4m3"}
    # delayed scaling: the scale of step 1 comes from the amax of step 0
    up_act = df[(df.layer == "up") & (df.tensor == "activation")].set_index("step")
    assert up_act.loc[0, "scale"] == 1.0
    assert up_act.loc[1, "expected_amax"] == pytest.approx(up_act.loc[0, "amax"], rel=1e-6)
    assert up_act.loc[1, "scale"] == pytest.approx(448 / up_act.loc[0, "amax"], rel=1e-5)
    assert (df.numel > 0).all() and (df.qerr_mse >= 0).all()
    scal = fp8scope.load_run(tmp_path / "r").scalars()
    assert set(scal.name) == {"loss", "lr"} and len(scal) == 6


def test_mixed_layers_keep_execution_order_on_cheap_steps(mlp, tmp_path):
    """Cheap steps, where the plain layer's captures go through the kernel's row log and the
    emulated layers' through the collector's list: merged back, the rows are in execution order."""
    convert_to_fp8(mlp, recipe=DelayedScaling(amax_history_len=4), skip=["down"])
    with fp8scope.Monitor(mlp, tmp_path / "r", every=10**9, detect=False, full_on_anomaly=0) as mon:
        train(mlp, mon, steps=3)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    want = [("up", "activation"), ("up", "weight"), ("down", "activation"), ("down", "weight"),
            ("head", "activation"), ("head", "weight"),
            ("head", "gradient"), ("down", "gradient"), ("up", "gradient")]
    for step in (1, 2):
        rows = df[df.step == step].sort_values("order")
        assert list(zip(rows.layer, rows.tensor)) == want and not rows.full.any()
        assert set(rows[rows.layer == "down"].source) == {"whatif"} and (rows.amax > 0).all()


@pytest.mark.parametrize("model,micro", [("plain", 1), ("plain", 2), ("mixed", 1), ("mixed", 2)])
def test_compiled_and_eager_capture_log_the_same_rows(tmp_path, monkeypatch, model, micro):
    """The stats and amax passes compiled (inductor) and eager log the same rows: the same amaxes,
    scales, counts and order, step by step, for what-if and emulated layers."""
    frames = []
    for mode in ("sync", "0"):
        monkeypatch.setenv("FP8SCOPE_COMPILE", mode)
        torch.manual_seed(0)
        net = MLP()
        if model == "mixed":
            convert_to_fp8(net, recipe=DelayedScaling(amax_history_len=4), skip=["head"])
        with fp8scope.Monitor(net, tmp_path / f"r{mode}", every=4, detect=False, full_on_anomaly=0,
                              recipe=DelayedScaling(amax_history_len=3)) as mon:
            train(net, mon, steps=6, micro=micro)
        frames.append(fp8scope.load_run(tmp_path / f"r{mode}").tensors().sort_values(["step", "order"]))
    cols = ["step", "layer", "tensor", "calls", "amax", "scale", "scale_inv", "expected_amax", "numel", "nonfinite",
            "zeros", "overflow", "underflow", "saturated", "qerr_mse"]
    a, b = (f[cols].reset_index(drop=True) for f in frames)
    assert len(a) == 6 * 9
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-6)


@pytest.mark.parametrize("micro", [1, 3])
def test_whatif_cheap_steps_follow_delayed_scaling_of_the_logged_amaxes(mlp, tmp_path, micro):
    """Plain layers on cheap steps: the hook records the amax and the scaling update runs when the
    step ends. Replaying every logged amax through a fresh ScalingState must give the logged scales,
    step by step, for activations, weights and gradients (hooked on the output's autograd node);
    with micro-batches the update still runs once per capture, as begin() does."""
    from fp8scope.emulate import ScalingState
    from fp8scope.formats import get_format

    recipe = DelayedScaling(amax_history_len=3)
    with fp8scope.Monitor(mlp, tmp_path / "r", every=10**9, recipe=recipe, full_on_anomaly=0, detect=False) as mon:
        train(mlp, mon, steps=8, micro=micro)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert set(df[df.full].step) == {0} and set(df.calls) == {micro}  # step 0 takes full stats (a multiple of every)
    assert len(df) == 8 * 3 * 3  # 3 layers x activation / weight / gradient, every step
    if micro > 1:
        return  # merged rows carry the max amax of the micro-batches, not each capture's
    for (layer, role), rows in df.groupby(["layer", "tensor"]):
        rows = rows.sort_values("step")
        fmt = get_format("e5m2" if role == "gradient" else "e4m3")
        assert set(rows.fp8_format) == {fmt.name} and set(rows.source) == {"whatif"}
        ref = ScalingState(recipe, fmt)
        for amax, scale, scale_inv in zip(rows.amax, rows.scale, rows.scale_inv):
            want = ref.begin(torch.tensor([amax], dtype=torch.float32))
            assert (scale, scale_inv) == (want.scale.item(), want.scale_inv.item()), (layer, role)
    grad = df[(df.layer == "head") & (df.tensor == "gradient")].sort_values("step")
    assert (grad.amax > 0).all() and grad.amax.nunique() == 8  # a real gradient each step


def test_whatif_output_role_and_no_grad_forwards(mlp, tmp_path):
    """The ``output`` role and ``capture_no_grad=True`` on plain layers, on a full step (0) and a
    cheap one (1): the no-grad forward's captures merge into the step's rows (calls 2, the larger
    amax), and the output rows hold the layer's real output amax."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    with fp8scope.Monitor(mlp, tmp_path / "r", tensors=("activation", "weight", "output", "gradient"),
                          capture_no_grad=True, every=2, detect=False, full_on_anomaly=0) as mon:
        for _ in range(2):
            mlp(x).pow(2).mean().backward()
            mlp.zero_grad()
            with torch.no_grad():
                mlp(x * 2)  # no optimizer step: the same weights, twice the input
            mon.step()
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 2 * 3 * 4
    fwd = df[df.tensor != "gradient"]
    assert set(fwd.calls) == {2} and set(df[df.tensor == "gradient"].calls) == {1}
    with torch.no_grad():
        want = float(mlp(x * 2).abs().max())
    out = df[(df.layer == "head") & (df.tensor == "output")].sort_values("step")
    assert list(out.full) == [True, False]
    assert out.amax.tolist() == pytest.approx([want, want], rel=1e-6)


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
def test_eval_forwards_under_inference_mode_are_captured_too(tmp_path, grad_off):
    """With ``capture_no_grad``, an eval forward under ``torch.inference_mode`` is captured like one
    under ``no_grad``, also when it is the first thing captured: the what-if bank made there keeps
    a state it can update when the step ends, and inference tensors (which have no version counter)
    skip the shared-input and weight reads' checks instead of failing them."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8scope.Monitor(model, tmp_path / "r", every=100, detect=False, capture_no_grad=True) as mon:
            for _ in range(3):  # a full step, then cheap ones
                with grad_off():
                    model(input_ids=ids)
                mon.step()
    assert not [str(w.message) for w in caught if "fp8scope" in str(w.message)]
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert df.groupby("step").size().tolist() == [15 * 2] * 3  # 15 linears' activation and weight
    w = df[(df.tensor == "weight") & (df.layer == "model.layers.1.mlp.down_proj")].amax.tolist()
    assert w == pytest.approx([model.model.layers[1].mlp.down_proj.weight.abs().max().item()] * 3)


def test_whatif_current_scaling_derives_each_scale_from_its_own_amax(mlp, tmp_path):
    """Plain layers under CurrentScaling (a ScalingState per tensor, not the delayed bank): on full
    and cheap steps alike, each row's scale is fp8_max / its own amax and the expected amax is it."""
    with fp8scope.Monitor(mlp, tmp_path / "r", recipe=CurrentScaling(), every=2, detect=False,
                          full_on_anomaly=0) as mon:
        train(mlp, mon, steps=3)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 3 * 9 and set(df.full) == {True, False} and (df.amax > 0).all()
    assert df.scale.tolist() == pytest.approx((df.fp8_max / df.amax).tolist(), rel=1e-6)
    assert df.expected_amax.tolist() == pytest.approx(df.amax.tolist(), rel=1e-6)


def test_deepcopy_of_a_whatif_monitored_model_shares_the_monitor(mlp, tmp_path):
    """A copy of a monitored model (shadow replicas, EMA copies) keeps the hooks as functions are
    kept: no copy of the monitor (its locks cannot be copied), and the copy still trains."""
    import copy

    with fp8scope.Monitor(mlp, tmp_path / "r", detect=False) as mon:
        train(mlp, mon, steps=1)
        twin = copy.deepcopy(mlp)
        train(twin, None, steps=1)
        train(mlp, mon, steps=1)
    assert sorted(fp8scope.load_run(tmp_path / "r").tensors().step.unique()) == [0, 1]


def test_every_gives_full_stats_only_on_multiples_and_steps_limits_capture(mlp, tmp_path):
    with fp8scope.Monitor(mlp, tmp_path / "r", every=3, steps=(2, 7), full_on_anomaly=0) as mon:
        train(mlp, mon, steps=9)
    run = fp8scope.load_run(tmp_path / "r")
    df = run.tensors()
    assert sorted(df.step.unique()) == [2, 3, 4, 5, 6]
    full_steps = sorted(df[df.full].step.unique())
    assert full_steps == [3, 6]
    cheap = df[~df.full]
    assert cheap.overflow.isna().all() and cheap.amax.notna().all()
    assert sorted(run.scalars().step.unique()) == list(range(9))  # scalars every step


def test_layer_and_role_selection(mlp, tmp_path):
    with fp8scope.Monitor(mlp, tmp_path / "r", layers=r"^(up|down)$", tensors=["gradient"]) as mon:
        train(mlp, mon, steps=2)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert set(df.layer) == {"up", "down"} and set(df.tensor) == {"gradient"}
    with pytest.raises(fp8scope.UsageError):
        fp8scope.Monitor(mlp, tmp_path / "x", tensors=["grad"])
    with pytest.raises(fp8scope.UsageError):
        fp8scope.Monitor(mlp, tmp_path / "x", layers="nomatch")


def test_gradient_accumulation_merges_micro_batches(mlp, tmp_path):
    convert_to_fp8(mlp, recipe=CurrentScaling())
    with fp8scope.Monitor(mlp, tmp_path / "r", every=1) as mon:
        train(mlp, mon, steps=2, micro=4, batch=8)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 2 * 9  # one row per (step, tensor), not per micro-batch
    act = df[(df.layer == "up") & (df.tensor == "activation")]
    assert (act.calls == 4).all() and (act.numel == 4 * 8 * 16).all()


def test_restart_appends_a_segment_and_the_later_segment_wins(tmp_path):
    torch.manual_seed(0)
    m = MLP()
    with fp8scope.Monitor(m, tmp_path / "r", every=1) as mon:
        train(m, mon, steps=5)  # steps 0..4
    with fp8scope.Monitor(m, tmp_path / "r", every=1, step=3) as mon:  # resumed from a checkpoint at step 3
        train(m, mon, steps=4)  # steps 3..6
    run = fp8scope.load_run(tmp_path / "r")
    df = run.tensors()
    assert sorted(df.step.unique()) == list(range(7))
    seg = df.groupby("step").segment.unique().map(lambda s: list(s))
    assert seg[2] == [0] and seg[3] == [1] and seg[6] == [1]
    assert df.groupby(["step", "layer", "tensor"]).size().max() == 1


def test_restart_without_step_warns(tmp_path, mlp):
    with fp8scope.Monitor(mlp, tmp_path / "r") as mon:
        train(mlp, mon, steps=1)
    with pytest.warns(RuntimeWarning, match="already holds logged steps"):
        fp8scope.Monitor(mlp, tmp_path / "r").close()


def test_nan_is_counted_and_its_first_tensor_is_ordered_first(mlp, tmp_path):
    convert_to_fp8(mlp, recipe=DelayedScaling(amax_history_len=4))

    def poison(step, x):
        if step == 2:
            x = x.clone()
            x[0, 0] = math.nan
        return x

    with fp8scope.Monitor(mlp, tmp_path / "r", every=1) as mon:
        train(mlp, mon, steps=3, poison=poison)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    bad = df[(df.step == 2) & (df.nonfinite > 0)].sort_values("order")
    assert (bad.iloc[0].layer, bad.iloc[0].tensor) == ("up", "activation")
    assert bad.iloc[0].nonfinite == 1 and math.isnan(bad.iloc[0].amax)
    assert (df[df.step < 2].nonfinite == 0).all()


def test_eval_forwards_are_not_captured(mlp, tmp_path):
    with fp8scope.Monitor(mlp, tmp_path / "r", every=1) as mon:
        train(mlp, mon, steps=1)
        with torch.no_grad():
            mlp(torch.randn(3, 16))
        train(mlp, mon, steps=1)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert (df.calls == 1).all()


def test_bf16_model(tmp_path):
    torch.manual_seed(0)
    m = convert_to_fp8(MLP().to(torch.bfloat16), recipe=DelayedScaling(amax_history_len=8))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with fp8scope.Monitor(m, tmp_path / "r", every=1) as mon:
        for _ in range(3):
            m(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step(); opt.zero_grad()
            mon.step()
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 27 and df.amax.notna().all()


def test_torchao_float8_linear_emulated_on_cpu(tmp_path):
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    for recipe in ("tensorwise", "rowwise"):
        torch.manual_seed(0)
        m = MLP(d=16, h=32, out=16)
        cfg = Float8LinearConfig.from_recipe_name(recipe)
        cfg = Float8LinearConfig(**{**cfg.__dict__, "emulate": True})
        convert_to_float8_training(m, config=cfg)
        with fp8scope.Monitor(m, tmp_path / recipe, every=1) as mon:
            train(m, mon, steps=2)
        df = fp8scope.load_run(tmp_path / recipe).tensors()
        # 3 layers x 2 steps x (activation, weight, gradient); rowwise adds each role's second cast
        assert set(df.source) == {"torchao"} and len(df) == (18 if recipe == "tensorwise" else 36)
        # dynamic scaling maps amax onto fp8_max: at most float rounding above it
        assert (df.amax * df.scale <= df.fp8_max * (1 + 1e-6)).all()
        assert (df.overflow <= 1).all() and (df.underflow >= 0).all()
        grad_fmt = set(df[df.tensor.str.startswith("gradient")].fp8_format)
        assert grad_fmt == ({"e5m2"} if recipe == "tensorwise" else {"e4m3"})
        # the run names its recipe (the report's recipe line and advice read it)
        assert fp8scope.load_run(tmp_path / recipe).manifest["recipe"] == (
            {"kind": "current", "fp8_format": "HYBRID"} if recipe == "tensorwise" else {"kind": "rowwise", "fp8_format": "E4M3"})
        assert set(df.recipe) == {"current" if recipe == "tensorwise" else "rowwise"}  # and each tensor's rows
        if recipe == "tensorwise":
            act = df[df.tensor == "activation"]
            assert (act.scale * act.amax).round(2).eq(448.0).all()


def test_logging_stops_cleanly_when_the_run_folder_disappears(mlp, tmp_path):
    run_dir = tmp_path / "r"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = fp8scope.Monitor(mlp, run_dir, every=1)
        train(mlp, mon, steps=2)
        shutil.rmtree(run_dir)
        time.sleep(1.1)  # the writer looks for its folder at most once a second
        train(mlp, mon, steps=3)  # training goes on
        mon.close()
    msgs = [str(w.message) for w in caught if "fp8scope" in str(w.message)]
    assert len(msgs) == 1 and "logging stopped" in msgs[0]
    assert mon.logging_failed


def test_disabled_monitor_is_a_no_op(mlp, tmp_path):
    with fp8scope.Monitor(mlp, tmp_path / "r", enabled=False) as mon:
        train(mlp, mon, steps=2)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("layers", ["emulated", "whatif"])
def test_a_clipped_cheap_step_triggers_full_stats_on_the_next_steps(mlp, tmp_path, layers):
    """Emulated and plain layers: detect's triage rule flags the cheap step, the monitor looks closer."""
    if layers == "emulated":
        convert_to_fp8(mlp, recipe=DelayedScaling(amax_history_len=4))

    def spike(step, x):
        return x * 1000 if step == 5 else x  # an outlier the delayed scale cannot represent

    with fp8scope.Monitor(mlp, tmp_path / "r", every=100, full_on_anomaly=2,
                          recipe=DelayedScaling(amax_history_len=4)) as mon:
        train(mlp, mon, steps=9, poison=spike)
    df = fp8scope.load_run(tmp_path / "r").tensors()
    # step 0 by `every`; the writer thread judges step 5 while step 6 runs, and the monitor takes its
    # verdict when step 6 ends (it never waits for the writer, and a verdict that came sooner waits
    # too): 7 and 8 take full stats, whatever the timing, so a run's rows are the same every time
    assert sorted(df[df.full].step.unique()) == [0, 7, 8]
    up = df[(df.layer == "up") & (df.tensor == "activation")].set_index("step")
    assert up.loc[5, "amax"] > up.loc[5, "fp8_max"] * up.loc[5, "scale_inv"]
    # the closer look is at the layers the triage flagged at step 5, every role of them
    from fp8scope.detect.config import DetectConfig
    from fp8scope.detect.triage import suspicious_rows

    five = df[df.step == 5]
    flagged = set(five.layer[suspicious_rows(DetectConfig(), five.amax, five.scale_inv, five.fp8_max)])
    after = df[df.step.isin(sorted(df[df.full].step.unique())[1:])]
    assert "up" in flagged and set(after[after.full].layer) == flagged
    assert after[after.full].underflow.notna().all() and after[~after.full].underflow.isna().all()


@pytest.mark.parametrize("layers", ["emulated", "whatif"])
def test_a_closer_look_takes_full_stats_of_its_layers_only_and_of_every_layer_after_a_nan(mlp, tmp_path, layers):
    """``look_closer``: full stats of the layers a clip was seen in on the next steps, cheap rows of the
    others (a MoE's experts clip one or another on most steps early on: full stats of every tensor after
    each would be most steps'); after a non-finite amax, of every layer (the writer's flag)."""
    if layers == "emulated":
        convert_to_fp8(mlp, recipe=DelayedScaling(amax_history_len=4))
    with fp8scope.Monitor(mlp, tmp_path / "focus", every=100, full_on_anomaly=0) as mon:
        train(mlp, mon, steps=3)
        # (step 3 has begun: the look starts with the next step to begin, as the writer's flag does)
        mon.collector.look_closer(2, frozenset({"down"}))
        mon.collector.look_closer(1, frozenset({"head"}))  # joins the look under way
        train(mlp, mon, steps=3)
    df = fp8scope.load_run(tmp_path / "focus").tensors()
    full = {s: set(g.layer[g.full]) for s, g in df.groupby("step")}
    assert full == {0: {"up", "down", "head"}, 1: set(), 2: set(), 3: set(), 4: {"down", "head"}, 5: {"down", "head"}}
    assert set(df[df.full & (df.step == 4)].tensor) == {"activation", "weight", "gradient"}
    assert df[df.full].underflow.notna().all() and df[~df.full].underflow.isna().all()

    # a NaN in the head's weight at step 5 alone (put back before the update; gradients not captured, which
    # it reaches): only its row is non-finite
    opt = torch.optim.SGD(mlp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    with fp8scope.Monitor(mlp, tmp_path / "nan", every=100, full_on_anomaly=1,
                          tensors=("activation", "weight")) as mon:
        for step in range(8):
            if step == 5:
                kept = mlp.head.weight.detach().clone()
                with torch.no_grad():
                    mlp.head.weight[0, 0] = float("nan")
            mlp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            if step == 5:
                with torch.no_grad():
                    mlp.head.weight.copy_(kept)
                opt.zero_grad()
            opt.step()
            opt.zero_grad()
            mon.step()
    df = fp8scope.load_run(tmp_path / "nan").tensors()
    five = df[df.step == 5]
    assert set(five.layer[five.amax.isna() | ~np.isfinite(five.amax.fillna(0))]) == {"head"}
    later = df[df.full & (df.step > 5)]
    assert later.step.nunique() == 1 and set(later.layer) == {"up", "down", "head"}


def test_tensor_batch_identity_cache_gives_the_same_rows():
    """The writer caches the string columns per row list; a changed row list must not reuse them."""
    import numpy as np

    from fp8scope.step_payload import TensorKey
    from fp8scope.schema import N_FIELDS
    from fp8scope.step_records import tensor_batch

    keys = [TensorKey(f"l{i}", ("activation", "weight", "gradient")[i % 3], "emulated", "e4m3", 448.0, (4, 4))
            for i in range(6)]
    m = np.random.default_rng(0).random((6, N_FIELDS))
    cache: dict = {}
    for kids in ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [5, 3, 1], [0, 1, 2, 3, 4, 5], [2, 2, 4]):
        rows = m[: len(kids)]
        assert tensor_batch(7, 0, rows, kids, keys, True, cache=cache).equals(tensor_batch(7, 0, rows, kids, keys, True))
    assert len(cache) == 3


def test_cheap_tensor_batch_equals_the_general_path():
    """Cheap steps skip widening to every field and reuse the row list's columns: same batch, bit for bit."""
    import numpy as np

    from fp8scope.schema import FIELD_INDEX, N_FIELDS
    from fp8scope.step_payload import CHEAP_FIELDS, TensorKey
    from fp8scope.step_records import cheap_tensor_batch, tensor_batch

    keys = [TensorKey(f"l{i}", ("activation", "weight", "gradient")[i % 3], "whatif", "e4m3", 448.0, (4, 4))
            for i in range(6)]
    rng = np.random.default_rng(1)
    cache: dict = {}
    for step, kids in enumerate(([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [5, 3, 1], [2, 2, 4], [0, 1, 2, 3, 4, 5])):
        rows = rng.random((len(kids), len(CHEAP_FIELDS))) * 10
        rows[0, 0] = np.nan  # a NaN amax is stored as null on both paths, and flags nonfinite
        numels = [16] * len(kids)
        numels[-1] = -1  # a row without a tensor at hand (TE's amax history)
        wide = np.full((len(kids), N_FIELDS), np.nan)
        for j, name in enumerate(CHEAP_FIELDS):
            wide[:, FIELD_INDEX[name]] = rows[:, j]
        wide[:, FIELD_INDEX["numel"]] = np.where(np.asarray(numels) >= 0, numels, np.nan)
        wide[:, FIELD_INDEX["nonfinite"]] = ~np.isfinite(rows[:, 0])
        want = tensor_batch(step, 3, wide, kids, keys, False)
        got = cheap_tensor_batch(step, 3, rows, kids, numels, keys, cache)
        assert got.equals(want), step
        assert got.column("zeros").null_count == got.num_rows and got.column("amax").null_count == 1
        assert got.column("nonfinite").to_pylist()[0] == 1 and sum(got.column("nonfinite").to_pylist()) == 1


def test_step_writes_keep_order_with_concurrent_table_writes(tmp_path, monkeypatch):
    """Steps and rows other threads log meanwhile share the writer thread: every step lands once, in order."""
    import threading

    import pyarrow as pa

    from fp8scope.schema import TABLE_SCHEMAS

    schema = pa.schema([("step", pa.int64()), ("rank", pa.int32()), ("text", pa.string())])
    monkeypatch.setitem(TABLE_SCHEMAS, "notes_test", schema)
    mlp = MLP()
    mon = fp8scope.Monitor(mlp, tmp_path / "r", every=3, detect=True)
    stop = threading.Event()
    sent = []

    def other_thread():
        i = 0
        while not stop.is_set():
            mon.log_table("notes_test", pa.RecordBatch.from_pylist([{"step": i, "rank": 0, "text": "x"}], schema=schema))
            sent.append(i)
            i += 1
            time.sleep(0.0005)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        train(mlp, mon, steps=60)
    finally:
        stop.set()
        t.join()
        mon.close()
    run = fp8scope.load_run(tmp_path / "r")
    steps = run.tensors().groupby("step").size()
    assert list(steps.index) == list(range(60)) and (steps == steps.iloc[0]).all()
    assert list(run.scalars().query("name == 'loss'").step) == list(range(60))
    assert sorted(run.table("notes_test").to_pandas().step) == sent
    assert mon.logging_failed is None and mon._writer.dropped == 0


def test_background_detector_examines_steps_in_pairs_and_a_lone_step_after_its_wait():
    """Two steps cost one pass (whose cost is mostly fixed): a step waits for the next, and goes
    alone once ``pair_wait_s`` has passed without one (the run paused); a flush does not wait."""
    from fp8scope.detect.online import BackgroundDetector

    calls = []

    class Det:
        def process(self, steps):
            calls.append([s[0] for s in steps])

    def wait_for(n):
        deadline = time.monotonic() + 10
        while len(calls) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    bg = BackgroundDetector(Det(), lambda table, batch: None, pair_wait_s=0.5)
    bg(0, 0, None, None)
    time.sleep(0.1)
    assert calls == []  # step 0 waits for its pair
    bg(1, 0, None, None)
    wait_for(1)
    assert calls == [[0, 1]]
    t0 = time.monotonic()
    bg(2, 0, None, None)
    wait_for(2)
    assert calls == [[0, 1], [2]] and time.monotonic() - t0 >= 0.4  # alone, after its wait
    bg(3, 0, None, None)
    bg.flush()
    assert calls[-1] == [3]  # a flush examines what is queued without waiting for a pair
    bg.close()


def test_a_suspicious_step_is_examined_at_once():
    """A step whose amax is non-finite or clipped (the triage rule that also asks for full stats),
    or whose loss is non-finite, does not wait for a pair: a blow-up's first step is reported at
    once, and an event fork starts as early as it did."""
    import pyarrow as pa

    from fp8scope.detect.online import BackgroundDetector, OnlineDetector

    calls = []

    class Det(OnlineDetector):
        def process(self, steps):
            calls.append([s[0] for s in steps])

    def tensors(amax):
        return pa.RecordBatch.from_pydict({"amax": [1.0, amax], "scale_inv": [1 / 448, 1 / 448],
                                           "fp8_max": [448.0, 448.0]})

    def loss(value):
        return pa.RecordBatch.from_pydict({"value": [value]})

    bg = BackgroundDetector(Det(), lambda table, batch: None, pair_wait_s=30)
    for step, args in enumerate([(tensors(float("nan")), None), (tensors(1e4), None),
                                 (None, loss(float("inf"))), (tensors(1.0), loss(2.0))]):
        t0 = time.monotonic()
        bg(step, 0, *args)
        while step < 3 and len(calls) <= step and time.monotonic() < t0 + 10:
            time.sleep(0.01)
        if step < 3:
            assert calls[-1] == [step] and time.monotonic() - t0 < 10  # at once, not after 30 s
    time.sleep(0.2)
    assert len(calls) == 3  # the healthy step waits for its pair
    bg.close()
    assert calls[-1] == [3]


def test_background_detector_examines_a_backlog_in_batches_and_flush_does_not_wait():
    from fp8scope.detect.online import BackgroundDetector

    calls = []

    class Det:
        def process(self, steps):
            calls.append([s[0] for s in steps])
            return None

    bg = BackgroundDetector(Det(), lambda table, batch: None, max_batch=8, lag_warn=1000)
    t0 = time.monotonic()
    for s in range(20):
        bg(s, 0, None, None)
    bg.flush()
    assert time.monotonic() - t0 < 30  # flushed at once
    assert [s for c in calls for s in c] == list(range(20))
    assert all(len(c) <= 8 for c in calls)
    bg.close()


def test_a_backlog_is_warned_about_only_when_it_keeps_steps_waiting():
    """A detector that starts (a child process importing its libraries) lets steps queue; they are
    examined in one batch then, without the lag warning, as is a backlog of a fast loop that is
    examined within ``lag_warn_s``. A backlog whose oldest step waited longer is said once, with
    its steps and seconds."""
    import threading
    import warnings

    from fp8scope.detect.online import BackgroundDetector

    started, hold, calls = threading.Event(), threading.Event(), []

    class Det:
        def wait_ready(self):
            started.wait(10)

        def process(self, steps):
            calls.append([s[0] for s in steps])
            if len(calls) in (2, 4):
                hold.wait(10)
                hold.clear()

    def backlog(first: int, wait_s: float) -> None:
        """Step ``first`` examined alone; the detector holds it while 20 more queue for ``wait_s``."""
        n = len(calls)
        bg(first, 0, None, None)
        deadline = time.monotonic() + 10
        while len(calls) == n and time.monotonic() < deadline:
            time.sleep(0.01)
        for s in range(first + 1, first + 21):
            bg(s, 0, None, None)
        time.sleep(wait_s)
        hold.set()
        bg.flush()

    bg = BackgroundDetector(Det(), lambda table, batch: None, lag_warn=8, pair_wait_s=0, lag_warn_s=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(30):
            bg(s, 0, None, None)
        time.sleep(1.2)  # longer than lag_warn_s, but the detector was not ready
        started.set()
        bg.flush()
        assert calls == [list(range(30))]
        backlog(30, 0.0)  # 20 steps behind for a moment: no news
        assert not [w for w in caught if "behind" in str(w.message)]
        backlog(51, 1.5)
    said = [str(w.message) for w in caught if "behind" in str(w.message)]
    got = re.search(r"fell 20 steps \((\d+\.\d) s\) behind", said[0]) if len(said) == 1 else None
    assert got is not None and float(got.group(1)) >= 1.5, said
    assert [s for c in calls for s in c] == list(range(72))
    assert bg.max_lag >= 30 and bg.max_wait_s >= 1.5
    bg.close()
