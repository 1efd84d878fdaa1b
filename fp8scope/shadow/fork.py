"""Fork mode: a BF16 (FP8 off) replica trained beside the FP8 run on the same batches.

Verdict (docs/shadow.md, "Verdict"): the question is whether BF16, from the same state and on the
same batches, would have done what FP8 did.

* ``baseline`` = median of the FP8 run's last ``baseline_steps`` losses *before the first anomaly*
  (the first warning or critical event the Shadow heard of, else the fork's start): the steps just
  before a fork are often broken already, since a fork starts after the event that asked for it.
* Each curve is summarised by the mean of its last ``max(1, n // 4)`` losses (``f`` for FP8, ``g``
  for BF16), or marked non-finite.
* The decision compares the curves with each other and with the baseline, in log space:
  - FP8 non-finite, BF16 finite -> ``fp8-induced``; both non-finite -> ``not-fp8``;
  - |log f - log g| within ``agree`` (5 %): BF16 follows FP8 -> ``not-fp8`` (whatever happened,
    BF16 from the same state does the same: a learning-rate jump, bad data);
  - both above ``diverge_factor`` x the baseline, whichever ends worse: ``not-fp8`` (BF16 from the
    same state diverges too);
  - FP8 above BF16 by more than ``agree`` and above ``diverge_factor`` x the baseline while BF16
    stays within it: ``fp8-induced`` (FP8 diverges while BF16 recovers);
  - FP8 above BF16 by more than ``agree``, FP8 above its baseline and BF16 below it: ``fp8-induced``
    (FP8 stays broken while BF16 trains on);
  - otherwise ``inconclusive`` (BF16 does worse than FP8 without both diverging, or FP8 is worse
    than BF16 but back at its baseline), with the numbers in the reason.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8scope.capture.adapters import make_plain

PENDING = "pending"
FP8_INDUCED = "fp8-induced"
NOT_FP8 = "not-fp8"
INCONCLUSIVE = "inconclusive"


AGREE = 0.05  # the two curves' final losses within 5 % of each other: BF16 follows FP8


def _tail_mean(losses: list[float]) -> float:
    if not losses or not all(math.isfinite(v) for v in losses):
        return math.nan
    tail = losses[-max(1, len(losses) // 4):]
    return sum(tail) / len(tail)


def verdict(fp8: list[float], bf16: list[float], baseline: float, factor: float,
            agree: float = AGREE) -> tuple[str, str]:
    """(verdict, reason) for the two loss curves of a fork against the pre-anomaly ``baseline``."""
    if not fp8 or not bf16:
        return INCONCLUSIVE, "no fork steps"
    f, g = _tail_mean(fp8), _tail_mean(bf16)
    bad8, bad16 = not math.isfinite(f), not math.isfinite(g)
    if bad8 and not bad16:
        return FP8_INDUCED, f"FP8 went non-finite; BF16 from the same state did not (final loss {g:.4g})"
    if bad8 and bad16:
        return NOT_FP8, "FP8 and BF16 both went non-finite from the same state: look at the learning rate / data"
    if bad16:
        return INCONCLUSIVE, f"only BF16 went non-finite (FP8 final loss {f:.4g})"
    base = f" (pre-anomaly baseline {baseline:.4g})" if math.isfinite(baseline) else ""
    gap = math.log(f / g) if f > 0 and g > 0 else 0.0
    if abs(gap) <= math.log1p(agree):
        return NOT_FP8, (f"BF16 follows FP8: final losses {f:.4g} (FP8) and {g:.4g} (BF16) within {100 * agree:g} %"
                         f"{base}: BF16 from the same state does the same, so FP8 is not the cause")
    diverged = factor * baseline if math.isfinite(baseline) else math.inf  # a loss above it diverged
    if f > diverged and g > diverged:  # whichever ends worse
        return NOT_FP8, (f"BF16 from the same state diverges too ({g:.4g}, {g / baseline:.3g}x the baseline "
                         f"{baseline:.4g}; FP8 {f:.4g}): look at the learning rate / data")
    if gap > 0 and f > diverged:
        return FP8_INDUCED, (f"FP8 stays at {f:.4g}, {f / baseline:.3g}x its baseline {baseline:.4g}, while BF16 "
                             f"from the same state reaches {g:.4g}")
    if gap > 0 and math.isfinite(baseline) and f > baseline > g:
        return FP8_INDUCED, (f"FP8 stays above its baseline ({f:.4g} vs {baseline:.4g}) while BF16 from the same state "
                             f"trains on below it ({g:.4g}): FP8 ends {100 * (f / g - 1):.3g} % worse")
    if gap > 0:
        return INCONCLUSIVE, (f"FP8 ends {100 * (f / g - 1):.3g} % above BF16 ({f:.4g} vs {g:.4g}) but within "
                              f"{factor:g}x its baseline{base}")
    return INCONCLUSIVE, f"BF16 ends worse than FP8 ({g:.4g} vs {f:.4g}){base}"


def baseline_of(history: list[float], first: float) -> float:
    finite = [v for v in history if math.isfinite(v)]
    return statistics.median(finite) if finite else first


def _is_ours(fn) -> bool:
    mod = getattr(getattr(fn, "__func__", fn), "__module__", "") or ""
    return mod.startswith(("fp8scope.capture", "fp8scope.shadow"))


def make_replica(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """Deep copies of model and optimizer (one deepcopy, so the optimizer's state maps to the
    replica's parameters), with FP8 off, the monitor's and shadow's hooks removed, and no grads.

    The real ``.grad`` tensors are set aside during the copy (not copied, not changed).
    """
    saved = [(p, p.grad) for p in model.parameters()]
    for p, _ in saved:
        p.grad = None
    try:
        replica, opt = copy.deepcopy((model, optimizer))
    finally:
        for p, g in saved:
            p.grad = g
    for m in replica.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                      getattr(m, "_backward_pre_hooks", {})):
            for key in [k for k, fn in hooks.items() if _is_ours(fn)]:
                del hooks[key]
        if hasattr(m, "fp8scope_tap"):
            m.fp8scope_tap = None
            m.fp8scope_monitor = None
            m.fp8scope_monitor_taps = None
    make_plain(replica)  # each adapter switches its layers off for good
    return replica, opt


def replica_bytes(replica: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    """Bytes held by the replica: parameters, buffers and optimizer state tensors."""
    seen: set[int] = set()
    n = 0

    def add(t):
        nonlocal n
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            n += t.nelement() * t.element_size()

    for t in list(replica.parameters()) + list(replica.buffers()):
        add(t)
    if opt is not None:
        for st in opt.state.values():
            for v in st.values():
                add(v)
    return n


@dataclass
class Fork:
    fork_id: int
    start_step: int
    steps: int
    trigger: str
    baseline_history: list[float]
    replica: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    bytes: int = 0
    step_ids: list[int] = field(default_factory=list)
    loss_fp8: list[float] = field(default_factory=list)
    loss_bf16: list[float] = field(default_factory=list)
    baseline: float = math.nan
    verdict: str = PENDING
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.verdict != PENDING

    def release(self) -> None:
        self.replica = None
        self.optimizer = None
