"""Which cheap steps deserve a closer look: the rule the monitor asks before its next step.

A cheap step logs only amaxes and scales. When one shows a NaN/Inf or a clipped outlier, the
monitor takes full stats on the next ``full_on_anomaly`` steps (counts, underflow, quantization
error of the aftermath). The rule uses the saturation rule's lowest warning threshold (a cheap
step's rows carry no role): whatever that rule warns about gets its closer look, and a gradient
clipped less than gradients warn at (``sat_grad_warn_ratio``) gets one too, whose full rows then
say how many of its elements overflowed.
"""

from __future__ import annotations

from fp8scope.detect.config import DetectConfig


def suspicious_cheap_step(cfg: DetectConfig, amax, scale_inv, fp8_max) -> bool:
    """A cheap step worth full stats next (the monitor's ``full_on_anomaly``): a non-finite amax, or
    an amax at least the saturation rule's lowest warning ratio times the range the scale in use
    can represent (not the slight overflow of a tensor growing early in training). Arguments are
    the step's rows as numpy arrays."""
    import numpy as np

    amax = np.asarray(amax, dtype=np.float64)
    ratio = min(cfg.sat_warn_ratio, cfg.sat_grad_warn_ratio)
    return bool((~np.isfinite(amax)).any() or (amax > ratio * np.asarray(scale_inv) * np.asarray(fp8_max)).any())
