"""Faulty storage under a real monitored training subprocess: disk full, read-only, folder deleted or moved.

In every case: training runs to its last step (exit 0), exactly one fp8scope warning says logging
stopped, and every step whose mon.step() returned while logging worked is readable afterwards.

How the faults are made (root in a container): a size-limited tmpfs for "disk full" (ENOSPC) and a
read-only tmpfs / read-only remount for "read-only"; tests that need mount(2) skip without it. The
RLIMIT_FSIZE variant (EFBIG, SIGXFSZ ignored) and the non-root permission variant need no mount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import fp8scope
from rel_common import ForkServer, cli, cli_inproc, assert_one_line_error


def _mount(target: Path, opts: str) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)], capture_output=True)
    return r.returncode == 0


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def make(name: str, opts: str) -> Path:
        d = tmp_path / name
        if os.geteuid() != 0 or not _mount(d, opts):
            pytest.skip("mount(2) not permitted here: the RLIMIT_FSIZE / non-root variants cover this")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        _umount(d)


@pytest.fixture(scope="module")
def server():
    srv = ForkServer()
    yield srv
    srv.close()


def run_trainer(srv, run_dir, steps=300, fsize=None, uid=None, pace=0.0, act=None) -> dict:
    """A forked monitored trainer; `act(step)` runs here as it reports each step (to break things mid-run)."""
    job = srv.submit({"op": "storage", "run": str(run_dir), "steps": steps, "fsize": fsize, "uid": uid, "pace": pace})
    seen = 0
    deadline = time.monotonic() + 120
    while job.done is None and time.monotonic() < deadline:
        job._take(0.05)
        while act is not None and seen < len(job.steps):
            act(job.steps[seen])
            seen += 1
    assert job.error is None, f"training did not survive: {job.error}"
    s = job.summary
    assert job.done == 0 and s is not None and s["steps_done"] == steps, (job.done, s)
    return s


def assert_stopped_once(summary: dict, needle: str) -> None:
    # the fault's own warnings: online detection saying it fell behind the run (its child process slow on a
    # loaded 2-core machine, full stats every step at 30 steps a second) is about the machine, not the fault
    said = [w for w in summary["warnings"] if "online detection fell" not in w]
    assert len(said) == 1, summary["warnings"]
    assert needle in said[0] and "training continues" in said[0], summary["warnings"]
    assert summary["logging_failed"], summary


def assert_ok_steps_readable(run_dir, summary: dict) -> None:
    run = fp8scope.load_run(run_dir)
    sc = run.scalars()
    assert set(summary["ok_steps"]) <= set(sc.step), sorted(set(summary["ok_steps"]) - set(sc.step))[:10]
    assert not sc.duplicated(["step", "rank", "name"]).any()
    t = run.tensors()
    assert not t.duplicated(["step", "rank", "layer", "tensor"]).any()
    assert set(summary["ok_steps"]) <= set(t.step)
    for args in (("info", run_dir), ("tensors", run_dir, "--last", "2")):
        rc, _, err = cli_inproc(*args)
        assert rc == 0, err


def test_disk_full_tmpfs(tmpfs, server):
    d = tmpfs("small", "size=64k")
    s = run_trainer(server, d / "run", 80)
    assert_stopped_once(s, "No space left on device")
    assert len(s["ok_steps"]) >= 3, "the tmpfs should hold a few steps before it fills"
    assert_ok_steps_readable(d / "run", s)


def test_disk_full_rlimit_fsize(tmp_path, server):
    s = run_trainer(server, tmp_path / "run", 60, fsize=40_000)
    assert_stopped_once(s, "File too large")
    assert len(s["ok_steps"]) >= 3
    assert_ok_steps_readable(tmp_path / "run", s)


def test_disk_already_full_when_the_monitor_opens(tmpfs, server):
    d = tmpfs("full", "size=64k")
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    s = run_trainer(server, d / "run", 20)
    assert_stopped_once(s, "No space left on device")
    assert s["ok_steps"] == []


def test_read_only_folder_from_the_start(tmpfs, server):
    d = tmpfs("ro", "ro,size=64k")
    s = run_trainer(server, d / "run", 20)
    assert_stopped_once(s, "Read-only file system")


def test_read_only_existing_run_readers_work_writers_fail_open(tmp_path, tmpfs, server):
    d = tmpfs("rorun", "size=4m")
    s0 = run_trainer(server, d / "run", 8)
    assert s0["warnings"] == [] and len(s0["ok_steps"]) == 8
    r = subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert_ok_steps_readable(d / "run", s0)  # reading a read-only run works (API and CLI)
    r = cli("info", d / "run")
    assert r.returncode == 0, r.stderr
    r = cli("compact", d / "run")  # writing to it is a clear one-line error, not a traceback
    assert_one_line_error(r.returncode, r.stderr, "Read-only file system")
    s = run_trainer(server, d / "run", 10)  # a restarted trainer on a read-only run: trains, warns once
    assert_stopped_once(s, "Read-only file system")
    assert_ok_steps_readable(d / "run", s0)  # and the old steps are untouched


def test_permission_denied_as_non_root(tmp_path, server):
    ro = tmp_path / "locked"
    ro.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(ro, 0o555)  # root owns it; the trainer runs as nobody, so the mode is enforced
    s = run_trainer(server, ro / "run", 10, uid=65534)
    assert_stopped_once(s, "Permission denied")


def test_run_folder_deleted_while_training(tmp_path, server):
    run_dir = tmp_path / "run"

    def act(step):
        if step == 12:
            shutil.rmtree(run_dir)

    s = run_trainer(server, run_dir, 40, pace=0.03, act=act)
    assert_stopped_once(s, "removed while training")
    assert not run_dir.exists(), "the monitor must not recreate a deleted run folder"
    r = cli("info", run_dir)
    assert_one_line_error(r.returncode, r.stderr, "no such run folder")


def test_run_folder_moved_while_training(tmp_path, server):
    run_dir, moved = tmp_path / "run", tmp_path / "moved"

    def act(step):
        if step == 12:
            os.rename(run_dir, moved)

    s = run_trainer(server, run_dir, 40, pace=0.03, act=act)
    assert_stopped_once(s, "removed while training")
    assert len(s["ok_steps"]) >= 13
    assert_ok_steps_readable(moved, s)  # everything written before is there, at the new place
