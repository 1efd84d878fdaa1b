"""What a monitor covers: the GEMM weights its layers hold, and the modules holding GEMM weights
that it leaves (recorded in run.json's ``meta.coverage``, said in one warning at attach).

Why: a run's report can only speak for the layers that were monitored. A user told "no problems
flagged" about a model whose largest GEMMs were never looked at has been told something false,
and a NaN that starts in an unmonitored module is first seen at the next monitored layer's input,
where blaming that layer's FP8 would be false too. What is left:

- modules holding a weight matrix of a kind nothing recognises (``linear_like``);
- MoE routers (``linear_like.is_router``): recorded, but neither warned about nor named in the
  report, since every FP8 recipe keeps them in high precision;
- monitored layers whose forward never runs (:meth:`Coverage.leave_idle`): the code around them
  uses their weight directly, as ``transformers``' Mamba does with ``dt_proj`` (``self.dt_proj.weight
  @ x``; with the ``mamba_ssm`` kernels also ``x_proj`` and ``out_proj``). Hooks see nothing of that
  GEMM, and an emulated FP8 layer bypassed this way computes in high precision. They are found
  after the first steps (the monitor warns then and rewrites the coverage), and monitored again if
  they run later (a layer used only by some batches);
- MoE experts stored as 3-D weights (``adapters.experts``) that run under ``torch.compile`` with
  GEMMs read in eager forwards only (the loop; ``grouped_mm`` and ``batched_mm`` are read compiled). In
  a small Mixtral they hold 8 in 10 of the GEMM weights. They are found at their first traced
  forward (:meth:`Coverage.leave_traced`; the monitor warns then and rewrites the coverage).

So the monitor records which modules it left, how much of the GEMM weights they hold, and where
they sit in the model's module order (``order``), and the report reads it
(``store.manifest.coverage_text``, ``detect.report.unmonitored_upstream``).
"""

from __future__ import annotations

from torch import nn

from fp8scope.linear_like import describe_skipped, expert_weights, holds_weight_matrix, is_router
from fp8scope.store.manifest import share_text


def _gemm_params(params) -> dict[int, int]:
    """Parameter id -> size of the matrices (and stacks of them) among ``params``: a GEMM's weights,
    not its norms or biases; by id, so a tied weight counts once."""
    return {id(p): p.numel() for p in params if p.dim() >= 2}


