"""HostDelayedBank (the what-if monitor's CPU delayed scaling) against ScalingState, which the
hand-computed TE sequences of test_emulate.py pin down: capture by capture, the same rows; after
each step's update, the same history, scales, expected amax and kept flag."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8scope import native
from fp8scope.emulate import DelayedScaling, ScalingState
from fp8scope.emulate.recipes import CurrentScaling
from fp8scope.emulate.scaling_bank import HostDelayedBank
from fp8scope.formats import get_format

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")
NAN, INF = float("nan"), float("inf")
FP32_MAX = torch.finfo(torch.float32).max

# float32 values, as the amax kernel measures them
amax_values = st.one_of(
    st.sampled_from([0.0, NAN, INF, 1e-45, 1e-40, 3.0e38, FP32_MAX, 448.0, 57344.0, 1.0]),
    st.floats(1e-30, 1e30),
).map(lambda v: float(torch.tensor(v, dtype=torch.float32)))


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    native.kernel()  # built now: the bank uses it from its first update


def kernel_paths(test):
    """Run ``test(**kwargs)`` once with the C update (where it builds) and once with numpy's."""
    @functools.wraps(test)
    def both(*args, **kwargs):
        paths = [False] + ([True] if native.delayed_update_fn() is not None else [])
        for on in paths:
            old = native.set_enabled(on)
            try:
                test(*args, **kwargs)
            finally:
                native.set_enabled(old)
    return both


def same(a, b) -> bool:
    """Equality of float sequences where NaN == NaN."""
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def state_row(state: ScalingState, amax: float) -> list[float]:
    got = state.begin_values(torch.tensor([amax], dtype=torch.float32), record=True)
    return [float(v) for v in got]


