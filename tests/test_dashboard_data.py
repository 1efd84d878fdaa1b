"""The dashboard's data layer on real runs: one table of derived statistics (SQL and numpy agree), the
report's analysis cached in the run folder, the culprit / blame the card shows, the layer_outlier
ranking, step ranges that re-bucket down to single steps, Compare's divergence step, a corrupt
stream listed as an error, and the events panel of a run whose events are all ``info``. Real training runs of the demo model and real stream files."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dashboard import outliers as O
from dashboard import queries as Q
from dashboard.runcache import RunCache
from dashboard.runstatus import run_status
from dashboard.ui import plot_label
from fp8scope.derived import DERIVED
from fp8scope.detect import DetectConfig
from fp8scope.detect.analysis import EVENTS_FILE, REPORT_FILE, analysis, data_key, load
from fp8scope.run import load_run
from fp8scope.store.layout import analysis_dir, list_streams

SMALL = dict(n_layers=4, d_model=32, n_heads=2, batch_size=4, seq_len=16, every=5, quiet=True, corpus_chars=20000)


def _train(path: Path, inject=(), steps=70) -> Path:
    from fp8scope.demo import train as T

    torch.set_num_threads(1)
    a = T.default_args(steps=steps, inject=list(inject), **SMALL)
    s = T.build(a)
    shutil.rmtree(path, ignore_errors=True)
    with T.open_monitor(s, path) as mon:
        T.train_steps(s, steps, monitor=mon)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dashdata")
    return {"outlier": _train(base / "outlier", ["outlier:blocks.2.mlp.down:55:1000:2"]),
            "lr": _train(base / "lr", ["lr:55:30"])}


def test_derived_statistics_mean_the_same_in_sql_and_numpy(runs):
    r = load_run(runs["outlier"])
    t = r.table("tensors")
    cols = {n: t[n].to_numpy(zero_copy_only=False).astype(np.float64) for n in t.column_names
            if n in {c for d in DERIVED.values() for c in d.columns}}
    sql = r.sql("select " + ", ".join(f"cast({d.sql} as double) as {k}" for k, d in DERIVED.items()) + " from tensors")
    for k, d in DERIVED.items():
        a = np.asarray(d.fn(lambda n: cols[n]), dtype=np.float64)
        b = sql[k].to_numpy(dtype=np.float64, copy=True)
        a[~np.isfinite(a)] = np.nan
        b[~np.isfinite(b)] = np.nan
        assert np.allclose(a, b, equal_nan=True, rtol=1e-9), k
    # underflow is a share of the non-zero values, as detection reads it
    full = sql["underflow_pct"].notna()
    assert full.any()


def test_analysis_is_cached_in_the_run_folder_and_keyed(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["outlier"], run, ignore=shutil.ignore_patterns("analysis"))
    ev, rep = analysis(run)
    d = analysis_dir(run)
    assert (d / REPORT_FILE).is_file() and (d / EVENTS_FILE).is_file()
    hit = load(run, data_key(run, DetectConfig()))
    assert hit is not None and hit[1] == rep and len(hit[0]) == len(ev)
    assert load(run, data_key(run, DetectConfig(spike_factor=99.0))) is None  # other thresholds: recompute
    # the run grows: its key changes
    s = list_streams(run)[0].path
    with open(s, "ab") as f:
        f.write(b"\0")
    assert load(run, data_key(run, DetectConfig())) is None
    # a folder where the cache cannot be written: the analysis still stands
    shutil.rmtree(d)
    d.write_text("not a folder")
    ev2, rep2 = analysis(run)
    assert rep2["culprit"] == rep["culprit"]
    # the cache is not the run being written: a finished run is not made "live" by it
    run2 = tmp_path / "run2"
    shutil.copytree(runs["outlier"], run2, ignore=shutil.ignore_patterns("analysis"))
    import os
    import time

    old = time.time() - 3600
    for p in run2.rglob("*"):
        os.utime(p, (old, old))
    analysis(run2)
    st = run_status(run2)
    assert st["last_write"] < time.time() - 3000 and st["events_source"] == "analysis"


def test_card_culprit_and_blame(runs):
    _, rep = analysis(runs["outlier"])
    assert rep["culprit"]["layer"] == "blocks.2.mlp.down" and rep["culprit"]["tensor"] == "activation"
    assert rep["culprit"]["step"] == 55
    # a 2-step outlier that FP8 clipped, and the loss of the 13 steps after it did not move
    assert rep["blame"]["level"] == "symptoms", rep["blame"]
    assert rep["blame"]["why"].startswith("an FP8 symptom came first (saturation in blocks.2.mlp.down activation at "
                                          "step 55, critical), and the loss ")
    _, rep = analysis(runs["lr"])
    assert rep["culprit"] is None  # the optimizer side moved first: no tensor to blame
    assert rep["blame"]["level"] == "unlikely" and "lr_change at step 55" in rep["blame"]["why"]


def test_outliers_rank_the_planted_layer_first(runs):
    e = RunCache().get(runs["outlier"])
    df = O.outliers(e)
    assert (df["layer"].iloc[0], df["tensor"].iloc[0]) == ("blocks.2.mlp.down", "activation"), df.head().to_string()
    assert int(df["step"].iloc[0]) == 55
    # a role filter ranks that role alone
    g = O.outliers(e, "gradient")
    assert set(g["tensor"]) == {"gradient"}


def test_step_range_rebuckets_down_to_single_steps(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from dashboard_speed import make_big_run

    run = tmp_path / "big"
    make_big_run(run, 2600, 8)  # an amax spike at steps 500, 1500, 2500 in one layer
    e = RunCache().get(run)
    full = Q.heatmap_frame(e, "log2_amax", "activation")
    g = int(np.diff(np.sort(full["step"].unique()))[0])
    assert g > 1  # the whole run: buckets of several steps
    fr = Q.heatmap_frame(e, "log2_amax", "activation", span=Q.clip_span(e, (1490, 1510)))
    steps = np.sort(fr["step"].unique())
    assert steps[0] == 1490 and steps[-1] == 1510 and len(steps) == 21  # one column per step
    top = fr.loc[fr["value"].idxmax()]
    assert int(top["step"]) == 1500
    layer = top["layer"]
    s = Q.tensor_series(e, layer, "activation", span=Q.clip_span(e, (1495, 1505)))
    assert list(s["step"]) == list(range(1495, 1506))
    assert s.loc[s["amax"].idxmax(), "step"] == 1500
    mid = Q.heatmap_frame(e, "log2_amax", "activation", span=Q.clip_span(e, (1000, 1999)))
    assert mid["step"].min() >= 999 and mid["step"].max() <= 1999
    with pytest.raises(Exception, match="no steps in the range"):
        Q.clip_span(e, (5000, 6000))


def test_first_divergence():
    a = pd.DataFrame({"step": range(10), "value": [3.0] * 10})
    b = a.assign(value=[3.0] * 4 + [3.01, 3.3, 3.4, 3.5, 3.6, 3.7])
    assert Q.first_divergence(a, b) == 5
    assert Q.first_divergence(a, a) is None
    c = a.assign(value=[3.0] * 6 + [float("nan")] * 4)
    assert Q.first_divergence(a, c) == 6


def test_corrupt_stream_is_listed_as_error(runs, tmp_path):
    run = tmp_path / "corrupt"
    shutil.copytree(runs["outlier"], run)
    s = list_streams(run)[0].path
    data = bytearray(s.read_bytes())
    data[:4] = b"PK\x03\x04"
    s.write_bytes(bytes(data))
    st = run_status(run)
    assert st["status"] == "error" and "not an Arrow IPC stream" in st["error"] and "\n" not in st["error"]


def test_plot_labels_show_names_literally():
    assert plot_label("a&amp;b") == "a&amp;amp;b"  # plotly turns &amp; back into &: the name shows as written
    assert "<" not in plot_label("<img src=x>")


def test_events_panel_of_a_run_with_only_info_events(tmp_path):
    """A clean run's events are often all ``info`` (dynamic range, say): hidden by default, they leave
    nothing to list, and the panel must say so instead of failing on the empty selection."""
    import pyarrow as pa

    from dashboard.app import DashboardApp, parse
    from fp8scope.schema import TENSOR_SCHEMA
    from fp8scope.store.manifest import new_manifest, write_manifest
    from fp8scope.store.writer import RunWriter

    run = tmp_path / "runs" / "clean"
    coverage = {"params": {"monitored": 3000, "unmonitored": 1000}, "order": ["proj", "fc"],
                "unmonitored": [{"module": "proj", "class": "Projector", "kind": "matrix", "params": 1000}]}
    write_manifest(run, new_manifest(meta={"model": "clean", "coverage": coverage}))
    with RunWriter(run) as w:
        for step in range(12):
            cols = {f.name: pa.nulls(1, f.type) for f in TENSOR_SCHEMA}
            cols.update(step=pa.array([step], pa.int64()), rank=pa.array([0], pa.int32()), layer=pa.array(["fc"]),
                        tensor=pa.array(["activation"]), order=pa.array([0], pa.int32()), amax=pa.array([1.0]),
                        min_nonzero=pa.array([1e-7]),  # 23 binades: dynamic_range (info), nothing worse
                        scale=pa.array([448.0]), scale_inv=pa.array([1 / 448]), fp8_max=pa.array([448.0]),
                        expected_amax=pa.array([1.0]), fp8_format=pa.array(["e4m3"]), source=pa.array(["emulated"]),
                        numel=pa.array([100], pa.int64()), overflow=pa.array([0], pa.int64()),
                        underflow=pa.array([0], pa.int64()), saturated=pa.array([0], pa.int64()))
            w.write("tensors", pa.record_batch([cols[f.name] for f in TENSOR_SCHEMA], schema=TENSOR_SCHEMA))
    from dashboard import verdict

    app = DashboardApp(tmp_path / "runs")
    e = app.cache.get(run)
    verdict.ensure(e, app.cache)
    thread = verdict.analyser(e).thread
    if thread is not None:
        thread.join(60)
    assert verdict.events(e) is not None and set(verdict.events(e)["severity"]) == {"info"}
    for query in ("?run=clean&view=overview", "?run=clean&view=overview&info=1"):
        page = str(app.render(parse(query)))
        assert "error-card" not in page, page[page.find("error-card") - 300:page.find("error-card") + 300]
    assert "dynamic_range" in page  # listed once info is asked for
    # the card says what the monitor did not see, and the verdict is clean only in what it saw
    assert "card-coverage" in page and "not monitored: 1 other weight matrix (proj, 25 % of the GEMM weights)" in page
    assert "no warning or critical events in the monitored layers" in page
