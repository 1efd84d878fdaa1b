"""One analysis of a run: the events every rule finds and the report built from them, cached in the
run folder.

``fp8scope report``, ``fp8scope events`` and the dashboard all call :func:`analysis`, so they show the
same events, the same counts and the same verdict. The result is kept in ``RUN/analysis/`` with a key
made of the run's data files (name, size, modification time), the detection thresholds and the
fp8scope version: a second look at a finished run is a file read, and any new byte, threshold or
release recomputes it. The cache is derived data (deleting it loses nothing); a folder that cannot be
written (read-only, full disk) only means the next look recomputes: it never fails the analysis.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict
from typing import Any, Callable

import pandas as pd

from fp8scope.detect.config import DetectConfig

REPORT_FILE = "report.json"
EVENTS_FILE = "events.parquet"


def data_key(path, cfg: DetectConfig) -> dict:
    """What the analysis of ``path`` depends on: every data file's (name, size, mtime), the thresholds,
    the fp8scope version."""
    from fp8scope import __version__
    from fp8scope.store.layout import list_parquet_tables, list_streams, manifest_path, parquet_path

    files = [manifest_path(path)] + [s.path for s in list_streams(path)]
    files += [parquet_path(path, t) for t in list_parquet_tables(path)]
    sig = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        sig.append([os.path.relpath(f, path), st.st_size, st.st_mtime_ns])
    return {"version": __version__, "config": _jsonable(asdict(cfg)), "files": sig}


def analyse(run, cfg: DetectConfig | None = None, progress: Callable[[str], None] | None = None,
            events: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
    """(events, report) of ``run``: every rule offline (unless ``events`` are given), then the report."""
    from fp8scope.detect.engine import detect
    from fp8scope.detect.report import build_report

    cfg = cfg or DetectConfig()
    ev = events if events is not None else detect(run, cfg, progress=progress)
    return ev, build_report(run, cfg, events=ev, progress=progress)


def stored_events(run) -> pd.DataFrame:
    """The events the online detector wrote during training, in step order and in detect's columns."""
    ev = run.events()
    return ev[[c for c in ev.columns if c != "segment"]].reset_index(drop=True)


def analysis(path, cfg: DetectConfig | None = None, progress: Callable[[str], None] | None = None,
             run=None) -> tuple[pd.DataFrame, dict]:
    """The cached (events, report) of the run at ``path`` when its key still matches, else a fresh
    :func:`analyse` (opening ``path`` unless ``run`` is given), saved for the next look."""
    cfg = cfg or DetectConfig()
    key = data_key(path, cfg)
    hit = load(path, key)
    if hit is not None:
        return hit
    if run is None:
        from fp8scope.detect.engine import open_run

        run = open_run(path)
    ev, rep = analyse(run, cfg, progress)
    rep = _jsonable(rep)  # what a cached look returns too: the same report either way
    save(path, key, ev, rep)
    return ev, rep


def cached_report(path, key: dict) -> dict | None:
    """The cached report of the run at ``path`` when it was made for ``key``, else None (the events
    stay unread: the Runs list needs only the report's counts)."""
    from fp8scope.store.layout import analysis_dir

    try:
        with open(analysis_dir(path) / REPORT_FILE, encoding="utf-8") as f:
            doc = json.load(f)
        return doc["report"] if doc.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load(path, key: dict) -> tuple[pd.DataFrame, dict] | None:
    rep = cached_report(path, key)
    if rep is None:
        return None
    try:
        import pyarrow.parquet as pq

        from fp8scope.detect.events import empty_events
        from fp8scope.store.layout import analysis_dir

        ev = pq.read_table(analysis_dir(path) / EVENTS_FILE).to_pandas()
        return (empty_events() if ev.empty else ev), rep
    except Exception:  # noqa: BLE001 - a damaged cache (OS or pyarrow errors) only means recomputing
        return None


def save(path, key: dict, events: pd.DataFrame, rep: dict) -> bool:
    """Write the cache atomically (events first, then the report that names the key); False if the
    folder cannot be written."""
    from fp8scope.store.layout import analysis_dir

    d = analysis_dir(path)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        d.mkdir(exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=d, suffix=".tmp", delete=False)
        tmp.close()
        pq.write_table(pa.Table.from_pandas(events, preserve_index=False), tmp.name)
        os.chmod(tmp.name, 0o644)  # readable like the run's own files (temp files are created 0600)
        os.replace(tmp.name, d / EVENTS_FILE)
        body = json.dumps({"key": key, "report": _jsonable(rep)}, allow_nan=False)
        with tempfile.NamedTemporaryFile("w", dir=d, suffix=".tmp", delete=False, encoding="utf-8") as f:
            f.write(body)
        os.chmod(f.name, 0o644)
        os.replace(f.name, d / REPORT_FILE)
        return True
    except Exception:  # noqa: BLE001 - read-only folder, full disk: the analysis itself stands
        for p in d.glob("*.tmp") if d.is_dir() else ():
            try:
                p.unlink()
            except OSError:
                pass
        return False


def _jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if hasattr(o, "item") and not isinstance(o, (str, bytes)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if o is None or isinstance(o, (str, int, float, bool)):
        return o
    return str(o)
