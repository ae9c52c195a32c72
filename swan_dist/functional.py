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

import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from .collectives import is_fake  # noqa: F401 (re-exported: the SWAN math's one use of it)

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

    'auto' picks the fastest dtype whose update stays within 2 % (relative Frobenius distance) of the
    fp32 update: NSDS in bf16 on CUDA (the paper's SWAN‡) and on CPUs with native bf16 dot products
    (AVX512-BF16 or AMX: there bf16 GEMMs run 2-3x faster than fp32; without them, orders of magnitude
    slower), fp32 otherwise and for NS (whose 10 coupled steps compound bf16 rounding).
    ``SWAN_DIST_CPU_BF16=0`` (or ``1``) overrides the CPU detection.
    """
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if cfg.method == "nsds" and (device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())):
        return torch.bfloat16
    return torch.float32


@functools.cache
def _cpuinfo_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (Linux flags avx512_bf16 / amx_bf16), unless
    ``SWAN_DIST_CPU_BF16`` says otherwise."""
    forced = os.environ.get("SWAN_DIST_CPU_BF16", "").strip().lower()
    if forced in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        return forced in ("1", "true", "yes", "on")
    return _cpuinfo_bf16()


def _recip(norm: Tensor) -> Tensor:
    """1 / norm, with 0 for norm == 0 (so zero inputs map to zero outputs, never NaN)."""
    return torch.where(norm > 0, 1.0 / norm.clamp_min(torch.finfo(norm.dtype).tiny), 0.0)


def _max_abs(x: Tensor, dim) -> Tensor:
    return x.abs().amax(dim=dim, keepdim=True)  # ~6x faster than vector_norm(ord=inf) on CPU


def _norm(x: Tensor, dim) -> Tensor:
    """2-norm over ``dim`` with no under/overflow for any fp32/bf16 input, non-finite exactly where
    ``x`` has a NaN/Inf. On an accelerator: accumulated in fp64, one pass, no host sync. On the CPU,
    where fp64 reductions are several times slower and a host sync costs nothing: in the input's
    precision, redone in fp64 only when some norm is zero, tiny or infinite (entries beyond ~1e±18)."""
    if x.device.type != "cpu":
        return torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float64)
    if dim == -2 and x.dtype in (torch.float32, torch.float64):  # vector_norm over a strided dim: 2-8x slower
        n = torch.mul(x, x).sum(dim, keepdim=True).sqrt_()
    else:
        n = torch.linalg.vector_norm(x, dim=dim, keepdim=True)
    if not is_fake(n) and bool(((n < 1e-18) | ~torch.isfinite(n)).any()):
        return torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float64)
    return n


def _scale_by(x: Tensor, factor: Tensor, dtype: torch.dtype) -> Tensor:
    """``x * factor`` written as ``dtype`` (a new tensor; ``x`` is never written). A narrowing result is
    one mixed-dtype multiply (one rounding); a widening one is the exact cast, then the multiply in place
    (on the CPU 3-10x faster than one mixed-dtype multiply)."""
    factor = factor.to(torch.promote_types(x.dtype, torch.float32))
    if x.dtype != dtype and torch.promote_types(x.dtype, dtype) == dtype:
        return x.to(dtype).mul_(factor)
    if dtype == torch.promote_types(x.dtype, factor.dtype):
        return x * factor
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    return torch.mul(x, factor, out=out)


