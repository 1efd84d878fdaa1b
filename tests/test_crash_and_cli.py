"""Real subprocesses: a monitored training killed with SIGKILL, and the CLI on real run folders."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import fp8scope
from tests.conftest import ROOT

TRAINER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    import fp8scope
    from fp8scope.emulate import DelayedScaling, convert_to_fp8
    from tests.conftest import MLP
    torch.manual_seed(0)
    m = convert_to_fp8(MLP(d=64, h=256, out=64), recipe=DelayedScaling(amax_history_len=8))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    mon = fp8scope.Monitor(m, sys.argv[1], every=2)
    step = 0
    while True:
        loss = m(torch.randn(64, 64)).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad()
        mon.step(loss=loss.detach())
        if step:  # steps are written one behind: step() returned, so the step before it is on disk
            print("RETURNED", step - 1, flush=True)
        step += 1
    """
)


def _run_and_kill(run_dir, delay: float) -> list[int]:
    script = TRAINER.format(root=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    returned: list[int] = []
    deadline = time.monotonic() + 60
    # wait for the first step so the kill lands in the middle of training
    while not returned and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("RETURNED"):
            returned.append(int(line.split()[1]))
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    rest, _ = proc.communicate()
    # a line the kill cut short ("RETURNED" without its number) names no step: skip it
    returned += [int(m.group(1)) for m in re.finditer(r"^RETURNED (\d+)$", rest, re.M)]
    return returned


def test_sigkill_during_training_loses_no_durable_step(tmp_path):
    rng = random.Random(7)
    for i in range(4):
        run_dir = tmp_path / f"r{i}"
        returned = _run_and_kill(run_dir, delay=rng.uniform(0.05, 1.5))
        assert returned, "trainer never got through a step"
        run = fp8scope.load_run(run_dir)  # no error despite a possibly torn tail
        logged = set(run.scalars().step)
        assert set(returned) <= logged, f"lost steps {sorted(set(returned) - logged)}"
        tensors = run.tensors()
        assert set(returned) <= set(tensors.step)
        assert tensors.groupby(["step", "layer", "tensor"]).size().max() == 1  # nothing duplicated
        # the CLI opens the crashed run too
        cli = subprocess.run([sys.executable, "-m", "fp8scope", "info", str(run_dir)], capture_output=True, text=True)
        assert cli.returncode == 0, cli.stderr


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "fp8scope", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    import torch

    from fp8scope.emulate import DelayedScaling, convert_to_fp8
    from tests.conftest import MLP, train

    run_dir = tmp_path_factory.mktemp("cli") / "run"
    torch.manual_seed(0)
    m = convert_to_fp8(MLP(), recipe=DelayedScaling(amax_history_len=4))
    with fp8scope.Monitor(m, run_dir, every=2) as mon:
        train(m, mon, steps=6)
    return run_dir


def test_cli_info_and_tensors(small_run):
    r = _cli("info", small_run)
    assert r.returncode == 0 and "6 (first 0, last 5)" in r.stdout
    r = _cli("info", small_run, "--json")
    info = json.loads(r.stdout)
    assert info["steps"] == 6 and info["tensors"] == 9 and info["recipe"]["amax_history_len"] == 4
    r = _cli("tensors", small_run, "--layer", "^down$", "--tensor", "gradient", "--last", "2", "--csv")
    assert r.returncode == 0
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3 and all(",down,gradient," in l for l in lines[1:])
    r = _cli("tensors", small_run, "--last", "1")
    assert r.returncode == 0 and "activation" in r.stdout


def test_cli_compact_then_read(small_run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small_run, copy)
    before = fp8scope.load_run(copy).tensors()
    r = _cli("compact", copy)
    assert r.returncode == 0, r.stderr
    assert (copy / "parquet" / "tensors.parquet").exists()
    after = fp8scope.load_run(copy).tensors()
    assert len(after) == len(before) and set(after.step) == set(before.step)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["info", "/nonexistent/run"], "no such run folder"),
        (["tensors", "{run}", "--layer", "("], "bad --layer regex"),
        (["tensors", "{run}", "--last", "0"], "--last must be >= 1"),
        (["tensors", "{run}", "--columns", "nope"], "unknown column"),
        (["tensors", "{run}", "--tensor", "grad"], "unknown --tensor"),
        (["info", "{garbage}"], "run.json"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_cli_bad_input_is_one_line_and_nonzero(args, needle, small_run, tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "run.json").write_text("{not json")
    r = _cli(*[a.format(run=small_run, garbage=garbage) for a in args])
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_doctor():
    r = _cli("doctor")
    assert r.returncode == 0 and "torch" in r.stdout and "transformer_engine" in r.stdout


def test_cli_info_reads_a_run_without_importing_pandas_or_torch(small_run):
    """`fp8scope info` beside a training job: no pandas (~0.2 s of CPU per call) and no torch on its
    path; it prints the summary from Arrow alone."""
    code = textwrap.dedent(f"""
        import sys
        from fp8scope.cli.main import main
        assert main(["info", {str(small_run)!r}]) == 0
        print("IMPORTED", sorted(m for m in ("pandas", "torch") if m in sys.modules))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "IMPORTED []" in r.stdout, r.stdout[-500:]
