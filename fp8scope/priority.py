"""Readers may yield the CPU to training, when asked to.

A dashboard or a report reading a run on the training node competes with the trainer for CPU
(the writer thread, the data loader, the host side of every kernel launch). Lowering a reader's
priority protects the trainer, but it is the user's call: a niced ``fp8scope report`` on a busy
login node waits for the CPU most of its wall time, and a process cannot raise its priority back.
So it is opt-in: ``FP8SCOPE_NICE=N`` in the environment, or ``--nice`` (19) / ``--nice=N`` on the
command line, makes the reading commands of the CLI (the dashboard server included) raise their
own niceness to N before they start, the CLI before it imports anything. A script of your own
that watches a run can call :func:`yield_to_training` for the same effect. Without either,
readers run at the priority they were started with; benchmarks/reliability_load.py measures
what they then cost a training job (docs/reliability.md).
"""

from __future__ import annotations

import os

NICE_FLAG_DEFAULT = 19  # what a bare --nice, or yield_to_training(), asks for: the lowest priority


def _env_niceness() -> int | None:
    try:
        return int(os.environ["FP8SCOPE_NICE"])
    except (KeyError, ValueError):
        return None


def wanted_niceness(flag: int | None = None) -> int:
    """The niceness a reading command asks for: ``--nice`` (``flag``), else ``FP8SCOPE_NICE``,
    else 0 (no change)."""
    if flag is not None:
        return flag
    env = _env_niceness()
    return 0 if env is None else env


def yield_to_training(niceness: int | None = None) -> int | None:
    """Raise this process's niceness to at least ``niceness`` (default: ``FP8SCOPE_NICE``, else
    19; it never lowers it) and return the niceness now, or None where the platform has none.
    Call it before starting threads: on Linux a thread keeps the niceness it was created with.
    Never raises."""
    if niceness is None:
        env = _env_niceness()
        niceness = NICE_FLAG_DEFAULT if env is None else env
    try:
        now = os.nice(0)
        if niceness > now:
            now = os.nice(min(int(niceness), 19) - now)
        return now
    except (OSError, AttributeError):  # no nice() here, or not allowed: reading still works
        return None