class Coverage:
    """Built while the monitor attaches: each monitored layer and each module left, in module order."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.monitored: dict[int, int] = {}  # parameter id -> numel (a tied weight counts once)
        self.left: dict[int, int] = {}
        self.experts: list[tuple[str, nn.Module, int]] = []
        self.matrices: list[tuple[str, nn.Module, int]] = []
        self.routers: list[tuple[str, nn.Module, int]] = []  # recorded, not warned about: always high precision
        self.idle: list[tuple[str, nn.Module, int]] = []  # monitored layers whose forward never ran
        self._holders: dict[int, set[str]] = {}  # parameter id -> the monitored layers holding it

    def layer(self, name: str, module: nn.Module) -> None:
        self.order.append(name)
        sizes = _gemm_params(module.parameters())
        self.monitored.update(sizes)
        for k in sizes:  # a tied weight has several holders; it is left only when all of them are idle
            self._holders.setdefault(k, set()).add(name)

    def consider(self, name: str, module: nn.Module, inside: bool) -> None:
        """A module no adapter claims; ``inside``: it is part of a monitored layer or of a module
        already left (a TE module's parts, an experts module's activation)."""
        if inside:
            return
        if holds_weight_matrix(module):
            kind, params, into = ("router", [module.weight], self.routers) if is_router(module) else (
                "matrix", [module.weight], self.matrices)
        else:
            return
        sizes = {k: v for k, v in _gemm_params(params).items() if k not in self.monitored and k not in self.left}
        self.left.update(sizes)
        self.order.append(name)
        into.append((name, module, sum(sizes.values())))

    def leave_traced(self, name: str, module: nn.Module) -> None:
        """A monitored experts module that ran under torch.compile with GEMMs its adapter reads in eager
        forwards only: it is left after all."""
        sizes = {k: v for k, v in _gemm_params(expert_weights(module)).items() if k in self.monitored}
        for k in sizes:
            del self.monitored[k]
        self.left.update(sizes)
        self.experts.append((name, module, sum(sizes.values())))

    def leave_idle(self, name: str, module: nn.Module) -> None:
        """A monitored layer whose forward has not run: the code around it uses its weight directly."""
        idle = {n for n, _, _ in self.idle} | {name}
        sizes = {k: v for k, v in _gemm_params(module.parameters()).items()
                 if k in self.monitored and self._holders.get(k, set()) <= idle}
        for k in sizes:
            del self.monitored[k]
        self.left.update(sizes)
        self.idle.append((name, module, sum(sizes.values())))

    def ran(self, name: str) -> None:
        """A layer left idle ran after all (a layer only some batches use): it is monitored."""
        for i, (n, m, _) in enumerate(self.idle):
            if n == name:
                del self.idle[i]
                sizes = {k: v for k, v in _gemm_params(m.parameters()).items() if k in self.left}
                for k in sizes:
                    del self.left[k]
                self.monitored.update(sizes)
                return

    def names(self) -> list[str]:
        return [n for n, _, _ in self.experts + self.matrices + self.routers]

    def to_dict(self) -> dict:
        """run.json's ``meta.coverage``."""
        left = [{"module": n, "class": type(m).__name__, "kind": kind, "params": p}
                for kind, group in (("experts", self.experts), ("matrix", self.matrices), ("idle", self.idle),
                                    ("router", self.routers))
                for n, m, p in group]
        return {"params": {"monitored": sum(self.monitored.values()), "unmonitored": sum(self.left.values())},
                "unmonitored": left, "order": self.order}

    def warning(self, layers: int) -> str | None:
        """The one attach warning naming what is not monitored, or None when nothing is left (experts
        are left later, when they run: :meth:`traced_warning`)."""
        if not self.matrices:
            return None
        return (f"monitoring {layers} layer(s); {len(self.matrices)} module(s) holding a weight matrix are of a kind "
                f"fp8scope does not know as linear and are not monitored: "
                f"{describe_skipped((n, m) for n, m, _ in self.matrices)} (fp8scope.register_linear_like(cls) adds a "
                "class)")

    def traced_warning(self, names: list[str]) -> str:
        """The warning for experts modules (``names``, left by :meth:`leave_traced`) that ran under
        torch.compile with GEMMs read in eager forwards only."""
        group = [e for e in self.experts if e[0] in names]
        return (f"{len(group)} MoE expert module(s) holding {self._share(group)} of the model's GEMM weights ran "
                f"under torch.compile without a grouped or batched GEMM and are not monitored: "
                f"{describe_skipped((n, m) for n, m, _ in group)} (compiled, experts are captured where they run "
                "transformers' grouped_mm (the default experts_implementation) or batched_mm; the loop is captured in "
                "eager forwards only. A fault that starts in them shows first where it reaches a monitored layer)")

    def idle_warning(self, names: list[str], steps: int) -> str:
        """The warning for monitored layers (``names``, left by :meth:`leave_idle`) whose forward did
        not run in the first ``steps`` steps."""
        group = [e for e in self.idle if e[0] in names]
        return (f"{len(group)} monitored layer(s) holding {self._share(group)} of the model's GEMM weights did not run "
                f"their forward in {steps} steps: {describe_skipped((n, m) for n, m, _ in group)}. Unused, or the "
                "code around them uses their weight directly (transformers' Mamba: self.dt_proj.weight @ x): then "
                "fp8scope does not see that GEMM, and an emulated FP8 layer bypassed this way computes in high "
                "precision. They count as not monitored until they run")

    def _share(self, group) -> str:
        total = sum(self.monitored.values()) + sum(self.left.values())  # routers' included
        return share_text(sum(p for _, _, p in group), total) if total else "some"
