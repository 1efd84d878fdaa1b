"""Real Transformer Engine on a GPU (skipped elsewhere): TransformerLayer under fp8_autocast."""

from __future__ import annotations

import pytest
import torch

import fp8scope

pytestmark = [pytest.mark.te, pytest.mark.gpu]


@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"])
def test_transformer_layer_is_monitored(tmp_path, recipe_name):
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common import recipe as te_recipe

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if recipe_name == "MXFP8BlockScaling" and torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("MXFP8 needs Blackwell")
    rec = getattr(te_recipe, recipe_name)()
    torch.manual_seed(0)
    layer = te.TransformerLayer(256, 1024, 4, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(32, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with fp8scope.Monitor(layer, tmp_path, every=1) as mon:
        assert mon.sources.get("te", 0) >= 3  # qkv (LayerNormLinear), proj (Linear), LayerNormMLP
        for _ in range(3):
            with te.fp8_autocast(enabled=True, fp8_recipe=rec):
                y = layer(x)
            y.float().pow(2).mean().backward()
            mon.step()
    df = fp8scope.load_run(tmp_path).tensors()
    assert set(df.source) == {"te"}
    assert {"fc1", "fc2"} <= {name.rsplit(".", 1)[-1] for name in df.layer}
    last = df[df.step == 2]
    assert last.amax.notna().all() and (last.scale > 0).all()
    if recipe_name != "MXFP8BlockScaling":
        assert (last.amax * last.scale <= last.fp8_max * 1.0001).all() or recipe_name == "DelayedScaling"
