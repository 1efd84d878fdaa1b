"""The Triton kernels and launches inductor generates for fp8scope's compiled functions on CUDA,
counted on a machine without a GPU.

Why: on a GPU a tensor's full-stats pass costs what its launches cost the host, and the CPU's own
proxy (inductor's C++ kernels) does not show them: the same graph was 1 C++ kernel and 17 Triton
launches on an H200. This script traces each function on fake CUDA tensors (dynamic sizes, as
``fp8scope.compiled`` compiles them), runs inductor's lowering and Triton code generation, and
stops before anything would be compiled for a device, so no GPU and no CUDA toolkit are needed.
It reproduced the H200's count for the pre-fusion full-stats pass exactly (12 kernels, 17 launches,
the same kernel names).

It needs triton (inductor generates Triton code through it): ``.ci/setup.sh`` installs it into
``.triton/``, apart from the venv, so that nothing else in the tests sees it. It stands in for the
CUDA runtime by patching torch (device properties: an H100's; RNG state; device guards): it was
written against torch 2.13 and triton 3.9, and a later torch may need the patches adjusted.

    python benchmarks/triton_kernels.py          # .ci/setup.sh puts triton in .triton/ (used if present)
    python benchmarks/triton_kernels.py --code /tmp/full_stats_triton.py   # also write the code
    python benchmarks/triton_kernels.py --recipes ''                       # without the other recipes

Counts only: how fast the kernels run needs a GPU (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)


def fake_cuda() -> None:
    """Make a CPU-only torch believe in one H100 for as long as inductor asks (this process only)."""
    props = collections.namedtuple(
        "Props", "name major minor multi_processor_count total_memory regs_per_multiprocessor "
                 "max_threads_per_multi_processor warp_size L2_cache_size shared_memory_per_block_optin "
                 "max_threads_per_block gcnArchName")("NVIDIA H100", 9, 0, 132, 80 << 30, 65536, 2048, 32, 50 << 20,
                                                      232448, 1024, "")
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda._lazy_init = lambda: None
    cuda.get_device_properties = lambda *a, **k: props
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.get_device_name = lambda *a, **k: props.name
    cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    cuda.set_rng_state = lambda *a, **k: None
    cuda._exchange_device = lambda d: 0
    cuda._maybe_exchange_device = lambda d: 0
    cuda.set_device = lambda d: None

    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as config
    import torch._inductor.fx_passes.joint_graph as joint_graph
    import torch.utils._triton as torch_triton
    from triton.backends.compiler import GPUTarget

    config.compile_threads = 1
    config.fx_graph_cache = False
    config.pattern_matcher = False  # its patterns are traced on real device tensors
    config.joint_graph_constant_folding = False  # folds by running ops on the device
    joint_graph.lazy_init = lambda *a, **k: None
    compile_fx.get_cuda_device_context = lambda gm: contextlib.nullcontext()

    class Backend:
        target = GPUTarget("cuda", 90, 32)

        def hash(self) -> str:
            return "fake-cuda"

    torch_triton.triton_hash_with_backend = lambda: "fake-cuda"
    torch_triton.triton_backend = lambda: Backend()


class _Stop(BaseException):
    pass


def triton_code(fn, examples: tuple, options: dict | None = None) -> str:
    """Inductor's output code for ``fn`` on fake CUDA copies of ``examples``, traced as the product
    traces what it compiles (``fp8scope.compiled.trace``: every dimension above 1 dynamic, equal
    sizes sharing a symbol as dynamo's duck sizing does)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering

    from fp8scope.compiled import trace

    graph, fakes, _ = trace(fn, examples, fake_device="cuda:0")
    got: list[str] = []
    codegen = GraphLowering.codegen

    def capture(self, *a, **k):
        out = codegen(self, *a, **k)
        code = out[0] if isinstance(out, tuple) else out
        got.append(str(getattr(code, "value", code)))
        raise _Stop  # before the module is loaded, which would compile the kernels for a device

    GraphLowering.codegen = capture
    try:
        with config.patch(options or {}):
            compile_fx(graph, fakes)
    except _Stop:
        pass
    except Exception as exc:  # inductor wraps what the stand-in raised
        if not got:
            raise exc
    finally:
        GraphLowering.codegen = codegen
    return got[-1]


def kernels_and_launches(code: str) -> tuple[int, int]:
    """The kernels in inductor's output code (Triton or C++) and the launches one call of it makes
    (a Triton kernel can run more than once: a split reduction's finishing kernel per output)."""
    names = re.findall(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", code, flags=re.M)
    return len(names), sum(len(re.findall(rf"^\s+{n}(?:\.run)?\(", code, flags=re.M)) for n in names)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", help="write the generated code of the first full-stats variant here")
    ap.add_argument("--json", action="store_true", help="one JSON object: {name: [kernels, launches]}")
    ap.add_argument("--recipes", default="current,block128,rowwise,mxfp8_floor,bf16",
                    help="the other recipes to count a full-stats variant with, one at a time (comma-separated; "
                         "'' for none; mxfp8 and nvfp4 make constants on the device, which the generator cannot trace)")
    args = ap.parse_args()
    if os.path.isdir(os.path.join(_ROOT, ".triton")):  # .ci/setup.sh installs triton there, apart from the venv
        sys.path.append(os.path.join(_ROOT, ".triton"))
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.stderr.write("benchmarks/triton_kernels.py needs triton: bash .ci/setup.sh, or pip install triton\n")
        return 2
    fake_cuda()
    from fp8scope.capture import stats
    from fp8scope.emulate import amax

    counts: dict[str, list[int]] = {}
    say = (lambda *a, **k: None) if args.json else print
    say(f"torch {torch.__version__}: Triton kernels (launches) per call, generated for an H100 without a GPU")
    variants = [("bf16, per-tensor scale (what-if, TE, torchao tensorwise)", (torch.bfloat16, "e4m3", False, False)),
                ("bf16, a dequantized copy given (the emulated layer)", (torch.bfloat16, "e4m3", False, True)),
                ("fp32, per-row scales and a copy (block / rowwise)", (torch.float32, "e5m2", True, True))]
    say("full stats:")
    for i, (label, rest) in enumerate(variants):
        key = ("cuda", *rest)
        examples = stats._full_examples(("cpu", *rest))
        now = triton_code(stats.traced_form(key), examples, stats.FULL_STATS.options(key))
        if i == 0 and args.code:
            with open(args.code, "w") as f:
                f.write(now)
        counts[f"full_stats {rest}"] = list(kernels_and_launches(now))
        say("   {:58s} {:>3d} ({:>2d})".format(label, *counts[f"full_stats {rest}"]))
    recipes = [r for r in args.recipes.split(",") if r]
    if recipes:
        say("full stats measuring one other recipe too (Monitor(whatif_recipes=...), full steps; bf16 activation):")
    for recipe in recipes:
        rest = (torch.bfloat16, "e4m3", False, False, (recipe,), "activation", False)
        key = ("cuda", *rest)
        examples = stats._full_examples(("cpu", *rest))
        now = triton_code(stats.traced_form(key), examples, stats.FULL_STATS.options(key))
        counts[f"full_stats + {recipe}"] = list(kernels_and_launches(now))
        say("   {:58s} {:>3d} ({:>2d})".format(recipe, *counts[f"full_stats + {recipe}"]))
    ex = amax._examples(("cpu", torch.bfloat16))
    counts["amax_pair"] = list(kernels_and_launches(triton_code(amax._fused_pair, ex, amax.AMAX.options(("cuda", torch.bfloat16)))))
    counts["amax_pair eager form"] = list(kernels_and_launches(triton_code(amax.amaxes_of, ex)))
    say("amax pair (the emulated layer's amax, every step):")
    say("   {:58s} {:>3d} ({:>2d})   the eager form compiled: {:>3d} ({:>2d})".format(
        "bf16", *counts["amax_pair"], *counts["amax_pair eager form"]))
    if args.json:
        import json

        print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
