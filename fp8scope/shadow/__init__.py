"""Shadow BF16 reference steps: where FP8 hurts (compare) and whether FP8 is to blame (fork).

Importing this package registers the ``shadow_compare`` and ``shadow_fork`` tables.
Docs: docs/shadow.md.
"""

from .compare import CompareResult
from .fork import FP8_INDUCED, INCONCLUSIVE, NOT_FP8, PENDING, Fork, verdict
from .precision import high_precision
from .shadow import Shadow
from .tables import COMPARE_TABLE, FORK_TABLE, SHADOW_COMPARE_SCHEMA, SHADOW_FORK_SCHEMA

__all__ = [
    "Shadow", "CompareResult", "Fork", "verdict", "high_precision",
    "FP8_INDUCED", "NOT_FP8", "INCONCLUSIVE", "PENDING",
    "COMPARE_TABLE", "FORK_TABLE", "SHADOW_COMPARE_SCHEMA", "SHADOW_FORK_SCHEMA",
]
