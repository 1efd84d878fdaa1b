"""Planted, real instabilities for the demo: hooks that change real tensors at a chosen step.

Each kind reproduces one failure signature from the FP8 reference (§5) by acting
on the actual tensors a layer sees, so the monitor has to *detect* it rather than
being told about it:

``outlier:LAYER:STEP[:FACTOR[:DURATION]]``
    Multiply a few fixed input channels of LAYER by FACTOR (default 1000) for
    DURATION steps (default 1; 0 = forever) from STEP on. Under delayed scaling the
    scale comes from the amax *history*, which has never seen such a value: the
    step saturates (signature 1). The spike then sits in the history, the scale
    stays ~FACTOR too small and the bulk of the tensor underflows for up to
    ``amax_history_len`` steps although amax is back to normal (signature 2).
    (Measured on the demo, ``blocks.1.mlp.down``, history 16: ~2% of the input
    saturates at STEP, then ~4% underflows for 16 steps instead of ~0.05%.)
    With DURATION 0 it becomes a persistent outlier feature (signature 5).
``nan:LAYER:STEP``
    Put one NaN into LAYER's input at STEP only. It propagates to the loss, the
    gradients and (through the optimizer) the weights: the monitor should name
    LAYER as the first module with a non-finite value (signature 6).
``gradscale:LAYER:STEP[:FACTOR]``
    From STEP on, multiply the gradient arriving at LAYER's output (grad_output)
    by FACTOR (default 1e-8), like a broken loss scale (signature 3). Under delayed
    scaling the E5M2 scale still reflects the old, larger gradients, so a large part
    of grad_output underflows (measured on the demo, 2 layers, history 16: ~24% with
    1e-8, nearly all with 1e-10) until the history forgets them, ``amax_history_len``
    steps later; current scaling absorbs it at once. The layer's weight gradient and
    its share of upstream gradients shrink by FACTOR in any precision (the residual
    path keeps upstream layers alive).
``lr:STEP[:FACTOR]``
    From STEP on, multiply the learning rate by FACTOR (default 100): a loss blow-up
    that is *not* FP8's fault (on the demo the loss jumps from ~2.0 back to ~3.0 and
    stays there; grad clipping keeps it finite), so the monitor can show it happens
    in BF16 too (signatures 8 and 9).

``grow:LAYER:STEP[:FACTOR[:DURATION]]``
    From STEP on, multiply the same few input channels of LAYER by a factor that grows
    geometrically to FACTOR (default 8) over DURATION steps (default 70), then stays: a
    slowly growing outlier feature (the SwiGLU amplification of signature 4). The weight's
    matching input columns are divided by the same factor (a parametrization of LAYER's
    weight), so in exact arithmetic the layer computes what it did: only the range of its
    input grows, as with real outlier features in a model BF16 trains well. Without that, the
    optimizer shrank the channels back (a ``transformers`` Llama's down projection input grew
    3-5x under a planted 256x) and the fault never reached FP8. Its peers stay flat; FP8 loses
    the rest of the input to a scale set by the outliers, and the layer saturates once the
    growth outruns the amax history.
``reset:LAYER:STEP``
    At STEP, reset LAYER's FP8 scaling state (an emulated ``Fp8Linear``): scale 1 and an empty
    amax history, what a checkpoint resumed without its FP8 state does. Under delayed scaling the
    next steps quantize with scale 1: small gradients underflow E5M2 until the history refills.
``batch:STEP[:DURATION]``
    At STEP (for DURATION steps, default 1) the batch is replaced by uniformly random tokens: a
    bad batch. The loss jumps in any precision; FP8 is not to blame.

Steps are 0-based optimizer-step indices: the training loop sets ``Injector.step``
before each forward pass. Hooks are registered with ``prepend=True`` so they run
before any hook a monitor puts on the same module: the monitor sees the modified tensor.
Attach *after* ``convert_to_fp8``: conversion replaces modules, and hooks on the old
module would be lost with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

KINDS = ("outlier", "nan", "gradscale", "lr", "grow", "reset", "batch")
_DEFAULT_FACTOR = {"outlier": 1000.0, "gradscale": 1e-8, "lr": 100.0, "grow": 8.0}
_DEFAULT_DURATION = {"outlier": 1, "grow": 70}
_USAGE = (
    "expected one of: outlier:LAYER:STEP[:FACTOR[:DURATION]], nan:LAYER:STEP, "
    "gradscale:LAYER:STEP[:FACTOR], lr:STEP[:FACTOR], grow:LAYER:STEP[:FACTOR[:DURATION]], reset:LAYER:STEP, "
    "batch:STEP[:DURATION]  (e.g. outlier:blocks.2.mlp.down:150:1000)"
)
N_OUTLIER_CHANNELS = 4


@dataclass(frozen=True)
class Injection:
    """One parsed spec. ``layer`` is None only for ``lr``; ``duration`` None means forever."""

    kind: str
    step: int
    layer: str | None = None
    factor: float = 1.0
    duration: int | None = 1

    def active(self, step: int) -> bool:
        """Whether this injection acts at ``step``."""
        if step < self.step:
            return False
        if self.kind == "grow":  # grows for ``duration`` steps, then stays
            return True
        return self.duration is None or step < self.step + self.duration

    def multiplier(self, step: int) -> float:
        """The channel factor at ``step``: ``factor`` for an outlier, the geometric ramp of ``grow``."""
        if self.kind != "grow":
            return self.factor
        frac = min(1.0, (step - self.step + 1) / max(1, self.duration or 1))
        return float(self.factor ** frac)

    @property
    def spec(self) -> str:
        """Canonical spec string (round-trips through ``parse_spec``); goes into run metadata."""
        if self.kind == "lr":
            return f"lr:{self.step}:{self.factor:g}"
        if self.kind == "nan":
            return f"nan:{self.layer}:{self.step}"
        if self.kind == "gradscale":
            return f"gradscale:{self.layer}:{self.step}:{self.factor:g}"
        if self.kind == "reset":
            return f"reset:{self.layer}:{self.step}"
        if self.kind == "batch":
            return f"batch:{self.step}:{self.duration}"
        return f"{self.kind}:{self.layer}:{self.step}:{self.factor:g}:{self.duration or 0}"


def _parse_int(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"inject spec {spec!r}: {what} must be an integer, got {text!r}") from None
    if value < 0:
        raise ValueError(f"inject spec {spec!r}: {what} must be >= 0, got {value}")
    return value


def _parse_factor(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"inject spec {spec!r}: FACTOR must be a number, got {text!r}") from None
    if not math.isfinite(value) or value == 0:
        raise ValueError(f"inject spec {spec!r}: FACTOR must be finite and non-zero, got {text!r}")
    return value


def parse_spec(spec: str) -> Injection:
    """Parse ``KIND:...`` into an Injection; raises ValueError saying what is wrong and the syntax."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty inject spec; {_USAGE}")
    parts = spec.strip().split(":")
    kind = parts[0].lower()
    if kind not in KINDS:
        raise ValueError(f"inject spec {spec!r}: unknown kind {parts[0]!r}; {_USAGE}")
    args = parts[1:]

    if kind == "lr":
        if not 1 <= len(args) <= 2:
            raise ValueError(f"inject spec {spec!r}: lr takes STEP[:FACTOR]; {_USAGE}")
        factor = _parse_factor(args[1], spec) if len(args) == 2 else _DEFAULT_FACTOR["lr"]
        if factor < 0:
            raise ValueError(f"inject spec {spec!r}: lr FACTOR must be positive")
        return Injection("lr", _parse_int(args[0], "STEP", spec), None, factor, None)

    if kind == "batch":
        if not 1 <= len(args) <= 2:
            raise ValueError(f"inject spec {spec!r}: batch takes STEP[:DURATION]; {_USAGE}")
        duration = _parse_int(args[1], "DURATION", spec) if len(args) == 2 else 1
        return Injection("batch", _parse_int(args[0], "STEP", spec), None, 1.0, max(1, duration))

    max_args = {"outlier": 4, "nan": 2, "gradscale": 3, "grow": 4, "reset": 2}[kind]
    if not 2 <= len(args) <= max_args:
        raise ValueError(f"inject spec {spec!r}: wrong number of fields for {kind}; {_USAGE}")
    layer = args[0]
    if not layer:
        raise ValueError(f"inject spec {spec!r}: LAYER is empty; {_USAGE}")
    step = _parse_int(args[1], "STEP", spec)
    if kind in ("nan", "reset"):
        return Injection(kind, step, layer, 1.0, 1)
    factor = _parse_factor(args[2], spec) if len(args) >= 3 else _DEFAULT_FACTOR[kind]
    if kind == "gradscale":
        return Injection("gradscale", step, layer, factor, None)
    duration = _parse_int(args[3], "DURATION", spec) if len(args) == 4 else _DEFAULT_DURATION[kind]
    return Injection(kind, step, layer, factor, duration or None)


