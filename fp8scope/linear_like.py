"""Which modules are linear layers: the one registry that monitoring and conversion both ask.

A linear-like layer computes ``y = x @ W^T + b`` with one weight matrix. Models hold them in
several shapes, and a layer that nobody recognises is a layer nobody monitors:

- ``torch.nn.Linear`` and its subclasses (weight ``[out, in]``);
- ``transformers``' ``Conv1D`` (GPT-2, GPT-J-era checkpoints): a linear layer whose weight is
  stored transposed, ``[in, out]``, applied with ``addmm``;
- tensor-parallel wrappers (Megatron-LM's and fairscale's ``ColumnParallelLinear`` /
  ``RowParallelLinear``): plain ``nn.Module`` subclasses holding a ``[out, in]`` weight shard,
  calling ``F.linear`` (or a fused GEMM + all-reduce), and in Megatron returning
  ``(output, bias)``;
- any other leaf module whose class name ends in ``Linear`` and which holds a 2-D ``weight``
  (fused and quantized linears of other libraries). Its orientation is read off the input it
  is called with;
- classes registered with :func:`register_linear_like`.

Each kind says where the weight is and which way round, and whether ``convert_to_fp8`` may
replace the layer by the emulated ``Fp8Linear`` (only where forward is exactly a GEMM: a
parallel wrapper's communication or a subclass's extra behaviour would be lost).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LAYOUTS = ("out_in", "in_out", "infer")


@dataclass(frozen=True)
class LinearKind:
    """How to read one kind of linear layer.

    ``layout``: ``"out_in"`` (``nn.Linear``), ``"in_out"`` (``Conv1D``) or ``"infer"`` (decided
    from the input's last dimension at capture time). ``convertible``: ``convert_to_fp8`` may swap
    it for ``Fp8Linear`` sharing its Parameters."""

    name: str
    layout: str = "out_in"
    convertible: bool = False

    def weight(self, module: nn.Module, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """The weight as ``[out, in]`` (a view, never a copy), or None where the module holds none
        (Megatron's ``skip_weight_param_allocation`` passes it to forward instead)."""
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return None
        if self.layout == "in_out":
            return w.t()
        if self.layout == "infer" and x is not None and x.dim() >= 1:
            k = x.shape[-1]
            if k == w.shape[0] and k != w.shape[1]:
                return w.t()
        return w


def output_tensor(output: Any) -> torch.Tensor | None:
    """The GEMM's output in what forward returned: the tensor, or the first element of a tuple or
    list (Megatron's ``(output, bias)``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def replace_output(output: Any, tensor: torch.Tensor) -> Any:
    """``output`` with its GEMM output replaced by ``tensor`` (same container type)."""
    if isinstance(output, torch.Tensor):
        return tensor
    if isinstance(output, tuple):
        return (tensor, *output[1:])
    if isinstance(output, list):
        return [tensor, *output[1:]]
    return output


NN_LINEAR = LinearKind("nn.Linear", "out_in", convertible=True)
NN_LINEAR_SUBCLASS = LinearKind("nn.Linear subclass", "out_in")
CONV1D = LinearKind("transformers Conv1D", "in_out", convertible=True)
PARALLEL = LinearKind("tensor-parallel linear", "out_in")
BY_NAME = LinearKind("linear (by class name)", "infer")

_PARALLEL_NAMES = frozenset({"ColumnParallelLinear", "RowParallelLinear"})
_registered: list[tuple[type, LinearKind]] = []


def register_linear_like(cls: type, layout: str = "out_in", name: str | None = None) -> None:
    """Tell fp8scope that instances of ``cls`` are linear layers holding ``weight``.

    ``layout``: ``"out_in"`` like ``nn.Linear``, ``"in_out"`` for a transposed weight, or
    ``"infer"``. The monitor then captures them (what-if stats); ``convert_to_fp8`` leaves them
    alone. Registering the same class again replaces its entry."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_linear_like expects an nn.Module subclass, got {cls!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _registered[:] = [(c, k) for c, k in _registered if c is not cls]
    _registered.insert(0, (cls, LinearKind(name or cls.__name__, layout)))


def _is_leaf(module: nn.Module) -> bool:
    return next(iter(module.children()), None) is None


def _is_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return (any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers") for c in cls.__mro__)
            and hasattr(module, "nf"))


def linear_kind(module: nn.Module) -> LinearKind | None:
    """The kind of linear layer ``module`` is, or None."""
    for cls, kind in _registered:
        if isinstance(module, cls):
            return kind
    if isinstance(module, nn.Linear):
        return NN_LINEAR if type(module).forward is nn.Linear.forward else NN_LINEAR_SUBCLASS
    if _is_conv1d(module):
        return CONV1D if type(module).__name__ == "Conv1D" else LinearKind("Conv1D subclass", "in_out")
    w = getattr(module, "weight", None)
    name = type(module).__name__
    if name in _PARALLEL_NAMES and (w is None or (isinstance(w, torch.Tensor) and w.dim() == 2)):
        return PARALLEL
    if name.endswith("Linear") and isinstance(w, torch.Tensor) and w.dim() == 2 and _is_leaf(module):
        return BY_NAME
    return None


# the attribute an experts module keeps its expert count in, by library
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_partition")


def _expert_counts(module: nn.Module) -> set[int]:
    """The expert counts ``module`` keeps (under any of the libraries' names)."""
    return {getattr(module, a) for a in _EXPERT_COUNTS if isinstance(getattr(module, a, None), int)}


def expert_weights(module: nn.Module) -> list[nn.Parameter]:
    """The module's own 3-D Parameters stacking one weight matrix per expert, or []: a Parameter of
    shape ``[experts, out, in]`` (or ``[experts, in, out]``) whose first side is the module's expert
    count (``num_experts`` and its aliases), or of a class whose name says Expert. Convolutions'
    3-D weights are not experts, nor is a ``[1, tokens, features]`` position embedding."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return []
    counts = _expert_counts(module)
    named = "expert" in type(module).__name__.lower()
    return [p for p in module.parameters(recurse=False)
            if p.dim() == 3 and (p.shape[0] in counts or (named and p.shape[0] > 1))]


def is_router(module: nn.Module) -> bool:
    """A MoE router: a leaf holding one ``[experts, hidden]`` matrix (``MixtralTopKRouter``,
    ``GptOssTopKRouter``...): its class name says Router, or its rows are its expert count. Every FP8
    recipe keeps routers in high precision, so leaving one unmonitored is no gap worth a warning."""
    w = getattr(module, "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2):
        return False
    return "router" in type(module).__name__.lower() or w.shape[0] in _expert_counts(module)


_NOT_GEMMS = (nn.Embedding, nn.EmbeddingBag)


def holds_weight_matrix(module: nn.Module) -> bool:
    """A leaf module with a 2-D weight Parameter that is not a lookup table: a GEMM layer of some
    kind, worth a word if nothing claims it."""
    w = getattr(module, "weight", None)
    return (isinstance(w, nn.Parameter) and w.dim() == 2 and _is_leaf(module)
            and not isinstance(module, _NOT_GEMMS))


def describe_skipped(skipped: Iterable[tuple[str, nn.Module]], limit: int = 4) -> str:
    """``"a.b (Cls), c (Cls2) and 3 more"`` for a one-line warning."""
    items = [f"{name} ({type(m).__name__})" for name, m in skipped]
    head = ", ".join(items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")
