"""fp8scope's own small compiled functions (``fp8scope.compiled``), called without dynamo.

A variant whose trace assumes nothing about its sizes but their symbols is compiled by inductor
from a ``make_fx`` graph and called directly, with fp8scope's own check of what dynamo's guards
would check; everything else it is not made for runs the eager function. Real compiles
(inductor's C++ here: the same path that makes Triton on a GPU), real calls through
``stats_call`` and ``amax_pair``."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8scope.capture import stats as st
from fp8scope.compiled import CompiledFn, reset_dynamo
from fp8scope.emulate import amax as amax_mod
from fp8scope.formats import get_format
from tests.conftest import assert_same_row

FMT = get_format("e4m3")


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv("FP8SCOPE_COMPILE", "sync")
    reset_dynamo()
    yield
    reset_dynamo()


def _adversarial(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10 ** (seed % 7 - 3)
    flat = x.view(-1)
    flat[seed % flat.numel()] = [math.nan, math.inf, 0.0, 1e-40, 3e5][seed % 5]
    return x.to(dtype)


def test_full_stats_compile_to_a_direct_call_that_gives_the_eager_numbers(compiling):
    """Per-tensor (any rank, refolded by ``row_matrix``), with a dequantized copy, and with per-row
    scales: each variant is called directly, no call is turned away, and the numbers are the eager
    form's."""
    one, three = torch.tensor(2.0), torch.tensor(3.0)
    cases = [  # (x, scale, deq)
        (_adversarial((96, 40), torch.bfloat16, 1), one, None),
        (_adversarial((3, 50, 64), torch.bfloat16, 2), one, None),
        (_adversarial((1 << 14,), torch.bfloat16, 3), one, None),
        (_adversarial((70, 33), torch.float32, 4), one, "deq"),
        (_adversarial((70, 33), torch.float32, 5), torch.rand(70) * 100 + 1, "deq"),
    ]
    for x, scale, deq in cases:
        d = (x.float() * 0.999) if deq else None
        per_row = scale.numel() > 1
        key = ("cpu", x.dtype, FMT.name, per_row, d is not None)
        row, _, _ = st.stats_call(x, scale, 1 / scale, three, FMT, deq=d)  # compiles at this first call
        assert st.FULL_STATS.direct(key), (key, st.FULL_STATS.failures)
        runner = st.FULL_STATS._ready[key]
        before = runner.rejected
        row, recorded, _ = st.stats_call(x, scale, 1 / scale, three, FMT, deq=d)
        assert runner.rejected == before, "a call capture makes was turned away"
        xv = x.reshape(70, -1) if per_row else amax_mod.row_matrix(x)
        want = st.FULL_STATS.fallback(key)(xv, (scale.reshape(70, 1) if per_row else scale),
                                           (1 / scale).reshape(70, 1) if per_row else 1 / scale, three,
                                           d.reshape(xv.shape) if d is not None else None)
        assert_same_row(row, want)
        assert recorded.item() == want[2].item()


def test_calls_the_compiled_code_was_not_made_for_run_eagerly(compiling):
    """A strided view, a size-1 side, another dtype, a missing argument and a call under a dispatch
    mode run the eager function (counted as turned away), with the same numbers as ever; a first
    call under a dispatch mode runs eagerly and compiles nothing."""
    key = ("cpu", torch.bfloat16, FMT.name, False, False)
    s, si, e = torch.tensor(4.0), torch.tensor(0.25), torch.tensor(1.0)
    x = _adversarial((64, 48), torch.bfloat16, 6)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    family = CompiledFn("test_first_call", lambda key: (lambda t: t.abs().amax(1)), lambda key: (torch.ones(8, 8),))
    with Count():  # a first call under a mode does not compile: the mode would see the trace's ops
        family.get(("cpu",))(x)
    assert Count.ops == 2 and not family.direct(("cpu",)), Count.ops  # abs, amax: nothing traced
    family.get(("cpu",))(x)
    assert family.direct(("cpu",))
    st.stats_call(x, s, si, e, FMT)
    assert st.FULL_STATS.direct(key)
    runner, eager = st.FULL_STATS._ready[key], st.FULL_STATS.fallback(key)
    ok = runner.rejected
    assert_same_row(runner(x, s, si, e, None), eager(x, s, si, e, None))
    assert runner.rejected == ok
    for args in ((x.t(), s, si, e, None),  # strided
                 (x[:1], s, si, e, None),  # one row: dynamo would specialise on it too
                 (x.float(), s, si, e, None),  # another dtype
                 (x, s, si, e, x.float())):  # an argument the variant does not take
        assert_same_row(runner(*args), eager(*args))
    assert runner.rejected == ok + 4

    Count.ops = 0
    with Count():
        runner(x, s, si, e, None)
    assert Count.ops >= 30  # the eager form's ops, which the op-count proxies measure


