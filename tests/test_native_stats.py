"""The one-pass CPU stats kernel (fp8scope/native/fused_stats.c) against torch: its FP8 rounding bit for bit
against torch's own cast, its stats against the torch formulation, in training, after fork(),
and the fallback when it cannot be built."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8scope
from fp8scope import native
from fp8scope.capture.stats import _emin, full_stats
from fp8scope.emulate import DelayedScaling, convert_to_fp8
from fp8scope.formats import get_format
from fp8scope.schema import FIELD_INDEX
from tests.conftest import PYTHON, ROOT, train

E4M3, E5M2 = get_format("e4m3"), get_format("e5m2")
COUNTS = ("numel", "zeros", "nonfinite", "overflow", "underflow", "saturated")


@pytest.fixture(scope="module")
def lib():
    lib = native.kernel()
    if lib is None:
        if native._compiler() is None:
            pytest.skip("no C compiler")
        pytest.fail(f"kernel did not build: {native._state['error']}")
    return lib


def kernel_quant_dequant(lib, x: torch.Tensor, s: float, inv: float, fmt) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.fp8s_quant_dequant(x.data_ptr(), x.numel(), s, inv, fmt.max, _emin(fmt), fmt.mantissa_bits, out.data_ptr())
    return out


def torch_quant_dequant(x: torch.Tensor, s: float, inv: float, fmt) -> torch.Tensor:
    y = (x * torch.tensor(s, dtype=torch.float32)).clamp(-fmt.max, fmt.max)
    return y.to(fmt.dtype).float() * torch.tensor(inv, dtype=torch.float32)


def grid_and_ties(fmt) -> torch.Tensor:
    """Every non-negative finite FP8 code, the midpoints between neighbours (the ties), and one
    float32 ulp either side of each midpoint."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    codes = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values
    mids = (codes[1:] + codes[:-1]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    v = torch.cat([codes, mids, up, down, codes[-1:] * 1.03, codes[-1:] * 4])
    return torch.cat([v, -v])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("s", [1.0, 3.7, 1 / 3, 2.0 ** 12])
def test_rounding_matches_torch_cast_bit_for_bit(lib, fmt, s):
    inv = float(np.float32(1 / s))
    sweep = torch.arange(0, 2 ** 32, 7919, dtype=torch.int64).to(torch.int32).view(torch.float32)
    for x in (grid_and_ties(fmt) / s, sweep, grid_and_ties(fmt)):
        got = kernel_quant_dequant(lib, x, s, inv, fmt)
        want = torch_quant_dequant(x, s, inv, fmt)
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), (x[~same][:5], got[~same][:5], want[~same][:5])


def both_paths(*args, **kw) -> tuple[dict, dict]:
    res = []
    for on in (True, False):
        old = native.set_enabled(on)
        try:
            v = full_stats(*args, **kw)
        finally:
            native.set_enabled(old)
        res.append({k: float(v[i]) for k, i in FIELD_INDEX.items()})
    return res[0], res[1]


def assert_same(a: dict, b: dict) -> None:
    for k in a:
        if k in ("sq_err", "sq_signal"):  # the torch path sums float32 squares, the kernel float64
            if not b[k] < 3e38 / 4:  # past float32's range only the kernel's double sum is right
                assert a[k] >= 3e38 / 8, k
                continue
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-30), k
        else:
            assert a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])), (k, a[k], b[k])


values = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vals=st.lists(values, min_size=1, max_size=300), dtype=st.sampled_from([torch.float32, torch.bfloat16,
       torch.float16]), scale=st.floats(1e-4, 1e4).map(lambda v: float(np.float32(v))),
       fmt=st.sampled_from([E4M3, E5M2]))
def test_kernel_and_torch_path_agree_on_any_values(lib, vals, dtype, scale, fmt):
    x = torch.tensor(vals, dtype=torch.float32).to(dtype)
    with np.errstate(over="ignore"):
        inv = float(np.float32(1 / scale))
    a, b = both_paths(x, torch.tensor(scale), torch.tensor(inv), 1.0, fmt)
    assert_same(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [70_000, 1_500_003])  # below and above the one-thread cutoff; odd tails
def test_large_tensors_agree_threaded(lib, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 12, (n,), generator=g).float())).to(dtype)
    x[::9973] = 0
    x[17] = math.nan
    x[n - 1] = -math.inf
    for fmt in (E4M3, E5M2):
        a, b = both_paths(x, torch.tensor(7.5), torch.tensor(float(np.float32(1 / 7.5))), 1.0, fmt)
        assert_same(a, b)
        assert a["nonfinite"] == 2 and math.isnan(a["amax"])


