"""Shared fixtures: small real models and a helper to train them under the monitor."""

from __future__ import annotations

import math
import os
import socket
import sys

import pytest
import torch
from torch import nn

# Property tests explore a fixed sequence of examples so a CI result is reproducible;
# FP8SCOPE_STRESS=1 lets hypothesis search afresh (and longer, where tests ask for it).
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("fp8scope-ci", derandomize=True, deadline=None)
    _hyp_settings.register_profile("fp8scope-stress", deadline=None)
    _hyp_settings.load_profile("fp8scope-stress" if os.environ.get("FP8SCOPE_STRESS") else "fp8scope-ci")
except ImportError:  # hypothesis is a dev extra
    pass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a dashboard's, a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, target, args: tuple) -> None:
    """One gloo rank of :func:`spawn_gloo`: ``target(rank, *args)`` between the process group's start
    and its destruction, then an exit without interpreter finalization. gloo's C++ worker threads may
    free tensors that hold Python objects while the interpreter is torn down, which aborts the process
    (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291 describes it).
    Ranks of both multi-rank test files aborted so in CI after writing everything the tests read.
    faulthandler prints every thread's Python stack if a rank aborts before the exit."""
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        target(rank, *args)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(tmp_path, world: int, target, *args):
    """Run ``target(rank, out_dir, *args)`` on ``world`` gloo ranks (torch.multiprocessing, spawn) and
    return ``out_dir``, a fresh folder under ``tmp_path`` that the ranks write into. A rank killed by a
    native abort (see :func:`_gloo_rank`) is retried once, in a fresh folder and with a warning; a
    second abort, or any other failure, fails the test. How gloo tears itself down is not fp8scope's;
    the tests check what the ranks wrote."""
    import warnings

    import torch.multiprocessing as mp

    for attempt in (1, 2):
        out_dir = tmp_path / f"attempt{attempt}"
        out_dir.mkdir(parents=True)
        try:
            mp.spawn(_gloo_rank, args=(world, free_port(), target, (str(out_dir), *args)), nprocs=world,
                     join=True)
            return out_dir
        except mp.ProcessExitedException as exc:
            if attempt == 2 or exc.signal_name != "SIGABRT":
                raise
            warnings.warn(f"a rank aborted ({exc}); launching the ranks once more", RuntimeWarning)


def has_cuda() -> bool:
    return torch.cuda.is_available()


# The suite runs the stats eagerly (and so do the subprocesses it starts): compiling the stats
# pass costs seconds per variant on a 2-core machine. The compiled path has tests of its own
# (tests/test_compiled_calls.py, tests/test_compile_ahead.py and the ``stats_path`` fixture below).
os.environ.setdefault("FP8SCOPE_COMPILE", "0")


@pytest.fixture(params=["compiled", "eager"])
def stats_path(request, monkeypatch):
    """Run a test once with the stats pass compiled (inductor's C++ here, Triton on CUDA) and once
    eager: both must give the same numbers."""
    monkeypatch.setenv("FP8SCOPE_COMPILE", "sync" if request.param == "compiled" else "0")
    yield request.param
    from fp8scope.capture.stats import FULL_STATS
    from fp8scope.emulate.amax import AMAX

    failed = {**FULL_STATS.failures, **AMAX.failures}
    assert not failed, f"the stats pass did not compile: {failed}"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda():
            item.add_marker(skip_gpu)


class MLP(nn.Module):
    """Two hidden layers with names like a transformer MLP, so layer regexes read naturally."""

    def __init__(self, d: int = 16, h: int = 32, out: int = 4):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.act = nn.ReLU()
        self.down = nn.Linear(h, h)
        self.head = nn.Linear(h, out)

    def forward(self, x):
        return self.head(self.act(self.down(self.act(self.up(x)))))


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP()


