"""Optimizer-side rules, one scalar value at a time: loss and grad-norm spikes judged against the
run's own variability, learning-rate changes the schedule does not explain, non-finite losses.

The online detector feeds each step's scalars; the offline engine feeds each series in step order.
Both call :meth:`ScalarState.update`, so a run gets the same events either way.

Why these shapes:

- A fixed "2x the mean" misses what matters on real runs (a 30x learning-rate jump raised the loss
  1.59x and the grad norm 3.7x) and cries wolf on noisy ones. A spike is judged in log space
  against the median of the previous values and their spread (MAD): ``z = (log v - median) /
  spread``. It fires when z is large *and* the value is a minimum factor above the median, so a run
  with almost no noise does not flag a 2 % wobble.
- One event per excursion: a loss that jumps and stays up is one event, the next one fires after
  it came back (z below half the threshold).
- A learning rate moves every step under warm-up and decay. The rule compares each step's change
  with the largest change of the previous steps (the schedule's own pace): a linear warm-up's
  early doublings and a cosine decay never fire; a jump of several times the pace does (upward:
  warning; a drop: info, a step schedule is a normal thing).
- Warm-up is per series: a rule judges once its series has ``scalar_min_history`` values, not
  after a fixed step number.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from fp8scope.detect.config import DetectConfig
from fp8scope.detect.events import event
from fp8scope.detect.rules import _fmt

SCALAR_RULES = ("loss_spike", "grad_norm_spike", "lr_change", "loss_nonfinite")
SCALAR_ORDER = 1 << 30


class _Series:
    __slots__ = ("values", "in_spike", "bad", "ratios", "last", "peak")

    def __init__(self, window: int):
        self.values: deque = deque(maxlen=window)  # finite values, log space for spikes
        self.ratios: deque = deque(maxlen=window)  # |log(lr_t / lr_t-1)| for the lr rule
        self.in_spike = False
        self.bad = False
        self.last: float | None = None
        self.peak = 0.0  # the largest lr of the series so far (the lr rule)


def spike_stats(windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's median and raw spread (1.4826 x its median absolute deviation): the statistics a
    loss or grad-norm spike is judged against, for a matrix of windows of log values (one row per
    judged value: offline detection's whole series). One window at a time: :func:`window_stats`."""
    med = np.median(windows, axis=1)
    return med, 1.4826 * np.median(np.abs(windows - med[:, None]), axis=1)


def window_stats(values) -> tuple[float, float]:
    """:func:`spike_stats` of one window (a sequence of log values), in Python floats: the same
    numbers, bit for bit (``np.median`` averages the two middle values of an even count as
    ``(a + b) / 2`` too; ``tests/test_detect_rules.py`` compares them). Why: online detection
    judges one value at a time, and for one short window most of an ``np.median`` call is numpy's
    Python wrappers (docs/benchmarks.md, "Online")."""
    if not len(values):  # a rule judging from no history (scalar_min_history=0): numpy's NaN
        return math.nan, math.nan
    med = _median(sorted(values))
    return med, 1.4826 * _median(sorted([abs(v - med) for v in values]))


def _median(ordered: list) -> float:
    n = len(ordered)
    m = n // 2
    return float(ordered[m]) if n % 2 else (float(ordered[m - 1]) + float(ordered[m])) / 2


