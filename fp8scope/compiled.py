"""Small tensor functions compiled once per variant, at first use, on the thread that calls them.

Why: fp8scope's per-tensor work (full stats, the amax pass) is a handful of reductions over one
tensor. Eager, each op is a kernel launch on CUDA (and a memory pass everywhere); under
``torch.compile`` inductor fuses them into one or two kernels (Triton on CUDA, C++ on the CPU).

- each variant (the caller's key: device type, dtype, format, ...) gets a function object of its
  own (a code object of its own, so dynamo's cache for it is separate and no variant can use up
  another's recompile budget);
- the first call of a variant compiles it (dynamic shapes, traced once on large example tensors:
  inductor picks threads and block sizes from their size), on the calling thread, and later calls
  never compile: an input the compiled code does not fit runs eagerly instead. A variant whose
  trace assumes nothing of its sizes but their symbols (the stats pass, the amax pair) is traced
  here with ``make_fx``, compiled by inductor and called directly, with its inputs checked here
  (:class:`_Direct`): through ``torch.compile`` each call also paid dynamo's frame evaluation and
  runtime wrappers, about half a small call's host time (``benchmarks/capture_cost.py --sections
  calls``). A variant whose trace does assume a relation (a block size dividing a side) is compiled
  with ``torch.compile`` and called through ``torch._dynamo.run``, whose guards check it.

Why not ahead, on a helper thread (as this module did before): torch's tracing is process-wide.
While ``make_fx`` traces (ours, and AOTAutograd's inside every inductor compile) it replaces
``torch.nn.Module.__call__`` for every thread and sets FX's global tracing flag. A training thread
calling its model meanwhile went through the tracer's module wrapper, and a ``torch.compile``d
model raised "Detected that you are using FX to symbolically trace a dynamo-optimized function"
and ended the user's training (``tests/test_compile_mode.py``). Compiling on the calling thread
costs that thread the compile once per variant, at its first use (seconds, less from inductor's
on-disk cache on later runs), which a ``torch.compile`` user pays for the model too.

Where it compiles: by default (``FP8SCOPE_COMPILE`` unset, or ``auto``) on accelerators (CUDA and
any device type but the CPU), where each eager op is a kernel launch and a few generated kernels
replace tens of them (the full-stats pass: 3 Triton launches for 37 eager ops). On the CPU the
default is eager: there an eager op is a loop over memory, not a launch, and each compile takes
seconds of the very cores that train, which a short CPU run (a test, the demo) never earns back
(``benchmarks/capture_cost.py``, per-tensor timings). ``FP8SCOPE_COMPILE=1`` (or ``on``, ``sync``)
compiles on the CPU too; ``FP8SCOPE_COMPILE=0`` (or a torch without a working inductor) keeps
everything eager. A compile that fails leaves that variant eager for the rest of the process.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from typing import Callable, Hashable

_ENV = "FP8SCOPE_COMPILE"
_log = logging.getLogger("fp8scope.compiled")
_lock = threading.RLock()
_ALL: list["CompiledFn"] = []  # every family, so that a dynamo reset can make them compile again
_own_frames = 0  # frames dynamo compiled for these families (others are the user's)


def compile_mode() -> str:
    """``"off"``, ``"on"`` (every device) or ``"auto"`` (the default: accelerators only), from
    ``FP8SCOPE_COMPILE``; read at each new variant, so a test may switch it."""
    value = (os.environ.get(_ENV) or "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("", "auto"):
        return "auto"
    return "on"


def compiles_on(device_type: str) -> bool:
    """Whether the current mode compiles for ``device_type`` ("cuda", "cpu", ...)."""
    mode = compile_mode()
    return mode != "off" and (mode != "auto" or device_type != "cpu")


def _renamed(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own (dynamo keys its cache on the code object)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_local = threading.local()


def tracing() -> bool:
    """Whether the calling code is being traced for compilation: by dynamo (a user's compiled model,
    or ``torch.compile`` here) or by this module's own tracer (:class:`_Direct`, on the thread that
    compiles). A family's function asks it to pick the form written for the compiler."""
    import torch

    return getattr(_local, "tracing", False) or torch.compiler.is_compiling()


