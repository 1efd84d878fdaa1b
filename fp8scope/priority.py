"""Readers yield the CPU to training.

A dashboard or a report reading a run on the training node competes with the trainer for CPU
(the writer thread, the data loader, the host side of every kernel launch). The reading
commands of the CLI, the dashboard server included, therefore raise their own niceness before
they start (the CLI before it imports anything): 19 by default, the lowest, so they run on spare CPU (``FP8SCOPE_NICE`` sets another
value, ``FP8SCOPE_NICE=0`` turns it off). On an idle machine this changes nothing; on a busy one
the trainer is served first. (At niceness 10, readers still slowed 8 logging writers' median
step by 26-34 % in benchmarks/reliability_load.py on a 2-core box; at 19, by 0-3 %.) A script of
your own that watches a run can call :func:`yield_to_training` for the same effect.
"""

from __future__ import annotations

import os

DEFAULT_NICE = 19


def wanted_niceness() -> int:
    """The niceness readers ask for: ``FP8SCOPE_NICE`` if it is an integer, else 19."""
    try:
        return int(os.environ.get("FP8SCOPE_NICE", DEFAULT_NICE))
    except ValueError:
        return DEFAULT_NICE


def yield_to_training(niceness: int | None = None) -> int | None:
    """Raise this process's niceness to at least ``niceness`` (never lowers it) and return the
    niceness now, or None where the platform has none. Call it before starting threads: on
    Linux a thread keeps the niceness it was created with. Never raises."""
    target = wanted_niceness() if niceness is None else int(niceness)
    try:
        now = os.nice(0)
        if target > now:
            now = os.nice(min(target, 19) - now)
        return now
    except (OSError, AttributeError):  # no nice() here, or not allowed: reading still works
        return None
