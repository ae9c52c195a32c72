"""The SWAN update as pure functions (no torch.distributed, no framework imports).

Orientation. The paper writes a gradient G as (m, n) with rows = input dims and columns = output
dims. A torch weight is ``(out, in)``, i.e. the paper's transpose. Every function here takes torch
layout ``(..., out, in)`` and is batched over leading dims (a stack of same-shape matrices).

    grad_norm:  each input index (torch column) standardised across the output dims (dim -2)
    whiten:     (G Gᵀ)^{-1/2} G by coupled Newton-Schulz (NS) or NS with diagonal substitution
                (NSDS), Frobenius pre-normalised, Gram on the smaller side
    rescale:    ΔW · sqrt(m n) / ‖ΔW‖_F
    swan_update = rescale ∘ whiten ∘ grad_norm, with a per-matrix finite flag

Zero inputs map to zero outputs (never NaN): a zero column stays zero after GradNorm, a zero matrix
whitens and rescales to zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "WhitenConfig",
    "grad_norm",
    "whiten",
    "rescale",
    "swan_update",
    "resolve_dtype",
    "whiten_flops",
]


@dataclass(frozen=True)
class WhitenConfig:
    """How one matrix is processed. Immutable and hashable so it can key caches and plans."""

    method: str = "nsds"  # "ns" | "nsds" | "none" (GradNorm + rescale only, an ablation)
    steps: int = 2
    beta: float = 0.4
    grad_norm: str = "rms"  # "rms" (paper eq. 1) | "mean" (mean-centred variant) | "none"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float64": precision of the iteration

    def __post_init__(self) -> None:
        if self.method not in ("ns", "nsds", "none"):
            raise ValueError(f"whitening must be 'ns', 'nsds' or 'none', got {self.method!r}")
        if self.grad_norm not in ("rms", "mean", "none"):
            raise ValueError(f"grad_norm must be 'rms', 'mean' or 'none', got {self.grad_norm!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float64"):
            raise ValueError(
                f"whiten_dtype must be 'auto', 'float32', 'bfloat16' or 'float64', got {self.dtype!r}"
            )
        if self.method != "none" and self.steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {self.steps}")
        if not 0.0 < self.beta < 1.5:
            raise ValueError(f"beta must lie in (0, 1.5), got {self.beta}")


def resolve_dtype(cfg: WhitenConfig, device: torch.device) -> torch.dtype:
    """Precision of the whitening iteration.

    'auto' follows the paper where it is cheap: NSDS in bf16 on CUDA, NS in fp32. On CPU 'auto' is
    fp32: bf16 matmul speed there depends on the ISA (~1 vs ~170 GFLOP/s fp32 on CPUs without
    AVX512-BF16; faster than fp32 on some that have it, see docs/benchmarks.md), and fp32 keeps CPU
    runs comparable to the fp32 reference. Ask for 'bfloat16' explicitly where it pays.
    """
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if cfg.method == "nsds" and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def _recip(norm: Tensor) -> Tensor:
    """1 / norm, with 0 for norm == 0 (so zero inputs map to zero outputs, never NaN)."""
    return torch.where(norm > 0, 1.0 / norm.clamp_min(torch.finfo(norm.dtype).tiny), 0.0)


def _max_abs(x: Tensor, dim) -> Tensor:
    return x.abs().amax(dim=dim, keepdim=True)  # ~6x faster than vector_norm(ord=inf) on CPU


def grad_norm(g: Tensor, mode: str = "rms") -> Tensor:
    """GradNorm (paper eq. 1) in torch layout: each column (input index) of ``(..., out, in)``
    divided by its RMS over the output dim (-2); ``mode='mean'`` subtracts the column mean first.

    A column that is all zero stays zero. The RMS is taken of the max-abs-scaled column, so tiny
    (1e-30) and huge (1e30) gradients give the same result as moderate ones.
    """
    if mode == "none" or g.numel() == 0:
        return g
    if mode == "mean":
        g = g - g.mean(dim=-2, keepdim=True)
    g = g * _recip(_max_abs(g, -2))  # entries now in [-1, 1]: no under/overflow below
    rms = torch.linalg.vector_norm(g, dim=-2, keepdim=True) / math.sqrt(g.shape[-2])
    return g * _recip(rms)


def whiten(g: Tensor, method: str = "nsds", steps: int = 2, beta: float = 0.4, prescale: bool = True) -> Tensor:
    """GradWhitening (paper Alg. 2): approximately ``(G Gᵀ)^{-1/2} G`` for each matrix.

    Orientation is the paper's (rows = input dims; Alg. 2 assumes rows <= cols, so a wider-than-tall
    input is transposed, iterated, and transposed back). The input is divided by its Frobenius norm,
    then the coupled iteration runs on the Gram of the smaller side (``Y₀ = XXᵀ``, ``Z₀ = I``),
    updating Y and Z simultaneously from the previous pair:

    - NS:   ``T = 3I − Z Y;  Y ← β Y T;  Z ← β T Z``
    - NSDS: ``Y ← β Y Diag(3 − dZ⊙dY);  Z ← β (3I − Diag(dZ) Y) Diag(dZ)`` with dY, dZ the diagonals

    and returns ``Z X``. β = 0.5 is the classical iteration (Z → (XXᵀ)^{-1/2}); the paper uses β = 0.8
    (NS, 10 steps) and β = 0.4 (NSDS, 2 steps), which leave the singular values in a band rather
    than at one; the rescale that follows removes the overall scale. The result has the input's
    dtype; compute in the dtype you pass.

    The Frobenius normalisation is folded into the small matrices (``‖X‖²`` is the Gram's trace), so
    it costs no pass over X. With ``prescale`` the input is first divided by its max-abs so that the
    Gram cannot under/overflow; GradNorm's output (entries bounded by sqrt(rows)) does not need it.
    """
    if method == "none" or g.numel() == 0:
        return g
    if method not in ("ns", "nsds"):
        raise ValueError(f"unknown whitening method {method!r}")
    transpose = g.shape[-2] > g.shape[-1]
    x = g.mT if transpose else g
    if prescale:
        x = x * _recip(_max_abs(x, (-2, -1)))
    m = x.shape[-2]
    eye = torch.eye(m, dtype=x.dtype, device=x.device)
    y = x @ x.mT
    inv_fro2 = _recip(y.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True).unsqueeze(-1))
    y = y * inv_fro2  # the Gram of X / ‖X‖_F
    z = eye.expand_as(y)
    for _ in range(steps):
        if method == "ns":
            t = 3.0 * eye - z @ y
            y, z = beta * (y @ t), beta * (t @ z)
        else:
            dy = y.diagonal(dim1=-2, dim2=-1)
            dz = z.diagonal(dim1=-2, dim2=-1)
            y, z = (
                beta * y * (3.0 - dz * dy).unsqueeze(-2),
                beta * (3.0 * eye - dz.unsqueeze(-1) * y) * dz.unsqueeze(-2),
            )
    out = (z * inv_fro2.sqrt()) @ x  # Z (X / ‖X‖_F), the scale applied to the small matrix
    return out.mT if transpose else out


def rescale(u: Tensor) -> Tensor:
    """``u · sqrt(m n) / ‖u‖_F`` per matrix (paper eq. 3: the norm of sign descent); 0 stays 0."""
    if u.numel() == 0:
        return u
    m, n = u.shape[-2], u.shape[-1]
    u = u * _recip(_max_abs(u, (-2, -1)))
    return u * (_recip(torch.linalg.vector_norm(u, dim=(-2, -1), keepdim=True)) * math.sqrt(m * n))


def swan_update(g: Tensor, cfg: WhitenConfig = WhitenConfig()) -> tuple[Tensor, Tensor]:
    """The SWAN direction ΔW for a batch of gradients ``(..., out, in)`` in torch layout.

    Returns ``(update, finite)``: ``update`` in fp32 (fp64 if the iteration runs in fp64), with the
    shape of ``g``; ``finite`` is a bool tensor of shape ``g.shape[:-2]`` telling which matrices had
    an all-finite gradient. Matrices with a non-finite gradient get a zero update, so a NaN never
    reaches the weights; what to do about them (skip, raise) is the caller's policy.
    """
    if g.dim() < 2:
        raise ValueError(f"swan_update needs matrices (..., out, in), got shape {tuple(g.shape)}")
    if g.numel() == 0:
        return torch.zeros(g.shape, dtype=torch.float32, device=g.device), torch.ones(
            g.shape[:-2], dtype=torch.bool, device=g.device
        )
    x = g.to(torch.promote_types(g.dtype, torch.float32))
    finite = torch.isfinite(_max_abs(x, (-2, -1)))  # NaN/Inf anywhere shows in the max-abs
    x = grad_norm(x, cfg.grad_norm)
    wdtype = resolve_dtype(cfg, g.device)
    # whiten() works in the paper's orientation (rows = input dims): a square matrix takes the Gram
    # of its input side, as Alg. 2 with m <= n does; NSDS depends on that choice, NS does not.
    x = whiten(x.to(wdtype).mT, cfg.method, cfg.steps, cfg.beta, prescale=cfg.grad_norm == "none").mT
    upd = rescale(x.to(torch.promote_types(wdtype, torch.float32)))
    return torch.where(finite, upd, 0.0), finite[..., 0, 0]


def whiten_flops(shape: tuple[int, int], cfg: WhitenConfig) -> float:
    """Approximate FLOPs to process one matrix of ``shape`` (the planner's cost model).

    With s = min(rows, cols), l = max: Gram 2s²l, final product 2s²l; NS adds 6s³ per step (three s×s
    GEMMs), NSDS only O(s²) per step. GradNorm and rescale are O(sl).
    """
    s, l = min(shape), max(shape)
    base = 4.0 * s * s * l + 6.0 * s * l
    if cfg.method == "ns":
        return base + cfg.steps * 6.0 * s**3
    if cfg.method == "nsds":
        return base + cfg.steps * 6.0 * s * s
    return 6.0 * s * l
