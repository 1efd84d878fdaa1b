"""A small GPT whose Linear layers are the ones fp8scope watches.

The layout mirrors a modern decoder (RMSNorm, causal attention, SwiGLU MLP) on
purpose: the FP8 failure signatures in the reference (outliers in the input of
``mlp.down``, gradient underflow in early layers) live in exactly these layers,
and the qualified names (``blocks.2.mlp.down``, ``blocks.0.attn.qkv``) are the
names users see in the monitor's tables, so they must read like real models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Model size. Defaults are sized so 300 steps run in well under 2 minutes on a small CPU."""

    vocab: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    mlp_hidden: int | None = None  # None -> round(8/3 * d_model) to a multiple of 32 (LLaMA-style)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.mlp_hidden is None:
            self.mlp_hidden = ((8 * self.d_model // 3) + 31) // 32 * 32


class RMSNorm(nn.Module):
    """RMSNorm (no mean subtraction); kept as a module so it is not an nn.Linear and stays out of FP8."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Fused qkv projection + SDPA + output projection (``attn.qkv``, ``attn.proj``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)).

    The product silu(gate) * up is where Fishman et al. (2024) saw outliers grow
    in the input of ``down``: that is why ``down`` is the default injection target.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.mlp_hidden is not None
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """Token + learned position embedding, ``n_layers`` blocks, final norm, ``lm_head``.

    ``forward(idx)`` returns logits of shape (batch, seq, vocab); the caller computes
    the loss so the training loop in the example stays explicit.
    """

    def __init__(self, cfg: GPTConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = 0) -> None:
        """GPT-2 style init from a private generator, so the same seed gives the same
        weights regardless of the global RNG state (tests and A/B runs compare runs)."""
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        std = 0.02
        resid_std = std / (2 * self.cfg.n_layers) ** 0.5  # residual projections scaled down
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            s = resid_std if name.endswith(("attn.proj.weight", "mlp.down.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen) * s)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds model seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def linear_names(self) -> list[str]:
        """Qualified names of every Linear (the layers FP8 conversion touches), in forward order."""
        return [n for n, m in self.named_modules() if _is_linear(m)]


def _is_linear(m: nn.Module) -> bool:
    """nn.Linear, or an FP8 replacement of it (``Fp8Linear`` may not subclass nn.Linear)."""
    return isinstance(m, nn.Linear) or type(m).__name__.endswith("Linear")
