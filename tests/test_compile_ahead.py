"""Compiling ahead, in a child process (``fp8scope.compile_ahead``): the calling process runs the
eager function until the child's code is ready, traces nothing itself, loads the code on the next
call and calls it directly; a child that cannot call a variant directly hands it back to be
compiled through dynamo here, and a child that dies leaves its variant eager with one warning.
Real children (``python -m fp8scope.compile_child``), real inductor compiles (C++ here)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from fp8scope import compile_ahead, compiled
from fp8scope.capture import stats as st
from fp8scope.compiled import CompiledFn
from fp8scope.formats import get_format


def _scaled_max(key):
    def scaled_max(x, s):
        return (x.abs() * s).amax(1)

    return scaled_max


def _examples(key):
    return torch.randn(96, 40).to(key[1]), torch.tensor(2.0)


def _dies(key):
    main = sys.modules["__main__"]
    if getattr(getattr(main, "__spec__", None), "name", "") == "fp8scope.compile_child":
        os._exit(3)  # what a child that cannot run looks like to the parent
    return _examples(key)


# top level: a compile child imports this module and finds them by name
SCALED_MAX = CompiledFn("test_ahead_scaled_max", _scaled_max, _examples)
DIES = CompiledFn("test_ahead_dies", _scaled_max, _dies)


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setenv("FP8SCOPE_COMPILE", "ahead")  # the default on a GPU; the CPU's compiles at first use
    yield


def test_a_variant_compiles_in_a_child_and_is_called_directly_once_loaded(ahead):
    key = ("cpu", torch.bfloat16)
    SCALED_MAX.forget(key)
    x, s = torch.randn(64, 33).bfloat16(), torch.tensor(3.0)
    want = (x.abs() * s).amax(1)
    traced = compiled.traces
    first = SCALED_MAX.get(key)
    assert torch.equal(first(x, s), want)  # eagerly, while the child compiles
    assert key in SCALED_MAX._ahead and not SCALED_MAX.direct(key)
    assert SCALED_MAX.ensure(key, timeout=300), SCALED_MAX.failures
    assert SCALED_MAX.direct(key) and compiled.traces == traced  # traced and compiled in the child only
    runner = SCALED_MAX.get(key)
    assert torch.equal(runner(x, s), want) and runner.rejected == 0
    assert torch.equal(runner(x.float(), s), (x.float().abs() * s).amax(1)) and runner.rejected == 1  # another dtype


def test_a_family_whose_child_dies_compiles_here_with_one_warning(ahead):
    """A child that cannot run (a GPU in exclusive-process mode, say) costs one warning; the variant
    then compiles in this process at its next call, as ``sync`` would, and so do the family's later
    variants, without a child."""
    key, later = ("cpu", torch.float32), ("cpu", torch.float64)
    for k in (key, later):
        DIES.forget(k)
    DIES.child_failed = None
    x, s = torch.randn(8, 5), torch.tensor(2.0)
    DIES.get(key)(x, s)
    with pytest.warns(RuntimeWarning, match="compile child for test_ahead_dies failed .*exit status 3"):
        assert DIES.ensure(key, timeout=300), DIES.failures
    assert "exit status 3" in DIES.child_failed and DIES.direct(key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(DIES.get(key)(x, s), (x.abs() * s).amax(1))
        assert DIES.ensure(later) and later not in DIES._ahead  # no child for it


def test_a_variant_the_child_cannot_call_directly_compiles_through_dynamo_here(ahead):
    """MXFP8 beside the stats reads 32-element blocks: its trace assumes sides that blocks divide,
    which dynamo's guards must check, so the child says so and this process compiles it with
    ``torch.compile`` at the next call."""
    key = ("cpu", torch.float32, "e4m3", False, False, ("mxfp8",), "activation", False)
    st.FULL_STATS.forget(key)
    x, one = torch.randn(64, 96), torch.tensor(1.0)
    args = (x, one, one, one, get_format("e4m3"))
    eager = st.stats_call(*args, recipes=("mxfp8",))
    assert st.FULL_STATS.ensure(key, timeout=300), st.FULL_STATS.failures
    assert not st.FULL_STATS.direct(key) and "relations between sizes" in st.FULL_STATS.not_direct[key]
    again = st.stats_call(*args, recipes=("mxfp8",))
    assert torch.allclose(again[0], eager[0], equal_nan=True) and torch.allclose(again[2], eager[2])


def test_requests_and_replies_are_json_that_round_trip():
    key = ("cuda", torch.bfloat16, "e4m3", True, False, ("mxfp8", "bf16"), "gradient", False)
    spec = [(torch.float32, torch.device("cuda", 1), ("s0", 7)), None]
    for value in (key, spec):
        assert compile_ahead.decode(compile_ahead.encode(value)) == value
    with pytest.raises(ValueError):
        compile_ahead.decode({"dtype": "Tensor"})


def test_an_emulated_model_logs_the_eager_rows_while_and_after_its_variants_compile_ahead(tmp_path, monkeypatch):
    """The default on a GPU, here on the CPU: an emulated FP8 model's delayed updates and stats
    compile in children while it trains; the rows logged before and after the compiled code takes
    over are the rows an eager run logs, and the training process traces nothing."""
    import fp8scope
    from fp8scope.demo.tiny_gpt import GPTConfig, TinyGPT
    from fp8scope.emulate import DelayedScaling, convert_to_fp8
    from fp8scope.emulate.scaling import UPDATE

    def run(mode: str, name: str):
        monkeypatch.setenv("FP8SCOPE_COMPILE", mode)
        torch.manual_seed(0)
        model = convert_to_fp8(TinyGPT(GPTConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16)),
                               recipe=DelayedScaling(amax_history_len=8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        with fp8scope.Monitor(model, tmp_path / name, every=2, detect=False) as mon:
            for step in range(6):
                if step == 3 and mode == "ahead":  # the children's code from here on
                    for family in (UPDATE, st.FULL_STATS):
                        assert family._ahead and all(family.ensure(k, timeout=300) for k in list(family._ahead))
                idx = torch.randint(0, 64, (2, 16), generator=gen)
                loss = model(idx).float().logsumexp(-1).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                mon.step(loss=loss.detach())
        cols = ["step", "layer", "tensor", "amax", "scale", "scale_inv", "expected_amax", "overflow", "underflow",
                "saturated", "qerr_mse"]
        return fp8scope.load_run(tmp_path / name).tensors().sort_values(["step", "order"])[cols].reset_index(drop=True)

    for family in (UPDATE, st.FULL_STATS):
        for k in list(family._ready) + list(family._ahead):
            family.forget(k)
    traced = compiled.traces
    ahead = run("ahead", "ahead")
    assert compiled.traces == traced, "the training process traced"
    assert UPDATE._ready and all(UPDATE.direct(k) for k in UPDATE._ready), UPDATE.not_direct
    assert st.FULL_STATS._ready and all(st.FULL_STATS.direct(k) for k in st.FULL_STATS._ready)
    eager = run("0", "eager")
    import pandas as pd

    pd.testing.assert_frame_equal(ahead, eager, check_exact=False, rtol=1e-6)


def test_a_family_no_child_can_import_compiles_at_first_use(ahead):
    """A family made inside a function is nowhere a child could import it from: under ``ahead`` it
    compiles on the calling thread at its first call, and no child is asked."""
    local = CompiledFn("test_ahead_local", _scaled_max, _examples)
    key = ("cpu", torch.float32)
    x, s = torch.randn(16, 9), torch.tensor(2.0)
    assert torch.equal(local.get(key)(x, s), (x.abs() * s).amax(1))
    assert local.direct(key) and key not in local._ahead


_QUIET_THREAD = r'''
import json, os, sys, tempfile, threading
os.environ["FP8SCOPE_COMPILE"] = "ahead"
calls = {}


def count(frame, event, arg):
    if event == "call":
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1


import torch
from torch import nn

import fp8scope
from fp8scope.capture.stats import FULL_STATS

model = nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 32))
with tempfile.TemporaryDirectory() as tmp, fp8scope.Monitor(model, tmp, every=1, detect=False) as mon:
    prepared = "torch._inductor.compile_fx" in sys.modules  # at setup, before any training step
    threading.setprofile(count)
    sys.setprofile(count)
    model(torch.randn(8, 96)).sum().backward()  # its stats eager, their variants asked of children
    mon.step()
    key = ("cpu", torch.float32, "e4m3", False, False)
    assert FULL_STATS.ensure(key, timeout=600), FULL_STATS.failures
    threading.setprofile(None)
    sys.setprofile(None)
print(json.dumps({"prepared": prepared, "calls": calls}))
'''


def test_the_thread_beside_training_runs_almost_no_python_and_the_monitor_prepares_the_load(tmp_path):
    """The daemon thread that runs compile children only starts them and waits, the GIL released:
    Python work on a thread beside training makes every training op wait for the GIL (an H100's
    slowest early step was 3.6 s against a 20 ms median while the thread imported inductor), so the
    imports a load needs happen when the Monitor attaches (``compiled.prepare``). A fresh
    interpreter, so that no earlier test's imports hide them; the thread's Python function calls are
    counted (hundreds for starting and reading children; an inductor import is about a million)."""
    import json
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", _QUIET_THREAD], capture_output=True, text=True, env=env,
                         timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["prepared"], "the Monitor did not import inductor's loader at setup"
    thread = got["calls"].get("fp8scope-compile-ahead")
    assert thread is not None, got["calls"]  # children ran (the thread was counted)
    assert thread < 20_000, got["calls"]


def test_one_child_serves_variants_in_turn_and_a_later_one_starts_after_it_left_idle(ahead, monkeypatch):
    """The child serves one request after another; idle past ``FP8SCOPE_COMPILE_IDLE_S`` it exits
    (its CUDA context with it, on a GPU), and the next request starts a new child without a
    warning: a request written to a child that just left is asked again, not taken for a failure."""
    import time

    monkeypatch.setenv("FP8SCOPE_COMPILE_IDLE_S", "1")
    compile_ahead.stop_child()  # the next child reads the setting
    started = compile_ahead._children
    first, second, third = ("cpu", torch.float32), ("cpu", torch.float16), ("cpu", torch.float64)
    for key in (first, second, third):
        SCALED_MAX.forget(key)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a child taken for failed would warn
        SCALED_MAX.get(first)(torch.randn(8, 4), torch.tensor(1.0))
        SCALED_MAX.get(second)(torch.randn(8, 4).half(), torch.tensor(1.0))  # queued behind the first
        assert SCALED_MAX.ensure(first, timeout=300) and SCALED_MAX.ensure(second, timeout=300)
        child = compile_ahead._running
        assert child is not None and compile_ahead._children == started + 1  # one child for both
        deadline = time.monotonic() + 60
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert child.returncode == 0, "the child did not leave when idle"
        SCALED_MAX.get(third)(torch.randn(8, 4).double(), torch.tensor(1.0))
        assert SCALED_MAX.ensure(third, timeout=300), SCALED_MAX.failures
    assert compile_ahead._running is not child and compile_ahead._children == started + 2
    x = torch.randn(64, 33).double()
    assert SCALED_MAX.direct(third) and torch.equal(SCALED_MAX.get(third)(x, torch.tensor(2.0)), (x.abs() * 2).amax(1))
