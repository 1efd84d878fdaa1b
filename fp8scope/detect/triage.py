"""Which cheap steps deserve a closer look: the rule the monitor asks before its next step.

A cheap step logs only amaxes and scales. When one shows a NaN/Inf or a clipped outlier, the
monitor takes full stats on the next ``full_on_anomaly`` steps (counts, underflow, quantization
error of the aftermath). The rule uses the saturation rule's own warning threshold, so the two
never disagree on what "clipped" means.
"""

from __future__ import annotations

from fp8scope.detect.config import DetectConfig


def suspicious_cheap_step(cfg: DetectConfig, amax, scale_inv, fp8_max) -> bool:
    """A cheap step worth full stats next (the monitor's ``full_on_anomaly``): a non-finite amax, or
    an amax at least ``sat_warn_ratio`` times the range the scale in use can represent (what the
    saturation rule calls a warning; not the slight overflow of a tensor growing early in
    training). Arguments are the step's rows as numpy arrays."""
    import numpy as np

    amax = np.asarray(amax, dtype=np.float64)
    return bool((~np.isfinite(amax)).any()
                or (amax > cfg.sat_warn_ratio * np.asarray(scale_inv) * np.asarray(fp8_max)).any())
