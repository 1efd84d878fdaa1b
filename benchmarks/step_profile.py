"""Where a monitored cheap step's extra time goes: GPU kernels, the training thread's host time,
host syncs, or the monitor's other threads.

Why: a ratio of step times (the 1.1B Llama's cheap step on an H100, docs/benchmarks.md, "On a
GPU") cannot say which of these it is. A step whose GPU work outlasts its host
work hides the host's extra time, unless a sync makes the two add up; a step the host bounds shows
every microsecond of it. So this prints, for the plain and the monitored model (what-if, cheap
steps), per step:

- the step's wall time (synchronized once per block of steps, as ``large_model.py`` times it);
- the GPU: kernels launched, and their summed device time (``torch.profiler``), with the kernels
  the monitor adds the most time to;
- host syncs, by thread: each CUDA runtime call that waits for the device
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking
  ``cudaMemcpy``), counted, with their time (the training thread's hold its launches back; the
  monitor's writer waits for a step's rows, which is no stall of training);
- CPU time per thread (``/proc/self/task``): the training thread, autograd's device threads (which
  run the backward and its hooks on a GPU), the monitor's writer and detector, the rest;

- the training thread's Python profile (``cProfile``), monitored minus plain: which functions its
  extra CPU time goes to (on an H100 the monitor added far more of it than kernel time);
- ``torch.profiler``'s host side, monitored minus plain: each aten op's own host time (on a GPU
  its dispatch and launch) and each CUDA runtime call's (launches, memsets, allocations), by
  thread: which part of the extra host time is torch's and the driver's rather than Python's;

and all of it but the Python profile again for the monitor without online detection (its thread's
Python competes with the training thread for the GIL, whatever the number of cores). Then the
cheap capture's amax pass alone (``aminmax``) on the step's tensor shapes, against other
reductions that give the amax, in GB/s: whether that pass runs at the memory's speed (on an H200
``aminmax`` read 925 GB/s where the weights' multi-tensor norm read about 2 TB/s, so that one is
timed a tensor a call too).

    python benchmarks/step_profile.py --device cuda            # the 1.1B Llama on a GPU
    python benchmarks/step_profile.py --size narrow --batch 2 --seq 32   # on a CPU: no device tables
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8scope  # noqa: E402
from large_model import Setup, full_steps, model_args, train_step  # noqa: E402
from overhead import time_interleaved  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, by name: Python threads by their ``threading``
    name, the others by the name the OS knows them by (torch names autograd's ``pt_autograd_N``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = collections.defaultdict(float)
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        out[names.get(int(tid)) or comm] += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return dict(out)


def _group(name: str) -> str:
    if name == "MainThread":
        return "training thread"
    if name.startswith("pt_autograd"):
        return "pt_autograd (backward)"
    if name.startswith("fp8scope"):  # the writer and the detector
        return f"monitor: {name}"
    return "other threads"


class ThreadCpu:
    """CPU ms per step per thread group, block by block (``time_interleaved``'s ``around_block``)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.blocks: dict[str, list[dict[str, float]]] = collections.defaultdict(list)

    def __call__(self, label: str):
        cpu0 = thread_cpu()

        def after() -> None:
            groups: dict[str, float] = collections.defaultdict(float)
            for name, seconds in thread_cpu().items():
                groups[_group(name)] += (seconds - cpu0.get(name, 0.0)) / self.steps * 1e3
            self.blocks[label].append(dict(groups))

        return after

    def medians(self, label: str) -> dict[str, float]:
        blocks = self.blocks[label]
        return {g: statistics.median(b.get(g, 0.0) for b in blocks) for g in {g for b in blocks for g in b}}


def profiled(setup: Setup, mon, first: int, sync, n: int = 3) -> dict:
    """``torch.profiler`` over ``n`` steps, per step: kernels (launches, device ms), host syncs, the
    CUDA runtime calls by name and thread (count, host ms: launches, memsets, allocations), and the
    aten ops (count, self host ms: an op's dispatch and launch on a GPU, its work too on a CPU).
    ``sync``: None on a CPU (no device activity recorded)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if sync is not None else [])
    with torch_profile(activities=activities) as prof:
        for step in range(first, first + n):
            train_step(setup, step, mon)
        if sync is not None:
            sync()
    kernels: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    syncs: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    runtime: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    ops: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    threads = {t.native_id: t.name for t in threading.enumerate()}  # the profiler's thread ids are the OS's
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.self_device_time_total / 1e3
            continue
        name = threads.get(ev.thread)
        where = _group(name) if name else f"thread {ev.thread}"
        if ev.name.startswith("aten::"):
            o = ops[ev.name]
            o[0] += 1
            o[1] += ev.self_cpu_time_total / 1e3
        elif ev.name.startswith("cu"):  # the CUDA runtime and driver calls
            r = runtime[f"{ev.name} ({where})"]
            r[0] += 1
            r[1] += ev.cpu_time_total / 1e3
        if ev.name.startswith(SYNC_CALLS) and not ev.name.startswith("cudaMemcpyAsync"):
            # whose wait: the training thread's stalls the launches, the writer's waits for a step's rows
            s = syncs[f"{ev.name} ({where})"]
            s[0] += 1
            s[1] += ev.cpu_time_total / 1e3
    per_step = lambda d: {k: (c / n, ms / n) for k, (c, ms) in d.items()}  # noqa: E731
    return {"kernels": per_step(kernels), "syncs": per_step(syncs), "runtime": per_step(runtime), "ops": per_step(ops)}


def print_added(title: str, plain: dict, monitored: dict, top: int = 10) -> None:
    """The entries of a ``profiled`` table the monitor adds the most host time to, per step."""
    added = {k: (c - plain.get(k, (0, 0.0))[0], ms - plain.get(k, (0, 0.0))[1]) for k, (c, ms) in monitored.items()}
    total = sum(ms for _, ms in added.values())
    print(f"   {title}, monitored - plain: {total:+.2f} ms a step; most added:")
    for k, (c, ms) in sorted(added.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"      {ms:+7.2f} ms  {c:+7.0f} calls  {k[:100]}")


def host_profile(setup: Setup, mon, first: int, sync, n: int = 3) -> dict[str, tuple[float, float]]:
    """The training thread's Python profile (``cProfile``: this thread only; autograd's device
    threads run the backward's hooks unseen) over ``n`` steps: per function, calls and self ms per
    step. The monitored model's minus the plain one's says which functions the training thread's
    extra CPU time is spent in (the profiler inflates each call alike: read it as shares)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for step in range(first, first + n):
        train_step(setup, step, mon)
    if sync is not None:
        sync()
    prof.disable()
    out = {}
    for (path, line, func), (_, calls, self_s, _, _) in pstats.Stats(prof).stats.items():
        where = func if path == "~" else f"{path.split('site-packages/')[-1].split('fp8scope/')[-1]}:{func}"
        c, ms = out.get(where, (0.0, 0.0))
        out[where] = (c + calls / n, ms + self_s * 1e3 / n)
    return out


def print_host_diff(plain: dict, monitored: dict, top: int = 15) -> None:
    total = sum(ms for _, ms in monitored.values()) - sum(ms for _, ms in plain.values())
    print(f"   the training thread's Python, monitored - plain (cProfile, {total:+.1f} ms a step, inflated); "
          "most added self time:")
    added = {k: (c - plain.get(k, (0, 0))[0], ms - plain.get(k, (0, 0.0))[1]) for k, (c, ms) in monitored.items()}
    for k, (c, ms) in sorted(added.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"      {ms:+7.2f} ms  {c:+7.0f} calls  {k[:100]}")


def amax_kernels(shapes: list[tuple[int, ...]], device: str, dtype: torch.dtype, reps: int = 10) -> None:
    """The cheap capture's one pass over each captured tensor, timed alone on the step's shapes, with
    other one-pass reductions that give the amax (and the weights' multi-tensor norm, a tensor a
    call): whether the pass runs at the memory's speed."""
    ops = {"aminmax (the capture's)": torch.aminmax,
           "vector_norm(inf)": lambda x: torch.linalg.vector_norm(x, float("inf")),
           "_foreach_norm(inf) of one": lambda x: torch._foreach_norm([x], float("inf")),  # the weights' kernel
           "amax of abs (2 passes)": lambda x: x.abs().amax()}
    counts = collections.Counter(shapes)
    total_bytes = sum(n * math.prod(shape) * torch.finfo(dtype).bits // 8 for shape, n in counts.items())
    on_gpu = device.startswith("cuda")
    for name, op in ops.items():
        seconds = 0.0
        for shape, n in counts.items():
            x = torch.randn(shape, device=device).to(dtype)
            op(x)
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                op(x)
            if on_gpu:
                torch.cuda.synchronize()
            seconds += (time.perf_counter() - t0) / reps * n
        print(f"   {name:26s} {seconds * 1e3:8.2f} ms for a step's {len(shapes)} captures "
              f"({total_bytes / 1e9:.2f} GB: {total_bytes / seconds / 1e9:7.1f} GB/s)")


def report(label: str, r: dict) -> None:
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
    print(f"   {label:9s} step {r['wall']:8.1f} ms   CPU ms per step: {cpu}")
    if r.get("kernels"):
        launches = sum(c for c, _ in r["kernels"].values())
        busy = sum(ms for _, ms in r["kernels"].values())
        syncs = ", ".join(f"{k} {c:.1f}x {ms:.2f} ms" for k, (c, ms) in sorted(r["syncs"].items())) or "none"
        print(f"   {'':9s} GPU: {launches:.0f} kernels, {busy:.1f} ms of kernel time   host syncs per step: {syncs}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap)
    ap.add_argument("--steps", type=int, default=10, help="steps a timed block")
    ap.add_argument("--rounds", type=int, default=3, help="timed blocks per configuration, interleaved")
    args = ap.parse_args()
    on_gpu = args.device.startswith("cuda")
    os.environ.setdefault("FP8SCOPE_COMPILE", "sync" if on_gpu else "0")
    sync = torch.cuda.synchronize if on_gpu else None
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"torch {torch.__version__}, {name}, Llama {args.size}, batch {args.batch} x {args.seq} tokens, bf16, "
          f"what-if, cheap steps (every=50), median of {args.rounds} interleaved blocks of {args.steps} steps")
    configs = {"plain": None, "monitored": True, "no detect": False}  # detect=...
    setups = {label: Setup(args.size, "off", args.device, args.batch, args.seq) for label in configs}
    tmp = tempfile.TemporaryDirectory()
    mons = {label: None if detect is None else fp8scope.Monitor(
        setups[label].model, os.path.join(tmp.name, label.replace(" ", "_")), every=50,
        recipe=setups[label].recipe, detect=detect) for label, detect in configs.items()}
    cpu = ThreadCpu(args.steps)
    # interleaved blocks (the machine's drift falls on every configuration), after a warm-up of 3
    # steps each: the allocator, the monitor's full step 0 and its compiles
    walls, _ = time_interleaved({label: (setups[label], mons[label]) for label in configs}, args.rounds, args.steps,
                                warmup=3, sync=sync, step_fn=train_step, around_block=cpu)
    results = {}
    for label in configs:
        results[label] = {"wall": walls[label] * 1e3, "cpu": cpu.medians(label)}
        try:  # after the timed blocks (the profiler's own cost stays out of them); the times above are
            # worth printing whatever the profiler of this torch does
            results[label] |= profiled(setups[label], mons[label], 0, sync)
        except Exception as exc:
            print(f"   ({label}: torch.profiler failed: {type(exc).__name__}: {exc})")
        if label != "no detect":
            results[label]["python"] = host_profile(setups[label], mons[label], 0, sync)
        report(label, results[label])
    shapes = [k.shape for k in mons["monitored"].collector.keys]
    for label, mon in mons.items():
        if mon is not None:
            mon.close()
            full = full_steps(os.path.join(tmp.name, label.replace(" ", "_")))
            if full != [0]:  # the monitor's triage took full steps: not every timed step was cheap
                print(f"   ({label}: full steps {full})")
    tmp.cleanup()
    del setups, mons
    if on_gpu:
        torch.cuda.empty_cache()
    print("   the amax pass alone, on the monitored tensors' shapes (bf16), back to back:")
    try:
        amax_kernels(shapes, args.device, torch.bfloat16)
    except Exception as exc:  # e.g. out of memory on a smaller GPU: the summary below still prints
        print(f"   (failed: {type(exc).__name__}: {exc})")
    p, m = results["plain"], results["monitored"]
    nd = results["no detect"]
    print(f"   the monitor adds {m['wall'] - p['wall']:.1f} ms a step ({m['wall'] / p['wall']:.3f}x; without online "
          f"detection {nd['wall'] - p['wall']:.1f} ms, {nd['wall'] / p['wall']:.3f}x); CPU per step, "
          "monitored - plain: " + ", ".join(f"{k} {m['cpu'].get(k, 0) - p['cpu'].get(k, 0):+.1f} ms"
                                            for k in sorted(set(m["cpu"]) | set(p["cpu"]))))
    print_host_diff(p["python"], m["python"])
    if "ops" in m and "ops" in p:
        print_added("aten ops' own host time (every thread)", p["ops"], m["ops"])
    if m.get("runtime"):
        print_added("CUDA runtime calls' host time", p.get("runtime", {}), m["runtime"])
    if m.get("kernels"):
        added = {k: m["kernels"][k][1] - p["kernels"].get(k, (0, 0.0))[1] for k in m["kernels"]}
        gpu = sum(ms for _, ms in m["kernels"].values()) - sum(ms for _, ms in p["kernels"].values())
        print(f"   GPU kernel time {gpu:+.2f} ms a step; most added:")
        for k, ms in sorted(added.items(), key=lambda kv: -kv[1])[:6]:
            print(f"      {ms:+7.2f} ms  {m['kernels'][k][0]:5.0f} launches  {k[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
