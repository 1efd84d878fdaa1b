"""Overhead of fp8scope.Monitor on the tiny GPT, as ratios measured in one run.

Configurations, all trained from the same seed and timed interleaved (round-robin blocks of
steps, so machine noise hits them alike):

- ``plain``     no monitor
- ``default``   Monitor() defaults: cheap stats every step, full stats every 50th step and on
                the 2 steps after a suspicious one, online detection on
- ``full``      Monitor(every=1): full stats every step (the stats pass compiled by inductor;
                ``FP8SCOPE_COMPILE=0`` times it eager)
- ``naive``     the obvious hand-written alternative: forward/backward hooks computing the same
                numbers with one ``.item()`` per number, appended to a JSON-lines file
- ``floor``     (what-if model only) hooks that only read each tensor's amax once per step: the
                least any what-if monitor must do, so the floor of its overhead on this machine

for two models: the tiny GPT in emulated FP8 (delayed scaling) and the same GPT in plain
FP32 with what-if stats. Then the stats alone over one step's tensors against one plain
read pass (``x.abs().amax()``) over the same tensors.

    python benchmarks/overhead.py              # ~3-4 minutes on a 2-core CPU
    python benchmarks/overhead.py --quick      # smoke run
    python benchmarks/overhead.py --models off --only-default --phases   # where what-if time goes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8scope  # noqa: E402
from fp8scope.capture.stats import full_stats  # noqa: E402
from fp8scope.emulate.amax import logged_amax  # noqa: E402
from fp8scope.demo import train  # noqa: E402
from fp8scope.formats import get_format  # noqa: E402


class NaiveMonitor:
    """What people write by hand: hooks, a .item() per number, a JSON line per step."""

    def __init__(self, model, path):
        self.rows: list[dict] = []
        self.file = open(path, "w")
        self.handles = []
        self.e4m3, self.e5m2 = get_format("e4m3"), get_format("e5m2")
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
                self.handles.append(mod.register_forward_hook(self._post(name)))

    def _stats(self, layer, role, x, fmt):
        x = x.detach().float()
        amax = x.abs().max().item()
        scale = fmt.max / amax if amax > 0 and amax == amax and amax != float("inf") else 1.0
        y = x * scale
        q = y.clamp(-fmt.max, fmt.max).to(fmt.dtype).float() / scale
        self.rows.append({
            "layer": layer, "role": role, "amax": amax, "scale": scale,
            "overflow": (y.abs() > fmt.max).sum().item(),
            "underflow": ((x != 0) & (q == 0)).sum().item(),
            "saturated": (q.abs() * scale >= fmt.max).sum().item(),
            "zeros": (x == 0).sum().item(),
            "nonfinite": (~torch.isfinite(x)).sum().item(),
            "mse": ((q - x) ** 2).mean().item(),
        })

    def _pre(self, name):
        def hook(mod, args):
            if torch.is_grad_enabled():
                self._stats(name, "activation", args[0], self.e4m3)
                self._stats(name, "weight", mod.weight, self.e4m3)
        return hook

    def _post(self, name):
        def hook(mod, args, out):
            if out.requires_grad:
                out.register_hook(lambda g: self._stats(name, "gradient", g, self.e5m2))
        return hook

    def step(self, loss=None, **kw):
        self.file.write(json.dumps({"loss": float(loss), "tensors": self.rows}) + "\n")
        self.file.flush()
        self.rows = []


CONFIGS = ("plain", "default", "full", "naive")


class AmaxFloor:
    """The least a what-if monitor must do: one amax pass per activation, weight and gradient per
    step (one reduction, no host read), nothing else, for the plain model. Its step time over the
    plain one is the floor of any what-if overhead on this machine."""

    def __init__(self, model):
        self.amaxes: list[float] = []
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_pre_hook(self._pre)
                mod.register_forward_hook(self._post)

    @staticmethod
    def _amax(x):
        lo, hi = torch.aminmax(x.detach())  # the what-if monitor's own eager amax pass
        return hi, lo

    def _pre(self, mod, args):
        self.amaxes.append(self._amax(args[0]))
        self.amaxes.append(self._amax(mod.weight))

    def _post(self, mod, args, out):
        node, nr = out.grad_fn, out.output_nr
        node.register_prehook(lambda grads: self.amaxes.append(self._amax(grads[nr])) and None)

    def step(self, loss=None, **kw):
        self.amaxes.clear()


def make_setups(fp8: str, tmp: str, size: dict, configs=CONFIGS):
    out = {}
    for cfg in configs:
        setup = train.build(fp8=fp8, quiet=True, **size)
        if cfg == "plain":
            mon = None
        elif cfg == "naive":
            mon = NaiveMonitor(setup.model, os.path.join(tmp, f"{fp8}-naive.jsonl"))
        elif cfg == "floor":
            mon = AmaxFloor(setup.model)
        else:
            recipe = setup.recipe or train.make_recipe(argparse.Namespace(**{**vars(setup.args), "fp8": "delayed"}))
            kw = {} if cfg == "default" else {"every": 1}  # "default": the Monitor's own defaults
            mon = fp8scope.Monitor(setup.model, os.path.join(tmp, f"{fp8}-{cfg}"), recipe=recipe, **kw)
        out[cfg] = (setup, mon)
    return out


def settle_gc() -> None:
    """One full collection now, before the timed blocks. Why: CPython runs a full collection (every
    object in the process: about 180 ms for the narrow Llama's 420k, seconds on a training job's
    heap) once the objects that survived since the last one reach a quarter of the rest. Setting
    up a monitor makes such objects, so that collection came a few steps later, inside a timed
    block of the monitored model (the narrow Llama: at its step 10, +3.6 ms on each of 50 timed
    steps), where it measured a one-time cost as a per-step one. In a steady run no full collection
    follows it (none in 190 steps there)."""
    gc.collect()


def time_interleaved(setups, rounds: int, block: int, warmup: int,
                     sync=None, step_fn=None, around_block=None) -> tuple[dict[str, float], dict[str, float]]:
    """Median step time per configuration, and the paired ratio to ``plain``: the median over rounds
    of (this configuration's block / plain's block in the same round). Adjacent blocks see the same
    machine, so the paired ratio cancels the slow drifts of a shared VM that the medians keep.
    ``sync``: called before reading the clock (``torch.cuda.synchronize`` on a GPU). ``step_fn(setup,
    step, monitor)``: one training step (the demo's ``train.train_step`` unless given).
    ``around_block(name)``: called before each timed block, returns what to call after it
    (``step_profile.py`` reads the threads' CPU time there)."""
    step_fn = step_fn or train.train_step
    per_step: dict[str, list[float]] = {k: [] for k in setups}
    step = {k: 0 for k in setups}
    for k, (s, m) in setups.items():  # warm-up: allocator, first-step costs
        for _ in range(warmup):
            step_fn(s, step[k], m)
            step[k] += 1
    settle_gc()
    order = list(setups)
    for r in range(rounds):
        order = order[1:] + order[:1]  # rotate who goes first
        for k in order:
            s, m = setups[k]
            after = around_block(k) if around_block is not None else None
            t0 = time.perf_counter()
            for _ in range(block):
                step_fn(s, step[k], m)
                step[k] += 1
            if sync is not None:
                sync()
            per_step[k].append((time.perf_counter() - t0) / block)
            if after is not None:
                after()
    medians = {k: statistics.median(v) for k, v in per_step.items()}
    paired = {k: statistics.median(a / b for a, b in zip(v, per_step["plain"])) for k, v in per_step.items()}
    return medians, paired


PHASES = ("forward", "backward", "optimizer", "mon.step")


def time_phases(setups, rounds: int, block: int, warmup: int) -> dict[str, dict[str, float]]:
    """Mean ms per phase of a step (train_step's marks), per configuration, interleaved as
    :func:`time_interleaved`: where a monitor's time goes in situ (the forward and backward
    carry its hooks, ``mon.step`` its end of step)."""
    spans: dict[str, list[list[float]]] = {k: [[] for _ in PHASES] for k in setups}
    step = {k: 10**6 for k in setups}  # past the warm-up of the main timing: no first-step costs
    order = list(setups)
    for r in range(rounds + 1):
        order = order[1:] + order[:1]
        if r == 1:
            settle_gc()
        for k in order:
            s, m = setups[k]
            for _ in range(block if r else warmup):
                marks: list[float] = []
                train.train_step(s, step[k], m, marks=marks)
                step[k] += 1
                if r:  # round 0 warms up
                    for i in range(len(PHASES)):
                        spans[k][i].append(marks[i + 1] - marks[i])
    return {k: {p: statistics.mean(v[i]) * 1e3 for i, p in enumerate(PHASES)} for k, v in spans.items()}


def print_phases(phases: dict[str, dict[str, float]]) -> None:
    print("  in situ, mean ms per phase (and extra over plain):")
    base = phases["plain"]
    for k, ph in phases.items():
        cells = "  ".join(f"{p} {ph[p]:6.2f}" + (f" ({ph[p] - base[p]:+5.2f})" if k != "plain" else " " * 8)
                          for p in PHASES)
        total = sum(ph.values())
        print(f"    {k:8s} {cells}  total {total:6.2f}" + (f" ({total - sum(base.values()):+5.2f})" if k != "plain" else ""))


def step_tensors(fp8: str, size: dict):
    """The activations, weights and gradients of one training step, with their formats."""
    setup = train.build(fp8=fp8, quiet=True, **size)
    got = []
    e4, e5 = get_format("e4m3"), get_format("e5m2")
    hs = []
    for mod in setup.model.modules():
        if isinstance(mod, torch.nn.Linear):
            hs.append(mod.register_forward_pre_hook(lambda m, a: got.extend([(a[0].detach(), e4), (m.weight.detach(), e4)])))
            def on_output(m, a, o):  # must return None, or the handle would replace the output
                o.register_hook(lambda g: got.append((g.detach(), e5)))

            hs.append(mod.register_forward_hook(on_output))
    train.train_step(setup, 0, None)
    for h in hs:
        h.remove()
    return got


def time_stats(tensors, reps: int) -> dict[str, float]:
    def run(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    one = torch.tensor(1.0)

    def eager():
        old = os.environ.get("FP8SCOPE_COMPILE")
        os.environ["FP8SCOPE_COMPILE"] = "0"
        try:
            from fp8scope.capture.stats import FULL_STATS

            return [FULL_STATS.fallback((x.device.type, x.dtype, f.name, False, False))(x.reshape(-1), one, one, one, None)
                    for x, f in tensors]
        finally:
            os.environ["FP8SCOPE_COMPILE"] = old or "sync"

    return {
        "read pass x.abs().amax()": run(lambda: [x.abs().amax() for x, _ in tensors]),
        "cheap capture (what-if amax)": run(lambda: torch.stack([logged_amax(x) for x, _ in tensors])),
        "full stats": run(lambda: [full_stats(x, one, one, one, f) for x, f in tensors]),
        "full stats, eager": run(eager),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="delayed,off",
                    help="which models: delayed (emulated FP8), off (plain FP32, what-if); default both")
    ap.add_argument("--only-default", action="store_true",
                    help="time plain and (a) only, and skip the stats-alone table (quicker A/B runs)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the phases of a step (forward, backward, optimizer, mon.step) in situ")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.block, args.warmup = 2, 2, 1
    size = {}  # the demo's default tiny GPT
    os.environ.setdefault("FP8SCOPE_COMPILE", "sync")  # the stats compiled before the first timed step
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu; stats pass: "
          f"FP8SCOPE_COMPILE={os.environ['FP8SCOPE_COMPILE']}")
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models.split(",")
        for fp8, label in (("delayed", "tiny GPT, emulated FP8 (delayed scaling)"),
                           ("off", "tiny GPT, plain FP32, what-if stats")):
            if fp8 not in models:
                continue
            configs = ("plain", "default") if args.only_default else CONFIGS
            if fp8 == "off":
                configs += ("floor",)
            setups = make_setups(fp8, tmp, size, configs)
            t, pr = time_interleaved(setups, args.rounds, args.block, args.warmup)
            phases = time_phases(setups, args.rounds, args.block, args.warmup) if args.phases else None
            for _, m in setups.values():
                if isinstance(m, fp8scope.Monitor):
                    m.close()
            n = len(fp8scope.load_run(os.path.join(tmp, f"{fp8}-default")).manifest["tensors"])
            print(f"\n{label}: {n} monitored tensors, median step time")
            print(f"  plain (no monitor)        {t['plain'] * 1e3:8.1f} ms")
            for k, label in (("default", "(a) default sampling"), ("full", "(b) full stats every step"),
                             ("naive", "naive .item() hooks"), ("floor", "floor: amax pass per tensor")):
                if k in t:
                    print(f"  {label:25s} {t[k] * 1e3:8.1f} ms   ratio {t[k] / t['plain']:.3f}x"
                          f"   paired {pr[k]:.3f}x")
            if "naive" in t:
                print(f"  ours full / naive         {t['full'] / t['naive']:.3f}x")
            if "floor" in t:
                print(f"  (a) / floor               {t['default'] / t['floor']:.3f}x   paired "
                      f"{pr['default'] / pr['floor']:.3f}x  (what the monitor adds beyond reading each tensor once)")
            if phases is not None:
                print_phases(phases)
        if args.only_default:
            return 0
        tensors = step_tensors("delayed", size)
        st = time_stats(tensors, reps=3 if args.quick else 10)
        base = st["read pass x.abs().amax()"]
        print(f"\nstats alone over one step's {len(tensors)} tensors "
              f"({sum(x.numel() for x, _ in tensors) / 1e6:.1f} M elements)")
        for k, v in st.items():
            print(f"  {k:26s} {v * 1e3:8.2f} ms   {v / base:.2f}x one read pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
