"""Swap the linear layers of a model for :class:`Fp8Linear`, and switch FP8 off for a while.

``convert_to_fp8`` works in place and shares Parameters, so it can run after the
optimizer was built. ``fp8_disabled`` is the BF16 side of an FP8-vs-BF16
comparison: same model, same weights, plain ``nn.Linear`` numerics, scaling
state untouched.
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from typing import Iterable, Iterator

from torch import nn

from ..compiled import prepare
from ..linear_like import describe_skipped, linear_kind
from .autocast import globally_disabled
from .linear import Fp8Linear
from .scaling import UpdateGroup
from .recipes import CurrentScaling, DelayedScaling, Recipe

Selection = str | Iterable[str] | None


def _convertible(module: nn.Module) -> bool:
    """A linear layer whose forward is exactly its GEMM (``nn.Linear``, ``transformers``'
    ``Conv1D``; ``fp8scope.linear_like``), not already converted.

    Subclasses that override ``forward`` (LoRA wrappers, quantized layers...) and tensor-parallel
    wrappers are left alone, with a warning: replacing them would silently drop their behaviour
    (or their communication)."""
    kind = linear_kind(module)
    return kind is not None and kind.convertible and not isinstance(module, Fp8Linear)


def _matcher(selection: Selection, what: str, candidates: list[str]):
    """Return ``name -> bool`` for a regex (``re.search``) or a list of exact names.

    Raises ValueError if the selection matches nothing (a regex) or names a layer
    that is not a convertible Linear (a list): a typo must not silently convert
    everything or nothing.
    """
    if selection is None:
        return None
    if isinstance(selection, str):
        pattern = re.compile(selection)
        if not any(pattern.search(n) for n in candidates):
            raise ValueError(f"{what}={selection!r} matches no convertible linear layer; candidates: {candidates}")
        return lambda name: pattern.search(name) is not None
    names = set(selection)
    missing = sorted(names - set(candidates))
    if missing:
        raise ValueError(f"{what} names no convertible linear layer for {missing}; candidates: {candidates}")
    return lambda name: name in names


def convert_to_fp8(
    model: nn.Module,
    recipe: Recipe | None = None,
    layers: Selection = None,
    skip: Selection = None,
    amax_reduction_group=None,
) -> nn.Module:
    """Replace the linear layers of ``model`` (``nn.Linear`` and ``transformers``' ``Conv1D``) by
    :class:`Fp8Linear`, in place.

    ``layers``: regex (``re.search`` on the qualified name, e.g. ``"mlp"``) or list
    of qualified names to include; default all. ``skip``: same form, to exclude
    (e.g. ``skip=["lm_head"]`` keeps the head in high precision). Returns
    ``model``; if ``model`` itself is a linear layer the new layer is returned. Other
    linear-like layers the selection covers (tensor-parallel wrappers, subclasses with a
    forward of their own) stay as they are, named in one warning.
    """
    recipe = recipe if recipe is not None else DelayedScaling()
    candidates = [name for name, m in model.named_modules() if _convertible(m)]
    include = _matcher(layers, "layers", candidates)
    exclude = _matcher(skip, "skip", candidates)
    chosen = [n for n in candidates if (include is None or include(n)) and not (exclude and exclude(n))]
    if layers is not None and not chosen:
        raise ValueError(f"layers={layers!r} minus skip={skip!r} leaves no layer to convert")
    left = [(n, m) for n, m in model.named_modules()
            if linear_kind(m) is not None and not _convertible(m) and not isinstance(m, Fp8Linear)
            and (include is None or include(n)) and not (exclude and exclude(n))]
    if left:
        warnings.warn(f"fp8scope: convert_to_fp8 left {len(left)} linear-like layer(s) in high precision, whose "
                      f"forward is more than a GEMM: {describe_skipped(left)}", RuntimeWarning, stacklevel=2)
    prepare({p.device.type for p in model.parameters()})  # what loading compiled code takes: now, not in a step
    group = UpdateGroup(amax_reduction_group)  # the model's states update together (one batch a step)
    for m in model.modules():  # layers converted by an earlier call join too
        if isinstance(m, Fp8Linear):
            m.join_update_group(group)
    for name in chosen:
        old = model.get_submodule(name)
        new = Fp8Linear.from_linear(old, recipe)
        new.join_update_group(group)
        if name == "":
            return new
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model


@contextmanager
def fp8_disabled(model: nn.Module | None = None) -> Iterator[None]:
    """Run with emulated FP8 off: every Fp8Linear behaves exactly as nn.Linear.

    With no ``model`` the switch is global for the current thread; with a model
    only its Fp8Linear layers are switched. The previous state is restored on
    exit, exceptions included, so nested uses compose.
    """
    if model is None:
        with globally_disabled():
            yield
        return
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    previous_flags = [m.fp8_enabled for m in layers]
    for m in layers:
        m.fp8_enabled = False
    try:
        yield
    finally:
        for m, flag in zip(layers, previous_flags):
            m.fp8_enabled = flag
