"""Multi-rank runs on CPU: torch.multiprocessing (spawn) + gloo, real DistributedDataParallel and FSDP2.

Each test spawns 2 or 4 ranks that train a small emulated-FP8 MLP under DDP (or a ``transformers``
Llama sharded with FSDP2's ``fully_shard``) with a Monitor on every rank, all writing into one run
folder, then reads the folder back in the parent.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

import fp8scope
from fp8scope.distributed import AGGREGATE_RANK, CrossRankCheck, cross_rank_scale_mismatch
from tests.conftest import spawn_gloo

pytestmark = pytest.mark.timeout(180)
STEPS = 4


def _train_one(rank: int, run_dir: str, reduce: str, check, plant: bool, look: bool = False) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.conftest import MLP
    from fp8scope.emulate import DelayedScaling, ScalingState, convert_to_fp8

    torch.manual_seed(0)
    model = convert_to_fp8(MLP(), recipe=DelayedScaling(amax_history_len=4))
    if plant and rank == 1:  # this replica quantizes `down`'s weight with another margin
        layer, old = model.down, model.down.weight_state
        layer.weight_state = ScalingState(DelayedScaling(margin=2, amax_history_len=4), layer.recipe.forward_format)
        # in the model's batch, at the same place: every rank all-reduces the same amaxes (reduce_amax)
        layer.weight_state.update_group, layer.weight_state._seq = old.update_group, old._seq
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    mon = fp8scope.Monitor(model, run_dir, every=2, reduce=reduce, cross_rank_check=check)
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=gen)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss.detach(), lr=0.05)
        if look and step == 1:  # closer looks at cheap step 3, as triage asks for them: per rank, own layers
            mon.collector.look_closer(1, frozenset({"up", "down"} if rank == 0 else {"up"}))
    mon.close()
    info = {"rank": mon.rank, "world": mon.world_size, "exchanges": getattr(mon._writer, "exchanges", 0),
            "exchange_failed": getattr(mon._writer, "exchange_failed", None), "failed": mon.logging_failed}
    with open(os.path.join(run_dir, f"worker{rank}.json"), "w") as f:
        json.dump(info, f)


def _train_runs(rank: int, root: str, configs: dict) -> None:
    for name, config in configs.items():  # several runs per spawn: process start-up dominates
        _train_one(rank, os.path.join(root, name), *config)


def _launch(tmp_path, world: int, configs: dict) -> dict:
    root = spawn_gloo(tmp_path, world, _train_runs, configs)
    out = {}
    for name in configs:
        run_dir = root / name
        infos = [json.load(open(run_dir / f"worker{r}.json")) for r in range(world)]
        out[name] = (fp8scope.load_run(run_dir), infos)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two runs in one 2-rank job: aggregated + per-rank (clean), and per-rank only with a planted scale."""
    return _launch(tmp_path_factory.mktemp("dist2"), 2, {
        "both": ("both", None, False, True),
        "planted": ("none", None, True),
    })


def test_ddp_two_ranks_per_rank_and_aggregated_series(two_ranks):
    run, infos = two_ranks["both"]
    assert [(i["rank"], i["world"]) for i in infos] == [(0, 2), (1, 2)]
    assert all(i["failed"] is None and i["exchange_failed"] is None for i in infos)
    # one collective per logged step on every rank (the capacity never had to grow)
    assert [i["exchanges"] for i in infos] == [STEPS, STEPS]
    assert run.manifest["world_size"] == 2
    assert run.manifest["meta"]["distributed"]["reduce"] == "both"
    streams = {(s.table, s.rank) for s in __import__("fp8scope.store.layout", fromlist=["x"]).list_streams(run.path)}
    assert {("tensors", 0), ("tensors", 1), ("scalars", 0), ("scalars", 1)} <= streams
    df = run.tensors()
    assert set(df["rank"]) == {AGGREGATE_RANK, 0, 1}
    per = df[df["rank"] >= 0]
    agg = df[df["rank"] == AGGREGATE_RANK].set_index(["step", "layer", "tensor"])
    g = per.groupby(["step", "layer", "tensor"])
    assert len(agg) == len(g) == STEPS * 9
    np.testing.assert_array_equal(agg["amax"].sort_index(), g["amax"].max().sort_index())
    np.testing.assert_array_equal(agg["scale"].sort_index(), g["scale"].min().sort_index())
    np.testing.assert_array_equal(agg["numel"].sort_index(), g["numel"].sum().sort_index())
    full = agg[agg["full"]]
    # the full steps (0, 2), and at step 3 the layer both ranks looked closer at: a row is full where every
    # rank's was; "down", which rank 0 alone looked at, is not (its counts cannot be summed across ranks)
    assert per[(per.step == 3) & per.full].groupby("rank")["layer"].unique().map(sorted).to_dict() == {
        0: ["down", "up"], 1: ["up"]}
    pd.testing.assert_series_equal(agg["full"].sort_index(), g["full"].all().sort_index(), check_names=False)
    assert sorted(set(full.index.get_level_values("step"))) == [0, 2, 3]
    assert len(full) == 2 * 9 + 3 and full["overflow"].notna().all()
    np.testing.assert_array_equal(full["overflow"].sort_index(), g["overflow"].sum()[full.index].sort_index())
    assert (agg["calls"] == 2).all()
    # activations differ between ranks (different data), weights are identical replicas
    w = per[per.tensor == "weight"].pivot_table(index=["step", "layer"], columns="rank", values="scale")
    assert (w[0] == w[1]).all()
    loss = run.scalars("loss")
    per_loss = loss[loss["rank"] >= 0].groupby("step")["value"].mean()
    np.testing.assert_allclose(loss[loss["rank"] == -1].set_index("step")["value"], per_loss)
    assert "cross_rank_scale_mismatch" not in set(run.events()["rule"])
    assert cross_rank_scale_mismatch(run).empty
    assert len(run.tensors(rank=-1)) == STEPS * 9


