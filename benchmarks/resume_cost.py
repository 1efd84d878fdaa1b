"""What continuing a run costs the monitor: rebuilding its what-if tensors' delayed-scaling state
from the run's log (``fp8scope.resume.whatif_states``, once, when ``Monitor(step=N)`` opens a run
folder that logged earlier steps).

    .venv/bin/python benchmarks/make_big_run.py --source whatif --out /tmp/fp8scope-big-whatif   # once
    .venv/bin/python benchmarks/resume_cost.py [--run /tmp/fp8scope-big-whatif] [--step 9500]

Prints, per what-if history length, the seconds to read and rebuild every tensor's state, and the
rows the read keeps: those of the ``2 * amax_history_len`` steps before ``--step`` (every stream is
scanned; only their step and source columns are read in full).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8scope.emulate import DelayedScaling  # noqa: E402
from fp8scope.resume import whatif_states  # noqa: E402
from fp8scope.store.layout import list_streams  # noqa: E402


def rows_read(length: int, step: int, tensors: int) -> int:
    """The rows of the window ``whatif_states`` keeps (every tensor logged every step)."""
    return min(2 * length, step) * tensors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="/tmp/fp8scope-big-whatif")
    p.add_argument("--step", type=int, default=9500, help="the step the monitor continues from")
    p.add_argument("--lengths", default="16,1024", help="what-if amax_history_len values to time")
    args = p.parse_args(argv)
    streams = [s for s in list_streams(args.run) if s.rank == 0]
    if not streams:
        print(f"no streams in {args.run}: run benchmarks/make_big_run.py --source whatif --out {args.run} first")
        return 1
    print(f"run {args.run}, continued at step {args.step}")
    print("   history   tensors   seconds   rows kept")
    for length in (int(x) for x in args.lengths.split(",")):
        recipe = DelayedScaling(amax_history_len=length)
        t0 = time.perf_counter()
        states = whatif_states(streams, 0, args.step, recipe)
        took = time.perf_counter() - t0
        print(f"   {length:7d}   {len(states):7d}   {took:7.2f}   {rows_read(length, args.step, len(states)):>10,d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
