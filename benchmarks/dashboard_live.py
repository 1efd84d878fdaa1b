"""The dashboard's live refresh on a multi-rank run being written: CPU per refresh as the run grows.

8 writer processes (the load benchmark's writers: 2,000 tensors per step, one step per 100 ms each)
write a fresh run while this process does, every 2 s, what an open dashboard does on its refresh
interval: ``RunCache.refresh``, the run's status, the amax heatmap and the scalar lines. Prints, per
refresh, the CPU seconds it took and the rows the run had, and whether the rollup was updated in
place or rebuilt.

    .venv/bin/python benchmarks/dashboard_live.py [--seconds 40] [--writers 8] [--tensors 2000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=2000)
    args = ap.parse_args()

    from dashboard import queries as Q
    from dashboard import rollup as R
    from dashboard import runstatus as S
    from dashboard.runcache import RunCache
    from fp8scope.store import new_manifest, write_manifest

    work = Path(tempfile.mkdtemp(prefix="fp8live-"))
    try:
        run = work / "run"
        write_manifest(run, new_manifest(world_size=args.writers))
        load = str(ROOT / "benchmarks" / "reliability_load.py")
        writers = [subprocess.Popen([sys.executable, load, "--_writer", str(r), str(run), str(args.seconds), "100",
                                     str(args.tensors), str(work / f"w{r}.json")]) for r in range(args.writers)]
        time.sleep(5)
        cache = RunCache()
        t_end = time.time() + args.seconds - 6
        last = None
        print("cpu_s  rows        rollup")
        while time.time() < t_end:
            c0 = time.process_time()
            e = cache.get(run)
            cache.refresh(run, force=True)
            S.run_status(run, cache)
            Q.heatmap_frame(e, "log2_amax", None)
            Q.scalars_frame(e)
            r = R.rollup(e)
            how = "built" if r is not last else f"updated ({r.updates})"
            last = r
            print(f"{time.process_time() - c0:5.2f}  {e.run.table('tensors').num_rows:10d}  {how}", flush=True)
            time.sleep(2)
        for w in writers:
            w.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
