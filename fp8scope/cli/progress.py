"""Progress display for commands that read a large run: a rich bar on stderr, silent when not a TTY."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def phases(title: str, total: int):
    """Yields ``tick(phase_name)``; each call advances the bar by one phase."""
    if not sys.stderr.isatty():
        yield lambda phase: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn(f"{title}: " + "{task.fields[phase]}"), BarColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as p:
        task = p.add_task(title, total=total, phase="starting")
        seen: list[str] = []

        def tick(phase: str) -> None:
            if seen:
                p.advance(task)
            seen.append(phase)
            p.update(task, phase=phase)

        yield tick


@contextlib.contextmanager
def items(title: str, total: int):
    """Yields ``advance(n=1)`` for loops over many items (tensors, layers)."""
    if not sys.stderr.isatty() or total <= 0:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(title), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as p:
        task = p.add_task(title, total=total)
        yield lambda n=1: p.advance(task, n)
