"""Did training suffer after FP8's first symptom? The report's verdict asks this before it blames FP8.

An FP8 symptom is not always harm. In the detection suite, 1000x outliers planted in an MLP's input were
clipped by their delayed scales, and in most of those runs the loss never moved. A clean T5 grew an
outlier that pressed 2.2 % of a tensor under the flush threshold while its loss fell throughout. "FP8 is
the likely cause" of a loss that never moved sends a user looking for a failure that is not there. So the
verdict tells the two apart: FP8 symptoms that training shows (a loss or grad-norm spike, a non-finite
loss, a loss that rose and stayed up), and symptoms it does not show yet.

Only the loss and grad-norm series count. The symptom's own numbers (how much clipped, how much flushed)
are the rules' business: here the question is what training made of them.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from fp8scope.detect.config import DetectConfig

HARM_RULES = ("loss_nonfinite", "loss_spike", "grad_norm_spike")
# logged losses per median: a rise that lasts this long is the loss moving, not one hard batch (a spike
# that short is the loss_spike rule's, judged against the run's own variability)
HARM_WINDOW = 10


def training_harm(losses: pd.DataFrame | None, serious: pd.DataFrame, since: dict, cfg: DetectConfig) -> dict:
    """Whether training shows harm at or after ``since`` (the first FP8 symptom: ``step``).

    ``losses``: the logged loss per step (``step``, ``value``; the mean over ranks), None or empty when the
    run logs none. ``serious``: the warning-or-critical events. The harm, first found first:

    - a ``loss_nonfinite``, ``loss_spike`` or ``grad_norm_spike`` event at or after that step;
    - a non-finite loss from that step on;
    - the loss's median over ``HARM_WINDOW`` logged steps rising ``cfg.loss_spike_factor`` x above the lowest
      such median before it (a positive loss only: a negative objective has no ratio).

    Returns ``hurt`` (True, False, or None where no loss was logged from that step on), ``how`` (one clause
    for the verdict), ``since`` and ``steps_since`` (logged losses from that step on)."""
    step = int(since["step"])
    ev = serious[serious["rule"].isin(HARM_RULES) & (serious["step"] >= step)] if not serious.empty else serious
    if not ev.empty:
        e = ev.sort_values("step", kind="stable").iloc[0]
        what = {"loss_nonfinite": "went non-finite", "loss_spike": "spiked"}.get(e["rule"])
        how = f"the loss {what} at step {int(e['step'])}" if what else f"the grad norm spiked at step {int(e['step'])}"
        return {"hurt": True, "how": how, "since": step, "steps_since": _steps_since(losses, step)}
    if losses is None or losses.empty or _steps_since(losses, step) == 0:
        return {"hurt": None, "how": "no loss was logged after it to tell whether training suffered",
                "since": step, "steps_since": 0}
    s = losses.sort_values("step", kind="stable")
    steps = s["step"].to_numpy()
    v = s["value"].to_numpy(dtype=float)
    after = steps >= step
    bad = after & ~np.isfinite(v)
    if bad.any():
        return {"hurt": True, "how": f"the loss went non-finite at step {int(steps[bad][0])}", "since": step,
                "steps_since": int(after.sum())}
    out = {"hurt": False, "since": step, "steps_since": int(after.sum())}
    med = pd.Series(v).rolling(HARM_WINDOW, min_periods=HARM_WINDOW // 2).median().to_numpy()
    ok = np.isfinite(v).all() and (v > 0).all() and np.isfinite(med).sum() >= 2
    if ok:
        low = np.fmin.accumulate(np.where(np.isfinite(med), med, np.inf))  # the lowest median up to each step
        rise = np.full(len(v), np.nan)
        rise[1:] = med[1:] / low[:-1]
        judged = after & np.isfinite(rise)
        over = judged & (rise >= float(cfg.loss_spike_factor))
        if over.any():
            i = int(np.argmax(over))
            return {**out, "hurt": True,
                    "how": f"the loss rose to {_g(med[i])} by step {int(steps[i])} (median of {HARM_WINDOW} logged "
                           f"steps), {_g(rise[i])}x its lowest before ({_g(low[i - 1])})"}
        if judged.any():
            return {**out, "how": f"the loss has not moved in the {_steps(out['steps_since'])} since (median of the "
                                  f"last {HARM_WINDOW}: {_g(med[-1])}; at most {_g(np.nanmax(rise[judged]))}x its "
                                  "lowest before)"}
    return {**out, "how": f"the loss stayed finite in the {_steps(out['steps_since'])} since, with no spike"}


def _steps(n: int) -> str:
    return "1 logged step" if n == 1 else f"{n} logged steps"


def _steps_since(losses: pd.DataFrame | None, step: int) -> int:
    return 0 if losses is None or losses.empty else int((losses["step"] >= step).sum())


def _g(x) -> str:
    return f"{float(x):.3g}" if math.isfinite(float(x)) else str(x)