def outlier_channels(n_features: int, n: int = N_OUTLIER_CHANNELS) -> list[int]:
    """The fixed channels an outlier injection scales: spread evenly, never channel 0.

    Fixed (not random) so a user can find them in the per-channel amax view and a
    test can check them; a few channels, like the real outlier features in LLMs.
    """
    n = min(n, n_features)
    return sorted({(2 * i + 1) * n_features // (2 * n) for i in range(n)})


class _GrowthCompensation(nn.Module):
    """The weight of a ``grow`` layer as its GEMM reads it: the grown channels' input columns divided
    by the factor the input hook multiplies those channels by at the injector's current step."""

    def __init__(self, injector: "Injector", inj: Injection, in_dim: int, channels: list[int]):
        super().__init__()
        self.injector, self.inj, self.in_dim, self.channels = injector, inj, in_dim, channels

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        step = self.injector.step
        if not self.inj.active(step):
            return w
        inv = torch.ones(w.shape[self.in_dim], dtype=w.dtype, device=w.device)
        inv[self.channels] = 1.0 / self.inj.multiplier(step)
        return w * (inv if self.in_dim == 1 else inv[:, None])

    def __deepcopy__(self, memo: dict) -> "_GrowthCompensation":
        # a copy of the model (a shadow fork's replica) is planted the same way: the same injector
        # (its step) and input hook, so its weight must follow that injector too
        return _GrowthCompensation(self.injector, self.inj, self.in_dim, self.channels)


class Injector:
    """Owns the parsed injections, the current step, and the hooks on the model.

    Usage::

        inj = Injector(["outlier:blocks.2.mlp.down:150"]).attach(model)
        for step in range(n):
            inj.step = step
            lr = base_lr(step) * inj.lr_scale()
            ...
    """

    def __init__(self, specs: Iterable[str | Injection] = ()) -> None:
        self.injections: list[Injection] = [
            s if isinstance(s, Injection) else parse_spec(s) for s in specs
        ]
        self.step = 0  # set by the training loop before each forward pass
        self.fired: list[tuple[int, str]] = []  # (step, spec) each step a hook acted
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._parametrized: list[nn.Module] = []  # layers whose weight a ``grow`` compensates

    def __repr__(self) -> str:
        return f"Injector({self.specs!r}, step={self.step})"

    def __bool__(self) -> bool:
        return bool(self.injections)

    @property
    def specs(self) -> list[str]:
        """Canonical spec strings, for run metadata (so a report can say what was planted)."""
        return [inj.spec for inj in self.injections]

    def lr_scale(self, step: int | None = None) -> float:
        """Product of the factors of the ``lr`` injections active at ``step`` (default: current)."""
        step = self.step if step is None else step
        scale = 1.0
        for inj in self.injections:
            if inj.kind == "lr" and inj.active(step):
                scale *= inj.factor
        return scale

    def attach(self, model: nn.Module) -> "Injector":
        """Register the hooks on ``model``'s named modules; unknown layer names raise ValueError."""
        modules = dict(model.named_modules())
        for inj in self.injections:
            if inj.kind in ("lr", "batch"):
                continue
            if inj.layer not in modules:
                linears = [n for n, m in modules.items() if n and type(m).__name__.endswith("Linear")]
                raise ValueError(
                    f"inject spec {inj.spec!r}: no module named {inj.layer!r} in the model; "
                    f"linear layers are: {', '.join(linears)}"
                )
            module = modules[inj.layer]
            if inj.kind == "reset" and not callable(getattr(module, "reset_scaling", None)):
                raise ValueError(f"inject spec {inj.spec!r}: {inj.layer} has no FP8 scaling state to reset "
                                 f"(an emulated Fp8Linear has; this is a {type(module).__name__})")
            if inj.kind == "gradscale":
                h = module.register_full_backward_pre_hook(self._grad_hook(inj), prepend=True)
            else:
                h = module.register_forward_pre_hook(self._input_hook(inj), prepend=True)
            self._handles.append(h)
            if inj.kind == "grow":
                self._compensate(module, inj)
        return self

    def _compensate(self, module: nn.Module, inj: Injection) -> None:
        """Divide the weight's input columns of the grown channels by the growth factor (``grow``)."""
        from torch.nn.utils import parametrize

        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"inject spec {inj.spec!r}: {inj.layer} holds no weight matrix to compensate the growth in")
        in_dim = 0 if getattr(module, "weight_transposed", False) or type(module).__name__ == "Conv1D" else 1
        parametrize.register_parametrization(
            module, "weight", _GrowthCompensation(self, inj, in_dim, outlier_channels(w.shape[in_dim])))
        self._parametrized.append(module)

    def detach(self) -> None:
        """Remove every hook (and weight parametrization) this injector registered."""
        from torch.nn.utils import parametrize

        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._parametrized:
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        self._parametrized.clear()

    # --- hooks -----------------------------------------------------------------------------

    def corrupt_batch(self, x: torch.Tensor, y: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of the current step: replaced by uniformly random tokens while a ``batch``
        injection is active (seeded by the step, so a rerun plants the same batch)."""
        for inj in self.injections:
            if inj.kind == "batch" and inj.active(self.step):
                g = torch.Generator().manual_seed(1_000_003 + self.step)
                self._record(inj)
                x = torch.randint(0, vocab, x.shape, generator=g).to(x.device)
                y = torch.randint(0, vocab, y.shape, generator=g).to(y.device)
        return x, y

    def _input_hook(self, inj: Injection):
        def hook(module: nn.Module, args: tuple):
            if not inj.active(self.step) or not args or not torch.is_tensor(args[0]):
                return None
            if inj.kind == "reset":
                if not self.fired or self.fired[-1] != (self.step, inj.spec):  # once per step
                    module.reset_scaling()
                    self._record(inj)
                return None
            x = args[0].clone()  # never modify the caller's tensor in place (autograd, residuals)
            if inj.kind in ("outlier", "grow"):
                ch = outlier_channels(x.shape[-1])
                x[..., ch] = x[..., ch] * inj.multiplier(self.step)
            else:  # nan: one element, the first of the flattened input
                x.view(-1)[0] = float("nan")
            self._record(inj)
            return (x, *args[1:])

        return hook

    def _grad_hook(self, inj: Injection):
        def hook(module: nn.Module, grad_output: tuple):
            if not inj.active(self.step):
                return None
            self._record(inj)
            return tuple(None if g is None else g * inj.factor for g in grad_output)

        return hook

    def _record(self, inj: Injection) -> None:
        if not self.fired or self.fired[-1] != (self.step, inj.spec):
            self.fired.append((self.step, inj.spec))


def parse_specs(specs: Iterable[str]) -> list[Injection]:
    """Parse several specs at once (argparse collects them in a list)."""
    return [parse_spec(s) for s in specs]
