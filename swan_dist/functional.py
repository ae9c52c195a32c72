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
whitens and rescales to zero. No function here reads a tensor's value on the host (no ``bool(t)``,
``.item()``, ``.tolist()``): tiny, huge and non-finite inputs are handled by exact power-of-two scales
and masks decided on the device.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
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


def _read_cpuinfo_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


_CPU_BF16 = _read_cpuinfo_bf16()  # read once, at import: a constant to torch.compile, no file read in a step


def _cpuinfo_bf16() -> bool:
    return _CPU_BF16


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (Linux flags avx512_bf16 / amx_bf16), unless
    ``SWAN_DIST_CPU_BF16`` says otherwise."""
    forced = os.environ.get("SWAN_DIST_CPU_BF16", "").strip().lower()
    if forced in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        return forced in ("1", "true", "yes", "on")
    return _cpuinfo_bf16()


def _on_cpu(t: Tensor) -> bool:
    """Whether ``t`` takes the CPU's formulation (exactly scaled copies, passes in row blocks that stay in
    cache) rather than the accelerators' (fp64-accumulated reductions, one op per pass, for torch.compile
    to fuse). Both compute the same update to rounding for any input; tests run the accelerators' on the
    CPU through this one function."""
    return t.device.type == "cpu"


def _recip(norm: Tensor) -> Tensor:
    """1 / norm, with 0 for norm == 0 (so zero inputs map to zero outputs, never NaN)."""
    return torch.where(norm > 0, 1.0 / norm.clamp_min(torch.finfo(norm.dtype).tiny), 0.0)


def _max_abs(x: Tensor, dim) -> Tensor:
    """``max |x|`` over ``dim`` (kept), NaN where ``x`` has a NaN: an ``amax`` and an ``amin``, no
    temporary (on the CPU ~2x faster than ``abs().amax()``, ~6x than ``vector_norm(ord=inf)``)."""
    return torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg_())


def _maxexp(dtype: torch.dtype) -> int:
    """``e`` with ``2^e`` just above ``dtype``'s largest finite value (fp32, bf16: 128; fp64: 1024)."""
    return math.frexp(torch.finfo(dtype).max)[1]


def _pow2_scale(m: Tensor, dtype: torch.dtype) -> Tensor:
    """The exact power of two ``2^-e`` that brings each max-abs ``m`` into [0.5, 1) (``m = f·2^e``,
    ``f`` in [0.5, 1)), as ``dtype``: 1 where ``m`` is zero. Multiplying by it is exact, so a
    computation invariant to the scale gives, on the scaled input, bitwise the result it gives on the
    unscaled one wherever that one neither under- nor overflows. The exponent is clamped so that the
    scale is a positive finite ``dtype`` (a max-abs below ``dtype``'s smallest normal is brought to
    ``2^-23`` or above, not into [0.5, 1)); where ``m`` is NaN/Inf the scale is some such power of two,
    and what it multiplies stays non-finite."""
    top = _maxexp(dtype)
    e = torch.frexp(m.to(torch.promote_types(m.dtype, torch.float32))).exponent
    return torch.exp2(e.neg_().clamp_(-top, top - 2).to(dtype))


_BLOCK_BYTES = 1 << 20  # row blocks of the CPU's passes over a matrix: a second op on a block finds it in cache


