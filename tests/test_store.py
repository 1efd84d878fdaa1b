"""Store tests: real files, real subprocesses, no mocks."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from fp8scope.errors import RunError, UsageError
from fp8scope.run import load_run
from fp8scope.schema import EVENT_SCHEMA, SCALAR_SCHEMA, SCHEMA_VERSION, TENSOR_SCHEMA
from fp8scope.store import (
    RunWriter,
    StreamTail,
    compact,
    new_manifest,
    next_segment,
    read_manifest,
    read_stream,
    update_manifest,
    write_manifest,
)
from fp8scope.store.layout import list_streams, parse_stream_name, stream_path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.1.attn.qkv", "blocks.1.mlp.fc1"]
ROLES = ["activation", "weight", "gradient"]


def tensor_batch(step: int, rank: int = 0, value: float = 1.0) -> pa.RecordBatch:
    pairs = [(l, r) for l in LAYERS for r in ROLES]
    n = len(pairs)
    cols = {}
    for f in TENSOR_SCHEMA:
        if f.name == "step":
            cols[f.name] = [step] * n
        elif f.name == "rank":
            cols[f.name] = [rank] * n
        elif f.name == "layer":
            cols[f.name] = [p[0] for p in pairs]
        elif f.name == "tensor":
            cols[f.name] = [p[1] for p in pairs]
        elif f.name == "order":
            cols[f.name] = list(range(n))
        elif f.name in ("source", "fp8_format"):
            cols[f.name] = ["emulated" if f.name == "source" else "e4m3"] * n
        elif f.name == "recipe":
            cols[f.name] = ["delayed"] * n
        elif f.name == "full":
            cols[f.name] = [True] * n
        elif pa.types.is_integer(f.type):
            cols[f.name] = [step] * n
        else:
            cols[f.name] = [value] * n
    return pa.record_batch([pa.array(cols[f.name], f.type) for f in TENSOR_SCHEMA], schema=TENSOR_SCHEMA)


def scalar_batch(step: int, rank: int = 0, value: float = 1.0) -> pa.RecordBatch:
    return pa.record_batch(
        [
            pa.array([step, step], pa.int64()),
            pa.array([rank, rank], pa.int32()),
            pa.array(["loss", "lr"]),
            pa.array([value, value * 0.1]),
            pa.array([time.time()] * 2),
        ],
        schema=SCALAR_SCHEMA,
    )


def event_batch(step: int, rank: int = 0) -> pa.RecordBatch:
    return pa.record_batch(
        [pa.array([step], pa.int64()), pa.array([rank], pa.int32()), pa.array(["overflow"]), pa.array(["warning"]),
         pa.array([LAYERS[0]]), pa.array(["activation"]), pa.array([3.0]), pa.array([1.0]), pa.array(["too many"])],
        schema=EVENT_SCHEMA,
    )


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    write_manifest(d, new_manifest(world_size=2, tensors=[{"layer": l, "tensor": r, "shape": [8, 8], "fp8_format": "e4m3", "source": "emulated"} for l in LAYERS for r in ROLES]))
    return d


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


# -- round trip ----------------------------------------------------------------------------
def test_round_trip(run_dir: Path):
    with RunWriter(run_dir, rank=0) as w:
        for s in range(5):
            w.write("tensors", tensor_batch(s))
            w.write("scalars", scalar_batch(s, value=float(s)))
        w.write("events", event_batch(3))
    run = load_run(run_dir)
    assert run.manifest["world_size"] == 2 and run.manifest["schema_version"] == SCHEMA_VERSION
    df = run.tensors()
    assert len(df) == 5 * len(LAYERS) * len(ROLES)
    assert list(df.columns) == TENSOR_SCHEMA.names + ["segment"]
    assert df["step"].is_monotonic_increasing
    assert run.scalars(name="loss")["value"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    ev = run.events()
    assert ev["rule"].tolist() == ["overflow"]
    info = run.info()
    assert info["steps"] == 5 and info["first_step"] == 0 and info["last_step"] == 4
    assert info["ranks"] == [0] and info["tensors"] == 12 and info["segments"] == [0]
    assert info["size_bytes"] > 0 and info["last_write"] and info["compacted"] is False
    assert run.table("tensors").equals(load_run(run_dir).table("tensors"))


def test_a_run_resumed_by_a_newer_fp8scope_reads_and_detects_across_its_segments(run_dir: Path):
    """Segment 0 written before the tensors table had its ``recipe`` and ``underflow_deep`` columns (an
    older fp8scope), segment 1 with them: the run reads as one table, the old rows' values null, and
    detection runs over both."""
    from fp8scope.detect import detect

    added = ["recipe", "underflow_deep"]
    old = pa.schema([f for f in TENSOR_SCHEMA if f.name not in added], metadata=TENSOR_SCHEMA.metadata)
    stream_path(run_dir, "tensors", 0, 0).parent.mkdir(parents=True)
    with pa.ipc.new_stream(str(stream_path(run_dir, "tensors", 0, 0)), old) as w:
        for s in range(3):
            w.write_batch(tensor_batch(s).drop_columns(added))
    with RunWriter(run_dir, rank=0) as w:
        assert w.segment == 1
        for s in range(3, 6):
            w.write("tensors", tensor_batch(s))
    df = load_run(run_dir).tensors()
    assert df["step"].tolist() == sorted(df["step"].tolist()) and len(df) == 6 * len(LAYERS) * len(ROLES)
    assert df.loc[df["step"] < 3, "recipe"].isna().all() and (df.loc[df["step"] >= 3, "recipe"] == "delayed").all()
    assert df.loc[df["step"] < 3, "underflow_deep"].isna().all()
    assert detect(run_dir) is not None


def test_a_run_an_older_fp8scope_logged_answers_sql_on_the_columns_it_predates(run_dir: Path):
    """A run written before ``underflow_deep`` and ``below_normal`` existed, alone: its merged table has the
    columns as nulls, so SQL naming them (the derived statistics of the dashboard, the HTML report and
    ``export``) runs, the part of its underflow pressed under is all of it (nothing is known to be deep),
    in SQL as in numpy, and the share under the normal range is unknown (null), not 0."""
    from fp8scope.derived import DERIVED

    new = ("underflow_deep", "below_normal")
    old = pa.schema([f for f in TENSOR_SCHEMA if f.name not in new], metadata=TENSOR_SCHEMA.metadata)
    stream_path(run_dir, "tensors", 0, 0).parent.mkdir(parents=True)
    with pa.ipc.new_stream(str(stream_path(run_dir, "tensors", 0, 0)), old) as w:
        for s in range(3):
            b = tensor_batch(s).drop_columns(list(new))
            n = b.num_rows
            for name, v in (("numel", 1000), ("zeros", 100), ("nonfinite", 0), ("underflow", 18 + s)):
                b = b.set_column(b.schema.get_field_index(name), old.field(name), pa.array([v] * n, pa.int64()))
            w.write_batch(b)
    run = load_run(run_dir)
    for name in new:
        assert run.table("tensors")[name].null_count == 3 * len(LAYERS) * len(ROLES)
    d = DERIVED["underflow_shallow_pct"]
    total = DERIVED["underflow_pct"].sql
    got = run.sql(f"select step, {d.sql} as shallow, {total} as total from tensors order by step")
    assert np.allclose(got["shallow"], got["total"]) and np.allclose(got["total"], 100 * (18 + got["step"]) / 900)
    t = run.table("tensors")
    fn = d.fn(lambda c: t[c].to_numpy(zero_copy_only=False).astype(np.float64))
    assert np.allclose(np.sort(fn), np.sort(got["shallow"].to_numpy()))
    below = run.sql(f"select {DERIVED['below_normal_pct'].sql} as pct from tensors")["pct"]
    assert below.isna().all() and np.isnan(DERIVED["below_normal_pct"].fn(
        lambda c: t[c].to_numpy(zero_copy_only=False).astype(np.float64))).all()


def test_filters(run_dir: Path):
    with RunWriter(run_dir, 0) as w0, RunWriter(run_dir, 1) as w1:
        for s in range(10):
            w0.write("tensors", tensor_batch(s, 0))
            w1.write("tensors", tensor_batch(s, 1))
    run = load_run(run_dir)
    df = run.tensors(layer=r"mlp", tensor="weight", steps=(2, 4), rank=1)
    assert set(df["layer"]) == {"blocks.0.mlp.fc1", "blocks.1.mlp.fc1"}
    assert set(df["tensor"]) == {"weight"} and set(df["rank"]) == {1}
    assert sorted(set(df["step"])) == [2, 3, 4]
    assert sorted(set(run.tensors(steps=range(0, 10, 3))["step"])) == [0, 3, 6, 9]
    assert sorted(set(run.tensors(last=3)["step"])) == [7, 8, 9]
    assert sorted(set(run.tensors(tensor=["weight", "gradient"])["tensor"])) == ["gradient", "weight"]
    assert len(run.tensors(layer="nothing-matches")) == 0
    assert run.table("tensors", ranks=[0]).num_rows == 10 * 12
    with pytest.raises(UsageError):
        run.tensors(layer="(")



@pytest.mark.parametrize("combine", [True, False])
def test_filters_combined_equal_pandas_filtering(run_dir: Path, combine: bool):
    """Every condition is combined into one mask before the table is filtered once; ``last`` counts
    the steps left after the other conditions. Same rows as filtering the whole frame in pandas,
    whether the run was read zero-copy (the CLI's way) or copied into one chunk per stream."""
    from fp8scope.run import Run

    with RunWriter(run_dir, 0) as w0, RunWriter(run_dir, 1) as w1:
        for s in range(12):
            w0.write("tensors", tensor_batch(s, 0))
            if s % 3:  # rank 1 skips every third step: `last` must count the steps left after the filters
                w1.write("tensors", tensor_batch(s, 1))
    run = Run(run_dir, combine_chunks=combine)
    every = run.tensors()
    cases = [dict(layer="mlp", tensor="weight", steps=(2, 9), rank=1, last=3), dict(rank=1, last=2),
             dict(layer="attn", last=4), dict(tensor=["weight", "gradient"], steps=range(0, 12, 4)), dict(last=100)]
    for kw in cases:
        want = every
        if "rank" in kw:
            want = want[want["rank"] == kw["rank"]]
        if "layer" in kw:
            want = want[want["layer"].str.contains(kw["layer"])]
        if "tensor" in kw:
            want = want[want["tensor"].isin([kw["tensor"]] if isinstance(kw["tensor"], str) else kw["tensor"])]
        if "steps" in kw:
            st = kw["steps"]
            want = want[want["step"].isin(list(st) if isinstance(st, range) else range(st[0], st[1] + 1))]
        if "last" in kw:
            want = want[want["step"].isin(sorted(want["step"].unique())[-kw["last"]:])]
        got = run.tensors(**kw)
        assert got.reset_index(drop=True).equals(want.reset_index(drop=True)), kw
    assert sorted(set(run.tensors(rank=1, last=2)["step"])) == [10, 11]
    assert sorted(set(run.tensors(rank=1, steps=(0, 6), last=2)["step"])) == [4, 5]


def test_events_empty_has_columns(run_dir: Path):
    with RunWriter(run_dir, 0) as w:
        w.write("scalars", scalar_batch(0))
    ev = load_run(run_dir).events()
    assert len(ev) == 0 and list(ev.columns) == EVENT_SCHEMA.names + ["segment"]


def test_sql(run_dir: Path):
    with RunWriter(run_dir, 0) as w:
        for s in range(4):
            w.write("tensors", tensor_batch(s, value=float(s)))
            w.write("scalars", scalar_batch(s, value=10.0 + s))
    run = load_run(run_dir)
    df = run.sql("select step, max(amax) m from tensors group by step order by step")
    assert df["m"].tolist() == [0.0, 1.0, 2.0, 3.0]
    j = run.sql("select t.step, s.value from tensors t join scalars s using (step) where s.name = 'loss' and t.\"order\" = 0 order by 1")
    assert j["value"].tolist() == [10.0, 11.0, 12.0, 13.0]
    assert run.sql("select count(*) n from events")["n"].tolist() == [0]
    with pytest.raises(UsageError) as e:
        run.sql("select nope from tensors")
    one_line(e)


# -- torn tails ----------------------------------------------------------------------------
def test_torn_tail_every_offset(run_dir: Path, tmp_path: Path):
    w = RunWriter(run_dir, 0)
    sizes = []
    for s in range(3):
        w.write("scalars", scalar_batch(s))
        sizes.append(w.paths()["scalars"].stat().st_size)
    path = w.paths()["scalars"]
    w.close()
    data = path.read_bytes()
    cut = tmp_path / "cut-r00000-s0000.arrows"
    for end in range(sizes[1], len(data) + 1):
        cut.write_bytes(data[:end])
        t = read_stream(cut)
        want = [0, 0, 1, 1] if end < sizes[2] else [0, 0, 1, 1, 2, 2]
        assert t["step"].to_pylist() == want, end
    # Torn inside the schema message, header only, empty: empty tables, no error.
    for end in [0, 1, 4, 7, 8, 20, sizes[0] - len(data[:sizes[0]]) + 100]:
        cut.write_bytes(data[:end])
        assert read_stream(cut, schema=SCALAR_SCHEMA).num_rows == 0
    header_only = run_dir / "streams" / "x-r00000-s0000.arrows"
    header_only.write_bytes(SCALAR_SCHEMA.serialize().to_pybytes())
    assert read_stream(header_only).schema.names == SCALAR_SCHEMA.names


def test_torn_tail_then_tail_completes(tmp_path: Path):
    """A live reader that sees half a message picks it up whole on the next poll."""
    p = tmp_path / "scalars-r00000-s0000.arrows"
    full = SCALAR_SCHEMA.serialize().to_pybytes() + scalar_batch(0).serialize().to_pybytes()
    b1 = scalar_batch(1).serialize().to_pybytes()
    p.write_bytes(full + b1[:37])
    tail = StreamTail(p)
    assert [b.num_rows for b in tail.read_new()] == [2]
    with open(p, "ab") as f:
        f.write(b1[37:])
    assert [b["step"][0].as_py() for b in tail.read_new()] == [1]
    assert tail.read_new() == []


def test_garbage_stream_raises(run_dir: Path):
    bad = stream_path(run_dir, "tensors", 0, 0)
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"this is not arrow at all, just text\n" * 10)
    with pytest.raises(RunError) as e:
        read_stream(bad)
    assert bad.name in one_line(e)
    with pytest.raises(RunError) as e:
        load_run(run_dir).tensors()
    assert bad.name in one_line(e)
    # Continuation marker but nonsense header.
    bad.write_bytes(b"\xff\xff\xff\xff\x10\x00\x00\x00" + os.urandom(16) + b"\x00" * 64)
    with pytest.raises(RunError):
        read_stream(bad)


