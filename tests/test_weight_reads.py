"""A cheap step's weight reads in one batch (``fp8scope.emulate.weight_reads``): the same amaxes as
each layer reading its own weight, and a batched amax never standing for a weight it was not read
from (changed in place, replaced, sharded and gathered in its layer's forward as FSDP does)."""

from __future__ import annotations

import math
import tempfile
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8scope
from fp8scope.emulate import DelayedScaling
from fp8scope.emulate.amax import amax_parts, amax_parts_many, combine_parts
from fp8scope.emulate.device_bank import DeviceDelayedBank
from fp8scope.formats import get_format

NAN, INF = float("nan"), float("inf")
E4M3 = get_format("e4m3")


class Reads(TorchDispatchMode):
    """Counts the amax reads (``aminmax`` per tensor, ``_foreach_norm`` per batch)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("aminmax", "_foreach_norm")):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _both(parts):
    logged, recorded = combine_parts(*parts)
    return logged.item(), recorded.item()


def _same(a, b):
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


@pytest.mark.parametrize("multi_tensor", [False, True])
def test_batched_parts_are_each_tensors_parts(multi_tensor):
    """Both forms (one ``aminmax`` each; the multi-tensor norm that CUDA runs) give every tensor's
    logged and recorded amax as a read of its own does: NaN, +-Inf, a negative extreme, bf16 and
    float32 mixed in one call."""
    xs = [torch.tensor([1.0, -7.0, 3.0]), torch.tensor([2.0, NAN, -1.0]).to(torch.bfloat16),
          torch.tensor([[1.0, -INF], [0.5, 2.0]]), torch.tensor([INF, 1.0]).to(torch.bfloat16),
          torch.randn(64, 48).to(torch.bfloat16), torch.tensor([-0.0, 0.0])]
    got = amax_parts_many(xs, multi_tensor=multi_tensor)
    for x, parts in zip(xs, got):
        assert _same(_both(parts), _both(amax_parts(x))), x
    assert amax_parts_many([], multi_tensor=multi_tensor) == []


def _bank_with_weights(n=3):
    bank = DeviceDelayedBank(DelayedScaling(amax_history_len=4), "cpu")
    slots = [bank.add(E4M3) for _ in range(n)]
    weights = [nn.Parameter(torch.randn(8, 4) * (i + 1)) for i in range(n)]
    return bank, slots, weights


def _step(bank, slots, xs):
    with Reads() as reads:
        for s, x in zip(slots, xs):
            bank.capture(s, x, weight=True)
    return reads.n, bank.take_rows()[:, 0].tolist()


def test_a_steps_weights_are_read_once_in_a_batch_from_the_second_step():
    bank, slots, ws = _bank_with_weights()
    true = [w.detach().abs().max().item() for w in ws]
    assert _step(bank, slots, ws) == (3, true)  # nothing known yet: each read on its own
    with torch.no_grad():
        for w in ws:
            w.mul_(2)  # the optimizer's step
    batches = []
    for _ in range(2):
        true = [w.detach().abs().max().item() for w in ws]
        n, amaxes = _step(bank, slots, ws)
        assert amaxes == true
        batches.append(n)
    assert batches == [3, 3]  # here (a CPU) the batch is one aminmax each, all at the first capture
    # micro-batches: a weight captured twice in a step takes the batch's read both times
    with Reads() as reads:
        for s, w in zip(slots * 2, ws * 2):
            bank.capture(s, w, weight=True)
    assert reads.n == 3
    assert bank.take_rows()[:, 0].tolist() == [w.detach().abs().max().item() for w in ws] * 2


def test_a_batched_read_never_stands_for_a_changed_or_other_tensor():
    bank, slots, ws = _bank_with_weights()
    _step(bank, slots, ws)  # known from now on
    # changed in place after the batch (a version bump): read again, and by its layer from then on
    bank.capture(slots[0], ws[0], weight=True)  # the batch is read here
    with torch.no_grad():
        ws[1].mul_(10)
    bank.capture(slots[1], ws[1], weight=True)
    # replaced by another tensor (a new Parameter of the same shape)
    other = nn.Parameter(torch.full((8, 4), 100.0))
    bank.capture(slots[2], other, weight=True)
    assert bank.take_rows()[:, 0].tolist() == [ws[0].detach().abs().max().item(),
                                               ws[1].detach().abs().max().item(), 100.0]
    with Reads() as reads:  # slot 1 missed once: its layer reads it; slot 2's new tensor is batched
        bank.capture(slots[0], ws[0], weight=True)
        bank.capture(slots[1], ws[1], weight=True)
        bank.capture(slots[2], other, weight=True)
    assert reads.n == 3  # the batch (slots 0 and 2) and slot 1's own read
    assert 1 not in bank._weights._known
    bank.take_rows()


def test_a_transposed_weight_is_batched_and_unused_weights_leave_the_batch():
    """``Conv1D`` stores its weight ``[in, out]`` and is read through ``.t()``, a new view each
    forward: its batched amax stands for it. A weight no layer captured in a step (an MoE expert
    without tokens) is not read in the next batch."""
    bank, slots, ws = _bank_with_weights()
    for _ in range(2):
        _step(bank, slots, [w.t() for w in ws])
    with Reads() as reads:
        bank.capture(slots[0], ws[0].t(), weight=True)
        bank.capture(slots[1], ws[1].t(), weight=True)
    assert reads.n == 3  # the batch: every weight known at its start
    assert bank.take_rows()[:, 0].tolist() == [w.detach().abs().max().item() for w in ws[:2]]
    with Reads() as reads:
        bank.capture(slots[0], ws[0].t(), weight=True)
    assert reads.n == 2  # slot 2 was not captured last step: not read
    bank.take_rows()


def test_freed_storage_is_not_read():
    """FSDP frees an unsharded weight's storage after its layer's forward (a null data pointer) and
    gathers it again in the next forward: the batch skips it, the layer reads it whole."""
    bank, slots, ws = _bank_with_weights(2)
    _step(bank, slots, ws)
    keep = ws[1].detach().clone()
    ws[1].untyped_storage().resize_(0)  # resharded: no data until the layer's next forward
    with Reads() as reads:
        bank.capture(slots[0], ws[0], weight=True)
        ws[1].untyped_storage().resize_(keep.numel() * keep.element_size())  # gathered again
        with torch.no_grad():
            ws[1].copy_(keep)
        bank.capture(slots[1], ws[1], weight=True)
    assert reads.n == 2  # slot 0 from the batch of one, slot 1 read by its layer
    assert bank.take_rows()[:, 0].tolist() == [ws[0].detach().abs().max().item(), keep.abs().max().item()]


class _Sharded(nn.Module):
    """A Linear whose weight is freed between steps and gathered in its forward pre-hook, as FSDP2
    does with its unsharded parameters (the same Parameter, its storage resized), and updated from
    its gradient by itself (the optimizer holds the shard, not the gathered weight)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.shard = self.lin.weight.detach().clone()
        self.lin.register_forward_pre_hook(self._gather)

    def _gather(self, mod, args):
        w = mod.weight
        if w.untyped_storage().nbytes() == 0:
            w.untyped_storage().resize_(self.shard.numel() * self.shard.element_size())
            with torch.no_grad():
                w.copy_(self.shard)

    def step_and_reshard(self, lr):
        w = self.lin.weight
        self.shard -= lr * w.grad
        w.grad = None
        w.untyped_storage().resize_(0)

    def forward(self, x):
        return self.lin(x)