def train(model, mon, steps: int, micro: int = 1, batch: int = 8, poison=None):
    """Real SGD steps; ``poison(step, x)`` may edit the input of a step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    d = model.up.in_features
    for step in range(steps):
        for _ in range(micro):
            x = torch.randn(batch, d, generator=gen)
            if poison is not None:
                x = poison(step, x)
            loss = model(x).pow(2).mean() / micro
            loss.backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step(loss=loss.detach(), lr=0.05)


def fp8scope_python_calls(run_step) -> int:
    """Calls of functions defined in fp8scope (the demo model's own left out), by ``sys.setprofile``:
    this thread's, which on a CPU runs the backward's hooks too. A cheap step's host time on a GPU is
    its Python, so tests cap it (deterministic, where a timing is not)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + "fp8scope"
    demo = pkg + os.sep + "demo"
    calls = [0]

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(pkg) and not path.startswith(demo):
            calls[0] += 1

    sys.setprofile(profile)
    try:
        run_step()
    finally:
        sys.setprofile(None)
    return calls[0]


def fx_cache_when_compiled_again(run, path, step) -> tuple[dict, object]:
    """Train ``run`` (a torch.compile'd model) monitored for 3 steps of ``step(run)`` (forward and
    backward), make dynamo forget it, and train 3 more with the same monitor: its taps keep their
    ids, as a new process's would. Inductor's FX-graph-cache counters of the second compile, and
    the run's rows. Neither compile may bypass the cache; skipped where this torch keeps the
    backward's taps in a form the cache refuses (``graph_taps.GRAD_KEPT_AS``)."""
    import fp8scope
    from fp8scope import graph_taps
    from torch._dynamo.utils import counters

    if graph_taps.GRAD_KEPT_AS != "side effect":
        pytest.skip(f"this torch keeps the backward's taps as {graph_taps.GRAD_KEPT_AS or 'a sink write'}")
    with fp8scope.Monitor(run, path, every=2, detect=False) as mon:
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            for _ in range(3):
                step(run)
                mon.step()
            cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
            assert "fxgraph_cache_bypass" not in cache, cache
    return cache, fp8scope.load_run(path).tensors()


def assert_same_row(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-9, *context) -> None:
    """Two stats rows (``step_payload.WIDE_FIELDS``) from two forms of the one definition: NaN where
    NaN, the values within ``rtol``, and the squared sums within 2e-6, as the CPU's eager pass over
    a finite tensor sums each row's squares in float32 where the other forms sum in float64
    (``stats._make_finite_row``)."""
    from fp8scope.step_payload import WIDE_FIELDS

    squares = [i for i, name in enumerate(WIDE_FIELDS) if name.startswith("sq_")]
    others = [i for i in range(len(WIDE_FIELDS)) if i not in squares]
    assert torch.equal(got.isnan(), want.isnan()), (*context, got, want)
    assert torch.allclose(got[others], want[others], rtol=rtol, equal_nan=True), (*context, got, want)
    assert torch.allclose(got[squares], want[squares], rtol=max(rtol, 2e-6), equal_nan=True), (*context, got, want)


def fused_stats_case(variant: str, fmt_name: str, rows: int, cols: int, trial: int, g: torch.Generator):
    """``(key, args)`` of one check of the fused full-stats form against the eager one: an adversarial
    tensor (magnitudes over 18 decades and one NaN, Inf, -Inf, zero, subnormal or out-of-range value)
    laid out as ``stats_call`` hands it over for ``variant`` ("per_tensor", "deq": a dequantized copy,
    "per_row": per-row scales and a copy, "recipes": current and bf16 measured too, on the matrix,
    "per_row_recipes": both)."""
    from fp8scope.emulate.amax import row_matrix

    x = torch.randn(rows, cols, generator=g) * torch.logspace(-12, 6, cols)
    x[trial % rows, trial % cols] = [math.nan, math.inf, -math.inf, 0.0, 1e-44, 1e5][trial % 6]
    x = x.to(torch.bfloat16) if variant in ("per_tensor", "recipes") else x
    per_row, has_deq = variant in ("per_row", "per_row_recipes"), variant in ("deq", "per_row", "per_row_recipes")
    if per_row:
        scale, xv = torch.rand(rows, 1, generator=g) * 10 ** (trial % 5), x
    else:  # with other recipes the stats read the matrix
        scale = torch.tensor(float(10 ** (trial % 5 - 2)))
        xv = x if variant == "recipes" else row_matrix(x.reshape(-1))  # a vector, refolded
    deq = xv.float() * 0.999 if has_deq else None
    key = ("cpu", x.dtype, fmt_name, per_row, has_deq)
    if variant in ("recipes", "per_row_recipes"):
        key = (*key, ("current", "bf16"), "activation", False)
    return key, (xv, scale, 1 / scale, torch.tensor(3.0), deq)
