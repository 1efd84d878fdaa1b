"""MoE experts stored as 3-D weights (``transformers`` 5.x: ``MixtralExperts``, Qwen's, DeepSeek's,
GPT-OSS's; any module whose 3-D Parameters stack one matrix per expert, ``linear_like.expert_weights``),
in high precision: the recipe is simulated on each expert's GEMMs, as on any other plain layer
(:mod:`.whatif`), and nothing changes.

Why a tap inside the module: the experts' GEMMs are not modules. ``transformers`` runs them one of
three ways, chosen per model (``experts_implementation``): a loop of ``F.linear(x_e, W[e])`` (or
``x_e @ W[e]``) over the experts a batch reached, one ``grouped_mm(x, W, offs)`` over the tokens
sorted by expert (the default), or ``batched_mm``: ``bmm`` of each row by ``W[expert_ids]``.
While the module runs, a ``TorchFunctionMode`` sees each call and recognises the GEMMs whose weight is one of the module's stacked Parameters (or an expert's
slice of one). Each expert's GEMM is a layer of its own, ``<module>.<expert>.<parameter>``
(``model.layers.0.mlp.experts.3.down_proj``, as ``transformers`` 4.x named its per-expert
``nn.Linear``), with its own delayed-scaling state, as Transformer Engine's ``GroupedLinear``
keeps one per GEMM.

A cheap step reads no group size on the host: one reduction per row of a grouped (or batched)
GEMM's input, and of its output's gradient, and one scatter by expert give every expert's amax
parts together (:meth:`~fp8scope.emulate.device_bank.DeviceDelayedBank.capture_parts`), with an
expert that got no token this step at 0 (TE's amax of an empty split); such rows have no element
count. Full steps, and recipes other than delayed scaling, read the group sizes once per forward
and capture each expert's rows as a plain layer's. The loop captures the experts it reaches.
Experts whose GEMMs are none of these (a layout of their own) are named in one warning.

Under ``torch.compile`` dynamo traces the mode too (:class:`_TracedMode`): a grouped GEMM, or a
batched one, hands its input, stack and routing to one opaque op of :mod:`fp8scope.graph_taps`, and
its output's gradient goes the same way, so the graph runs the eager capture above on the real
tensors and logs the same rows, without a graph break. Traced code has no addresses, so the stack is
found by its shape there and checked by its address when the graph runs. The loop is read in eager
forwards only: experts that ran traced without a grouped or batched GEMM are left, and the monitor
says so at that step's end.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fp8scope.capture.adapters.base import Adapter, Handle, Sink, guarded
from fp8scope.capture.adapters.whatif import _WhatIfTap
from fp8scope.linear_like import NN_LINEAR, expert_weights

_GROUPED = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
_MATMUL = frozenset({"matmul", "__matmul__"})
_READ = _GROUPED | _MATMUL | {"linear", "bmm", "__getitem__"}
# dynamo traces a TorchFunctionMode entered in compiled code from torch 2.6 (pytorch#137121); before, the
# experts of a compiled model are left, and said so
_TRACES_MODES = torch.torch_version.TorchVersion(torch.__version__) >= (2, 6)


class ExpertsSource(Adapter):
    """A module of stacked expert weights: each expert's GEMMs captured what-if."""

    name = "whatif"

    @staticmethod
    def claims(module: nn.Module) -> bool:
        return bool(expert_weights(module))

    @staticmethod
    def attach(layer: str, module: nn.Module, sink: Sink, recipe: Any) -> Handle:
        tap = _ExpertsTap(layer, module, sink, recipe)
        pre = module.register_forward_pre_hook(guarded(sink, tap.enter))
        post = module.register_forward_hook(guarded(sink, tap.leave), always_call=True)
        return lambda: (pre.remove(), post.remove(), tap.unregister()) and None

    @staticmethod
    def weights(module: nn.Module) -> list[nn.Parameter]:
        return expert_weights(module)


class _Mode(TorchFunctionMode):
    def __init__(self, tap: "_ExpertsTap"):
        super().__init__()
        self.tap = tap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _READ:
            try:
                self.tap.gemm(name, args, kwargs, out)
            except Exception as exc:  # a monitor problem must not reach training
                self.tap.sink.fail(exc)
        return out


class _TracedMode(TorchFunctionMode):
    """The mode as dynamo traces it (a model under ``torch.compile``): a grouped GEMM, or a batched
    one on an expert-indexed stack, hands its tensors to the graph's taps
    (:meth:`_ExpertsTap.traced_gemm`)."""

    def __init__(self, tap: "_ExpertsTap"):
        super().__init__()
        self.tap = tap
        self.seen = 0  # GEMMs on the module's stacks in this traced forward
        self.gathers: list[tuple] = []  # (W[ids], W, its stack's name, ids) in this forward (batched_mm)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _GROUPED or name in ("bmm", "__getitem__"):
            out = self.tap.traced_gemm(self, name, args, kwargs, out)
        return out


class _ExpertsTap:
    def __init__(self, layer: str, module: nn.Module, sink: Sink, recipe: Any):
        from fp8scope import graph_taps
        from fp8scope.emulate import DelayedScaling

        self.layer, self.sink, self.recipe = layer, sink, recipe
        self.module = weakref.ref(module)
        stacked = expert_weights(module)
        self.params = [(n, p) for n, p in module.named_parameters(recurse=False) if any(p is q for q in stacked)]
        self.delayed = isinstance(recipe, DelayedScaling)
        self.taps: dict[tuple[int, str], _WhatIfTap] = {}
        self._mode: _Mode | None = None
        self._seen = 0  # GEMMs recognised in this forward
        self._host: dict[int, tuple] = {}  # id(offs or ids) -> (it, perm, group sizes): read once per forward
        self._stacks = dict(self.params)
        self._gathers: list[tuple] = []  # (W[ids], W, its stack's name, ids) in this forward (batched_mm)
        self._slots: dict[tuple[str, str], tuple] = {}  # (parameter, role) -> (bank, every expert's slot, key ids)
        self._traced: list[_TracedMode] = []  # the mode of the forward dynamo is tracing
        # under torch.compile a grouped or batched GEMM hands its tensors to these taps (see graph_taps),
        # per stack and routing: its forward's, as traced with grad on and off (a compiled forward runs
        # its graph with grad off, so the tap cannot ask), and its output's gradient
        self._graph_taps: dict[tuple[str, Any], int] = {}
        for name, _ in self.params:
            for routing in ("offs", "ids"):  # a grouped GEMM's cumulative offsets, a batched one's expert per row
                for training in (True, False):
                    self._graph_taps[name, routing, training] = graph_taps.register(
                        guarded(sink, partial(self._graph_forward, name, routing, training)))
                self._graph_taps[name, routing, "gradient"] = graph_taps.register(
                    guarded(sink, partial(self._graph_grad, name, routing)))

    def unregister(self) -> None:
        from fp8scope import graph_taps

        for tap in self._graph_taps.values():
            graph_taps.unregister(tap)

    def __deepcopy__(self, memo: dict) -> "_ExpertsTap":
        # A copy of the model (a fork's replica, whose hooks are then removed; the user's EMA copy)
        # keeps the hooks as functions: the same tap, which reads only its own module (enter).
        return self

    def tap(self, expert: int, param: str) -> _WhatIfTap:
        t = self.taps.get((expert, param))
        if t is None:
            t = self.taps[expert, param] = _WhatIfTap(f"{self.layer}.{expert}.{param}", self.sink, self.recipe,
                                                      NN_LINEAR, traced=False)
        return t

    # ---- the module's forward ---------------------------------------------------------------
    def enter(self, module, args):
        if torch.compiler.is_compiling():  # traced: the mode is traced too, and its taps run with the graph
            if not _TRACES_MODES:
                self.sink.traced_layers.add(self.layer)  # a side effect dynamo replays: no graph break
                return
            mode = _TracedMode(self)
            self._traced.append(mode)
            mode.__enter__()
            return
        if not self.sink.active or self._mode is not None or module is not self.module():
            return
        self._seen = 0
        self._mode = _Mode(self)
        self._mode.__enter__()

    def leave(self, module, args, output):
        if torch.compiler.is_compiling():
            if not self._traced:
                return
            mode = self._traced.pop()
            mode.__exit__(None, None, None)
            if not mode.seen:  # the loop, traced: not captured; the monitor says so at the step's end
                self.sink.traced_layers.add(self.layer)  # a side effect dynamo replays: no graph break
            return
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        self._host, self._gathers = {}, []
        if not self._seen:
            self.sink.warn("experts-unread", f"{self.layer}: its experts ran no GEMM fp8scope reads (F.linear or a "
                           "matmul on an expert's slice, grouped_mm, batched_mm): they are not captured")

    # ---- one GEMM -----------------------------------------------------------------------
    def _param(self, w: Any) -> tuple[str, torch.Tensor, int | None] | None:
        """The stacked Parameter ``w`` is, or is a view of: (name, Parameter, expert) with expert None
        for the whole stack (a grouped GEMM), or None."""
        if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3):
            return None
        ptr = w.data_ptr()
        for name, p in self.params:
            base, size = p.data_ptr(), p.numel() * p.element_size()
            if not base <= ptr < base + size:
                continue
            if w.dim() == 3:
                return (name, p, None) if ptr == base and w.shape[0] == p.shape[0] else None
            step = p.stride(0) * p.element_size()
            if (ptr - base) % step == 0 and w.numel() == p[0].numel():
                return name, p, (ptr - base) // step
        return None

    def gemm(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if name == "__getitem__":  # batched_mm's weights gathered per row: W[expert_ids]
            hit = self._param(args[0])
            if hit is not None and hit[2] is None and _expert_index(args):
                self._gathers.append((out, hit[1], hit[0], args[1]))
            return
        if name == "bmm":
            got = _batched_input(self._gathers, args)
            if got is None:
                return
            x, (_, p, param, ids) = got
            self._seen += 1
            self._routed(param, x, _weight_of(p, "ids", x.shape[-1]), p, out, ids=ids)
            return
        if name in _GROUPED:
            x, w, offs = _grouped_args(args, kwargs)
            hit = self._param(w)
            if hit is None or hit[2] is not None or not isinstance(offs, torch.Tensor):
                return
            self._seen += 1
            self._routed(hit[0], x, _weight_of(w, "offs", x.shape[-1]), hit[1], out, offs=offs)
            return
        x, w = (args[0], args[1]) if len(args) > 1 else (args[0], kwargs.get("weight"))
        hit = self._param(w)
        if hit is None or hit[2] is None or not isinstance(x, torch.Tensor):
            return
        self._seen += 1
        param, _, expert = hit
        # F.linear's weight is [out, in]; x @ W[e] holds [in, out]
        self.tap(expert, param).forward_hook(_ExpertGemm(w if name == "linear" else w.t()), (x,), out)

    # ---- under torch.compile ----------------------------------------------------------------
    def _stack_of(self, w: Any) -> str | None:
        """As traced: the stack ``w`` (a grouped GEMM's weight, a batched one's gathered source) is,
        read by its shape (a traced tensor has no address): ``[experts, in, out]`` or ``[experts, out,
        in]``; None where no stack or two fit. The graph's tap checks the address when it runs
        (:meth:`_graph_forward`)."""
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            return None
        fits = [name for name, p in self.params
                if p.shape[0] == w.shape[0] and sorted(p.shape[1:]) == sorted(w.shape[1:])]
        return fits[0] if len(fits) == 1 else None

    def traced_gemm(self, mode: _TracedMode, name: str, args: tuple, kwargs: dict, out: Any) -> Any:
        """A GEMM as dynamo traces it: a grouped GEMM's input, weight and offsets, or a batched GEMM's
        input, stack and expert ids, go to the forward's graph tap, and its output through
        :class:`~fp8scope.graph_taps.GradObserver` to the gradient's, with the routing, which says whose
        gradient rows are whose as it said whose input rows were. Returns the output the model goes on
        with."""
        from fp8scope.graph_taps import GradObserver, observe

        if name == "__getitem__":  # batched_mm's weights gathered per row: W[expert_ids]
            param = self._stack_of(args[0])
            if param is not None and _expert_index(args):
                mode.gathers.append((out, args[0], param, args[1]))
            return out
        if name == "bmm":
            got = _batched_input(mode.gathers, args)
            if got is None:
                return out
            x, (_, w, param, route) = got
            routing = "ids"
        else:
            (x, w, route), routing = _grouped_args(args, kwargs), "offs"
            param = self._stack_of(w)
            if param is None or not isinstance(route, torch.Tensor) or not isinstance(x, torch.Tensor):
                return out
        mode.seen += 1
        sink, training = self.sink, torch.is_grad_enabled()
        if (sink.capture_no_grad or training) and sink.roles & {"activation", "weight"}:
            observe(self._graph_taps[param, routing, training], x, w, route)
        if "gradient" in sink.roles and isinstance(out, torch.Tensor) and out.requires_grad:
            # a copy: the model may change the output in place (GPT-OSS adds its experts' biases), which
            # autograd forbids on a custom Function's view; the compiler fuses the copy into its consumer
            return GradObserver.apply(out, self._graph_taps[param, routing, "gradient"], route).clone()
        return out

    def _graph_forward(self, param: str, routing: str, training: bool, x: torch.Tensor, w: torch.Tensor,
                       route: torch.Tensor) -> None:
        """Run by the compiled graph: a grouped (``routing`` "offs") or batched ("ids") GEMM's forward,
        captured as an eager one's."""
        if not self.sink.active:
            return
        hit = self._param(w)
        if hit is None or hit[0] != param or hit[2] is not None:
            self.sink.warn(f"experts-traced:{self.layer}",
                           f"{self.layer}: a compiled GEMM's weight is not the stack {param} its shape matched: "
                           "it is not captured")
            return
        self._host = {}  # no forward's end runs here to clear it
        self._routed(param, x, _weight_of(w, routing, x.shape[-1]), hit[1], None, training=training,
                     **{routing: route})

    def _graph_grad(self, param: str, routing: str, grad: torch.Tensor, route: torch.Tensor) -> None:
        """Run by the compiled backward: a GEMM's output gradient, routed as its input was."""
        sink = self.sink
        if not sink.active:
            return
        n = self._stacks[param].shape[0]
        offs, ids = (route, None) if routing == "offs" else (None, route)
        if self._by_size(param, n):
            self._host = {}
            perm, sizes = self._groups(offs, ids, n)
            self._grads_by_size(param, grad, perm, sizes)
        else:
            ids = _expert_ids(offs, grad.shape[0]) if ids is None else ids
            self._on_grad(param, grad.reshape(grad.shape[0], -1), ids, n)

    def _routed(self, param: str, x: torch.Tensor, weight_of, stack: torch.Tensor, out: torch.Tensor | None,
                offs: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                training: bool | None = None) -> None:
        """``out`` = the GEMMs of ``x``'s rows, each by its expert's weight (``weight_of(e)``, as
        ``[out, in]``; ``stack``, the Parameter, holds them all: read whole, as stored, since an
        expert's amax does not depend on the order of its values, where a transposed view of it would
        be copied); rows ``offs[e-1]:offs[e]`` are expert e's
        (grouped_mm; rows past ``offs[-1]`` belong to nobody: expert-parallel sentinels), or row r is
        expert ``ids[r]``'s (batched_mm)."""
        sink, n = self.sink, stack.shape[0]
        roles = sink.roles
        training = torch.is_grad_enabled() if training is None else training
        forward = sink.capture_no_grad or training
        if self._by_size(param, n):
            # each expert's rows as a plain layer's (the sizes on the host): their taps take full stats of
            # the experts a closer look wants, cheap rows of the others
            perm, sizes = self._groups(offs, ids, n)
            xs = x if perm is None else x[perm]
            start = 0
            for e, size in enumerate(sizes):
                if size and forward:  # the gradient is hooked below, on the whole output (a slice of it gets none)
                    tap = self.tap(e, param)
                    if "activation" in roles:
                        tap.capture("activation", xs[start:start + size], training)
                    if "weight" in roles:
                        tap.capture("weight", weight_of(e), training)
                start += size
            if "gradient" in roles and out is not None and out.requires_grad:
                out.register_hook(lambda g: self._grads_by_size(param, g, perm, sizes) and None)
            return
        if offs is not None:
            ids = _expert_ids(offs, x.shape[0])
        if forward and "activation" in roles:
            self._deferred(param, "activation", x, _parts_by_expert(x, ids, n))
        if forward and "weight" in roles:
            self._deferred(param, "weight", weight_of(0),
                           torch.stack(stack.detach().reshape(n, -1).aminmax(dim=1)[::-1], 1))
        if "gradient" in roles and out is not None and out.requires_grad:
            # (the hook holds no reference to ``out``: a tensor's hook that held its tensor would keep the
            # step's activations alive in a cycle)
            out.register_hook(lambda g: self._on_grad(param, g.reshape(g.shape[0], -1), ids, n) and None)

    def _by_size(self, param: str, n: int) -> bool:
        """Whether this capture of ``param``'s GEMM reads its group sizes on the host and captures each
        expert's rows as a plain layer's: a full step, a recipe other than delayed scaling, or a closer
        look at one of its experts; else one segmented reduction gives every expert's cheap row."""
        return self.sink.full or not self.delayed or bool(self.sink.focus and self._focused(param, n))

    def _focused(self, param: str, n: int) -> bool:
        """Whether a closer look (``StepCollector.look_closer``) wants one of ``param``'s experts."""
        return any(self.tap(e, param).layer in self.sink.focus for e in range(n))

    def _grads_by_size(self, param: str, grad: torch.Tensor, perm: torch.Tensor | None, sizes: list[int]) -> None:
        if not self.sink.active:
            return
        try:  # a hook in the user's backward: a monitor problem must not reach it
            grad = grad.reshape(grad.shape[0], -1)
            grad = grad if perm is None else grad[perm]
            start = 0
            for e, size in enumerate(sizes):
                if size:
                    self.tap(e, param)._on_grad(grad[start:start + size])
                start += size
        except Exception as exc:
            self.sink.fail(exc)

    def _on_grad(self, param: str, grad: torch.Tensor, ids: torch.Tensor, n: int) -> None:
        if not self.sink.active:
            return
        try:
            self._deferred(param, "gradient", grad, _parts_by_expert(grad, ids, n))
        except Exception as exc:
            self.sink.fail(exc)

    def _deferred(self, param: str, role: str, like: torch.Tensor, parts: torch.Tensor) -> None:
        """Every expert's cheap row of ``role`` from its amax parts ``[experts, 2]``."""
        got = self._slots.get((param, role))
        if got is None or got[0].device != like.device:  # made once (again when the model moved), not per step
            shape = tuple(like.shape) if role == "weight" else (-1, *like.shape[1:])  # an expert's rows vary
            slots = [self.tap(e, param).slot(role, like.device, shape) for e in range(parts.shape[0])]
            got = self._slots[param, role] = (slots[0][0], [s for _, s, _ in slots], [k for _, _, k in slots])
        bank, slots, kids = got
        self.sink.record_rows(role, bank.capture_parts(slots, parts), kids)

    def _groups(self, offs: torch.Tensor | None, ids: torch.Tensor | None, n: int):
        """``(perm, sizes)``: the order that puts each expert's rows together (None: they are) and the
        group sizes, read on the host once per forward (both GEMMs of a forward route alike)."""
        key = id(offs if offs is not None else ids)
        got = self._host.get(key)
        if got is None or got[0] is not (offs if offs is not None else ids):
            if offs is not None:
                ends = offs.tolist()
                perm, sizes = None, [b - a for a, b in zip([0] + ends[:-1], ends)]
            else:
                perm, sizes = torch.argsort(ids, stable=True), torch.bincount(ids, minlength=n)[:n].tolist()
            got = self._host[key] = (offs if offs is not None else ids, perm, sizes)
        return got[1], got[2]


class _ExpertGemm:
    """One expert's GEMM as a plain what-if tap reads a layer: its weight as ``[out, in]``."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight


def _as_out_in(w: torch.Tensor, k: int) -> torch.Tensor:
    """An expert's weight as ``[out, in]`` for an input of ``k`` features (stored either way)."""
    return w.t() if w.shape[0] == k and w.shape[1] != k else w


def _grouped_args(args: tuple, kwargs: dict) -> tuple:
    """A grouped GEMM's ``(x, w, offs)``: ``grouped_mm(x, w, offs)`` with ``offs`` by keyword or not."""
    return args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)


