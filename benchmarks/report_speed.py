"""Time ``fp8scope events`` and ``fp8scope report`` on a big run as subprocesses; print seconds and peak RSS.

    .venv/bin/python benchmarks/make_big_run.py            # once: /tmp/fp8scope-big (10k steps x 500 tensors)
    .venv/bin/python benchmarks/report_speed.py [--run /tmp/fp8scope-big] [--repeat 2] [--html]
    .venv/bin/python benchmarks/report_speed.py --online RUN [--tile 16] [--steps 300] [--batch 10]

``--online RUN`` instead replays RUN's first ``--steps`` logged steps through ``OnlineDetector``
(what the detection thread does per step) and prints CPU ms per step; ``--tile K`` repeats
every step's tensors K times under new layer names (63 tensors x 16 = 1008).

Each command runs twice per try: *fresh*, with the run's cached analysis (``RUN/analysis/``)
deleted first, so that it detects over the whole run as the first command on a run does; then
*cached*, reading what the fresh one left.

Peak RSS is the child's ru_maxrss (resource.getrusage(RUSAGE_CHILDREN) after each run, which
is the max over children so far: each command runs in a fresh interpreter, measured in order);
CPU is its user + system time, less sensitive than wall time to other work on a shared machine.
The 1-minute load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time


def measure(cmd: list[str]) -> tuple[float, float, float, int]:
    """(wall s, CPU s, peak RSS MiB, exit code) of ``cmd``."""
    t0 = time.perf_counter()
    # a fresh process per measurement so RUSAGE_CHILDREN's max is this command's
    code = ("import resource, subprocess, sys, json; p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print(json.dumps([p.returncode, u.ru_maxrss, u.ru_utime + u.ru_stime]))")
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=True).stdout
    import json

    rc, rss_kb, cpu = json.loads(out.strip().splitlines()[-1])
    return time.perf_counter() - t0, cpu, rss_kb / 1024, rc


def online(run_dir: str, tile: int, n_steps: int, batch: int = 1) -> None:
    import logging

    import pyarrow as pa
    import pyarrow.compute as pc

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from fp8scope.detect.online import OnlineDetector
    from fp8scope.run import load_run

    logging.getLogger("fp8scope.detect").setLevel(logging.CRITICAL + 1)
    run = load_run(run_dir)
    t = run.table("tensors").drop_columns(["segment"])
    s = run.table("scalars").drop_columns(["segment"])
    steps = pc.unique(t["step"]).to_pylist()[:n_steps]
    batches = []
    for st in steps:
        tb = t.filter(pc.equal(t["step"], st))
        if tile > 1:
            li = tb.schema.get_field_index("layer")
            tb = pa.concat_tables([tb.set_column(li, "layer", pc.binary_join_element_wise(
                pa.scalar(f"r{i}."), tb["layer"], "")) for i in range(tile)])
        sb = s.filter(pc.equal(s["step"], st)).combine_chunks()
        batches.append((st, tb.combine_chunks().to_batches()[0], sb.to_batches()[0] if sb.num_rows else None))
    det = OnlineDetector()
    warm = min(5, len(batches) - 1)
    for b in batches[:warm]:
        det(b[0], 0, b[1], b[2])
    c0, w0 = time.process_time(), time.perf_counter()
    rest = [(b[0], 0, b[1], b[2]) for b in batches[warm:]]
    for i in range(0, len(rest), batch):  # as the detection thread hands them over: `batch` steps per pass
        det.process(rest[i:i + batch])
    n = len(batches) - warm
    print(f"online, {batch} step(s) per pass: {batches[0][1].num_rows} tensors/step, {n} steps: "
          f"{1e3 * (time.process_time() - c0) / n:.2f} ms CPU/step "
          f"({1e3 * (time.perf_counter() - w0) / n:.2f} ms wall), {len(det.events)} events")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run", default="/tmp/fp8scope-big")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--html", action="store_true", help="also time report --html")
    p.add_argument("--online", metavar="RUN", help="time OnlineDetector per step replaying RUN instead")
    p.add_argument("--tile", type=int, default=1, help="--online: repeat each step's tensors K times")
    p.add_argument("--steps", type=int, default=300, help="--online: steps to replay")
    p.add_argument("--batch", type=int, default=1, help="--online: steps per detection pass")
    args = p.parse_args(argv)
    if args.online:
        online(args.online, args.tile, args.steps, args.batch)
        return 0
    if not os.path.exists(os.path.join(args.run, "run.json")):
        print(f"no run at {args.run}; run benchmarks/make_big_run.py first", file=sys.stderr)
        return 2
    fp = [sys.executable, "-m", "fp8scope"]
    cmds = {
        "events": fp + ["events", args.run, "--severity", "warning", "--json"],
        "report": fp + ["report", args.run],
        "report --json": fp + ["report", args.run, "--json"],
    }
    if args.html:
        cmds["report --html"] = fp + ["report", args.run, "--html", "/tmp/fp8scope-big-report.html"]
    print(f"run: {args.run}  (cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.2f})")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from fp8scope.store.layout import analysis_dir

    cache = analysis_dir(args.run)  # the commands' cached analysis
    for name, cmd in cmds.items():
        for i in range(args.repeat):
            # fresh: the run's analysis computed by this command (the first command on a run); cached:
            # the same command again, reading the analysis the fresh one left
            for label in ("fresh", "cached"):
                if label == "fresh":
                    shutil.rmtree(cache, ignore_errors=True)
                s, cpu, rss, rc = measure(cmd)
                print(f"{name:15s} {label:6s} try {i + 1}: {s:6.2f} s  CPU {cpu:6.2f} s  peak RSS {rss:7.0f} MiB  "
                      f"rc={rc}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
