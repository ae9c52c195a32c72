"""The pure math: GradNorm axis, NS/NSDS whitening, rescale, edge cases, and the paper's theorem."""

import math

import pytest
import torch

from swan_dist.functional import WhitenConfig, grad_norm, rescale, swan_update, whiten, whiten_flops

pytestmark = pytest.mark.timeout(120)


def _well_conditioned(rows, cols, batch=(), seed=0, dtype=torch.float64):
    """Random matrices with singular values in [1, 3] (so 30 NS steps converge tightly)."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(*batch, rows, k, generator=g, dtype=dtype))
    v, _ = torch.linalg.qr(torch.randn(*batch, cols, k, generator=g, dtype=dtype))
    s = 1 + 2 * torch.rand(*batch, k, generator=g, dtype=dtype)
    return (u * s.unsqueeze(-2)) @ v.mT


def _polar(g):
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (48, 48)])
def test_ns_converges_to_polar_factor_fp32(shape):
    g = _well_conditioned(*shape, batch=(3,)).float()
    out = whiten(g, "ns", steps=30, beta=0.5)
    ref = _polar(g.double()).float()
    assert torch.allclose(out, ref, atol=2e-5, rtol=0), (out - ref).abs().max()


def test_ns_paper_beta_is_not_exact_but_rescales_to_a_band():
    """β = 0.8 (paper) leaves singular values in a band; documents why tests of exactness use β = 0.5."""
    g = _well_conditioned(32, 128).float()
    s = torch.linalg.svdvals(whiten(g, "ns", steps=10, beta=0.8))
    assert s.max() / s.min() > 1.5
    s_exact = torch.linalg.svdvals(whiten(g, "ns", steps=30, beta=0.5))
    assert s_exact.max() / s_exact.min() < 1 + 1e-4


def _nsds_dense_reference(x, steps, beta):
    """The paper's NSDS recurrence written literally with dense Diag(·) matrices, Y and Z updated
    from (Y_k, Z_k) (appendix: Y_{k+1} = β Y_k Diag(3I − Z_k Diag(Y_k)), Z_{k+1} = β (3I − Diag(Z_k) Y_k) Diag(Z_k))."""
    x = x / x.norm()
    eye = torch.eye(x.shape[0], dtype=x.dtype)
    Diag = lambda a: torch.diag(torch.diagonal(a))  # noqa: E731
    y, z = x @ x.T, eye.clone()
    history = []
    for _ in range(steps):
        y, z = beta * y @ Diag(3 * eye - z @ Diag(y)), beta * (3 * eye - Diag(z) @ y) @ Diag(z)
        history.append(z @ x)
    return history


@pytest.mark.parametrize("beta", [0.4, 0.5])
def test_nsds_matches_dense_recurrence_step_by_step(beta):
    x = torch.randn(24, 80, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _nsds_dense_reference(x, 4, beta)
    for k in range(1, 5):
        out = whiten(x, "nsds", steps=k, beta=beta)
        assert torch.allclose(out, ref[k - 1], atol=1e-12, rtol=1e-10), k


def test_nsds_uses_gram_of_smaller_side():
    x = torch.randn(80, 24, dtype=torch.float64)
    # torch layout (80, 24): rows > cols, so the iteration runs on the 24x24 Gram of the transpose
    assert torch.allclose(whiten(x, "nsds", 2, 0.4), _nsds_dense_reference(x.T, 2, 0.4)[-1].T)


def _paper_reference(g_torch, cfg):
    """SWAN written in the paper's orientation: G (m=in, n=out), GradNorm per row over columns."""
    G = g_torch.T.double()
    s = G.pow(2).mean(dim=1, keepdim=True).sqrt()
    G = G / s
    W = whiten(G, cfg.method, cfg.steps, cfg.beta)  # smaller-side Gram, as Alg. 2 assumes m <= n
    W = W * math.sqrt(G.numel()) / W.norm()
    return W.T


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (40, 40)])
@pytest.mark.parametrize("method", ["ns", "nsds"])
def test_orientation_matches_paper_layout(shape, method):
    cfg = WhitenConfig(method=method, steps=5 if method == "ns" else 2, beta=0.5 if method == "ns" else 0.4)
    g = torch.randn(*shape)
    upd, finite = swan_update(g, cfg)
    assert finite.item()
    assert torch.allclose(upd.double(), _paper_reference(g, cfg), atol=1e-4, rtol=1e-4)


def test_grad_norm_axis_and_mean_mode():
    g = torch.randn(16, 8) * torch.logspace(-3, 3, 8)  # wildly different column scales
    out = grad_norm(g)
    assert torch.allclose(out.pow(2).mean(dim=0), torch.ones(8), atol=1e-5)  # each input index RMS 1
    assert not torch.allclose(out.pow(2).mean(dim=1), torch.ones(16), atol=1e-2)
    centred = grad_norm(torch.randn(16, 8) * 3 + 5.0, "mean")
    assert torch.allclose(centred.mean(dim=0), torch.zeros(8), atol=1e-5)
    assert torch.allclose(centred.pow(2).mean(dim=0), torch.ones(8), atol=1e-4)


