"""CUDA paths: stats on the device (eager and compiled to Triton), pinned non-blocking transfer, the
what-if device bank, the emulated layer under torch.compile, real torchao FP8 GEMMs.

Marked ``gpu``: skipped on machines without CUDA (CI never has one).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import fp8scope
from fp8scope.emulate import DelayedScaling, convert_to_fp8
from tests.conftest import MLP, fx_cache_when_compiled_again

pytestmark = pytest.mark.gpu


def _train(model, mon, steps, d=16):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        loss = model(torch.randn(32, d, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss.detach())


def assert_logged_scales_replay(df, recipe) -> None:
    """Replaying each tensor's logged amaxes through one fresh ScalingState gives its logged scales."""
    from fp8scope.emulate import ScalingState
    from fp8scope.formats import get_format

    for (layer, role), rows in df.groupby(["layer", "tensor"]):
        ref = ScalingState(recipe, get_format("e5m2" if role == "gradient" else "e4m3"))
        rows = rows.sort_values("step")
        for amax, scale, scale_inv in zip(rows.amax, rows.scale, rows.scale_inv):
            want = ref.begin(torch.tensor([amax], dtype=torch.float32))
            assert (scale, scale_inv) == (want.scale.item(), want.scale_inv.item()), (layer, role)


def test_emulated_fp8_on_cuda_matches_cpu_semantics(tmp_path):
    torch.manual_seed(0)
    m = convert_to_fp8(MLP().cuda(), recipe=DelayedScaling(amax_history_len=4))
    with fp8scope.Monitor(m, tmp_path / "r", every=1) as mon:
        _train(m, mon, steps=5)
        # a step's rows and device scalars reach the host in one non-blocking copy into pinned memory
        payload = mon.collector.end_step({"loss": torch.ones((), device="cuda")})
        assert payload.ready is not None and payload.host.is_pinned()
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 5 * 9 and df.amax.notna().all()
    up = df[(df.layer == "up") & (df.tensor == "activation")].set_index("step")
    assert up.loc[1, "scale"] == pytest.approx(448 / up.loc[0, "amax"], rel=1e-5)


def _thread_cpu_seconds(name: str) -> float:
    """CPU seconds (user + system) the thread named ``name`` has used, from ``/proc``."""
    import threading

    tid = next(t.native_id for t in threading.enumerate() if t.name == name)
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_writer_sleeps_while_the_gpu_finishes_a_step(tmp_path):
    """A step's rows land when the GPU reaches the end of the step; the writer thread waits for them
    asleep (a blocking event), not spinning a core beside training for as long as the GPU is behind."""
    torch.manual_seed(0)
    m = MLP().cuda()
    with fp8scope.Monitor(m, tmp_path / "r", every=50, detect=False) as mon:
        _train(m, mon, steps=3)
        mon.flush()
        before = _thread_cpu_seconds("fp8scope-writer")
        for _ in range(2):  # cycles: how long this GPU takes for them (the second time at its working clock)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.cuda._sleep(200_000_000)
            torch.cuda.synchronize()
            cycles_per_s = 2e8 / (time.perf_counter() - t0)
        torch.cuda._sleep(int(1.5 * cycles_per_s))  # about 1.5 s of GPU time queued before the step's copy
        t0 = time.perf_counter()
        _train(m, mon, steps=1)
        mon.flush()  # returns once the writer has the step: after the GPU's sleep
        waited = time.perf_counter() - t0
        spent = _thread_cpu_seconds("fp8scope-writer") - before
    assert waited > 0.3, waited  # the writer did wait for the GPU
    assert spent < 0.25 * waited, (spent, waited)


