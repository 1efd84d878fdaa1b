"""Whether autograd is running a backward pass on this thread.

Activation checkpointing re-runs forwards during backward; their captures must count aside
(``StepCollector._append``), so both the collector and the what-if tap's kernel path ask this.
"""

from __future__ import annotations

import torch

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread (e.g. checkpoint recomputation).
    False inside a graph dynamo traces: a compiled forward is not a recomputation."""
    if torch.compiler.is_compiling():
        return False
    try:
        return _graph_task_id is not None and _graph_task_id() != -1
    except Exception:
        return False