def test_a_monitored_run_logs_each_steps_true_weight_amax():
    """Training with the monitor (cheap steps, two micro-batches a step): every weight row is the
    weight's amax as its layer used it, for plain, transposed (``Conv1D``) and FSDP-style gathered
    weights alike, and the run trains without a warning."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), Conv1D(24, 32), nn.GELU(), _Sharded(24, 8))
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("4.")], lr=0.05)
    weights = {"0": model[0].weight, "2": model[2].weight, "4.lin": model[4].lin.weight}
    seen: dict[tuple[int, str], float] = {}  # (step, layer) -> its weight's amax as the forward used it

    def note(name, w):
        def hook(mod, args, out):
            seen.setdefault((step, name), w.detach().abs().max().item())
        return hook

    for name, w in weights.items():
        model.get_submodule(name).register_forward_hook(note(name, w))
    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fp8scope.Monitor(model, tmp, every=100, detect=False, full_on_anomaly=0) as mon:
                for step in range(6):
                    for _ in range(2):
                        model(torch.randn(4, 16)).square().mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    model[4].step_and_reshard(0.05)
                    mon.step()
        df = fp8scope.load_run(tmp).tensors()
    assert not [str(w.message) for w in caught if "fp8scope" in str(w.message)]
    rows = df[df.tensor == "weight"]
    assert len(rows) == 6 * 3
    for (step, name), amax in seen.items():
        got = rows[(rows.step == step) & (rows.layer == name)].amax.item()
        assert got == pytest.approx(amax, rel=1e-6), (step, name)


def test_an_eval_forward_on_swapped_weights_reads_its_own():
    """Evaluating with EMA weights swapped in through ``.data`` (no version bump) inside a step,
    captured with ``capture_no_grad``: the eval forward's weight is read, not taken from the batch
    the training forward used, so the step's merged row has the larger amax of the two."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ema = [p.detach().clone() * 3 for p in model.parameters()]  # larger than the weights
    x = torch.randn(8, 16)
    with tempfile.TemporaryDirectory() as tmp:
        with fp8scope.Monitor(model, tmp, every=100, detect=False, full_on_anomaly=0, capture_no_grad=True) as mon:
            for _ in range(3):
                model(x).square().mean().backward()
                live = [p.detach().clone() for p in model.parameters()]
                with torch.no_grad():  # before the optimizer's step: the weights' versions are the batch's
                    for p, e in zip(model.parameters(), ema):
                        p.data.copy_(e)
                    model(x)
                    for p, t in zip(model.parameters(), live):
                        p.data.copy_(t)
                opt.step()
                opt.zero_grad(set_to_none=True)
                mon.step()
        df = fp8scope.load_run(tmp).tensors()
    w = df[(df.tensor == "weight") & (df.step == 2) & (df.layer == "0")]
    assert w.calls.item() == 2
    assert w.amax.item() == pytest.approx(ema[0].abs().max().item(), rel=1e-6)


def test_a_compiled_cheap_step_reads_the_weights_in_one_batch_as_eager_does(tmp_path, monkeypatch):
    """A compiled forward runs its graph with grad off, so a tap cannot tell a training forward by
    grad mode when it runs; it is told the grad mode the forward was traced with. So a compiled
    cheap step reads every weight in the step's one multi-tensor call, as an eager one does (on a
    GPU: one read a step where it made one per layer). The multi-tensor form is CUDA's, taken here
    on the CPU."""
    import collections
    import contextlib

    from fp8scope.emulate import amax as amax_mod

    class ByOp(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(amax_mod, "_multi_tensor_devices", lambda: ("cpu",))
    reads = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        run = torch.compile(model) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with fp8scope.Monitor(run, tmp_path / str(compiled), every=100, detect=False, full_on_anomaly=0) as mon:
            count = ByOp()
            for step in range(4):  # the 4th: a cheap step whose weights are in the batch
                with count if step == 3 else contextlib.nullcontext():
                    run(torch.randn(8, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                mon.step()
        reads[compiled] = (count.n["aminmax"], count.n["_foreach_norm"])
    assert reads[False] == (4, 1)  # two inputs and two gradients, and the weights in one call
    assert reads[True] == reads[False]
