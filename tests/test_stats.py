"""Numerics of the on-device stats against hand-made tensors and a float64 reference."""

import math

import pytest
import torch

from fp8scope.capture import stats as stats_mod
from fp8scope.capture.stats import full_stats, saturation_floor, stats_call
from fp8scope.emulate.amax import amax_pair, amax_parts, amax_parts_many, combine_parts
from fp8scope.formats import get_format, recipe_format
from fp8scope.schema import FIELD_INDEX, STAT_FIELDS
from fp8scope.step_payload import N_WIDE, WIDE_FIELDS, wide_stats
from tests.conftest import assert_same_row, fused_stats_case

# every test here runs on both stats paths (compiled, eager)
pytestmark = pytest.mark.usefixtures("stats_path")

E4M3 = get_format("e4m3")
E5M2 = get_format("e5m2")


def as_dict(vec):
    return {name: float(vec[i]) for i, (name, _) in enumerate(STAT_FIELDS)}


def test_formats_come_from_finfo():
    assert E4M3.max == 448 and E5M2.max == 57344
    assert E4M3.min_subnormal == 2.0**-9 and E5M2.min_subnormal == 2.0**-16
    assert recipe_format("HYBRID", "backward") is E5M2 and recipe_format("E4M3", "backward") is E4M3
    with pytest.raises(ValueError):
        get_format("e3m4")


def test_saturation_floor_follows_the_real_cast():
    for fmt in (E4M3, E5M2):
        floor = saturation_floor(fmt)
        above = torch.nextafter(torch.tensor(floor), torch.tensor(math.inf))
        assert float(torch.tensor([floor]).to(fmt.dtype).float()) < fmt.max
        assert float(above.reshape(1).to(fmt.dtype).float()) == fmt.max


def test_hand_made_e4m3_counts():
    x = torch.tensor([0.0, 1.0, -2.0, 500.0, math.inf, math.nan, 2.0**-10, 3 * 2.0**-11, 440.0, -432.0, 431.0, 0.0])
    s = as_dict(full_stats(x, torch.tensor(1.0), torch.tensor(1.0), 3.0, E4M3))
    assert math.isnan(s["amax"])  # NaN propagates, as a recipe's amax does
    assert s["numel"] == 12
    assert s["zeros"] == 2
    assert s["nonfinite"] == 2  # inf and nan
    assert s["overflow"] == 2  # 500 and inf exceed 448 before the cast
    assert s["saturated"] == 4  # 500, inf, 440 and -432 land on +-448; 431 rounds to 416
    assert s["underflow"] == 1  # 2^-10 is exactly half the smallest subnormal: rounds to 0
    assert s["below_normal"] == 2  # and 3 * 2^-11 is a subnormal: both under the smallest normal, 2^-6
    assert s["min_nonzero"] == 2.0**-10
    assert s["expected_amax"] == 3.0


def test_scale_is_applied_before_counting():
    x = torch.tensor([1.0, 2.0, 4.0, 1e-4])
    s = as_dict(full_stats(x, torch.tensor(200.0), torch.tensor(1 / 200.0), 2.24, E4M3))
    assert s["overflow"] == 1  # 200 and 400 fit under 448, 800 does not
    assert s["saturated"] == 1  # 400 is a tie between 384 and 416: rounds to even (384), not 448
    assert s["underflow"] == 0  # 1e-4 * 200 = 0.02 is representable
    s = as_dict(full_stats(x, torch.tensor(1.0), torch.tensor(1.0), 4.0, E4M3))
    assert s["underflow"] == 1 and s["overflow"] == 0  # 1e-4 < 2^-10


