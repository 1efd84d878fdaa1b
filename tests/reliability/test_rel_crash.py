"""Crash safety: monitored trainers (and compactions racing them) killed with SIGKILL at random moments.

After every kill: every step that was durable (``mon.step()`` of the step after it returned: steps
are written one behind, on every device) is readable, exactly once, from a life that
could have logged it (restarts replay steps: the later segment must win), and the API, the CLI
and the dashboard's data layer (when present) open the run without error.
"""

from __future__ import annotations

import json
import os

import pytest

from rel_common import crash_campaign


def test_sigkill_campaign_ci(tmp_path):
    summary = crash_campaign(tmp_path, n_kills=10, seed=int(os.environ.get("FP8SCOPE_SEED", 11)))
    print(json.dumps(summary, indent=2))
    assert summary["kills"] >= 10 and summary["returned_steps_checked"] > 0


@pytest.mark.slow
def test_sigkill_campaign_50(tmp_path):
    summary = crash_campaign(tmp_path, n_kills=50, seed=int(os.environ.get("FP8SCOPE_SEED", 2024)), n_runs=3,
                             real_cli_compactions=3)
    print(json.dumps(summary, indent=2))
    out = os.environ.get("FP8SCOPE_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"test": "sigkill_campaign_50", **summary}) + "\n")
    assert summary["kills"] >= 50


KILL_POINTS_SCRIPT = r'''
import os, signal, sys, json, importlib
from pathlib import Path
import pyarrow.parquet as pq
C = importlib.import_module("fp8scope.store.compact")
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
results = []
for run, k in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        calls = [0]
        def tick(orig):
            def f(*a, **kw):
                calls[0] += 1
                if calls[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
                return orig(*a, **kw)
            return f
        os.replace = tick(os.replace)
        os.fsync = tick(os.fsync)
        Path.unlink = tick(Path.unlink)
        C.pq.write_table = tick(pq.write_table)
        C.atomic_write_bytes = tick(C.atomic_write_bytes)
        C.compact(run, delete_streams=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    results.append(os.WIFSIGNALED(status))
print(json.dumps(results))
'''


def test_compaction_killed_at_every_write_point_then_restart(tmp_path):
    """compact --delete-streams killed at its k-th replace/fsync/unlink/write (every k until it completes);
    then a restarted writer appends. Every step stays readable, once. (This found the
    delete-before-compacted.json bug fixed in store/compact.py.)"""
    import time

    import fp8scope
    from fp8scope.step_records import scalar_batch
    from fp8scope.store import RunWriter, new_manifest, write_manifest

    from rel_common import PYTHON, ROOT

    def prepare(run):
        write_manifest(run, new_manifest())
        for seg_steps in (range(0, 6), range(4, 10)):  # two closed segments, the second replays 4, 5
            w = RunWriter(run, 0)
            for s in seg_steps:
                w.write("scalars", scalar_batch(s, 0, ["loss", "seg"], [float(s), float(w.segment)], time.time()))
            w.close()

    jobs = []
    for k in range(1, 25):
        run = tmp_path / f"k{k}"
        prepare(run)
        jobs.append((str(run), k))
    import subprocess
    import json

    r = subprocess.run([PYTHON, "-c", KILL_POINTS_SCRIPT, json.dumps(jobs)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    killed = json.loads(r.stdout)
    assert any(killed) and not killed[-1], "the last k should let compaction finish (raise the range)"
    for (run, k), was_killed in zip(jobs, killed):
        w = RunWriter(run, 0)  # the restarted job
        for s in range(8, 12):
            w.write("scalars", scalar_batch(s, 0, ["loss", "seg"], [float(s), float(w.segment)], time.time()))
        sc = fp8scope.load_run(run).scalars()
        assert not sc.duplicated(["step", "rank", "name"]).any(), k
        loss = sc[sc.name == "loss"]
        assert sorted(loss.step) == list(range(12)), (k, sorted(loss.step))
        seg = sc[sc.name == "seg"].set_index("step")["value"]
        assert (seg.loc[8:11] == w.segment).all() and (seg.loc[4:7] == 1).all(), (k, seg.to_dict())
