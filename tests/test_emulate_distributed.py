"""``reduce_amax`` of the emulated delayed scaling on 2 and 4 gloo ranks (torch.multiprocessing).

TE all-reduces (MAX) row 0 of the amax history across the autocast's group before every update
(``quantization.py``, ``reduce_and_update_fp8_tensors``; ../shared/te-internals.md), so every
rank records the same amax and uses the same scale. Each rank here trains the same layer on its
own data twice: with ``reduce_amax`` (the default) and without. One layer, so that no amax
depends on a scale (its input, its weight, and a fixed output gradient), and the reduced
histories must be exactly the elementwise maximum of the ranks' unreduced ones.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from tests.conftest import spawn_gloo

pytestmark = pytest.mark.timeout(180)
STEPS = 5


def _train(rank: int, out_dir: str) -> None:
    from fp8scope.emulate import DelayedScaling, convert_to_fp8, fp8_autocast

    models = {}
    for reduce in (True, False):
        torch.manual_seed(0)  # the same weights on every rank
        models[reduce] = convert_to_fp8(nn.Sequential(nn.Linear(8, 4)),
                                        DelayedScaling(amax_history_len=8, reduce_amax=reduce))
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=gen) * (1 + rank) * (1 + step % 3)
        g = torch.randn(4, 4, generator=gen) * 10.0 ** (rank - step)
        for reduce, model in models.items():
            with fp8_autocast():
                y = model(x)
            (y * g).sum().backward()
    # one more forward applies the last updates
    for model in models.values():
        model(torch.zeros(1, 8))
    states = {reduce: [torch.stack([s.amax_history for s in (m.activation_state, m.weight_state,
                                                              m.gradient_state)])
                       for m in model if hasattr(m, "activation_state")]
              for reduce, model in models.items()}
    scales = [float(s.scale) for m in models[True] for s in (m.activation_state, m.weight_state, m.gradient_state)]
    torch.save({"states": states, "scales": scales}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_amax_gives_every_rank_the_max_over_ranks(tmp_path, world):
    out_dir = spawn_gloo(tmp_path, world, _train)
    res = [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
    for layer in range(1):
        reduced = [r["states"][True][layer] for r in res]
        alone = [r["states"][False][layer] for r in res]
        for r in range(1, world):
            assert torch.equal(reduced[r], reduced[0])  # every rank: the same history
        assert not all(torch.equal(a, alone[0]) for a in alone[1:])  # the ranks did see different amaxes
        # rows 1..: the updates so far (row 0 holds the zero forward's amax, which differs per model)
        assert torch.equal(reduced[0][:, 1:], torch.stack(alone)[:, :, 1:].amax(0))
    assert all(r["scales"] == res[0]["scales"] for r in res)
