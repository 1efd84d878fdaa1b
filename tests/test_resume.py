"""A run resumed from a checkpoint logs what the uninterrupted run logs: a preempted job, killed with
SIGKILL after its checkpoint, then continued in a new process with ``Monitor(step=N)``.

TE keeps its scaling state in the checkpoint (``get_extra_state``), so a resumed TE run quantizes
its next step with the scales it had. The emulated layers keep theirs the same way
(``Fp8Linear.get_extra_state``); the what-if monitor rebuilds its tensors' states from the run's
log (``fp8scope.resume``). Started from scale 1 instead, every resume showed a ``scale_mismatch`` and
the gradients' ``underflow``, and the report blamed FP8 at the resume step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest

from fp8scope.run import load_run
from tests.conftest import ROOT

TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {root!r})
    import fp8scope
    from fp8scope.emulate import DelayedScaling, convert_to_fp8
    from tests.conftest import MLP
    run, ckpt, start, stop, save_at, model, kill, detect = sys.argv[1:]
    start, stop, save_at = int(start), int(stop), int(save_at)
    torch.manual_seed(0)
    m = MLP(d=32, h=64, out=32)
    recipe = DelayedScaling(amax_history_len=8)
    if model == "emulated":
        m = convert_to_fp8(m, recipe=recipe)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    if start:
        saved = torch.load(ckpt, weights_only=True)
        m.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    mon = fp8scope.Monitor(m, run, every=4, recipe=recipe, detect=detect == "detect", step=start)
    for step in range(start, stop):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)) * (1 + step / 10)
        x[:, 0] *= 1e-6  # a feature far below the rest: a dynamic range one scale does not cover
        if step == 5:
            x = x * 0  # an amax of 0 rolls nothing into the history
        if step == 45:
            x = x * 100  # a spike past the resume step of the 60-step runs
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss.detach())
        if step + 1 == save_at:
            torch.save({{"model": m.state_dict(), "opt": opt.state_dict()}}, ckpt)
        print("RETURNED", step, flush=True)
    if kill == "kill":
        time.sleep(600)
    mon.close()
    """
).format(root=ROOT)


