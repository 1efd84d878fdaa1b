"""torch.compile as a first-class mode: monitoring a compiled model adds no graph break, logs the
rows an eager run logs, keeps emulated FP8 layers free of breaks and per-step recompiles, and names
layers as the eager model does. Real training steps, real compiles (inductor's C++ backend here)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch._dynamo

import fp8scope
from fp8scope.demo.tiny_gpt import GPTConfig, TinyGPT
from fp8scope.emulate import DelayedScaling, ScalingState, convert_to_fp8
from fp8scope.formats import get_format

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore:torch.compile.d code existed:RuntimeWarning")

CFG = dict(n_layers=1, d_model=32, n_heads=2, seq_len=16)


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    m = TinyGPT(GPTConfig(**CFG))
    if kind == "emulated":
        convert_to_fp8(m, recipe=DelayedScaling(amax_history_len=8))
    return m


def llama(layers: int = 1) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def batch(model, gen=None):
    return torch.randint(0, 64, (2, 16), generator=gen)


def loss_of(model, idx):
    out = model(idx)
    logits = out.logits if hasattr(out, "logits") else out
    return logits.float().logsumexp(-1).mean()


def graph_breaks(model, tmp_path, monitored: bool) -> tuple[int, int]:
    mon = None
    if monitored:
        mon = fp8scope.Monitor(model, tmp_path / "explain", every=50, detect=False)
        loss_of(model, batch(model)).backward()  # step 0 (full stats) eagerly: keys exist, states pending
        mon.step()
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(lambda idx: loss_of(model, idx))(batch(model))
    finally:
        if mon is not None:
            mon.close()
    return ex.graph_count, ex.graph_break_count


@pytest.mark.parametrize("kind", ["whatif", "emulated", "llama"])
def test_monitoring_a_compiled_model_adds_no_graph_break(tmp_path, kind):
    make = llama if kind == "llama" else (lambda: tiny(kind))
    plain = graph_breaks(make(), tmp_path, monitored=False)
    monitored = graph_breaks(make(), tmp_path, monitored=True)
    assert monitored == plain, (plain, monitored)
    if kind != "llama":
        assert plain == (1, 0)  # our own layers, emulated FP8 included, trace as one graph


def test_emulated_layers_trace_where_dynamo_cannot_ask_about_autocast(tmp_path, monkeypatch):
    """Dynamo in torch 2.11 cannot trace ``torch.amp.is_autocast_available`` (this torch folds it to a
    constant): asked in the emulated layers' forward and backward, it broke the demo model's graph
    18 times on an H200. Here the query is made as opaque to dynamo as 2.11 has it."""
    opaque = torch._dynamo.disable(torch.amp.is_autocast_available)
    monkeypatch.setattr(torch.amp, "is_autocast_available", opaque)
    assert graph_breaks(tiny("emulated"), tmp_path, monitored=True) == (1, 0)


def test_compiled_emulated_layers_switch_autocast_off_only_under_autocast():
    """Without the user's autocast the emulated layers' graph holds no autocast switch, which AOT
    autograd's cache refuses (a restart would trace the model again); under it, dynamo guards on the
    autocast state and the compiled layers still run their GEMMs in their own dtypes, as eager ones."""
    def two_layers():
        torch.manual_seed(0)
        return convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)),
                              DelayedScaling(amax_history_len=4))

    eager, model, x = two_layers(), two_layers(), torch.randn(4, 32)
    for m in (eager, model):
        m(x).sum().backward()  # the scaling states are made at a layer's first call
    graphs = []

    def keep(gm, _examples):
        graphs.append(gm)
        return gm.forward

    def switches(gm) -> int:
        return sum("_enter_autocast" in str(n.target) for n in gm.graph.nodes)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=keep)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    assert len(graphs) == 1 and switches(graphs[0]) == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), eager(x)
    assert len(graphs) == 2 and switches(graphs[1]) > 0
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


def train(model, run_dir, steps: int, compiled: bool, every: int = 3):
    model = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with fp8scope.Monitor(model, run_dir, every=every, detect=False) as mon:
        for _ in range(steps):
            loss = loss_of(model, batch(model, gen))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
    return fp8scope.load_run(run_dir).tensors().sort_values(["step", "order"]).reset_index(drop=True)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since its counters were cleared: a recompile is one more. (This
    torch keeps no ``counters["recompiles"]``: a test asserting that one is empty cannot fail.)"""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_whatif_run_logs_the_eager_rows_without_recompiles(tmp_path):
    eager = train(tiny("whatif"), tmp_path / "eager", steps=7, compiled=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train(tiny("whatif"), tmp_path / "compiled", steps=7, compiled=True)
    assert compiled_graphs() == 1  # compiled once, for all 7 steps
    keys = ["step", "layer", "tensor", "full", "calls", "numel"]
    assert (eager[keys].values == compiled[keys].values).all()  # same rows, same order, no _orig_mod.
    for col in ("amax", "scale", "scale_inv", "expected_amax"):
        torch.testing.assert_close(torch.tensor(compiled[col].values), torch.tensor(eager[col].values),
                                   rtol=1e-4, atol=0)
    assert set(compiled.source) == {"whatif"} and compiled[compiled.full].overflow.notna().all()


@pytest.mark.parametrize("kind", ["whatif", "emulated"])
def test_a_compiled_model_with_a_graph_break_trains_monitored_and_logs_the_eager_rows(tmp_path, kind):
    """A user's compiled model is often several graphs (a break anywhere). With two micro-batches
    whose forwards both run before their backward, taps of four compiled forwards and backwards run
    interleaved. The taps wrote one shared sink tensor, which a backward took from its forward and
    autograd checked: the user's first backward failed ("modified by an inplace operation"). Now
    each step trains and the run logs the rows an eager run logs."""

    def run(compiled: bool, path):
        model = tiny(kind)
        model.blocks[0].mlp.register_forward_pre_hook(lambda mod, args: torch._dynamo.graph_break())
        return trained_rows(model, torch.compile(model) if compiled else model, path, steps=4, every=3, micro=2)

    eager = run(False, tmp_path / "eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run(True, tmp_path / "compiled")
    assert compiled_graphs() >= 2  # the break is there
    assert len(compiled) == 4 * 6 * 3 and (compiled.calls == 2).all()
    assert_same_rows(compiled, eager)


@pytest.mark.parametrize("recipe, in_graph", [("current", False), ("delayed", True)])
def test_a_compiled_backwards_gradient_rows_are_the_eager_ones(tmp_path, monkeypatch, recipe, in_graph):
    """A compiled backward hands the gradient's scales to the emulated layer's tap, and its amaxes
    where the graph measures them (``amax.fused_when_traced``: an accelerator's; ``in_graph`` makes
    the CPU do it too). They are the graph's intermediates, whose memory inductor gives to later
    values once the tap has run, while the state and the step's rows keep them: under current
    scaling (the gradient's own scales, measured in the graph on every device) a compiled model's
    gradient rows logged other layers' scales, and with the amaxes measured in the graph, delayed
    scaling logged and recorded other layers' amaxes. Two micro-batches and a graph break, as
    above."""
    from fp8scope.emulate import CurrentScaling
    from fp8scope.emulate import amax as amax_module
    from fp8scope.emulate import linear as linear_module

    if in_graph:
        for module in (amax_module, linear_module):
            monkeypatch.setattr(module, "fused_when_traced", lambda device: True)

    def run(compiled: bool, path):
        torch.manual_seed(0)
        model = TinyGPT(GPTConfig(**CFG))
        convert_to_fp8(model, recipe=CurrentScaling() if recipe == "current" else DelayedScaling(amax_history_len=8))
        model.blocks[0].mlp.register_forward_pre_hook(lambda mod, args: torch._dynamo.graph_break())
        return trained_rows(model, torch.compile(model) if compiled else model, path, steps=4, every=3, micro=2)

    eager = run(False, tmp_path / "eager")
    torch._dynamo.reset()
    compiled = run(True, tmp_path / "compiled")
    assert (compiled.tensor == "gradient").sum() == 4 * 6 and (compiled.calls == 2).all()
    assert_same_rows(compiled, eager)


def test_a_llama_compiled_block_by_block_trains_monitored_and_logs_the_eager_rows(tmp_path):
    """Compiling each decoder layer apart is how FSDP2 training compiles (torchtitan): one graph per
    layer, the next layer's forward running between a layer's forward and its backward. With the
    taps writing a shared sink, the first backward failed."""

    def run(compiled: bool, path):
        model = llama(layers=2)
        if compiled:
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = torch.compile(layer)
        return trained_rows(model, model, path, steps=3, every=2)

    eager = run(False, tmp_path / "eager")
    torch._dynamo.reset()
    compiled = run(True, tmp_path / "compiled")
    assert len(compiled) > 0 and set(compiled.tensor) == {"activation", "weight", "gradient"}
    assert_same_rows(compiled, eager)


def test_a_monitored_compiled_models_graphs_come_from_inductors_cache_when_compiled_again(tmp_path):
    """Inductor's FX graph cache serves a monitored model's forward and backward graphs, as it does
    an unmonitored model's: a restarted job does not compile them again. The backward's taps were an
    ordered effect, and the cache refuses every graph holding one ("Can't cache HigherOrderOperator:
    with_effects"), so every process compiled every monitored backward, and an emulated model's
    backward, from scratch. Here ``torch._dynamo.reset()`` makes the same monitored model compile
    again (the same taps: a new process registers its taps under the same ids)."""
    from tests.conftest import fx_cache_when_compiled_again

    model = tiny("emulated")
    cache, rows = fx_cache_when_compiled_again(torch.compile(model), tmp_path / "r",
                                               lambda run: loss_of(run, batch(model)).backward())
    assert cache == {"fxgraph_cache_hit": 2}, cache  # the forward and the backward
    assert (rows.tensor == "gradient").sum() == 6 * 6 and rows.amax.notna().all()


def test_where_torch_cannot_mark_an_effect_the_backward_taps_keep_the_shared_sink(tmp_path, monkeypatch):
    """A torch without ``torch.library``'s effect registration: a backward's taps write the shared
    sink as before (dropping them would drop an emulated layer's gradient amax, and its scaling with
    it), a model that is one graph logs every gradient, and the monitor says what can fail."""
    from fp8scope import graph_taps

    monkeypatch.setattr(graph_taps, "GRAD_KEPT_AS", None)
    model = tiny("emulated")
    with pytest.warns(RuntimeWarning, match="cannot mark an op as an effect"):
        rows = trained_rows(model, torch.compile(model), tmp_path / "r", steps=3, every=2)
    assert len(rows) == 3 * 6 * 3 and (rows.tensor == "gradient").sum() == 3 * 6 and rows.amax.notna().all()


def trained_rows(model, target, path, steps: int, every: int, micro: int = 1):
    """Train ``target`` (``model``, or it compiled) monitored, with SGD; ``micro`` micro-batches a
    step, whose forwards all run before their one backward. The run's rows, in logged order."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with fp8scope.Monitor(target, path, every=every, detect=False) as mon:
        for _ in range(steps):
            sum(loss_of(target, batch(model, gen)) / micro for _ in range(micro)).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return fp8scope.load_run(path).tensors().sort_values(["step", "order"]).reset_index(drop=True)


def assert_same_rows(compiled, eager) -> None:
    """The rows an eager run logs: the same tensors in the same order, values as close as compiled
    numerics are to eager ones."""
    keys = ["step", "layer", "tensor", "full", "calls", "numel"]
    assert len(compiled) == len(eager) and (eager[keys].values == compiled[keys].values).all()
    for col in ("amax", "scale", "scale_inv", "expected_amax"):
        torch.testing.assert_close(torch.tensor(compiled[col].values), torch.tensor(eager[col].values),
                                   rtol=1e-4, atol=0)


@pytest.fixture
def fresh_families(monkeypatch):
    """The compiled families' caches of eager functions as a fresh process has them: empty (other
    tests in this process filled them, which would hide a guard on their contents)."""
    from fp8scope import compiled

    for family in compiled._ALL:
        monkeypatch.setattr(family, "_eager", {})
        monkeypatch.setattr(family, "_fallbacks", {})


def test_compiled_emulated_layers_keep_te_scaling_and_do_not_recompile(tmp_path, fresh_families):
    """Emulated FP8 under compile: one compile for every step (the scales, and the flag that says an
    update is due, are tensors), and every logged scale is the one TE's delayed scaling derives from
    the logged amaxes. There were three: step 0 is the only forward with no update due, and the
    trace branched on the states' Python flags (``ScalingState._set_flags``); and the amax and
    update functions' caches, filled during the first trace, failed the guard on their contents
    (``CompiledFn.traced``)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    df = train(tiny("emulated"), tmp_path / "r", steps=8, compiled=True, every=4)
    assert compiled_graphs() == 1
    assert len(df) == 8 * 6 * 3 and set(df.source) == {"emulated"}  # qkv, proj, gate, up, down, lm_head
    recipe = DelayedScaling(amax_history_len=8)
    for (layer, role), rows in df.groupby(["layer", "tensor"]):
        ref = ScalingState(recipe, get_format("e5m2" if role == "gradient" else "e4m3"))
        for amax, scale in zip(rows.amax, rows.scale):
            assert ref.begin(torch.tensor([amax])).scale.item() == scale, (layer, role)


def test_a_compiled_emulated_llama_with_micro_batches_compiles_only_at_its_first(tmp_path, fresh_families):
    """A ``transformers`` Llama in emulated FP8, compiled and monitored, two micro-batches a step
    (full stats every third step): whatever graphs its first micro-batch compiles serve every later
    one. Its second micro-batch is the first forward with an update due, which compiled the model a
    second time when the trace branched on the states' Python flags."""
    model = llama()
    convert_to_fp8(model, recipe=DelayedScaling(amax_history_len=8))
    run = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    first = None
    with fp8scope.Monitor(run, tmp_path / "r", every=3, detect=False) as mon:
        for _ in range(4):
            for _ in range(2):
                (loss_of(run, batch(run, gen)) / 2).backward()
                first = compiled_graphs() if first is None else first
            opt.step()
            opt.zero_grad()
            mon.step()
    assert first >= 1 and compiled_graphs() == first, (first, compiled_graphs())
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert set(df.source) == {"emulated"} and (df.calls == 2).all() and df.step.nunique() == 4


def test_a_monitor_adds_at_most_one_kernel_to_a_compiled_emulated_step(tmp_path):
    """The monitor's taps are opaque calls in the graph, which inductor orders its fused kernels
    around. One between an emulated layer's two FP8 round trips split them into kernels of their own
    (a forward's 6 C++ kernels became 9; on a GPU, launches), and one before the gradient's scale
    update split that off too. The layer now reports its operands after both round trips and the
    update: a monitored training step (forward and backward, after the first steps) compiles to
    the unmonitored step's kernels and one more, in the forward (7 and 7 where the unmonitored
    step has 6 and 7; the update after the taps gave 2 more). The backward's taps are ordered
    effects (``graph_taps``), which cost none here; as writes of the shared sink they cost one."""
    from torch._inductor.utils import run_and_get_code

    kernels, taps = {}, {}
    for monitored in (False, True):
        torch._dynamo.reset()
        model = tiny("emulated")
        compiled = torch.compile(model)
        mon = fp8scope.Monitor(compiled, tmp_path / "k", every=10**6, detect=False) if monitored else None

        def step():
            loss_of(compiled, batch(model)).backward()  # noqa: B023
            if mon is not None:  # noqa: B023
                mon.step()  # noqa: B023

        try:
            step()  # the first steps: nothing recorded yet, then an update due
            step()
            _, codes = run_and_get_code(step)
        finally:
            if mon is not None:
                mon.close()
        code = "\n".join(codes)
        taps[monitored] = code.count("torch.ops.fp8scope.observe")
        kernels[monitored] = len(re.findall(r"async_compile\.(?:cpp_pybinding|cpp|triton)\(", code))
    assert taps[True] > taps[False], taps  # the monitor's taps are in the graph (the layers' own too)
    assert kernels[False] <= kernels[True] <= kernels[False] + 1, kernels


def test_torchao_float8_linear_under_compile(tmp_path):
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from tests.conftest import MLP

    torch.manual_seed(0)
    m = MLP(d=16, h=32, out=16)
    convert_to_float8_training(m, config=Float8LinearConfig(emulate=True))
    compiled = torch.compile(m)
    x = torch.randn(8, 16)
    torch._dynamo.utils.counters.clear()
    with fp8scope.Monitor(compiled, tmp_path, every=2, detect=False) as mon:
        for _ in range(3):
            compiled(x).pow(2).mean().backward()
            mon.step()
    assert compiled_graphs() == 1  # full and cheap steps alike: compiled once
    df = fp8scope.load_run(tmp_path).tensors()
    assert set(df.source) == {"torchao"} and len(df) == 3 * 9 and set(df.layer) == {"up", "down", "head"}
    assert (df.amax * df.scale <= df.fp8_max * (1 + 1e-6)).all()


def test_a_model_compiled_before_the_monitor_attached_is_still_monitored(tmp_path):
    """Dynamo does not guard on hooks added after compilation: a graph traced before the monitor
    attached (here, another instance of the class, compiled and run first) would log nothing. The
    monitor resets dynamo once, with a warning, so the hooks are traced."""
    other = torch.compile(tiny("whatif"))
    loss_of(other, batch(other)).backward()
    model = torch.compile(tiny("whatif"))
    with pytest.warns(RuntimeWarning, match="dynamo was reset"):
        mon = fp8scope.Monitor(model, tmp_path / "r", every=2, detect=False)
    with mon:
        for _ in range(2):
            loss_of(model, batch(model)).backward()
            mon.step()
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 2 * 6 * 3


def test_an_unmonitored_instance_compiled_first_does_not_hide_the_hooks(tmp_path):
    """A baseline instance of the same class compiled and run after the monitor attached: with
    dynamo's default it would share its hook-less graph; the monitor turns hook guards on."""
    torch._dynamo.reset()
    monitored, baseline = torch.compile(tiny("whatif")), torch.compile(tiny("whatif"))
    with fp8scope.Monitor(monitored, tmp_path / "r", every=2, detect=False) as mon:
        loss_of(baseline, batch(baseline)).backward()  # compiles first, no hooks
        for _ in range(2):
            loss_of(monitored, batch(monitored)).backward()
            mon.step()
    assert len(fp8scope.load_run(tmp_path / "r").tensors()) == 2 * 6 * 3


def test_compiling_the_stats_never_runs_beside_the_training_thread(tmp_path, monkeypatch):
    """The stats pass compiles ahead in a child process, never in the training process beside its
    training: torch's tracing replaces ``nn.Module.__call__`` for every thread and sets FX's global
    tracing flag, so a helper thread's compile ran the training thread's module calls through its
    tracer, and a compiled model raised "Detected that you are using FX to symbolically trace a
    dynamo-optimized function" (a compiled what-if model with ``FP8SCOPE_COMPILE=1``, then the
    default on GPUs, ended at its second step). Here the model trains while a child compiles, this
    process traces nothing, and the child's code is called directly once loaded."""
    from fp8scope import compiled
    from fp8scope.capture.stats import FULL_STATS

    monkeypatch.setenv("FP8SCOPE_COMPILE", "ahead")  # the default's behaviour on a GPU, here on the CPU
    torch._dynamo.reset()
    model = torch.compile(tiny("whatif"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keys = [("cpu", torch.float32, fmt, False, False) for fmt in ("e4m3", "e5m2")]
    for k in keys:
        FULL_STATS.forget(k)  # compiled here by a test before, perhaps
    traced = compiled.traces
    with fp8scope.Monitor(model, tmp_path / "r", every=1, detect=False) as mon:
        for step in range(3):
            loss = loss_of(model, batch(model))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
            assert all(k in FULL_STATS._ahead for k in keys), step  # asked of a child at the first full step
            if step == 1:
                assert all(FULL_STATS.ensure(k, timeout=300) for k in keys), FULL_STATS.failures
                assert all(FULL_STATS.direct(k) for k in keys), FULL_STATS.not_direct
    assert compiled.traces == traced, "the training process traced"
    df = fp8scope.load_run(tmp_path / "r").tensors()
    assert len(df) == 3 * 6 * 3 and df.overflow.notna().all()
