"""Where a cheap what-if capture's host time goes: each function of the capture path timed per call
(a wrapper around each; about 1 us of its own per call), on a Llama with TinyLlama's 22 layers at
tiny widths (155 linears, 465 tensors), eager, on the CPU, where a step is nearly all host time.

Why: on a GPU a cheap step costs its host time (docs/benchmarks.md, "On a GPU"), and this shows
which part of it to cut.

    python benchmarks/capture_pieces.py
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8scope  # noqa: E402
from fp8scope.capture import collector  # noqa: E402
from fp8scope.emulate import DelayedScaling  # noqa: E402
from fp8scope.capture.adapters import base, whatif  # noqa: E402
from fp8scope.emulate import device_bank  # noqa: E402
from large_model import SIZES  # noqa: E402
from overhead import settle_gc  # noqa: E402

_spent: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            cell = _spent[label]
            cell[0] += time.perf_counter() - start
            cell[1] += 1

    setattr(owner, name, timed)


def main() -> int:
    import transformers

    os.environ["FP8SCOPE_COMPILE"] = "0"
    _timed(whatif._WhatIfTap, "forward_hook", "a layer's forward hook (its captures included)")
    _timed(whatif._WhatIfTap, "_on_grad", "a layer's gradient hook (its capture included)")
    _timed(whatif._WhatIfTap, "capture", "one capture")
    _timed(device_bank.DeviceDelayedBank, "capture", "  its amax and pending row")
    _timed(collector.StepCollector, "record_deferred", "  its place in the step")
    _timed(base.GradHook, "attach", "the gradient's pre-hook, registered")
    _timed(fp8scope.Monitor, "step", "mon.step")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SIZES["narrow"], attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    steps = 20
    with tempfile.TemporaryDirectory() as tmp:
        # the what-if recipe large_model.py times (a 16-long history; the default 1,024 makes mon.step
        # roll [465, 1024] floats, which on a CPU is most of its time)
        mon = fp8scope.Monitor(model, tmp, every=50, detect=False, recipe=DelayedScaling(amax_history_len=16))
        for step in range(steps + 5):
            if step == 5:
                settle_gc()  # the full collection that setting up the monitor brings on, not in the timings
                _spent.clear()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss.detach())
        mon.close()
    print(f"torch {torch.__version__}, cpu, Llama narrow (465 tensors), cheap what-if steps, per step:")
    for label, (seconds, calls) in _spent.items():
        print(f"   {label:48s} {calls / steps:5.0f} calls  {seconds / calls * 1e6:7.1f} us each"
              f"  {seconds / steps * 1e3:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
