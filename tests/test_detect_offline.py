"""Offline detection read in slices of whole steps equals one pass over the run, and the readers'
fast paths (one segment, repeated step chunks) give what the general paths give.

Runs are written through the real write path (``step_records.tensor_batch`` + ``store.writer.RunWriter``)
with planted anomalies, two ranks, gaps and a restarted segment, so every window, edge and group rule
has something to carry across slice boundaries.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import fp8scope.detect.engine as engine
from fp8scope.step_payload import TensorKey
from fp8scope.detect import DetectConfig, detect
from fp8scope.detect.features import WindowCarry, _sliding_max, window_features_numpy
from fp8scope.run import Run, _distinct_rows
from fp8scope.schema import FIELD_INDEX, N_FIELDS
from fp8scope.step_records import scalar_batch, tensor_batch
from fp8scope.store.merge import dedup_latest_segment
from fp8scope.store.writer import RunWriter

ROLES = ("activation", "weight", "gradient")
KEYS = [TensorKey(f"blocks.{i}.mlp.up", role, "emulated", "e5m2" if role == "gradient" else "e4m3",
                  57344.0 if role == "gradient" else 448.0, (64, 64)) for i in range(4) for role in ROLES]
ONE_PASS = 1 << 40  # CHUNK_ROWS larger than any run: one slice


def _stats(step: int, rank: int, rng) -> tuple[np.ndarray, list[int]]:
    """One step's stats matrix with planted anomalies, and the tensors it logs (tensor 5 every other step)."""
    n = len(KEYS)
    fp8_max = np.array([k.fp8_max for k in KEYS])
    amax = np.exp(rng.normal(0, 0.1, n)) * (1 + 0.1 * rank)
    expected = amax * np.exp(rng.normal(0, 0.3, n))
    scale_inv = expected / fp8_max
    if step == 150:
        amax[4] *= 1000.0  # amax spike, saturation, layer outlier; stale scale after
    if 150 < step < 160:
        expected[4] = amax[4] * 1000.0
    if 200 <= step < 204 and rank == 0:
        amax[7:] = np.inf  # NaN/Inf origin at tensor 7, propagated to the later ones (NaN would be stored as null)
    if 200 <= step <= 204 and rank == 0:
        scale_inv[7:] = 0.01  # the recipe keeps the scale of a NaN amax
    if 60 <= step < 130:
        scale_inv[10] *= 1.15 ** (step - 60)  # gradual scale collapse
    m = np.full((n, N_FIELDS), np.nan)
    m[:, FIELD_INDEX["amax"]] = amax
    m[:, FIELD_INDEX["scale"]] = 1.0 / scale_inv
    m[:, FIELD_INDEX["scale_inv"]] = scale_inv
    m[:, FIELD_INDEX["expected_amax"]] = expected
    m[:, FIELD_INDEX["numel"]] = 4096
    if step % 5 == 0:  # full stats
        m[:, FIELD_INDEX["min_nonzero"]] = amax * 2.0 ** -20
        m[:, FIELD_INDEX["zeros"]] = 0
        m[:, FIELD_INDEX["nonfinite"]] = np.where(np.isfinite(amax), 0.0, 7.0)
        m[:, FIELD_INDEX["overflow"]] = np.where(amax > expected, 40.0, 0.0)
        m[:, FIELD_INDEX["underflow"]] = 2.0 if not 170 <= step < 190 else 3000.0
    logged = [i for i in range(n) if i != 5 or step % 2 == 0]
    return m[logged], logged


