"""DeviceDelayedBank (the what-if monitor's delayed scaling, batched per step) against ScalingState,
which test_emulate.py pins to hand-computed TE sequences: capture by capture the same rows, after
each step the same history, scales, expected amax and kept flag. A cheap capture's amax is one
``aminmax``, exactly TE's but on a tensor holding a NaN, which rolls in as 0 (``cheap_row`` feeds the
reference that amax; tested below). Runs on the CPU (the bank's code is device-independent torch);
test_gpu.py runs the monitor on CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8scope.emulate import DelayedScaling, ScalingState
from fp8scope.emulate.amax import amax_pair
from fp8scope.emulate.device_bank import DeviceDelayedBank
from fp8scope.emulate.recipes import CurrentScaling
from fp8scope.formats import get_format

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")
NAN, INF = float("nan"), float("inf")

amax_values = st.one_of(
    st.sampled_from([0.0, NAN, INF, 1e-45, 1e-40, 3.0e38, torch.finfo(torch.float32).max, 448.0, 57344.0, 1.0]),
    st.floats(1e-30, 1e30),
).map(lambda v: float(torch.tensor(v, dtype=torch.float32)))

# one step: for each of 3 tensors, 0, 1 or 2 captures (2 = micro-batches)
steps_strategy = st.lists(st.lists(st.lists(amax_values, min_size=0, max_size=2), min_size=3, max_size=3),
                          min_size=1, max_size=20)


def same(a, b) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def tensor_with_amax(v: float) -> torch.Tensor:
    return torch.tensor([0.25 * v if math.isfinite(v) else 0.0, -v, 0.0], dtype=torch.float32)


def state_row(state: ScalingState, x: torch.Tensor) -> list[float]:
    state.begin(x, record=True)
    return [float(v) for v in state.latest()]


def cheap_row(state: ScalingState, x: torch.Tensor) -> list[float]:
    """The row the bank promises a cheap capture of ``x``: ScalingState's, recording the amax one
    ``aminmax`` gives, which is TE's but on a tensor holding a NaN, where the NaN is recorded (and
    rolls in as 0) instead of TE's fmaxf amax of the other elements."""
    if not bool(torch.isnan(x).any()):
        return state_row(state, x)
    state.begin(x, record=False)
    state.record(torch.tensor(NAN))
    return [float(v) for v in state.latest()]


def assert_same_state(bank: DeviceDelayedBank, slot: int, state: ScalingState) -> None:
    assert same(bank.history[slot].tolist(), state.amax_history.tolist())
    assert same([float(bank.scale[slot]), float(bank.scale_inv[slot]), float(bank.expected[slot])],
                [float(state.scale), float(state.scale_inv), float(state.latest()[3])])
    assert bool(bank.kept[slot]) == bool(state.scale_kept)
    assert bank.updates[slot] == state.updates


@settings(max_examples=60, deadline=None)
@given(steps=steps_strategy, hist=st.integers(1, 6), algo=st.sampled_from(["max", "most_recent"]),
       margin=st.sampled_from([0, 2]), order=st.permutations([0, 1, 2]))
def test_device_bank_matches_scaling_state_capture_by_capture(steps, hist, algo, margin, order):
    recipe = DelayedScaling(amax_history_len=hist, amax_compute_algo=algo, margin=margin)
    fmts = (E4M3, E4M3, E5M2)
    bank = DeviceDelayedBank(recipe, "cpu")
    slots = [bank.add(f) for f in fmts]
    states = [ScalingState(recipe, f) for f in fmts]
    for step in steps:
        rows, want = [], []
        for k in range(2):  # captures interleave across tensors (and micro-batches), in a shuffled layer order
            for i in order:
                if k < len(step[i]):
                    x = tensor_with_amax(step[i][k])
                    want.append(cheap_row(states[i], x))
                    rows.append(bank.capture(slots[i], x))
        values = bank.take_rows()
        for row, w in zip(rows, want):
            assert same(values[row.index].tolist(), w), (values[row.index].tolist(), w)
        for slot, state in zip(slots, states):
            state.update()
            assert_same_state(bank, slot, state)


@settings(max_examples=40, deadline=None)
@given(amaxes=st.lists(amax_values, min_size=1, max_size=25), hist=st.integers(1, 6),
       algo=st.sampled_from(["max", "most_recent"]))
