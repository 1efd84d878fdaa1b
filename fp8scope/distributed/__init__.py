"""Multi-rank runs: cross-rank aggregation of the stats and the cross-rank scale check.

Every rank always writes its own streams into the shared run folder (``streams/*-r{rank}-*``);
rank 0 alone writes ``run.json``. On top of that, ``Monitor(reduce=...)`` picks what is logged:

- ``"none"`` (default): per-rank rows only; nothing is exchanged between ranks.
- ``"aggregate"``: one series for the whole job, rows with ``rank = -1`` (``AGGREGATE_RANK``),
  written by rank 0; the other ranks write no tensor/scalar rows.
- ``"both"``: per-rank rows and the ``rank = -1`` series.

The exchange is one ``all_gather`` of a small float64 tensor per logged step, done in the
monitor's writer thread over a dedicated gloo group on host memory, so the training thread
never joins a collective and the GPU is never synchronised (``distributed.writer``).
The gathered scales feed the online ``cross_rank_scale_mismatch`` check
(``distributed.consistency``), which also runs offline over per-rank data.
"""

from fp8scope.distributed.aggregate import AGGREGATE_RANK, REDUCE_MODES
from fp8scope.distributed.consistency import (
    RULE_NAME,
    CrossRankCheck,
    cross_rank_scale_mismatch,
    scale_mismatch_events,
)

__all__ = [
    "AGGREGATE_RANK",
    "REDUCE_MODES",
    "RULE_NAME",
    "CrossRankCheck",
    "cross_rank_scale_mismatch",
    "scale_mismatch_events",
]
