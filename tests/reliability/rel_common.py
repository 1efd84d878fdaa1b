"""Shared machinery for the reliability suite: the crash campaign and run-folder checks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTHON = sys.executable
N_TENSORS = 9  # tests.conftest.MLP: 3 FP8 linears x (activation, weight, gradient)


def cli(*args, timeout: float = 120, cwd=ROOT) -> subprocess.CompletedProcess:
    """The real `fp8scope` CLI in a subprocess."""
    return subprocess.run([PYTHON, "-m", "fp8scope", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def cli_inproc(*args) -> tuple[int, str, str]:
    """The CLI's main() in this process (same code path as the console script, no interpreter start-up)."""
    from fp8scope.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def assert_one_line_error(rc: int, stderr: str, needle: str | None = None) -> None:
    assert rc not in (0, None), f"expected a failure, got rc={rc}"
    assert "Traceback" not in stderr, stderr
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {stderr!r}"
    assert "internal error" not in stderr, f"uncaught exception reached the CLI: {stderr.strip()}"
    if needle:
        assert needle in stderr, stderr


def dashboard_loader():
    """The dashboard's data layer (dashboard/), if present: a callable(run_dir) that computes what its
    pages show (status row, heatmaps, lines, events, outliers, the verdict's analysis). None if absent."""
    try:
        from dashboard import outliers as O
        from dashboard import queries as Q
        from dashboard import runstatus as S
        from dashboard import verdict as V
        from dashboard.rollup import NoData
        from dashboard.runcache import RunCache
    except Exception:
        return None

    def load(path) -> dict:
        path = Path(path)
        status = S.run_status(path)  # the Runs view: never raises, says "error" in one line
        if status["status"] == "error":
            assert status["error"] and "\n" not in status["error"], status
        cache = RunCache()
        e = cache.get(path)  # a page on one run: RunError for a broken one
        S.run_status(path, cache)
        a = V.analyser(e)
        a.request(e, False)
        if a.thread is not None:
            a.thread.join(120)
        for fn in (
            lambda: Q.step_span(e), lambda: Q.roles(e), lambda: Q.layer_order(e),
            lambda: Q.heatmap_frame(e, "log2_amax", None), lambda: Q.heatmap_frame(e, "overflow_pct", "gradient"),
            lambda: Q.heatmap_frame(e, "sqnr_db", None), lambda: Q.scalars_frame(e), lambda: V.events(e),
            lambda: O.outliers(e), lambda: Q.nonfinite_cells(e, None),
        ):
            try:
                fn()
            except NoData:
                pass
        cache.refresh(path, force=True)
        return status

    return load