@pytest.mark.parametrize("method", ["ns", "nsds"])
@pytest.mark.parametrize("norm", ["rms", "mean"])
def test_invariant_to_input_scaling_not_output_scaling(method, norm):
    cfg = WhitenConfig(method=method, steps=10 if method == "ns" else 2, beta=0.8 if method == "ns" else 0.4, grad_norm=norm, dtype="float64")
    g = torch.randn(24, 40, dtype=torch.float64)
    col = torch.rand(40, dtype=torch.float64) * 100 + 1e-3  # positive, per input index (torch column)
    row = torch.rand(24, 1, dtype=torch.float64) * 100 + 1e-3  # positive, per output index
    base, _ = swan_update(g, cfg)
    scaled_in, _ = swan_update(g * col, cfg)
    scaled_out, _ = swan_update(g * row, cfg)
    assert torch.allclose(base, scaled_in, atol=1e-9)
    assert (base - scaled_out).abs().max() > 1e-2


@pytest.mark.parametrize("shape", [(7, 13), (13, 7), (1, 9), (9, 1), (5, 3, 4)])
def test_output_norm_is_sqrt_mn(shape):
    upd, _ = swan_update(torch.randn(*shape))
    m, n = shape[-2:]
    norms = upd.flatten(-2).norm(dim=-1)
    assert torch.allclose(norms, torch.full_like(norms, math.sqrt(m * n)), rtol=1e-5)


def test_one_row_and_one_column():
    g = torch.randn(1, 9)
    upd, _ = swan_update(g)  # one output: each input index normalised alone -> sign descent
    assert torch.allclose(upd, g.sign(), atol=1e-5)
    g = torch.randn(9, 1)
    upd, _ = swan_update(g)  # one input index: the column over its RMS
    assert torch.allclose(upd, g / g.pow(2).mean().sqrt(), atol=1e-5)


def test_zero_tiny_huge_and_empty():
    for cfg in (WhitenConfig(), WhitenConfig(method="ns", steps=10, beta=0.8)):
        upd, finite = swan_update(torch.zeros(3, 8, 5), cfg)
        assert finite.all() and torch.equal(upd, torch.zeros(3, 8, 5))
        g = torch.randn(8, 5)
        g[:, 2] = 0  # one dead input index stays dead, the rest is finite
        upd, _ = swan_update(g, cfg)
        assert torch.isfinite(upd).all() and torch.equal(upd[:, 2], torch.zeros(8))
        base, _ = swan_update(torch.randn(8, 5, generator=torch.Generator().manual_seed(3)), cfg)
        for scale in (1e-30, 1e30):
            g = torch.randn(8, 5, generator=torch.Generator().manual_seed(3)) * scale
            out, finite = swan_update(g, cfg)
            assert finite.item() and torch.allclose(out, base, atol=1e-4), scale
    for shape in [(0, 5), (5, 0), (0, 3, 4)]:
        upd, finite = swan_update(torch.empty(shape))
        assert upd.shape == shape and finite.all()
    with pytest.raises(ValueError):
        swan_update(torch.randn(5))


def test_nonfinite_matrices_flagged_and_zeroed_without_touching_others():
    g = torch.randn(4, 6, 5)
    g[1, 2, 3] = float("nan")
    g[3, 0, 0] = float("inf")
    upd, finite = swan_update(g)
    assert finite.tolist() == [True, False, True, False]
    assert torch.equal(upd[1], torch.zeros(6, 5)) and torch.equal(upd[3], torch.zeros(6, 5))
    alone, _ = swan_update(g[[0, 2]])
    assert torch.allclose(upd[[0, 2]], alone)


@pytest.mark.parametrize("lead", [(1,), (1, 1)])
def test_a_stack_of_one_is_whitened_as_its_matrix(monkeypatch, lead):
    """A stack holding one matrix (the owner path's phases make them) runs as that matrix (torch's
    batch-of-one bmm is a slow kernel on the CPU): same update, the stack's shapes, NaN still flagged."""
    import swan_dist.functional as F

    seen, inner = [], F._swan_update
    monkeypatch.setattr(F, "_swan_update", lambda g, cfg: seen.append(g.dim()) or inner(g, cfg))
    swan_update(torch.randn(*lead, 6, 5))
    swan_update(torch.randn(2, 6, 5))
    assert seen == [2, 3]
    for shape in [(24, 40), (40, 24)]:
        g = torch.randn(shape)
        for cfg in (WhitenConfig(), WhitenConfig(method="ns", steps=5, beta=0.8), WhitenConfig(dtype="bfloat16")):
            upd, finite = swan_update(g.view(*lead, *shape), cfg)
            assert upd.shape == (*lead, *shape) and finite.shape == lead and finite.all()
            assert torch.equal(upd.reshape(shape), swan_update(g, cfg)[0])
            both, _ = swan_update(torch.stack([g, g]).view(2, *lead, *shape), cfg)
            tol = 2e-2 if cfg.dtype == "bfloat16" else 1e-5  # mm and bmm may round a bf16 product apart
            torch.testing.assert_close(upd, both[0], atol=tol, rtol=0)
    bad = torch.randn(1, 6, 5)
    bad[0, 1, 1] = float("nan")
    upd, finite = swan_update(bad)
    assert finite.tolist() == [False] and torch.equal(upd, torch.zeros(1, 6, 5))


