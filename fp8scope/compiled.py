"""Small tensor functions compiled once per variant: ahead in a child process on accelerators, at
first use on the calling thread on the CPU.

Why: fp8scope's per-tensor work (full stats, the amax pass) is a handful of reductions over one
tensor. Eager, each op is a kernel launch on CUDA (and a memory pass everywhere); under
``torch.compile`` inductor fuses them into one or two kernels (Triton on CUDA, C++ on the CPU).

- each variant (the caller's key: device type, dtype, format, ...) gets a function object of its
  own (a code object of its own, so dynamo's cache for it is separate and no variant can use up
  another's recompile budget);
- on an accelerator a variant compiles ahead, in a child process (``fp8scope.compile_ahead``), and
  runs eagerly until its code is ready: no training step waits for a compile. The first call after
  that loads the code (milliseconds, on the calling thread, once :func:`prepare` has imported what
  a load needs) and later calls never compile: an input the compiled code does not fit runs
  eagerly instead;
- a variant whose trace assumes nothing of its sizes but their symbols (the stats pass, the amax
  pair, the delayed update) is traced with ``make_fx`` (dynamic shapes, on large example tensors:
  inductor picks threads and block sizes from their size), compiled by inductor
  (``torch._inductor.standalone_compile``, whose artifact a child saves and this process loads) and
  called directly, with its inputs checked here (:class:`_Direct`): through ``torch.compile`` each
  call also paid dynamo's frame evaluation and runtime wrappers, about half a small call's host
  time (``benchmarks/capture_cost.py --sections calls``). A variant whose trace does assume a
  relation (a block size dividing a side) is compiled in this process with ``torch.compile`` at
  its next use and called through ``torch._dynamo.run``, whose guards check it.

Why a child process. Not a helper thread (as this module once did): torch's tracing is
process-wide. While ``make_fx`` traces (ours, and AOTAutograd's inside every inductor compile) it
replaces ``torch.nn.Module.__call__`` for every thread and sets FX's global tracing flag. A
training thread calling its model meanwhile went through the tracer's module wrapper, and a
``torch.compile``d model raised "Detected that you are using FX to symbolically trace a
dynamo-optimized function" and ended the user's training (``tests/test_compile_mode.py``). Not the
training thread (as it did next): the step that first needs a variant stalled for its compile,
seconds per variant. A child compiles beside training with neither problem, on a core the training
thread, which on a GPU mostly launches kernels, does not use. On the CPU training already runs on
every core, and a child takes them from it for as long as it compiles (``benchmarks/capture_cost.py
--sections first`` measures both ways), so there a variant compiles at its first use, on the
calling thread. So does a family that a child cannot rebuild (one not defined at
the top level of a module), and every family whose compile child failed (a GPU in
exclusive-process mode, say): one warning, then compiles at first use.

``FP8SCOPE_COMPILE``: unset or ``auto``, compile on accelerators (CUDA and any device type but the
CPU), where each eager op is a kernel launch and a few generated kernels replace tens of them (the
full-stats pass: 3 Triton launches for 37 eager ops), and run eagerly on the CPU, where an eager op
is a loop over memory, not a launch, and each compile takes seconds of the very cores that train,
which a short CPU run (a test, the demo) never earns back (``benchmarks/capture_cost.py``,
per-tensor timings). ``1`` (or ``on``) compiles on the CPU too; ``sync`` compiles every variant at
first use on the calling thread (benchmarks that time compiled steps from the first one; a
machine where a second process cannot open the GPU), ``ahead`` every variant in a child;
``0`` (or a torch without a working inductor) keeps everything eager. A compile that fails leaves
that variant eager for the rest of the process, with one warning per family.
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
_BY_NAME: dict[str, "CompiledFn"] = {}  # how a compile child finds a family
_own_frames = 0  # frames dynamo compiled for these families (others are the user's)
traces = 0  # graphs :func:`trace` traced in this process (a compile child's are its own)


def compile_mode() -> str:
    """``"off"``, ``"auto"`` (the default: accelerators only), ``"on"`` (every device), ``"sync"``
    (every device, always at first use on the calling thread) or ``"ahead"`` (every device, always
    in a compile child), from ``FP8SCOPE_COMPILE``; read at each call of a variant that is not
    ready, so a test may switch it."""
    value = (os.environ.get(_ENV) or "auto").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    if value in ("", "auto"):
        return "auto"
    if value in ("sync", "ahead"):
        return value
    return "on"


def compiles_on(device_type: str) -> bool:
    """Whether the current mode compiles for ``device_type`` ("cuda", "cpu", ...); never for
    "meta", whose tensors hold no values to run code on."""
    mode = compile_mode()
    return mode != "off" and device_type != "meta" and (mode != "auto" or device_type != "cpu")


def ahead_on(device_type: str) -> bool:
    """Whether the current mode compiles ``device_type``'s variants in a compile child: on
    accelerators, where the training thread mostly launches kernels and the host's other cores are
    free for a compile; not on the CPU (unless ``ahead``), where training already runs on every
    core and a child took them from it (``benchmarks/capture_cost.py --sections first``)."""
    mode = compile_mode()
    return compiles_on(device_type) and (mode == "ahead" or (mode in ("auto", "on") and device_type != "cpu"))


_prepared: set[str] = set()


def prepare(device_types) -> None:
    """Import now, on the calling thread, what loading a compile child's code takes in this
    process (inductor's loader, torch's source hash; Triton's runtime on a GPU, the vector
    instruction probe on the CPU), for the device types whose variants compile ahead. A
    :class:`~fp8scope.Monitor` and ``convert_to_fp8`` call it for the model's devices, at setup,
    so that no training step pays it (seconds, once per process); a model moved to a GPU later
    pays it at its first load instead.

    Why not on the thread that waits for the child, beside training: torch releases the GIL in
    every op, and a thread running Python meanwhile makes each op wait up to the interpreter's
    switch interval to take it back: a warm-up there made the demo model's full step several
    times slower on a 2-core CPU, and the slowest of an H100's first steps a hundred times its
    median step. Failures are ignored: the load does the same, later."""
    for device_type in sorted(set(device_types)):
        if device_type in _prepared or not ahead_on(device_type):
            continue
        _prepared.add(device_type)
        try:
            _prepare(device_type)
        except Exception:  # only a head start
            pass


def _prepare(device_type: str) -> None:
    import torch._functorch._aot_autograd.autograd_cache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401  (the load imports it: a second and more)
    import torch._inductor.standalone_compile  # noqa: F401
    from torch._inductor.codecache import torch_key

    torch_key()  # the artifact's cache key: torch's source files hashed
    if device_type == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()  # compiles probes in a subprocess
        return
    import torch._inductor.runtime.triton_heuristics  # noqa: F401  (Triton, and inductor's launcher)

    if device_type == "cuda":
        from torch._inductor.runtime.triton_compat import triton_key
        from triton.runtime.driver import driver

        triton_key()  # Triton's cache key: its source files hashed
        driver.active.utils  # noqa: B018  (loads, or builds, Triton's CUDA helper module)


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


def trace(fn: Callable, examples: tuple, fake_device=None, static=()):
    """``(graph, fakes, shape_env)``: ``fn`` traced by ``make_fx`` on fake copies of ``examples``
    (None stays None and is not an input of the graph), every dimension above 1 a symbol and equal
    sizes one symbol, as dynamo's duck sizing makes them, except the ``(argument, dimension)``
    pairs in ``static``, which keep their example's size; ``fake_device``: the fakes claim that
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
        fixed = {d % t.dim() for a, d in static if a == i}
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK if n > 1 and d not in fixed else DimDynamic.STATIC
                                                      for d, n in enumerate(t.shape)])
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

    global traces
    traces += 1
    device_type = torch.device(fake_device).type if fake_device is not None else examples[present[0]].device.type
    _local.tracing = True
    try:  # now on the thread that calls, maybe inside a hook under the user's autocast: the graph
        # must not bake that region's casts into code every later call runs
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            graph = make_fx(call, tracing_mode="symbolic")(*fakes)
    finally:
        _local.tracing = False
    return graph, fakes, shape_env


