"""Time ``fp8scope events`` and ``fp8scope report`` on a big run as subprocesses; print seconds and peak RSS.

    .venv/bin/python benchmarks/make_big_run.py            # once: /tmp/fp8scope-big (10k steps x 500 tensors)
    .venv/bin/python benchmarks/report_speed.py [--run /tmp/fp8scope-big] [--repeat 2] [--html]

Peak RSS is the child's ru_maxrss (resource.getrusage(RUSAGE_CHILDREN) after each run, which
is the max over children so far: each command runs in a fresh interpreter, measured in order).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def measure(cmd: list[str]) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    # a fresh process per measurement so RUSAGE_CHILDREN's max is this command's
    code = ("import resource, subprocess, sys, json; p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "print(json.dumps([p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))")
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=True).stdout
    import json

    rc, rss_kb = json.loads(out.strip().splitlines()[-1])
    return time.perf_counter() - t0, rss_kb / 1024, rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run", default="/tmp/fp8scope-big")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--html", action="store_true", help="also time report --html")
    args = p.parse_args(argv)
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
    print(f"run: {args.run}  (cores: {os.cpu_count()})")
    for name, cmd in cmds.items():
        for i in range(args.repeat):
            s, rss, rc = measure(cmd)
            print(f"{name:15s} try {i + 1}: {s:6.2f} s  peak RSS {rss:7.0f} MiB  rc={rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