def _row_blocks(x: Tensor, nbytes: int = _BLOCK_BYTES) -> list[tuple[int, int]]:
    """``(start, stop)`` of the row blocks (dim -2) of about ``nbytes`` each (all leading dims included)."""
    step = max(1, nbytes // max(1, x[..., :1, :].numel() * x.element_size()))
    return [(i, min(i + step, x.shape[-2])) for i in range(0, x.shape[-2], step)]


def _combine(parts: list[Tensor], op: str) -> Tensor:
    """Per-block partial reductions (kept dims, stacked along -2) reduced over the blocks."""
    if len(parts) == 1:
        return parts[0]
    cat = torch.cat(parts, dim=-2)
    return cat.amax(dim=-2, keepdim=True) if op == "max" else cat.sum(dim=-2, keepdim=True)


def _col_max_abs(x: Tensor) -> Tensor:
    """Each column's max-abs ``(..., 1, cols)``, NaN for a column with a NaN (row block by row block on
    the CPU, so that the ``amin`` reads what the ``amax`` brought into cache)."""
    if not _on_cpu(x):
        return _max_abs(x, -2)
    return _combine([_max_abs(x[..., i:j, :], -2) for i, j in _row_blocks(x)], "max")


def _scaled(x: Tensor, dim, keep: bool = True,
            dtype: torch.dtype | None = None) -> tuple[Tensor | None, Tensor, Tensor]:
    """``(y, n, scale)`` for the CPU: ``y = x·scale``, where ``scale`` is the power of two per slice over
    ``dim`` (-2, or (-2, -1); kept) that brings its max-abs into [0.5, 1) (:func:`_pow2_scale`), so
    ``y`` is exact, a new tensor (None unless ``keep``) in ``x``'s dtype promoted with ``dtype`` and fp32;
    ``n`` its 2-norm over ``dim``, in that precision: it cannot overflow (every entry of ``y`` is below
    1) and the entries whose squares underflow weigh less than its rounding, so ``n`` is exact to
    rounding for any input (tiny, huge, subnormal), and non-finite exactly where ``x`` has a NaN/Inf. Two
    passes, each row block by row block (:data:`_BLOCK_BYTES`): the max-abs, then the scaled block and
    its sum of squares, still in cache."""
    blocks = _row_blocks(x)
    dtype = torch.promote_types(torch.promote_types(x.dtype, dtype or x.dtype), torch.float32)
    scale = _pow2_scale(_combine([_max_abs(x[..., i:j, :], dim) for i, j in blocks], "max"), dtype)
    y = torch.empty_like(x, dtype=dtype) if keep else None
    tmp = torch.empty(x[..., :blocks[0][1], :].shape, dtype=dtype, device=x.device)
    parts = []
    for i, j in blocks:
        yb = torch.mul(x[..., i:j, :], scale, out=(y[..., i:j, :] if keep else tmp[..., :j - i, :]))
        if dim == -2:  # vector_norm over a strided dim: 2-8x slower than a multiply and a sum
            parts.append(torch.mul(yb, yb, out=tmp[..., :j - i, :]).sum(dim=-2, keepdim=True))
        else:
            parts.append(torch.linalg.vector_norm(yb, dim=dim, keepdim=True).square_())
    return y, _combine(parts, "sum").sqrt_(), scale


def _norm(x: Tensor, dim) -> Tensor:
    """2-norm over ``dim`` (-2, or (-2, -1); kept) in fp64, with no under/overflow for any input,
    non-finite exactly where ``x`` has a NaN/Inf, and no host sync on any device. On an accelerator:
    accumulated in fp64, one pass. On the CPU, where fp64 reductions are several times slower: the norm
    of the exactly scaled copy (:func:`_scaled`), the scale divided out in fp64."""
    if not _on_cpu(x):
        return torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float64)
    _, n, scale = _scaled(x, dim, keep=False)
    return n.to(torch.float64).div_(scale.to(torch.float64))


def _norm_bounded(x: Tensor, dim) -> Tensor:
    """2-norm over ``dim`` (kept) of a matrix whose entries are known to lie far from the ends of its
    dtype's range (GradNorm's and the whitening's outputs: at most ``sqrt(rows)`` and a few units in
    magnitude), so that a sum of squares cannot under- or overflow: one pass in the input's precision
    on the CPU (fp64 accumulation elsewhere, as :func:`_norm`). Still non-finite exactly where ``x``
    has a NaN/Inf."""
    if not _on_cpu(x):
        return torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float64)
    return torch.linalg.vector_norm(x, dim=dim, keepdim=True)


def _scale_by(x: Tensor, factor: Tensor, dtype: torch.dtype) -> Tensor:
    """``x * factor`` written as ``dtype`` (a new tensor; ``x`` is never written), on an accelerator: one
    op computing in ``factor``'s precision and rounding once on the store. ``factor`` (fp64: GradNorm's
    per column, the rescale's per matrix, from fp64 norms) may lie beyond ``x``'s range where the product
    does not: 1/norm of a column of subnormal gradients overflows fp32, while ``x·factor`` is at most
    sqrt(rows) (GradNorm) or sqrt(rows·cols) (the rescale)."""
    return torch.mul(x, factor, out=torch.empty(x.shape, dtype=dtype, device=x.device))


def _centred(g: Tensor, mode: str) -> Tensor:
    if mode != "mean":
        return g
    g = g.to(torch.promote_types(g.dtype, torch.float32))
    return g - g.mean(dim=-2, keepdim=True)


