"""Cheap steps are appended from a rewritten IPC message (store.message_template): the bytes must be
exactly what serializing the batch built the ordinary way gives, and the fallback must take over
wherever rewriting in place would not give that (NaN stored as null, merged micro-batches)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from fp8scope.capture.collector import TensorKey
from fp8scope.capture.stats import CHEAP_FIELDS
from fp8scope.schema import TENSOR_SCHEMA
from fp8scope.step_records import cheap_tensor_batch, cheap_tensor_message, scalar_batch, scalar_message
from fp8scope.store.message_template import MessageTemplate, TemplateError, batch_of_message

KEYS = [TensorKey(f"blocks.{i // 3}.mlp.fc{i % 2}", ("activation", "weight", "gradient")[i % 3], "whatif",
                  ("e4m3", "e5m2")[i % 2], (448.0, 57344.0)[i % 2], (4, 4)) for i in range(9)]


def test_cheap_message_is_the_serialized_batch_step_after_step():
    rng = np.random.default_rng(0)
    cache: dict = {}
    kids, numels = [4, 0, 1, 2, 3, 5, 6, 7, 8], [16, 16, 16, 16, 16, 16, 16, 16, -1]
    for step in range(6):
        rows = rng.standard_normal((len(kids), len(CHEAP_FIELDS))) * 10.0 ** rng.integers(-30, 30)
        rows[1, 0] = np.inf  # an infinite amax is a value (only NaN is stored as null)
        got = cheap_tensor_message(step * 1000 + 7, 3, rows, kids, numels, KEYS, cache)
        want = cheap_tensor_batch(step * 1000 + 7, 3, rows, kids, numels, KEYS, {})
        assert got is not None
        message, fp8_max = got
        assert message == want.serialize().to_pybytes(), step
        assert np.array_equal(fp8_max, want.column("fp8_max").to_numpy())
        assert batch_of_message(message, want.schema).equals(want)


def test_cheap_message_falls_back_where_the_template_cannot_say_it():
    cache: dict = {}
    rows = np.ones((3, len(CHEAP_FIELDS)))
    assert cheap_tensor_message(0, 0, rows, [0, 1, 2], [4, 4, 4], KEYS, cache) is not None
    rows[2, 1] = np.nan  # NaN is stored as null: the validity bitmap would change
    assert cheap_tensor_message(1, 0, rows, [0, 1, 2], [4, 4, 4], KEYS, cache) is None
    # two captures of one tensor (micro-batches): merged rows, not one row per capture
    assert cheap_tensor_message(2, 0, np.ones((3, len(CHEAP_FIELDS))), [0, 0, 2], [4, 4, 4], KEYS, cache) is None
    # a new row list gets its own template; the old one still serves its rows
    other = cheap_tensor_message(3, 0, np.ones((2, len(CHEAP_FIELDS))), [5, 6], [4, 4], KEYS, cache)
    assert other is not None and batch_of_message(other[0], TENSOR_SCHEMA).num_rows == 2
    again = cheap_tensor_message(4, 0, np.full((3, len(CHEAP_FIELDS)), 2.0), [0, 1, 2], [4, 4, 4], KEYS, cache)
    want = cheap_tensor_batch(4, 0, np.full((3, 4), 2.0), [0, 1, 2], [4, 4, 4], KEYS, {})
    assert again[0] == want.serialize().to_pybytes()


def test_scalar_message_is_the_serialized_batch_nan_loss_included():
    cache: dict = {}
    for step, values in enumerate(([1.5, 3e-4], [float("nan"), 2e-4], [float("inf"), 0.0])):
        got = scalar_message(step, 1, ["loss", "lr"], values, 1700000000.25 + step, cache)
        want = scalar_batch(step, 1, ["loss", "lr"], values, 1700000000.25 + step)
        assert got == want.serialize().to_pybytes()


def test_template_refuses_columns_it_cannot_rewrite():
    b = pa.record_batch({"a": pa.array([1.0, None]), "s": pa.array(["x", "y"]), "f": pa.array([True, False]),
                         "i": pa.array([1, 2], pa.int64())})
    for col in ("a", "s", "f", "missing"):
        with pytest.raises((TemplateError, KeyError)):
            MessageTemplate(b, [col])
    t = MessageTemplate(b, ["i"])
    got = pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(t.fill({"i": np.array([7, 9])}))), b.schema)
    assert got.column("i").to_pylist() == [7, 9] and got.column("s").to_pylist() == ["x", "y"]


def test_log_message_is_the_serialized_batch_and_flags_suspicious_steps():
    """The kernel's fill from the what-if row log (step_records.cheap_log_message): after the general
    path kept the template, the same bytes as the batch built the ordinary way, the writer's
    suspicious rule, and None (the general path) for a NaN, other rows or no template."""
    from array import array

    from fp8scope import native
    from fp8scope.capture.row_log import WIDTH
    from fp8scope.step_records import cheap_log_message
    from fp8scope.writer_thread import BackgroundWriter

    if native.fill_cheap_message_fn() is None and native.kernel() is None:
        pytest.skip("no C compiler: the kernel fill does not exist")
    rng = np.random.default_rng(1)
    kids, numels = [4, 0, 1, 2, 3, 5, 6, 7, 8], [16, 16, 16, 16, 16, 16, 16, 16, 32]
    fp8_max = np.array([KEYS[k].fp8_max for k in kids])

    def logged(rows, kids=kids, numels=numels):
        full = np.column_stack([rows, kids, numels, np.zeros(len(kids))])
        assert full.shape[1] == WIDTH
        return array("d", full.reshape(-1).tolist())

    cache: dict = {}
    rows = np.abs(rng.standard_normal((len(kids), 4)))
    assert cheap_log_message(0, 2, logged(rows), len(kids), cache) is None  # no template kept yet
    assert cheap_tensor_message(0, 2, rows, kids, numels, KEYS, cache, for_log=True) is not None
    for step in range(1, 8):
        rows = np.abs(rng.standard_normal((len(kids), 4))) * 10.0 ** rng.integers(-20, 20)
        if step == 3:
            rows[2, 0] = np.inf
        if step == 5:
            rows[4, 0] = 9 * rows[4, 2] * fp8_max[4]  # an amax 9x what the scale can represent
        got = cheap_log_message(step * 1000 + 7, 2, logged(rows), len(kids), cache)
        want = cheap_tensor_batch(step * 1000 + 7, 2, rows, kids, numels, KEYS, {})
        assert got is not None and got[0] == want.serialize().to_pybytes(), step
        assert got[1] == BackgroundWriter._suspicious(rows[:, 0], rows[:, 2], fp8_max) == (step in (3, 5))
    nan = rows.copy()
    nan[1, 3] = np.nan
    assert cheap_log_message(9, 2, logged(nan), len(kids), cache) is None
    swapped = kids[:2][::-1] + kids[2:]
    assert cheap_log_message(9, 2, logged(rows, kids=swapped), len(kids), cache) is None
    assert cheap_log_message(9, 2, logged(rows, numels=[16] * len(kids)), len(kids), cache) is None
    assert cheap_log_message(9, 2, logged(rows[:3], kids[:3], numels[:3]), 3, cache) is None
    assert cheap_log_message(9, 3, logged(rows), len(kids), cache) is None  # another rank's writer
