"""A stand-in for ``transformer_engine`` of a given 2.x version, for tests without a GPU.

It encodes TE's *bookkeeping*, version by version, as read in TE's source (paths under
``transformer_engine/``; tag:line, see also ``fp8scope/capture/adapters/te_layout.py``). The GEMMs run
in float32: only the state a monitor reads has to be TE's.

- Delayed-scaling state per module: ``fp8_meta["scaling_fwd"/"scaling_bwd"]`` with ``scale`` [n] ones
  and ``amax_history`` [L, n] zeros, 3 slots per GEMM forward and 2 backward (``pytorch/quantization.py``
  v2.18 1426-1432; ``pytorch/module/base.py``). ``quantizers[key][i]`` view the state.
- Amax recording: ``fmaxf`` from 0 (NaN ignored) accumulated into row 0 with an atomic max until the
  update (``common/recipe/delayed_scaling.cu``; ``vectorized_pointwise.h``). Forwards under no_grad
  record too.
- Forward update at the outermost autocast exit with grad enabled (``pytorch/fp8.py`` v2.0 422-429,
  ``pytorch/quantization.py`` v2.18 762-772); backward update at the end of the backward of the
  autocast's first FP8 module, whose autograd node carries ``reduce_and_update_bwd_fp8_tensors``
  (``module/linear.py`` v2.0 289/585; on ``ctx.backward_objects`` for ``_Linear`` from v2.16, 1298-1332).
- The update is :func:`kernel_bulk`, a transcription of TE's kernel (``delayed_scaling.cu`` 162-250,
  identical in v2.0 and main).
- LayerNormMLP backward slots and GroupedLinear slots per version (``te_layout``'s table, which is
  TE's ``layernorm_mlp.py`` v2.0 119-121/1404-1406, v2.3 1764-1769, v2.4 1880-1885; ``grouped_linear.py``
  v2.0 456, v2.3 525-529); the stand-in takes the slots from its own copy of that table below.
- Current scaling (2.2+): ``Float8CurrentScalingQuantizer`` with ``force_pow_2_scales`` and
  ``amax_epsilon``; ``.scale`` / ``.amax`` buffers written by each cast in 2.2-2.15, none from 2.16
  (``pytorch/csrc/quantizer.cpp`` v2.16 931-936). The scale is :func:`compute_scale_from_amax`,
  transcribed from ``common/recipe/recipe_common.cuh`` (v2.8+ 14-49).
- Weight caching: ``is_first_microbatch=False`` reuses ``_fp8_workspaces[key]``, quantized at the first
  micro-batch, and records no weight amax (``module/base.py``; ``module/linear.py`` v2.18 435-441).
- Split weights: ``parameters_split`` registers ``query_weight`` / ``key_weight`` / ``value_weight``
  (views of one buffer) and ``weight_names``; they are concatenated before one quantization
  (``module/layernorm_linear.py`` v2.18 1471-1554, 1859).
"""

from __future__ import annotations

import enum
import math
import struct
import sys
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

FLT_MAX = 3.4028234663852886e38


# ---- TE's arithmetic, transcribed (plain Python floats, float32 rounding by struct) ----------
def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0] if math.isfinite(v) and abs(v) <= FLT_MAX else v


def kernel_bulk(history: list[float], scale: float, last: float, scaled_max: float, algo: str) -> tuple[list, float]:
    """One column of ``delayed_scaling.cu`` ``kernel_bulk`` (lines 176-250): roll only when the
    amax recorded is not 0, fmaxf from 0, ``scaled_max / amax`` where finite and > 0, inf -> FLT_MAX."""
    length = len(history)
    amax = 0.0
    if last != 0.0:
        new = []
        for i in range(length):
            a = history[i + 1] if i < length - 1 else last
            if not math.isnan(a):
                amax = max(amax, a)
            new.append(a if i > 0 else 0.0)
        history = new
    if algo == "most_recent":
        amax = last
    if math.isfinite(amax) and amax > 0:
        scale = f32(scaled_max / amax)
        if math.isinf(scale) or scale > FLT_MAX:
            scale = FLT_MAX
    return history, scale


