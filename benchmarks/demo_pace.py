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
import json, shutil, statistics, sys, tempfile, time
from fp8scope.demo.train import build, open_monitor, parse_args, train_steps

steps, every = int(sys.argv[1]), int(sys.argv[2])
run_dir = tempfile.mkdtemp(prefix="fp8scope-pace-")
args = parse_args(["--inject", "outlier:blocks.2.mlp.down:150", "--quiet", "--steps", str(steps),
                   "--run-dir", run_dir])
setup = build(args)
marks = []
t0 = time.perf_counter()
with open_monitor(setup, run_dir) as mon:
    result = train_steps(setup, steps, monitor=mon, on_step=lambda: marks.append(time.perf_counter()))
shutil.rmtree(run_dir, ignore_errors=True)
took = [marks[0] - t0] + [b - a for a, b in zip(marks, marks[1:])]
print(json.dumps({"loop": result.seconds, "step0": took[0],
                  "cheap": statistics.median([t for i, t in enumerate(took) if i > 1 and i % every]),
                  "full": statistics.median([t for i, t in enumerate(took) if i > 0 and i % every == 0])}))
"""


def run(tree: str, steps: int, every: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", RUN, str(steps), str(every)], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"a run in {tree} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", default="5602916~1", help="the other tree's commit")
    p.add_argument("--pairs", type=int, default=2, help="runs of each tree, alternating")
    p.add_argument("--steps", type=int, default=300, help="the demo's steps (its default)")
    args = p.parse_args(argv)
    every = 10  # the demo's full-stats interval (its --every default)
    with tempfile.TemporaryDirectory(prefix="fp8scope-against-") as other:
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.against], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", other], input=archive.stdout, check=True)
        results: dict[str, list[dict]] = {"this tree": [], args.against: []}
        for _ in range(args.pairs):
            results["this tree"].append(run(ROOT, args.steps, every))
            results[args.against].append(run(other, args.steps, every))
    print(f"the demo's training loop, {args.steps} steps, full stats every {every}th, {args.pairs} pairs of runs")
    print(f"{'':>14} {'loop s':>22} {'cheap ms':>22} {'full ms':>22} {'step 0 ms':>22}")
    for name, rs in results.items():
        cells = [", ".join(f"{r[k] * (1 if k == 'loop' else 1e3):.1f}" for r in rs) for k in ("loop", "cheap", "full", "step0")]
        print(f"{name:>14} " + " ".join(f"{c:>22}" for c in cells))
    ratios = [a["loop"] / b["loop"] for a, b in zip(results["this tree"], results[args.against])]
    print("loop ratio, each pair: " + ", ".join(f"{r:.3f}x" for r in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
