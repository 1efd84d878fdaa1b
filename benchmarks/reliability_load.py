"""Load benchmark: 8 writer processes log 2,000 tensors per step into one run while readers
(the CLI, load_run().refresh(), the dashboard's data layer) read it. Reports reader errors and the
writers' per-step write time with and without readers, interleaved in one run (phases alternate).

    .venv/bin/python benchmarks/reliability_load.py [--writers 8] [--tensors 2000] [--phase-s 6]
        [--rounds 3] [--step-ms 100] [--out results.json]

Writers: one process per rank; each step builds its 2,000-row tensors batch and scalars from a
stats matrix (what the monitor's writer thread does: step_records.tensor_batch) and appends them
with RunWriter; a training step is simulated by sleeping to the next --step-ms tick (a GPU step
does not use the host CPU). "write time" = build + append, measured per step.

Readers: one process per kind, started once after the writers; they open the run during a
warm-up (--warmup-s, 15 s), then read only in the "with readers" phases and idle in the others
(a quiet phase starts once every reader has finished its read in flight). The CLI reader runs
each command as a fresh process, like a user typing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def writer(rank: int, run: str, duration: float, step_ms: float, n_tensors: int, out: str) -> None:
    import numpy as np

    from fp8scope.step_payload import TensorKey
    from fp8scope.schema import N_FIELDS
    from fp8scope.step_records import scalar_batch, tensor_batch
    from fp8scope.store import RunWriter

    keys = [TensorKey(f"blocks.{i // 3}.mlp.fc{i % 2}", ("activation", "weight", "gradient")[i % 3], "emulated",
                      "e4m3", 448.0, (1024, 1024)) for i in range(n_tensors)]
    rng = np.random.default_rng(rank)
    w = RunWriter(run, rank)
    samples = []
    cache: dict = {}
    t_end = time.time() + duration
    step = 0
    next_tick = time.perf_counter()
    while time.time() < t_end:
        m = rng.random((n_tensors, N_FIELDS)) * 100
        g0 = gc.get_stats()[2]["collections"]
        t0, c0, u0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        tb = tensor_batch(step, rank, m, list(range(n_tensors)), keys, True, cache=cache)  # as the monitor's writer
        w.write("tensors", tb)
        w.write("scalars", scalar_batch(step, rank, ["loss", "lr"], [float(m[0, 0]), 1e-3], time.time()))
        dt, cpu, u1 = time.perf_counter() - t0, time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF)
        # what a slow write did: page faults (minor, major), involuntary context switches, kernel CPU s
        samples.append((time.time(), dt, cpu, u1.ru_minflt - u0.ru_minflt, u1.ru_majflt - u0.ru_majflt,
                        u1.ru_nivcsw - u0.ru_nivcsw, u1.ru_stime - u0.ru_stime,
                        gc.get_stats()[2]["collections"] - g0))
        step += 1
        next_tick += step_ms / 1000
        time.sleep(max(0.0, next_tick - time.perf_counter()))
    w.close()
    Path(out).write_text(json.dumps(samples))


def reader(kind: str, run: str, ctl: str, out: str) -> None:
    """One reader for the whole benchmark: it reads while ``ctl/active`` exists and idles (after
    saying so in ``ctl/idle-<kind>``) while it does not; ``ctl/stop`` ends it. Started once, so the
    phases compare steady reading with none, not a reader's start-up (an opened dashboard stays
    open; see --cold for what opening costs)."""
    import fp8scope

    # As the product's readers do: they yield only when asked (FP8SCOPE_NICE, --nice;
    # fp8scope/priority.py). The CLI reader's commands run in fresh processes and read the same
    # environment; --nice N sets it for every reader.
    if kind != "cli" and os.environ.get("FP8SCOPE_NICE"):
        fp8scope.yield_to_training()
    ctl_dir = Path(ctl)
    errors, n = [], 0
    state: dict = {}

    def once() -> float:
        """One read of the run; returns the pause before the next one."""
        if kind == "api":
            if "run" not in state:
                state["run"] = fp8scope.load_run(run)
            else:
                state["run"].refresh()
            state["run"].tensors(last=1)
            state["run"].info()
            return 0.5
        if kind == "dashboard":
            from dashboard import queries as Q
            from dashboard import runstatus as S
            from dashboard.runcache import RunCache

            cache = state.setdefault("cache", RunCache(warm=Q.warm_up))
            p = Path(run)
            e = cache.get(p)
            cache.refresh(p, force=True)
            S.run_status(p, cache)
            Q.heatmap_frame(e, "log2_amax", None)
            Q.scalars_frame(e)
            return 2.0  # the dashboard's default refresh interval
        # cli: a fresh process each time, like a user typing
        for args in (["info", run], ["tensors", run, "--last", "1", "--csv"]):
            r = subprocess.run([sys.executable, "-m", "fp8scope", *args], capture_output=True, text=True, cwd=ROOT)
            if r.returncode != 0:
                raise RuntimeError(r.stderr.strip()[:300])
        return 1.0

    idle = ctl_dir / f"idle-{kind}"
    while not (ctl_dir / "stop").exists():
        if not (ctl_dir / "active").exists():
            idle.touch()
            time.sleep(0.05)
            continue
        idle.unlink(missing_ok=True)
        try:
            pause = once()
            n += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
            pause = 0.5
        t_end = time.time() + pause
        while time.time() < t_end and (ctl_dir / "active").exists():
            time.sleep(0.05)
    Path(out).write_text(json.dumps({"kind": kind, "reads": n, "errors": errors}))


def run_load(writers=8, tensors=2000, phase_s=6.0, rounds=3, step_ms=100.0, readers=("cli", "api", "dashboard"),
             work: str | None = None, warmup_s: float = 15.0) -> dict:
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="fp8load-"))
    try:
        return _run_load(work, writers, tensors, phase_s, rounds, step_ms, readers, warmup_s)
    finally:
        if own:  # ~1 GB per run: left behind, later runs measure the kernel's dirty-page writeback
            shutil.rmtree(work, ignore_errors=True)


def _run_load(work: Path, writers, tensors, phase_s, rounds, step_ms, readers, warmup_s) -> dict:
    from fp8scope.store import new_manifest, write_manifest

    run = work / "run"
    write_manifest(run, new_manifest(world_size=writers))
    warmup_s = warmup_s if readers else 0.0
    duration = phase_s * 2 * rounds + warmup_s + 10
    me = str(Path(__file__).resolve())
    wprocs = [subprocess.Popen([sys.executable, me, "--_writer", str(r), str(run), str(duration), str(step_ms),
                                str(tensors), str(work / f"w{r}.json")], cwd=ROOT) for r in range(writers)]
    deadline = time.time() + 120  # wait until every writer has written its first step
    while time.time() < deadline and len(list((run / "streams").glob("tensors-*"))) < writers:
        time.sleep(0.1)
    ctl = work / "ctl"
    ctl.mkdir()
    (ctl / "active").touch()  # warm-up: the readers open the run (not measured)
    rprocs = [subprocess.Popen([sys.executable, me, "--_reader", kind, str(run), str(ctl),
                                str(work / f"r-{kind}.json")], cwd=ROOT) for kind in readers]
    time.sleep(warmup_s)
    phases = []  # (start, end, with_readers)
    try:
        for k in range(rounds):
            for with_readers in (False, True):  # interleaved: A B A B ...
                if with_readers:
                    (ctl / "active").touch()
                else:
                    (ctl / "active").unlink(missing_ok=True)
                    t_wait = time.time() + 120  # an in-flight read finishes before the quiet phase starts
                    while time.time() < t_wait and not all((ctl / f"idle-{kind}").exists() for kind in readers):
                        time.sleep(0.05)
                t0 = time.time()
                time.sleep(phase_s)
                phases.append((t0, time.time(), with_readers))
    finally:
        (ctl / "stop").touch()
        for p in rprocs:
            p.wait(timeout=300)
        for p in wprocs:
            p.wait(timeout=duration + 120)
    reader_results = [json.loads((work / f"r-{kind}.json").read_text()) for kind in readers]
    samples = []
    for r in range(writers):
        samples += json.loads((work / f"w{r}.json").read_text())

    def phase_writes(a, b, col):  # write times (ms) in one phase
        return [row[col] * 1000 for row in samples if a <= row[0] < b]

    def summ(x):
        if not x:
            return {"n": 0}
        x = sorted(x)
        return {"n": len(x), "mean_ms": round(statistics.fmean(x), 3), "median_ms": round(statistics.median(x), 3),
                "p95_ms": round(x[int(0.95 * (len(x) - 1))], 3), "p99_ms": round(x[int(0.99 * (len(x) - 1))], 3),
                "max_ms": round(x[-1], 1), "over_10ms": sum(v > 10 for v in x)}

    def pooled(flag, col):
        return [v for a, b, f in phases if f == flag for v in phase_writes(a, b, col)]

    def paired(stat, col):
        """Median over rounds of stat(with readers) / stat(without) in the same round: adjacent phases
        share the machine's state of the moment (a shared VM drifts by more than the effect measured)."""
        ratios = []
        for (a0, b0, _), (a1, b1, _) in zip(phases[0::2], phases[1::2]):
            off, on = phase_writes(a0, b0, col), phase_writes(a1, b1, col)
            if off and on:
                ratios.append(stat(on) / stat(off))
        return round(100 * (statistics.median(ratios) - 1), 1) if ratios else None

    a, b = pooled(False, 1), pooled(True, 1)
    slow = [row for row in samples if row[1] > 0.010]  # the writes over 10 ms, whatever the phase

    def slow_writes() -> dict:
        if not slow:
            return {"n": 0}
        pick = lambda i: round(statistics.median(r[i] for r in slow), 4)  # noqa: E731
        return {"n": len(slow), "median_wall_ms": round(1000 * pick(1), 1), "median_cpu_ms": round(1000 * pick(2), 1),
                "median_kernel_cpu_ms": round(1000 * pick(6), 1), "median_minor_faults": pick(3),
                "median_major_faults": pick(4), "median_involuntary_switches": pick(5),
                "typical_write_minor_faults": statistics.median(r[3] for r in samples),
                "with_full_gc": sum(r[7] > 0 for r in slow), "full_gcs_in_all_writes": sum(r[7] for r in samples)}

    p95 = lambda x: sorted(x)[int(0.95 * (len(x) - 1))]  # noqa: E731

    import fp8scope

    final = fp8scope.load_run(run).info()
    errors = [e for r in reader_results for e in r["errors"]]
    return {
        "writers": writers, "tensors_per_step": tensors, "step_ms": step_ms, "phase_s": phase_s, "rounds": rounds,
        "without_readers": summ(a), "with_readers": summ(b),
        "cpu_without_readers": summ(pooled(False, 2)), "cpu_with_readers": summ(pooled(True, 2)),
        "slowdown_mean_pct": round(100 * (statistics.fmean(b) / statistics.fmean(a) - 1), 1) if a and b else None,
        "slowdown_median_pct": round(100 * (statistics.median(b) / statistics.median(a) - 1), 1) if a and b else None,
        "paired_slowdown_median_pct": paired(statistics.median, 1),
        "paired_slowdown_mean_pct": paired(statistics.fmean, 1),
        "paired_slowdown_p95_pct": paired(p95, 1),
        "paired_cpu_slowdown_median_pct": paired(statistics.median, 2),
        "slow_writes": slow_writes(),
        "per_phase": [{"with_readers": f, "mean_ms": round(statistics.fmean(w), 3),
                       "median_ms": round(statistics.median(w), 3), "max_ms": round(max(w), 1)}
                      for a, b, f in phases if (w := phase_writes(a, b, 1))],
        "reads": {k: sum(r["reads"] for r in reader_results if r["kind"] == k) for k in readers},
        "reader_errors": errors, "rows_written": final["tables"], "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 1),
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_writer":
        a = sys.argv[2:]
        writer(int(a[0]), a[1], float(a[2]), float(a[3]), int(a[4]), a[5])
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--_reader":
        reader(*sys.argv[2:6])
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--phase-s", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--warmup-s", type=float, default=15.0, help="readers open the run first, unmeasured")
    ap.add_argument("--readers", default="cli,api,dashboard", help="comma-separated: cli, api, dashboard")
    ap.add_argument("--nice", type=int, default=None,
                    help="readers run at this niceness (FP8SCOPE_NICE); default: not niced, the product's default")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.nice is not None:  # inherited by every reader process
        os.environ["FP8SCOPE_NICE"] = str(args.nice)
    else:
        os.environ.pop("FP8SCOPE_NICE", None)
    res = run_load(args.writers, args.tensors, args.phase_s, args.rounds, args.step_ms,
                   readers=tuple(r for r in args.readers.split(",") if r), warmup_s=args.warmup_s)
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