def test_bf16_gradients_and_bf16_iteration():
    g = torch.randn(16, 32)
    ref, _ = swan_update(g)
    upd, _ = swan_update(g.bfloat16())
    assert upd.dtype == torch.float32 and torch.allclose(upd, ref, atol=0.05)
    low, _ = swan_update(g, WhitenConfig(dtype="bfloat16"))
    assert torch.isfinite(low).all() and (low - ref).norm() / ref.norm() < 0.05


def test_rescale_and_config_validation():
    assert torch.equal(rescale(torch.zeros(2, 3)), torch.zeros(2, 3))
    for bad in [dict(method="svd"), dict(grad_norm="l2"), dict(dtype="half"), dict(steps=0), dict(beta=0)]:
        with pytest.raises(ValueError):
            WhitenConfig(**bad)
    ns, nsds = WhitenConfig(method="ns", steps=10), WhitenConfig()
    assert whiten_flops((1024, 4096), ns) > 2 * whiten_flops((1024, 4096), nsds)
    assert whiten_flops((4096, 1024), ns) == whiten_flops((1024, 4096), ns)


def test_theorem_one_step_to_optimum_from_stiefel():
    """Thm (appendix): L(W) = ½Tr(WᵀHW), W₀ with orthonormal rows; one exact-whitening step with
    lr = ‖HW‖_*/Tr(H) reaches the optimum (W = 0, L = 0). Plain GD at that lr does not."""
    g = torch.Generator().manual_seed(0)
    m, n = 12, 30
    q, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    H = q @ torch.diag(torch.logspace(-2, 2, m, dtype=torch.float64)) @ q.T  # condition number 1e4
    W0 = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))[0].T  # W0 W0ᵀ = I
    loss = lambda W: 0.5 * torch.trace(W.T @ H @ W)  # noqa: E731
    G = H @ W0
    lr = torch.linalg.matrix_norm(G, ord="nuc") / torch.trace(H)
    W1 = W0 - lr * whiten(G, "ns", steps=60, beta=0.5)
    assert loss(W1) / loss(W0) < 1e-10
    assert loss(W0 - lr * G) / loss(W0) > 1e-2


def _paper_swan(g_torch, steps, beta, diag):
    """Algorithms 1 and 2 of the paper, transcribed literally in float64 and the paper's layout:
    G = G_torchᵀ is (m, n) with rows = input dims. GradNorm (eq. 1): each row divided by its RMS over
    the output dims (columns). GradWhitening (Alg. 2, input divided by its Frobenius norm first, as the
    appendix says): Y ← GGᵀ, Z ← I, then K steps of the coupled iteration, return Z G; Alg. 2 assumes
    m <= n, so an (m > n) input is whitened through its transpose. Rescale: sqrt(mn)·ΔW/‖ΔW‖."""
    G = g_torch.double().T
    m, n = G.shape
    s = torch.sqrt((G ** 2).mean(dim=1, keepdim=True))  # one RMS per row (input index)
    G = G / (s @ torch.ones(1, n, dtype=G.dtype))

    def alg2(X):
        X = X / torch.linalg.norm(X)
        I = torch.eye(X.shape[0], dtype=X.dtype)  # noqa: E741
        Diag = lambda A: torch.diag(torch.diagonal(A))  # noqa: E731
        Y, Z = X @ X.T, I
        for _ in range(steps):
            if diag:
                Y, Z = beta * Y @ Diag(3 * I - Z @ Diag(Y)), beta * (3 * I - Diag(Z) @ Y) @ Diag(Z)
            else:
                Y, Z = beta * Y @ (3 * I - Z @ Y), beta * (3 * I - Z @ Y) @ Z
        return Z @ X

    dW = alg2(G) if m <= n else alg2(G.T).T
    dW = math.sqrt(m * n) * dW / torch.linalg.norm(dW)
    return dW.T  # back to torch layout (out, in)


