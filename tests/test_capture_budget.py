"""The GPU cost budgets of capture, in proxies that are deterministic on a CPU (timings live in
benchmarks/capture_cost.py):

- eager full stats: at most 40 aten ops per tensor, whatever its size (no chunking);
- compiled full stats: at most 3 generated kernels per tensor (inductor's C++ here, Triton on CUDA);
- a cheap step: at most 2 aten ops per monitored tensor, plus a constant, on the tiny GPT;
- a cheap step's host work: at most 7 calls of fp8scope's Python functions per monitored tensor,
  plus a constant (a small model on a GPU is bound by its host: an H100 spent about 73 us of host
  time a capture, docs/benchmarks.md);
- memory: the bytes the eager passes allocate per element of the tensor they read.

Ops are counted with a TorchDispatchMode; views (no kernel on any device) are left out.
"""

from __future__ import annotations

import math
import re
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp8scope
from fp8scope.capture import stats as stats_mod
from fp8scope.demo import train
from tests.conftest import fp8scope_python_calls
from fp8scope.formats import get_format


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__ not in ("detach", "alias"):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def eager_stats(monkeypatch):
    monkeypatch.setenv("FP8SCOPE_COMPILE", "0")


@pytest.mark.parametrize("shape", [(64, 64), (512, 1024), (4096, 1024)])
@pytest.mark.parametrize("per_row", [False, True])
def test_eager_full_stats_stay_within_40_ops_whatever_the_size(shape, per_row):
    x = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
    scale = torch.full((shape[0], 1), 50.0) if per_row else torch.tensor(50.0)
    scale_inv, expected = 1 / scale, torch.tensor(8.96)
    fmt = get_format("e4m3")
    stats_mod.stats_call(x, scale, scale_inv, expected, fmt)  # first call: format constants cached
    with OpCounter() as c:
        stats_mod.stats_call(x, scale, scale_inv, expected, fmt)
    assert len(c.ops) <= 40, c.ops


