"""The emulated delayed scaling against Transformer Engine's update kernel as written
(``delayed_scaling.cu`` ``kernel_bulk``, transcribed line by line in tests/te_standin.py), on
adversarial amax sequences: spikes, zeros, NaN and Inf elements, subnormals, FLT_MAX, several
records per step (TE keeps their max in row 0) and states updated in one batch or alone."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8scope.emulate import DelayedScaling, ScalingState
from fp8scope.emulate.scaling import UpdateGroup
from fp8scope.formats import get_format
from tests.te_standin import f32, kernel_bulk, te_amax

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")
NAN, INF = float("nan"), float("inf")
FLT_MAX = torch.finfo(torch.float32).max

element = st.one_of(
    st.sampled_from([0.0, NAN, INF, -INF, 1e-45, 1e-40, 1.2e-38, FLT_MAX, -FLT_MAX, 448.0, 57344.0, 1.0, -3.0]),
    st.floats(-1e30, 1e30),
).map(lambda v: float(torch.tensor(v, dtype=torch.float32)))
tensor = st.lists(element, min_size=1, max_size=4)
step = st.lists(tensor, min_size=1, max_size=3)  # the tensors one state quantizes in one step


def reference(steps, length, algo, fmt, margin):
    """(scale used at each step, history after all steps) per TE: row 0 = max of the step's amaxes."""
    history, scale = [0.0] * length, 1.0
    scaled_max = f32(fmt.max * 2.0 ** -margin)
    used = []
    for records in steps:
        used.append(scale)
        history[0] = max([history[0]] + [te_amax(torch.tensor(r)) for r in records])
        history, scale = kernel_bulk(history, scale, history[0], scaled_max, algo)
    return used, history


def emulate(state, steps):
    used = []
    for records in steps:
        for k, r in enumerate(records):  # one step: its last record makes the update due
            s = state.begin(torch.tensor(r, dtype=torch.float32), record=True, due=k == len(records) - 1)
            if k == 0:
                used.append(float(s.scale))
            else:
                assert float(s.scale) == used[-1]  # one scale for the whole step
    state.update()
    return used, state.amax_history.tolist()


def same(a, b):
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=12), length=st.integers(1, 5),
       algo=st.sampled_from(["max", "most_recent"]), margin=st.sampled_from([0, 1, 3]),
       fmt=st.sampled_from([E4M3, E5M2]))
def test_one_state_follows_te_kernel(steps, length, algo, margin, fmt):
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    want_used, want_hist = reference(steps, length, algo, fmt, margin)
    got_used, got_hist = emulate(ScalingState(recipe, fmt), steps)
    assert same(got_used, want_used), (got_used, want_used)
    assert same(got_hist, want_hist), (got_hist, want_hist)


@settings(max_examples=40, deadline=None)
@given(per_state=st.lists(st.lists(step, min_size=4, max_size=4), min_size=3, max_size=3),
       order=st.permutations([0, 1, 2]), length=st.integers(1, 4))
def test_states_updated_in_one_batch_follow_te_kernel(per_state, order, length):
    """Three states of one group, recording interleaved in a shuffled order: the batch applies every
    state's own update (the scale each one used is what TE's would have been)."""
    recipe = DelayedScaling(amax_history_len=length)
    group = UpdateGroup()
    fmts = (E4M3, E4M3, E5M2)
    states = [ScalingState(recipe, f) for f in fmts]
    for s in states:
        group.join(s)
    used = [[] for _ in states]
    for t in range(4):
        for i in order:
            records = per_state[i][t]
            for k, r in enumerate(records):
                s = states[i].begin(torch.tensor(r, dtype=torch.float32), record=True, due=k == len(records) - 1)
                if k == 0:
                    used[i].append(float(s.scale))
    for i, state in enumerate(states):
        state.update()
        want_used, want_hist = reference([per_state[i][t] for t in range(4)], length, "max", fmts[i], 0)
        assert same(used[i], want_used) and same(state.amax_history.tolist(), want_hist), i
