"""``fp8_autocast`` for emulated layers: Transformer Engine's region, and when its updates fall due.

TE updates the delayed scales of a region's forward tensors once, when the outermost
``fp8_autocast`` exits with grad enabled (``quantization.py``, ``fp8_autocast_exit``). So a layer run
twice in one region quantizes both calls with one scale and records the larger amax, and a forward
under ``no_grad`` records its amax into the next update without making one. Emulated layers follow
the same timing inside :func:`fp8_autocast`. Outside one, each grad-enabled call of a layer is its
own region (its update falls due at once) and a ``no_grad`` call still records, as inside.

The update itself stays lazy: it is applied at the next use of the scale (batched per model,
``scaling.UpdateGroup``). Between a region's end and that use only the backward runs, which uses
the gradient states and, for a forward re-run by activation checkpointing, the scales of the first
run: what TE's recompute buffers restore.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from .scaling import ScalingState

_region = threading.local()
_switch = threading.local()  # the per-thread off switch of ``fp8_disabled()`` (convert.py) and of a disabled region


def fp8_globally_disabled() -> bool:
    """True inside ``fp8_disabled()`` (no model given) or ``fp8_autocast(enabled=False)`` in this thread."""
    return getattr(_switch, "disabled", False)


def set_globally_disabled(value: bool) -> None:
    _switch.disabled = value


@contextmanager
def globally_disabled() -> Iterator[None]:
    """Every emulated layer of this thread runs as ``nn.Linear`` inside; restored on exit."""
    previous = fp8_globally_disabled()
    set_globally_disabled(True)
    try:
        yield
    finally:
        set_globally_disabled(previous)


def region_open() -> bool:
    """An :func:`fp8_autocast` region is open in this thread."""
    return getattr(_region, "depth", 0) > 0


def note_recorded(state: "ScalingState") -> None:
    """``state`` recorded an amax in the open region: its update falls due when the region ends."""
    _region.states[id(state)] = state


@contextmanager
def fp8_autocast(enabled: bool = True) -> Iterator[None]:
    """A region of emulated FP8 with TE's update timing (see the module's docstring).

    ``enabled=False`` runs every emulated layer as ``nn.Linear`` inside (as TE's
    ``fp8_autocast(enabled=False)``), with the scaling state untouched. Regions nest; the
    outermost one decides."""
    depth = getattr(_region, "depth", 0)
    if depth == 0:
        _region.states = {}
    _region.depth = depth + 1
    try:
        with nullcontext() if enabled else globally_disabled():
            yield
    finally:
        _region.depth = depth
        if depth == 0:
            states, _region.states = _region.states, {}
            if torch.is_grad_enabled():  # TE: no update at the exit of a no-grad region
                for state in states.values():
                    if state._pending:
                        state._set_flags(True, True)


# Which device types have autocast, asked here, outside any trace. Dynamo in torch 2.11 cannot trace
# ``torch.amp.is_autocast_available`` (a call into ``torch._C``; later versions fold it to a
# constant): asked inside a compiled forward, it broke the graph at every emulated layer, forward
# and backward (an H200 with torch 2.11: 18 breaks in the demo model).
_HAS_AUTOCAST = {t: torch.amp.is_autocast_available(t) for t in ("cpu", "cuda", "meta", "xpu", "mps", "hpu")}


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)``: the emulated GEMMs run in the dtypes they
    chose, whatever autocast the user runs. Nothing on a device type without autocast (the "meta"
    device, on which ``tests/test_host_sync.py`` runs the emulated layers), where there is nothing
    to switch off. Another device type is asked once, eagerly; traced, it is taken to have autocast
    (every real accelerator's backend does).

    Nothing either where autocast is off, the usual case: a compiled graph that switches autocast
    (``_enter_autocast``) is one AOT autograd's cache refuses, so a restarted process would trace
    the model's joint graph again (``benchmarks/capture_cost.py --sections restart``). Dynamo
    guards on the autocast state it reads here."""
    has = _HAS_AUTOCAST.get(device_type)
    if has is None:
        if torch.compiler.is_compiling():
            has = True
        else:
            has = _HAS_AUTOCAST[device_type] = torch.amp.is_autocast_available(device_type)
    if not has or not torch.is_autocast_enabled(device_type):
        return nullcontext()
    return torch.autocast(device_type, enabled=False)
