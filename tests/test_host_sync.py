"""A monitored training step makes no host sync, checked without a GPU.

On a GPU a host sync (a device value read on the host, or a host value copied to the device from
pageable memory, which waits for the stream) makes the training thread wait for every kernel queued
before it: a step's host time and its GPU time then add up instead of overlapping. No CPU run shows
that. Here the monitored model trains on the "meta" device, which takes a GPU's code paths (nothing
on it is "cpu") and runs the real hooks, scaling states, banks and step gather, under a torch
function mode that records each call that would sync on a GPU, with the fp8scope line that made it.
``tests/test_gpu.py::test_monitored_steps_make_no_host_sync`` checks the same on a real GPU.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meta_training import attach as _attach, llama, train as _train

from fp8scope.demo.tiny_gpt import GPTConfig, TinyGPT
from fp8scope.emulate import (CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling,
                              NVFP4BlockScaling, convert_to_fp8)

T = torch.Tensor
# reading a device value on the host
_READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.numpy, T.cpu, T.nonzero,
          torch.nonzero, T.masked_select, torch.masked_select, torch.unique, T.unique}
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _device_of(value) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, (str, int)):
        return torch.device(value)
    return value if isinstance(value, torch.device) else None


def _target(args, kwargs) -> torch.device | None:
    """The device a ``Tensor.to`` call moves to (a device or a tensor as its first argument)."""
    dev = kwargs.get("device")
    if dev is None and args:
        first = args[0]
        dev = first.device if isinstance(first, torch.Tensor) else first
    try:
        return _device_of(dev)
    except (RuntimeError, TypeError):
        return None  # a dtype


class HostSyncs(TorchFunctionMode):
    """Records (what, fp8scope file:line) of each call that would make the host wait on a GPU."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def _note(self, what: str) -> None:
        ours = [f for f in traceback.extract_stack()[:-2] if "/fp8scope/" in f.filename]
        where = f"{ours[-1].filename.split('/fp8scope/')[-1]}:{ours[-1].lineno}" if ours else "outside fp8scope"
        self.found.append((what, where))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_device = this is not None and this.device.type != "cpu"
        if func in _READS and on_device:
            self._note(getattr(func, "__name__", str(func)))
        elif func in _FACTORIES:
            dev = _device_of(kwargs.get("device"))
            if dev is not None and dev.type != "cpu":
                self._note(f"torch.{func.__name__}(..., device={dev.type}): a blocking copy from the host")
        elif func in (T.to, T.copy_) and this is not None:
            src, dst = (this, _target(args[1:], kwargs)) if func is T.to else (args[1], this.device)
            blocking = not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2] is True)
            if isinstance(src, torch.Tensor) and dst is not None:
                if src.device.type != "cpu" and dst.type == "cpu":
                    self._note(f"{func.__name__} to the host")
                elif src.device.type == "cpu" and dst.type != "cpu" and blocking and src.numel() > 0:
                    self._note(f"{func.__name__} from the host, blocking")
        return func(*args, **kwargs)


def _gpt_loss(cfg: GPTConfig):
    def loss_of(model):
        x = torch.randint(0, cfg.vocab, (2, cfg.seq_len), device="meta")
        return F.cross_entropy(model(x).float().view(-1, cfg.vocab), x.reshape(-1))

    return loss_of


def _model(recipe=None) -> tuple[TinyGPT, GPTConfig]:
    cfg = GPTConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
    model = TinyGPT(cfg, seed=0).to("meta")
    if recipe is not None:
        convert_to_fp8(model, recipe=recipe, skip=["lm_head"])
    return model, cfg


MODELS = {
    "whatif-delayed": (None, DelayedScaling(amax_history_len=8), ()),
    "whatif-current": (None, CurrentScaling(), ()),
    "whatif-recipes": (None, DelayedScaling(amax_history_len=8), ("current", "mxfp8", "block128", "nvfp4")),
    "emulated-delayed": (DelayedScaling(amax_history_len=8), DelayedScaling(amax_history_len=8), ()),
    "emulated-current": (CurrentScaling(), DelayedScaling(), ()),
    "emulated-mxfp8": (MXFP8BlockScaling(), DelayedScaling(), ()),
    "emulated-block": (Float8BlockScaling(), DelayedScaling(), ()),
    "emulated-nvfp4": (NVFP4BlockScaling(), DelayedScaling(), ()),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_monitored_training_makes_no_host_sync(name):
    """Cheap and full steps (``every=2``), two micro-batches a step (the what-if bank's rounds, a
    pending update read back on a full step), on the tiny GPT: not one call that would sync."""
    convert, recipe, whatif_recipes = MODELS[name]
    model, cfg = _model(convert)
    collector = _attach(model, recipe, every=2, whatif_recipes=whatif_recipes)
    syncs = HostSyncs()
    with syncs:
        rows = _train(model, collector, _gpt_loss(cfg))
    assert rows >= 4 * 21  # every step gathered its rows (21 layers' tensors, at least one each)
    assert not syncs.found, "\n".join(f"{what} at {where}" for what, where in sorted(set(syncs.found)))


def test_the_check_sees_host_syncs():
    """The mode flags what it is meant to, from fp8scope's own code and others'."""
    from fp8scope.emulate.device_bank import DeviceDelayedBank

    syncs = HostSyncs()
    x = torch.ones(3, device="meta")
    with syncs:
        for read in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x.tolist(), lambda: x.cpu(),
                     lambda: x.to("cpu"), lambda: torch.tensor(2.0, device="meta"), lambda: torch.ones(2).to(x),
                     lambda: x.copy_(torch.ones(3))):
            try:
                read()
            except (RuntimeError, NotImplementedError):  # meta has no values: the call was still made
                pass
        torch.ones(2).to("meta", non_blocking=True)  # not a sync
        torch.full((), 2.0, device="meta")  # not a sync
        DeviceDelayedBank(DelayedScaling(), "meta")  # nothing read back
    assert len(syncs.found) == 8, syncs.found
    assert all(where == "outside fp8scope" for _, where in syncs.found)


def test_transformers_llama_makes_no_host_sync_of_ours():
    """A ``transformers`` Llama (built from a config, random weights) with the what-if monitor: our
    hooks add no sync. (transformers itself makes a blocking copy in its forward, which on a GPU
    is the model's own cost, with or without a monitor: only our lines are held against us.)"""
    model, collector, loss_of = llama(every=2)
    syncs = HostSyncs()
    with syncs:
        rows = _train(model, collector, loss_of)
    assert rows == 4 * 2 * 15 * 3  # 15 linears (7 a layer and the head) x 3 roles, twice a step
    ours = sorted({(what, where) for what, where in syncs.found if where != "outside fp8scope"})
    assert not ours, "\n".join(f"{what} at {where}" for what, where in ours)


def test_torchao_float8_training_makes_no_host_sync():
    """torchao's ``Float8Linear`` (its dynamic scaling: the amax each cast computes is read where
    torchao keeps it), monitored: neither torchao's training step nor our reading of it syncs."""
    pytest.importorskip("torchao.float8")
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    convert_to_float8_training(model)
    model = model.to("meta")
    collector = _attach(model, None, every=2)
    syncs = HostSyncs()
    with syncs:
        rows = _train(model, collector,
                      lambda m: m(torch.randn(16, 64, device="meta", dtype=torch.bfloat16)).float().square().mean())
    assert rows == 4 * 2 * 2 * 3  # two Float8Linear x activation, weight, gradient, two micro-batches a step
    assert not syncs.found, "\n".join(f"{what} at {where}" for what, where in sorted(set(syncs.found)))