def _expert_index(args: tuple) -> bool:
    """Whether ``W[args[1]]`` gathers a stack by one expert id per row (batched_mm)."""
    index = args[1] if len(args) > 1 else None
    return isinstance(index, torch.Tensor) and index.dim() == 1 and not index.is_floating_point() \
        and index.dtype != torch.bool


def _batched_input(gathers: list, args: tuple) -> tuple | None:
    """``(x, gather)`` of ``bmm(x[:, None], W[ids])`` or ``bmm(W[ids], x[..., None])``, where ``gather``
    is the entry of ``gathers`` (``(W[ids], W, name, ids)``) it reads; None for another bmm."""
    a, b = args[0], args[1]
    got = next((g for g in gathers if g[0] is a or g[0] is b), None)
    if got is None:
        return None
    return (a.squeeze(1) if got[0] is b else b.squeeze(-1)), got


def _weight_of(w: torch.Tensor, routing: str, k: int):
    """Expert e's weight as ``[out, in]``: from a grouped GEMM's ``w`` (``routing`` "offs":
    ``[experts, in, out]``) or a batched GEMM's gathered stack ("ids": stored either way, for an
    input of ``k`` features)."""
    if routing == "offs":
        return lambda e: w[e].t()
    return lambda e: _as_out_in(w[e], k)


def _expert_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert from the grouped GEMM's cumulative offsets (``len(offs)`` for rows past the
    last: nobody's)."""
    return torch.bucketize(torch.arange(rows, device=offs.device, dtype=offs.dtype), offs, right=True)


def _parts_by_expert(x: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, 2]``: each expert's (max, min) over its rows of ``x`` (0 and 0 for an expert without rows),
    NaN where one of its rows holds a NaN whatever the device's scatter does with NaN."""
    lo, hi = x.detach().reshape(x.shape[0], -1).aminmax(dim=1)
    zeros = hi.new_zeros(n + 1)
    top = zeros.scatter_reduce(0, ids, hi, "amax")
    low = zeros.scatter_reduce(0, ids, lo, "amin")
    nan = zeros.scatter_reduce(0, ids, hi.isnan().to(hi.dtype), "amax") > 0
    top = top.masked_fill(nan, float("nan"))
    return torch.stack([top, low], 1)[:n]
