"""What-if delayed scaling off the CPU: one ScalingState per tensor against the batched
DeviceDelayedBank, on one training step's real tensors of the tiny GPT (63: every Linear's
activation, weight and gradient).

For each way, per step: the aten operations dispatched, and those that are not views (on a GPU
each of these is about one kernel launch, each launch microseconds of the training thread) and the time of the captures plus the
step's end (stacking the rows for the one transfer), measured in one run, interleaved.

    python benchmarks/whatif_device_bank.py                 # CUDA if available, else CPU
    python benchmarks/whatif_device_bank.py --device cpu --steps 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8scope.demo import train  # noqa: E402
from fp8scope.emulate import DelayedScaling, ScalingState  # noqa: E402
from fp8scope.emulate.device_bank import DeviceDelayedBank  # noqa: E402
from fp8scope.formats import get_format  # noqa: E402


class CountOps(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, and those that compute (not views: on a
    GPU each of these is about one kernel launch)."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if not func.is_view and func.overloadpacket not in (torch.ops.aten.detach, torch.ops.aten.alias):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def step_tensors(device: str) -> list[tuple[torch.Tensor, object]]:
    """One step's activations, weights and gradients of the plain-FP32 tiny GPT, with their formats."""
    setup = train.build(fp8="off", quiet=True)
    e4, e5 = get_format("e4m3"), get_format("e5m2")
    got: list = []
    for mod in setup.model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(lambda m, a: got.extend([(a[0].detach(), e4), (m.weight.detach(), e4)]))

            def on_output(m, a, o):
                o.register_hook(lambda g: got.append((g.detach(), e5)))

            mod.register_forward_hook(on_output)
    train.train_step(setup, 0, None)
    return [(x.to(device), f) for x, f in got]


def per_tensor(tensors, recipe, device):
    states = [ScalingState(recipe, f, device=device) for _, f in tensors]

    def step():
        rows = []
        for (x, _), st in zip(tensors, states):
            st.begin(x, record=True)
            rows.extend(st.latest())
        return torch.stack(rows).view(-1, 4)

    return step


def batched(tensors, recipe, device):
    bank = DeviceDelayedBank(recipe, device)
    slots = [bank.add(f) for _, f in tensors]

    def step():
        for s, (x, _) in zip(slots, tensors):
            bank.capture(s, x)
        return bank.take_rows()

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    tensors = step_tensors(args.device)
    recipe = DelayedScaling(amax_history_len=1024)  # TE's default history length
    ways = {"one ScalingState per tensor": per_tensor(tensors, recipe, args.device),
            "DeviceDelayedBank": batched(tensors, recipe, args.device)}
    ops, times = {}, {k: [] for k in ways}
    for name, step in ways.items():
        step()  # first step: allocations, index plans
        with CountOps() as c:
            step()
        ops[name] = (c.n, c.kernels)
    for _ in range(args.rounds):  # interleaved blocks
        for name, step in ways.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps)
    print(f"torch {torch.__version__}, device {args.device}, {len(tensors)} tensors, amax_history_len 1024")
    base = statistics.median(times["one ScalingState per tensor"])
    for name in ways:
        t = statistics.median(times[name])
        print(f"  {name:28s} {ops[name][0]:6d} aten ops/step ({ops[name][1]:5d} not views)   {t * 1e3:7.3f} ms/step"
              f"   {t / base:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