def compute_scale_from_amax(amax: float, max_fp8: float, pow2: bool, epsilon: float,
                            value_for_inf: float = FLT_MAX) -> float:
    """``recipe_common.cuh`` 14-49 (v2.8+)."""
    if amax < epsilon:
        amax = epsilon
    if math.isinf(amax) or amax == 0.0 or math.isnan(amax):
        return 1.0
    scale = f32(max_fp8 / amax)
    if math.isinf(scale) or scale > FLT_MAX:
        scale = value_for_inf
    if pow2:
        bits = struct.unpack("<I", struct.pack("<f", scale))[0] & 0xFF800000
        scale = struct.unpack("<f", struct.pack("<I", bits))[0]
    return scale


def float_to_e8m0(val: float) -> int:
    """``float_to_e8m0``, the software path (``common/util/ptx.cuh`` v2.18 386-418), on Python floats."""
    if math.isnan(val):
        return 0xFF
    if math.isinf(val):
        return 0xFE
    if val == 0.0:
        return 0
    u = struct.unpack("<I", struct.pack("<f", val))[0]
    exponent, mantissa = (u >> 23) & 0xFF, u & 0x7FFFFF
    if (mantissa > 0 and exponent != 0xFE) and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def te_amax(t: torch.Tensor) -> float:
    """fmaxf(|x|) from 0: NaN elements ignored."""
    return float(torch.nan_to_num(t.detach().float().abs(), nan=0.0, posinf=math.inf).max()) if t.numel() else 0.0


# ---- the version table (TE's source; see the module docstring) ------------------------------
def mlp_grad_slots(v: tuple[int, int]) -> tuple[int, int]:
    """(fc1 hidden gradient, fc2 grad_output) backward slots LayerNormMLP really uses."""
    return (1, 3) if v < (2, 3) else (1, 0) if v < (2, 4) else (0, 2)


def grouped_slots(v: tuple[int, int], i: int, n: int) -> tuple[int, int, int]:
    return (i, n + i, i) if v < (2, 3) else (3 * i, 3 * i + 1, 2 * i)