def test_zero_filled_tail_is_torn(tmp_path: Path):
    p = tmp_path / "scalars-r00000-s0000.arrows"
    p.write_bytes(SCALAR_SCHEMA.serialize().to_pybytes() + scalar_batch(0).serialize().to_pybytes() + b"\x00" * 300)
    assert read_stream(p).num_rows == 2


# -- crash safety with a real process -------------------------------------------------------
WRITER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    import pyarrow as pa
    from fp8scope.schema import SCALAR_SCHEMA, TENSOR_SCHEMA
    from fp8scope.store.writer import RunWriter
    run_dir, start, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    w = RunWriter(run_dir, 0)
    print("segment", w.segment, flush=True)
    n = {n_rows}
    layers = pa.array({layers!r} * (n // {n_layers}))
    step = start
    while True:
        v = pa.array([float(w.segment)] * n)
        cols = dict(step=pa.array([step] * n, pa.int64()), rank=pa.array([0] * n, pa.int32()), layer=layers, amax=v)
        w.write("tensors", pa.record_batch([cols.get(f.name, pa.nulls(n, f.type)) for f in TENSOR_SCHEMA], schema=TENSOR_SCHEMA))
        w.write("scalars", pa.record_batch([pa.array([step], pa.int64()), pa.array([0], pa.int32()), pa.array(["loss"]),
                                            pa.array([float(w.segment)]), pa.array([time.time()])], schema=SCALAR_SCHEMA))
        print(step, flush=True)
        step += 1
        if delay:
            time.sleep(delay)
    """
)


def spawn_writer(run_dir: Path, start: int, delay: float) -> subprocess.Popen:
    script = run_dir.parent / "writer.py"
    layers = [f"{l}.{r}" for l in LAYERS for r in ROLES]
    script.write_text(WRITER_SCRIPT.format(repo=str(REPO), layers=layers, n_layers=len(layers), n_rows=len(layers)))
    return subprocess.Popen([sys.executable, str(script), str(run_dir), str(start), str(delay)], stdout=subprocess.PIPE, text=True, cwd=REPO)


def test_sigkill_never_loses_returned_writes(run_dir: Path):
    rng = random.Random(1234)
    printed: dict[int, int] = {}  # step -> segment that last logged it
    start = 0
    for attempt in range(4):
        proc = spawn_writer(run_dir, start, 0.0)
        first = proc.stdout.readline().split()
        assert first[0] == "segment"
        seg = int(first[1])
        assert seg == attempt
        first_step = proc.stdout.readline()  # kill only once this writer has written (busy machines start slowly)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        steps = [int(x) for x in (first_step + out).split()]  # only lines printed after write() returned
        for s in steps:
            printed[s] = seg
        # Next "restart" resumes a bit before where this one died: replayed steps.
        start = max(start, (steps[-1] if steps else start) - 3)
        run = load_run(run_dir)
        sc = run.scalars(name="loss")
        got = dict(zip(sc["step"], sc["value"]))
        for s, sg in printed.items():
            assert s in got, (attempt, s)
            assert got[s] == float(sg), "later segment must win"
        ten = run.tensors()
        assert set(printed) <= set(ten["step"])
        # Every (rank, step) comes from exactly one segment, the latest, with all its rows.
        assert (ten.groupby("step")["segment"].nunique() == 1).all()
        assert (ten.groupby("step").size() == len(LAYERS) * len(ROLES)).all()
        amax = ten.groupby("step")["amax"].first()
        assert all(amax[s] == float(sg) for s, sg in printed.items())
    assert len(list_streams(run_dir)) == 8


def test_live_reading(run_dir: Path):
    proc = spawn_writer(run_dir, 0, 0.02)
    try:
        assert proc.stdout.readline().startswith("segment")
        proc.stdout.readline()
        path = stream_path(run_dir, "scalars", 0, 0)
        tail = StreamTail(path)
        run = load_run(run_dir)
        seen, polls_with_data = 0, 0
        deadline = time.time() + 10
        while polls_with_data < 4 and time.time() < deadline:
            new = tail.read_new()
            if new:
                polls_with_data += 1
                seen += sum(b.num_rows for b in new)
            time.sleep(0.05)
        assert polls_with_data >= 4 and seen > 0
        before = len(run.scalars())
        time.sleep(0.2)
        assert run.refresh() is True
        assert len(run.scalars()) > before
    finally:
        proc.kill()
        proc.communicate()


# -- segments and dedup -----------------------------------------------------------------------
def test_segments_later_wins(run_dir: Path):
    assert next_segment(run_dir, 0) == 0
    with RunWriter(run_dir, 0) as w:
        assert w.segment == 0
        for s in range(6):
            w.write("tensors", tensor_batch(s, value=0.0))
    with RunWriter(run_dir, 1) as w:
        for s in range(6):
            w.write("tensors", tensor_batch(s, rank=1, value=0.0))
    assert next_segment(run_dir, 0) == 1 and next_segment(run_dir, 1) == 1 and next_segment(run_dir, 2) == 0
    with RunWriter(run_dir, 0) as w:  # restarted rank 0 replays steps 4..7
        assert w.segment == 1
        for s in range(4, 8):
            w.write("tensors", tensor_batch(s, value=1.0))
    names = sorted(p.name for p in (run_dir / "streams").iterdir())
    assert names == ["tensors-r00000-s0000.arrows", "tensors-r00000-s0001.arrows", "tensors-r00001-s0000.arrows"]
    assert parse_stream_name(names[1]) == ("tensors", 0, 1)
    run = load_run(run_dir)
    t = run.table("tensors")
    assert "segment" in t.column_names
    df = run.tensors(rank=0)
    per_step = df.groupby("step").agg(seg=("segment", "max"), segs=("segment", "nunique"), n=("amax", "size"), v=("amax", "max"))
    assert per_step["segs"].eq(1).all() and per_step["n"].eq(12).all()
    assert per_step.loc[[0, 1, 2, 3], "seg"].eq(0).all() and per_step.loc[[4, 5, 6, 7], "seg"].eq(1).all()
    assert (run.tensors(rank=1)["segment"] == 0).all() and len(run.tensors(rank=1)) == 6 * 12
    assert run.info()["segments"] == [0, 1]
    with pytest.raises(RunError):  # never append into an existing stream
        RunWriter(run_dir, 0, segment=0).write("tensors", tensor_batch(0))


def test_writer_rejects_bad_batches(run_dir: Path):
    w = RunWriter(run_dir, 0)
    with pytest.raises(UsageError):
        w.write("nope", scalar_batch(0))
    with pytest.raises(UsageError):
        w.write("scalars", pa.record_batch({"x": [1]}))
    # Castable types are conformed (int value column -> double).
    loose = pa.record_batch({"step": [1], "rank": [0], "name": ["loss"], "value": [3], "time": [0.0]})
    w.write("scalars", loose)
    w.close()
    assert load_run(run_dir).scalars()["value"].tolist() == [3.0]


# -- compaction ---------------------------------------------------------------------------------
def test_compaction_round_trip_and_append(run_dir: Path):
    w = RunWriter(run_dir, 0)
    for s in range(5):
        w.write("tensors", tensor_batch(s))
        w.write("scalars", scalar_batch(s, value=float(s)))
    before = load_run(run_dir)
    summary = compact(run_dir)
    assert (run_dir / "parquet" / "tensors.parquet").exists()
    listed = json.loads((run_dir / "parquet" / "compacted.json").read_text())
    assert listed["streams"] == summary["streams"]
    assert listed["streams"]["streams/scalars-r00000-s0000.arrows"] == w.paths()["scalars"].stat().st_size
    after = load_run(run_dir)
    assert after.info()["compacted"] is True
    assert after.table("tensors").equals(before.table("tensors"))
    assert after.scalars()["value"].tolist() == before.scalars()["value"].tolist()
    # Append to the same (still open) stream, and from a restarted segment.
    for s in range(5, 8):
        w.write("scalars", scalar_batch(s, value=float(s)))
    w.close()
    with RunWriter(run_dir, 0) as w2:
        w2.write("scalars", scalar_batch(7, value=70.0))
        w2.write("scalars", scalar_batch(8, value=80.0))
    run = load_run(run_dir)
    assert run.scalars(name="loss")["value"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 70.0, 80.0]
    assert after.refresh() is True
    assert after.scalars(name="loss")["step"].tolist() == list(range(9))
    # Recompact, delete closed streams: data unchanged, new segments keep increasing.
    compact(run_dir, delete_streams=True)
    assert list_streams(run_dir) == []
    assert load_run(run_dir).scalars(name="loss")["value"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 70.0, 80.0]
    assert next_segment(run_dir, 0) == 2
    with RunWriter(run_dir, 0) as w3:
        w3.write("scalars", scalar_batch(8, value=800.0))
    assert load_run(run_dir).scalars(name="loss")["value"].tolist()[-1] == 800.0


def test_compaction_crash_leftovers_are_harmless(run_dir: Path):
    with RunWriter(run_dir, 0) as w:
        for s in range(3):
            w.write("scalars", scalar_batch(s))
    compact(run_dir)
    # A compaction killed mid-write leaves a temp file and maybe no compacted.json.
    (run_dir / "parquet" / ".tensors.parquet.tmp-999").write_bytes(b"PAR1 half")
    (run_dir / "parquet" / "compacted.json").unlink()
    run = load_run(run_dir)
    assert run.scalars()["step"].tolist() == [0, 0, 1, 1, 2, 2]


# -- manifests -----------------------------------------------------------------------------------
def test_manifest_round_trip_and_update(tmp_path: Path):
    d = tmp_path / "r"
    m = write_manifest(d, {"recipe": {"kind": "delayed"}, "world_size": 4, "tensors": [{"layer": "a", "tensor": "weight", "shape": (2, 3), "fp8_format": "e4m3", "source": "te"}]})
    got = read_manifest(d)
    assert got == m and got["tensors"][0]["shape"] == [2, 3]
    assert got["fp8scope_version"] and "created" in got and got["schema_version"] == SCHEMA_VERSION
    update_manifest(d, meta={"note": "x"})
    update_manifest(d, meta={"other": 1}, world_size=8)
    got = read_manifest(d)
    assert got["meta"] == {"note": "x", "other": 1} and got["world_size"] == 8
    assert not [p for p in d.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize(
    "content, expect",
    [
        (None, "not an fp8scope run (no run.json)"),
        ('{\n  "schema_version": 1,\n  "world_size": 2,,\n}', "run.json is not valid JSON (line 3)"),
        (b"\xff\xfe garbage", "not valid JSON"),
        ('{"schema_version": 7}', f"schema version 7 is newer than this fp8scope supports ({SCHEMA_VERSION})"),
        ('{"schema_version": "1"}', "schema_version must be an integer"),
        ('{"world_size": 1}', "has no schema_version"),
        ("[1, 2]", "not a JSON object"),
        ('{"schema_version": 1, "tensors": {"a": 1}}', "tensors must be a list"),
        ('{"schema_version": 1, "tensors": [{"layer": "a"}]}', "tensors[0] has no string 'tensor'"),
        ('{"schema_version": 1, "world_size": 0}', "world_size must be a positive integer"),
        ('{"schema_version": 1, "recipe": 3}', "recipe must be an object or null"),
    ],
)
def test_bad_manifests(tmp_path: Path, content, expect):
    d = tmp_path / "runs" / "x"
    d.mkdir(parents=True)
    if content is not None:
        (d / "run.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RunError) as e:
        load_run(d)
    msg = one_line(e)
    assert expect in msg and msg.startswith(str(d))


def test_missing_run_folder(tmp_path: Path):
    with pytest.raises(RunError) as e:
        read_manifest(tmp_path / "nope")
    assert "no such run folder" in one_line(e)
