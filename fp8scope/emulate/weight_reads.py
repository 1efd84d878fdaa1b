"""A cheap step's weight reads in one batch, for the what-if bank.

Why: a weight does not change between two optimizer steps, yet every layer's forward reads its
own: one ``aminmax`` launch per layer and micro-batch (155 a step for a 1.1B Llama, a third of
its cheap captures). Here the first weight capture of a step reads every weight captured before
in one call (:func:`~fp8scope.emulate.amax.amax_parts_many`: two launches for all of them on
CUDA), and each layer's capture then takes its weight's amax from that batch. The values are the
ones the layer's own read would give, so the rows and the delayed-scaling updates do not change.

A batched amax stands for a layer's weight only when it was read from that very tensor (the same
object, or a view of all of it such as ``Conv1D``'s transpose), unchanged since: the same version
counter and data pointer. Otherwise the layer reads its weight itself, as before:

- sharded or offloaded weights (FSDP, ZeRO-3) are whole only inside their layer's forward: at the
  batch they are another tensor, another shape, or storage freed to a null data pointer, so they
  are not read then;
- a weight whose batched amax once did not stand for it (changed in place after the batch, or
  swapped under its layer by a framework) is read by its layer from then on, so nothing is read
  twice a step for long;
- a weight no layer captured in a step (an MoE expert that got no tokens) leaves the batch until
  its layer captures it again;
- an eval forward (no grad, captured with ``capture_no_grad``) reads its own: it may run on
  weights swapped in through ``.data`` (an EMA), which bumps no version counter
  (``DeviceDelayedBank.capture``).
"""

from __future__ import annotations

import weakref

import torch

from .amax import amax_parts, amax_parts_many

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not DTensor or other subclasses: their reads differ


class WeightReads:
    """The weights a bank's slots captured, and the current step's batch of their amax parts."""

    def __init__(self, device: torch.device):
        self.device = device
        self._known: dict[int, tuple[weakref.ref, torch.Size, int]] = {}  # slot -> (tensor, shape, data pointer)
        self._never: set[int] = set()  # slots whose batched amax once did not stand for their weight
        self._batch: dict[int, tuple] | None = None  # this step's slot -> (tensor, version, data pointer, parts)
        self._used: set[int] = set()  # slots that took their parts from this step's batch

    def parts(self, slot: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``amax_parts(x)`` for ``slot``'s weight ``x``: from the step's batch when it stands for
        ``x``, else read now (and ``x`` joins the next step's batch where it can)."""
        owner = x if x._base is None else x._base
        batch = self._batch
        if batch is None:  # the step's first weight capture
            batch = self._batch = self._read()
        got = batch.get(slot)
        if got is not None:
            if got[0] is owner and got[1] == owner._version and got[2] == owner.data_ptr():
                self._used.add(slot)
                return got[3]
            self._never.add(slot)
            self._known.pop(slot, None)
        parts = amax_parts(x)
        if (slot not in self._never and type(owner) in _PLAIN and owner.device == self.device
                and x.numel() == owner.numel() > 0):
            self._known[slot] = (weakref.ref(owner), owner.shape, owner.data_ptr())
        return parts

    def end_step(self) -> None:
        """The step is over: its batch goes, and weights no layer took from it leave the next one."""
        if self._batch is not None:
            for slot in self._batch.keys() - self._used:
                self._known.pop(slot, None)
            self._batch, self._used = None, set()

    def _read(self) -> dict[int, tuple]:
        entries, tensors = [], []
        for slot, (ref, shape, ptr) in list(self._known.items()):
            t = ref()
            if t is None or t.data_ptr() != ptr or t.shape != shape:  # gone, its storage freed, or resharded
                del self._known[slot]
                continue
            entries.append((slot, t, t._version, ptr))
            tensors.append(t)
        parts = amax_parts_many(tensors)
        return {slot: (t, version, ptr, p) for (slot, t, version, ptr), p in zip(entries, parts)}