def test_the_amax_pair_compiles_where_asked_and_keeps_te_semantics(compiling, monkeypatch):
    """The emulated layer's amax pair, compiled for the CPU when asked: called directly, NaN ignored
    by the recorded amax and kept by the logged one."""
    monkeypatch.setattr(amax_mod.AMAX, "_devices", None)  # the family compiles for CUDA only by default
    x = _adversarial((4, 32, 64), torch.bfloat16, 0)  # holds a NaN
    logged, recorded = amax_mod.amax_pair(x)
    key = ("cpu", torch.bfloat16)
    assert amax_mod.AMAX.direct(key), amax_mod.AMAX.failures
    logged, recorded = amax_mod.amax_pair(x)
    assert math.isnan(logged)
    assert recorded.item() == torch.nan_to_num(x.float().abs(), nan=0.0).max().item()


def test_variants_whose_trace_assumes_a_shape_relation_go_through_dynamo(compiling):
    """MXFP8 measured beside the stats reads 32-element blocks: the trace assumes sides that blocks
    divide, which dynamo's guards check; that variant is compiled through ``torch.compile``."""
    x = torch.randn(64, 96)
    key = ("cpu", torch.float32, FMT.name, False, False, ("mxfp8",), "activation", False)
    st.stats_call(x, torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0), FMT, recipes=("mxfp8",))
    assert key in st.FULL_STATS._ready, st.FULL_STATS.failures
    assert not st.FULL_STATS.direct(key)


def test_a_variant_that_cannot_compile_warns_once_and_runs_eagerly(compiling, caplog):
    """A compile failure is a monitor problem: one warning per family, the eager function from then
    on, and each reason kept; a compile that works logs its time (a long first full step says why)."""
    broken = CompiledFn("test_broken", lambda key: (lambda x: x * 2), lambda key: (torch.ones(8, 8),),
                        options=lambda key: {"no_such_inductor_option": 1})
    with pytest.warns(RuntimeWarning, match="could not compile test_broken"):
        fn = broken.get(("cpu",))
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0)) and ("cpu",) in broken.failures
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(broken.get(("cpu",))(torch.ones(2)), torch.full((2,), 2.0))  # no second warning
        assert torch.equal(broken.get(("cpu", 2))(torch.ones(2)), torch.full((2,), 2.0))  # nor for the next variant
    assert ("cpu", 2) in broken.failures
    working = CompiledFn("test_working", lambda key: (lambda x: x * 2), lambda key: (torch.ones(8, 8),))
    with caplog.at_level(logging.INFO, logger="fp8scope.compiled"):
        assert working.ensure(("cpu",))
    assert "compiled test_working ('cpu',) in" in caplog.text and "called directly" in caplog.text


def test_fp8scope_compile_0_runs_eagerly_even_after_a_compile(compiling, monkeypatch):
    """``FP8SCOPE_COMPILE=0`` keeps everything eager, also a variant compiled earlier in the process
    (a test's eager half after its compiled half used to run the compiled code)."""
    family = CompiledFn("test_switch", lambda key: (lambda t: t.abs().amax(1)), lambda key: (torch.ones(8, 8),))
    assert family.ensure(("cpu",))
    compiled = family.get(("cpu",))
    monkeypatch.setenv("FP8SCOPE_COMPILE", "0")
    assert family.get(("cpu",)) is family.fallback(("cpu",)) is not compiled
    monkeypatch.setenv("FP8SCOPE_COMPILE", "sync")
    assert family.get(("cpu",)) is compiled


@pytest.mark.parametrize("length", [1, 16])
def test_the_delayed_update_is_called_directly_with_its_history_length_fixed(compiling, length):
    """TE's delayed update with the history's length part of the variant: its trace then assumes
    nothing of the batch's size, so the code is called directly (and on a GPU compiles ahead), for
    one state and a batch, with the eager numbers on adversarial amaxes (0, NaN, Inf, a spike)."""
    from fp8scope.emulate.scaling import UPDATE, delayed_update, delayed_update_eager

    last = torch.tensor([0.0, math.nan, math.inf, 3e4, 1e-30, 2.0, 0.5])
    k = last.numel()
    history = torch.rand(k, length) * 10
    scaled_max, scale, expected = torch.full((k,), 448.0), torch.rand(k) + 0.5, torch.full((k,), 400.0)
    for most_recent in (False, True):
        for args in ((history, last, scaled_max, scale, expected),
                     (history[3], last[3], scaled_max[3], scale[3], expected[3])):
            got = delayed_update(*args, most_recent)
            key = ("cpu", most_recent, args[0].dim(), length)
            assert UPDATE.direct(key), (UPDATE.failures, UPDATE.not_direct)
            for a, b in zip(got, delayed_update_eager(*args, most_recent)):
                assert torch.equal(a.isnan(), b.isnan()) and torch.allclose(a, b, equal_nan=True), (a, b)