class ScalarState:
    """Per (rank, name) series state; :meth:`update` returns the events of one value."""

    def __init__(self, cfg: DetectConfig):
        self.cfg = cfg
        self.series: dict[tuple, _Series] = {}

    @property
    def names(self) -> tuple[str, ...]:
        c = self.cfg
        return (c.loss_name, c.grad_norm_name, c.lr_name)

    def update(self, step: int, rank: int, name: str, value) -> list[dict]:
        if name not in self.names:
            return []
        return self._update(self._series(rank, name), step, rank, name, value)

    def update_series(self, steps, rank: int, name: str, values) -> list[dict]:
        """:meth:`update` of each value of one series in step order, with the spike rules' window
        statistics of all its values computed at once (:func:`spike_stats` over a matrix of
        windows): the same events and the same state after. Why: offline detection feeds a run's
        whole series, and two ``np.median`` calls per value were a tenth of a fresh ``report`` of a
        10,000-step run."""
        if name not in self.names:
            return []
        s = self._series(rank, name)
        stats: list = [None] * len(values)
        if name != self.cfg.lr_name:
            stats = self._window_stats(s, values, name)
        out: list[dict] = []
        for step, value, st in zip(steps, values, stats):
            out += self._update(s, int(step), rank, name, value, st)
        return out

    def _series(self, rank: int, name: str) -> _Series:
        s = self.series.get((rank, name))
        if s is None:
            s = self.series[(rank, name)] = _Series(int(self.cfg.scalar_window))
        return s

    def _window_stats(self, s: _Series, values, name: str) -> list:
        """For each of ``values``, fed after ``s``'s current ones: the (median, raw spread) of the
        window its spike rule will judge it against, or None where it will not judge (a non-finite
        or non-positive value, or too few before it)."""
        cfg = self.cfg
        logs = [_log_if_judged(v) for v in values]
        prior = list(s.values)
        seq = np.array(prior + [lv for lv in logs if lv is not None], dtype=float)
        width, least = int(s.values.maxlen), int(cfg.scalar_min_history)
        full_from = max(width, len(prior))  # positions in seq with a whole window before them
        full = (spike_stats(np.lib.stride_tricks.sliding_window_view(seq[:-1], width)[full_from - width:])
                if len(seq) > full_from else (np.empty(0), np.empty(0)))
        out, g = [], len(prior)
        for lv in logs:
            if lv is None:
                out.append(None)
                continue
            n = min(g, width)
            if n < least:
                out.append(None)
            elif g >= full_from:
                out.append((full[0][g - full_from], full[1][g - full_from]))
            else:  # a window still filling up: its own call
                out.append(window_stats(seq[g - n:g].tolist()))
            g += 1
        return out

    def _update(self, s: _Series, step: int, rank: int, name: str, value, stats=None) -> list[dict]:
        cfg = self.cfg
        v = float("nan") if value is None else float(value)
        # a step's scalars come after its tensors (the loss and grad norm of step t are computed from
        # them, the lr of step t is applied after them): at equal steps events sort tensors first
        base = {"step": step, "rank": rank, "layer": "", "tensor": name, "order": SCALAR_ORDER}
        if name == cfg.lr_name:
            return self._lr(s, v, base)
        out: list[dict] = []
        fin = math.isfinite(v)
        was_bad, s.bad = s.bad, (not fin and value is not None)
        if s.bad and not was_bad and "loss_nonfinite" not in cfg.disabled:
            out.append(event(base, "loss_nonfinite", "critical", v, float("nan"),
                             f"{name} became non-finite ({'NaN' if v != v else _fmt(v)}) at step {step}"))
        lv = _log_if_judged(v)
        if lv is not None:
            out += self._spike(s, v, lv, name, base, stats)
        return out

    def _spike(self, s: _Series, v: float, lv: float, name: str, base: dict, stats=None) -> list[dict]:
        """``lv``: log(v); ``stats``: :meth:`_window_stats`' (median, raw spread) for this value, else
        computed here."""
        cfg = self.cfg
        is_loss = name == cfg.loss_name
        rule = "loss_spike" if is_loss else "grad_norm_spike"
        n = len(s.values)
        if n >= int(cfg.scalar_min_history) and stats is None:
            stats = window_stats(s.values)
        s.values.append(lv)
        if n < int(cfg.scalar_min_history) or rule in cfg.disabled:
            return []
        med = float(stats[0])
        spread = max(float(stats[1]), float(cfg.loss_noise_floor if is_loss else cfg.grad_noise_floor))
        z = (lv - med) / spread
        ratio = math.exp(lv - med)
        min_ratio = float(cfg.loss_spike_factor if is_loss else cfg.grad_spike_factor)
        min_z = float(cfg.loss_spike_z if is_loss else cfg.grad_spike_z)
        if s.in_spike:
            s.in_spike = z >= min_z / 2
            return []
        if z < min_z or ratio < min_ratio:
            return []
        s.in_spike = True
        what = "loss" if is_loss else "grad norm"
        msg = (f"{what} {_fmt(v)} is {_fmt(ratio)}x the median of its previous {n} steps "
               f"({_fmt(math.exp(med))}), {_fmt(z)} times their usual spread")
        return [event(base, rule, "warning", ratio, min_ratio, msg)]

    def _lr(self, s: _Series, v: float, base: dict) -> list[dict]:
        cfg = self.cfg
        prev, s.last = s.last, v
        peak = s.peak
        if math.isfinite(v) and v > peak:
            s.peak = v
        if not (math.isfinite(v) and v > 0 and prev is not None and math.isfinite(prev) and prev > 0):
            return []
        r = math.log(v / prev)
        pace = max(s.ratios, default=None)
        s.ratios.append(abs(r))
        if pace is None or len(s.ratios) <= int(cfg.lr_min_history) or "lr_change" in cfg.disabled:
            return []
        jump, factor = abs(r), float(cfg.lr_jump_factor)
        if jump < math.log(factor) or jump < float(cfg.lr_pace_factor) * pace:
            return []
        up = r > 0
        # a rise back to no more than an lr the run already trained at is a schedule's restart (cosine
        # with warm restarts: transformers' cosine_with_restarts, torch's CosineAnnealingWarmRestarts),
        # told like a drop; one past every earlier lr is the jump a wrong lr or schedule makes
        restart = up and v <= peak * (1 + 1e-6)
        msg = (f"learning rate {'rose' if up else 'fell'} {_fmt(math.exp(jump))}x in one step ({_fmt(prev)} -> "
               f"{_fmt(v)}); the schedule's largest step over the previous {len(s.ratios) - 1} was "
               f"{_fmt(math.exp(pace))}x" + (f"; back to no more than its earlier peak ({_fmt(peak)}): a "
                                             "schedule's restart, or a scheduler reset" if restart else ""))
        return [event(base, "lr_change", "warning" if up and not restart else "info", math.exp(r), factor, msg)]


def _log_if_judged(value) -> float | None:
    """log(value) where the spike rules judge the value (finite and > 0), else None."""
    v = float("nan") if value is None else float(value)
    return math.log(v) if math.isfinite(v) and v > 0 else None