class ByteCounter(TorchDispatchMode):
    """The bytes of the tensors the ops allocate (outputs of ops that neither write in place nor
    into an ``out=`` tensor, views left out): on a CPU each large one is fresh memory from the OS,
    on a GPU memory the training may need."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_deq", [False, True])
def test_eager_full_stats_allocate_five_float32_copies_at_most(dtype, with_deq):
    """The eager pass computes in place in its scratch tensors: about 21 bytes per element at most
    (two float32 copies, a block of two masks that later holds the float64 copy, the cast's FP8 copy
    and a bf16 tensor's float32 copy, and a few values per row), where a temporary per value took 34
    to 55."""
    fmt = get_format("e4m3")
    x = torch.randn(512, 384, dtype=dtype)
    scale = torch.tensor(2.0)
    deq = (x.float() * 2).to(fmt.dtype).float() / 2 if with_deq else None
    stats_mod.stats_call(x, scale, 1 / scale, torch.tensor(4.0), fmt, deq=deq)
    with ByteCounter() as c:
        stats_mod.stats_call(x, scale, 1 / scale, torch.tensor(4.0), fmt, deq=deq)
    assert c.bytes / x.numel() <= 21.5, c.bytes / x.numel()


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("has_deq", [False, True])
def test_the_general_pass_stays_within_40_ops_whatever_the_size(per_row, has_deq):
    """The pass an accelerator runs eagerly (where a value cannot be read without a sync), and a CPU for
    a tensor with a NaN: a bf16 tensor's float32 copy and the general form, at most 40 ops at any size.
    Its seven counts take four sums (two masks a sum)."""
    fmt = get_format("e4m3")
    for shape in ((64, 64), (2048, 1024)):
        x = torch.randn(*shape, dtype=torch.bfloat16)
        x[1, 1] = math.nan
        scale = torch.full((shape[0], 1), 50.0) if per_row else torch.tensor(50.0)
        scale_inv, expected = 1 / scale, torch.tensor(8.96)
        deq = (x.float() * 50).to(fmt.dtype).float() / 50 if has_deq else None
        general = stats_mod._make_general(("cpu", x.dtype, "e4m3", per_row, has_deq))
        with OpCounter() as c:
            general(x.to(torch.float32), scale, scale_inv, expected, deq)
        assert len(c.ops) <= 40, (shape, len(c.ops), c.ops)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_deq", [False, True])
def test_the_cpus_finite_pass_allocates_two_float32_copies(dtype, with_deq):
    """On the CPU a finite tensor's pass (``stats._make_finite_row``) works in one float32 copy (the
    magnitudes, then the scaled magnitudes, the error and its squares) and one mask: 8 bytes per
    element, plus the cast's FP8 copy without a decoded copy and a bf16 tensor's float32 copy. A
    tensor with a NaN hands its magnitudes to the general form, which allocates no more than alone.
    Beside them: each row's float32 sums (10 a row, 0.1 bytes per element of a row of 384) and a few
    scalars."""
    fmt = get_format("e4m3")
    x = torch.randn(512, 384, dtype=dtype)
    scale = torch.tensor(2.0)
    deq = (x.float() * 2).to(fmt.dtype).float() / 2 if with_deq else None
    extra = (0 if with_deq else 1) + (4 if dtype == torch.bfloat16 else 0) + 10 * 4 / x.shape[1] + 0.01
    stats_mod.stats_call(x, scale, 1 / scale, torch.tensor(4.0), fmt, deq=deq)
    with ByteCounter() as c:
        stats_mod.stats_call(x, scale, 1 / scale, torch.tensor(4.0), fmt, deq=deq)
    assert c.bytes / x.numel() <= 8 + extra, c.bytes / x.numel()
    x[0, 0] = math.nan
    with ByteCounter() as c:
        stats_mod.stats_call(x, scale, 1 / scale, torch.tensor(4.0), fmt, deq=deq)
    assert c.bytes / x.numel() <= 16 + extra, c.bytes / x.numel()


def test_the_emulated_layers_operand_allocates_nothing_for_its_amax_and_one_float32_copy_for_its_round_trip():
    """Every emulated operand, every step: its amax pair allocates nothing tensor-sized on the CPU (one
    ``aminmax`` pass; |x| is copied only for a tensor holding a NaN), its FP8 round trip one float32
    copy and the FP8 tensor (decoded into the buffer the cast read): 5 bytes per element of a float32
    tensor."""
    from fp8scope.emulate.amax import amax_pair
    from fp8scope.emulate.quantize import quantize_dequantize

    x = torch.randn(512, 384)
    with ByteCounter() as c:
        amax_pair(x)
        quantize_dequantize(x, torch.tensor(2.0), torch.tensor(0.5), get_format("e4m3"))
    assert c.bytes / x.numel() <= 5 + 1e-3, c.bytes / x.numel()


def test_compiled_full_stats_are_at_most_3_kernels():
    from torch._inductor.utils import run_and_get_code

    for key in (("cpu", torch.bfloat16, "e4m3", False, False), ("cpu", torch.float32, "e5m2", True, True)):
        torch._dynamo.reset()
        _, codes = run_and_get_code(torch.compile(stats_mod.FULL_STATS.eager(key), dynamic=True,
                                                  options=stats_mod.FULL_STATS.options(key)),
                                    *stats_mod._full_examples(key))
        kernels = len(re.findall(r"async_compile\.(?:cpp_pybinding|cpp|triton)\(", "\n".join(codes)))
        assert 1 <= kernels <= 3, (key, kernels)


def _guards_accept(family, key, args) -> bool:
    """Whether the compiled code of ``key`` accepts ``args`` (a call its guards reject runs eagerly,
    silently: the compile would be wasted on every step)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    if family.direct(key):  # called without dynamo: its own check of what the trace assumed
        return family._ready[key].accepts(args)

    code = next(c for c in _compiled_codes(family._ready[key]) if c.co_name.startswith(f"fp8scope_{family.name}"))
    fn_locals = dict(zip(code.co_varnames[:code.co_argcount], args))
    eager = family.eager(key)  # the renamed copy shares the eager function's closure
    fn_locals.update({n: c.cell_contents for n, c in zip(eager.__code__.co_freevars, eager.__closure__ or ())})
    with torch.no_grad():  # the runner's grad mode
        return any(e.guard_manager.check(fn_locals) for e in _debug_get_cache_entry_list(code))


