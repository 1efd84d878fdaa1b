"""Real Transformer Engine on a GPU (skipped elsewhere): TransformerLayer under each recipe the GPU
supports, checked row by row against TE's own state by examples/te_hopper.py --check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.te, pytest.mark.gpu]
ROOT = Path(__file__).resolve().parents[1]


def test_te_hopper_example_checks_every_recipe(tmp_path):
    pytest.importorskip("transformer_engine.pytorch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "te_hopper.py"), "--check", "--steps", "4",
                           "--layers", "2", "--hidden", "256", "--run", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "delayed:" in proc.stdout