def build(owner: "CompiledFn", key: Hashable) -> tuple:
    """``(artifact, spec, single)``: variant ``key`` of ``owner`` traced (:func:`trace`) and
    compiled by inductor into an artifact that can be saved and loaded in another process
    (``torch._inductor.standalone_compile``); ``spec``, what :class:`_Direct` checks of each call;
    ``single``, whether the function returns one tensor (the artifact returns a list). The one
    compile of a directly called variant, in a compile child or on the calling thread. ValueError
    says why a variant cannot be called directly (dynamo's guards must check it)."""
    import torch
    from torch._inductor import config, standalone_compile

    fn = _renamed(owner.eager(key), f"fp8scope_{owner.name}")
    examples = owner._examples(key)
    present = [i for i, t in enumerate(examples) if t is not None]
    if not all(examples[i].is_contiguous() for i in present):
        raise ValueError("a strided example")
    if len({examples[i].data_ptr() for i in present}) < len(present):
        raise ValueError("aliased examples (they would trace as one input, which calls need not be)")
    graph, fakes, shape_env = trace(fn, examples, static=owner.static(key))
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
    out = graph.graph.output_node().args[0]
    single = not isinstance(out, (tuple, list))
    with config.patch(owner.options(key) or {}), torch.no_grad():
        artifact = standalone_compile(graph, fakes, dynamic_shapes="from_graph")
    return artifact, spec, single


