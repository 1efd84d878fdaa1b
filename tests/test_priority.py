"""Reading commands yield the CPU to training when asked (fp8scope/priority.py), in real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fp8scope
from tests.conftest import MLP, ROOT, train

PROBE = (  # the real CLI entry point, then the niceness it left the process with
    "import os, sys\n"
    "from fp8scope.cli.main import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('NICE', os.nice(0), rc)\n"
)


def niceness_of(*argv: str, env: dict | None = None) -> tuple[int, int]:
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=120)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("NICE")][-1].split()
    return int(line[1]), int(line[2])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prio") / "run"
    torch.manual_seed(0)
    model = MLP()
    with fp8scope.Monitor(model, d, detect=False) as mon:
        train(model, mon, 3)
    return d


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no nice() on this platform")
def test_niceness_is_opt_in_and_only_for_reading_commands(run_dir):
    base = os.nice(0)
    assert niceness_of("info", str(run_dir)) == (base, 0)  # by default nothing changes
    assert niceness_of("tensors", str(run_dir), "--last", "1") == (base, 0)
    assert niceness_of("--nice", "info", str(run_dir)) == (max(base, 19), 0)
    assert niceness_of("tensors", str(run_dir), "--last", "1", "--nice") == (max(base, 19), 0)
    assert niceness_of("info", str(run_dir), "--nice=5") == (max(base, 5), 0)
    assert niceness_of("--nice", "7", "info", str(run_dir)) == (max(base, 7), 0)
    assert niceness_of("info", str(run_dir), env={"FP8SCOPE_NICE": "3"}) == (max(base, 3), 0)
    assert niceness_of("info", str(run_dir), env={"FP8SCOPE_NICE": "0"}) == (base, 0)
    assert niceness_of("--nice", "doctor")[0] == base  # inspects the machine, trains nothing, reads no run


def test_yield_to_training_never_lowers_and_never_raises():
    code = ("import os, fp8scope\n"
            "now = os.nice(1)\n"  # relative: this process may inherit a niceness already
            "assert fp8scope.yield_to_training(now - 1) == now\n"
            "assert fp8scope.yield_to_training(40) == 19\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no nice() on this platform")
def test_the_cli_yields_before_it_imports_the_commands(run_dir):
    """Building the parser imports pandas (~0.5 s of CPU): a reading command must already run niced then."""
    code = ("import os, sys\n"
            "import fp8scope.cli.main as m\n"
            "build = m.build_parser\n"
            "def spy():\n"
            "    print('AT_PARSER', os.nice(0), 'pandas' in sys.modules)\n"
            "    return build()\n"
            "m.build_parser = spy\n"
            "m.main(sys.argv[1:])\n")
    base = os.nice(0)
    for argv, want in ((["--nice", "info", str(run_dir)], max(base, 19)), (["--nice", "doctor"], base),
                       (["info", str(run_dir)], base)):
        r = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        at = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("AT_PARSER")][0]
        assert int(at[1]) == want and at[2] == "False", (argv, at, r.stderr[-300:])