@pytest.mark.parametrize("shape, method, steps, beta", [
    ((48, 24), "ns", 10, 0.8),  # tall in torch layout (out > in): the paper's m <= n directly
    ((24, 48), "ns", 10, 0.8),  # wide: the paper's m > n, whitened through the transpose
    ((32, 32), "ns", 10, 0.8),
    ((48, 24), "nsds", 2, 0.4),
    ((24, 48), "nsds", 2, 0.4),  # wide, NSDS: unlike NS, the result depends on which side's Gram is taken
    ((32, 32), "nsds", 2, 0.4),  # square: the Gram of the input side, as Alg. 2 with m <= n
])
def test_swan_update_equals_literal_paper_algorithm(shape, method, steps, beta):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    g[:, 3] *= 100.0  # one input index with a large scale: GradNorm must remove it, on the right axis
    want = _paper_swan(g, steps, beta, diag=method == "nsds")
    exact = WhitenConfig(method=method, steps=steps, beta=beta, grad_norm="rms", dtype="float64")
    got, finite = swan_update(g.double(), exact)  # same algorithm, same precision: equal to rounding
    assert finite.item() and (got - want).abs().max() < 1e-9 * want.abs().max(), (got - want).abs().max()
    fp32 = WhitenConfig(method=method, steps=steps, beta=beta, grad_norm="rms", dtype="float32")
    got32, _ = swan_update(g, fp32)  # the default precision: fp32 rounding, amplified by the iteration
    # measured: <= 6e-6 relative, except square NS (beta 0.8 x 10 steps amplifies the rounding of the
    # smallest singular values: 2e-4 at this seed, up to 6e-4 over seeds)
    tol32 = 1e-3 if method == "ns" and shape[0] == shape[1] else 1e-4
    assert (got32.double() - want).abs().max() < tol32 * want.abs().max(), (got32.double() - want).abs().max()
    # the comparison discriminates: another β, or GradNorm on the other axis, is far outside it
    assert (_paper_swan(g, steps, 0.5, diag=method == "nsds") - want).abs().max() > 3e-3 * want.abs().max()
    if shape[0] == shape[1]:
        wrong_axis = _paper_swan(g.T.contiguous(), steps, beta, diag=method == "nsds").T
        assert (wrong_axis - want).abs().max() > 1e-2 * want.abs().max()