@pytest.mark.parametrize("fp8", ["off", "delayed", "current", "mxfp8"])
def test_monitored_steps_make_no_host_sync(tmp_path, monkeypatch, fp8):
    """The demo model monitored (what-if, then emulated under delayed, current and MXFP8 scaling),
    its stats compiled and called directly (``sync``: compiled before the checked steps): 8 steps,
    2 of them full, with no synchronizing CUDA call. A sync a step lets the host no longer run ahead
    of the GPU: the next step's launches are then exposed, the whole of a launch-bound step's host
    time. (``tests/test_host_sync.py`` checks the same paths and more on the CPU, on "meta".)"""
    from fp8scope.demo import train
    from fp8scope.emulate import MXFP8BlockScaling

    monkeypatch.setenv("FP8SCOPE_COMPILE", "sync")
    setup = train.build(fp8="off" if fp8 == "mxfp8" else fp8, quiet=True, device="cuda")
    if fp8 == "mxfp8":  # a block recipe: the demo's options have none
        setup.recipe = MXFP8BlockScaling()
        convert_to_fp8(setup.model, setup.recipe, skip=["lm_head"])
        setup.optimizer = torch.optim.AdamW(setup.model.parameters(), lr=setup.args.lr)
    whatif = setup.recipe if fp8 in ("delayed", "current") else None  # the head's what-if recipe
    with fp8scope.Monitor(setup.model, tmp_path / "r", every=4, recipe=whatif) as mon:
        for step in range(6):  # compiles, allocator, cuBLAS: before the checked steps
            train.train_step(setup, step, mon)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(6, 14):
                    train.train_step(setup, step, mon)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, syncs[:10]


def test_whatif_scaling_follows_the_model_from_cpu_to_cuda(tmp_path):
    """Plain layers trained on the CPU (a CPU bank), then moved to CUDA: each tensor's
    delayed scaling goes on from the same history on the device, so replaying every logged amax
    through one fresh ScalingState gives every logged scale, before and after the move."""

    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    recipe = DelayedScaling(amax_history_len=3)
    with fp8scope.Monitor(m, tmp_path / "r", every=10**9, recipe=recipe, full_on_anomaly=0, detect=False) as mon:
        for step in range(8):
            if step == 4:
                m.cuda()  # the parameters move in place: the optimizer keeps them
            loss = m(torch.randn(32, 16, device="cuda" if step >= 4 else "cpu")).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 8 * 9 and set(df.source) == {"whatif"}
    assert_logged_scales_replay(df, recipe)


@pytest.mark.parametrize("micro", [1, 2])
def test_whatif_on_cuda_uses_the_device_bank(tmp_path, micro):
    """Plain layers on CUDA from the start: cheap steps go through the DeviceDelayedBank (one amax
    pass per capture, rows resolved at the step's end); replaying the logged amaxes gives the
    logged scales, and the rows keep the execution order."""
    from fp8scope.emulate.device_bank import DeviceDelayedBank

    torch.manual_seed(0)
    m = MLP().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    recipe = DelayedScaling(amax_history_len=3)
    with fp8scope.Monitor(m, tmp_path / "r", every=4, recipe=recipe, full_on_anomaly=0, detect=False) as mon:
        for _ in range(7):
            for _ in range(micro):
                (m(torch.randn(32, 16, device="cuda")).pow(2).mean() / micro).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        banks = list(mon.collector._device_banks.values())
        assert len(banks) == 1 and isinstance(banks[0], DeviceDelayedBank) and len(banks[0]) == 9
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 7 * 9 and set(df.calls) == {micro} and set(df[df.full].step) == {0, 4}
    step1 = df[df.step == 1].sort_values("order")
    assert list(zip(step1.layer, step1.tensor))[:2] == [("up", "activation"), ("up", "weight")]
    if micro == 1:
        assert_logged_scales_replay(df, recipe)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores (sm_89+)")
def test_torchao_real_fp8_gemms(tmp_path):
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import convert_to_float8_training
    torch.manual_seed(0)
    m = MLP(d=64, h=128, out=64).cuda().to(torch.bfloat16)
    convert_to_float8_training(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with fp8scope.Monitor(m, tmp_path / "r", every=1) as mon:
        for _ in range(3):
            loss = m(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)).float().pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            mon.step(loss=loss.detach())
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert set(df.source) == {"torchao"} and len(df) == 27
    assert (df.amax * df.scale <= df.fp8_max * (1 + 1e-3)).all()