def write_run(path, steps: int = 240, ranks=(0, 1), restart_at: int | None = 220) -> None:
    """A run of ``steps`` steps per rank; rank 0 restarts at ``restart_at`` (a second segment replaying
    the 10 steps before it, which the reader's dedup must drop from the first)."""
    rng = np.random.default_rng(0)
    for rank in ranks:
        segments = [(0, steps)] if restart_at is None or rank else [(0, restart_at), (restart_at - 10, steps)]
        for lo, hi in segments:
            with RunWriter(path, rank) as w:
                for step in range(lo, hi):
                    m, logged = _stats(step, rank, rng)
                    w.write("tensors", tensor_batch(step, rank, m, logged, KEYS, step % 5 == 0))
                    loss = 2.0 * (5.0 if step == 180 else 1.0) + rng.normal(0, 0.01)
                    w.write("scalars", scalar_batch(step, rank, ["loss", "grad_norm"], [loss, 1.0], time.time()))
    from fp8scope.store.manifest import new_manifest, write_manifest

    write_manifest(path, new_manifest(recipe={"kind": "delayed"}, world_size=len(ranks)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sliced") / "run"
    write_run(path)
    return path


def _events(path, chunk_rows: int, monkeypatch):
    monkeypatch.setattr(engine, "CHUNK_ROWS", chunk_rows)
    return detect(engine.open_run(path), DetectConfig())


@pytest.mark.parametrize("chunk_rows", [1, 25, 300])
def test_sliced_detection_equals_one_pass(run_dir, chunk_rows, monkeypatch):
    one = _events(run_dir, ONE_PASS, monkeypatch)
    fired = set(one["rule"])
    assert {"amax_spike", "saturation", "stale_scale", "nan_origin", "nonfinite", "scale_kept", "scale_collapse",
            "underflow", "layer_outlier", "loss_spike"} <= fired, fired
    sliced = _events(run_dir, chunk_rows, monkeypatch)
    pd_equal(sliced, one)


def pd_equal(a, b) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


def test_slices_cut_between_steps_of_a_rank(run_dir, monkeypatch):
    monkeypatch.setattr(engine, "CHUNK_ROWS", 25)
    t = engine.open_run(run_dir).table("tensors")
    bounds, ordered = engine._step_slices(t)
    assert ordered and bounds[0][0] == 0 and bounds[-1][1] == t.num_rows
    step, rank = t["step"].to_numpy(), t["rank"].to_numpy()
    for a, b in bounds:
        assert b - a >= 25 or b == t.num_rows
        if a:
            assert (rank[a], step[a]) != (rank[a - 1], step[a - 1]), "a slice boundary splits one step"


def test_rows_out_of_step_order_fall_back_to_one_slice(tmp_path, monkeypatch):
    """Aggregated rank -1 rows interleaved with rank 0's in one stream: not (rank, step) sorted."""
    rng = np.random.default_rng(1)
    rows = 0
    with RunWriter(tmp_path, 0) as w:
        for step in range(220):
            m, logged = _stats(step, 0, rng)
            w.write("tensors", tensor_batch(step, 0, m, logged, KEYS, step % 5 == 0))
            w.write("tensors", tensor_batch(step, -1, m, logged, KEYS, step % 5 == 0))
            rows += 2 * len(logged)
    from fp8scope.store.manifest import new_manifest, write_manifest

    write_manifest(tmp_path, new_manifest(recipe={"kind": "delayed"}, world_size=1))
    assert engine._step_slices(engine.open_run(tmp_path).table("tensors")) == ([(0, rows)], False)
    one = _events(tmp_path, ONE_PASS, monkeypatch)
    assert {"amax_spike", "nan_origin"} <= set(one["rule"])
    pd_equal(_events(tmp_path, 10, monkeypatch), one)


def _window_reference(rows: dict, cfg: DetectConfig) -> dict:
    """The window features of one tensor's rows, from their definitions (docs/detection.md), row by row."""
    W, K, R = cfg.spike_window, cfg.collapse_window, cfg.sat_rate_window
    a, si = rows["amax_f"], rows["scale_inv_f"]

    def fmax(v):
        v = [x for x in v if x == x]
        return max(v) if v else float("nan")

    T, dev = cfg.trend_window, rows["dev"]
    out: dict = {k: [] for k in ("prev_max", "n_prev", "prev_bad_amax", "prev_scale_inv", "si_old", "si_max", "n_si",
                                 "max_jump", "n_sat", "n_rate", "dev_old", "dev_jump")}
    for j in range(len(a)):
        out["prev_max"].append(fmax(a[max(0, j - W):j]))
        out["n_prev"].append(int(np.sum(~np.isnan(a[max(0, j - W):j]))))
        out["prev_bad_amax"].append(bool(rows["bad_amax"][j - 1]) if j else False)
        out["prev_scale_inv"].append(si[j - 1] if j else float("nan"))
        out["si_old"].append(si[j - min(j, K)])
        out["si_max"].append(fmax(si[max(0, j - K):j + 1]))
        out["n_si"].append(int(np.sum(~np.isnan(si[max(0, j - K):j + 1]))))
        out["max_jump"].append(fmax([si[i] / si[i - 1] for i in range(max(1, j - K + 1), j + 1)]))
        out["n_sat"].append(int(np.sum(rows["sat_hit"][max(0, j - R + 1):j + 1] != 0)))
        out["n_rate"].append(min(j + 1, R))
        out["dev_old"].append(dev[j - T] if j >= T else float("nan"))
        out["dev_jump"].append(fmax([dev[i] - dev[i - 1] for i in range(max(1, j - T + 1), j + 1)]))
    return out


def _window_inputs(counts, rng) -> tuple[np.ndarray, dict]:
    key = np.repeat(np.arange(len(counts)) * 3, counts)
    n = len(key)
    amax, si = rng.lognormal(size=n), rng.lognormal(size=n)
    amax[rng.random(n) < 0.1] = np.nan
    si[rng.random(n) < 0.1] = np.nan
    dev = rng.normal(size=n)
    dev[rng.random(n) < 0.1] = np.nan
    return key, {"amax_f": amax, "scale_inv_f": si, "sat_hit": (rng.random(n) < 0.3).astype(np.int64),
                 "bad_amax": rng.random(n) < 0.1, "dev": dev}


CFG_SMALL = DetectConfig(spike_window=7, collapse_window=4, sat_rate_window=5, trend_window=6)


@pytest.mark.parametrize("counts", [[30, 30, 30], [1, 40, 3, 0, 12], [9]], ids=["same-rows", "ragged", "one"])
def test_window_features_match_their_definitions(counts):
    rng = np.random.default_rng(len(counts))
    counts = [c for c in counts if c]
    key, cols = _window_inputs(counts, rng)
    got = window_features_numpy(key, cols, CFG_SMALL)
    start = 0
    for c in counts:
        ref = _window_reference({k: v[start:start + c] for k, v in cols.items()}, CFG_SMALL)
        for name, want in ref.items():
            assert np.array_equal(got[name][start:start + c], np.array(want, dtype=got[name].dtype), equal_nan=True), name
        start += c


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("size", [1, 2, 3, 9])
def test_window_carry_over_slices_equals_one_pass(ragged, size):
    """Rows fed slice by slice (each tensor's rows in step order, tensors appearing late or skipping slices);
    slices of one or a few steps (the online detector) take each window where it lies, bigger ones the
    padded layout: the same features either way."""
    rng = np.random.default_rng(7)
    steps, tensors = 60, 5
    logged = rng.random((steps, tensors)) < 0.7 if ragged else np.ones((steps, tensors), bool)
    step, key = np.nonzero(logged)  # step-major rows
    _, cols = _window_inputs([len(key)], rng)
    order = np.lexsort((step, key))
    one = window_features_numpy(key[order], {k: v[order] for k, v in cols.items()}, CFG_SMALL)
    carry, parts = WindowCarry(CFG_SMALL), []
    for lo in range(0, steps, size):
        rows = np.flatnonzero((step >= lo) & (step < lo + size))
        rows = rows[np.lexsort((step[rows], key[rows]))]
        part = carry.features(key[rows], {k: v[rows] for k, v in cols.items()})
        parts.append(pd.DataFrame(part).assign(_row=rows))
    sliced = pd.concat(parts).set_index("_row").loc[order].reset_index(drop=True)
    pd.testing.assert_frame_equal(sliced, pd.DataFrame(one), check_dtype=True)


@pytest.mark.parametrize("n", [0, 1, 5, 63, 64, 100, 1000])
@pytest.mark.parametrize("w", [1, 2, 3, 50, 51, 64, 100])
def test_sliding_max_is_the_trailing_window_max(n, w):
    rng = np.random.default_rng(n * 1000 + w)
    x = rng.normal(size=n)
    x[rng.random(n) < 0.2] = -np.inf
    ref = np.array([x[max(0, i - w + 1):i + 1].max() for i in range(n)])
    assert np.array_equal(_sliding_max(x, w), ref)


# ---- readers ---------------------------------------------------------------------------------
def test_dedup_and_info_with_a_restarted_segment(run_dir):
    """The restarted rank keeps the later segment's copy of the replayed steps; info sees both segments."""
    run = Run(run_dir, combine_chunks=False)
    t = run.table("tensors")
    r0 = t.filter(pa.compute.equal(t["rank"], 0))
    steps = r0["step"].to_numpy()
    seg = r0["segment"].to_numpy()
    assert len(np.unique(steps)) == 240 and set(seg[(steps >= 210) & (steps < 220)]) == {1}
    info = run.info()
    assert info["segments"] == [0, 1] and info["rank_segments"] == 3 and info["ranks"] == [0, 1]
    assert info["tensors"] == len(KEYS) and info["steps"] == 240


def test_one_segment_skips_dedup_but_keeps_every_row(tmp_path):
    write_run(tmp_path, steps=30, ranks=(0,), restart_at=None)
    t = Run(tmp_path, combine_chunks=False).table("tensors")
    assert dedup_latest_segment(t) is t
    assert t.num_rows == sum(len(_stats(s, 0, np.random.default_rng(0))[1]) for s in range(30))
    info = Run(tmp_path).info()
    assert info["segments"] == [0] and info["rank_segments"] == 1 and info["tensors"] == len(KEYS)


def test_distinct_rows_counts_tensors_across_repeated_and_changing_steps():
    """Step chunks that repeat the previous one are skipped; a tensor that only some steps log still counts."""
    names = [("a", "w"), ("b", "w")]

    def batch(pairs):
        return pa.RecordBatch.from_arrays([pa.array([p[0] for p in pairs]), pa.array([p[1] for p in pairs]),
                                           pa.array(np.arange(len(pairs)))], names=["layer", "tensor", "x"])

    steps = [names, names, names + [("c", "g")], names, [("a", "w")], names]
    t = pa.Table.from_batches([batch(p) for p in steps])
    assert _distinct_rows(t, ["layer", "tensor"]) == 3
    assert _distinct_rows(t.combine_chunks(), ["layer", "tensor"]) == 3
