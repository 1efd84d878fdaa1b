"""Bad input to the readers: every reader (load_run, the CLI, the dashboard's data layer when present)
answers a broken run folder with one clear line (RunError / UsageError; CLI exit code 2) or reads
what is intact; never a traceback, never an internal error, never a crash of the process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pyarrow as pa
import pytest

import fp8scope
from fp8scope.errors import RunError
from fp8scope.schema import SCALAR_SCHEMA, TENSOR_SCHEMA
from fp8scope.step_records import scalar_batch
from fp8scope.store import RunWriter
from rel_common import HERE, PYTHON, ROOT, assert_one_line_error, cli, cli_inproc, dashboard_loader
from rel_fuzz_streams import make_run, tensor_rows

# report and events run detection over what the readers merged: a row no reader can place breaks them first
READ_COMMANDS = (("info",), ("info", "--json"), ("tensors", "--csv"), ("tensors", "--last", "1"), ("report",),
                 ("events",))


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad") / "good"
    make_run(d)
    return d


@pytest.fixture
def run(good_run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(good_run, d)
    return d


def expect_clean_error(run_dir, needle: str | None = None) -> None:
    with pytest.raises(RunError) as ei:
        r = fp8scope.load_run(run_dir)
        r.tensors()
        r.info()
    msg = str(ei.value)
    assert "\n" not in msg and msg.strip(), repr(msg)
    if needle:
        assert needle in msg, msg
    for cmd in READ_COMMANDS:
        rc, _, err = cli_inproc(cmd[0], run_dir, *cmd[1:])
        assert_one_line_error(rc, err, needle)
        assert rc == 2
    dash = dashboard_loader()
    if dash is not None:
        with pytest.raises(RunError) as ei:
            dash(str(run_dir))
        assert "\n" not in str(ei.value)


def expect_readable(run_dir) -> fp8scope.run.Run:
    r = fp8scope.load_run(run_dir)
    r.tensors(), r.scalars(), r.events(), r.info()
    for cmd in READ_COMMANDS:
        rc, _, err = cli_inproc(cmd[0], run_dir, *cmd[1:])
        assert rc == 0, err
    dash = dashboard_loader()
    if dash is not None:
        dash(str(run_dir))
    return r


# ---- manifests -------------------------------------------------------------------------------
MANIFESTS = [
    (b"", "not valid JSON"),
    (b"{", "not valid JSON"),
    (b"\x00\xff\xfe garbage \x80", "not valid JSON"),
    (b"\xef\xbb\xbf{}", None),  # UTF-8 BOM
    (b"[]", "not a JSON object"),
    (b"null", "not a JSON object"),
    (b'"run"', "not a JSON object"),
    (b"{}", "no schema_version"),
    (b'{"schema_version": 99}', "newer than this fp8scope supports"),
    (b'{"schema_version": "1"}', "schema_version must be an integer"),
    (b'{"schema_version": 1.0}', "schema_version must be an integer"),
    (b'{"schema_version": true}', "schema_version must be an integer"),
    (b'{"schema_version": 0}', "invalid"),
    (b'{"schema_version": NaN}', "schema_version must be an integer"),
    (b'{"schema_version": 1, "world_size": -2}', "world_size"),
    (b'{"schema_version": 1, "world_size": 1e999}', "world_size"),
    (b'{"schema_version": 1, "tensors": {"a": 1}}', "tensors must be a list"),
    (b'{"schema_version": 1, "tensors": [{"layer": 3, "tensor": "weight"}]}', "layer"),
    (b'{"schema_version": 1, "tensors": [{"layer": "a", "tensor": "weight", "shape": "4x4"}]}', "shape"),
    (b'{"schema_version": 1, "recipe": "delayed"}', "recipe"),
    (b'{"schema_version": 1, "meta": []}', "meta"),
    (b'{"schema_version": 1' + b'0' * 5000 + b'}', None),  # a 5001-digit int: Python refuses to parse it
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # nesting deep enough to blow the stack
]


@pytest.mark.parametrize("content, needle", MANIFESTS, ids=[f"m{i}" for i in range(len(MANIFESTS))])
def test_bad_manifest(run, content, needle):
    (run / "run.json").write_bytes(content)
    expect_clean_error(run, needle)


def test_manifest_missing_or_not_a_file(run, tmp_path):
    (run / "run.json").unlink()
    expect_clean_error(run, "no run.json")
    (run / "run.json").mkdir()
    expect_clean_error(run)
    f = tmp_path / "afile"
    f.write_text("x")
    expect_clean_error(f, "not a folder")
    expect_clean_error(tmp_path / "does-not-exist", "no such run folder")


def test_hand_edited_manifest_that_is_still_valid(run):
    m = json.loads((run / "run.json").read_text())
    m.update(world_size=8, meta={"note": "edited by hand", "nested": {"x": [1, 2]}}, extra_key=[1, 2, 3],
             tensors=[{"layer": "blocks.0.mlp", "tensor": "weight"}])
    (run / "run.json").write_text(json.dumps(m))
    r = expect_readable(run)
    assert r.info()["world_size"] == 8


# ---- streams -----------------------------------------------------------------------------------
def _one_stream(run, table="tensors", rank=1):
    return next(p for p in (run / "streams").iterdir() if p.name.startswith(f"{table}-r{rank:05d}"))


@pytest.mark.parametrize("content", [b"", b"\xff\xff\xff\xff", b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\x00" * 4096],
                         ids=["empty", "torn-prefix", "eos-only", "zeros"])
def test_stream_with_nothing_in_it_is_an_empty_stream(run, content):
    _one_stream(run).write_bytes(content)
    r = expect_readable(run)
    assert set(r.tensors()["rank"]) == {0}


@pytest.mark.parametrize("content", [b"hello, world" * 10, os.urandom(1) + b"PAR1" + b"\x01" * 300,
                                     b"PAR1" + b"\x00" * 64 + b"PAR1"], ids=["text", "random", "parquet-magic"])
def test_garbage_stream_is_a_clear_error(run, content):
    p = _one_stream(run)
    p.write_bytes(content)
    expect_clean_error(run, p.name)


def _write_stream(path, schema, batches):
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, schema) as w:
        for b in batches:
            w.write_batch(b)


def test_stream_of_another_table_under_a_tensors_name(run):
    # Merged, its rows were tensor rows with no layer, and `report` and `events` stopped on an internal
    # error; the file says which table it holds, so the readers refuse it, naming the file.
    p = _one_stream(run)
    b = scalar_batch(3, 1, ["loss"], [1.0], time.time())
    _write_stream(p, SCALAR_SCHEMA, [b])
    expect_clean_error(run, f"{p.name}: holds the 'scalars' table, not 'tensors'")


def test_stream_without_its_tables_key_columns(run):
    # the same rows with the table's name in their metadata but no layer column (hand-made, foreign)
    p = _one_stream(run)
    b = tensor_rows(2, 1).drop_columns(["layer"])
    _write_stream(p, b.schema, [b])
    expect_clean_error(run, "not an fp8scope tensors stream (no 'layer' column)")


@pytest.mark.parametrize("change", ["step-as-string", "no-step-column", "extra-column", "newer-schema-metadata"])
def test_wrong_schema_stream(run, change):
    p = _one_stream(run)
    b = tensor_rows(2, 1)
    if change == "step-as-string":
        b = b.set_column(0, "step", pa.array([str(x) for x in b.column(0).to_pylist()]))
    elif change == "no-step-column":
        b = b.drop_columns(["step"])
    elif change == "extra-column":
        b = b.append_column("surprise", pa.array([1] * b.num_rows))
    else:
        b = b.replace_schema_metadata({b"fp8scope.table": b"tensors", b"fp8scope.schema_version": b"99"})
    _write_stream(p, b.schema, [b])
    if change in ("extra-column", "newer-schema-metadata"):
        expect_readable(run)
    else:
        expect_clean_error(run, "tensors")


def test_parquet_and_compacted_json_garbage(run):
    rc, _, err = cli_inproc("compact", run)
    assert rc == 0, err
    (run / "parquet" / "compacted.json").write_text("{oops")
    expect_readable(run)  # compacted.json is a summary: the parquet metadata is the truth
    (run / "parquet" / "tensors.parquet").write_bytes(b"PAR1 not really")
    expect_clean_error(run, "tensors.parquet")


def test_junk_files_in_the_run_folder_are_ignored(run):
    (run / "streams" / "notes.txt").write_text("hello")
    (run / "streams" / ".tensors-r00000-s0000.arrows.swp").write_bytes(b"\0" * 10)
    (run / "streams" / "tensors-r00009-s0003.arrows").mkdir()  # a folder with a stream's name
    (run / "parquet").mkdir()
    (run / "parquet" / "README").write_text("x")
    (run / ".run.json.tmp-12345").write_text('{"half": ')  # leftover of a killed manifest rewrite
    expect_readable(run)


def test_missing_ranks(run):
    m = json.loads((run / "run.json").read_text())
    m["world_size"] = 4
    (run / "run.json").write_text(json.dumps(m))
    w = RunWriter(run, 3)  # ranks 0, 1, 3 logged; rank 2 never did
    w.write("tensors", tensor_rows(0, 3))
    w.close()
    r = expect_readable(run)
    info = r.info()
    assert info["ranks"] == [0, 1, 3] and info["world_size"] == 4
    rc, out, err = cli_inproc("tensors", run, "--rank", "2")
    assert rc == 0 and "no rows match" in out, err
    for p in (run / "streams").glob("*-r00001-*"):
        p.unlink()  # a rank's files deleted by hand
    assert expect_readable(run).info()["ranks"] == [0, 3]


def test_cli_bad_arguments_on_a_good_run(run):
    for args, needle in [(("tensors", run, "--layer", "(["), "bad --layer regex"),
                         (("tensors", run, "--columns", "step,nope"), "unknown column"),
                         (("tensors", run, "--last", "-3"), "--last must be >= 1"),
                         (("tensors", run, "--rank", "x"), "invalid int value")]:
        rc, _, err = cli_inproc(*args)
        assert_one_line_error(rc, err, needle)


def _fuzz(tmp_path, seed: int, n: int) -> dict:
    r = subprocess.run([PYTHON, str(HERE / "rel_fuzz_streams.py"), str(tmp_path), str(seed), str(n)],
                       capture_output=True, text=True, cwd=ROOT, timeout=1800)
    where = (tmp_path / "current_case").read_text() if (tmp_path / "current_case").exists() else "?"
    assert r.returncode == 0, f"the reader process died (rc={r.returncode}) on {where}: {r.stderr[-1500:]}"
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["bad"] == [], summary["bad"][:10]
    return summary


def test_fuzzed_streams_ci(tmp_path):
    s = _fuzz(tmp_path, seed=int(os.environ.get("FP8SCOPE_SEED", 1)), n=120)
    print(json.dumps(s))


@pytest.mark.slow
def test_fuzzed_streams_stress(tmp_path):
    s = _fuzz(tmp_path, seed=int(os.environ.get("FP8SCOPE_SEED", 99)), n=3000)
    print(json.dumps(s))
    out = os.environ.get("FP8SCOPE_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"test": "fuzzed_streams_3000", **s}) + "\n")
