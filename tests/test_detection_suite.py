"""A few small cases of the detection suite (benchmarks/detection_suite.py), as CI tests: real
training runs of the tiny GPT and a transformers Llama with planted failures, scored the way the
suite scores them (localization, attribution), and clean runs of the tiny GPT and a transformers
Phi that must raise nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "detection_suite.py"
_spec = importlib.util.spec_from_file_location("detection_suite", _path)
suite = importlib.util.module_from_spec(_spec)
sys.modules["detection_suite"] = suite  # dataclasses look their module up there
_spec.loader.exec_module(suite)

STEPS = 150
CASES = [
    # a checkpoint resumed without its FP8 state, on a cheap step (every=10): seen from the scale alone
    suite.Case("gpt-scale-reset-cheap", "gpt", ["reset:blocks.1.mlp.up:125"], "blocks.1.mlp.up", "activation", 125, "fp8"),
    # a learning-rate jump: the optimizer side moved first, FP8 is not blamed
    suite.Case("gpt-lr-jump", "gpt", ["lr:115:30"], "", "lr", 115, "not-fp8"),
    # a NaN entering one layer's input on a cheap step of a model we did not write
    suite.Case("llama-nan-cheap", "llama", [f"nan:{suite.LLAMA.format(1)}.self_attn.o_proj:113"],
               f"{suite.LLAMA.format(1)}.self_attn.o_proj", "activation", 113, "fp8"),
    # warm restarts (the lr back at its peak twice): a rise to an earlier peak is not a warning
    suite.Case("gpt-clean-restarts", "gpt", lr_cycles=3),
    # a clean Phi (parallel attention and MLP, GELU): its q_proj gradients outgrew their delayed scales
    # in a fifth of its first 64 steps, and saturation_rate warned at step 63, past the warm-up, about
    # the warm-up's rows
    suite.Case("phi-clean", "phi"),
]


# the verdict's level (report.blame): a scale reset that flushed small values while the loss went on
# falling is FP8's symptom with no harm seen; a NaN is harm by itself; the lr jump is the optimizer's
BLAME = {"gpt-scale-reset-cheap": "symptoms", "gpt-lr-jump": "unlikely", "llama-nan-cheap": "likely",
         "gpt-clean-restarts": "clean", "phi-clean": "clean"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_suite_case(case, tmp_path):
    trained = suite.train(case, tmp_path / case.name, STEPS)
    r = suite.score(case, tmp_path / case.name, trained["losses"])
    assert r["ok"], r
    assert r["blame"] == BLAME[case.name], r
    if case.cause == "clean":
        assert r["warnings"] == r["criticals"] == 0
    else:
        assert r["detected"]["step"] == case.step, r