def test_grad_norm_on_tall_matrix_equals_literal_eq1():
    g = torch.randn(40, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    g[:, 2] *= 1e3
    G = g.T  # paper layout (in, out)
    s = torch.sqrt((G ** 2).mean(dim=1, keepdim=True))
    want = (G / s).T
    got = grad_norm(g.float(), "rms").double()
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert torch.allclose(got.pow(2).mean(dim=0), torch.ones(8, dtype=torch.float64), atol=1e-5)  # unit RMS per input


def test_compile_failure_falls_back_to_eager_once(monkeypatch):
    """SWAN_DIST_COMPILE=1 routes swan_update through torch.compile; a compiler that fails warns once
    and the eager result comes back (and later calls go straight to the eager code)."""
    import swan_dist.functional as F

    calls = []

    def broken_compile(fn, **kwargs):
        def run(*a, **k):
            calls.append(1)
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setenv("SWAN_DIST_COMPILE", "1")
    monkeypatch.setattr(F.torch, "compile", broken_compile)
    monkeypatch.setattr(F, "_COMPILED", {})
    monkeypatch.setattr(F, "_COMPILE_STATE", {})
    g = torch.randn(3, 12, 7)
    with pytest.warns(RuntimeWarning, match="torch.compile of swan_update failed"):
        upd, finite = swan_update(g)
    ref, _ = F._swan_update(g, WhitenConfig())
    assert torch.equal(upd, ref) and bool(finite.all())
    swan_update(g)
    assert len(calls) == 1  # not retried
    monkeypatch.setenv("SWAN_DIST_COMPILE", "0")
    monkeypatch.setattr(F, "_COMPILE_STATE", {})
    swan_update(g)
    assert len(calls) == 1  # off: never compiled


def test_auto_dtype_rule_and_bf16_tolerance(monkeypatch):
    """'auto': NSDS in bf16 on CUDA and on CPUs with native bf16 (here: /proc/cpuinfo's flags, or
    SWAN_DIST_CPU_BF16), fp32 otherwise and for NS; and on this machine's CPU a bf16 NSDS update stays
    within the stated 2 % (relative Frobenius distance) of the fp32 update on tall, wide and square,
    Gaussian and nearly low-rank gradients."""
    import swan_dist.functional as F

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    nsds, ns = WhitenConfig(), WhitenConfig(method="ns", steps=10, beta=0.8)
    assert F.resolve_dtype(nsds, cuda) == torch.bfloat16 and F.resolve_dtype(ns, cuda) == torch.float32
    monkeypatch.setenv("SWAN_DIST_CPU_BF16", "1")
    assert F.resolve_dtype(nsds, cpu) == torch.bfloat16 and F.resolve_dtype(ns, cpu) == torch.float32
    monkeypatch.setenv("SWAN_DIST_CPU_BF16", "0")
    assert F.resolve_dtype(nsds, cpu) == torch.float32
    monkeypatch.delenv("SWAN_DIST_CPU_BF16")
    assert (F.resolve_dtype(nsds, cpu) == torch.bfloat16) == F._cpuinfo_bf16()
    assert F.resolve_dtype(WhitenConfig(dtype="float32"), cuda) == torch.float32  # explicit wins
    g = torch.Generator().manual_seed(3)
    for shape in [(6, 96, 96), (4, 256, 96), (4, 96, 256)]:
        gauss = torch.randn(shape, generator=g)
        lowrank = (torch.randn(shape[0], shape[1], 4, generator=g) @ torch.randn(shape[0], 4, shape[2], generator=g)
                   + 0.01 * torch.randn(shape, generator=g))
        for x in (gauss, lowrank):
            u32, _ = swan_update(x, WhitenConfig(dtype="float32"))
            u16, _ = swan_update(x, WhitenConfig(dtype="bfloat16"))
            rel = ((u16 - u32).norm(dim=(-2, -1)) / u32.norm(dim=(-2, -1))).max()
            assert rel < 0.02, (shape, float(rel))
            assert rel > 1e-4  # bf16 really ran


@pytest.mark.parametrize("method, steps, beta", [("nsds", 2, 0.4), ("ns", 10, 0.8), ("nsds", 1, 0.4)])
def test_gradnorm_folded_into_gram_equals_general_path(monkeypatch, method, steps, beta):
    """On the CPU, a matrix whose Gram is on the input side (in <= out) takes GradNorm from the Gram's
    diagonal and folds it into the small matrices; the result equals the general path (GradNorm pass,
    then whitening) to rounding, for every input: a zero column, tiny or huge columns, columns spanning
    the whole range, and a NaN/Inf column (then a zero update, flagged)."""
    import swan_dist.functional as F

    cfg = WhitenConfig(method=method, steps=steps, beta=beta, dtype="float64")
    gen = torch.Generator().manual_seed(11)
    f64 = torch.float64

    def general(g):
        return F._rescale(F.whiten(F._grad_norm(g, "rms", f64)[0].mT, method, steps, beta, prescale=False).mT, f64)

    for shape in [(48, 24), (32, 32), (3, 40, 8), (1, 1), (5, 1)]:
        g = torch.randn(*shape, generator=gen, dtype=f64)
        g[..., 0] *= 1e3  # GradNorm must remove a column's scale
        fast, finite = F._swan_update_gram_first(g, cfg, f64, f64)
        assert finite.shape == g.shape[:-2] and bool(finite.all()), shape
        want = general(g)
        assert (fast - want).abs().max() < 1e-10 * want.abs().max(), shape
        if shape[-1] > 1:  # one column: GradNorm alone already fixes the result (sign-like)
            monkeypatch.setattr(F, "_whitener", lambda gram, *a, **k: torch.zeros_like(gram))
            assert F._swan_update_gram_first(g, cfg, f64, f64)[0].abs().max() == 0  # the shortcut really ran
            monkeypatch.undo()
    g = torch.randn(16, 8, generator=gen, dtype=f64)
    spread = g * torch.logspace(-300, 300, 8, dtype=f64)  # columns from 1e-300 to 1e300 in one matrix
    for bad in ("zero", "tiny", "huge", "tinier", "huger", "spread", "nan", "inf", "-inf"):
        x = spread if bad == "spread" else g.clone()
        if bad != "spread":
            x[:, 2] = {"zero": 0.0, "tiny": 1e-17, "huge": 1e17, "tinier": 1e-300, "huger": 1e300,
                       "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[bad]
        fast, finite = F._swan_update_gram_first(x, cfg, f64, f64)
        if bad in ("nan", "inf", "-inf"):
            assert not bool(finite) and torch.equal(fast, torch.zeros_like(x)), bad
            continue
        want = general(x)
        assert bool(finite) and (fast - want).abs().max() < 1e-10 * want.abs().max(), bad
        if bad == "zero":
            assert torch.equal(fast[:, 2], torch.zeros(16, dtype=f64))
        else:  # the column's own scale is gone: the same update as with a moderate column there
            y = g.clone()
            if bad != "spread":
                y[:, 2] = x[:, 2] / x[:, 2].abs().max()
            ref = F._swan_update_gram_first(y, cfg, f64, f64)[0]
            assert (fast - ref).abs().max() < 1e-10 * ref.abs().max(), bad
    wide = torch.randn(8, 16, generator=gen)
    monkeypatch.setattr(F, "_swan_update_gram_first", lambda *a: pytest.fail("wide matrices take the general path"))
    F._swan_update(wide, WhitenConfig(method=method, steps=steps, beta=beta))


@pytest.fixture(params=["cpu", "accelerator"])
def formulation(request, monkeypatch):
    """Each of the math's two formulations, run on this CPU: its own, and the accelerators' (fp64-accumulated
    norms, one op per pass; ``functional._on_cpu`` False), which otherwise runs only on a GPU."""
    import swan_dist.functional as F

    if request.param == "accelerator":
        monkeypatch.setattr(F, "_on_cpu", lambda t: False)
    return request.param


@pytest.mark.parametrize("shape", [(2, 96, 64), (2, 64, 96), (128, 128)])
def test_the_accelerator_formulation_equals_the_cpu_one(monkeypatch, shape):
    """The accelerators' formulation (run here on the CPU) gives the CPU's update to rounding and flags the
    same matrices, for every preset and GradNorm mode, on moderate, tiny, huge and near-fp32-max gradients,
    subnormal ones (a whole matrix, one column: 1/norm overflows fp32 there, the product does not), zero
    columns and matrices, and NaN/Inf ones (zero updates, flagged); its updates are always finite. (The
    mean-centred GradNorm of a gradient near fp32's max overflows in the centring: flagged, on both.)"""
    import swan_dist.functional as F

    gen = torch.Generator().manual_seed(5)
    g = torch.randn(*shape, generator=gen)
    col = torch.tensor([3])
    cases = {"moderate": g, "tiny": g * 1e-30, "huge": g * 1e30, "near max": g / g.abs().max() * 3e38,
             "subnormal": g * 1e-41, "subnormal column": g.index_copy(-1, col, g[..., 3:4] * 1e-41),
             "zero column": g.index_fill(-1, col, 0.0), "zero": g * 0,
             "nan column": g.index_fill(-1, col, float("nan")), "inf column": g.index_fill(-1, col, float("inf"))}
    cfgs = [WhitenConfig(dtype="float32"), WhitenConfig(dtype="bfloat16"), WhitenConfig(method="ns", steps=10, beta=0.8),
            WhitenConfig(grad_norm="mean", dtype="float32"), WhitenConfig(method="none"),
            WhitenConfig(grad_norm="none", dtype="float32"), WhitenConfig(method="none", grad_norm="none")]
    for name, x in cases.items():
        for cfg in cfgs:
            want, want_ok = swan_update(x, cfg)
            with monkeypatch.context() as m:
                m.setattr(F, "_on_cpu", lambda t: False)
                got, ok = swan_update(x, cfg)
            assert torch.equal(ok, want_ok) and bool(got.isfinite().all()), (name, cfg)
            # mean-centred GradNorm of a near-max gradient: g - mean reaches 2x max, flagged on both
            overflow = name == "near max" and cfg.grad_norm == "mean"
            assert ok.all() == (name not in ("nan column", "inf column") and not overflow), (name, cfg)
            tol = 2e-2 if cfg.dtype == "bfloat16" else 1e-3 if cfg.method == "ns" else 1e-4  # NS: 10 steps' rounding
            rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
            assert rel <= tol, (name, cfg, rel)


def test_the_accelerator_formulation_compiles(monkeypatch):
    """What a GPU runs: the accelerators' formulation through torch.compile (here inductor's CPU code), fp32
    and bf16 whitening, a stack with a subnormal matrix and a NaN one: it compiles (no fallback to eager),
    flags the same matrices and gives the eager update to rounding."""
    import swan_dist.functional as F

    monkeypatch.setenv("SWAN_DIST_COMPILE", "1")
    monkeypatch.setattr(F, "_on_cpu", lambda t: False)
    monkeypatch.setattr(F, "_COMPILED", {})
    monkeypatch.setattr(F, "_COMPILE_STATE", {})
    g = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(9))
    g[1] *= 1e-41
    g[2, 0, 0] = float("nan")
    for cfg, tol in ((WhitenConfig(dtype="float32"), 1e-5), (WhitenConfig(dtype="bfloat16"), 2e-2)):
        got, ok = swan_update(g, cfg)
        assert cfg in F._COMPILED and not F._COMPILE_STATE, F._COMPILE_STATE
        want, want_ok = F._swan_update(g, cfg)
        assert ok.tolist() == want_ok.tolist() == [True, True, False]
        assert torch.equal(got[2], torch.zeros_like(got[2]))
        assert float((got - want).norm() / want.norm()) < tol, cfg
    torch._dynamo.reset()  # nothing compiled here stays for later tests


def _awkward_stack(shape, dtype, gen):
    """A stack of 5 matrices of ``shape``: moderate, with a NaN, all zero, with an Inf, and one whose
    columns span 1e-30..1e30; as ``dtype``."""
    g = torch.randn(5, *shape, generator=gen)
    g[1, 0, 0] = float("nan")
    g[2] = 0
    g[3, -1, -1] = float("-inf")
    g[4] *= torch.logspace(-30, 30, shape[-1])
    return g.to(dtype)


_CFGS = [WhitenConfig(), WhitenConfig(dtype="bfloat16"), WhitenConfig(method="ns", steps=5, beta=0.8),
         WhitenConfig(method="none"), WhitenConfig(grad_norm="mean"), WhitenConfig(grad_norm="none"),
         WhitenConfig(method="none", grad_norm="none"), WhitenConfig(dtype="float64")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_math_reads_no_tensor_value_on_the_host(dtype, formulation):
    """swan_update, grad_norm, whiten and rescale decide everything on the device, on the CPU too: no
    call of torch.Tensor's value-reading methods (item, tolist, bool, nonzero, cpu, int, float, index,
    numpy; tests/host_reads.py), by anyone, for tall (Gram-first), wide and square stacks and single
    matrices with NaN, Inf, zero and extreme inputs, in every whitening dtype and mode. Results still
    right: the non-finite matrices flagged and zero, the others finite."""
    from swan_dist.host_reads import HostReads

    gen = torch.Generator().manual_seed(21)
    inputs = [_awkward_stack(shape, dtype, gen) for shape in [(24, 16), (16, 24), (12, 12), (1, 9), (9, 1)]]
    inputs += [g[0] for g in inputs] + [inputs[0][:1], inputs[1][3]]
    results = []
    with HostReads() as reads:
        for g in inputs:
            for cfg in _CFGS:
                results.append((g, swan_update(g, cfg)))
            grad_norm(g), grad_norm(g, "mean"), rescale(g), whiten(g), whiten(g, "ns", 3, 0.5)
    assert not reads.ours and not reads.others, (reads.ours, reads.others)
    for g, (upd, finite) in results:
        bad = ~torch.isfinite(g.float()).flatten(-2).all(-1)
        assert torch.equal(finite, ~bad) and torch.isfinite(upd).all()
        assert torch.equal(upd[bad], torch.zeros_like(upd[bad]))


def test_fake_tensors_run_the_same_code(formulation):
    """Under FakeTensorMode (shapes and dtypes, no data: a step's memory estimated) swan_update runs the
    code real tensors run (the module has nothing to special-case) and gives the real shapes and dtypes."""
    import inspect

    import swan_dist.functional as F
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    assert "is_fake" not in inspect.getsource(F)
    cases = [((24, 16), torch.float32, WhitenConfig()), ((16, 24), torch.float32, WhitenConfig()),
             ((3, 24, 16), torch.bfloat16, WhitenConfig(dtype="bfloat16")),
             ((2, 16, 24), torch.bfloat16, WhitenConfig()),
             ((4, 12, 12), torch.float32, WhitenConfig(method="ns", steps=4, beta=0.8)),
             ((2, 1, 9, 5), torch.float32, WhitenConfig(method="none")),
             ((9, 5), torch.float64, WhitenConfig(dtype="float64")),
             ((1, 9, 5), torch.float32, WhitenConfig(grad_norm="none"))]
    real = [swan_update(torch.randn(shape).to(dt), cfg) for shape, dt, cfg in cases]
    with FakeTensorMode():
        for (shape, dt, cfg), (r_upd, r_fin) in zip(cases, real):
            upd, finite = swan_update(torch.empty(shape, dtype=dt), cfg)
            assert isinstance(upd, FakeTensor) and isinstance(finite, FakeTensor)
            assert upd.shape == r_upd.shape == shape and upd.dtype == r_upd.dtype, (shape, cfg)
            assert finite.shape == r_fin.shape == shape[:-2] and finite.dtype == torch.bool
            x = torch.empty(shape, dtype=dt)
            assert grad_norm(x).shape == shape and rescale(x).shape == shape


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (16, 16), (3, 24, 16), (3, 16, 24)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_and_column_scales_change_nothing(shape, dtype, formulation):
    """Tall (Gram-first on the CPU), wide and square, single and stacked, fp32 and bf16 iterations: each
    column multiplied by its own power of two from 2^-100 to 2^100 gives bitwise the same update (GradNorm
    removes it, and no rounding sees a power of two); tiny (1e-30) and huge (1e30) gradients, columns
    spread over 1e-30..1e30 and subnormal gradients (1e-40) give the same update as moderate ones."""
    cfg = WhitenConfig(dtype=dtype)
    gen = torch.Generator().manual_seed(31)
    g = torch.randn(*shape, generator=gen)
    base, finite = swan_update(g, cfg)
    assert finite.all()
    k = torch.randint(-100, 101, (shape[-1],), generator=gen)
    up, finite = swan_update(g * torch.exp2(k.float()), cfg)
    assert finite.all() and torch.equal(up, base)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5  # bf16: the scaled gradient rounds to other bf16 values
    for scaled in (g * 1e-30, g * 1e30, g * torch.logspace(-30, 30, shape[-1]), (g.double() * 1e-40).float()):
        up, finite = swan_update(scaled, cfg)
        assert finite.all()
        rel = ((up - base).norm(dim=(-2, -1)) / base.norm(dim=(-2, -1))).max()
        assert rel < tol, float(rel)
    sub = (g.double() * 2.0 ** -140).float()  # subnormal: the same values as a normal matrix, exactly
    torch.testing.assert_close(swan_update(sub, cfg)[0], swan_update((sub.double() * 2.0 ** 140).float(), cfg)[0])


def test_norms_of_extreme_inputs(formulation):
    """rescale and grad_norm: the norms under- and overflow nowhere (huge, tiny, subnormal, spread)."""
    for x in (torch.full((3, 4), 1e30), torch.full((3, 4), 3e38), torch.full((3, 4), 1e-30), torch.full((3, 4), 1e-44),
              torch.randn(2, 5, 6) * torch.logspace(-37, 37, 6)):
        r = rescale(x)
        sqrt_mn = math.sqrt(x.shape[-2] * x.shape[-1])
        torch.testing.assert_close(r.flatten(-2).norm(dim=-1), torch.full(x.shape[:-2], sqrt_mn))
        gn = grad_norm(x)
        torch.testing.assert_close(gn.pow(2).mean(dim=-2), torch.ones(x.shape[:-2] + x.shape[-1:]), rtol=1e-5, atol=1e-5)
    zero = torch.zeros(2, 3)
    assert torch.equal(rescale(zero), zero) and torch.equal(grad_norm(zero), zero)
    bad = torch.ones(2, 3, 4)
    bad[1, 0, 0] = float("inf")
    assert torch.isfinite(rescale(bad)[0]).all() and not torch.isfinite(rescale(bad)[1]).all()


def test_nonfinite_matrices_in_every_path_leave_the_others_alone(formulation):
    """Tall (Gram-first) and wide stacks, bf16 and fp32 gradients and iterations, NS and NSDS: a NaN or
    an Inf zeroes its own matrix's update and clears its flag; the other matrices get what they get alone."""
    gen = torch.Generator().manual_seed(41)
    for shape in [(24, 16), (16, 24)]:
        for dtype in (torch.float32, torch.bfloat16):
            for cfg in (WhitenConfig(), WhitenConfig(dtype="bfloat16"), WhitenConfig(method="ns", steps=5, beta=0.8)):
                g = _awkward_stack(shape, dtype, gen)
                upd, finite = swan_update(g, cfg)
                assert finite.tolist() == [True, False, True, False, True]
                assert torch.equal(upd[[1, 3]], torch.zeros(2, *shape))
                alone, _ = swan_update(g[[0, 2, 4]], cfg)
                torch.testing.assert_close(upd[[0, 2, 4]], alone, atol=1e-6, rtol=1e-5)


def test_inputs_are_never_written(formulation):
    """The fast paths cast and scale in place: only ever their own temporaries, for every input dtype,
    whitening dtype, GradNorm mode and method."""
    for dt in (torch.bfloat16, torch.float32, torch.float64):
        for wdt in ("bfloat16", "float32", "float64"):
            for gn in ("rms", "mean", "none"):
                for method in ("nsds", "ns", "none"):
                    for shape in [(8, 16), (16, 8), (8, 8)]:
                        g = torch.randn(*shape).to(dt)
                        g0 = g.clone()
                        swan_update(g, WhitenConfig(method=method, grad_norm=gn, dtype=wdt))
                        grad_norm(g)
                        rescale(g)
                        assert torch.equal(g, g0), (dt, wdt, gn, method, shape)


def test_gram_from_halves_equals_the_full_gram(monkeypatch):
    """On the CPU a single matrix's Gram at least _GRAM_HALVES_MIN wide is built from three GEMMs on its
    halves: symmetric to rounding (its off-diagonal blocks exactly, one the other's transpose; the GEMM of a
    diagonal block may round its two triangles apart, as this CPU's fp64 GEMM does on an AMD EPYC), equal to
    the full GEMM to rounding (fp64, fp32, bf16, either orientation), and the update through it equals the
    update through the full GEMM."""
    import swan_dist.functional as F

    gen = torch.Generator().manual_seed(51)
    n = F._GRAM_HALVES_MIN
    for dt, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x = torch.randn(n + 77, n + 6, generator=gen).to(dt)
        for v in (x, x.mT):  # the whitening's x xᵀ and the Gram-first path's gᵀg
            got = F._gram(v)
            assert got.shape == (v.shape[0], v.shape[0]) and got.dtype == dt
            h = v.shape[0] // 2
            assert torch.equal(got[h:, :h], got[:h, h:].mT)
            want = v @ v.mT
            assert (got.double() - want.double()).abs().max() <= tol * want.double().abs().max()
            assert (got.double() - got.double().mT).abs().max() <= tol * want.double().abs().max()
    g = torch.randn(n + 77, n + 6, generator=gen)
    halves = [swan_update(v, WhitenConfig(dtype="float32"))[0] for v in (g, g.mT)]
    monkeypatch.setattr(F, "_GRAM_HALVES_MIN", 1 << 30)
    for got, v in zip(halves, (g, g.mT)):
        torch.testing.assert_close(got, swan_update(v, WhitenConfig(dtype="float32"))[0], atol=1e-5, rtol=1e-5)