def _compiled_codes(obj, seen=None):
    seen = set() if seen is None else seen
    for cell in getattr(obj, "__closure__", None) or ():
        v = cell.cell_contents
        if callable(v) and id(v) not in seen:
            seen.add(id(v))
            if hasattr(v, "__code__"):
                yield v.__code__
            yield from _compiled_codes(v, seen)


def test_compiled_stats_with_recipes_serve_the_calls_capture_makes(monkeypatch):
    """The fused stats + recipes variants compiled at first use accept what ``stats_call`` hands them: a
    per-tensor capture, and a block view with the matrix it was cut from and per-block expected
    amaxes (summarised to the 0-d value the variant was made for)."""
    from fp8scope.compiled import reset_dynamo
    from fp8scope.emulate.blocks import mxfp8_blocks

    monkeypatch.setenv("FP8SCOPE_COMPILE", "sync")
    reset_dynamo()
    fmt = get_format("e4m3")
    calls = {}
    real_get = stats_mod.FULL_STATS.get

    def spy(key):
        fn = real_get(key)

        def call(*args):
            calls.setdefault(key, args)
            return fn(*args)

        return call

    monkeypatch.setattr(stats_mod.FULL_STATS, "get", spy)
    for shape in ((300, 64), (64, 96)):
        calls.clear()
        x = torch.randn(shape)
        b = mxfp8_blocks(x, fmt)
        stats_mod.stats_call(b.x, b.scale, b.scale_inv, b.amax, fmt, recipes=("mxfp8",), whole=x)
        stats_mod.stats_call(x, torch.tensor(2.0), torch.tensor(0.5), torch.tensor(3.0), fmt, recipes=("current",))
        assert len(calls) == 2
        for key, args in calls.items():
            assert key in stats_mod.FULL_STATS._ready, stats_mod.FULL_STATS.failures
            assert _guards_accept(stats_mod.FULL_STATS, key, args), key
    reset_dynamo()


def _cheap_step_extra(fp8: str, measure) -> tuple[int, int]:
    """(what ``measure(run_step)`` counts for one cheap step of the 2-layer demo model, monitored
    minus unmonitored; the tensors monitored)."""
    counts, n = {}, 0
    for monitored in (False, True):
        setup = train.build(fp8=fp8, quiet=True, n_layers=2, d_model=64, batch_size=4, seq_len=32)
        with tempfile.TemporaryDirectory() as tmp:
            mon = fp8scope.Monitor(setup.model, tmp, every=100, detect=False, full_on_anomaly=0,
                                   recipe=setup.recipe) if monitored else None
            for step in range(1, 4):  # cheap steps (step 0 would be full): keys made, states pending
                train.train_step(setup, step, mon)
            counts[monitored] = measure(lambda: train.train_step(setup, 4, mon))
            if mon is not None:
                n = len(mon.collector.keys)
                mon.close()
    assert n == 11 * 3  # 5 Linear per block x 2 + lm_head, activation / weight / gradient
    return counts[True] - counts[False], n


def _aten_ops(run_step) -> int:
    with OpCounter() as c:
        run_step()
    return len(c.ops)


@pytest.mark.parametrize("fp8", ["off", "delayed"])  # what-if (plain FP32) and emulated FP8
def test_a_cheap_step_costs_at_most_2_ops_per_tensor(fp8):
    extra, n = _cheap_step_extra(fp8, _aten_ops)
    assert extra <= 2 * n + 40, (extra, n)


