"""Fork mode: a BF16 (FP8 off) replica trained beside the FP8 run on the same batches.

Divergence (documented in docs/shadow.md, "Verdict"):

* ``baseline`` = median of the FP8 run's last ``baseline_steps`` losses before the fork
  step (the median ignores the spike that may have triggered the fork); without any
  history, the first loss of the fork.
* a curve (the FP8 losses or the BF16 losses over the fork's steps) *diverged* if any
  of its losses is non-finite, or if the mean of its last ``max(1, n // 4)`` losses is
  above ``diverge_factor x baseline`` (default 1.5).
* verdict: FP8 diverged and BF16 did not -> ``fp8-induced``; both diverged ->
  ``not-fp8`` (look at the learning rate and the data); otherwise ``inconclusive``
  (neither diverged, or only the BF16 replica did).
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from .precision import _te_module_classes, _torchao_float8_linear_cls, set_torchao_high_precision

PENDING = "pending"
FP8_INDUCED = "fp8-induced"
NOT_FP8 = "not-fp8"
INCONCLUSIVE = "inconclusive"


def diverged(losses: list[float], baseline: float, factor: float) -> tuple[bool, str]:
    if not losses:
        return False, "no steps"
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            return True, f"non-finite loss at fork step {i}"
    tail = losses[-max(1, len(losses) // 4):]
    mean = sum(tail) / len(tail)
    if math.isfinite(baseline) and mean > factor * baseline:
        return True, f"final loss {mean:.4g} > {factor:g} x baseline {baseline:.4g}"
    return False, f"final loss {mean:.4g} <= {factor:g} x baseline {baseline:.4g}"


def verdict(fp8: list[float], bf16: list[float], baseline: float, factor: float) -> tuple[str, str]:
    """(verdict, reason) for the two loss curves of a fork."""
    d8, r8 = diverged(fp8, baseline, factor)
    d16, r16 = diverged(bf16, baseline, factor)
    if d8 and not d16:
        return FP8_INDUCED, f"FP8 diverged ({r8}); BF16 did not ({r16})"
    if d8 and d16:
        return NOT_FP8, f"both diverged (FP8: {r8}; BF16: {r16}): look at the learning rate / data"
    if d16:
        return INCONCLUSIVE, f"only BF16 diverged ({r16})"
    return INCONCLUSIVE, f"neither diverged (FP8: {r8}; BF16: {r16})"


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
    ao = _torchao_float8_linear_cls()
    for m in replica.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                      getattr(m, "_backward_pre_hooks", {})):
            for key in [k for k, fn in hooks.items() if _is_ours(fn)]:
                del hooks[key]
        if hasattr(m, "fp8scope_tap"):
            m.fp8scope_tap = None
            m.fp8scope_monitor = None
            m.fp8scope_monitor_taps = None
        if hasattr(m, "fp8_enabled"):
            m.fp8_enabled = False
        if ao is not None and isinstance(m, ao):
            set_torchao_high_precision(m)
    te_classes = _te_module_classes()
    uses_te = bool(te_classes) and any(isinstance(m, te_classes) for m in replica.modules())
    return replica, opt, uses_te


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


def te_off_context():
    te = sys.modules.get("transformer_engine.pytorch")
    autocast = getattr(te, "fp8_autocast", None) or getattr(te, "autocast")
    return autocast(enabled=False)


@dataclass
class Fork:
    fork_id: int
    start_step: int
    steps: int
    trigger: str
    baseline_history: list[float]
    replica: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    uses_te: bool = False
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
