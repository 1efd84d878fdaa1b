"""A small Transformer Engine stack on one GPU, monitored by fp8scope, that checks itself.

    pip install "fp8scope[te]"
    python examples/te_hopper.py --steps 50 --run runs/te_hopper
    fp8scope info runs/te_hopper && fp8scope tensors runs/te_hopper --last 1

With ``--check`` (tests/test_integrations_te.py runs it so) it trains a ``TransformerLayer`` stack
under each recipe the GPU and TE support (delayed, current, MXFP8 and NVFP4 on Blackwell, Float8
block scaling from TE 2.3) and exits non-zero unless the rows agree with TE's own state:

- delayed scaling: every row's scale is the one in ``fp8_meta`` when the step ran (the slot the
  installed TE version uses, ``fp8scope.capture.adapters.te_layout``), every amax the one TE
  recorded (the newest history row after the step's update);
- current scaling: every row's scale is TE's rule of the row's amax (power-of-two when the quantizer
  says so), and no element overflows;
- MXFP8 and block scaling: rowwise and columnwise rows, power-of-two scales, no overflow;
- NVFP4: E2M1 rows, with the columnwise rows of the weight-gradient GEMM's operands.

Multi-GPU: torchrun --nproc-per-node 8 examples/te_hopper.py --reduce both
(every rank logs into the same folder; see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

import torch

import fp8scope


def build(te, layers: int, hidden: int):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[te.TransformerLayer(hidden, 4 * hidden, max(1, hidden // 64), params_dtype=torch.bfloat16)
          for _ in range(layers)]).cuda()


def recipes(te_recipe) -> dict:
    out = {"delayed": te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16,
                                               amax_compute_algo="max")}
    if hasattr(te_recipe, "Float8CurrentScaling"):
        out["current"] = te_recipe.Float8CurrentScaling()
    if hasattr(te_recipe, "Float8BlockScaling") and torch.cuda.get_device_capability()[0] >= 9:
        out["block"] = te_recipe.Float8BlockScaling()
    if torch.cuda.get_device_capability()[0] >= 10:
        out["mxfp8"] = te_recipe.MXFP8BlockScaling()
        if hasattr(te_recipe, "NVFP4BlockScaling"):
            out["nvfp4"] = te_recipe.NVFP4BlockScaling()
    return out


def te_state(model) -> dict:
    """Each TE module's delayed-scaling state (copies)."""
    out = {}
    for name, m in model.named_modules():
        meta = getattr(m, "fp8_meta", None) or {}
        for key in ("scaling_fwd", "scaling_bwd"):
            if key in meta and hasattr(meta[key], "scale"):
                out[(name, key)] = (meta[key].scale.detach().clone().cpu(), meta[key].amax_history.detach().clone().cpu())
    return out


def train(te, model, recipe, run: str, steps: int, every: int, reduce: str = "none", check: bool = False):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    hidden = model[0].layernorm_mlp.fc1_weight.shape[1] if hasattr(model[0], "layernorm_mlp") else 256
    seq, batch = 128, 2
    states = []
    mon = fp8scope.Monitor(model, run, every=every, reduce=reduce, meta={"example": "te_hopper"})
    autocast = getattr(te, "autocast", None)
    for step in range(steps):
        x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16)
        before = te_state(model) if check else None
        ctx = autocast(enabled=True, recipe=recipe) if autocast else te.fp8_autocast(enabled=True, fp8_recipe=recipe)
        with ctx:
            y = model(x)
        loss = y.float().pow(2).mean()  # a stand-in objective: enough to exercise every GEMM
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if check:
            states.append((before, te_state(model)))
        mon.step(loss=loss.detach(), grad_norm=grad_norm, lr=3e-4)  # tensors: no host sync
    mon.close()
    return states