class _Direct:
    """A variant inductor compiled from a graph traced by :func:`trace`, called without dynamo.

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

    def __init__(self, compiled: Callable, spec: list, single: bool, eager: Callable, owner: "CompiledFn",
                 key: Hashable):
        self._compiled, self._spec, self._single, self._eager = compiled, spec, single, eager
        self._owner, self._key = owner, key
        self._present = [i for i, item in enumerate(spec) if item is not None]
        self._checks = [(i, *spec[i], len(spec[i][2])) for i in self._present]  # (index, dtype, device, dims, rank)
        self._absent = [i for i, item in enumerate(spec) if item is None]
        self.rejected = 0  # calls that ran eagerly because they did not fit

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
            out = self._compiled(*tensors)
            if out.__class__ is list:  # a loaded artifact returns its outputs boxed
                return out[0] if self._single else tuple(out)
            return out
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


def _fail(owner: "CompiledFn", key: Hashable, reason: str) -> None:
    """A variant that could not compile: eager for the rest of the process, the reason kept, and one
    warning per family (a machine that cannot compile one variant cannot compile the next)."""
    import warnings

    owner.failures[key] = reason
    if not owner.warned:
        owner.warned = True
        warnings.warn(f"fp8scope: could not compile {owner.name} {key} ({reason}); it runs as eager torch "
                      "ops, as does any other variant that fails (.failures)", RuntimeWarning, stacklevel=4)


def _compile_here(owner: "CompiledFn", key: Hashable, not_direct: str | None = None) -> None:
    """Compile one variant on this thread: called directly if it can be (:func:`build`), else
    through dynamo (``not_direct``: a compile child already found that it cannot). Its time is
    logged (``fp8scope.compiled``, INFO: a first full step that took seconds says why)."""
    import time

    start = time.perf_counter()
    runner = None
    try:
        if not_direct is None:
            try:
                artifact, spec, single = build(owner, key)
                runner = _Direct(artifact, spec, single, owner.eager(key), owner, key)
            except Exception as exc:  # a shape relation, or a torch without this path
                not_direct = f"{type(exc).__name__}: {exc}"
        if runner is None:
            owner.not_direct[key] = not_direct
            fn = _renamed(owner.eager(key), f"fp8scope_{owner.name}_{len(owner._tried)}")
            runner = _through_dynamo(owner, key, fn, lambda: owner._examples(key))
    except Exception as exc:  # no working compiler here: this variant stays eager
        _fail(owner, key, f"{type(exc).__name__}: {exc}")
    else:
        owner._ready[key] = runner
        _log.info("compiled %s %s in %.1f s (%s)", owner.name, key, time.perf_counter() - start,
                  "called directly" if isinstance(runner, _Direct) else "through torch.compile")


def _load(owner: "CompiledFn", key: Hashable, built) -> None:
    """Take a compile child's result for ``key`` (``compile_ahead.Build``) on this thread: load the
    artifact (milliseconds), or compile through dynamo here (a shape relation), or compile here as
    ``sync`` would (the child failed: this family's later variants too)."""
    import time

    kind, *rest = built.result
    if kind == "not_direct":
        _compile_here(owner, key, not_direct=rest[0])
        return
    if kind != "direct":  # the child could not run here (a GPU in exclusive-process mode, no interpreter, ...)
        import warnings

        if owner.child_failed is None:
            warnings.warn(f"fp8scope: a compile child for {owner.name} failed ({rest[0]}); its variants compile "
                          "in this process at their first use instead", RuntimeWarning, stacklevel=4)
        owner.child_failed = rest[0]
        _compile_here(owner, key)
        return
    path, spec, single, seconds = rest
    start = time.perf_counter()
    try:
        from torch._inductor import config
        from torch._inductor.standalone_compile import CompiledArtifact

        with config.patch(compile_threads=1):  # its kernels come compiled: no pool of compile workers for them
            artifact = CompiledArtifact.load(path=path, format="binary")
    except Exception as exc:
        _fail(owner, key, f"loading the compiled code failed: {type(exc).__name__}: {exc}")
        return
    owner._ready[key] = _Direct(artifact, spec, single, owner.eager(key), owner, key)
    _log.info("compiled %s %s in %.1f s (called directly; in a child process, loaded in %.0f ms)",
              owner.name, key, seconds, (time.perf_counter() - start) * 1e3)


class CompiledFn:
    """A family of compiled variants of one eager function.

    ``make(key)`` returns the eager function for a variant (constants such as the FP8 format baked
    in); ``examples(key)`` returns example arguments for its compile (small tensors on the variant's
    device, every dimension at least 2 so dynamic shapes do not specialise on 0 or 1);
    ``options(key)``, inductor settings for that variant's compile (``torch.compile(options=)``:
    they apply to this compile only), or None; ``static(key)``, the ``(argument, dimension)`` pairs
    whose size the key fixes (traced as constants, not symbols). A family defined at the top level of a module, under
    a name no other family has, compiles in a child process (the child imports that module and asks
    :func:`family`); any other compiles on the thread that first calls it.
    """

    def __init__(self, name: str, make: Callable[[Hashable], Callable],
                 examples: Callable[[Hashable], tuple], fallback: Callable[[Hashable], Callable] | None = None,
                 devices: tuple[str, ...] | None = None, options: Callable[[Hashable], dict | None] | None = None,
                 static: Callable[[Hashable], tuple] | None = None):
        self.name = name
        self._options = options
        self._static = static  # (argument, dimension) pairs whose size is part of the variant, not a symbol
        self._devices = devices  # device types worth compiling for (a key's first item); None: all
        self._make = make
        self._examples = examples
        self._fallback = fallback  # the eager form where no compiled code runs, if not make's (same outputs)
        self._eager: dict[Hashable, Callable] = {}
        self._tried: set[Hashable] = set()  # compiled, or its compile failed
        self._wanted: dict[Hashable, tuple[str | None, bool]] = {}  # key -> (FP8SCOPE_COMPILE, compiled under it?)
        self._fallbacks: dict[Hashable, Callable] = {}
        self._ahead: dict[Hashable, object] = {}  # key -> its compile child's record (compile_ahead.Build)
        self._child_ok: bool | None = None  # whether a compile child can rebuild this family
        self.child_failed: str | None = None  # why a compile child failed: the family compiles here since
        _ALL.append(self)
        _BY_NAME.setdefault(name, self)
        self._ready: dict[Hashable, Callable] = {}
        self.failures: dict[Hashable, str] = {}
        self.warned = False  # a failed compile has been warned about
        self.not_direct: dict[Hashable, str] = {}  # why a variant could not be called directly (it went through dynamo)

    def get(self, key: Hashable) -> Callable:
        """The function to call for ``key``: compiled if its code is ready, else eager (and its
        compile started: in a child, or here and now under ``FP8SCOPE_COMPILE=sync``).

        Inside a region dynamo is tracing (the user compiled the model), the plain function
        (:meth:`traced`): dynamo inlines it into the user's graph, where inductor fuses it with the rest."""
        import torch

        if _is_compiling():
            return self.traced(key)
        if not self._for_device(key):  # never compiled there: no setting to read
            return self.fallback(key)
        setting = os.environ.get(_ENV)
        wanted = self._wanted.get(key)
        if wanted is None or wanted[0] != setting:  # read under each setting: a test may switch it
            wanted = self._wanted[key] = (setting, self._compiles(key))
        if not wanted[1]:  # FP8SCOPE_COMPILE=0 is eager, also for code compiled earlier
            return self.fallback(key)
        fn = self._ready.get(key)
        if fn is not None:
            return fn
        if (key in self._tried
                or torch._C._len_torch_dispatch_stack()  # a mode (an op counter) would see a trace or a load
                or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())):
            # (a CUDA graph being captured holds no compile's or load's work: later, outside it)
            return self.fallback(key)
        built = self._ahead.get(key)
        if built is not None:
            if built.done.is_set():
                with _lock:
                    if key not in self._tried:
                        self._tried.add(key)
                        _load(self, key, built)
                return self._ready.get(key) or self.fallback(key)
            return self.fallback(key)
        if ahead_on(key[0]) and self.child_failed is None and self._child_can_build():
            return self._requesting(key)
        with _lock:  # one compile at a time: two threads tracing at once would trace each other
            if key not in self._tried:
                self._tried.add(key)
                _compile_here(self, key)
        return self._ready.get(key) or self.fallback(key)

    def _requesting(self, key: Hashable) -> Callable:
        """The fallback, which first asks a compile child for ``key`` on the device of its call."""
        fallback = self.fallback(key)

        def first_call(*args):
            self._request(key, args)
            return fallback(*args)

        return first_call

    def _request(self, key: Hashable, args: tuple) -> None:
        from . import compile_ahead

        with _lock:
            if key in self._ahead:
                return
            index = None
            if key[0] == "cuda":
                import torch

                devices = [a.device for a in args if isinstance(a, torch.Tensor)]
                index = devices[0].index if devices and devices[0].index is not None else torch.cuda.current_device()
            self._ahead[key] = compile_ahead.request(self.name, self._make.__module__, key, index)

    def _child_can_build(self) -> bool:
        """Whether a child that imports this family's module finds it there, under its name."""
        import sys

        if self._child_ok is None:
            module = sys.modules.get(self._make.__module__)
            self._child_ok = (_BY_NAME.get(self.name) is self and module is not None
                              and any(v is self for v in vars(module).values()))
        return self._child_ok

    def static(self, key: Hashable) -> tuple:
        """The ``(argument, dimension)`` pairs of ``key`` traced at their example's size (the key
        holds that size), not as symbols."""
        return self._static(key) if self._static is not None else ()

    def options(self, key: Hashable) -> dict | None:
        """The inductor settings ``key`` compiles with (benchmarks count its kernels with them)."""
        return self._options(key) if self._options is not None else None

    def eager(self, key: Hashable) -> Callable:
        """The eager function of ``key`` (the op-count proxies use it; compiles nothing)."""
        eager = self._eager.get(key)
        if eager is None:  # no lock: setdefault is atomic
            eager = self._eager.setdefault(key, self._make(key))
        return eager

    def traced(self, key: Hashable) -> Callable:
        """The eager function of ``key`` as dynamo traces it into a user's compiled model: made afresh,
        from no cache. Why: dynamo guards on what the trace reads, so a lookup that missed would leave a
        guard "``key`` not cached" that the lookup's own fill then fails, and the user's whole model
        would compile again (twice for the emulated layer's two families: three compiles of a model
        where one does, each a full inductor compile; ``tests/test_compile_mode.py``)."""
        return self._make(key)

    def _compiles(self, key: Hashable) -> bool:
        """Whether ``key`` is compiled at all: compilation on, and a device type worth it."""
        return compiles_on(key[0]) and self._for_device(key)

    def _for_device(self, key: Hashable) -> bool:
        """Whether the family compiles for ``key``'s device type at all (its ``devices``)."""
        return self._devices is None or key[0] in self._devices

    def fallback(self, key: Hashable) -> Callable:
        """The eager function that runs where ``key`` is not compiled (never compiled itself)."""
        return self._fallbacks.get(key) or self._make_fallback(key)

    def _make_fallback(self, key: Hashable) -> Callable:
        fn = self._fallback(key) if self._fallback is not None else self.eager(key)
        self._fallbacks[key] = fn
        return fn

    def _demote(self, key: Hashable, exc: BaseException) -> None:
        """A compiled variant that raised: eager from now on, and the reason kept (``failures``)."""
        self._ready.pop(key, None)
        self.failures[key] = f"{type(exc).__name__}: {exc}"

    def direct(self, key: Hashable) -> bool:
        """Whether ``key`` runs the directly called code (:class:`_Direct`), not dynamo's."""
        return isinstance(self._ready.get(key), _Direct)

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s compiled code and its compile's record: its next call starts over (tests
        that watch a first compile in a process where another test compiled that variant)."""
        with _lock:
            for held in (self._ready, self._ahead, self.failures, self.not_direct):
                held.pop(key, None)
            self._tried.discard(key)

    def ensure(self, key: Hashable, timeout: float | None = None) -> bool:
        """Compile ``key`` now if this mode compiles it, or wait for its compile child and load its
        code; True if it is compiled (tests and benchmarks that measure the compiled code)."""
        self.get(key)
        if key in self._ready or key in self._tried or not self._wanted[key][1]:
            return key in self._ready
        if key not in self._ahead:
            self._request(key, ())
        if self._ahead[key].done.wait(timeout):
            self.get(key)
        return key in self._ready


def family(name: str) -> CompiledFn:
    """The family registered under ``name`` (a compile child's way to it)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise LookupError(f"no compiled family named {name!r}") from None


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
