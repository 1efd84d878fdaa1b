"""The demo's training pace against another commit's, as ratios measured in one run.

Why: issue 15 asks that the demo (``fp8scope demo``: 300 steps of the emulated FP8 tiny GPT, full
stats every 10th, online detection, an outlier planted at step 150) keep its pace within 10 % of the
tree before the GPU-first capture work, whose CPU capture was a C kernel. Wall times of whole
commands on a shared VM move by a quarter between runs, so this times the demo's own training loop
(``demo.train.train_steps``, as the demo calls it, with its monitor) step by step, in a process of
its own per run, the two trees alternating; and it says where a difference is: the median cheap
step, the median full-stats step and step 0.

The other tree is taken from git (``git archive REV``) into a temporary directory and run with its
own ``fp8scope`` first on ``sys.path``; both use this environment's torch.

    python benchmarks/demo_pace.py                          # against 5602916~1, 2 pairs of runs
    python benchmarks/demo_pace.py --against HEAD~3 --pairs 3
    python benchmarks/demo_pace.py --host-bound --unmonitored   # the emulated layers' own host time

``--unmonitored`` runs the loop without a monitor: the emulated layers alone (their scaling state,
amax and round trips). ``--host-bound`` makes the demo model so small (d_model 16, batch 1 x 8
tokens, 2 heads, torch on one thread) that a step is its host work, as a small or compiled model's
step is on a GPU, where the host launches kernels while the GPU runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One run, in a child process whose sys.path starts with the tree under test. Only the demo's
# public entry points, which both trees have: parse_args, build, open_monitor, train_steps.
RUN = r"""
import contextlib, json, shutil, statistics, sys, tempfile, time
import torch
from fp8scope.demo.train import build, open_monitor, parse_args, train_steps

steps, every, monitored, extra = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", json.loads(sys.argv[4])
if extra:
    torch.set_num_threads(1)
run_dir = tempfile.mkdtemp(prefix="fp8scope-pace-")
args = parse_args(["--inject", "outlier:blocks.2.mlp.down:150", "--quiet", "--steps", str(steps),
                   "--run-dir", run_dir, *extra])
setup = build(args)
marks = []
t0 = time.perf_counter()
with (open_monitor(setup, run_dir) if monitored else contextlib.nullcontext()) as mon:
    result = train_steps(setup, steps, monitor=mon, on_step=lambda: marks.append(time.perf_counter()))
shutil.rmtree(run_dir, ignore_errors=True)
took = [marks[0] - t0] + [b - a for a, b in zip(marks, marks[1:])]
print(json.dumps({"loop": result.seconds, "step0": took[0],
                  "cheap": statistics.median([t for i, t in enumerate(took) if i > 1 and i % every]),
                  "full": statistics.median([t for i, t in enumerate(took) if i > 0 and i % every == 0])}))
"""


HOST_BOUND = ["--d-model", "16", "--batch-size", "1", "--seq-len", "8", "--n-heads", "2"]


def run(tree: str, steps: int, every: int, monitored: bool = True, extra: list[str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-c", RUN, str(steps), str(every), "1" if monitored else "0", json.dumps(extra or [])]
    out = subprocess.run(cmd, cwd=tree,
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"a run in {tree} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", default="5602916~1", help="the other tree's commit")
    p.add_argument("--pairs", type=int, default=2, help="runs of each tree, alternating")
    p.add_argument("--steps", type=int, default=300, help="the demo's steps (its default)")
    p.add_argument("--unmonitored", action="store_true", help="no monitor: the emulated layers alone")
    p.add_argument("--host-bound", action="store_true", help="the model so small that a step is host work")
    args = p.parse_args(argv)
    extra = HOST_BOUND if args.host_bound else []
    every = 10  # the demo's full-stats interval (its --every default)
    with tempfile.TemporaryDirectory(prefix="fp8scope-against-") as other:
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.against], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", other], input=archive.stdout, check=True)
        results: dict[str, list[dict]] = {"this tree": [], args.against: []}
        for _ in range(args.pairs):
            results["this tree"].append(run(ROOT, args.steps, every, not args.unmonitored, extra))
            results[args.against].append(run(other, args.steps, every, not args.unmonitored, extra))
    what = "unmonitored" if args.unmonitored else f"full stats every {every}th"
    size = ", host-bound (d_model 16, batch 1 x 8, one thread)" if args.host_bound else ""
    print(f"the demo's training loop{size}, {args.steps} steps, {what}, {args.pairs} pairs of runs")
    columns = [("loop s", "loop"), ("median step ms" if args.unmonitored else "cheap ms", "cheap"),
               *([] if args.unmonitored else [("full ms", "full")]), ("step 0 ms", "step0")]
    digits = 2 if args.host_bound else 1
    print(f"{'':>14} " + " ".join(f"{title:>22}" for title, _ in columns))
    for name, rs in results.items():
        cells = [", ".join(f"{r[k] * (1 if k == 'loop' else 1e3):.{digits}f}" for r in rs) for _, k in columns]
        print(f"{name:>14} " + " ".join(f"{c:>22}" for c in cells))
    ratios = [a["loop"] / b["loop"] for a, b in zip(results["this tree"], results[args.against])]
    print("loop ratio, each pair: " + ", ".join(f"{r:.3f}x" for r in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