@pytest.mark.parametrize("layout", ["per_tensor", "per_row", "recipes", "per_row_recipes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_stats_on_cuda_match_eager_and_cpu(dtype, layout):
    """The stats pass compiled to Triton gives the eager numbers, and the CPU's, on CUDA tensors,
    called without dynamo (but for block recipes, whose trace assumes the blocks divide the sides);
    other recipes are measured in the same graph as the fused stats."""
    import os

    from fp8scope.capture.stats import FULL_STATS, stats_call
    from fp8scope.formats import get_format

    torch.manual_seed(0)
    x = (torch.randn(1000, 257) * torch.logspace(-6, 3, 257)).to(dtype).cuda()
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    scale = torch.tensor(448 / 30.0, device="cuda")
    if layout.startswith("per_row"):  # with other recipes: the fused form, first compiled on a GPU here
        scale = torch.rand(1000, 1, device="cuda") * 20 + 0.5
    recipes = {"recipes": ("current", "block128"), "per_row_recipes": ("current", "bf16")}.get(layout, ())
    fmt = get_format("e4m3")
    call = lambda t, s: stats_call(t, s, 1 / s, 30.0, fmt, recipes=recipes)  # noqa: E731
    old = os.environ.get("FP8SCOPE_COMPILE")
    try:
        os.environ["FP8SCOPE_COMPILE"] = "0"
        eager, rec_e, mat_e = call(x, scale)
        os.environ["FP8SCOPE_COMPILE"] = "1"
        key = ("cuda", dtype, "e4m3", layout.startswith("per_row"), False)
        if recipes:
            key = (*key, recipes, "activation", False)
        assert FULL_STATS.ensure(key), FULL_STATS.failures
        compiled, rec_c, mat_c = call(x, scale)
        if not recipes:  # called without dynamo (fp8scope.compiled._Direct), and the call fit
            assert FULL_STATS.direct(key) and FULL_STATS._ready[key].rejected == 0, FULL_STATS.not_direct
    finally:
        os.environ["FP8SCOPE_COMPILE"] = old if old is not None else "0"
    cpu, _, mat_cpu = call(x.cpu(), scale.cpu())
    for got in (compiled.cpu(), cpu):
        same = torch.isclose(got, eager.cpu(), rtol=1e-6, equal_nan=True)
        assert bool(same.all()), (got, eager)
    assert float(rec_c) == float(rec_e)
    if recipes:
        for got in (mat_c.cpu(), mat_cpu):
            assert torch.allclose(got, mat_e.cpu(), rtol=1e-6, equal_nan=True), (got, mat_e)


def test_eager_stats_on_cuda_hold_a_few_copies_of_the_tensor(monkeypatch):
    """What runs on a GPU until the compiled pass is ready: the eager pass computes in place in its
    scratch tensors, so its peak memory stays within the bytes per element that
    ``tests/test_capture_budget.py`` counts on the CPU (about 21 for bf16), where a temporary per
    value took 55."""
    from fp8scope.capture.stats import stats_call
    from fp8scope.formats import get_format

    monkeypatch.setenv("FP8SCOPE_COMPILE", "0")
    x = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
    scale = torch.tensor(2.0, device="cuda")
    call = lambda: stats_call(x, scale, 1 / scale, torch.tensor(4.0, device="cuda"), get_format("e4m3"))  # noqa: E731
    call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    row = call()[0]
    torch.cuda.synchronize()
    assert (torch.cuda.max_memory_allocated() - base) / x.numel() <= 22
    assert float(row[8]) == x.numel()  # numel: the counts' float32 sums per row, then float64


def test_a_first_stats_call_inside_a_cuda_graph_capture_compiles_nothing():
    """A first call while the user captures a CUDA graph (hooks fire during capture) runs the eager
    ops into the graph and neither compiles nor asks for a compile there; its next call outside
    the capture asks a compile child, whose code (built on this process's device) is loaded and
    gives the same numbers."""
    import os

    from fp8scope.capture.stats import FULL_STATS, stats_call
    from fp8scope.formats import get_format

    x = torch.randn(256, 96, device="cuda", dtype=torch.float16)
    scale, fmt = torch.tensor(2.0, device="cuda"), get_format("e5m2")
    inv, expected = 1 / scale, torch.tensor(30.0, device="cuda")  # made before: a capture copies nothing in
    key = ("cuda", torch.float16, "e5m2", False, False)
    old = os.environ.get("FP8SCOPE_COMPILE")
    os.environ["FP8SCOPE_COMPILE"] = "1"
    try:
        assert not FULL_STATS.direct(key)  # a variant no other test compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            row, _, _ = stats_call(x, scale, inv, expected, fmt)
        assert not FULL_STATS.direct(key), "compiled inside a capture"
        graph.replay()
        assert not FULL_STATS.direct(key) and key not in FULL_STATS._ahead, "a compile asked for inside a capture"
        want, _, _ = stats_call(x, scale, inv, expected, fmt)  # asks a compile child, outside the capture
        assert FULL_STATS.ensure(key, timeout=600), FULL_STATS.failures  # its code, loaded on this device
        assert FULL_STATS.direct(key)
        again, _, _ = stats_call(x, scale, inv, expected, fmt)
        assert torch.allclose(again, want, rtol=1e-6, equal_nan=True), (again, want)
    finally:
        os.environ["FP8SCOPE_COMPILE"] = old if old is not None else "0"
    assert torch.allclose(row, want, rtol=1e-6, equal_nan=True), (row, want)


def test_emulated_layer_compiles_without_breaks_on_cuda():
    """Emulated FP8 layers under torch.compile on CUDA: one graph, no recompiles over steps."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    m = convert_to_fp8(MLP().cuda(), recipe=DelayedScaling(amax_history_len=4))
    x = torch.randn(32, 16, device="cuda")
    explain = dynamo.explain(m)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = torch.compile(m)
    for _ in range(3):  # the first step records with no update due, later ones update first: one graph
        compiled(x).pow(2).mean().backward()
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1


def _tiny_gpt_on_cuda(kind: str):
    from fp8scope.demo.tiny_gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    m = TinyGPT(GPTConfig(n_layers=2, d_model=64)).cuda()
    if kind == "emulated":
        convert_to_fp8(m, recipe=DelayedScaling(amax_history_len=16))
    return m


def _train_monitored_on_cuda(m, run, path, steps: int, inside=None):
    """``steps`` AdamW steps of ``run`` (``m``, compiled or not) monitored, full stats every third;
    ``inside(last_batch)`` is called with the monitor still attached. Its result and the rows."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with fp8scope.Monitor(run, path, every=3, detect=False) as mon:
        for _ in range(steps):
            idx = torch.randint(0, 64, (4, 32), device="cuda")
            loss = run(idx).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
        got = inside(idx) if inside is not None else None
    return got, fp8scope.load_run(path).tensors()


@pytest.mark.parametrize("kind", ["whatif", "emulated"])
def test_compiled_model_monitored_on_cuda(tmp_path, kind):
    """A torch.compile'd tiny GPT on CUDA (Triton): monitoring adds no graph break and logs every
    tensor of every step, with the stats pass compiled too."""
    import os

    import torch._dynamo as dynamo

    m = _tiny_gpt_on_cuda(kind)
    old = os.environ.get("FP8SCOPE_COMPILE")
    os.environ["FP8SCOPE_COMPILE"] = "1"
    try:
        explain, df = _train_monitored_on_cuda(
            m, torch.compile(m), tmp_path / "r", 6,
            inside=lambda idx: dynamo.explain(lambda i: m(i).float().logsumexp(-1).mean())(idx))
    finally:
        os.environ["FP8SCOPE_COMPILE"] = old if old is not None else "0"
    assert explain.graph_break_count == 0, explain.break_reasons
    n = len(m.linear_names()) * 3
    assert len(df) == 6 * n and df.amax.notna().all() and not df.layer.str.contains("_orig_mod").any()


def test_a_monitored_model_compiled_again_on_cuda_comes_from_inductors_cache(tmp_path):
    """The backward's taps are a side effect (``graph_taps``), so Triton's graphs of a monitored
    emulated model stay in inductor's FX graph cache, as on the CPU
    (``tests/test_compile_mode.py``): compiled again, each is a cache hit, and none bypasses it."""
    def step(run):
        run(torch.randint(0, 64, (4, 32), device="cuda")).float().logsumexp(-1).mean().backward()

    m = _tiny_gpt_on_cuda("emulated")
    cache, rows = fx_cache_when_compiled_again(torch.compile(m), tmp_path / "r", step)
    # the model's forward and backward (and any stats variant compiled in this process) are hits
    assert cache.get("fxgraph_cache_hit", 0) >= 2 and "fxgraph_cache_miss" not in cache, cache
    assert (rows.tensor == "gradient").sum() == 6 * len(m.linear_names()) and rows.amax.notna().all()


@pytest.mark.parametrize("kind", ["whatif", "emulated"])
def test_a_model_compiled_block_by_block_trains_monitored_on_cuda(tmp_path, kind):
    """Each block compiled apart (FSDP2's way), on CUDA with this torch's Triton: the backward's
    taps are side effects the compiler keeps (``graph_taps``; as writes of a shared sink they
    failed the first backward); every tensor of every step is logged."""
    m = _tiny_gpt_on_cuda(kind)
    for i, block in enumerate(m.blocks):
        m.blocks[i] = torch.compile(block)
    _, df = _train_monitored_on_cuda(m, m, tmp_path / "r", 4)
    n = len(m.linear_names()) * 3
    assert len(df) == 4 * n and df.amax.notna().all() and set(df.tensor) == {"activation", "weight", "gradient"}


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_a_compiled_emulated_backward_logs_the_eager_gradient_rows_on_cuda(tmp_path, recipe):
    """On an accelerator the compiled backward measures the gradient's amaxes in its graph (Triton's
    fused pair, ``amax.fused_when_traced``) and hands them, with the scales, to the layer's tap,
    which keeps a copy: inductor reuses their memory once the tap has run. Two micro-batches a step,
    whose forwards run before their backward: the compiled model logs the eager model's rows."""
    from fp8scope.demo.tiny_gpt import GPTConfig, TinyGPT
    from fp8scope.emulate import CurrentScaling

    def run(compiled: bool, path):
        torch.manual_seed(0)
        m = TinyGPT(GPTConfig(n_layers=2, d_model=64)).cuda()
        convert_to_fp8(m, recipe=CurrentScaling() if recipe == "current" else DelayedScaling(amax_history_len=16))
        target = torch.compile(m) if compiled else m
        gen = torch.Generator(device="cuda").manual_seed(1)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        with fp8scope.Monitor(target, path, every=3, detect=False) as mon:
            for _ in range(5):
                batches = [torch.randint(0, 64, (4, 32), device="cuda", generator=gen) for _ in range(2)]
                sum(target(idx).float().logsumexp(-1).mean() / 2 for idx in batches).backward()
                opt.step()
                opt.zero_grad()
                mon.step()
        return fp8scope.load_run(path).tensors().sort_values(["step", "order"]).reset_index(drop=True)

    eager = run(False, tmp_path / "eager")
    compiled = run(True, tmp_path / "compiled")
    keys = ["step", "layer", "tensor", "calls"]
    assert len(compiled) == len(eager) > 0 and (compiled[keys].values == eager[keys].values).all()
    assert (compiled.tensor == "gradient").any() and (compiled.calls == 2).all()
    # compiled and eager numerics drift apart over the steps (a few % by the fifth on a CPU); a
    # reused buffer's values were other layers', off by orders of magnitude
    for col in ("amax", "scale", "scale_inv", "expected_amax"):
        torch.testing.assert_close(torch.tensor(compiled[col].values), torch.tensor(eager[col].values),
                                   rtol=0.05, atol=0)


def _emulated_rows(recipe, device: str, tmp_path):
    """Three steps of an emulated-FP8 MLP on ``device`` from one seed, every step full."""
    torch.manual_seed(0)
    m = convert_to_fp8(MLP(d=128, h=256, out=128), recipe=recipe).to(device)
    xs = [torch.randn(64, 128) for _ in range(3)]
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with fp8scope.Monitor(m, tmp_path / device, every=1, detect=False) as mon:
        for x in xs:
            loss = m(x.to(device)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
    return fp8scope.load_run(tmp_path / device).tensors()


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8", "block", "nvfp4"])
def test_emulated_recipes_on_cuda_log_the_rows_the_cpu_logs(tmp_path, recipe):
    """Each emulated recipe is device-agnostic torch: on CUDA it logs the same rows as on the CPU,
    and the first step's forward operands (before any GEMM rounding can differ) the same amax and
    scale."""
    from fp8scope.emulate import CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

    make = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": CurrentScaling,
            "mxfp8": MXFP8BlockScaling, "block": Float8BlockScaling,
            "nvfp4": lambda: NVFP4BlockScaling(disable_rht=True)}[recipe]
    cpu, cuda = (_emulated_rows(make(), d, tmp_path) for d in ("cpu", "cuda"))
    key = ["step", "layer", "tensor", "order"]
    cpu, cuda = (df.sort_values(key).reset_index(drop=True) for df in (cpu, cuda))
    assert len(cuda) == len(cpu) > 0 and (cuda[key] == cpu[key]).all().all()
    assert cuda.amax.notna().all() and (cuda.nonfinite == 0).all()
    first = (cpu.step == 0) & (cpu.layer == "up") & (cpu.tensor != "gradient")
    assert torch.allclose(torch.tensor(cuda[first].amax.values), torch.tensor(cpu[first].amax.values), rtol=1e-6)
    assert torch.allclose(torch.tensor(cuda[first].scale.values), torch.tensor(cpu[first].scale.values), rtol=1e-6)
    close = torch.isclose(torch.tensor(cuda.amax.values), torch.tensor(cpu.amax.values), rtol=0.05)
    assert bool(close.all()), cuda[~close.numpy()]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_compiled_real_fp8_gemms(tmp_path, recipe):
    """torchao's intended mode: Float8Linear under torch.compile, real FP8 GEMMs, monitored without
    graph breaks, every cast logged with torchao's own scale, no ``_orig_mod.`` in a name."""
    import torch._dynamo as dynamo

    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    m = MLP(d=64, h=128, out=64).cuda().to(torch.bfloat16)
    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
    compiled = torch.compile(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with fp8scope.Monitor(compiled, tmp_path / "r", every=1, detect=False) as mon:
        for _ in range(3):
            loss = compiled(x).float().pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
            mon.step(loss=loss.detach())
        explain = dynamo.explain(lambda i: m(i).float().pow(2).mean())(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert set(df.source) == {"torchao"} and set(df.layer) == {"up", "down", "head"}
    assert set(df.step) == {0, 1, 2} and df.amax.notna().all()
    assert (df.amax * df.scale <= df.fp8_max * (1 + 1e-3)).all()


def _moe_rows_on(tmp_path, device: str, implementation: str, every: int, check_sync: bool = False,
                 compiled: bool = False):
    """A Mixtral of ``tests/test_experts.py`` trained 6 steps on ``device`` (``compiled``: through
    ``torch.compile(fullgraph=True)``): its experts' rows, and fp8scope's synchronizing calls in steps
    3-5 (``check_sync``)."""
    from tests.test_experts import _rows, build

    name = f"{device}-{implementation}-{every}{'-compiled' if compiled else ''}"
    model = build("mixtral", implementation).to(device)
    mon = fp8scope.Monitor(model, tmp_path / name, every=every, detect=False)
    forward = torch.compile(model, fullgraph=True) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(1)
    caught = []
    for step in range(6):
        ids = torch.randint(0, 96, (4, 16), generator=g).to(device)
        watched = check_sync and step >= 3
        if watched:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                loss = forward(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                mon.step(loss=loss.detach())
            caught += [f"{w.filename}:{w.lineno}" for w in got if "synchroniz" in str(w.message)
                       and "fp8scope" in w.filename]
        finally:
            if watched:
                torch.cuda.set_sync_debug_mode(0)
    mon.close()
    return _rows(fp8scope.load_run(tmp_path / name).tensors()), caught


def test_compiled_moe_experts_on_cuda_log_the_cpus_rows_and_their_cheap_steps_do_not_sync(tmp_path):
    """Compiled by inductor for the GPU (Triton), the grouped and batched experts' graph taps still
    find their stacks by address and log the eager CPU rows, and their cheap steps make no
    synchronizing call of fp8scope's."""
    pytest.importorskip("transformers")
    ref, _ = _moe_rows_on(tmp_path, "cpu", "eager", 1)
    for implementation in ("grouped_mm", "batched_mm"):
        got, _ = _moe_rows_on(tmp_path, "cuda", implementation, 2, compiled=True)
        assert list(got.index) == list(ref.index), implementation
        assert torch.allclose(torch.tensor(got.to_numpy()), torch.tensor(ref.to_numpy()), rtol=1e-3), implementation
    _, syncs = _moe_rows_on(tmp_path, "cuda", "grouped_mm", 100, check_sync=True, compiled=True)
    assert not syncs, syncs[:10]


def test_moe_experts_on_cuda_log_the_cpus_rows_and_their_cheap_steps_do_not_sync(tmp_path):
    """A Mixtral's experts (3-D weights) on CUDA under grouped_mm and the eager loop log the rows
    the CPU logs; the grouped cheap steps' capture (a segmented reduction for all experts) makes no
    synchronizing call of fp8scope's (transformers' own routing may)."""
    pytest.importorskip("transformers")
    ref, _ = _moe_rows_on(tmp_path, "cpu", "eager", 1)
    for implementation in ("eager", "grouped_mm"):
        got, _ = _moe_rows_on(tmp_path, "cuda", implementation, 1)
        assert list(got.index) == list(ref.index)
        assert torch.allclose(torch.tensor(got.to_numpy()), torch.tensor(ref.to_numpy()), rtol=1e-3)
    _, syncs = _moe_rows_on(tmp_path, "cuda", "grouped_mm", 100, check_sync=True)
    assert not syncs, syncs[:10]