def check_delayed(model, df, states) -> list[str]:
    from fp8scope.capture.adapters.te import gemm_slots
    from fp8scope.capture.adapters.te_layout import installed_version, layout_for

    layout = layout_for(installed_version())
    where = {}  # (layer, tensor) -> (module name, key, slot)
    for name, m in model.named_modules():
        if (name, "scaling_fwd") not in states[-1][1]:
            continue
        for g in gemm_slots(name, m, layout):
            where[(g.name, "activation")] = (name, "scaling_fwd", g.input_slot)
            where[(g.name, "weight")] = (name, "scaling_fwd", g.weight_slot)
            where[(g.name, "gradient")] = (name, "scaling_bwd", g.grad_slot)
    bad = []
    for r in df.itertuples():
        if (r.layer, r.tensor) not in where or r.step == 0:
            continue
        mod, key, slot = where[(r.layer, r.tensor)]
        before, after = states[r.step]
        scale = float(before[(mod, key)][0][slot])
        recorded = float(after[(mod, key)][1][-1, slot])
        if r.scale != scale:
            bad.append(f"{r.layer} {r.tensor} step {r.step}: scale {r.scale} but TE used {scale}")
        if recorded > 0 and not math.isclose(r.amax, recorded, rel_tol=1e-6):
            bad.append(f"{r.layer} {r.tensor} step {r.step}: amax {r.amax} but TE recorded {recorded}")
    missing = set(where) - set(zip(df.layer, df.tensor))
    bad += [f"no row for {k}" for k in sorted(missing)]
    return bad


def check_run(name: str, model, df, states) -> list[str]:
    if df.empty:
        return [f"{name}: no rows"]
    bad = []
    if name == "delayed":
        bad += check_delayed(model, df, states)
    elif name == "nvfp4":  # a block scale rounded down may push a block's top value past 6: no overflow test
        if set(df.fp8_format) != {"e2m1"}:
            bad.append(f"rows in {sorted(set(df.fp8_format))}, not e2m1")
        if not {"activation@columnwise", "gradient@columnwise"} <= set(df.tensor):
            bad.append("no columnwise rows for the weight-gradient GEMM's operands")
    else:
        over = df[df.overflow.fillna(0) > 0]
        bad += [f"{r.layer} {r.tensor} step {r.step}: {int(r.overflow)} overflows under {name} scaling"
                for r in over.itertuples()]
    if name == "current":
        from fp8scope.emulate.scaling import te_scale_from_amax

        amax = torch.tensor(df.expected_amax.to_numpy(), dtype=torch.float32)
        for pow2 in (False, True):
            want = te_scale_from_amax(amax, 448.0, pow2=pow2).numpy()
            want_bwd = te_scale_from_amax(amax, 57344.0, pow2=pow2).numpy()
            ok = (df.scale.to_numpy() == want) | (df.scale.to_numpy() == want_bwd)
            if ok.all():
                break
        else:
            bad.append(f"current: {int((~ok).sum())} rows whose scale is not TE's rule of their amax")
    if name in ("mxfp8", "block"):
        if not any(t.endswith("@columnwise") for t in df.tensor):
            bad.append(f"{name}: no columnwise rows")
        pow2 = df.scale.map(lambda s: s > 0 and math.log2(s) == round(math.log2(s)))
        if not pow2.all():
            bad.append(f"{name}: {int((~pow2).sum())} scales that are not powers of two")
    return [f"{name}: {b}" for b in bad]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", default="runs/te_hopper")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--reduce", default="none", choices=["none", "aggregate", "both"])
    p.add_argument("--check", action="store_true", help="train under every supported recipe and check the rows")
    args = p.parse_args()

    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    if "RANK" in os.environ:
        torch.distributed.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not args.check:
        model = build(te, args.layers, args.hidden)
        if torch.distributed.is_initialized():
            model = torch.nn.parallel.DistributedDataParallel(model)
        train(te, model, recipes(te_recipe)["delayed"], args.run, args.steps, args.every, args.reduce)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(fp8scope.load_run(args.run).tensors(last=1)[["layer", "tensor", "amax", "scale", "overflow",
                                                              "sqnr_db"]])
        return
    problems = []
    for name, recipe in recipes(te_recipe).items():
        run = os.path.join(args.run, name)
        shutil.rmtree(run, ignore_errors=True)
        model = build(te, args.layers, args.hidden)
        states = train(te, model, recipe, run, args.steps, 1, check=True)
        df = fp8scope.load_run(run).tensors()
        found = check_run(name, model, df, states)
        print(f"{name}: {len(df)} rows, {len(found)} problems")
        problems += found
    for line in problems[:40]:
        print(line)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