def _grad_norm(g: Tensor, mode: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """GradNorm written as ``dtype``, and the per-matrix finite flag ``(..., 1, 1)``: the column norms
    (which also tell whether ``g`` is finite) and one multiply over ``g``."""
    g = _centred(g, mode)
    if mode == "none":
        return g.to(dtype), torch.isfinite(_max_abs(g, (-2, -1)))
    if _on_cpu(g):  # GradNorm of the exactly scaled copy: the same result, a factor <= 2 sqrt(rows)
        y, norms, _ = _scaled(g, -2, dtype=dtype)  # (subnormal columns included)
        finite = torch.isfinite(norms).all(dim=-1, keepdim=True)
        return y.mul_(_recip(norms) * math.sqrt(g.shape[-2])).to(dtype), finite
    norms = _norm(g, -2)  # (..., 1, in)
    finite = torch.isfinite(norms).all(dim=-1, keepdim=True)
    return _scale_by(g, _recip(norms) * math.sqrt(g.shape[-2]), dtype), finite


def grad_norm(g: Tensor, mode: str = "rms") -> Tensor:
    """GradNorm (paper eq. 1) in torch layout: each column (input index) of ``(..., out, in)``
    divided by its RMS over the output dim (-2); ``mode='mean'`` subtracts the column mean first.

    A column that is all zero stays zero. The column norms cannot under- or overflow (:func:`_norm`),
    so tiny (1e-30) and huge (1e30) gradients give the same result as moderate ones.
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
    out = _whitener(_gram(x), method, steps, beta) @ x  # Z·(X / ‖X‖_F): the scale is folded into Z
    return out.mT if transpose else out


_GRAM_HALVES_MIN = 1024  # a single matrix's Gram at least this wide is built from its halves on the CPU


def _gram(x: Tensor) -> Tensor:
    """``x @ x.mT`` (a new tensor). On the CPU, a single matrix with at least :data:`_GRAM_HALVES_MIN`
    rows is split in two halves of rows, ``x = [x0; x1]``: three GEMMs (``x0 x0ᵀ``, ``x0 x1ᵀ``,
    ``x1 x1ᵀ``) and the transpose of the middle one make the symmetric Gram with 3/4 of the
    multiply-adds (measured 5-20 % faster there, fp32 and bf16; batched GEMMs gain nothing). Every entry
    is the same dot product, to rounding; the off-diagonal blocks are exact transposes of each other (a
    BLAS may round a diagonal block's two triangles apart, as it may the full GEMM's)."""
    s = x.shape[-2]
    if x.dim() != 2 or s < _GRAM_HALVES_MIN or not _on_cpu(x):
        return x @ x.mT
    h = s // 2
    x0, x1 = x[:h], x[h:]
    gram = torch.empty((s, s), dtype=x.dtype, device=x.device)
    torch.mm(x0, x0.mT, out=gram[:h, :h])
    torch.mm(x1, x1.mT, out=gram[h:, h:])
    torch.mm(x0, x1.mT, out=gram[:h, h:])
    gram[h:, :h] = gram[:h, h:].mT
    return gram


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


def _rescale_factor(u: Tensor, norm: Tensor) -> Tensor:
    """``sqrt(m n) / ‖u‖_F`` per matrix from ``norm`` = ``‖u‖_F``, 0 for a zero matrix."""
    return _recip(norm) * math.sqrt(u.shape[-2] * u.shape[-1])


def _rescale(u: Tensor, dtype: torch.dtype) -> Tensor:
    if _on_cpu(u):  # the exactly scaled copy, rescaled in place (subnormal matrices included)
        y, norm, _ = _scaled(u, (-2, -1))
        return y.mul_(_rescale_factor(y, norm)).to(dtype)
    return _scale_by(u, _rescale_factor(u, _norm(u, (-2, -1))), dtype)


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
    also give ``finite``; on the CPU a max-abs pass first, so that they cannot under/overflow) and its
    multiply, written in the whitening dtype; the rescale's norm, the zeroing of NaN/Inf and the
    multiply, in the output dtype (on the CPU with the Gram on the input side, GradNorm is folded into
    the Gram instead: :func:`_swan_update_gram_first`). Every decision is a mask or a ``where`` on the
    device: nothing reads a tensor's value on the host, on any device, so fake tensors
    (``FakeTensorMode``) run exactly this code.

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
    if _on_cpu(g) and cfg.method == "none" and cfg.grad_norm != "none":
        return _grad_norm_rescaled(g, cfg.grad_norm, out_dtype)
    if cfg.grad_norm == "rms" and cfg.method != "none" and _on_cpu(g) and g.shape[-1] <= g.shape[-2]:
        return _swan_update_gram_first(g, cfg, wdtype, out_dtype)
    x, finite = _grad_norm(g, cfg.grad_norm, wdtype)
    # whiten() works in the paper's orientation (rows = input dims): a square matrix takes the Gram
    # of its input side, as Alg. 2 with m <= n does; NSDS depends on that choice, NS does not.
    x = whiten(x.mT, cfg.method, cfg.steps, cfg.beta, prescale=cfg.grad_norm == "none").mT
    bounded = cfg.grad_norm != "none" or cfg.method != "none"  # else x is the raw gradient
    if not bounded:  # the raw gradient: its norm taken with no under/overflow
        if _on_cpu(x):
            upd, norm, _ = _scaled(x, (-2, -1))  # the exactly scaled copy, so the factor is representable
            return _finish(upd.to(out_dtype), finite, norm)
        upd = x.to(out_dtype, copy=True)
        return _finish(upd, finite, _norm(upd, (-2, -1)))
    if x.dtype == out_dtype:  # x is a new tensor (GradNorm's or the whitening's), written in place
        return _finish(x, finite)
    upd = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return _finish(upd, finite, fill=lambda i, j, ub: ub.copy_(x[..., i:j, :]))


_PRODUCT_BLOCK_BYTES = 4 << 20  # the update's passes on the CPU, made this many bytes at a time (in cache)
# the Gram-first product in bf16 is made whole up to this many bytes of fp32 update, in row blocks of it above
# (so that a large matrix's product never exists whole): GEMMs on 4 MB row blocks of a stack measured 5-20 %
# slower than one GEMM over it, on this CPU (docs/benchmarks.md, "Whitening (CPU)")
_PRODUCT_WHOLE_BYTES = 64 << 20


def _finish(upd: Tensor, finite: Tensor, norm: Tensor | None = None, fill=None) -> tuple[Tensor, Tensor]:
    """The rescale, in place, and the zeroing of the matrices whose gradient (``finite``, ``(..., 1, 1)``)
    or update is not finite, decided on the device: the update's norm (``norm`` if given, else
    :func:`_norm_bounded`'s), its NaN/Inf entries set to 0 (nothing changes in a finite matrix), then
    each matrix multiplied by its rescale factor, 0 for the non-finite ones. ``fill(i, j, block)``, if
    given, first writes rows ``i:j`` of ``upd``; on the CPU the rows are filled, measured and cleaned
    block by block (:data:`_PRODUCT_BLOCK_BYTES` of ``upd`` each), each block still in cache. Returns
    ``(update, finite[..., 0, 0])``, ``finite`` now that of the gradient and the update."""
    if norm is not None or not _on_cpu(upd):
        if fill is not None:
            fill(0, upd.shape[-2], upd)
        if norm is None:
            norm = _norm_bounded(upd, (-2, -1))
        torch.nan_to_num_(upd, 0.0, 0.0, 0.0)
    else:
        parts = []
        for i, j in _row_blocks(upd, _PRODUCT_BLOCK_BYTES):
            ub = upd[..., i:j, :]
            if fill is not None:
                fill(i, j, ub)
            parts.append(torch.linalg.vector_norm(ub, dim=(-2, -1), keepdim=True))
            torch.nan_to_num_(ub, 0.0, 0.0, 0.0)
        norm = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.cat(parts, -1), dim=-1, keepdim=True)
    finite = finite & norm.isfinite()
    # in the norm's precision, rounded once on the store: an accelerator's fp64 norm of a subnormal matrix
    # gives a factor beyond fp32's range, the product is not
    factor = torch.where(finite, _rescale_factor(upd, norm), 0.0)
    return upd.mul_(factor), finite[..., 0, 0]


def _grad_norm_rescaled(g: Tensor, mode: str, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """SWAN without whitening, on the CPU: GradNorm and the rescale as one multiply. GradNorm leaves every
    non-zero column with norm sqrt(rows), so its output's norm is sqrt(rows·k), k the matrix's non-zero
    columns, and the rescale is the factor sqrt(cols / k) per matrix, folded into GradNorm's per column
    (0 for a non-finite matrix, whose NaN/Inf entries are then set to 0). Passes: the column max-abs, the
    exactly scaled copy and its column sums of squares (:func:`_scaled`), then the multiply and the
    zeroing of NaN/Inf on each block in cache."""
    y, norms, _ = _scaled(_centred(g, mode), -2, dtype=out_dtype)
    finite = torch.isfinite(norms).all(dim=-1, keepdim=True)  # (..., 1, 1)
    k = (norms > 0).sum(dim=-1, keepdim=True)
    per_matrix = torch.where(finite & (k > 0), (g.shape[-1] / k.clamp_min(1)).sqrt(), 0.0)
    factor = (_recip(norms) * math.sqrt(g.shape[-2])).mul_(per_matrix.to(norms.dtype))
    for i, j in _row_blocks(y):
        torch.nan_to_num_(y[..., i:j, :].mul_(factor), 0.0, 0.0, 0.0)
    return y.to(out_dtype), finite[..., 0, 0]


def _swan_update_gram_first(g: Tensor, cfg: WhitenConfig, wdtype: torch.dtype, out_dtype: torch.dtype):
    """SWAN with GradNorm folded into the Gram, for a Gram on the input side (in <= out), on the CPU.

    GradNorm scales the input side, ``x = g·D``, so the Gram the whitening needs is ``D (gᵀg) D`` and
    D's entries come from ``gᵀg``'s diagonal (the column sums of squares): GradNorm costs no pass over
    the gradient, and D is folded into the small matrices (:func:`_whitener`), the result being
    ``g (Z D)ᵀ``.

    So that the Gram can neither overflow nor lose precision to underflow, whatever the gradient's
    scale, each column is first multiplied by the exact power of two that brings its max-abs into
    [0.5, 1) (:func:`_pow2_scale`): a non-zero column's sum of squares then lies in [0.25, rows].
    GradNorm is invariant to a per-column scale and a power-of-two scale changes no rounding, so the
    result is bitwise the one computed on the unscaled gradient wherever that one is exact, and the
    same for any column scales: tiny, huge, or spanning the whole range. A zero column gets D = 0 and
    stays zero.

    Passes over the matrix: the column max-abs (an ``amax`` and an ``amin``), the scaled copy in the
    whitening dtype (cast, then multiplied in place), the two GEMMs, the cast of the result to fp32 (in row
    blocks of :data:`_PRODUCT_WHOLE_BYTES` for a large matrix) and :func:`_finish` (the update's
    norm and the zeroing of NaN/Inf on each block in cache, then an in-place multiply). A NaN/Inf
    gradient, or a non-finite update, gives a zero update and ``finite`` False, decided on the device
    (no host sync). Returns ``(update, finite)``, ``finite`` of shape ``g.shape[:-2]``."""
    m = _col_max_abs(g)  # (..., 1, in)
    scale = _pow2_scale(m, torch.promote_types(g.dtype, torch.float32))
    xb = torch.empty(g.shape, dtype=wdtype, device=g.device)
    sdtype = torch.promote_types(g.dtype, wdtype)  # the multiply's precision: exact in it
    blocks = _row_blocks(g)
    tmp = None if sdtype == wdtype else torch.empty(g[..., :blocks[0][1], :].shape, dtype=sdtype, device=g.device)
    scale = scale.to(sdtype)
    for i, j in blocks:
        if tmp is None:  # written straight into the copy (a widening cast, or none)
            torch.mul(g[..., i:j, :], scale, out=xb[..., i:j, :])
        else:  # narrowing: scaled in the gradient's precision in a block in cache, then cast
            xb[..., i:j, :].copy_(torch.mul(g[..., i:j, :], scale, out=tmp[..., :j - i, :]))
    a = _gram(xb.mT)  # (..., in, in)
    sq = a.diagonal(dim1=-2, dim2=-1).to(out_dtype)
    d = torch.where(sq > 0, sq.rsqrt(), 0.0).mul_(math.sqrt(g.shape[-2]))  # GradNorm: each input index over its RMS
    zt = _whitener(a, cfg.method, cfg.steps, cfg.beta, d).mT
    finite = torch.isfinite(m).all(dim=-1, keepdim=True)  # (..., 1, 1)
    if wdtype == out_dtype:
        return _finish(torch.matmul(xb, zt), finite)  # (X_paper)ᵀ in torch layout: g·(Z D)ᵀ; a new tensor
    upd = torch.empty(xb.shape, dtype=out_dtype, device=xb.device)  # the product in the whitening dtype, cast
    for i, j in _row_blocks(upd, _PRODUCT_WHOLE_BYTES):
        upd[..., i:j, :].copy_(torch.matmul(xb[..., i:j, :], zt))
    return _finish(upd, finite)


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