def test_per_row_scales_deq_and_non_contiguous_agree(lib):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 257, generator=g) * torch.logspace(-5, 5, 300)[:, None]
    scale = (E4M3.max / x.abs().amax(dim=1, keepdim=True)).float()
    a, b = both_paths(x, scale, 1 / scale, x.abs().amax(dim=1, keepdim=True), E4M3)
    assert_same(a, b)
    assert a["scale"] == float(scale.min()) and a["expected_amax"] == float(x.abs().max())
    xt = x.t()  # not contiguous
    a, b = both_paths(xt, torch.tensor(2.0), torch.tensor(0.5), 1.0, E5M2)
    assert_same(a, b)
    deq = torch_quant_dequant(x.reshape(-1), 3.0, float(np.float32(1 / 3)), E4M3).reshape(x.shape)
    a, b = both_paths(x, torch.tensor(3.0), torch.tensor(1 / 3), 1.0, E4M3, deq=deq)
    assert_same(a, b)


def test_training_logs_the_same_stats_on_both_paths(lib, tmp_path):
    """A real emulated-FP8 run with full stats every step, once per path: the logged tables agree."""
    from tests.conftest import MLP

    tables = []
    for on in (True, False):
        old = native.set_enabled(on)
        try:
            torch.manual_seed(0)
            model = convert_to_fp8(MLP(), recipe=DelayedScaling(amax_history_len=4))
            with fp8scope.Monitor(model, tmp_path / f"run-{on}", every=1, detect=False) as mon:
                train(model, mon, 6)
        finally:
            native.set_enabled(old)
        t = fp8scope.load_run(tmp_path / f"run-{on}").tensors().sort_values(["step", "layer", "tensor"])
        tables.append(t.reset_index(drop=True))
    a, b = tables
    assert len(a) == len(b) > 0
    for col in COUNTS + ("amax", "min_nonzero", "scale", "scale_inv"):
        assert (a[col] == b[col]).all(), col
    for col in ("qerr_mse", "sqnr_db"):
        assert np.allclose(a[col], b[col], rtol=1e-4, atol=1e-30, equal_nan=True), col


def test_kernel_works_in_a_forked_child(lib):
    """After fork(), GNU OpenMP's pool is unusable in the child (torch's own ops hang there too),
    which is why torch's DataLoader workers run with one thread. With one thread the kernel must
    not touch the pool: a forked worker can compute full stats."""
    code = (
        "import os, sys, torch\n"
        "from fp8scope import native\n"
        "from fp8scope.capture.stats import full_stats\n"
        "from fp8scope.formats import get_format\n"
        "assert native.kernel() is not None\n"
        "x = torch.randn(2_000_000)\n"
        "one = torch.tensor(1.0)\n"
        "full_stats(x, one, one, one, get_format('e4m3'))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    torch.set_num_threads(1)\n"
        "    v = full_stats(x, one, one, one, get_format('e4m3'))\n"
        "    os._exit(0 if float(v[2]) == 2_000_000 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    r = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_no_compiler_falls_back_to_torch_with_one_warning(tmp_path):
    code = (
        "import warnings, torch\n"
        "from fp8scope import native\n"
        "from fp8scope.capture.stats import full_stats\n"
        "from fp8scope.formats import get_format\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert native.kernel() is None\n"
        "    v = full_stats(torch.tensor([1.0, 0.0, 1e-9]), 1.0, 1.0, 1.0, get_format('e4m3'))\n"
        "assert float(v[3]) == 1 and float(v[6]) == 1, v\n"
        "msgs = [str(x.message) for x in w]\n"
        "assert len(msgs) == 1 and 'torch path' in msgs[0], msgs\n"
        "print(native.status())\n"
    )
    env = {**os.environ, "CC": "/bin/false-no-such-compiler", "PATH": str(tmp_path), "FP8SCOPE_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "unavailable" in r.stdout
    off = subprocess.run([sys.executable, "-c", "from fp8scope import native; print(native.status())"],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "FP8SCOPE_NATIVE": "0"})
    assert off.stdout.strip() == "off (FP8SCOPE_NATIVE=0)"


def test_whatif_full_steps_measure_the_amax_once_and_log_what_cheap_steps_log(lib, tmp_path):
    """Plain layers under delayed scaling: on full steps the state records the amax the full-stats
    pass measured. The scales and amaxes logged must be those of cheap steps (and of the torch path)."""
    from tests.conftest import MLP

    cols = ["step", "layer", "tensor", "amax", "scale", "scale_inv", "expected_amax"]
    tables = {}
    for name, every, on in (("full", 1, True), ("cheap", 10**9, True), ("torch", 1, False)):
        old = native.set_enabled(on)
        try:
            torch.manual_seed(0)
            model = MLP()
            with fp8scope.Monitor(model, tmp_path / name, every=every, detect=False,
                                  recipe=DelayedScaling(amax_history_len=3)) as mon:
                train(model, mon, 8)
        finally:
            native.set_enabled(old)
        t = fp8scope.load_run(tmp_path / name).tensors()
        tables[name] = t[cols].sort_values(cols[:3]).reset_index(drop=True)
    assert len(tables["full"]) == 8 * 9
    assert tables["full"].equals(tables["cheap"])
    assert tables["full"].equals(tables["torch"])