def _train(tmp_path, run: str, start: int, stop: int, model: str, kill: bool = False, save_at: int = 12,
           detect: bool = False) -> None:
    args = [sys.executable, "-c", TRAINER, str(tmp_path / run), str(tmp_path / f"{run}.pt"), str(start), str(stop),
            str(save_at), model, "kill" if kill else "close", "detect" if detect else "-"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.strip() == f"RETURNED {stop - 1}":
            break
    if kill:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == (-signal.SIGKILL if kill else 0)


def _rows(path) -> pd.DataFrame:
    t = load_run(path).table("tensors").to_pandas().drop(columns=["segment"])
    return t.sort_values(["step", "layer", "tensor"]).reset_index(drop=True)


@pytest.mark.parametrize("model", ["whatif", "emulated"])
def test_a_run_killed_after_its_checkpoint_and_resumed_logs_what_the_uninterrupted_run_logs(tmp_path, model):
    """Steps 0-17 with a checkpoint after step 11, SIGKILL, then steps 12-29 from the checkpoint in a
    new process, against steps 0-29 in one: every row (amax, scales, full stats) is the same, bit
    for bit, the resumed segment's included. A what-if tensor's state is rebuilt from its rows
    before step 12; an emulated layer's comes from the checkpoint."""
    _train(tmp_path, "straight", 0, 30, model)
    _train(tmp_path, "resumed", 0, 18, model, kill=True)
    _train(tmp_path, "resumed", 12, 30, model)

    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert set(load_run(tmp_path / "resumed").table("tensors")["segment"].to_pylist()) == {0, 1}
    assert (straight["source"] == model).all() and straight["step"].max() == 29
    at_resume = straight[straight["step"] == 12]
    assert (at_resume["scale"] != 1).all()  # a fresh state's scale 1 would differ from the run's
    pd.testing.assert_frame_equal(resumed, straight)


def test_online_detection_of_a_resumed_run_reports_what_the_uninterrupted_run_reported(tmp_path):
    """Online detection (its rules in their child process) continues from the run's last logged
    steps (``fp8scope.resume.logged_steps``, examined without reporting): the events the resumed life
    stored are the uninterrupted run's from the resume step on. Started with empty windows, it
    judged the resumed life's first rows against nothing before them."""
    _train(tmp_path, "straight", 0, 60, "whatif", save_at=30, detect=True)
    _train(tmp_path, "resumed", 0, 37, "whatif", kill=True, save_at=30, detect=True)
    _train(tmp_path, "resumed", 30, 60, "whatif", save_at=30, detect=True)

    def events(run: str, segment: int | None) -> pd.DataFrame:
        t = load_run(tmp_path / run).table("events").to_pandas()
        t = t[t["step"] >= 30] if segment is None else t[t["segment"] == segment]
        return t.drop(columns=["segment"]).sort_values(["step", "rule", "layer", "tensor"]).reset_index(drop=True)

    straight = events("straight", None)
    assert 45 in set(straight["step"]), straight  # the spike past the resume step is reported, once
    pd.testing.assert_frame_equal(events("resumed", 1), straight)


def test_the_state_is_the_banks_own_at_the_step_from_this_ranks_rows_the_later_segment_winning(tmp_path):
    """``fp8scope.resume.whatif_states`` on streams the store's writer wrote: a tensor's amaxes, with
    a 0 (rolls nothing in) and a NaN (rolls in as 0), logged with the scales a
    ``DeviceDelayedBank`` gave them; a first life that went on past its checkpoint (steps 6-8, other
    amaxes) and a second that logged steps 6-9 again in a later segment; and rank 0's aggregate
    rows (rank -1) in its stream. At step 10 the state is the bank's own after it took the merged
    sequence: history, scales, expected amax, kept."""
    import numpy as np
    import torch

    from fp8scope.emulate import DelayedScaling
    from fp8scope.emulate.device_bank import DeviceDelayedBank
    from fp8scope.formats import get_format
    from fp8scope.resume import whatif_states
    from fp8scope.schema import FIELD_INDEX, N_FIELDS
    from fp8scope.step_payload import TensorKey
    from fp8scope.step_records import tensor_batch
    from fp8scope.store.layout import list_streams
    from fp8scope.store.writer import RunWriter

    recipe = DelayedScaling(amax_history_len=4)
    keys = [TensorKey("l", "activation", "whatif", "e4m3", 448.0, (4, 4), "delayed"),
            TensorKey("l", "gradient", "whatif", "e5m2", 57344.0, (4, 4), "delayed")]
    first = [[3.0, 1e-3], [0.0, 2e-3], [5.0, float("nan")], [2.0, 1e-3], [7.0, 4e-4], [1.0, 0.0]]
    again = [[4.0, 3e-3], [0.5, 1e-3], [6.0, 2e-4], [2.5, 5e-4]]  # steps 6-9 of the second life
    bank = DeviceDelayedBank(recipe, "cpu")
    slots = [bank.add(get_format(k.fmt)) for k in keys]

    def write(writer, step, amaxes, rank=0, feed=True) -> None:
        """One step's rows; ``feed``: the bank takes the step (its scales are the rows')."""
        m = np.full((len(keys), N_FIELDS), np.nan)
        for i, (slot, a) in enumerate(zip(slots, amaxes)):
            scale, scale_inv, expected = bank.scales(slot) if feed else (torch.tensor(9.0),) * 3
            m[i, FIELD_INDEX["amax"]], m[i, FIELD_INDEX["numel"]] = a, 16
            m[i, FIELD_INDEX["scale"]], m[i, FIELD_INDEX["scale_inv"]] = float(scale), float(scale_inv)
            m[i, FIELD_INDEX["expected_amax"]] = float(expected)
            if feed:
                bank.record_amax(slot, torch.tensor(a))
        writer.write("tensors", tensor_batch(step, rank, m, [0, 1], keys, False))
        if feed:
            bank.resolve()

    with RunWriter(tmp_path, 0) as first_life:
        for step, amaxes in enumerate(first):
            write(first_life, step, amaxes)
            write(first_life, step, [1e6, 1e6], rank=-1, feed=False)  # the ranks' aggregate
        for step in range(6, 9):  # past the checkpoint: replaced by the second life's rows
            write(first_life, step, [100.0, 100.0], feed=False)
    with RunWriter(tmp_path, 0) as second_life:
        assert second_life.segment == 1
        for step, amaxes in enumerate(again, start=6):
            write(second_life, step, amaxes)
            write(second_life, step, [1e6, 1e6], rank=-1, feed=False)
    states = whatif_states(list_streams(tmp_path), 0, 10, recipe)
    assert sorted(states) == [("l", "activation"), ("l", "gradient")]
    for key, slot in zip(keys, slots):
        fmt, history, scale, scale_inv, expected, kept = states[(key.layer, key.role)]
        assert fmt == key.fmt
        assert torch.equal(history, bank.history[slot]), (key.role, history, bank.history[slot])
        for ours, theirs in ((scale, bank.scale), (scale_inv, bank.scale_inv), (expected, bank.expected),
                             (kept, bank.kept)):
            assert torch.equal(ours, theirs[slot]), key.role
    assert states[("l", "gradient")][1][1:].tolist() != [0.0] * 3  # the history holds rolled amaxes
    assert whatif_states(list_streams(tmp_path), 1, 10, recipe) == {}  # another rank's: none here
