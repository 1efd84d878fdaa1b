"""Scalars for ``Monitor.step`` taken without forcing host syncs."""

from __future__ import annotations

from typing import Any


def as_scalar(value: Any) -> Any:
    """A 0-d tensor stays a tensor (it travels with the step's single transfer); numbers pass;
    anything else (None, strings, lists) is dropped."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.detach().reshape(()) if value.numel() == 1 else None
    except Exception:
        pass
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def device_grad_norm(params) -> Any:
    """The global L2 norm of the gradients of ``params``, on their device (no sync), or None. Each
    gradient's norm is computed in float32 by the norm kernel itself (``dtype=``): no float copy of a
    BF16 gradient per step."""
    import torch

    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
