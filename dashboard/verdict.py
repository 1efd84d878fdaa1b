"""The dashboard's verdict is the report's: :func:`fp8scope.detect.analysis.analysis`, run in the
background when a run is opened, its progress shown, its result cached in the run folder.

A finished or crashed run is analysed offline once (the same events, counts and verdict as
``fp8scope report``; a second visit reads ``RUN/analysis/``). A live run whose online detector writes
an events table gets its card from those events, re-summarised as soon as a new event is written (and
every ``LIVE_REFRESH_S`` otherwise); a live run without one is re-analysed offline at most every
``LIVE_REANALYSE_S`` seconds while it grows.
"""

from __future__ import annotations

import threading
import time

import pandas as pd

from dashboard.runcache import Entry

LIVE_REANALYSE_S = 5.0
LIVE_REFRESH_S = 30.0
PHASES = 9  # detect's phases + the report's summary (for the progress bar)


class Analyser:
    """Background analysis of one open run: at most one thread at a time; the newest result kept."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.result: dict | None = None  # {"events", "report", "version", "source", "at"}
        self.error: str | None = None
        self.error_version: tuple | None = None
        self.phase = "waiting"
        self.done_phases = 0
        self.started = 0.0
        self.generation = 0  # bumps whenever the state a page shows changes (progress or result)

    def _tick(self, phase: str) -> None:
        with self.lock:
            self.phase, self.done_phases = phase, self.done_phases + 1
            self.generation += 1

    def _run(self, e: Entry, version: tuple, stored: bool, n_events: int | None = None) -> None:
        from fp8scope.detect.analysis import analyse, analysis, stored_events
        from fp8scope.detect.engine import open_run

        try:
            run = open_run(e.path)  # its own reader: the page's Run keeps refreshing meanwhile
            if stored:
                ev, rep = analyse(run, events=stored_events(run), progress=self._tick)
                source = "online detector (live run)"
            else:
                ev, rep = analysis(e.path, progress=self._tick, run=run)
                source = "offline analysis (same as fp8scope report)"
            with self.lock:
                self.result = {"events": ev, "report": rep, "version": version, "source": source, "at": time.time(),
                               "events_rows": n_events}
                self.error = None
        except Exception as exc:  # noqa: BLE001 - the card says so; the dashboard keeps working
            with self.lock:
                self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                self.error_version = version
        finally:
            with self.lock:
                self.phase, self.thread = "done", None
                self.generation += 1

    def request(self, e: Entry, live) -> None:
        """Start an analysis of the run's current version unless one is running or the newest result is
        of this version. ``live()`` says whether the run is being written; for a live run a result is
        renewed when its online detector wrote a new event (at once) or after LIVE_REFRESH_S, and without
        an events table at most every LIVE_REANALYSE_S."""
        with self.lock:
            if self.thread is not None:
                return
            r = self.result
            if r is not None and r["version"] == e.version and r.get("events_rows") is None:
                return  # an offline analysis of these rows: final (a live run's summary is renewed below)
            if self.error is not None and self.error_version == e.version:
                return  # failed on these very rows: the card shows the error until the run changes
        is_live = live() if callable(live) else bool(live)  # outside the lock: it reads the run folder
        with self.lock:
            if self.thread is not None:
                return
            stored = is_live and "events" in e.tables()
            n_events = e.run.table("events").num_rows if stored else None
            age = time.time() - self.started
            if r is not None and is_live:
                if stored and r.get("events_rows") is not None and (
                        r["version"] == e.version or (r["events_rows"] == n_events and age < LIVE_REFRESH_S)):
                    return  # no new event: the card stands (its "analysed through" step renews every 30 s)
                if not stored and age < LIVE_REANALYSE_S:
                    return
            self.started, self.phase, self.done_phases = time.time(), "reading run", 0
            self.generation += 1
            self.thread = threading.Thread(target=self._run, args=(e, e.version, stored, n_events), daemon=True,
                                           name=f"analyse {e.path.name}")
            self.thread.start()

    def state(self) -> dict:
        with self.lock:
            return {"running": self.thread is not None, "phase": self.phase, "progress": self.done_phases / PHASES,
                    "result": self.result, "error": self.error, "generation": self.generation}


def analyser(e: Entry) -> Analyser:
    with e.lock:
        if e.analyser is None:
            e.analyser = Analyser()
        return e.analyser


def is_live(e: Entry, cache=None) -> bool:
    from dashboard.runstatus import liveness

    try:
        return liveness(e.path, cache)[0] == "live"
    except Exception:  # noqa: BLE001 - an unreadable run is analysed (and fails) like a finished one
        return False


def ensure(e: Entry, cache=None) -> dict:
    """The analysis state of ``e``, starting an analysis of its current version when needed."""
    a = analyser(e)
    a.request(e, lambda: is_live(e, cache))
    return a.state()


def events(e: Entry) -> pd.DataFrame | None:
    """The events of the newest analysis (None until the first one lands): the report's events."""
    a = analyser(e)
    r = a.state()["result"]
    return None if r is None else r["events"]


def report(e: Entry) -> dict | None:
    r = analyser(e).state()["result"]
    return None if r is None else r["report"]