def test_device_bank_full_steps_and_micro_batches(amaxes, hist, algo):
    """scales() then record_amax() (full steps: full stats measure the amax), two captures of the
    slot per step, against ScalingState.begin."""
    recipe = DelayedScaling(amax_history_len=hist, amax_compute_algo=algo)
    bank = DeviceDelayedBank(recipe, "cpu")
    other = bank.add(E5M2)  # a second slot that is never captured: its state must not move
    slot = bank.add(E4M3)
    state = ScalingState(recipe, E4M3)
    for i, v in enumerate(amaxes):
        x = tensor_with_amax(v)
        want = state_row(state, x)
        got = bank.scales(slot)
        assert same([float(t) for t in got], want[1:])
        bank.record_amax(slot, amax_pair(x)[1])  # what the stats pass hands over: TE's amax
        if i % 3 == 2:  # some steps end here, others take a second (micro-batch) capture first
            bank.resolve()
            state.update()
            assert_same_state(bank, slot, state)
    assert bank.updates[other] == 0 and float(bank.scale[other]) == 1.0


def test_device_bank_empty_tensor_half_precision_and_hand_sequence():
    """An empty tensor records amax 0 (the scale is kept); bf16 is read in float32; TE's rule by hand."""
    bank = DeviceDelayedBank(DelayedScaling(amax_history_len=3, amax_compute_algo="max"), "cpu")
    s = bank.add(E4M3)
    used = []
    for amax in (2.0, 8.0, 1.0, 0.0, NAN, 1.0, 1.0):
        row = bank.capture(s, tensor_with_amax(amax).to(torch.bfloat16))
        used.append(bank.take_rows()[row.index, 1].item())
    # the NaN tensor rolls in as 0 (TE's fmaxf amax of its other elements, 0, would not roll), so
    # the 8 leaves the 3-row window one capture after it
    assert used == [1.0, 224.0, 56.0, 56.0, 56.0, 56.0, 448.0]
    row = bank.capture(s, torch.zeros(0, 4))
    assert bank.take_rows()[row.index].tolist() == [0.0, 448.0, float(torch.tensor(1 / 448.0)), 1.0]
    assert bool(bank.kept[s])


def test_cheap_amax_differs_from_te_only_on_nan():
    """A cheap capture's amax is one eager op that propagates NaN: the row logs the NaN (the first
    NaN is localized), but the history cannot know TE's fmaxf amax of the other elements and rolls
    in 0 (never a NaN)."""
    bank = DeviceDelayedBank(DelayedScaling(amax_history_len=3), "cpu")
    s = bank.add(E4M3)
    for v in (2.0, 4.0):
        bank.capture(s, tensor_with_amax(v))
        bank.take_rows()
    row = bank.capture(s, torch.tensor([NAN, 3.0]))
    assert math.isnan(bank.take_rows()[row.index, 0].item())
    bank.capture(s, tensor_with_amax(1.0))
    bank.take_rows()
    # the NaN step rolled (as 0), so the 4 has left the 3-row window; TE's amax 3 would have stayed
    assert bank.history[s].tolist() == [0.0, 0.0, 1.0] and not torch.isnan(bank.history).any()


def test_device_bank_slot_moves_to_another_bank():
    """A tensor that moves (model.to(device)) takes its slot's state to the new device's bank."""
    recipe = DelayedScaling(amax_history_len=4)
    bank, ref = DeviceDelayedBank(recipe, "cpu"), ScalingState(recipe, E5M2)
    s = bank.add(E5M2)
    seq = [3.0, 0.5, NAN, 0.0, 7.0, 2.0, 1.0, 0.25]
    for v in seq[:5]:
        bank.capture(s, tensor_with_amax(v))
        bank.take_rows()
        cheap_row(ref, tensor_with_amax(v))
        ref.update()
    other = DeviceDelayedBank(recipe, "cpu")
    other.add(E4M3)
    t = other.add(E5M2, like=(bank, s))
    for v in seq[5:]:
        row = other.capture(t, tensor_with_amax(v))
        assert same(other.take_rows()[row.index].tolist(), cheap_row(ref, tensor_with_amax(v)))
        ref.update()
    assert_same_state(other, t, ref)


def test_device_bank_needs_delayed_scaling():
    with pytest.raises(TypeError):
        DeviceDelayedBank(CurrentScaling(), "cpu")