# ---- fork server ---------------------------------------------------------------------------
class ForkServer:
    """One long-lived interpreter with torch imported; every job is a fork()ed child we can SIGKILL."""

    def __init__(self):
        self.proc = subprocess.Popen([PYTHON, str(HERE / "rel_forkserver.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, bufsize=0)
        self.events: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        self._n = 0

    def _q(self, jid: str) -> queue.Queue:
        with self.lock:
            return self.events.setdefault(jid, queue.Queue())

    def _pump(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            self._q(msg["id"]).put(msg)

    def _pump_err(self) -> None:
        for raw in self.proc.stderr:
            self.stderr_lines.append(raw.decode(errors="replace"))

    def submit(self, job: dict) -> "Job":
        self._n += 1
        job = {**job, "id": f"j{self._n}"}
        q = self._q(job["id"])
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        msg = q.get(timeout=60)
        assert "pid" in msg, msg
        return Job(job["id"], msg["pid"], q)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()


class Job:
    def __init__(self, jid: str, pid: int, q: queue.Queue):
        self.id, self.pid, self.q = jid, pid, q
        self.returned: list[int] = []
        self.steps: list[int] = []
        self.summary: dict | None = None
        self.done: int | None = None
        self.error: str | None = None
        self.killed = False

    def _take(self, timeout: float) -> bool:
        try:
            msg = self.q.get(timeout=timeout)
        except queue.Empty:
            return False
        if "ret" in msg:
            self.returned.append(msg["ret"])
        if "step" in msg:
            self.steps.append(msg["step"])
        if "summary" in msg:
            self.summary = msg["summary"]
        if "done" in msg:
            self.done = msg["done"]
        if "error" in msg:
            self.error = msg["error"]
        return True

    def drain(self) -> None:
        while self._take(0):
            pass

    def wait_returned(self, n: int = 1, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.returned) < n and self.done is None and time.monotonic() < deadline:
            self._take(0.05)
        return len(self.returned) >= n

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait_done(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while self.done is None and time.monotonic() < deadline:
            if not self.alive():
                break
            self._take(0.05)
        time.sleep(0.02)
        self.drain()
        return self.done is not None

    def wait_dead(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.alive():
            self.kill()
        self.drain()

    def kill(self) -> None:
        """SIGKILL, then wait until the kernel has reaped it, then collect the steps it reported."""
        try:
            os.kill(self.pid, signal.SIGKILL)
            self.killed = True
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.02)
        self.drain()


# ---- the crash campaign -------------------------------------------------------------------
class RunState:
    """What the trainers told us about one run folder across its lives (restarts)."""

    def __init__(self, path: Path):
        self.path = path
        self.lives = 0
        self.life_start: dict[int, int] = {}
        self.returned: dict[int, int] = {}  # step -> highest life whose mon.step() returned it

    def next_start(self, rng: random.Random) -> int:
        if not self.returned:
            return 0
        last = max(self.returned) + 1
        return max(0, last - rng.choice([0, 0, 1, 3, 5]))  # a restart replays a few steps, like a checkpoint

    def record(self, life: int, job: Job) -> None:
        for s in job.returned:
            self.returned[s] = max(self.returned.get(s, -1), life)


def check_run(rs: RunState, with_cli: bool = True) -> dict:
    """Every returned step readable, once, from a life that could have logged it; every reader opens the run."""
    import fp8scope
    from fp8scope.errors import RunError

    if not rs.returned:
        # Nothing promised yet: the folder may not even be a run; readers must still answer in one line.
        try:
            fp8scope.load_run(rs.path).info()
        except RunError:
            pass
        return {"steps": 0}
    run = fp8scope.load_run(rs.path)
    sc = run.scalars()
    dup = sc.duplicated(["step", "rank", "name"])
    assert not dup.any(), f"duplicated scalar rows: {sc[dup].head()}"
    life = sc[sc.name == "life"].set_index("step")["value"]
    missing = sorted(set(rs.returned) - set(life.index))
    assert not missing, f"lost steps whose mon.step() returned: {missing[:20]} (of {len(missing)})"
    for s, lv in rs.returned.items():
        got = int(life.loc[s])
        assert got >= lv, f"step {s}: row from life {got}, but life {lv} returned it later (older data won)"
        assert rs.life_start[got] <= s, f"step {s}: row claims life {got} which started at {rs.life_start[got]}"
    t = run.tensors()
    dup = t.duplicated(["step", "rank", "layer", "tensor"])
    assert not dup.any(), f"duplicated tensor rows: {t[dup].head()}"
    per_step = t.groupby("step").size()
    bad = [s for s in rs.returned if per_step.get(s, 0) != N_TENSORS]
    assert not bad, f"steps with a wrong number of tensor rows: {[(s, int(per_step.get(s, 0))) for s in bad[:10]]}"
    segs = t[t.step.isin(list(rs.returned))].groupby("step")["segment"].nunique()
    assert (segs == 1).all(), "a step's tensor rows come from more than one segment"
    info = run.info()
    assert info["steps"] >= len(rs.returned)
    if with_cli:
        for args in (("info", rs.path), ("info", rs.path, "--json"), ("tensors", rs.path, "--last", "3"),
                     ("tensors", rs.path, "--layer", "down", "--csv")):
            rc, out, err = cli_inproc(*args)
            assert rc == 0, f"fp8scope {' '.join(map(str, args))} failed: {err.strip()}"
    dash = dashboard_loader()
    if dash is not None:
        dash(str(rs.path))
    return {"steps": len(rs.returned), "rows": len(t)}


def crash_campaign(base: Path, n_kills: int, seed: int, n_runs: int = 2, real_cli_compactions: int = 1) -> dict:
    """SIGKILL monitored trainers (and compactions racing them) `n_kills` times; check after every kill.

    Returns counts per kind of kill and the totals the docs report.
    """
    rng = random.Random(seed)
    runs = [RunState(base / f"run{i}") for i in range(n_runs)]
    srv = ForkServer()
    kinds: Counter = Counter()
    kills = 0
    promised = 0
    t0 = time.monotonic()
    try:
        event = 0
        while kills < n_kills:
            event += 1
            rs = rng.choice(runs)
            mode = rng.choice(["step", "step", "tear", "tear", "compact", "clean_then_compact"])
            if mode == "tear" and rs.lives and rng.random() < 0.2:
                mode = "tear_manifest"
            if mode == "compact" and real_cli_compactions and rs.returned:
                mode = "compact_cli"
            life = rs.lives
            rs.lives += 1
            start = rs.next_start(rng)
            rs.life_start[life] = start
            job = {"op": "train", "run": str(rs.path), "life": life, "start": start, "stop": start + 10**6,
                   "every": rng.choice([1, 2, 3])}
            if mode == "tear":
                job["tear"] = [rng.randint(1, 40), rng.random()]
            if mode == "tear_manifest":
                job["tear_manifest"] = True
            if mode == "clean_then_compact":
                job["stop"] = start + rng.randint(2, 12)
            tr = srv.submit(job)
            if mode in ("tear", "tear_manifest"):
                tr.wait_dead(timeout=30)  # it kills itself mid-write
                kinds["mid-write (torn batch)" if mode == "tear" else "mid-manifest-rewrite"] += 1
                kills += 1
            elif mode == "step":
                tr.wait_returned(1)
                time.sleep(rng.uniform(0, 0.4))
                tr.kill()
                kinds["random moment in training"] += 1
                kills += 1
            elif mode in ("compact", "compact_cli"):
                tr.wait_returned(1)
                time.sleep(rng.uniform(0, 0.1))
                delete = rng.random() < 0.5
                if mode == "compact":
                    cj = srv.submit({"op": "compact", "run": str(rs.path), "delete": delete})
                    time.sleep(rng.uniform(0, 0.3))
                    cj.kill()
                    finished = cj.done is not None
                else:
                    real_cli_compactions -= 1
                    p = subprocess.Popen([PYTHON, "-m", "fp8scope", "compact", str(rs.path)]
                                         + (["--delete-streams"] if delete else []), cwd=ROOT,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    time.sleep(rng.uniform(0.5, 2.5))  # interpreter start-up is most of this
                    p.send_signal(signal.SIGKILL)
                    _, err = p.communicate()
                    finished = p.returncode == 0
                    assert p.returncode in (0, -signal.SIGKILL), err.decode()
                kinds["compaction (finished before the kill)" if finished else "compaction killed mid-way"] += 1
                time.sleep(rng.uniform(0, 0.2))
                tr.kill()
                kinds["training racing that compaction"] += 1
                kills += 2
            else:  # clean end, then a compaction that may delete the closed streams, killed at random
                tr.wait_done(timeout=60)
                assert tr.done == 0 and tr.error is None, tr.error
                cj = srv.submit({"op": "compact", "run": str(rs.path), "delete": True})
                time.sleep(rng.uniform(0, 0.3))
                cj.kill()
                kinds["compaction --delete-streams " + ("(finished)" if cj.done is not None else "killed")] += 1
                kills += 1
            assert tr.error is None, f"trainer failed: {tr.error}"
            rs.record(life, tr)
            check_run(rs)
        for rs in runs:  # finally, the real CLI binary on every run
            if rs.returned:
                for args in (("info", rs.path), ("tensors", rs.path, "--last", "2")):
                    r = cli(*args)
                    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        for rs in runs:
            promised += len(rs.returned)
    finally:
        srv.close()
    return {
        "kills": kills,
        "events": event,
        "kinds": dict(kinds),
        "lives": sum(rs.lives for rs in runs),
        "returned_steps_checked": promised,
        "lost": 0,
        "duplicated": 0,
        "seconds": round(time.monotonic() - t0, 1),
    }
