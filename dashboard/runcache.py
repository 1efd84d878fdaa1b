"""Runs open in the dashboard: one cached :class:`fp8scope.run.Run` per run folder, its DuckDB
connection and a small per-version cache of computed views.

Runs are cached per resolved path; :meth:`RunCache.refresh` calls ``Run.refresh()``, which reads only
the bytes appended since the last call (a torn tail is retried later). Every view result is cached
under the run's *version* (row counts of every table), so switching views or coming back to one is a
dictionary lookup until the run grows.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from fp8scope.run import Run

REFRESH_MIN_INTERVAL = 1.0
SMALL_TABLE_ROWS = 2_000_000  # scalars, events, shadow tables: registered with DuckDB as one chunk


@dataclass
class Entry:
    path: Path
    run: Run
    lock: threading.RLock = field(default_factory=threading.RLock)  # the cache dict, the version, refresh
    sql_lock: threading.Lock = field(default_factory=threading.Lock)  # the DuckDB connection (one user at a time)
    # held while the rollup is built or updated, and while a view reads it (an update rewrites it in place)
    rollup_lock: threading.RLock = field(default_factory=threading.RLock)
    version: tuple = ()
    last_refresh: float = 0.0
    con: object = None
    registered: tuple | None = None
    _reg: set = field(default_factory=set)
    cache: OrderedDict = field(default_factory=OrderedDict)
    rollup: object = None  # dashboard.rollup.Rollup, built on first use
    analyser: object = None  # dashboard.verdict.Analyser, started on first use
    warmed: threading.Event = field(default_factory=threading.Event)

    def tables(self) -> list[str]:
        return self.run.table_names()

    def has(self, table: str) -> bool:
        return table in self.run.table_names() and self.run.table(table).num_rows > 0

    def compute_version(self) -> tuple:
        return tuple((n, self.run.table(n).num_rows) for n in self.run.table_names())

    def sql(self, query: str, params: list | None = None) -> pd.DataFrame:
        import duckdb

        with self.sql_lock:
            if self.con is None:
                self.con = duckdb.connect()
                self.con.execute("SET threads TO 2")
            if self.registered != self.version:
                self.registered, self._reg = self.version, set()
            # register only the tables this query names (re-registering the 10M-row tensors table
            # on every live refresh costs ~0.4 s; the tensor views read the rollup instead)
            for n in self.run.table_names():
                if n not in self._reg and re.search(rf"\b{re.escape(n)}\b", query):
                    t = self.run.table(n)
                    if n != "tensors" and t.num_rows <= SMALL_TABLE_ROWS:
                        # one chunk instead of one record batch per step: DuckDB's Arrow scan takes the GIL per
                        # chunk, and 10k tiny chunks cost seconds while another thread (the rollup) holds it
                        t = t.combine_chunks()
                    self.con.register(n, t)
                    self._reg.add(n)
            return self.con.execute(query, params or []).df()

    def cached(self, key: tuple, fn, rollup: bool = False):
        """``fn()`` once per run version; computed outside the lock, so a slow view (a cold rollup, a
        DuckDB scan) never holds up another view's lookup (two requests for the same cold view may both
        compute it). ``rollup``: ``fn`` reads the rollup, under ``rollup_lock``."""
        with self.lock:
            k = (self.version, *key)
            if k in self.cache:
                self.cache.move_to_end(k)
                return self.cache[k]
        if rollup:
            with self.rollup_lock:
                val = fn()
        else:
            val = fn()
        with self.lock:
            self.cache[k] = val
            while len(self.cache) > 64:
                self.cache.popitem(last=False)
        return val


class RunCache:
    """Run objects per resolved path; refresh() reads only new bytes, at most once a second."""

    def __init__(self, max_runs: int = 8, warm=None):
        # warm(entry): run in a background thread when a run is opened (the app passes
        # dashboard.queries.warm_up: the rollup + the default views); None: nothing ahead
        self.warm = warm
        self._entries: OrderedDict[Path, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[Path, threading.Lock] = {}
        self.max_runs = max_runs

    def get(self, path: Path) -> Entry:
        path = Path(path)
        with self._lock:
            e = self._entries.get(path)
            if e is not None:
                self._entries.move_to_end(path)
                return e
            load_lock = self._loading.setdefault(path, threading.Lock())
        with load_lock:  # two requests for a cold run load it once
            with self._lock:
                e = self._entries.get(path)
            if e is None:
                run = Run(path, combine_chunks=False)  # zero-copy batches: the rollup scans them once
                e = Entry(path, run)
                e.version = e.compute_version()
                e.last_refresh = time.time()
                with self._lock:
                    self._entries[path] = e
                    while len(self._entries) > self.max_runs:
                        self._entries.popitem(last=False)
                if self.warm is not None:
                    threading.Thread(target=self.warm, args=(e,), daemon=True, name=f"warm {path.name}").start()
                else:
                    e.warmed.set()
            return e

    def preload(self, paths: list[Path]) -> None:
        """Open these runs in a background thread (one after another), so that a click from the Runs list
        finds them loaded and warming up; runs already open are skipped."""
        todo = [Path(p) for p in paths if self.peek(p) is None]
        if not todo:
            return

        def load():
            for p in todo:
                try:
                    self.get(p)
                except Exception:  # noqa: BLE001 - the run's own page reports what is wrong with it
                    continue

        threading.Thread(target=load, daemon=True, name="preload runs").start()

    def peek(self, path: Path) -> Entry | None:
        return self._entries.get(Path(path))

    def refresh(self, path: Path, force: bool = False) -> bool:
        """Read what was appended since the last refresh; True when the run changed."""
        e = self.get(path)
        with e.lock:
            if not force and time.time() - e.last_refresh < REFRESH_MIN_INTERVAL:
                return False
            e.last_refresh = time.time()
            e.run.refresh()
            v = e.compute_version()
            if v != e.version:
                e.version = v
                return True
            return False