# ---- recipes (common/recipe/__init__.py) -------------------------------------------------------
class Format(enum.Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"
    E2M1 = "E2M1"


class QParams:
    def __init__(self, power_2_scale=False, amax_epsilon=0.0):
        self.power_2_scale, self.amax_epsilon = power_2_scale, amax_epsilon


class Recipe:
    def delayed(self): return isinstance(self, DelayedScaling)
    def float8_current_scaling(self): return isinstance(self, Float8CurrentScaling)
    def mxfp8(self): return isinstance(self, MXFP8BlockScaling)
    def float8_block_scaling(self): return isinstance(self, Float8BlockScaling)
    def nvfp4(self): return isinstance(self, NVFP4BlockScaling)
    def custom(self): return isinstance(self, CustomRecipe)


class DelayedScaling(Recipe):
    def __init__(self, margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
                 reduce_amax=True):
        self.margin, self.fp8_format, self.amax_history_len = margin, fp8_format, amax_history_len
        self.amax_compute_algo, self.reduce_amax = amax_compute_algo, reduce_amax


class Float8CurrentScaling(Recipe):
    def __init__(self, fp8_format=Format.HYBRID, use_power_2_scales=False):
        self.fp8_format, self.use_power_2_scales = fp8_format, use_power_2_scales
        q = QParams(power_2_scale=use_power_2_scales)
        self.fp8_quant_fwd_inp = self.fp8_quant_fwd_weight = self.fp8_quant_bwd_grad = q


class MXFP8BlockScaling(Recipe):
    def __init__(self, margin=0, fp8_format=Format.E4M3):
        self.margin, self.fp8_format = margin, fp8_format


class Float8BlockScaling(Recipe):
    def __init__(self, fp8_format=Format.E4M3, x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1):
        self.fp8_format = fp8_format
        self.x_block_scaling_dim, self.w_block_scaling_dim = x_block_scaling_dim, w_block_scaling_dim
        self.grad_block_scaling_dim = grad_block_scaling_dim
        self.fp8_quant_fwd_inp = self.fp8_quant_fwd_weight = self.fp8_quant_bwd_grad = QParams(True)


class NVFP4BlockScaling(Recipe):
    """``common/recipe/__init__.py``: the three switches from 2.8 (v2.8 412-416), ``row_scaled_activation``
    from 2.16 (v2.16 538), ``nvfp4_4over6`` from 2.17 (v2.17 554); all off by default."""

    fp8_format = Format.E4M3  # the block scales' format; the elements are E2M1

    def __init__(self, disable_rht=False, disable_stochastic_rounding=False, disable_2d_quantization=False,
                 row_scaled_activation=False, nvfp4_4over6="none"):
        self.disable_rht, self.disable_stochastic_rounding = disable_rht, disable_stochastic_rounding
        self.disable_2d_quantization, self.row_scaled_activation = disable_2d_quantization, row_scaled_activation
        self.nvfp4_4over6 = nvfp4_4over6


class CustomRecipe(Recipe):
    fp8_format = Format.E4M3


# ---- quantizers (pytorch/tensor/*.py) ---------------------------------------------------------
class Float8Quantizer:
    def __init__(self, scale, amax):
        self.scale, self.amax = scale, amax  # views of the recipe state


class Float8CurrentScalingQuantizer:
    def __init__(self, buffers: bool, pow2=False, eps=0.0):
        self.force_pow_2_scales, self.amax_epsilon, self.with_amax_reduction = pow2, eps, False
        if buffers:  # 2.2-2.15
            self.scale, self.amax = torch.ones(1), torch.zeros(1)


class MXFP8Quantizer:
    pass


class Float8BlockQuantizer:
    def __init__(self, block_scaling_dim, pow2=True, eps=0.0):
        self.block_scaling_dim, self.force_pow_2_scales, self.amax_epsilon = block_scaling_dim, pow2, eps


class Float8Tensor(torch.Tensor):
    """A cached FP8 weight: only its ``_scale_inv`` matters here."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor):
        t = torch.Tensor._make_subclass(cls, data.detach())
        t._scale_inv = scale_inv
        return t


class RecipeState:
    def __init__(self, n: int, length: int):
        self.scale = torch.ones(n)
        self.amax_history = torch.zeros(length, n)


# ---- autocast and the global buffers (pytorch/fp8.py, pytorch/quantization.py) -----------------
class _Global:
    depth = 0
    recipe = None
    first = False
    modules: list = []


def _update(mod, key: str) -> None:
    rec = mod.fp8_meta["recipe"]
    if not rec.delayed():
        return
    st = mod.fp8_meta[key]
    fmax = mod.fp8_meta["fp8_max_fwd" if key == "scaling_fwd" else "fp8_max_bwd"]
    scaled_max = f32(fmax * 2.0 ** -rec.margin)
    for i in range(st.scale.numel()):
        h, s = kernel_bulk(st.amax_history[:, i].tolist(), float(st.scale[i]), float(st.amax_history[0, i]),
                           scaled_max, rec.amax_compute_algo)
        st.amax_history[:, i] = torch.tensor(h)  # in place, as the kernel
        st.scale[i] = s


@contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe=None, fp8_group=None):
    outer = _Global.depth == 0
    saved = (_Global.recipe, _Global.enabled if hasattr(_Global, "enabled") else False)
    if outer:
        _Global.first, _Global.modules = True, []
    _Global.depth += 1
    _Global.recipe, _Global.enabled = (fp8_recipe or DelayedScaling()), enabled
    try:
        yield
    finally:
        _Global.depth -= 1
        _Global.recipe, _Global.enabled = saved
        if enabled and _Global.depth == 0 and torch.is_grad_enabled():
            for m in _Global.modules:  # reduce_and_update_fp8_tensors(forward=True)
                _update(m, "scaling_fwd")


# ---- modules --------------------------------------------------------------------------------
class _Base(nn.Module):
    VERSION = (2, 18)
    num_gemms = 1

    def __init__(self):
        super().__init__()
        self.fp8 = False
        self.fp8_meta: dict = {}
        self.quantizers = {"scaling_fwd": [], "scaling_bwd": []}
        self._fp8_workspaces: dict = {}

    def _init_fp8(self) -> bool:
        self.fp8 = getattr(_Global, "enabled", False) and _Global.depth > 0
        if not self.fp8:
            return False
        rec = _Global.recipe
        n = self.num_gemms
        if self.fp8_meta.get("recipe") is not rec:
            fmt_name = rec.fp8_format.name
            self.fp8_meta = {"recipe": rec, "num_gemms": n, "fp8_max_fwd": 448.0,
                             "fp8_max_bwd": 57344.0 if fmt_name == "HYBRID" else 448.0}
            if rec.delayed():
                for key, k in (("scaling_fwd", 3), ("scaling_bwd", 2)):
                    st = self.fp8_meta[key] = RecipeState(k * n, rec.amax_history_len)
                    self.quantizers[key] = [Float8Quantizer(st.scale[i], st.amax_history[0][i].reshape(1))
                                            for i in range(k * n)]
            elif rec.float8_current_scaling():
                buffers = (2, 2) <= self.VERSION < (2, 16)
                for key, k in (("scaling_fwd", 3), ("scaling_bwd", 2)):
                    self.quantizers[key] = [Float8CurrentScalingQuantizer(buffers, rec.use_power_2_scales)
                                            for _ in range(k * n)]
            elif rec.mxfp8():
                self.quantizers = {key: [MXFP8Quantizer() for _ in range(k * n)]
                                   for key, k in (("scaling_fwd", 3), ("scaling_bwd", 2))}
            elif rec.float8_block_scaling():
                fwd = []
                for _ in range(n):
                    fwd += [Float8BlockQuantizer(rec.x_block_scaling_dim), Float8BlockQuantizer(rec.w_block_scaling_dim),
                            Float8BlockQuantizer(rec.x_block_scaling_dim)]
                self.quantizers = {"scaling_fwd": fwd,
                                   "scaling_bwd": [Float8BlockQuantizer(rec.grad_block_scaling_dim) for _ in range(2 * n)]}
            else:
                self.quantizers = {"scaling_fwd": [None] * 3 * n, "scaling_bwd": [None] * 2 * n}
        if self not in _Global.modules:
            _Global.modules.append(self)
        return True

    def _first(self) -> bool:
        first, _Global.first = _Global.first, False
        return first

    def cast(self, key: str, slot: int, t: torch.Tensor) -> None:
        """What the quantize kernel leaves in the state: the amax (delayed) or the buffers (current)."""
        rec = self.fp8_meta["recipe"]
        if rec.delayed():
            h = self.fp8_meta[key].amax_history
            h[0, slot] = max(float(h[0, slot]), te_amax(t))  # atomicMaxFloat
        elif rec.float8_current_scaling():
            q = self.quantizers[key][slot]
            if hasattr(q, "scale"):
                amax = te_amax(t)
                fmax = self.fp8_meta["fp8_max_fwd" if key == "scaling_fwd" else "fp8_max_bwd"]
                q.amax.fill_(amax)
                q.scale.fill_(compute_scale_from_amax(amax, fmax, q.force_pow_2_scales, q.amax_epsilon))

    def cast_weight(self, slot: int, key: str, w: torch.Tensor, is_first_microbatch) -> None:
        if is_first_microbatch is False and key in self._fp8_workspaces:
            return  # the cached FP8 weight: no quantize call, no amax recorded
        self.cast("scaling_fwd", slot, w)
        if is_first_microbatch is not None and self.fp8_meta["recipe"].delayed():
            scale = self.fp8_meta["scaling_fwd"].scale[slot]
            self._fp8_workspaces[key] = Float8Tensor(w, scale.reciprocal().reshape(1).clone())

    def backward_update(self, first: bool) -> None:
        if first:  # reduce_and_update_fp8_tensors(forward=False) over the autocast's modules
            for m in _Global.modules:
                _update(m, "scaling_bwd")


def _function(name: str, module_kind: str):
    """A ``torch.autograd.Function`` named as TE's (its node is ``<name>Backward``) that runs a module's
    float32 computation, records TE's amaxes and carries TE's backward-update flag."""

    def forward(ctx, mod, x, *weights):
        ctx.mod = mod
        # only when an input requires grad (linear.py v2.18 566-570: the Function's forward runs with grad off)
        first = mod._first() if mod.fp8 and any(t.requires_grad for t in (x, *weights)) else False
        if name == "_Linear" and mod.VERSION >= (2, 16):
            ctx.backward_objects = types.SimpleNamespace(reduce_and_update_bwd_fp8_tensors=first)
        else:
            ctx.reduce_and_update_bwd_fp8_tensors = first
        with torch.enable_grad():
            xs = x.detach().requires_grad_(x.requires_grad)
            ws = [w.detach().requires_grad_(w.requires_grad) for w in weights]
            hidden = {}
            out = mod.compute(xs, ws, hidden)
        ctx.graph = (xs, ws, out, hidden)
        return out.detach()

    def backward(ctx, grad):
        mod = ctx.mod
        xs, ws, out, hidden = ctx.graph
        if mod.fp8:
            mod.cast("scaling_bwd", mod.grad_slot, grad)
        inputs = [t for t in [xs, *ws] if t.requires_grad]
        if "h" in hidden and mod.fp8:
            hidden["h"].register_hook(lambda g: mod.cast("scaling_bwd", mod.hidden_grad_slot, g) and None)
        grads = iter(torch.autograd.grad(out, inputs, grad, allow_unused=True))
        result = [next(grads) if t.requires_grad else None for t in [xs, *ws]]
        if name == "_Linear" and mod.VERSION >= (2, 16):
            first = ctx.backward_objects.reduce_and_update_bwd_fp8_tensors
            ctx.backward_objects = None
        else:
            first = ctx.reduce_and_update_bwd_fp8_tensors
        if mod.fp8:
            mod.backward_update(first)  # at the end of the backward (linear.py v2.18 1388-1396)
        return (None, *result)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


class _LinearLike(_Base):
    grad_slot = 0

    def __init__(self, in_features, out_features, bias=True, parameters_split=None, norm=False, eps=1e-5,
                 normalization="LayerNorm", zero_centered_gamma=False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        weight = torch.randn(out_features, in_features) / in_features ** 0.5
        if parameters_split:
            self.weight_names, start = [], 0
            for split_name, size in parameters_split.items():
                pname = f"{split_name.rstrip('_')}_weight"
                self.register_parameter(pname, nn.Parameter(weight[start:start + size]))
                self.weight_names.append(pname)
                start += size
        else:
            self.weight = nn.Parameter(weight)
            self.weight_names = ["weight"]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.norm = norm
        if norm:
            self.layer_norm_weight = nn.Parameter(torch.ones(in_features) + 0.1 * torch.randn(in_features))
            self.layer_norm_bias = nn.Parameter(0.1 * torch.randn(in_features))
            self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self._fn = _function("_LayerNormLinear" if norm else "_Linear", "linear")

    def _weights(self):
        return [getattr(self, n) for n in self.weight_names]

    def compute(self, x, ws, hidden):
        w = torch.cat(ws) if len(ws) > 1 else ws[0]  # noop_cat before the one quantization
        inp = _norm(self, x) if self.norm else x
        if self.fp8:
            self.cast("scaling_fwd", 0, inp)
            self.cast_weight(1, "weight", w, self._is_first_mb)
        out = inp @ w.t()
        return out + self.bias if self.bias is not None else out

    def forward(self, inp, is_first_microbatch=None):
        self._init_fp8()
        self._is_first_mb = is_first_microbatch
        return self._fn.apply(self, inp, *self._weights())


def _norm(mod, x):
    w = mod.layer_norm_weight + (1.0 if mod.zero_centered_gamma else 0.0)
    xf = x.float()
    if mod.normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + mod.eps) * w.float()
    else:
        y = F.layer_norm(xf, xf.shape[-1:], w.float(), mod.layer_norm_bias.float(), mod.eps)
    return y.to(x.dtype)


class Linear(_LinearLike):
    def __init__(self, in_features, out_features, bias=True, parameters_split=None, **kw):
        super().__init__(in_features, out_features, bias, parameters_split)


class LayerNormLinear(_LinearLike):
    def __init__(self, in_features, out_features, bias=True, parameters_split=None, eps=1e-5, **kw):
        super().__init__(in_features, out_features, bias, parameters_split, norm=True, eps=eps, **kw)


class LayerNormMLP(_Base):
    num_gemms = 2

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, **kw):
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.randn(ffn_hidden_size, hidden_size) / hidden_size ** 0.5)
        self.fc2_weight = nn.Parameter(torch.randn(hidden_size, ffn_hidden_size) / ffn_hidden_size ** 0.5)
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.layer_norm_bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps, self.normalization, self.zero_centered_gamma = eps, "LayerNorm", False
        self._fn = _function("_LayerNormMLP", "mlp")
        self.hidden_grad_slot, self.grad_slot = mlp_grad_slots(self.VERSION)

    def compute(self, x, ws, hidden):
        w1, w2 = ws
        ln = _norm(self, x)
        h = ln @ w1.t()
        hidden["h"] = h
        act = F.gelu(h)
        if self.fp8:
            self.cast("scaling_fwd", 0, ln)
            self.cast_weight(1, "fc1_weight", w1, self._is_first_mb)
            self.cast("scaling_fwd", 3, act)
            self.cast_weight(4, "fc2_weight", w2, self._is_first_mb)
        return act @ w2.t()

    def forward(self, inp, is_first_microbatch=None):
        self._init_fp8()
        self._is_first_mb = is_first_microbatch
        return self._fn.apply(self, inp, self.fc1_weight, self.fc2_weight)


class GroupedLinear(_Base):
    def __init__(self, num_gemms, in_features, out_features, bias=False, **kw):
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5))
        self._fn = _function("_GroupedLinear", "grouped")

    def compute(self, x, ws, hidden):
        outs = []
        for i, (xi, w) in enumerate(zip(torch.split(x, self._splits), ws)):
            a, wslot, _ = grouped_slots(self.VERSION, i, self.num_gemms)
            if self.fp8:
                self.cast("scaling_fwd", a, xi)
                self.cast_weight(wslot, f"weight{i}", w, self._is_first_mb)
            outs.append(xi @ w.t())
        out = torch.cat(outs)
        if self.fp8:
            splits = self._splits

            def record(g):
                for i, gi in enumerate(torch.split(g, splits)):
                    self.cast("scaling_bwd", grouped_slots(self.VERSION, i, self.num_gemms)[2], gi)
            out.register_hook(lambda g: record(g) and None)
        return out

    grad_slot = None

    def cast(self, key, slot, t):
        if slot is None:  # the generic backward's single grad_output cast: done per GEMM above
            return
        super().cast(key, slot, t)

    def forward(self, inp, m_splits, is_first_microbatch=None):
        self._init_fp8()
        self._is_first_mb, self._splits = is_first_microbatch, list(m_splits)
        return self._fn.apply(self, inp, *[getattr(self, f"weight{i}") for i in range(self.num_gemms)])


def install(monkeypatch, version: str) -> types.ModuleType:
    """Put a stand-in of TE ``version`` (e.g. "2.3.0") into ``sys.modules``; returns its ``pytorch``."""
    v = tuple(int(p) for p in version.split(".")[:2])
    te = types.ModuleType("transformer_engine")
    te.__version__ = version
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for cls in (Format, DelayedScaling, MXFP8BlockScaling):
        setattr(recipe, cls.__name__, cls)
    if v >= (2, 2):
        recipe.Float8CurrentScaling = Float8CurrentScaling
    if v >= (2, 3):
        recipe.Float8BlockScaling = Float8BlockScaling
    if v >= (2, 8):
        recipe.NVFP4BlockScaling = NVFP4BlockScaling
    if v >= (2, 12):
        recipe.CustomRecipe = CustomRecipe
    pt = types.ModuleType("transformer_engine.pytorch")
    for cls in (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear):
        setattr(pt, cls.__name__, type(cls.__name__, (cls,), {"VERSION": v}))
    pt.fp8_autocast = fp8_autocast
    te.pytorch, te.common, common.recipe = pt, common, recipe
    for name, mod in (("transformer_engine", te), ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe), ("transformer_engine.pytorch", pt)):
        monkeypatch.setitem(sys.modules, name, mod)
    _Global.depth, _Global.modules, _Global.first = 0, [], False
    return pt
