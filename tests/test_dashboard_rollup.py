"""The dashboard's per-(tensor, bucket) rollup on a live multi-rank run: each refresh updates it from
the oldest bucket a rank can still add rows to, with no rebuild, and the result equals a rollup built
from scratch on the same rows. Real stream files written by RunWriter, read by the dashboard's cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dashboard import queries as Q
from dashboard import rollup as R
from dashboard.runcache import RunCache
from fp8scope.step_payload import TensorKey
from fp8scope.schema import N_FIELDS
from fp8scope.step_records import tensor_batch
from fp8scope.store import RunWriter, new_manifest, write_manifest

KEYS = [TensorKey(f"blocks.{i // 3}.fc", ("activation", "weight", "gradient")[i % 3], "emulated", "e4m3", 448.0,
                  (8, 8)) for i in range(12)]


def _write(w: RunWriter, rank: int, step: int) -> None:
    m = np.random.default_rng(rank * 100_000 + step).random((len(KEYS), N_FIELDS)) * (1 + step % 7)
    w.write("tensors", tensor_batch(step, rank, m, list(range(len(KEYS))), KEYS, True))


def _keyed(e) -> dict:
    """The rollup rows by (layer, role, bucket): tensor ids depend on the order rows were seen."""
    r = R.rollup(e)
    a = r.a
    out = {}
    for i in range(len(a["n"])):
        tid = int(a["tid"][i])
        out[(r.layer[tid], r.role[tid], int(a["b"][i]))] = {k: a[k][i] for k in a if k not in ("tid", "b")}
    return out


def _same(x: dict, y: dict) -> None:
    assert x.keys() == y.keys()
    for k in x:
        for f in x[k]:
            assert np.array_equal(x[k][f], y[k][f], equal_nan=True), (k, f)


def _fresh(run: Path):
    cache = RunCache()
    return cache.get(run)


def test_live_multi_rank_refreshes_update_without_rebuilding(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_manifest(run, new_manifest(world_size=3))
    writers = [RunWriter(run, r) for r in range(3)]
    lag = {0: 0, 1: 1, 2: 3}  # rank 2 trails the lead rank by three steps, as independent writers do
    cache = RunCache()
    e = None
    step = 0
    for refresh in range(12):
        for _ in range(4):  # four steps of the lead rank between refreshes
            for r, w in enumerate(writers):
                if step - lag[r] >= 0:
                    _write(w, r, step - lag[r])
            step += 1
        if e is None:
            e = cache.get(run)
        cache.refresh(run, force=True)
        _keyed(e)
    ru = R.rollup(e)
    assert ru.updates == 11  # built when first opened, then only updated in place
    assert ru.rank_last == {0: step - 1, 1: step - 2, 2: step - 4}
    _same(_keyed(e), _keyed(_fresh(run)))
    frame = Q.heatmap_frame(e, "log2_amax", None)
    fresh = Q.heatmap_frame(_fresh(run), "log2_amax", None)
    assert frame.equals(fresh)

    # rank 2 stalls: once recomputing from its bucket would re-read more than UPDATE_ROWS rows it is
    # left out; when it logs again its rows land in final buckets and the rollup is rebuilt, still exact
    monkeypatch.setattr(R, "UPDATE_ROWS", 200)
    for s in range(step, step + 40):
        for r in (0, 1):
            _write(writers[r], r, s)
    cache.refresh(run, force=True)
    _keyed(e)
    assert R.rollup(e) is ru and ru.updates == 12
    for s in range(step - 3, step + 2):
        _write(writers[2], 2, s)
    for w in writers:
        w.close()
    cache.refresh(run, force=True)
    _same(_keyed(e), _keyed(_fresh(run)))
    assert R.rollup(e) is not ru  # rebuilt
