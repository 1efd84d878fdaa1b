"""Which cheap steps deserve a closer look: the rule the monitor asks before its next step.

A cheap step logs only amaxes and scales. When one shows a NaN/Inf or a clipped outlier, the
monitor takes full stats on the next ``full_on_anomaly`` steps (counts, underflow, quantization
error of the aftermath): of every layer after a non-finite amax (a NaN spreads, and its first layer
is what is looked for), of the clipped tensors' layers after a clip. A MoE's experts clip one or
another on most steps early in training (an expert's tokens change every step, and its delayed scale
lags them): full stats of all its tens of thousands of tensors for each would be most steps'.

The rule uses the saturation rule's lowest warning threshold (a cheap step's rows carry no role):
whatever that rule warns about gets its closer look, and a gradient clipped less than gradients
warn at (``sat_grad_warn_ratio``) gets one too, whose full rows then say how many of its elements
overflowed.
"""

from __future__ import annotations

from fp8scope.detect.config import DetectConfig


def suspicious_rows(cfg: DetectConfig, amax, scale_inv, fp8_max):
    """The rows of a cheap step worth full stats next (the monitor's ``full_on_anomaly``), as a
    boolean array: a non-finite amax, or an amax at least the saturation rule's lowest warning ratio
    times the range the scale in use can represent (not the slight overflow of a tensor growing early
    in training). Arguments are the step's rows as numpy arrays."""
    import numpy as np

    amax = np.asarray(amax, dtype=np.float64)
    ratio = min(cfg.sat_warn_ratio, cfg.sat_grad_warn_ratio)
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(amax) | (amax > ratio * np.asarray(scale_inv) * np.asarray(fp8_max))


def closer_look(cfg: DetectConfig, amax, scale_inv, fp8_max):
    """Where a cheap step deserves a closer look: None (nowhere), else ``(rows, every_layer)``, the
    :func:`suspicious_rows` mask and whether every layer deserves it (a non-finite amax: a NaN
    spreads, and where it first appeared is the question) rather than the flagged rows' layers."""
    import numpy as np

    rows = suspicious_rows(cfg, amax, scale_inv, fp8_max)
    if not rows.any():
        return None
    return rows, not np.isfinite(np.asarray(amax, dtype=np.float64)[rows]).all()


def suspicious_cheap_step(cfg: DetectConfig, amax, scale_inv, fp8_max) -> bool:
    """Whether any row of a cheap step is suspicious (:func:`suspicious_rows`)."""
    return bool(suspicious_rows(cfg, amax, scale_inv, fp8_max).any())