# one step: for each of 3 tensors, 0, 1 or 2 captures (2 = micro-batches)
steps_strategy = st.lists(st.lists(st.lists(amax_values, min_size=0, max_size=2), min_size=3, max_size=3),
                          min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(steps=steps_strategy, hist=st.integers(1, 8), algo=st.sampled_from(["max", "most_recent"]),
       margin=st.sampled_from([0, 1, 3]))
@kernel_paths
def test_bank_matches_scaling_state_capture_by_capture(steps, hist, algo, margin):
    recipe = DelayedScaling(amax_history_len=hist, amax_compute_algo=algo, margin=margin)
    fmts = (E4M3, E4M3, E5M2)
    bank = HostDelayedBank(recipe)
    slots = [bank.add(f) for f in fmts]
    states = [ScalingState(recipe, f, host=True) for f in fmts]
    for step in steps:
        # captures interleave across tensors, as a model's layers do
        for k in range(2):
            for slot, st_, amaxes in zip(slots, states, step):
                if k < len(amaxes):
                    want = state_row(st_, amaxes[k])
                    got = list(bank.record(slot, amaxes[k]))
                    assert same(got, want), (got, want)
        bank.update()  # the step's end; each ScalingState applies the same update lazily
        for slot, st_ in zip(slots, states):
            st_.update()
            assert same(bank.history(slot), st_.amax_history.tolist())
            assert same([bank.scale[slot], bank.scale_inv[slot], bank.expected[slot]],
                        [st_.scale.item(), st_.scale_inv.item(), st_.latest()[3]])
            assert bank.kept[slot] == bool(st_.scale_kept)
            assert bank.updates[slot] == st_.updates


@settings(max_examples=40, deadline=None)
@given(amaxes=st.lists(amax_values, min_size=1, max_size=30), hist=st.integers(1, 6),
       algo=st.sampled_from(["max", "most_recent"]))
@kernel_paths
def test_bank_full_step_halves_equal_a_capture(amaxes, hist, algo):
    """scales() then record_amax() (a full step measures the amax in its own pass) is record()."""
    recipe = DelayedScaling(amax_history_len=hist, amax_compute_algo=algo)
    a, b = HostDelayedBank(recipe), HostDelayedBank(recipe)
    sa, sb = a.add(E4M3), b.add(E4M3)
    for i, v in enumerate(amaxes):
        want = a.record(sa, v)
        got = b.scales(sb)
        b.record_amax(sb, v)
        assert same(list(got), list(want[1:]))
        if i % 3 == 0:  # some steps end with the update, others leave it to the next capture
            a.update()
            b.update()
    assert same(a.history(sa), b.history(sb))


@kernel_paths
def test_bank_hand_computed_sequence():
    """TE's rule by hand, history 3, max: the scale follows the window max of the recorded amaxes
    (roll after each step, zero amax keeps the scale, NaN is ignored by the max)."""
    bank = HostDelayedBank(DelayedScaling(amax_history_len=3, amax_compute_algo="max"))
    s = bank.add(E4M3)
    scales = []
    for amax in (2.0, 8.0, 1.0, 0.0, NAN, 1.0, 1.0):
        scales.append(bank.record(s, amax)[1])
        bank.update()
    # in use at each capture: 1 (initial), 448/2, 448/8, 448/8, 448/8 (zero: kept),
    # 448/8 (window 8, 1, NaN -> 8), then the 8 has left the window: 448/1
    assert scales == [1.0, 224.0, 56.0, 56.0, 56.0, 56.0, 448.0]
    assert not bank.kept[s]
    assert same(bank.history(s), [0.0, 1.0, 1.0])


@kernel_paths
def test_bank_slot_goes_on_as_a_scaling_state():
    """to_state (a what-if tensor that left the CPU) continues the slot's sequence exactly."""
    recipe = DelayedScaling(amax_history_len=4)
    bank, ref = HostDelayedBank(recipe), HostDelayedBank(recipe)
    s, r = bank.add(E5M2), ref.add(E5M2)
    seq = [3.0, 0.5, NAN, 0.0, 7.0, 2.0, 1.0, 0.25]
    for v in seq[:4]:
        bank.record(s, v)
        ref.record(r, v)
        bank.update()
        ref.update()
    bank.record(s, seq[4])
    state = bank.to_state(s, E5M2)  # with the update of seq[4] still pending
    ref.record(r, seq[4])
    for v in seq[5:]:
        assert same(state_row(state, v), list(ref.record(r, v)))
    ref.update()
    state.update()
    assert same(state.amax_history.tolist(), ref.history(r))


def test_bank_needs_delayed_scaling():
    with pytest.raises(TypeError):
        HostDelayedBank(CurrentScaling())


def _tensor_with_amax(v: float, dtype=torch.float32) -> torch.Tensor:
    """A small tensor whose max |x| is ``v`` (NaN, Inf and 0 included)."""
    return torch.tensor([0.25 * v if math.isfinite(v) else 0.0, -v, 0.0], dtype=torch.float32).to(dtype)


@settings(max_examples=60, deadline=None)
@given(steps=steps_strategy, hist=st.integers(1, 6), algo=st.sampled_from(["max", "most_recent"]),
       capacity=st.integers(1, 8))
def test_kernel_capture_is_record_plus_a_logged_row(steps, hist, algo, capacity):
    """fp8s_bank_capture (the what-if cheap capture) against bank.record on a twin bank: the same
    row, the key id, numel and ``after`` it was given, the same state after each update; a full log
    refuses the capture (nothing recorded, the caller records it the Python way) and grows."""
    from fp8scope.capture.row_log import RowLog

    fn = native.bank_capture_fn()
    if fn is None:
        pytest.skip("no C compiler: the kernel capture does not exist")
    recipe = DelayedScaling(amax_history_len=hist, amax_compute_algo=algo)
    bank, twin, log = HostDelayedBank(recipe), HostDelayedBank(recipe), RowLog(capacity)
    bank.attach_log(log)
    slots = [(bank.add(f), twin.add(f)) for f in (E4M3, E4M3, E5M2)]
    refused = 0
    for step in steps:
        want, python_rows = [], 0
        for k in range(2):
            for i, ((s, t), amaxes) in enumerate(zip(slots, step)):
                if k < len(amaxes):
                    x = _tensor_with_amax(amaxes[k])
                    row = list(twin.record(t, amaxes[k]))
                    if fn(bank.ctx_address, x.data_ptr(), 0, x.numel(), s, 10 + i, python_rows) < 0:
                        bank.record(s, float(x.abs().max()))  # what the tap does then
                        python_rows += 1
                        refused += 1
                    else:
                        want.append(row + [10 + i, 3, python_rows])
        got = log.take()
        assert same(list(got) if got is not None else [], [v for r in want for v in r])
        bank.update(captured=True)
        twin.update()
        for s, t in slots:
            assert same(bank.history(s), twin.history(t))
            assert (bank.scale[s], bank.scale_inv[s], bank.kept[s]) == (twin.scale[t], twin.scale_inv[t], twin.kept[t])
    assert (log.meta[1] > capacity) == (refused > 0)


def test_kernel_capture_reads_half_precision_and_large_tensors():
    """bf16 / fp16 tensors and one large enough to be split over threads: the amax is the tensor's."""
    from fp8scope.capture.row_log import RowLog

    fn = native.bank_capture_fn()
    if fn is None:
        pytest.skip("no C compiler: the kernel capture does not exist")
    bank, log = HostDelayedBank(DelayedScaling()), RowLog()
    bank.attach_log(log)
    log.set_threads(2)
    s = bank.add(E4M3)
    big = torch.randn(1 << 18)
    big[123_457] = -40.0
    for x in (_tensor_with_amax(3.5, torch.bfloat16), _tensor_with_amax(-0.75, torch.float16), big):
        assert fn(bank.ctx_address, x.data_ptr(), native.dtype_code(x.dtype), x.numel(), s, 0, 0) > 0
    got = list(log.take())
    assert got[0::7] == [3.5, 0.75, 40.0] and got[5::7] == [3, 3, 1 << 18]
    assert log.take() is None
