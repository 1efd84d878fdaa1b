"""The verdict blames FP8 for a failure only when training shows one (fp8scope.detect.harm)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.harm import HARM_WINDOW, training_harm

CFG = DetectConfig()
NO_EVENTS = pd.DataFrame(columns=["step", "rank", "rule", "severity", "layer", "tensor"])


def noisy_loss(steps=300, seed=0):
    """A healthy loss: falling from 4 to 0.7 with the demo's per-batch noise (~8 %) and a hard batch now and
    then (1.3x: the demo's loss at steps 306 and 309 before its planted fault)."""
    rng = np.random.default_rng(seed)
    s = np.arange(steps)
    v = 0.7 + 3.3 * np.exp(-s / 60) * (1 + 0.08 * rng.standard_normal(steps))
    v *= 1 + 0.08 * rng.standard_normal(steps)
    v[rng.choice(steps, 12, replace=False)] *= 1.3
    return pd.DataFrame({"step": s, "value": v})


def ev(step, rule):
    return pd.DataFrame([{"step": step, "rank": 0, "rule": rule, "severity": "warning", "layer": "", "tensor": "loss"}])


def test_a_loss_that_keeps_falling_with_noise_is_no_harm():
    for seed in range(5):
        h = training_harm(noisy_loss(seed=seed), NO_EVENTS, {"step": 150}, CFG)
        assert h["hurt"] is False and h["steps_since"] == 150, h
        assert h["how"].startswith("the loss has not moved in the 150 logged steps since"), h
    early = training_harm(noisy_loss(), NO_EVENTS, {"step": 0}, CFG)  # a symptom at the first step
    assert early["hurt"] is False, early


def test_a_loss_that_rises_and_stays_up_is_harm_and_two_hard_batches_are_not():
    df = noisy_loss()
    up = df.copy()
    up.loc[up["step"] >= 200, "value"] *= 1.6
    h = training_harm(up, NO_EVENTS, {"step": 190}, CFG)
    assert h["hurt"] is True and h["how"].startswith("the loss rose to "), h
    # the rise shows once half a window's medians sit above it: within a few steps of 200
    step = int(h["how"].split("by step ")[1].split(" ")[0])
    assert 200 <= step <= 200 + HARM_WINDOW // 2 + 1, h
    bump = df.copy()
    bump.loc[bump["step"].between(200, 201), "value"] *= 1.5  # two hard batches in a row
    assert training_harm(bump, NO_EVENTS, {"step": 190}, CFG)["hurt"] is False
    # a rise before the symptom is not the symptom's harm
    before = df.copy()
    before.loc[before["step"].between(100, 140), "value"] *= 1.6
    assert training_harm(before, NO_EVENTS, {"step": 190}, CFG)["hurt"] is False


def test_the_loss_rules_events_and_a_non_finite_loss_are_harm():
    df = noisy_loss()
    for rule, words in (("loss_spike", "the loss spiked at step 220"),
                        ("loss_nonfinite", "the loss went non-finite at step 220"),
                        ("grad_norm_spike", "the grad norm spiked at step 220")):
        h = training_harm(df, ev(220, rule), {"step": 150}, CFG)
        assert h["hurt"] is True and h["how"] == words, h
        assert training_harm(df, ev(120, rule), {"step": 150}, CFG)["hurt"] is False  # before the symptom
    nan = df.copy()
    nan.loc[nan["step"] == 230, "value"] = np.nan
    h = training_harm(nan, NO_EVENTS, {"step": 150}, CFG)
    assert h["hurt"] is True and h["how"] == "the loss went non-finite at step 230", h


@pytest.mark.parametrize("losses", [None, pd.DataFrame({"step": [], "value": []}),
                                    pd.DataFrame({"step": [0, 1, 2], "value": [3.0, 2.9, 2.8]})])
def test_without_a_loss_after_the_symptom_harm_is_unknown(losses):
    h = training_harm(losses, NO_EVENTS, {"step": 5}, CFG)
    assert h["hurt"] is None and "no loss was logged after it" in h["how"], h


def test_a_negative_objective_is_judged_by_its_events_alone():
    df = noisy_loss()
    df["value"] = -df["value"]
    h = training_harm(df, NO_EVENTS, {"step": 150}, CFG)
    assert h["hurt"] is False and h["how"] == "the loss stayed finite in the 150 logged steps since, with no spike", h
    assert training_harm(df, ev(160, "loss_spike"), {"step": 150}, CFG)["hurt"] is True


def test_a_real_outlier_that_fp8_clips_once_is_no_harm_and_one_that_stays_is(tmp_path):
    """The demo's tiny GPT in emulated FP8 with a 1000x outlier planted in an MLP's input at step 100:
    for one step (its delayed scale clips it and the next steps' bulk flushes, the loss does not move:
    "FP8 symptoms, no harm seen in the loss"), and for good (the model's function changes: the loss jumps
    after FP8's saturation: "FP8 is the likely cause", saying how the loss moved)."""
    import shutil

    import torch

    from fp8scope.demo import train as T
    from fp8scope.detect.analysis import analysis
    from fp8scope.detect.report import blame_text

    torch.set_num_threads(1)
    reps = {}
    for duration in (1, 0):
        a = T.default_args(steps=140, n_layers=2, d_model=32, n_heads=2, batch_size=4, seq_len=16, every=10,
                           quiet=True, corpus_chars=20000,
                           inject=[T._inject_arg(f"outlier:blocks.1.mlp.down:100:1000:{duration}")])
        s = T.build(a)
        path = tmp_path / str(duration)
        shutil.rmtree(path, ignore_errors=True)
        with T.open_monitor(s, path) as mon:
            T.train_steps(s, 140, monitor=mon)
        reps[duration] = analysis(path)[1]
    once, stays = reps[1], reps[0]
    for rep in (once, stays):
        e = rep["attribution"]["event"]
        assert rep["attribution"]["side"] == "fp8" and e["layer"] == "blocks.1.mlp.down" and e["step"] == 100, e
    assert once["harm"]["hurt"] is False and once["blame"]["level"] == "symptoms", once["blame"]
    assert blame_text(once).startswith("FP8 symptoms, no harm seen in the loss: an FP8 symptom came first (")
    assert stays["harm"]["hurt"] is True and stays["blame"]["level"] == "likely", stays["blame"]
    why = stays["blame"]["why"]
    assert why.startswith("an FP8 symptom came first: ") and stays["harm"]["how"] in why, why
