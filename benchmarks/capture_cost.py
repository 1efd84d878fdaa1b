"""What capture costs, in the proxies that carry over to a GPU and in step-time ratios measured here.

1. Per captured tensor, for three sizes: aten ops of the eager full-stats pass and of a what-if
   cheap capture (counted with a ``TorchDispatchMode``: on CUDA each op is about one kernel
   launch; the cheap capture is one eager op on every device, see ``fp8scope.emulate.amax``), and
   the kernels inductor generates for the compiled full stats (its C++ kernels here, Triton kernels
   on CUDA). Plus the time of one full-stats call, eager and compiled, and the compiled call's
   rate over the tensor's bytes (on a GPU, against its memory bandwidth: what is left to tune).
2. Aten ops the monitor adds to one training step of the demo's tiny GPT (forward, backward and
   ``mon.step``, against the same step unmonitored), on a cheap and on a full step, for the
   what-if model (plain FP32) and the emulated FP8 one, with the stats eager (the op counts of
   compiled code are not visible to a dispatch mode; section 1 counts its kernels).
2b. The kernels of a ``torch.compile``d demo-model step (``--sections kernels``, forward and
   backward, the third step's generated code), their launches and fp8scope's taps in them,
   unmonitored and monitored: the monitor's taps add no kernel.
1b. Per other recipe measured on a tensor (``Monitor(whatif_recipes=...)``): eager ops, generated
   kernels, one call's time eager and compiled.
1c. The host time of one compiled full-stats call, through ``torch.compile`` and called directly
   (``fp8scope.compiled``), on a small tensor where that time is the call's whole cost.
3. Monitored / unmonitored step time of the demo model, eager and ``torch.compile``d, at
   ``every=50`` and ``every=1``: paired ratios, timed interleaved (round-robin blocks of steps);
   ``--whatif-recipes`` adds a monitor that also measures those recipes.
3b. Where a what-if monitor's time goes at ``every=50`` (the demo model, eager), five
   configurations timed interleaved in one run: unmonitored; cheap captures only (no online
   detection, no extra full steps after a suspicious one); those plus online detection; ``every=50``
   without detection or extra full steps; the default monitor.
3c. Host-bound steps (``--sections hostbound``): the demo model made so small that a step is host
   work, as a small or compiled model's step is on a GPU: unmonitored, cheap captures only, and
   ``every=50`` with online detection in its child process (the default) and in a thread.
3d. MoE experts (``--sections moe``): a ``transformers`` Mixtral (4 layers, width 128, 8 experts, 2
   per token) what-if, under each of ``transformers``' experts implementations: the aten ops the
   monitor adds to a cheap step (the experts' GEMMs of a grouped or batched implementation in one
   segmented reduction: the count does not grow with the experts), and the monitored / unmonitored
   step time at ``every=50`` (paired ratios, interleaved). ``--moe-modes eager,compiled`` also runs
   the model ``torch.compile``d (``grouped_mm`` and ``batched_mm``; the loop's experts are not
   captured compiled): its graphs and graph breaks, monitored, and the aten ops the monitor's graph
   taps run (a dispatch mode sees no compiled kernel, so the unmonitored compiled step counts none).
3e. MoE at scale (``--sections moescale``): a ``transformers`` Qwen3-MoE with Qwen3-30B-A3B's 48
   layers of 128 experts (8 per token) at tiny widths (``--moe-layers``, ``--moe-experts``): the first
   step, the ops a cheap step adds, the step-time ratios of cheap captures alone and of the default
   monitor, and the rows and bytes a step logs.
4. The first steps of a fresh process (``--sections first``), with the stats eager
   (``FP8SCOPE_COMPILE=0``), compiled at first use on the training thread (``sync``) and compiled
   ahead in a child process (``ahead``; the default on a GPU): step 0's time, the slowest later
   step and its index, and the step from which the stats run compiled. Each mode runs in a process
   of its own, with inductor's cache empty (``--first-warm``: as earlier runs left it); the
   Monitor's setup (``compiled.prepare``) is not timed.
4b. A restart of a ``torch.compile``d model (``--sections restart``): the demo model compiled, what-if
   and emulated FP8, unmonitored and monitored (``every=50``, no online detection), its first steps
   in a fresh process twice over one inductor cache, empty for the first process (a run's first
   start) and as the first left it for the second (a restart after a preemption, or another rank on
   the same machine): each process's time to the end of those steps, and its graphs from inductor's
   FX graph cache and from AOT autograd's cache (hit / miss / bypass). The monitor's graphs must come
   from the cache as the unmonitored ones do.

    python benchmarks/capture_cost.py                 # all sections, ~6 minutes on a 2-core CPU
    python benchmarks/capture_cost.py --sections ops  # section 2 only (deterministic)
    python benchmarks/capture_cost.py --sections kernels  # section 2b only (deterministic)
    python benchmarks/capture_cost.py --sections recipes,ratio --whatif-recipes all  # other recipes' cost
    python benchmarks/capture_cost.py --device cuda   # on a GPU
    python benchmarks/capture_cost.py --sections parts --rounds 10  # section 3b only
    python benchmarks/capture_cost.py --sections first   # section 4: does a compile stall a step?
    python benchmarks/capture_cost.py --sections restart   # section 4b: a compiled model's restart
    python benchmarks/capture_cost.py --sections hostbound --rounds 16   # section 3c only
    python benchmarks/capture_cost.py --sections moe --rounds 8   # section 3d only
    python benchmarks/capture_cost.py --sections moe --moe-modes compiled --rounds 8   # 3d, compiled
    python benchmarks/capture_cost.py --sections moescale --rounds 4 --block 5   # section 3e only

Op and kernel counts are deterministic; timings are this machine's, printed as ratios measured in
one run. Section 3 times the product's default: on a GPU the stats compiled (at their first use here,
``FP8SCOPE_COMPILE=sync``, so that timed steps run the compiled code from the first one), on the
CPU eager (``fp8scope.compiled``: the CPU does not compile by default); ``--compile-stats`` compiles
them on the CPU too, ``--no-compile-stats`` keeps them eager on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8scope  # noqa: E402
from fp8scope.capture import stats as stats_mod  # noqa: E402
from fp8scope.demo import train  # noqa: E402
from fp8scope.emulate import amax as amax_mod  # noqa: E402
from fp8scope.formats import get_format  # noqa: E402
from overhead import time_interleaved  # noqa: E402  (benchmarks/overhead.py: the paired, interleaved timing)
from triton_kernels import kernels_and_launches  # noqa: E402  (counts the kernels in inductor's code)

SIZES = ((256, 256), (1024, 4096), (8192, 4096))


class OpCounter(TorchDispatchMode):
    """Counts aten ops, and each by name (``by_name``); views (no kernel on any device) are counted
    apart."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.views = 0
        self.by_name: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.view_copy in func.tags or func.is_view or func.__name__ in ("detach", "view", "alias"):
            self.views += 1
        else:
            self.ops += 1
            self.by_name[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> tuple[int, int]:
    with OpCounter() as c:
        fn()
    return c.ops, c.views


def generated_kernels(fn, *args, options: dict | None = None) -> tuple[int, int]:
    """Kernels inductor generates for ``fn`` (C++ kernels on the CPU, Triton kernels on CUDA), and
    the launches one call makes (a Triton kernel can run more than once: a split reduction's
    finishing kernel per output). On a GPU each launch costs the host microseconds."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, dynamic=True, options=options), *args)
    return kernels_and_launches("\n".join(codes))


def timed(fn, reps: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def per_tensor(device: str, reps: int) -> None:
    print("1. per captured tensor (bf16, per-tensor scale, E4M3)")
    print(f"   {'size':>12s} {'full: eager ops':>16s} {'kernels (launches)':>19s} {'eager ms':>9s} {'compiled ms':>12s}"
          f" {'compiled GB/s':>14s}   {'cheap: ops':>11s}")
    from fp8scope.compiled import reset_dynamo

    fmt = get_format("e4m3")
    key = (device, torch.bfloat16, fmt.name, False, False)
    # kernels do not depend on the size (dynamic shapes); counting them resets dynamo, so first
    full_kernels, full_launches = generated_kernels(stats_mod.FULL_STATS.eager(key), *stats_mod._full_examples(key),
                                                    options=stats_mod.FULL_STATS.options(key))
    reset_dynamo()
    for rows, cols in SIZES:
        x = torch.randn(rows, cols, device=device).to(torch.bfloat16)
        scale = torch.tensor(100.0, device=device)
        inv, exp = 1 / scale, torch.tensor(4.48, device=device)
        os.environ["FP8SCOPE_COMPILE"] = "0"
        stats_mod.stats_call(x, scale, inv, exp, fmt)  # first call: the format's constants are cached
        full_ops, full_views = count_ops(lambda: stats_mod.stats_call(x, scale, inv, exp, fmt))
        eager = stats_mod.FULL_STATS.fallback(key)  # not stats_call: once compiled, that runs the compiled code
        matrix = amax_mod.row_matrix(x)  # what stats_call passes
        t_eager = timed(lambda: eager(matrix, scale, inv, exp, None), reps)
        os.environ["FP8SCOPE_COMPILE"] = "1"
        stats_mod.FULL_STATS.ensure(key)
        t_comp = timed(lambda: stats_mod.stats_call(x, scale, inv, exp, fmt), reps)  # the product's path
        cheap_ops, cheap_views = count_ops(lambda: amax_mod.amax_parts(x))  # one eager op on every device
        print(f"   {rows:>5d}x{cols:<6d} {full_ops:>10d} (+{full_views} views) {full_kernels:>8d} ({full_launches:>2d})     {t_eager * 1e3:>9.2f}"
              f" {t_comp * 1e3:>12.2f} {x.numel() * x.element_size() / t_comp / 1e9:>14.1f}   {cheap_ops:>5d} (+{cheap_views})")


def call_cost(device: str, reps: int) -> None:
    """The host time of one compiled full-stats call: through ``torch.compile`` (dynamo's frame
    evaluation and runtime wrappers on every call) and called directly (``fp8scope.compiled``'s
    ``_Direct``: the graph traced once, its inputs checked here; compiled in a child and loaded, as
    the default does on a GPU), beside the eager form."""
    import torch._dynamo

    from fp8scope.compiled import reset_dynamo

    print("\n1c. one compiled full-stats call, through torch.compile and called directly (bf16, per-tensor scale)")
    print(f"   {'size':>12s} {'eager us':>9s} {'torch.compile us':>17s} {'direct us':>10s}")
    os.environ["FP8SCOPE_COMPILE"] = "ahead"
    fmt = get_format("e4m3")
    key = (device, torch.bfloat16, fmt.name, False, False)
    reset_dynamo()
    through = torch.compile(stats_mod.FULL_STATS.eager(key), dynamic=True, options=stats_mod.FULL_STATS.options(key))
    with torch.no_grad():
        through(*stats_mod._full_examples(key))
    through = torch._dynamo.run(stats_mod.FULL_STATS.eager(key))
    for rows, cols in ((64, 64), (1024, 4096)):
        x = torch.randn(rows, cols, device=device).to(torch.bfloat16)
        s, si, e = (torch.tensor(v, device=device) for v in (100.0, 0.01, 4.48))
        stats_mod.FULL_STATS.ensure(key)
        direct = stats_mod.FULL_STATS.get(key)
        assert stats_mod.FULL_STATS.direct(key), stats_mod.FULL_STATS.failures
        eager = stats_mod.FULL_STATS.fallback(key)
        n = reps * 40
        with torch.no_grad():
            t_eager, t_through, t_direct = (timed(lambda f=f: f(x, s, si, e, None), n) for f in (eager, through, direct))
        print(f"   {rows:>5d}x{cols:<6d} {t_eager * 1e6:>9.1f} {t_through * 1e6:>17.1f} {t_direct * 1e6:>10.1f}")
    reset_dynamo()


def per_recipe(device: str, reps: int) -> None:
    from fp8scope.compiled import reset_dynamo
    from fp8scope.emulate.recipe_table import RECIPES

    rows, cols = SIZES[1]
    fmt = get_format("e4m3")
    print(f"\n1b. other recipes measured on one captured tensor, in its stats pass (Monitor(whatif_recipes=...), "
          f"full steps; bf16 {rows}x{cols}, activation): what each adds to the pass")
    print(f"   {'recipe':>9s} {'eager ops':>10s} {'kernels':>8s} {'eager ms':>9s} {'compiled ms':>12s}")
    x = torch.randn(rows, cols, device=device).to(torch.bfloat16)
    one = torch.ones((), device=device)
    base = (device, torch.bfloat16, fmt.name, False, False)
    alone = generated_kernels(stats_mod.FULL_STATS.eager(base), *stats_mod._full_examples(base))[0]
    for recipe in RECIPES:
        key = (*base, (recipe,), "activation", False)
        kernels = generated_kernels(stats_mod.FULL_STATS.eager(key), *stats_mod._full_examples(key))[0] - alone
        reset_dynamo()
        os.environ["FP8SCOPE_COMPILE"] = "0"
        call = lambda r=(recipe,): stats_mod.stats_call(x, one, one, one, fmt, recipes=r)  # noqa: E731
        plain = lambda: stats_mod.stats_call(x, one, one, one, fmt)  # noqa: E731
        ops = count_ops(call)[0] - count_ops(plain)[0]
        t_eager = timed(call, reps) - timed(plain, reps)
        os.environ["FP8SCOPE_COMPILE"] = "1"
        call(), plain()
        stats_mod.FULL_STATS.ensure(key), stats_mod.FULL_STATS.ensure(base)
        t_comp = timed(call, reps) - timed(plain, reps)
        print(f"   {recipe:>9s} {ops:>10d} {kernels:>8d} {t_eager * 1e3:>9.2f} {t_comp * 1e3:>12.2f}")


def step_ops(device: str) -> None:
    print("\n2. aten ops the monitor adds to one step of the tiny GPT (stats eager)")
    os.environ["FP8SCOPE_COMPILE"] = "0"
    for fp8, label in (("off", "what-if (plain FP32)"), ("delayed", "emulated FP8")):
        counts = {}
        for monitored in (False, True):
            setup = train.build(fp8=fp8, quiet=True, device=device)
            mon = None
            with tempfile.TemporaryDirectory() as tmp:
                if monitored:
                    mon = fp8scope.Monitor(setup.model, tmp, every=2, detect=False, full_on_anomaly=0,
                                           recipe=setup.recipe or None)
                for step in range(3):  # warm: keys made, states pending
                    train.train_step(setup, step, mon)
                for step, kind in ((3, "cheap"), (4, "full")):
                    # counting whole steps; the optimizer's ops are the same with and without a monitor
                    counts[(monitored, kind)] = count_ops(lambda: train.train_step(setup, step, mon))[0]
                n = len(mon.collector.keys) if mon else 0
                if mon:
                    mon.close()
        for kind in ("cheap", "full"):
            extra = counts[(True, kind)] - counts[(False, kind)]
            print(f"   {label:22s} {kind:5s} step: +{extra:5d} ops for {n} tensors = {extra / n:5.2f} per tensor")


def time_monitors(device: str, fp8: str, compiled: bool, configs: dict, rounds: int, block: int,
                  build: dict | None = None, env: dict | None = None, warmup: int | None = None,
                  plain: "train.Setup | None" = None):
    """Medians and paired ratios (:func:`overhead.time_interleaved`) of the demo model under each
    configuration: ``configs`` maps a name to the Monitor's keyword arguments, None for the model
    unmonitored ("plain", the ratios' reference). A monitor's what-if recipe is the model's own.
    ``build``: more ``train.build`` arguments (the model's size); ``env``: a configuration's name to
    environment variables set while its Monitor is made. ``plain``: an unmonitored setup an earlier
    call built (see :func:`demo_setup`), for the configurations that are None: a compiled model
    then compiles once for several calls."""
    setups = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, (name, kwargs) in enumerate(configs.items()):
                setup = plain if kwargs is None and plain is not None else demo_setup(device, fp8, compiled, build)
                extra = (env or {}).get(name, {})
                os.environ.update(extra)
                try:
                    mon = None if kwargs is None else fp8scope.Monitor(setup.model, os.path.join(tmp, str(i)),
                                                                       recipe=setup.recipe or None, **kwargs)
                finally:
                    for var in extra:
                        os.environ.pop(var, None)
                setups[name] = (setup, mon)
            sync = torch.cuda.synchronize if device.startswith("cuda") else None
            if warmup is None:
                warmup = 6 if compiled else 3
            return time_interleaved(setups, rounds, block, warmup=warmup, sync=sync)
        finally:
            for _, mon in setups.values():
                if mon is not None:
                    mon.close()


def compiled_kernels(device: str) -> None:
    """Section 2b: the kernels of a compiled demo-model step after the first ones (the third step's
    generated code, forward and backward), and the monitor's taps in it, unmonitored and monitored
    (cheap steps). Deterministic: the generated code is."""
    from torch._inductor.utils import run_and_get_code

    print("\n2b. A torch.compile'd demo-model step (the third): generated kernels, their launches and fp8scope's taps, "
          "forward + backward")
    for fp8 in ("delayed", "off"):
        for monitored in (False, True):
            torch._dynamo.reset()
            setup = demo_setup(device, fp8, True)
            with tempfile.TemporaryDirectory() as tmp:
                mon = fp8scope.Monitor(setup.model, tmp, every=10**6, detect=False) if monitored else None
                try:
                    train.train_step(setup, 0, mon)
                    train.train_step(setup, 1, mon)
                    _, codes = run_and_get_code(train.train_step, setup, 2, mon)
                finally:
                    if mon is not None:
                        mon.close()
            counts = [(*kernels_and_launches(c), c.count("torch.ops.fp8scope.observe")) for c in codes]
            cells = [" + ".join(str(c[i]) for c in counts) + f" = {sum(c[i] for c in counts)}" for i in range(3)]
            kind = "what-if" if fp8 == "off" else "emulated"
            print(f"   {kind:8s} {'monitored' if monitored else 'unmonitored':11s} "
                  f"kernels {cells[0]:14s} launches {cells[1]:14s} taps {cells[2]}")


def synchronizer(device: str):
    """Waits for the device's queued work before a step's time is read (nothing to wait for on a CPU)."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def child(device: str, *args: str, env: dict | None = None) -> dict:
    """This script run again in a fresh process (sections 4 and 4b: what a process does once, it
    does there); the JSON its last line prints."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", device, *args],
                         capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def demo_setup(device: str, fp8: str, compiled: bool, build: dict | None = None):
    """The demo model (``train.build``), compiled when asked."""
    setup = train.build(fp8=fp8, quiet=True, device=device, **(build or {}))
    if compiled:
        setup.model = torch.compile(setup.model)
    return setup


def ratios(device: str, rounds: int, block: int, compile_stats: bool, modes=("eager", "compiled"),
           models=("off", "delayed"), whatif_recipes=()) -> None:
    print("\n3. monitored / unmonitored step time, demo model (paired ratios, interleaved)")
    os.environ["FP8SCOPE_COMPILE"] = "sync" if compile_stats else "0"
    for compiled in [m == "compiled" for m in modes]:
        for fp8, label in [(f, lab) for f, lab in (("off", "what-if"), ("delayed", "emulated")) if f in models]:
            # each rate timed apart (a monitor's writer and detection child must not load the other's
            # blocks), against one unmonitored model: compiling a model is most of this section's time
            # on a GPU (the compiled emulated demo model's, about a minute each there)
            plain, cells = demo_setup(device, fp8, compiled), []
            for every in (50, 1):
                configs = {"plain": None, "monitored": dict(every=every)}
                if whatif_recipes:
                    configs["recipes"] = dict(every=every, whatif_recipes=whatif_recipes)
                medians, paired = time_monitors(device, fp8, compiled, configs, rounds, block, plain=plain)
                cells.append(f"every={every} {paired['monitored']:.3f}x"
                             + (f" (+recipes {paired['recipes']:.3f}x)" if whatif_recipes else ""))
            mode = "compiled" if compiled else "eager   "
            print(f"   {mode} {label:9s} plain {medians['plain'] * 1e3:7.1f} ms/step   {'  '.join(cells)}")


def ratio_parts(device: str, rounds: int, block: int) -> None:
    print("\n3b. where a what-if monitor's time goes at every=50, demo model, eager (paired ratios, interleaved)")
    os.environ["FP8SCOPE_COMPILE"] = "0" if device == "cpu" else "sync"
    configs = {
        "plain": None,
        "cheap captures only": dict(every=10**9, detect=False, full_on_anomaly=0),
        "  + online detection": dict(every=10**9, full_on_anomaly=0),
        "every=50, no detection, no extra full steps": dict(every=50, detect=False, full_on_anomaly=0),
        "every=50, the default monitor": dict(every=50),
    }
    medians, paired = time_monitors(device, "off", False, configs, rounds, block)
    for name in configs:
        print(f"   {name:45s} {medians[name] * 1e3:7.1f} ms/step   {paired[name]:.3f}x")


HOST_BOUND = dict(d_model=16, batch_size=1, seq_len=8, n_heads=2)  # the demo model with next to no arithmetic


def host_bound(device: str, rounds: int, block: int) -> None:
    """Section 3c: the demo model made so small that a step is its host work (Python, op dispatch),
    as a small or compiled model's step is on a GPU, where the host launches kernels while the GPU
    runs them. The monitor's own host work then shows in full: its captures, and its online
    detection in a child process (the default) or in a thread of the training process, where its
    Python holds the GIL that the training thread needs after every op."""
    print(f"\n3c. host-bound steps: the demo model at {HOST_BOUND}, what-if, eager, torch on one thread "
          "(paired ratios, interleaved)")
    os.environ["FP8SCOPE_COMPILE"] = "0" if device == "cpu" else "sync"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    configs = {
        "plain": None,
        "cheap captures only (no online detection)": dict(every=10**9, detect=False, full_on_anomaly=0),
        "every=50, detection in a child process (default)": dict(every=50),
        "every=50, detection in a thread": dict(every=50),
    }
    try:
        medians, paired = time_monitors(device, "off", False, configs, rounds, block * 2, build=HOST_BOUND,
                                        env={"every=50, detection in a thread": {"FP8SCOPE_DETECT_PROCESS": "0"}},
                                        warmup=6)
    finally:
        torch.set_num_threads(threads)
    for name in configs:
        print(f"   {name:50s} {medians[name] * 1e3:7.2f} ms/step   {paired[name]:.3f}x")


def moe(device: str, rounds: int, block: int, modes=("eager",)) -> None:
    """Section 3d: a Mixtral's experts (3-D weights, ``capture/adapters/experts.py``) under each
    experts implementation, eager and (``modes``) compiled: ops a cheap step adds, and the step-time
    ratio at ``every=50``."""
    from detection_suite import _hf_setup

    os.environ["FP8SCOPE_COMPILE"] = "0" if device == "cpu" else "sync"
    print("\n3d. MoE experts: a transformers Mixtral (4 layers, width 128, 8 experts, 2 per token), what-if "
          "(ops against the same step unmonitored; paired ratios, interleaved)")
    print("   implementation        tensors   ops a cheap step adds   every=50 ms/step   ratio   graphs (breaks)")
    runs = [(impl, False) for impl in ("eager", "grouped_mm", "batched_mm") if "eager" in modes]
    runs += [(impl, True) for impl in ("grouped_mm", "batched_mm") if "compiled" in modes]
    for impl, compiled in runs:
        def setup_of():
            setup = _hf_setup(train.build(fp8="off", quiet=True, device=device), "mixtral", experts=impl)
            if compiled:
                setup.model = torch.compile(setup.model)
            return setup

        graphs = ""
        if compiled:
            from fp8scope.compiled import reset_dynamo

            reset_dynamo()
            probe = setup_of()
            with tempfile.TemporaryDirectory() as tmp:
                mon = fp8scope.Monitor(probe.model, tmp, every=10**9, detect=False)
                x, _ = probe.batches.next()
                got = torch._dynamo.explain(probe.model._orig_mod)(x)
                mon.close()
            graphs = f"{got.graph_count} ({got.graph_break_count})"

        counts, n = {}, 0
        for monitored in (False, True):
            setup = setup_of()
            with tempfile.TemporaryDirectory() as tmp:
                mon = fp8scope.Monitor(setup.model, tmp, every=10**9, detect=False, full_on_anomaly=0) if monitored \
                    else None
                for step in range(3):  # warm: keys made
                    train.train_step(setup, step, mon)
                counts[monitored] = count_ops(lambda: train.train_step(setup, 3, mon))[0]
                if mon:
                    n = len(mon.collector.keys)
                    mon.close()
        plain, mon_setup = setup_of(), setup_of()
        with tempfile.TemporaryDirectory() as tmp:
            mon = fp8scope.Monitor(mon_setup.model, tmp, every=50)
            try:
                sync = torch.cuda.synchronize if device.startswith("cuda") else None
                medians, paired = time_interleaved({"plain": (plain, None), "every=50": (mon_setup, mon)}, rounds, block,
                                                   warmup=3, sync=sync)
            finally:
                mon.close()
        label = f"{impl}, compiled" if compiled else impl
        print(f"   {label:21s} {n:7d}   {counts[True] - counts[False]:21d}   {medians['every=50'] * 1e3:16.1f}   "
              f"{paired['every=50']:.3f}x   {graphs}")


def moe_scale(device: str, rounds: int, block: int, layers: int, experts: int) -> None:
    """Section 3e: a MoE with a large model's counts of layers and experts at tiny widths (Qwen3-30B-A3B's
    48 layers of 128 experts, 8 per token, by default): what a monitor costs when its tensors number
    tens of thousands. The first step (every tensor's state and key made, full stats), the ops a cheap
    step adds, the step-time ratios, and the rows and bytes a step logs."""
    import transformers

    os.environ["FP8SCOPE_COMPILE"] = "0" if device == "cpu" else "sync"
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 32), generator=g).to(device) for _ in range(8)]

    def build():
        torch.manual_seed(0)
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=16, intermediate_size=64,
            max_position_embeddings=64)
        model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm").to(device)
        return model, torch.optim.AdamW(model.parameters(), 1e-3)

    def step_fn(setup, step, mon):
        model, opt = setup
        ids = batches[step % len(batches)]
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step(loss=out.loss)

    sync = synchronizer(device)
    print(f"\n3e. MoE at scale: a transformers Qwen3-MoE, {layers} layers x {experts} experts (8 per token), widths "
          "32 / 16, grouped_mm, what-if, eager")
    counts, first = {}, {}
    for monitored in (False, True):
        setup = build()
        with tempfile.TemporaryDirectory() as tmp:
            mon = fp8scope.Monitor(setup[0], tmp, every=10**9, detect=False, full_on_anomaly=0) if monitored else None
            sync()
            t0 = time.perf_counter()
            step_fn(setup, 0, mon)
            sync()
            first[monitored] = time.perf_counter() - t0
            for step in range(1, 3):
                step_fn(setup, step, mon)
            counts[monitored] = count_ops(lambda: step_fn(setup, 3, mon))[0]
            if mon:
                tensors = len(mon.collector.keys)
                mon.close()
    print(f"   {tensors} tensors; step 0 (states, keys, full stats): {first[True]:.2f} s monitored, "
          f"{first[False]:.2f} s not; a cheap step adds {counts[True] - counts[False]} aten ops")
    plain, cheap, default = build(), build(), build()
    with tempfile.TemporaryDirectory() as tmp:
        mons = {"cheap": fp8scope.Monitor(cheap[0], os.path.join(tmp, "cheap"), every=10**9, detect=False,
                                          full_on_anomaly=0),
                "default": fp8scope.Monitor(default[0], os.path.join(tmp, "default"), every=50)}
        try:
            medians, paired = time_interleaved(
                {"plain": (plain, None), "cheap captures only": (cheap, mons["cheap"]),
                 "every=50 (the default monitor)": (default, mons["default"])},
                rounds, block, warmup=3, sync=sync if device.startswith("cuda") else None, step_fn=step_fn)
        finally:
            for m in mons.values():
                m.close()
        t0 = time.perf_counter()
        rows = fp8scope.load_run(os.path.join(tmp, "default")).tensors()
        read_s = time.perf_counter() - t0
        steps = rows["step"].nunique()
        streams = os.path.join(tmp, "default", "streams")
        size = sum(os.path.getsize(os.path.join(streams, f)) for f in os.listdir(streams) if f.startswith("tensors"))
        full = int(rows.groupby("step")["full"].any().sum())
    for name in medians:
        print(f"   {name:34s} {medians[name] * 1e3:8.1f} ms/step   {paired[name]:.3f}x")
    print(f"   the default monitor logged {len(rows) / steps:,.0f} rows a step, {size / steps / 1e6:.2f} MB a step "
          f"({size / len(rows):.0f} bytes a row) in its tensors stream, read back as a DataFrame in {read_s:.2f} s; "
          f"{full} of its {steps} steps took full stats")


def first_steps(device: str, steps: int, modes: tuple[str, ...], cap_s: float = 120.0, cold: bool = True) -> None:
    """Section 4: the first steps of a fresh process under each ``FP8SCOPE_COMPILE`` mode, each
    in a process of its own (a variant compiles once per process), with inductor's cache empty
    (``cold``) or as earlier runs left it."""
    print(f"\n4. the first steps of a fresh process (at least {steps}, and on until the stats run compiled, "
          f"at most {cap_s:.0f} s), demo model, what-if, full stats every 10th, each mode in a process of its own, "
          f"inductor's cache {'empty' if cold else 'as earlier runs left it'}")
    print("   mode     step 0 ms   slowest later ms (step)   median ms   steps   all steps s   stats compiled from step (s)")
    for mode in modes:
        with tempfile.TemporaryDirectory() as cache:  # inductor's cache empty, as on a run's first day
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache) if cold else None
            r = child(device, "--first-run", mode, "--first-steps", str(steps), "--first-cap", str(cap_s), env=env)
        ms = [t * 1e3 for t in r["times"]]
        ready = f"{r['compiled_from']} ({r['compiled_at_s']:.1f} s)" if r["compiled_from"] is not None else "-"
        worst = max(range(1, len(ms)), key=ms.__getitem__, default=0)  # past step 0 (CUDA's and the allocator's start)
        print(f"   {mode:6s} {ms[0]:11.0f} {ms[worst]:18.0f} {f'({worst})':>6s} {sorted(ms)[len(ms) // 2]:11.1f} {len(ms):7d}"
              f" {sum(ms) / 1e3:13.2f}   {ready}")


def first_run(device: str, mode: str, steps: int, cap_s: float = 120.0) -> None:
    """One process of section 4: timed training steps, then JSON on the last line."""
    import json

    os.environ["FP8SCOPE_COMPILE"] = mode
    sync = synchronizer(device)
    setup = train.build(fp8="off", quiet=True, device=device)
    family = stats_mod.FULL_STATS
    times, compiled_from, compiled_at = [], None, None

    def compiled() -> bool:
        asked = set(family._ahead) | family._tried
        return bool(asked) and all(k in family._ready or k in family.failures for k in asked)

    with tempfile.TemporaryDirectory() as tmp:
        with fp8scope.Monitor(setup.model, tmp, every=10, detect=False) as mon:
            start = time.perf_counter()
            step = 0
            while step < steps or (mode != "0" and compiled_from is None and time.perf_counter() - start < cap_s):
                t0 = time.perf_counter()
                train.train_step(setup, step, mon)
                sync()
                times.append(time.perf_counter() - t0)
                step += 1
                if compiled_from is None and mode != "0" and compiled():
                    compiled_from, compiled_at = step, time.perf_counter() - start
    print(json.dumps({"times": times, "compiled_from": compiled_from, "compiled_at_s": compiled_at}))


def restarts(device: str, models: tuple[str, ...], steps: int) -> None:
    """Section 4b: a compiled model's first ``steps`` steps in two fresh processes over one inductor
    cache, empty for the first."""
    print(f"\n4b. a restart of the compiled demo model: its first {steps} steps in a fresh process, twice over one "
          f"inductor cache (empty for the first process); FX graph cache and AOT autograd cache hit/miss/bypass")
    print("   model      monitor        first start s   restart s   restart: FX graphs h/m/b   AOT autograd h/m/b")
    for fp8 in models:
        for monitored in (False, True):
            runs = []
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                for _ in range(2):
                    runs.append(child(device, "--restart-run", f"{fp8},{int(monitored)}", "--restart-steps", str(steps),
                                      env=env))
            again = runs[1]
            print(f"   {'what-if' if fp8 == 'off' else 'emulated':10s} {'every=50' if monitored else 'none':10s}"
                  f" {runs[0]['s']:15.1f} {again['s']:11.1f}   {again['fx']:>24s}   {again['aot']:>18s}")


def restart_run(device: str, spec: str, steps: int) -> None:
    """One process of section 4b: build, compile, ``steps`` steps; JSON on the last line."""
    import json

    from torch._dynamo.utils import counters

    fp8, monitored = spec.split(",")
    sync = synchronizer(device)
    start = time.perf_counter()
    setup = demo_setup(device, fp8, compiled=True)
    with tempfile.TemporaryDirectory() as tmp:
        mon = fp8scope.Monitor(setup.model, tmp, every=50, detect=False) if monitored == "1" else None
        for step in range(steps):
            train.train_step(setup, step, mon)
        sync()
        took = time.perf_counter() - start
        if mon is not None:
            mon.close()

    def hmb(group: str, prefix: str) -> str:
        return "/".join(str(counters[group][f"{prefix}_{k}"]) for k in ("hit", "miss", "bypass"))

    print(json.dumps({"s": took, "fx": hmb("inductor", "fxgraph_cache"), "aot": hmb("aot_autograd", "autograd_cache")}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sections", default="tensor,calls,recipes,ops,ratio")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile-stats", action="store_true", help="section 3: compile the stats on the CPU too")
    ap.add_argument("--no-compile-stats", action="store_true", help="section 3: eager stats on a GPU too")
    ap.add_argument("--modes", default="eager,compiled", help="section 3: the model eager, compiled, or both")
    ap.add_argument("--models", default="off,delayed", help="sections 3 and 4b: off (what-if), delayed (emulated)")
    ap.add_argument("--whatif-recipes", default="", help="section 3: also time a monitor measuring these recipes "
                                                         "(comma-separated; 'all': every one)")
    ap.add_argument("--first-steps", type=int, default=60, help="section 4: steps per mode")
    ap.add_argument("--first-modes", default="0,sync,ahead", help="section 4: FP8SCOPE_COMPILE modes")
    ap.add_argument("--first-cap", type=float, default=120.0, help="section 4: at most this many seconds per mode")
    ap.add_argument("--first-warm", action="store_true", help="section 4: inductor's cache as earlier runs left it")
    ap.add_argument("--moe-modes", default="eager", help="section 3d: the model eager, compiled, or both")
    ap.add_argument("--moe-layers", type=int, default=48, help="section 3e: the MoE's layers")
    ap.add_argument("--moe-experts", type=int, default=128, help="section 3e: its experts per layer")
    ap.add_argument("--restart-steps", type=int, default=3, help="section 4b: steps per process")
    ap.add_argument("--first-run", help=argparse.SUPPRESS)  # one process of section 4
    ap.add_argument("--restart-run", help=argparse.SUPPRESS)  # one process of section 4b
    args = ap.parse_args()
    if args.first_run is not None:
        first_run(args.device, args.first_run, args.first_steps, args.first_cap)
        return 0
    if args.restart_run is not None:
        restart_run(args.device, args.restart_run, args.restart_steps)
        return 0
    sections = args.sections.split(",")
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads")
    if "tensor" in sections:
        per_tensor(args.device, args.reps)
    if "calls" in sections:
        call_cost(args.device, args.reps)
    if "recipes" in sections:
        per_recipe(args.device, args.reps)
    if "kernels" in sections:
        compiled_kernels(args.device)
    if "ops" in sections:
        step_ops(args.device)
    if "parts" in sections:
        ratio_parts(args.device, args.rounds, args.block)
    if "hostbound" in sections:
        host_bound(args.device, args.rounds, args.block)
    if "moe" in sections:
        moe(args.device, args.rounds, args.block, args.moe_modes.split(","))
    if "moescale" in sections:
        moe_scale(args.device, args.rounds, args.block, args.moe_layers, args.moe_experts)
    if "ratio" in sections:
        compile_stats = args.compile_stats or (args.device != "cpu" and not args.no_compile_stats)
        from fp8scope.emulate.recipe_table import RECIPES

        recipes = RECIPES if args.whatif_recipes == "all" else tuple(r for r in args.whatif_recipes.split(",") if r)
        ratios(args.device, args.rounds, args.block, compile_stats, args.modes.split(","),
               args.models.split(","), recipes)
    if "first" in sections:
        first_steps(args.device, args.first_steps, tuple(args.first_modes.split(",")), args.first_cap,
                    cold=not args.first_warm)
    if "restart" in sections:
        restarts(args.device, tuple(args.models.split(",")), args.restart_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