@pytest.mark.parametrize("fp8", ["off", "delayed"])
def test_a_cheap_step_makes_at_most_7_fp8scope_python_calls_per_tensor(fp8):
    extra, n = _cheap_step_extra(fp8, fp8scope_python_calls)
    assert extra <= 7 * n + 40, (extra, n)  # 6.3 a tensor and about 35 a step (what-if), 5.7 and 39 (emulated)


def test_current_scaling_backward_measures_the_gradient_once():
    """Under current scaling the emulated backward scales the gradient by its own amax, then records that
    amax for the monitor: one measurement, not two. Eagerly on the CPU that is one ``aminmax`` pass (TE's
    NaN-free amax is the logged one when no NaN is there: ``emulate.amax.amaxes_of``). Counted on the
    gradient's shape in a real backward."""
    from fp8scope.emulate import CurrentScaling, Fp8Linear

    torch.manual_seed(0)
    lin = Fp8Linear(64, 32, recipe=CurrentScaling())
    x = torch.randn(16, 64, requires_grad=True)
    lin(x).sum().backward()  # first pass: scales and constants made
    x.grad = None
    out = lin(x)
    g = torch.randn_like(out)
    with OpCounter() as c:
        out.backward(g)
    assert sum(op.startswith(("aminmax", "amax")) for op in c.ops) == 1, c.ops  # the forward's operands are not in here


def test_a_layer_input_shared_by_several_layers_is_read_once():
    """A ``transformers`` Llama's q, k and v projections take one hidden state, its MLP's gate and
    up projections another: a cheap step reads each such input once (one ``aminmax``), and each
    layer still gets its own row, with the same amax."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with tempfile.TemporaryDirectory() as tmp:
        with fp8scope.Monitor(model, tmp, every=100, detect=False, full_on_anomaly=0) as mon:
            for _ in range(3):
                step()
                mon.step()
            with OpCounter() as c:
                step()
            mon.step()
        df = fp8scope.load_run(tmp).tensors()
    # 15 linears (7 a layer, the head) x activation / weight / gradient; a layer's q, k, v share one
    # input and its gate and up another: 3 fewer reads a layer
    reads = sum(op.startswith("aminmax.") for op in c.ops)  # into the bank's buffer: the out= overload
    assert reads == 15 * 3 - 2 * 3, reads
    act = df[(df.tensor == "activation") & (df.step == 3)].set_index("layer").amax
    for layer in range(2):
        p = f"model.layers.{layer}."
        assert act[p + "self_attn.q_proj"] == act[p + "self_attn.k_proj"] == act[p + "self_attn.v_proj"]
        assert act[p + "mlp.gate_proj"] == act[p + "mlp.up_proj"]
        assert act[p + "mlp.down_proj"] != act[p + "mlp.up_proj"]


def test_an_accelerator_reads_a_cheap_steps_weights_in_one_call():
    """Where the device has torch's multi-tensor kernels (CUDA; "meta" takes that path here, with no
    values to compute), a cheap step reads every weight in one ``_foreach_norm`` (two launches on
    CUDA) where each layer's forward read its own, once per micro-batch: on a ``transformers``
    Llama, 15 of its 39 reads a micro-batch. The activations and gradients are read as before."""
    from meta_training import llama, train

    model, collector, loss_of = llama(every=100)
    counter = OpCounter()
    # step 0 full, step 1 cheap (its weights read one by one, as nothing is known yet), step 2 counted
    rows = train(model, collector, loss_of, steps=3, micro=2, last=counter)
    assert rows == 3 * 2 * 15 * 3  # every capture still has its row
    reads = 15 * 2 - 2 * 3  # a micro-batch's activations (q/k/v and gate/up share theirs) and gradients
    aminmax = sum(op.startswith("aminmax.") for op in counter.ops)  # any overload (the bank reads with out=)
    assert aminmax == 2 * reads, aminmax
    assert counter.ops.count("_foreach_norm.Scalar") == 1, [op for op in counter.ops if "foreach" in op]
