"""`info` and the report say what a run measured: real FP8, what-if statistics, or both."""

from __future__ import annotations

import torch

import fp8scope
from fp8scope.detect.report import build_report
from fp8scope.emulate import convert_to_fp8
from fp8scope.store.manifest import describe_mode, measured_mode
from tests.conftest import MLP


def test_modes_from_the_sources_the_monitor_attached_to():
    wi = {"kind": "delayed", "margin": 0}
    assert measured_mode({"meta": {"sources": {"whatif": 3}, "whatif_recipe": wi}})["kind"] == "whatif"
    fp8 = measured_mode({"recipe": wi, "meta": {"sources": {"emulated": 2}, "whatif_recipe": wi}})
    assert fp8["kind"] == "fp8" and fp8["whatif_recipe"] is None  # no plain layer: the what-if recipe played no part
    mixed = measured_mode({"recipe": wi, "meta": {"sources": {"te": 4, "whatif": 1}, "whatif_recipe": wi}})
    assert mixed["kind"] == "mixed" and "4 te" in describe_mode(mixed) and "1 high-precision" in describe_mode(mixed)
    assert measured_mode({})["kind"] == "unknown"


def _run(path, emulated: bool):
    torch.manual_seed(0)
    m = MLP()
    if emulated:
        convert_to_fp8(m)
    with fp8scope.Monitor(m, path, every=1) as mon:
        for step in range(30):
            x = torch.randn(8, 16) * (3000.0 if step == 20 else 1.0)  # an outlier batch far past the scale
            m(x).pow(2).mean().backward()
            mon.step(loss=1.0)
    return build_report(fp8scope.load_run(path))


def test_a_what_if_verdict_says_the_fp8_was_simulated(tmp_path):
    rep = _run(tmp_path / "w", emulated=False)
    assert rep["measured"]["kind"] == "whatif" and rep["first_anomaly"] is not None
    assert "what-if: simulated FP8" in rep["verdict"]
    rep = _run(tmp_path / "e", emulated=True)
    assert rep["measured"]["kind"] == "fp8" and rep["first_anomaly"] is not None
    assert "what-if" not in rep["verdict"]