def _is_compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def trace(fn: Callable, examples: tuple, fake_device=None):
    """``(graph, fakes, shape_env)``: ``fn`` traced by ``make_fx`` on fake copies of ``examples``
    (None stays None and is not an input of the graph), every dimension above 1 a symbol and equal
    sizes one symbol, as dynamo's duck sizing makes them; ``fake_device``: the fakes claim that
    device (``benchmarks/triton_kernels.py`` traces for a GPU it does not have). The one tracer of
    what :class:`_Direct` compiles and of what the benchmark counts."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    present = [i for i, t in enumerate(examples) if t is not None]
    fakes = []
    for i in present:
        t = examples[i]
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK if n > 1 else DimDynamic.STATIC
                                                      for n in t.shape])
        if fake_device is None:
            fakes.append(mode.from_tensor(t, symbolic_context=ctx))
        else:
            f = mode.from_tensor(torch.empty(t.shape, dtype=t.dtype, device="meta"), symbolic_context=ctx)
            f.fake_device = torch.device(fake_device)
            fakes.append(f)

    def call(*xs):
        args = [None] * len(examples)
        for i, x in zip(present, xs):
            args[i] = x
        return fn(*args)

    device_type = torch.device(fake_device).type if fake_device is not None else examples[present[0]].device.type
    _local.tracing = True
    try:  # now on the thread that calls, maybe inside a hook under the user's autocast: the graph
        # must not bake that region's casts into code every later call runs
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            graph = make_fx(call, tracing_mode="symbolic")(*fakes)
    finally:
        _local.tracing = False
    return graph, fakes, shape_env


class _Direct:
    """A variant inductor compiled from a graph traced here, called without dynamo.

    Why: through ``torch.compile`` every call of a small compiled function pays dynamo's frame
    evaluation and its runtime wrappers in Python, about as much host time as the kernel launches
    themselves (``benchmarks/capture_cost.py --sections calls``); on a GPU a full-stats step is that
    host time, tensor after tensor. Here the function is traced once with ``make_fx`` on fake
    tensors whose sizes are symbols (each dimension above 1; equal example sizes share a symbol, as
    dynamo's duck sizing does), inductor compiles that graph, and the call checks what dynamo's
    guards would: each argument's presence, dtype, device (with its index), rank and contiguity,
    the static sizes, every symbolic size at least 2, and the sizes that share a symbol equal
    (a fresh tensor per example: aliased ones would trace as one input). Only a variant whose
    trace recorded no guard on the symbols is compiled this way (a shape relation such as a block
    size dividing a side is dynamo's to check); a call that does not fit, or one made under a
    dispatch mode (the op-count proxies), runs the eager function."""

    def __init__(self, compiled: Callable, spec: list, eager: Callable, owner: "CompiledFn", key: Hashable):
        self._compiled, self._spec, self._eager = compiled, spec, eager
        self._owner, self._key = owner, key
        self._present = [i for i, item in enumerate(spec) if item is not None]
        self._checks = [(i, *spec[i], len(spec[i][2])) for i in self._present]  # (index, dtype, device, dims, rank)
        self._absent = [i for i, item in enumerate(spec) if item is None]
        self.rejected = 0  # calls that ran eagerly because they did not fit

    @classmethod
    def build(cls, owner: "CompiledFn", key: Hashable, fn: Callable, eager: Callable,
              examples: tuple) -> "_Direct":
        """The compiled variant, or ValueError saying why it cannot be called directly."""
        import torch
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        present = [i for i, t in enumerate(examples) if t is not None]
        if not all(examples[i].is_contiguous() for i in present):
            raise ValueError("a strided example")
        if len({examples[i].data_ptr() for i in present}) < len(present):
            raise ValueError("aliased examples (they would trace as one input, which calls need not be)")
        graph, fakes, shape_env = trace(fn, examples)
        if shape_env.guards:
            raise ValueError("its trace assumes relations between sizes, which dynamo's guards check")
        spec: list = [None] * len(examples)
        for i, f in zip(present, fakes):
            dims = []
            for n in f.shape:
                if isinstance(n, int):
                    dims.append(n)
                elif isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                    dims.append(str(n.node.expr))
                else:
                    raise ValueError(f"a size that is not a plain symbol ({n})")
            spec[i] = (f.dtype, f.device, tuple(dims))  # the device with its index: the code launches there
        with config.patch(owner.options(key) or {}), torch.no_grad():
            compiled = compile_fx(graph, fakes)
        return cls(compiled, spec, eager, owner, key)

    def accepts(self, args: tuple) -> bool:
        """Whether ``args`` fit the compiled code (what dynamo's guards would say)."""
        n_args = len(args)
        if n_args > len(self._spec) or any(args[i] is not None for i in self._absent if i < n_args):
            return False
        sizes: dict[str, int] = {}
        for i, dtype, device, dims, rank in self._checks:
            a = args[i] if i < n_args else None
            if a is None:
                return False
            if a.dtype is not dtype or a.dim() != rank or a.device != device or not a.is_contiguous():
                return False
            for want, n in zip(dims, a.shape):
                if want.__class__ is int:
                    if n != want:
                        return False
                elif n < 2 or sizes.setdefault(want, n) != n:
                    return False
        return True

    def __call__(self, *args):
        import torch

        if not self.accepts(args) or torch._C._len_torch_dispatch_stack():
            self.rejected += 1
            return self._eager(*args)
        tensors = [args[i] for i in self._present]
        grad = torch.is_grad_enabled()  # hooks run with grad on (forward) or off (backward): one mode for
        torch._C._set_grad_enabled(False)  # all, set by hand (a no_grad context costs more than the check)
        try:
            return self._compiled(*tensors)
        except Exception as exc:  # never the step's problem: this variant runs eagerly from now on
            self._owner._demote(self._key, exc)
            return self._eager(*args)
        finally:
            torch._C._set_grad_enabled(grad)


def _through_dynamo(owner: "CompiledFn", key: Hashable, fn: Callable, examples: Callable[[], tuple]) -> Callable:
    """``fn`` compiled with ``torch.compile`` and called through ``torch._dynamo.run``, whose guards
    check each call (the variants :class:`_Direct` cannot serve)."""
    import torch

    global _own_frames
    compiled = torch.compile(fn, dynamic=True, options=owner.options(key))
    with torch.no_grad():  # grad mode is part of the guards: compile and run under the same one
        compiled(*examples())  # traces and compiles now, on this thread
    cached = torch._dynamo.run(fn)
    _own_frames += 1

    def runner(*args):
        with torch.no_grad():  # hooks run with grad on (forward) or off (backward): one mode for all
            return cached(*args)

    return runner


def _compile(owner: "CompiledFn", key: Hashable, fn: Callable, examples: Callable[[], tuple]) -> None:
    """Compile one variant on this thread; its time is logged (``fp8scope.compiled``, INFO: a
    first full step that took seconds says why), and a failure leaves it eager, with one warning
    per family."""
    import time
    import warnings

    start = time.perf_counter()
    try:
        try:
            runner = _Direct.build(owner, key, fn, owner.eager(key), examples())
        except Exception as exc:  # a shape relation, or a torch without this path
            owner.not_direct[key] = f"{type(exc).__name__}: {exc}"
            runner = _through_dynamo(owner, key, fn, examples)
    except Exception as exc:  # no working compiler here: this variant stays eager
        owner._settle(key, None, exc)
        if not owner.warned:  # once per family: a machine that cannot compile one variant cannot compile the next
            owner.warned = True
            warnings.warn(f"fp8scope: could not compile {owner.name} {key} ({type(exc).__name__}: {exc}); it runs "
                          "as eager torch ops, as does any other variant that fails (.failures)",
                          RuntimeWarning, stacklevel=2)
    else:
        owner._settle(key, runner, None)
        _log.info("compiled %s %s in %.1f s (%s)", owner.name, key, time.perf_counter() - start,
                  "called directly" if isinstance(runner, _Direct) else "through torch.compile")


class CompiledFn:
    """A family of compiled variants of one eager function.

    ``make(key)`` returns the eager function for a variant (constants such as the FP8 format baked
    in); ``examples(key)`` returns example arguments for its compile (small tensors on the variant's
    device, every dimension at least 2 so dynamic shapes do not specialise on 0 or 1);
    ``options(key)``, inductor settings for that variant's compile (``torch.compile(options=)``:
    they apply to this compile only), or None.
    """

    def __init__(self, name: str, make: Callable[[Hashable], Callable],
                 examples: Callable[[Hashable], tuple], fallback: Callable[[Hashable], Callable] | None = None,
                 devices: tuple[str, ...] | None = None, options: Callable[[Hashable], dict | None] | None = None):
        self.name = name
        self._options = options
        self._devices = devices  # device types worth compiling for (a key's first item); None: all
        self._make = make
        self._examples = examples
        self._fallback = fallback  # the eager form where no compiled code runs, if not make's (same outputs)
        self._eager: dict[Hashable, Callable] = {}
        self._tried: set[Hashable] = set()  # compiled, or its compile failed
        self._wanted: dict[Hashable, tuple[str | None, bool]] = {}  # key -> (FP8SCOPE_COMPILE, compiled under it?)
        self._fallbacks: dict[Hashable, Callable] = {}
        _ALL.append(self)
        self._ready: dict[Hashable, Callable] = {}
        self.failures: dict[Hashable, str] = {}
        self.warned = False  # a failed compile has been warned about
        self.not_direct: dict[Hashable, str] = {}  # why a variant could not be called directly (it went through dynamo)

    def get(self, key: Hashable) -> Callable:
        """The function to call for ``key``: compiled (at this first call, if this mode compiles it),
        else eager.

        Inside a region dynamo is tracing (the user compiled the model), the plain function: dynamo
        inlines it into the user's graph, where inductor fuses it with the rest."""
        import torch

        if _is_compiling():
            return self.eager(key)
        setting = os.environ.get(_ENV)
        wanted = self._wanted.get(key)
        if wanted is None or wanted[0] != setting:  # read under each setting: a test may switch it
            wanted = self._wanted[key] = (setting, self._compiles(key))
        if not wanted[1]:  # FP8SCOPE_COMPILE=0 is eager, also for code compiled earlier
            return self.fallback(key)
        fn = self._ready.get(key)
        if fn is not None:
            return fn
        if (key not in self._tried
                and not torch._C._len_torch_dispatch_stack()  # a mode (an op counter) would see the trace
                and not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())):
            # (a CUDA graph being captured could not hold a compile's launches: later, outside it)
            with _lock:  # one compile at a time: two threads tracing at once would trace each other
                if key not in self._tried:
                    self._tried.add(key)
                    fn = _renamed(self.eager(key), f"fp8scope_{self.name}_{len(self._tried)}")
                    _compile(self, key, fn, lambda: self._examples(key))
            fn = self._ready.get(key)
            if fn is not None:
                return fn
        return self.fallback(key)

    def options(self, key: Hashable) -> dict | None:
        """The inductor settings ``key`` compiles with (benchmarks count its kernels with them)."""
        return self._options(key) if self._options is not None else None

    def eager(self, key: Hashable) -> Callable:
        """The eager function of ``key`` (the op-count proxies use it; compiles nothing)."""
        eager = self._eager.get(key)
        if eager is None:  # no lock: this may run inside a graph dynamo traces (setdefault is atomic)
            eager = self._eager.setdefault(key, self._make(key))
        return eager

    def _compiles(self, key: Hashable) -> bool:
        """Whether ``key`` is compiled at all: compilation on, and a device type worth it."""
        return compiles_on(key[0]) and (self._devices is None or key[0] in self._devices)

    def fallback(self, key: Hashable) -> Callable:
        """The eager function that runs where ``key`` is not compiled (never compiled itself)."""
        return self._fallbacks.get(key) or self._make_fallback(key)

    def _make_fallback(self, key: Hashable) -> Callable:
        fn = self._fallback(key) if self._fallback is not None else self.eager(key)
        self._fallbacks[key] = fn
        return fn

    def _settle(self, key: Hashable, runner: Callable | None, exc: BaseException | None) -> None:
        if runner is not None:
            self._ready[key] = runner
        else:
            self.failures[key] = f"{type(exc).__name__}: {exc}"

    def _demote(self, key: Hashable, exc: BaseException) -> None:
        """A compiled variant that raised: eager from now on, and the reason kept (``failures``)."""
        self._ready.pop(key, None)
        self.failures[key] = f"{type(exc).__name__}: {exc}"

    def direct(self, key: Hashable) -> bool:
        """Whether ``key`` runs the directly called code (:class:`_Direct`), not dynamo's."""
        return isinstance(self._ready.get(key), _Direct)

    def ensure(self, key: Hashable) -> bool:
        """Compile ``key`` now if this mode compiles it (as its first call would); True if it is
        compiled (tests and benchmarks that measure the compiled code)."""
        self.get(key)
        return key in self._ready


def user_frames_compiled() -> bool:
    """Whether dynamo has compiled code in this process other than these families' (a user's
    compiled model or function)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return False
    import torch._dynamo

    return torch._dynamo.utils.counters["frames"].get("ok", 0) > _own_frames


def reset_dynamo() -> None:
    """``torch._dynamo.reset()``, and the variants compiled through dynamo compile again at their
    next use (their compiled code went with the reset; the directly called ones stay)."""
    import torch._dynamo

    global _own_frames
    with _lock:
        torch._dynamo.reset()
        torch._dynamo.utils.counters["frames"].clear()
        _own_frames = 0
        for family in _ALL:  # the directly called variants do not live in dynamo: they stay
            family._ready = {k: v for k, v in family._ready.items() if isinstance(v, _Direct)}
            family._tried = set(family._ready)
            family.failures.clear()
            family.not_direct.clear()