def test_a_shared_input_is_read_once_while_unchanged_and_kept_alive_by_nothing():
    """Three slots capturing one tensor in a row (q, k, v reading one hidden state) read it once; the
    tensor changed in place is read again; the memo holds no reference that would keep a layer
    input alive through the backward; each slot still gets its own row."""
    import weakref

    bank = DeviceDelayedBank(DelayedScaling(amax_history_len=4), "cpu")
    slots = [bank.add(E4M3) for _ in range(4)]
    x = torch.tensor([1.0, -3.0, 2.0])
    for s in slots[:3]:
        bank.capture(s, x, shared=True)
    assert bank._codes[0] == bank._codes[1] == bank._codes[2]  # one aminmax for the three
    x.mul_(2)  # changed in place: its version moved, so it is read again
    bank.capture(slots[3], x, shared=True)
    assert bank._codes[3] != bank._codes[0]
    rows = bank.take_rows()
    assert rows[:, 0].tolist() == [3.0, 3.0, 3.0, 6.0]
    y = torch.ones(5)
    ref = weakref.ref(y)
    bank.capture(slots[0], y, shared=True)
    del y
    assert ref() is None
    z = torch.full((5,), 2.0)  # a new tensor, maybe where y was: read, not taken for y
    bank.capture(slots[1], z, shared=True)
    assert bank.take_rows()[:, 0].tolist() == [1.0, 2.0]


def test_a_step_of_many_captures_in_several_dtypes_matches_scaling_state():
    """The bank reads each capture's amax into the next row of the step's buffer of its dtype: a step of
    300 captures (the buffers grow mid-step, keeping the rows read before), bf16, fp16 and float32
    inputs interleaved, empty tensors, a NaN, an inference-mode tensor, micro-batches, and a slot added
    mid-step that copies another bank's slot (which resolves that bank mid-step): every row and every
    state as ScalingState has them, step after step."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=3)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    bank, other = DeviceDelayedBank(recipe, "cpu"), DeviceDelayedBank(recipe, "cpu")
    slots = [bank.add(E4M3) for _ in range(60)]
    states = [ScalingState(recipe, E4M3) for _ in slots]
    for step in range(4):
        rows, want = [], []
        for k in range(300):  # 5 captures a slot: micro-batches
            i = k % 60
            x = (torch.randn(7, 5) * (k + 1)).to(dtypes[k % 3])
            if k == 17 and step == 2:
                x[3, 1] = NAN
            if k == 23:
                x = x[:0]  # empty
            if k == 41:
                with torch.inference_mode():
                    x = x.clone()
            if k == 100 and step == 1:  # resolves `bank` mid-step (a tensor moved in from it)
                moved = other.add(E4M3, like=(bank, slots[7]))
            want.append(cheap_row(states[i], x.float()) if x.numel() else state_row(states[i], x.float()))
            rows.append(bank.capture(slots[i], x, shared=k % 5 == 0))
        values = bank.take_rows()
        assert bank._extra == [] and all(entry[2] == 0 for entry in bank._out.values())  # nothing kept
        for row, w in zip(rows, want):
            assert same(values[row.index].tolist(), w), (row.index, values[row.index].tolist(), w)
        for slot, state in zip(slots, states):
            state.update()
            assert_same_state(bank, slot, state)
    assert sorted(len(entry[1]) for entry in bank._out.values()) == [128, 128, 128]  # each grew once
    assert other.updates[moved] >= 1


def test_adding_slots_one_at_a_time_writes_memory_linear_in_their_number():
    """A MoE monitors tens of thousands of tensors (48 layers x 128 experts x 2 GEMMs x 3 roles in a
    Qwen3-MoE), each slot added on its tensor's first capture. Growing every state tensor by one row per
    add wrote n**2 / 2 rows in all: 13 minutes of a first step. The elements written by the ops of
    ``add`` that are not views (counted with a dispatch mode, so deterministic) must stay linear in the slots; the slots
    keep their state across the stores' growth."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Written(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not func.is_view:  # a view writes nothing
                    Written.elements += t.numel()
            return out

    bank = DeviceDelayedBank(DelayedScaling(amax_history_len=16), "cpu")
    first = bank.add(E4M3)
    bank.capture(first, tensor_with_amax(3.0))
    bank.take_rows()
    n = 4096
    with Written():
        for _ in range(n - 1):
            bank.add(E5M2)
    assert len(bank) == n and bank.history.shape == (n, 16) and bank.scale.shape == (n,)
    per_slot = 16 + 5  # a history row and the other states' elements
    assert Written.elements < 8 * n * per_slot, Written.elements  # 426k; one row per add wrote 176M
    rows = [bank.capture(s, tensor_with_amax(2.0)) for s in (first, n - 1)]
    values = bank.take_rows()
    assert values[rows[0].index, 1].item() == pytest.approx(448.0 / 3.0)  # the first slot's update survived
    assert values[rows[1].index, 1].item() == 1.0  # a new slot starts at TE's scale 1