def test_four_ranks_aggregate_only_and_a_planted_scale_is_a_critical_event(tmp_path):
    run, infos = _launch(tmp_path, 4, {"agg": ("aggregate", None, True)})["agg"]
    assert all(i["exchange_failed"] is None for i in infos)
    df = run.tensors()
    assert set(df["rank"]) == {AGGREGATE_RANK}  # one series instead of four
    assert set(run.scalars()["rank"]) == {AGGREGATE_RANK}
    all_ev = run.events()
    # online detection may also flag real saturation in this tiny delayed-scaling model
    ev = all_ev[all_ev["rule"] == "cross_rank_scale_mismatch"]
    assert len(ev) >= 1
    assert set(ev["severity"]) == {"critical"}
    assert set(ev["rank"]) == {1} and set(ev["layer"]) == {"down"} and set(ev["tensor"]) == {"weight"}
    assert ev["step"].min() == 1  # delayed scaling: step 0 runs at scale 1 on every rank
    assert (ev["value"] > 0.5).all()  # margin 2: the scale is 4x off


def test_per_rank_only_run_is_checked_offline(two_ranks):
    run, infos = two_ranks["planted"]
    assert [i["exchanges"] for i in infos] == [0, 0]  # nothing exchanged by default
    assert "cross_rank_scale_mismatch" not in set(run.events()["rule"])
    ev = cross_rank_scale_mismatch(run)
    assert len(ev) == 1 and ev.iloc[0]["rank"] == 1 and ev.iloc[0]["layer"] == "down"
    assert ev.iloc[0]["step"] == 1
    every = cross_rank_scale_mismatch(run, repeat=1)
    assert sorted(every["step"]) == list(range(1, STEPS))
    # groups that keep rank 0 and rank 1 apart see no mismatch
    assert cross_rank_scale_mismatch(run, groups=[[0], [1]]).empty
    # activations differ across data-parallel ranks, but reduce_amax (TE's default, and the
    # emulator's) all-reduces their amaxes: every rank uses the same activation scales
    assert cross_rank_scale_mismatch(run, roles=["activation"]).empty


def _fsdp_llama(emulated: bool):
    import transformers

    from fp8scope.emulate import convert_to_fp8

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    if emulated:
        convert_to_fp8(model, skip=["lm_head"])
    return model


def _fsdp_train(model, run_dir: str, seed: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    mon = fp8scope.Monitor(model, run_dir, every=2)
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss.detach())
    mon.close()


def _fsdp_runs(rank: int, root: str) -> None:
    """FSDP2 as torchtitan shards a model: each decoder layer, then the root; every rank its own data
    ("own") or every rank the same batches ("same", which the single-process run also trains on)."""
    from torch.distributed.fsdp import fully_shard

    for emulated in (False, True):
        for data in ("same", "own"):
            model = _fsdp_llama(emulated)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            _fsdp_train(model, os.path.join(root, f"{data}-{emulated}"), 7 if data == "same" else 100 + rank)


@pytest.fixture(scope="module")
def fsdp_root(tmp_path_factory):
    """One 2-rank job for both parametrizations (process start-up dominates)."""
    return spawn_gloo(tmp_path_factory.mktemp("fsdp2"), 2, _fsdp_runs)


@pytest.mark.parametrize("emulated", [False, True], ids=["whatif", "emulated"])
def test_fsdp2_sharded_layers_log_what_one_process_logs(fsdp_root, tmp_path_factory, emulated):
    """Real FSDP2 (``fully_shard``) over 2 gloo ranks of a ``transformers`` Llama: each layer's weight is
    sharded between steps and gathered in its forward (torch's pre-forward hook), its gradient reduce-
    scattered. With the same batches on both ranks, rank 0 logs what one unsharded process logs, bit for
    bit (the weights' amaxes are the gathered weights', the gradients the local ones); with each rank its
    own data, the weights' rows still agree across ranks (replicas), the activations' do not, and an
    emulated model's scales agree (its amaxes are reduced across the ranks, as TE's are)."""
    root = fsdp_root
    single = tmp_path_factory.mktemp("single") / "run"
    _fsdp_train(_fsdp_llama(emulated), str(single), 7)
    key = ["step", "layer", "tensor"]
    one = fp8scope.load_run(single).tensors().sort_values(key).reset_index(drop=True)
    same = fp8scope.load_run(root / f"same-{emulated}").tensors()
    assert set(same["rank"]) == {0, 1}
    r0 = same[same["rank"] == 0].sort_values(key).reset_index(drop=True)
    assert len(one) == len(r0) == STEPS * 15 * 3  # 2 layers x 7 projections and the head, x 3 roles, each step
    for col in ("amax", "scale", "scale_inv", "expected_amax"):
        np.testing.assert_array_equal(r0[col].to_numpy(), one[col].to_numpy(), err_msg=col)
    own = fp8scope.load_run(root / f"own-{emulated}")
    df = own.tensors()
    piv = df.pivot_table(index=key, columns="rank", values="amax")
    weights = piv.xs("weight", level="tensor")
    assert (weights[0] == weights[1]).all()
    assert (piv.xs("activation", level="tensor")[0] != piv.xs("activation", level="tensor")[1]).any()
    if emulated:
        fp8 = df[df["source"] == "emulated"].pivot_table(index=key, columns="rank", values="scale")
        assert (fp8[0] == fp8[1]).all()
    assert cross_rank_scale_mismatch(own).empty