def _grad_norm(g: Tensor, mode: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """GradNorm written as ``dtype``, and the per-matrix finite flag ``(..., 1, 1)``: one reduction
    and one multiply over ``g`` (the column norms also tell whether ``g`` is finite)."""
    if mode == "mean":
        g = g.to(torch.promote_types(g.dtype, torch.float32))
        g = g - g.mean(dim=-2, keepdim=True)
    if mode == "none":
        finite = torch.isfinite(g.abs().amax(dim=(-2, -1), keepdim=True))
        return g.to(dtype), finite
    norms = _norm(g, -2)  # (..., 1, in)
    finite = torch.isfinite(norms).all(dim=-1, keepdim=True)
    return _scale_by(g, _recip(norms) * math.sqrt(g.shape[-2]), dtype), finite


def grad_norm(g: Tensor, mode: str = "rms") -> Tensor:
    """GradNorm (paper eq. 1) in torch layout: each column (input index) of ``(..., out, in)``
    divided by its RMS over the output dim (-2); ``mode='mean'`` subtracts the column mean first.

    A column that is all zero stays zero. The column norms are accumulated in fp64, so tiny (1e-30)
    and huge (1e30) gradients give the same result as moderate ones.
    """
    if mode == "none" or g.numel() == 0:
        return g
    return _grad_norm(g, mode, g.dtype)[0]


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

    Only the products the result needs are computed: with Z₀ = I the first NS step is ``T = 3I − Y``,
    ``Z = βT`` (one product, ``Y T``), and the last step's Y is never used, so K NS steps take 3K − 3
    s×s products (K = 1: none) besides the Gram and ``Z X``. The Frobenius normalisation is folded
    into the small matrices (``‖X‖²`` is the Gram's trace), so it costs no pass over X. With
    ``prescale`` the input is first divided by its max-abs so that the Gram cannot under/overflow;
    GradNorm's output (entries bounded by sqrt(rows)) does not need it.
    """
    if method == "none" or g.numel() == 0:
        return g
    if method not in ("ns", "nsds"):
        raise ValueError(f"unknown whitening method {method!r}")
    transpose = g.shape[-2] > g.shape[-1]
    x = g.mT if transpose else g
    if prescale:
        x = x * _recip(_max_abs(x, (-2, -1)))
    out = _whitener(x @ x.mT, method, steps, beta) @ x  # Z·(X / ‖X‖_F): the scale is folded into Z
    return out.mT if transpose else out


def _whitener(gram: Tensor, method: str, steps: int, beta: float, d: Tensor | None = None) -> Tensor:
    """The s×s matrix Z with ``Z X`` = the whitened ``X / ‖X‖_F`` for ``gram = X Xᵀ`` (batched): the
    Frobenius normalisation c = 1/‖X‖²_F = 1/trace(gram) is folded into the small matrices.

    With ``d`` (..., s), a diagonal scaling folded in: ``gram`` is A and the Gram iterated is D A D
    (the Gram of X = D X'), and the result is Z·D, to be applied to X' (GradNorm without a pass over
    the gradient, see :func:`_swan_update_gram_first`). NSDS overwrites ``gram`` (callers drop it)."""
    dg = gram.diagonal(dim1=-2, dim2=-1).to(torch.promote_types(gram.dtype, torch.float32))
    if d is not None:
        dg = dg * d * d
    c = _recip(dg.sum(-1, keepdim=True))  # (..., 1)
    if method == "nsds":
        return _nsds_z(gram, dg, c, steps, beta, d)
    if d is not None:
        dw = d.to(gram.dtype)
        gram = gram * dw.unsqueeze(-1) * dw.unsqueeze(-2)
    m = gram.shape[-1]
    eye = torch.eye(m, dtype=gram.dtype, device=gram.device)
    cg = c.to(gram.dtype).unsqueeze(-1)
    t = 3.0 * eye - gram * cg  # step 1, Z₀ = I: T = 3I − Y₀, Z₁ = βT, Y₁ = βY₀T
    z = beta * t
    y = gram
    for k in range(1, steps):
        y = torch.matmul(y, t).mul_(beta * cg if k == 1 else beta)
        t = torch.baddbmm(3.0 * eye, z.reshape(-1, m, m), y.reshape(-1, m, m), alpha=-1.0).view(y.shape)
        z = torch.matmul(t, z).mul_(beta)
    scale = c.sqrt() if d is None else c.sqrt() * d  # per column of Z
    return z * scale.to(z.dtype).unsqueeze(-2)


def _nsds_z(gram: Tensor, dg: Tensor, c: Tensor, steps: int, beta: float, d: Tensor | None = None) -> Tensor:
    """NSDS's Z_K·sqrt(c) built from the Gram in two passes over it (K ≥ 1).

    Every NSDS step scales Y's columns (``Y ← βY·Diag(3 − dZ⊙dY)``), so ``Y_k = Y₀·Diag(a_k)`` and all
    the diagonals follow vector recursions: ``a_{k+1} = β a_k (3 − dZ_k dY_k)``, ``dY_k = dY₀ a_k``,
    ``dZ_{k+1} = β dZ_k (3 − dZ_k dY_k)`` (a₀ = dZ₀ = 1, dY₀ = c·diag(gram)). Only the last Z is a
    matrix: ``Z_K = 3β Diag(dZ) − β Diag(dZ)·Y₀·Diag(a dZ)`` with dZ, a at step K − 1: the same
    numbers as Alg. 2's K matrix updates, for O(K s) work besides building Z_K. With ``d`` (``gram``
    = A, Gram = D A D, ``dg`` its diagonal): Z_K·sqrt(c)·D from A, in the same two passes. Z is built
    in ``gram``'s memory (``dg`` is read first)."""
    dy0 = c * dg
    a = torch.ones_like(dy0)
    dz = torch.ones_like(dy0)
    for _ in range(steps - 1):
        f = 3.0 - dz * a * dy0
        a, dz = beta * a * f, beta * dz * f
    sc = c.sqrt()
    row, col, diag = dz * (-beta) * c * sc, a * dz, 3.0 * beta * sc * dz  # Z = Diag(row)·Gram·Diag(col) + Diag(diag)
    if d is not None:
        row, col, diag = row * d, col * d * d, diag * d
    z = gram.mul_(row.to(gram.dtype).unsqueeze(-1))  # in place: every caller passes a Gram it drops
    z.mul_(col.to(gram.dtype).unsqueeze(-2))
    z.diagonal(dim1=-2, dim2=-1).add_(diag.to(gram.dtype))
    return z


def _rescale_factor(u: Tensor, norm: Tensor | None = None) -> Tensor:
    """``sqrt(m n) / ‖u‖_F`` per matrix, 0 for a zero matrix (``norm``: ``‖u‖_F`` if already known)."""
    return _recip(_norm(u, (-2, -1)) if norm is None else norm) * math.sqrt(u.shape[-2] * u.shape[-1])


def _rescale(u: Tensor, dtype: torch.dtype) -> Tensor:
    return _scale_by(u, _rescale_factor(u), dtype)


def rescale(u: Tensor) -> Tensor:
    """``u · sqrt(m n) / ‖u‖_F`` per matrix (paper eq. 3: the norm of sign descent); 0 stays 0. One
    reduction (no under/overflow) and one multiply over ``u``."""
    if u.numel() == 0:
        return u
    return _rescale(u, u.dtype)


def swan_update(g: Tensor, cfg: WhitenConfig = WhitenConfig()) -> tuple[Tensor, Tensor]:
    """The SWAN direction ΔW for a batch of gradients ``(..., out, in)`` in torch layout.

    Returns ``(update, finite)``: ``update`` in fp32 (fp64 if the iteration runs in fp64), with the
    shape of ``g``; ``finite`` is a bool tensor of shape ``g.shape[:-2]`` telling which matrices had an
    all-finite gradient *and* an all-finite update (the whitening's output is checked through the norm
    the rescale computes anyway: a NaN/Inf made inside NS/NSDS makes it non-finite). The other matrices
    get a zero update, so a NaN never reaches the weights; what to do about them (skip, raise) is the
    caller's policy.

    Passes over the matrix besides the two GEMMs (Gram, final product): GradNorm's column norms (which
    also give ``finite``) and its multiply, written in the whitening dtype; the rescale's norm and its
    multiply, written in the output dtype; zeroing the non-finite matrices in place.

    On CUDA the computation runs through ``torch.compile`` (fusing the elementwise work around the
    GEMMs: small matrices are launch-bound there); ``SWAN_DIST_COMPILE=0`` turns that off, ``=1`` turns
    it on for every device. Where compilation fails, a warning says so once and the eager code runs.
    """
    if g.dim() < 2:
        raise ValueError(f"swan_update needs matrices (..., out, in), got shape {tuple(g.shape)}")
    if g.numel() == 0:
        return torch.zeros(g.shape, dtype=torch.float32, device=g.device), torch.ones(
            g.shape[:-2], dtype=torch.bool, device=g.device
        )
    compiled = _compile_wanted(g.device)
    if g.device.type == "cpu" and not compiled and g.dim() > 2 and math.prod(g.shape[:-2]) == 1:
        u, finite = swan_update(g.reshape(g.shape[-2:]), cfg)  # a stack of one as its matrix: torch's CPU
        return u.view(g.shape), finite.view(g.shape[:-2])  # batch-of-one bmm is up to 2x slower than mm
    if compiled:
        fn = _COMPILED.get(cfg)
        if fn is None:
            fn = _COMPILED[cfg] = torch.compile(functools.partial(_swan_update, cfg=cfg), dynamic=None)
        try:
            return fn(g)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager path below
            _COMPILE_STATE["failed"] = f"{type(e).__name__}: {e}"[:300]
            warnings.warn(f"swan_dist: torch.compile of swan_update failed ({_COMPILE_STATE['failed']}); running "
                          "eagerly from now on", RuntimeWarning)
    return _swan_update(g, cfg)


_COMPILED: dict[WhitenConfig, object] = {}
_COMPILE_STATE: dict[str, str] = {}


def _compile_wanted(device: torch.device) -> bool:
    if _COMPILE_STATE.get("failed"):
        return False
    mode = os.environ.get("SWAN_DIST_COMPILE", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return False
    return mode in ("1", "on", "true", "yes") or device.type == "cuda"


def _swan_update(g: Tensor, cfg: WhitenConfig) -> tuple[Tensor, Tensor]:
    wdtype = resolve_dtype(cfg, g.device)
    out_dtype = torch.promote_types(wdtype, torch.float32)
    if cfg.grad_norm == "rms" and cfg.method != "none" and g.device.type == "cpu" and g.shape[-1] <= g.shape[-2]:
        done = _swan_update_gram_first(g, cfg, wdtype, out_dtype)
        if done is not None:
            upd, ok = done
            if not is_fake(ok) and not bool(ok.all()):
                upd.masked_fill_(~ok, 0.0)
            return upd, ok[..., 0, 0]
    x, finite = _grad_norm(g, cfg.grad_norm, wdtype)
    # whiten() works in the paper's orientation (rows = input dims): a square matrix takes the Gram
    # of its input side, as Alg. 2 with m <= n does; NSDS depends on that choice, NS does not.
    x = whiten(x.mT, cfg.method, cfg.steps, cfg.beta, prescale=cfg.grad_norm == "none").mT
    norm = _norm(x, (-2, -1))
    upd = _scale_by(x, _rescale_factor(x, norm), out_dtype)
    finite = finite & norm.isfinite()  # the gradient and the whitening's output
    if g.device.type != "cpu" or (not is_fake(finite) and not bool(finite.all())):  # (no host sync off the CPU)
        upd.masked_fill_(~finite, 0.0)
    return upd, finite[..., 0, 0]


_PRODUCT_BLOCK_BYTES = 4 << 20  # the gram-first path's final product, made this many bytes at a time


def _swan_update_gram_first(g: Tensor, cfg: WhitenConfig, wdtype: torch.dtype, out_dtype: torch.dtype):
    """SWAN with GradNorm folded into the Gram, for a Gram on the input side (in <= out).

    GradNorm scales the input side, ``x = g·D``, so the Gram the whitening needs is ``D (gᵀg) D`` and
    D's entries come from ``gᵀg``'s diagonal (the column sums of squares): GradNorm costs no pass over
    the gradient, and D is folded into the small matrices (:func:`_whitener`), the result being
    ``g (Z D)ᵀ``. Passes over the matrix: the cast to the whitening dtype (none if it has it), the two
    GEMMs, the cast of the result to fp32 (block by block, so the product in the whitening dtype never
    exists whole), the rescale's norm and an in-place multiply.

    Returns None, for the general path to handle exactly, when some column's sum of squares is zero,
    non-finite (a NaN/Inf gradient) or outside [1e-30, 1e30] (where the Gram of the raw gradient
    could lose precision or overflow). The check reads a host value, so this runs on the CPU only.
    Otherwise ``(update, finite)``, ``finite`` of shape ``(..., 1, 1)``: whether each update is finite."""
    xb = g.to(wdtype)
    a = xb.mT @ xb  # (..., in, in)
    sq = a.diagonal(dim1=-2, dim2=-1).to(out_dtype)
    if not is_fake(sq) and not bool(((sq >= 1e-30) & (sq <= 1e30)).all()):
        return None
    d = sq.rsqrt().mul_(math.sqrt(g.shape[-2]))  # GradNorm: each input index over its RMS
    z = _whitener(a, cfg.method, cfg.steps, cfg.beta, d)
    if wdtype == out_dtype:
        upd = torch.matmul(xb, z.mT)  # (X_paper)ᵀ in torch layout: g·(Z D)ᵀ; a new tensor
    else:  # row blocks cast into the fp32 update: no whole product in the whitening dtype beside it
        upd = torch.empty(xb.shape, dtype=out_dtype, device=xb.device)
        rows = max(1, _PRODUCT_BLOCK_BYTES // max(1, xb[..., :1, :].numel() * xb.element_size()))
        for i in range(0, xb.shape[-2], rows):
            upd[..., i:i + rows, :] = torch.matmul(xb[..., i:i + rows, :], z.mT)
    norm = _norm(upd, (-2, -1))  # of the widened update, so no bf16-rounded scale
    return upd.mul_(_rescale_factor(upd, norm)), norm.isfinite()


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