def test_e5m2_gradient_underflow_matches_the_cast():
    torch.manual_seed(0)
    g = torch.randn(4096) * 1e-6
    s = as_dict(full_stats(g, torch.tensor(1.0), torch.tensor(1.0), 1.0, E5M2))
    q = g.to(torch.float8_e5m2).float()
    assert s["underflow"] == int(((g != 0) & (q == 0)).sum())
    assert s["underflow"] > 1000
    assert s["below_normal"] == int(((g != 0) & (g.abs() < 2.0**-14)).sum())  # under E5M2's smallest normal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_against_float64_reference(dtype):
    torch.manual_seed(1)
    x = (torch.randn(257, 33) * torch.logspace(-8, 3, 33)).to(dtype)
    x[3, 4] = 0
    scale = torch.tensor(448 / 50.0)
    s = as_dict(full_stats(x, scale, 1 / scale, 50.0, E4M3))
    x64 = x.double()
    y = (x.float().abs() * scale).double()  # the product the cast sees is computed in float32
    assert s["amax"] == pytest.approx(float(x64.abs().max()))
    assert s["zeros"] == int((x64 == 0).sum())
    assert s["overflow"] == int((y > 448).sum())
    assert s["underflow"] == int(((y > 0) & (y <= 2.0**-10)).sum())
    assert s["underflow_deep"] == int(((y > 0) & (y <= 2.0**-14)).sum())
    assert s["below_normal"] == int(((y > 0) & (y < 2.0**-6)).sum())
    q = (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() / float(scale)
    assert s["sq_err"] == pytest.approx(float(((q - x64) ** 2).sum()), rel=1e-4)
    assert s["min_nonzero"] == pytest.approx(float(x64.abs()[x64 != 0].min()))


def test_per_row_scale():
    x = torch.tensor([[1.0, 500.0], [1e-9, 2.0]])
    scale = torch.tensor([[1.0], [448 / 2.0]])
    s = as_dict(full_stats(x, scale, 1 / scale, torch.tensor([[500.0], [2.0]]), E4M3))
    assert s["overflow"] == 1 and s["underflow"] == 1
    assert s["scale"] == 1.0 and s["expected_amax"] == 500.0


def test_empty_and_all_zero_tensors():
    s = as_dict(full_stats(torch.zeros(0), 1.0, 1.0, 1.0, E4M3))
    assert s["amax"] == 0 and s["numel"] == 0 and s["overflow"] == 0
    s = as_dict(full_stats(torch.zeros(10), 1.0, 1.0, 1.0, E4M3))
    assert s["zeros"] == 10 and s["underflow"] == 0 and s["min_nonzero"] == math.inf


def test_amax_pair_logs_nan_and_records_te_amax():
    """The logged amax propagates NaN (the row marks where a NaN is); the recorded one is TE's fmaxf
    amax, NaN elements ignored, Inf kept."""
    logged, recorded = amax_pair(torch.tensor([math.nan, 3.0, -2.0]))
    assert math.isnan(float(logged)) and float(recorded) == 3.0
    logged, recorded = amax_pair(torch.tensor([1.0, -math.inf]))
    assert float(logged) == math.inf and float(recorded) == math.inf
    assert [float(v) for v in amax_pair(torch.zeros(0))] == [0.0, 0.0]
    assert [float(v) for v in amax_pair(torch.tensor([1.0, -7.0, 3.0], dtype=torch.bfloat16))] == [7.0, 7.0]
    logged, recorded = amax_pair(torch.tensor([-9.0, math.nan, 2.0], dtype=torch.bfloat16))
    assert math.isnan(float(logged)) and float(recorded) == 9.0
    for zeros in (torch.zeros(4), torch.full((4,), -0.0)):  # +0.0, as max(|x|) gives it, whatever the sign
        assert [math.copysign(1.0, float(v)) for v in amax_pair(zeros)] == [1.0, 1.0]
        # the what-if bank's rows, from the cheap capture's parts: one per tensor, and the multi-tensor form's
        parts = [amax_parts(zeros), *amax_parts_many([zeros], multi_tensor=True)]
        for a, c in parts:
            assert [math.copysign(1.0, float(v)) for v in combine_parts(a, c)] == [1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpus_logged_amax_is_the_magnitudes_max(dtype):
    """``amax.logged_on_host`` picks an end of ``aminmax`` on the host: the value, its sign (+0.0 for
    zeros of either sign) and the dtype of ``x.abs().amax()``, NaN where it is NaN."""
    from fp8scope.emulate.amax import logged_on_host

    for v in ([1.0, -3.0], [3.0, -1.0], [2.0, -2.0], [0.0, -0.0], [-0.0, -0.0], [0.0], [math.nan, 1.0],
              [-math.inf, 1.0], [math.inf], [-5.0, -7.0], [1e-40, -1e-41]):
        x = torch.tensor(v, dtype=dtype)
        logged, value = logged_on_host(x)
        want = x.abs().amax()
        assert logged.dtype == dtype and logged.shape == (), v
        if math.isnan(want):
            assert math.isnan(value) and math.isnan(logged), v
            continue
        assert value == float(logged) == float(want), (v, logged, want)
        assert math.copysign(1.0, value) == math.copysign(1.0, float(logged)) == 1.0, v


def test_full_stats_return_te_amax_for_a_whatif_state():
    row, recorded, _ = stats_call(torch.tensor([math.nan, 3.0, -5.0]), 1.0, 1.0, 1.0, E4M3)
    assert math.isnan(float(wide_stats(row)[FIELD_INDEX["amax"]])) and float(recorded) == 5.0


def test_the_pass_leaves_the_callers_tensors_alone():
    """The eager pass computes in place in scratch tensors, and reads a float32 tensor as it is (no
    copy): a slip would overwrite the user's activation or the emulated layer's dequantized copy. So
    would the emulated layer's amax pair and round trip, which clean and decode in place too."""
    from fp8scope.emulate.quantize import quantize_dequantize

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g) * 100
    x[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    x[1, :5] = 0
    deq = (x * 2).to(E4M3.dtype).float() / 2
    before = (x.clone(), deq.clone())
    for d in (None, deq):
        for scale in (torch.tensor(2.0), torch.full((64, 1), 2.0)):
            stats_call(x, scale, 1 / scale, torch.tensor(4.0), E4M3, deq=d)
            if scale.dim() == 0:  # a strided view: the pass reads it in place too
                stats_call(x.t(), scale, 1 / scale, torch.tensor(4.0), E4M3, deq=None if d is None else d.t())
    amax_pair(x)
    quantize_dequantize(x, torch.tensor(2.0), torch.tensor(0.5), E4M3)
    for now, then in zip((x, deq), before):
        assert torch.equal(now.isnan(), then.isnan()) and torch.equal(now.nan_to_num(), then.nan_to_num())


def test_counts_stay_exact_past_float32s_integer_range():
    """Counts are float32 sums per row, exact while a row holds fewer than 2**24 elements; a longer
    row (a vector of prime length, which no matrix view refolds) is summed in float64."""
    n = 16_777_259  # prime, above 2**24: odd counts past 2**24 are not float32 numbers
    s = as_dict(full_stats(torch.full((n,), 1e-30), 1.0, 1.0, 1.0, E4M3))
    assert s["numel"] == n and s["underflow"] == n and s["zeros"] == 0 and s["overflow"] == 0


def test_derived_limits_match_torch_finfo():
    for name in ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"):
        fmt = get_format(name)
        fi = torch.finfo(fmt.dtype)
        assert (fmt.max, fmt.tiny) == (float(fi.max), float(fi.tiny)), name
        smallest = torch.tensor([fmt.min_subnormal], dtype=torch.float32)
        assert float(smallest.to(fmt.dtype).float()) == fmt.min_subnormal  # representable
        assert float((smallest / 2).to(fmt.dtype).float()) == 0.0  # and nothing below it


@pytest.mark.parametrize("variant", ["per_tensor", "deq", "per_row", "recipes", "per_row_recipes"])
def test_the_fused_form_gives_the_eager_forms_numbers(variant):
    """The form inductor compiles on a GPU (each row, then the rows: few launches on CUDA) and
    the eager form are one definition written twice: run eagerly on adversarial tensors (NaN, Inf,
    zeros, subnormals, values past the format's range, scales that flush), they agree exactly but
    for the squared norms (float64 sums in the fused form; float32 rows in the CPU's eager pass over
    a finite tensor)."""
    from fp8scope.capture import stats as st

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        key, args = fused_stats_case(variant, "e4m3" if trial % 2 else "e5m2", 16, 40, trial, g)
        fused, eager = st._make_full_fused(key)(*args), st.FULL_STATS.fallback(key)(*args)  # the fused form run eagerly
        if variant.endswith("recipes"):  # the recipes' rows: one expression in both forms
            assert torch.equal(fused[1], eager[1]) or torch.allclose(fused[1], eager[1], equal_nan=True)
            fused, eager = fused[0], eager[0]
        assert fused.dtype == eager.dtype == torch.float64 and fused.shape == eager.shape == (N_WIDE,)
        exact = [i for i, name in enumerate(WIDE_FIELDS) if not name.startswith("sq_")]
        assert torch.equal(fused[exact].isnan(), eager[exact].isnan())
        same = (fused[exact] == eager[exact]) | eager[exact].isnan()
        assert bool(same.all()), (variant, trial, fused, eager)
        assert_same_row(fused, eager, 1e-12, variant, trial)


def test_the_fused_amax_pair_gives_the_eager_pair():
    """The amax pair as inductor sees it (each row, then the rows) and eagerly: the same logged
    (NaN-propagating) and recorded (TE's, NaN ignored) amaxes on adversarial tensors."""
    from fp8scope.emulate.amax import _fused_pair, amaxes_of, row_matrix

    for v in ([1.0, -3.0, 2.0], [math.nan, 3.0, -5.0], [math.inf, 1.0], [-math.inf, math.nan], [0.0, 0.0],
              [1e-44, -1e-45], [3e38, -3.4e38]):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.tensor(v).to(dtype)
            got, want = _fused_pair(row_matrix(x)), amaxes_of(x)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype == torch.float32
                assert (math.isnan(g) and math.isnan(w)) or float(g) == float(w), (v, dtype, got, want)


def _finite_row_cases():
    """Tensors for the CPU's finite pass: zeros, a NaN, an Inf, tiny and huge magnitudes, -0.0, with
    scales that clip, saturate, underflow or fit, per tensor and per row (one row's scale NaN)."""
    gen = torch.Generator().manual_seed(0)
    for case in range(40):
        rows, cols = [(64, 96), (1, 300), (130, 7), (3, 4)][case % 4]
        x = torch.randn(rows, cols, generator=gen) * 10.0 ** (case % 13 - 6)
        if case % 5 == 1:
            x[x.abs() < 0.5 * 10.0 ** (case % 13 - 6)] = 0
        if case % 7 == 2:
            x[0, 0] = math.nan
        if case % 11 == 3:
            x[0, -1] = -math.inf
        if case % 6 == 4:
            x[:] = 0
        if case % 9 == 5:
            x[0, 0] = -0.0
        yield case, x, [1.0, 0.5, 2.0, 1e-3, 1e3, 1.0001][case % 6], True
    # squares past float32's range, and squares that underflow it: the general form's float64 sums
    for case, magnitude in ((40, 1e21), (41, 1e-30), (42, 3e-23)):
        yield case, torch.randn(64, 96, generator=gen) * magnitude, 1.0, False


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("has_deq", [False, True])
def test_the_cpus_finite_pass_gives_the_general_passs_row(fmt_name, dtype, per_row, has_deq):
    """On the CPU a finite tensor's stats skip what it cannot hold (``stats._make_finite_row``); the
    row must be the general form's, bit for bit (a NaN as a NaN, the sign of a zero), and a tensor
    or decoded copy (or scale) with a NaN or an Inf must go to the general form."""
    key = ("cpu", dtype, fmt_name, per_row, has_deq)
    fmt = get_format(fmt_name)
    full, general, finite = stats_mod._make_full(key), stats_mod._make_general(key), stats_mod._make_finite_row(key)
    taken = 0
    squares = [i for i, name in enumerate(WIDE_FIELDS) if name.startswith("sq_")]
    for case, x, factor, in_range in _finite_row_cases():
        x = x.to(dtype)
        rows = x.shape[0]
        amax = x.float().abs().nan_to_num(nan=0.0, posinf=0.0).amax().item() or 1.0
        scale = torch.tensor(fmt.max / amax * factor)
        if per_row:
            scale = (scale * (1 + torch.arange(rows, dtype=torch.float32) / rows)).reshape(rows, 1)
            if case % 8 == 0:
                scale[0] = math.nan
        deq = None
        if has_deq:
            deq = (x.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() / scale
            if case % 10 == 7:
                deq[0, 0] = math.inf
        args = (x, scale, 1 / scale, torch.tensor(amax), deq)
        got, want = full(*args), general(x.to(torch.float32), *args[1:])
        assert torch.allclose(got[squares], want[squares], rtol=2e-6, atol=0, equal_nan=True), (case, got, want)
        got[squares] = want[squares]
        assert torch.equal(got.nan_to_num(nan=-7.0), want.nan_to_num(nan=-7.0)), (case, got, want)
        assert torch.equal(got.signbit(), want.signbit()), (case, got, want)
        finite_input = (bool(torch.isfinite(x).all()) and bool(torch.isfinite(scale).all())  # (a NaN scale decodes NaN)
                        and (deq is None or bool(torch.isfinite(deq).all())))
        ran = finite(x.to(torch.float32), *args[1:])[0] is not None
        assert ran == (finite_input and in_range), case
        taken += ran
    assert taken >= 20  # the finite pass ran on most cases


def test_a_frozen_weight_takes_the_cpus_finite_pass():
    """A frozen ``Parameter`` (a fine-tune's base weight) reaches the stats as itself; its values are
    as readable as a tensor's, so it takes the same finite pass: the same ops and the same row."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    w = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    args = (torch.tensor(2.0), torch.tensor(0.5), torch.tensor(3.0), E4M3)
    stats_call(w.detach(), *args)  # the variant made
    rows = []
    for x in (w, w.detach()):
        with Ops() as c:
            rows.append(stats_call(x, *args)[0])
        rows.append(c.n)
    assert torch.equal(rows[0], rows[2]) and rows[1] == rows[3], rows


def test_the_cpus_eager_forms_run_on_fake_tensors():
    """Under a ``FakeTensorMode`` (a memory estimate, an export) there is no value to read on the host:
    the amax pair and the stats pass take their forms that read nothing, where a read would raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(64, 32)
        logged, recorded = amax_pair(x)
        row, _, _ = stats_call(x, torch.tensor(2.0), torch.tensor(0.5), torch.tensor(4.0), E4M3)
    assert logged.shape == recorded.shape == () and row.shape == (N_WIDE,)
