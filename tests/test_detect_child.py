"""Online detection's rules in a child process (``fp8scope.detect.child``): the real child, killed
with SIGKILL, and a real training process killed under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest
import torch

from fp8scope import Monitor
from fp8scope.detect import DetectConfig
from fp8scope.detect.child import ChildDetector
from fp8scope.detect.online import OnlineDetector
from fp8scope.run import load_run
from tests.conftest import MLP, train

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _alive(pid: int) -> bool:
    """Running, not a zombie (a container's init may never reap an orphan that exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _nan_at(at: int):
    def poison(step, x):
        if step == at:
            x = x.clone()
            x[0, 0] = float("nan")
        return x
    return poison


def test_the_rules_run_in_the_child_and_report_in_the_training_process(tmp_path):
    """The default: one child per monitor runs the rules (the parent's own rule state stays empty),
    and its events reach ``on_event``, the detector's frame and the run's events table; the child
    is gone once the monitor is closed."""
    got = []
    torch.manual_seed(0)
    model = MLP()
    mon = Monitor(model, tmp_path / "r", every=1, on_event=got.append, detect=DetectConfig(warmup_rows=0))
    det = mon.detector.detector
    assert isinstance(det, ChildDetector) and det.in_child
    pid = det._proc.pid
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"fp8scope.detect.child" in f.read()
    train(model, mon, 20, poison=_nan_at(15))
    with open(f"/proc/{pid}/maps") as f:  # the child starts beside training, on the cores that train:
        assert "/pandas/" not in f.read()  # pandas alone was two thirds of its start, and no rule needs it
    mon.close()
    assert det.passes_in_child > 0 and not det._pass.km.info  # no rule ran in this process
    origin = [e for e in got if e["rule"] == "nan_origin"]
    assert [(e["step"], e["layer"]) for e in origin] == [(15, "up")]
    stored = load_run(tmp_path / "r").events()
    assert list(stored.query("rule == 'nan_origin'").step) == [15]
    assert len(mon.detector.frame()) == len(stored) == len(got)
    assert not _alive(pid)


def test_a_killed_child_leaves_detection_in_the_training_process(tmp_path):
    """SIGKILL the child mid-run: one warning, training and logging go on, and the rules go on in
    the training process (a NaN planted after the kill is still located at once)."""
    got = []
    torch.manual_seed(0)
    model = MLP()
    mon = Monitor(model, tmp_path / "r", every=1, on_event=got.append, detect=DetectConfig(warmup_rows=0))
    det = mon.detector.detector
    train(model, mon, 5)
    mon.detector.flush()
    os.kill(det._proc.pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match="online detection process stopped") as caught:
        train(model, mon, 20, poison=_nan_at(15))
        mon.close()
    assert sum("online detection process stopped" in str(w.message) for w in caught) == 1
    assert not det.in_child and det._pass.km.info  # the rules ran here after the kill
    # the second call's step 15 is the run's step 20
    assert [(e["step"], e["layer"]) for e in got if e["rule"] == "nan_origin"] == [(20, "up")]
    run = load_run(tmp_path / "r")
    assert run.tensors().step.nunique() == 25
    assert list(run.events().query("rule == 'nan_origin'").step) == [20]


@pytest.mark.parametrize("forked", [False, True])
def test_the_child_leaves_when_the_training_process_is_killed(tmp_path, forked):
    """A training process killed with SIGKILL cannot stop the child: the child sees its pipe close,
    or, where a process forked from training (a data loader's worker) still holds the pipe, sees
    its parent gone, and leaves; no detection process outlives its run."""
    fork = "worker = os.fork()\nif worker == 0:\n    time.sleep(60)\n    os._exit(0)\n" if forked else "worker = 0\n"
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {os.getcwd()!r})
        from fp8scope import Monitor
        from tests.conftest import MLP, train
        model = MLP()
        mon = Monitor(model, {str(tmp_path / "r")!r}, every=1)
    """) + fork + textwrap.dedent("""
        print(mon.detector.detector._proc.pid, worker, flush=True)
        while True:
            train(model, mon, 5)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = 0
    try:
        child, worker = map(int, proc.stdout.readline().split())
        time.sleep(1.0)  # training, and the child examining its steps
        assert _alive(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        proc.kill()
        proc.wait()
        if worker:
            os.kill(worker, signal.SIGKILL)
    assert load_run(tmp_path / "r").tensors().step.nunique() >= 5  # logged before the kill


def test_closing_the_monitor_ends_the_child_at_once_while_a_forked_worker_holds_its_pipe(tmp_path):
    """A data loader's worker forked after the monitor started holds the child's pipe too: the
    child is told to leave rather than waiting for the pipe to close, so close() does not wait."""
    torch.manual_seed(0)
    model = MLP()
    mon = Monitor(model, tmp_path / "r", every=1)
    pid = mon.detector.detector._proc.pid
    worker = os.fork()
    if worker == 0:
        time.sleep(60)
        os._exit(0)
    try:
        train(model, mon, 5)
        t0 = time.monotonic()
        mon.close()
        assert time.monotonic() - t0 < 20  # not the 60 s the worker holds the pipe, on a loaded machine too
        assert not _alive(pid)
    finally:
        os.kill(worker, signal.SIGKILL)
        os.waitpid(worker, 0)


def test_detection_stays_in_a_thread_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8SCOPE_DETECT_PROCESS", "0")
    mon = Monitor(MLP(), tmp_path / "r")
    assert type(mon.detector.detector) is OnlineDetector
    mon.close()


def test_the_child_gives_the_events_the_rules_give_in_process(tmp_path):
    """A logged run's steps, replayed two a pass through the child and through the rules in this
    process: the same events, in the same order (the child's state carries from pass to pass)."""
    import pyarrow.compute as pc

    torch.manual_seed(0)
    model = MLP()
    mon = Monitor(model, tmp_path / "r", every=3, detect=False)
    train(model, mon, 30, poison=_nan_at(22))
    mon.close()
    run = load_run(tmp_path / "r")
    tensors, scalars = run.table("tensors"), run.table("scalars")
    steps = []
    for step in range(30):
        t = tensors.filter(pc.equal(tensors["step"], step)).combine_chunks().to_batches()
        sc = scalars.filter(pc.equal(scalars["step"], step)).combine_chunks().to_batches()
        steps.append((step, 0, t[0] if t else None, sc[0] if sc else None))
    config = DetectConfig(warmup_rows=0, min_history=3)
    here, there = OnlineDetector(config), ChildDetector(config)
    events = []
    try:
        for i in range(0, 30, 2):
            got = there.examine(steps[i:i + 2])
            pd.testing.assert_frame_equal(pd.DataFrame(got), pd.DataFrame(here.examine(steps[i:i + 2])))  # NaN == NaN
            events += got
        assert there.passes_in_child == 15
    finally:
        there.close()
    assert [(e["step"], e["layer"]) for e in events if e["rule"] == "nan_origin"] == [(22, "up")]
