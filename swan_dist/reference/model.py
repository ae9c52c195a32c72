"""A small LLaMA-style decoder in plain PyTorch.

RMSNorm, rotary position embeddings on queries and keys, causal attention via
``scaled_dot_product_attention``, a SwiGLU MLP, no biases, and an optionally tied
output head.  Module names follow the original LLaMA code (``tok_embeddings``,
``layers.{i}.attention.wq`` ... ``output``) so that optimizers which classify
parameters by name see the usual layout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 8192
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention's key/value heads; None: n_heads
    ffn_dim: int | None = None  # None: LLaMA rule, 8/3 * dim rounded up to a multiple of 32
    max_seq_len: int = 1024
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head dimension (dim / n_heads) must be even for rotary embeddings")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.ffn_dim is None:
            self.ffn_dim = 32 * math.ceil(int(8 * self.dim / 3) / 32)


# Named sizes (vocab_size is set from the tokenizer at build time).  "60m" and
# "130m" are the LLaMA configurations used in the SWAN / GaLore papers; with an
# 8k vocabulary instead of 32k they hold ~34M and ~98M parameters.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4),  # ~2.9M params
    "small": dict(dim=384, n_layers=8, n_heads=6),  # ~20M params
    "60m": dict(dim=512, n_layers=8, n_heads=8, ffn_dim=1376),
    "130m": dict(dim=768, n_layers=12, n_heads=12, ffn_dim=2048),
    # the papers' 350M and 1.3B (their counts with the papers' 32k vocabulary; benchmarks/memory.py)
    "350m": dict(dim=1024, n_layers=24, n_heads=16, ffn_dim=2736),
    "1b3": dict(dim=2048, n_layers=24, n_heads=32, ffn_dim=5461),
}


def model_config(size: str, **overrides) -> LlamaConfig:
    """A :class:`LlamaConfig` for a named size with field overrides applied."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model option(s) {unknown}; valid: {sorted(fields)}")
    return LlamaConfig(**{**MODEL_SIZES[size], **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables of shape (max_seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by position; pairs are (i, i + head_dim/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads  # (the forward views -1 heads: the local ones under tensor parallelism)
        self.head_dim = cfg.dim // cfg.n_heads
        kv = (cfg.n_kv_heads or cfg.n_heads) * self.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # -1: local heads under TP

        q, k, v = apply_rope(heads(self.wq), cos, sin), apply_rope(heads(self.wk), cos, sin), heads(self.wv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))  # -1: the local heads under tensor parallelism


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        # Constant tables: not saved, and data-parallel wrappers need not broadcast them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; residual output projections scaled by 1/sqrt(2 * n_layers)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for layer in self.layers:
            nn.init.normal_(layer.attention.wo.weight, std=residual_std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=residual_std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss
