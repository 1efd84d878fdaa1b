"""Detection engine: rules over a run's statistics that say what went wrong, where and when.

* :func:`detect` - offline: ``detect(run, DetectConfig()) -> events DataFrame``.
* :class:`OnlineDetector` - the same rules inside ``Monitor`` (writer thread), step by step.
* :class:`DetectConfig` (alias ``Thresholds``) - every threshold, with calibrated defaults.

See docs/detection.md for each rule, its default and what to do about it.
"""

from fp8scope.detect.config import DetectConfig, Thresholds
from fp8scope.detect.engine import EVENT_COLUMNS, detect, events_batch
from fp8scope.detect.rules import SEVERITIES, all_rule_names

__all__ = ["DetectConfig", "Thresholds", "detect", "events_batch", "EVENT_COLUMNS", "SEVERITIES", "all_rule_names",
           "OnlineDetector"]


def __getattr__(name):
    if name == "OnlineDetector":
        from fp8scope.detect.online import OnlineDetector

        return OnlineDetector
    raise AttributeError(name)
