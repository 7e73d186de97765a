"""CRF and SparseMAP chain marginals: every backend against brute-force enumeration.

The oracles enumerate all 2^L configurations of a row (L <= 8): the CRF marginals are the
softmax-weighted mean of the configurations (autograd through it gives the oracle's
gradient), SparseMAP is the QP over the configurations' convex hull, solved by scipy's SLSQP
and then polished on its support by the closed-form KKT solution, accepted only with a
Frank-Wolfe gap below 1e-13 (a certificate: ½‖μ − μ*‖² <= gap). The reference solves
SparseMAP by an active set with a Viterbi oracle, the C++ operators by the chain's
reduction to a TV prox: three different routes.
"""
import itertools
import math

import numpy as np
import pytest
import torch

import entmax_fast
from entmax_fast import chain as C
from entmax_fast import dispatch
from entmax_fast.reference import chain as R

NEG_INF = float("-inf")


def _has_cpp() -> bool:
    ok, _ = dispatch.availability("cpp")
    return ok and hasattr(torch.ops.entmax_fast, "crf_forward")


HAS_CPP = _has_cpp()
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="entmax_fast._C has no chain operators")
BACKENDS = [pytest.param("reference", id="reference"), pytest.param("cpp", marks=needs_cpp, id="cpp")]
KINDS = ["crf", "sparsemap"]


def public(kind):
    return C.crf_marginals if kind == "crf" else C.sparsemap_marginals


def reference(kind):
    return R.crf_marginals if kind == "crf" else R.sparsemap_marginals


def run(kind, backend, scores, transitions, dim=-1):
    with dispatch.use_backend(backend):
        out = public(kind)(scores, transitions, dim=dim)
    assert dispatch.last_choice(kind).backend == backend
    return out


# ---------------------------------------------------------------------------------------
# Oracles: brute-force enumeration.

def configurations(L: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product([0, 1], repeat=L)), dtype=torch.float64).reshape(-1, L)


def configuration_scores(Z: torch.Tensor, s: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    theta = Z @ s
    for j in range(1, Z.shape[1]):
        theta = theta + T[Z[:, j - 1].long(), Z[:, j].long()]
    return theta


def oracle_crf(s: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """CRF marginals of one row by enumeration; differentiable in s and T."""
    Z = configurations(s.shape[0])
    return torch.softmax(configuration_scores(Z, s, T), dim=0) @ Z


def oracle_sparsemap(s: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """SparseMAP of one row: the QP over the configurations' hull, certified."""
    import scipy.optimize

    Z = configurations(s.shape[0])
    theta = configuration_scores(Z, s, T).numpy()
    Zn = Z.numpy()
    K = len(Zn)
    objective = lambda x: -(theta @ x - 0.5 * np.sum((Zn.T @ x) ** 2))  # noqa: E731
    gradient = lambda x: -(theta - Zn @ (Zn.T @ x))  # noqa: E731
    result = scipy.optimize.minimize(objective, np.full(K, 1.0 / K), jac=gradient, method="SLSQP",
                                     bounds=[(0, 1)] * K, options={"ftol": 1e-16, "maxiter": 2000},
                                     constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1,
                                                   "jac": lambda x: np.ones(K)}])
    support = np.flatnonzero(result.x > 1e-7)
    M = Zn[support].T
    k = len(support)
    kkt = np.block([[M.T @ M, np.ones((k, 1))], [np.ones((1, k)), np.zeros((1, 1))]])
    solution = np.linalg.lstsq(kkt, np.concatenate([theta[support], [1.0]]), rcond=None)[0]
    weights = np.zeros(K)
    weights[support] = solution[:k]
    if weights.min() < 0:  # the polish left the simplex: keep SLSQP's point
        weights = np.clip(result.x, 0, None) / np.clip(result.x, 0, None).sum()
    mu = Zn.T @ weights
    gap = float(np.max(theta - Zn @ mu) - (theta @ weights - mu @ mu))
    assert gap < 1e-13, f"oracle not certified: Frank-Wolfe gap {gap}"
    return torch.from_numpy(mu)


def random_case(L: int, seed: int, scale: float = 1.5):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(L, generator=gen, dtype=torch.float64) * scale
    T = torch.randn(2, 2, generator=gen, dtype=torch.float64) * scale
    return s, T


# ---------------------------------------------------------------------------------------
# Against enumeration.

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L", [1, 2, 3, 5, 8])
def test_crf_matches_enumeration(backend, L):
    for seed in range(6):
        s, T = random_case(L, seed)
        torch.testing.assert_close(run("crf", backend, s, T), oracle_crf(s, T), atol=1e-9, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L", [1, 2, 3, 5, 7, 8])
def test_sparsemap_matches_enumeration(backend, L):
    # The oracle's SLSQP over 2^L weights takes seconds at L = 8: fewer cases there.
    for seed in range({7: 3, 8: 2}.get(L, 8)):
        s, T = random_case(L, 100 + seed)
        torch.testing.assert_close(run("sparsemap", backend, s, T), oracle_sparsemap(s, T), atol=1e-6, rtol=0)


def test_sparsemap_oracle_is_sound():
    # The oracle certifies itself; here it also meets the T = 0 closed form, and a
    # configuration whose scores dominate (a vertex of the hull) is returned as it is.
    s, _ = random_case(6, 7)
    torch.testing.assert_close(oracle_sparsemap(s, torch.zeros(2, 2, dtype=torch.float64)), s.clamp(0, 1),
                               atol=1e-9, rtol=0)
    z = torch.tensor([1.0, 0, 0, 1, 1, 0], dtype=torch.float64)
    torch.testing.assert_close(oracle_sparsemap(10 * (2 * z - 1), torch.zeros(2, 2, dtype=torch.float64)), z)


@pytest.mark.parametrize("L", [2, 4, 7])
def test_crf_gradients_match_autograd_of_enumeration(L):
    for seed in range(4):
        s, T = random_case(L, 200 + seed)
        grad = torch.randn(L, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        expected = torch.autograd.grad(oracle_crf(s.requires_grad_(), T.requires_grad_()), (s, T), grad)
        for backend in ("reference", "cpp") if HAS_CPP else ("reference",):
            s2, T2 = s.detach().requires_grad_(), T.detach().requires_grad_()
            got = torch.autograd.grad(run("crf", backend, s2, T2), (s2, T2), grad)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, atol=1e-9, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L", [2, 4, 5])
def test_sparsemap_gradients_match_finite_differences(backend, L):
    # Central differences of the oracle (each perturbed QP solved and certified afresh); the
    # map is piecewise linear, so a step of 1e-5 is exact unless it crosses a kink, which the
    # random cases here do not reach (checked: every active set is the same on both sides).
    eps = 1e-5
    for seed in range(3):
        s, T = random_case(L, 300 + seed)
        grad = torch.randn(L, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        s2, T2 = s.clone().requires_grad_(), T.clone().requires_grad_()
        ds, dT = torch.autograd.grad(run("sparsemap", backend, s2, T2), (s2, T2), grad)
        for tensor, analytic in ((s, ds), (T, dT)):
            numeric = torch.zeros_like(tensor)
            flat = tensor.view(-1)
            for i in range(flat.numel()):
                saved = float(flat[i])
                flat[i] = saved + eps
                plus = float(grad @ oracle_sparsemap(s, T))
                flat[i] = saved - eps
                minus = float(grad @ oracle_sparsemap(s, T))
                flat[i] = saved
                numeric.view(-1)[i] = (plus - minus) / (2 * eps)
            torch.testing.assert_close(analytic, numeric, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind, backend):
    gen = torch.Generator().manual_seed(5)
    s = (torch.randn(3, 7, generator=gen, dtype=torch.float64) * 1.5).requires_grad_()
    s.data[1, 2] = NEG_INF
    T = (torch.randn(3, 2, 2, generator=gen, dtype=torch.float64)).requires_grad_()

    def fn(scores, transitions):
        with dispatch.use_backend(backend):
            return public(kind)(scores, transitions)

    # The masked entry has no gradient to check: perturb only the finite ones.
    mask = torch.isfinite(s.detach())
    finite = s.detach()[mask].clone().requires_grad_()

    def on_finite(values, transitions):
        full = s.detach().masked_scatter(mask, values)
        return fn(full, transitions)

    assert torch.autograd.gradcheck(on_finite, (finite, T))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_transitions_reduce_to_sigmoid_and_clip(backend):
    gen = torch.Generator().manual_seed(9)
    s = torch.randn(5, 33, generator=gen, dtype=torch.float64) * 2
    zero = torch.zeros(2, 2, dtype=torch.float64)
    torch.testing.assert_close(run("crf", backend, s, zero), torch.sigmoid(s), atol=1e-12, rtol=0)
    torch.testing.assert_close(run("sparsemap", backend, s, zero), s.clamp(0, 1), atol=1e-12, rtol=0)
    # A constant added to every entry of T changes nothing (it adds the same to every θ(z)).
    T = torch.randn(2, 2, generator=gen, dtype=torch.float64)
    for kind in KINDS:
        torch.testing.assert_close(run(kind, backend, s, T + 3.0), run(kind, backend, s, T), atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------------
# SparseMAP at w = T00 + T11 − T01 − T10 = 0: a kink in w.

W_DIRECTION = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)  # ∂w/∂T; T + (h/4)·it moves w by h
AT_ZERO_W = [torch.zeros(2, 2, dtype=torch.float64),
             torch.tensor([[0.25, 0.5], [-0.25, 0.0]], dtype=torch.float64),  # into/outof terms ≠ 0
             torch.tensor([[1.0, 0.75], [0.0, -0.25]], dtype=torch.float64)]


def least_magnitude(left: float, right: float) -> float:
    low, high = min(left, right), max(left, right)
    return low if low > 0 else (high if high < 0 else 0.0)


def one_sided_w_derivatives(s, T, g, h=2.0 ** -20):
    """(D−, D+) of g·μ in w at T by one-sided differences of the reference forward (the map is
    piecewise linear in w on each side; the cases' gaps of 1/64 put its first breakpoints
    far beyond h)."""
    def loss(t):
        return float(g @ R.sparsemap_marginals(s, t))

    base = loss(T)
    return (base - loss(T - h / 4 * W_DIRECTION)) / h, (loss(T + h / 4 * W_DIRECTION) - base) / h


def w_part(dT: torch.Tensor) -> float:
    """The w-component of a transitions gradient (the other directions are orthogonal to it)."""
    return float((dT * W_DIRECTION).sum() / 4)


def kink_cases(rows=24, L=8, seed=40, clip_edges=True):
    """Rows of scores on a 1/64 grid (exact ties between neighbours, ties after the flip
    c_j + c_{j+1} = 1, and with ``clip_edges`` values exactly 0 and 1; without, the grid
    is shifted by 1/128, which no edge term (multiples of 1/4) brings to 0 or 1), each
    with its own transitions at w = 0."""
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randint(-16, 81, (rows, L), generator=gen).to(torch.float64) + (0.0 if clip_edges else 0.5)) / 64
    s[0, 2:5] = 0.5 + (0.0 if clip_edges else 1 / 128)  # a tied run
    s[1, 3], s[1, 4] = 0.25 + 1 / 128, 0.75 - 1 / 128  # tied once flipped
    if clip_edges:
        s[2, 1], s[3, 4] = 0.0, 1.0
    s[4, 2] = NEG_INF  # its neighbours become adjacent
    T = torch.stack([AT_ZERO_W[r % len(AT_ZERO_W)] for r in range(rows)])
    g = torch.randint(-4, 5, (rows, L), generator=gen).to(torch.float64)
    return s, T, g


def test_sparsemap_w_kink_check_values():
    # Two keys, T = 0: w > 0 moves ν = (0.3 + λ, 0.6 − λ); w < 0 flips the second key, ν = (0.3, 0.4)
    # moves alike, so μ = (0.3 + λ, 0.6 + λ). D+ = (g1 − g2)/2, D− = −(g1 + g2)/2.
    s = torch.tensor([0.3, 0.6], dtype=torch.float64)
    zero = torch.zeros(2, 2, dtype=torch.float64)
    assert R.sparsemap_rates_at_zero(s.tolist(), zero.tolist(), False) == [1.0, -1.0]
    assert R.sparsemap_rates_at_zero(s.tolist(), zero.tolist(), True) == [1.0, 1.0]
    # (g, dL/dw): a kink minimum (0), a smooth direction, one-sided values of one sign.
    for g, expected in (((1.0, 0.0), 0.0), ((2.0, 1.0), 0.0), ((0.0, 1.0), -0.5), ((1.0, 3.0), -1.0),
                        ((-1.0, -3.0), 1.0)):
        for backend in [b.values[0] for b in BACKENDS if not b.marks or HAS_CPP]:
            T = zero.clone().requires_grad_()
            (dT,) = torch.autograd.grad(run("sparsemap", backend, s, T), T, torch.tensor(g, dtype=torch.float64))
            assert w_part(dT) == pytest.approx(expected, abs=1e-12), (backend, g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparsemap_gradient_at_zero_w_is_the_least_one_sided_derivative(backend):
    s, T, g = kink_cases()
    T_grad = T.clone().requires_grad_()
    (dT,) = torch.autograd.grad(run("sparsemap", backend, s, T_grad), T_grad, g)
    straddling = one_signed = 0
    for r in range(s.shape[0]):
        left, right = one_sided_w_derivatives(s[r], T[r], g[r])
        expected = least_magnitude(left, right)
        assert w_part(dT[r]) == pytest.approx(expected, abs=1e-6), (r, left, right)
        straddling += min(left, right) < -0.1 and max(left, right) > 0.1
        one_signed += abs(expected) > 0.1
    assert straddling >= 3 and one_signed >= 3  # both kinds of rows are exercised


@needs_cpp
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sparsemap_at_zero_w_cpp_matches_reference(dtype, atol):
    # Without scores at the clip's edges, where the two routes take different one-sided
    # derivatives in s (a kink of clip, not of w).
    s, T, g = kink_cases(rows=30, L=9, seed=41, clip_edges=False)
    s, T, g = s.to(dtype), T.to(dtype), g.to(dtype)
    grads = {}
    for backend in ("reference", "cpp"):
        s_grad, T_grad = s.clone().requires_grad_(), T.clone().requires_grad_()
        grads[backend] = torch.autograd.grad(run("sparsemap", backend, s_grad, T_grad), (s_grad, T_grad), g)
    for cpp, ref in zip(grads["cpp"], grads["reference"]):
        torch.testing.assert_close(cpp, ref, atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------
# Backends against the reference, masks, shapes.

def ragged(rows: int, n: int, dtype, seed: int, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randn(rows, n, generator=gen, dtype=torch.float64) * scale)
    s = s.masked_fill(torch.rand(rows, n, generator=gen) < 0.2, NEG_INF)
    s[min(1, rows - 1)] = NEG_INF
    T = torch.randn(rows, 2, 2, generator=gen, dtype=torch.float64) * scale
    T[0] = torch.tensor([[0.3, -1.0], [-1.0, 1.5]])  # attractive: w > 0
    T[-1] = torch.tensor([[0.0, 1.0], [1.2, -0.5]])  # repulsive: w < 0
    return s.to(dtype), T.to(dtype)


@needs_cpp
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 7, 64, 257])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_cpp_matches_reference_forward_backward(kind, n, dtype, atol):
    s, T = ragged(9, n, dtype, seed=n)
    grad = torch.randn(9, n, dtype=dtype)
    s_cpp, T_cpp = s.clone().requires_grad_(), T.clone().requires_grad_()
    out = run(kind, "cpp", s_cpp, T_cpp)
    out.backward(grad)
    s_ref, T_ref = s.double().requires_grad_(), T.double().requires_grad_()
    expected = reference(kind)(s_ref, T_ref)
    expected.backward(grad.double())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    torch.testing.assert_close(s_cpp.grad.double(), s_ref.grad, atol=atol * 10, rtol=1e-4 if dtype == torch.float32 else 0)
    T_expected = torch.zeros_like(T_ref) if T_ref.grad is None else T_ref.grad  # n = 1: no edge uses T
    torch.testing.assert_close(T_cpp.grad.double(), T_expected, atol=atol * 10 * n, rtol=1e-4 if dtype == torch.float32 else 0)


@needs_cpp
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 1e-6)])
def test_crf_rows_run_together_match_enumeration(dtype, atol):
    # The CPU forward runs rows with no masked entry several at a time: plain rows among
    # masked ones, a row count that leaves a remainder, one transition matrix per row, and
    # a row whose messages need rescaling (scores of ~100), each against the oracle.
    gen = torch.Generator().manual_seed(5)
    rows, L = 11, 8
    s = torch.randn(rows, L, generator=gen, dtype=torch.float64) * 1.5
    s[5] *= 100
    s[2, 3] = s[7, 0] = NEG_INF
    T = torch.randn(rows, 2, 2, generator=gen, dtype=torch.float64) * 1.5
    s, T = s.to(dtype), T.to(dtype)
    out = run("crf", "cpp", s, T)
    assert out.dtype == dtype
    for i in range(rows):
        keep = s[i] != NEG_INF
        expected = torch.zeros(L, dtype=torch.float64)
        expected[keep] = oracle_crf(s[i, keep].double(), T[i].double())
        torch.testing.assert_close(out[i].double(), expected, atol=atol, rtol=0)


@pytest.fixture(params=["auto", "portable"])
def kernel_isa(request):
    """The CPU kernel set the C++ operators use: AVX2+FMA where the CPU has it ("auto"), and
    the baseline ISA's, forced (both are compiled on x86-64)."""
    active = torch.ops.entmax_fast.cpu_kernel_isa(request.param)
    yield active
    torch.ops.entmax_fast.cpu_kernel_isa("auto")


def _rows_and_oracle_gradients(s, T, grad):
    """Per row, the oracle's marginals and gradients (ds, dT) for the incoming ``grad``
    (masked positions: weight and gradient 0)."""
    rows, L = s.shape
    mu, ds, dT = (torch.zeros(rows, L, dtype=torch.float64), torch.zeros(rows, L, dtype=torch.float64),
                  torch.zeros(rows, 2, 2, dtype=torch.float64))
    for i in range(rows):
        keep = s[i] != NEG_INF
        if not keep.any():  # an empty chain: zeros
            continue
        s_i, T_i = s[i, keep].double().requires_grad_(), T[i].double().requires_grad_()
        out = oracle_crf(s_i, T_i)
        mu[i, keep] = out.detach()
        ds_i, dT_i = torch.autograd.grad(out, (s_i, T_i), grad[i, keep].double(), allow_unused=True)
        ds[i, keep] = ds_i
        if dT_i is not None:  # a single key: no edge uses T
            dT[i] = dT_i
    return mu, ds, dT


@needs_cpp
@pytest.mark.parametrize("L", [1, 2, 7, 8])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_crf_rows_run_together_backward_matches_enumeration(kernel_isa, L, dtype, atol):
    # The CPU operators run rows with no masked entry four at a time, one SIMD lane per row,
    # the rows moved in blocks of 4 keys (L = 7: a block and a remainder): 19 rows (four
    # groups of 4 and a remainder) with a masked row and a NaN row among them, one
    # transition matrix per row, a row whose messages need rescaling (scores of ~100); every
    # row's marginals and gradients against the oracle's. float32: the operator's float64 arithmetic rounded to float32 at the end,
    # gradients of at most ~2 here (|g| <= 3, variances <= 1/4 over <= 8 keys).
    gen = torch.Generator().manual_seed(17 + L)
    rows = 19
    s = torch.randn(rows, L, generator=gen, dtype=torch.float64) * 1.5
    s[5] *= 100
    s[2, L - 1] = NEG_INF
    T = torch.randn(rows, 2, 2, generator=gen, dtype=torch.float64) * 1.5
    grad = torch.randn(rows, L, generator=gen, dtype=torch.float64)
    s, T, grad = s.to(dtype), T.to(dtype), grad.to(dtype)
    poisoned = s.clone()
    poisoned[11, 0] = float("nan")
    s_cpp, T_cpp = poisoned.clone().requires_grad_(), T.clone().requires_grad_()
    out = run("crf", "cpp", s_cpp, T_cpp)
    out.backward(grad)
    assert out.dtype == dtype and s_cpp.grad.dtype == dtype
    assert torch.isnan(out[11]).all() and torch.isnan(s_cpp.grad[11]).all() and torch.isnan(T_cpp.grad[11]).all()
    keep = torch.arange(rows) != 11
    mu, ds, dT = _rows_and_oracle_gradients(s[keep], T[keep], grad[keep])
    torch.testing.assert_close(out[keep].double(), mu, atol=atol, rtol=0)
    torch.testing.assert_close(s_cpp.grad[keep].double(), ds, atol=atol, rtol=0)
    torch.testing.assert_close(T_cpp.grad[keep].double(), dT, atol=atol * L, rtol=0)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_crf_long_rows_with_rescaling_match_reference(kernel_isa, dtype):
    # Rows of 2999 keys, all valid (the CPU operators' four-rows-at-a-time paths), with
    # transitions of up to ~±60: exp(T − max T) falls to e^-100 and below, so the messages
    # are rescaled every few keys. Against the log-space reference in float64.
    # float64: dx to 1e-9. dT to 1e-7: the semiring's tangents carry E[g·z | prefix], so a
    # near-deterministic chain sums pair terms of size ~n·|E[g·z]| ~ 1e5 whose difference is
    # dT, each with ~n·eps relative rounding (with 3000 keys, row 9 here was 1.2e-8 off by
    # both the one-row path and the lanes). float32 inputs: the same float64 arithmetic, rounded once to float32.
    gen = torch.Generator().manual_seed(23)
    rows, n = 13, 2999
    s = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 3
    T = torch.randn(rows, 2, 2, generator=gen, dtype=torch.float64) * 20
    T[0] = torch.tensor([[0.0, -50.0], [-60.0, 40.0]])
    grad = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    s_cpp, T_cpp = s.to(dtype).clone().requires_grad_(), T.to(dtype).clone().requires_grad_()
    out = run("crf", "cpp", s_cpp, T_cpp)
    out.backward(grad.to(dtype))
    s_ref, T_ref = s.to(dtype).double().clone().requires_grad_(), T.to(dtype).double().clone().requires_grad_()
    expected = R.crf_marginals(s_ref, T_ref)
    expected.backward(grad.to(dtype).double())
    if dtype == torch.float64:
        atol, rtol, atol_transitions = 1e-9, 0.0, 1e-7
    else:
        atol, rtol, atol_transitions = 1e-6, 1e-6, 1e-6
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    torch.testing.assert_close(s_cpp.grad.double(), s_ref.grad, atol=atol, rtol=rtol)
    torch.testing.assert_close(T_cpp.grad.double(), T_ref.grad, atol=atol_transitions, rtol=rtol)


@needs_cpp
@pytest.mark.parametrize("rows", [1, 3, 5, 7, 9, 13])
@pytest.mark.parametrize("L", [15, 16, 17, 47, 700])
def test_crf_lanes_blocks_and_late_rescales_match_reference(kernel_isa, rows, L):
    # The CPU lanes run each sweep in blocks of 16 keys, first with a cheap test of whether a
    # message fell low and again from the block's start with the rescale test at every step
    # where it did; the sweep's later blocks then rescale-test at every step (AVX2 kernels;
    # the portable ones test at every step, in the same blocks). Here: block
    # boundaries (L = 15, 16, 17, 47, 700), row counts that leave each remainder of the groups
    # of 4 (1 and 3: every row alone), and in the first group a row that needs rescaling only
    # from 3/5 of its length (scores of ±300 alternating against transitions that favour
    # agreement by 150: its messages fall by ~e^-150 a key there and would underflow within
    # 5 keys unrescaled; its first blocks run once, one block twice, the rest tested at every
    # step, in both sweeps) and a row that rescales every few keys from the start (transitions
    # of ~±30); a NaN row (from 7 rows) and a masked row (from 6), run alone. float64 against
    # the log-space reference; dT as in the long rows above.
    gen = torch.Generator().manual_seed(1000 * rows + L)
    s = torch.randn(rows, L, generator=gen, dtype=torch.float64)
    T = torch.randn(rows, 2, 2, generator=gen, dtype=torch.float64)
    grad = torch.randn(rows, L, generator=gen, dtype=torch.float64)
    late = L * 3 // 5
    s[0, late:] = 300 * torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(L)[: L - late]
    T[0] = torch.tensor([[0.0, -150.0], [-150.0, 0.0]])
    if rows > 1:
        T[1] *= 30
    if rows >= 6:
        s[rows - 1, L // 2] = NEG_INF
    nan_row = 2 if rows >= 7 else None
    poisoned = s.clone()
    if nan_row is not None:
        poisoned[nan_row, L // 3] = float("nan")
    s_cpp, T_cpp = poisoned.clone().requires_grad_(), T.clone().requires_grad_()
    out = run("crf", "cpp", s_cpp, T_cpp)
    out.backward(grad)
    keep = torch.ones(rows, dtype=torch.bool)
    if nan_row is not None:
        assert torch.isnan(out[nan_row]).all() and torch.isnan(s_cpp.grad[nan_row]).all()
        keep[nan_row] = False
    s_ref, T_ref = s[keep].clone().requires_grad_(), T[keep].clone().requires_grad_()
    expected = R.crf_marginals(s_ref, T_ref)
    expected.backward(grad[keep])
    torch.testing.assert_close(out[keep], expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(s_cpp.grad[keep], s_ref.grad, atol=1e-9, rtol=0)
    torch.testing.assert_close(T_cpp.grad[keep], T_ref.grad, atol=1e-7, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_masked_positions_equal_removing_them(kind, backend):
    gen = torch.Generator().manual_seed(11)
    s = torch.randn(12, generator=gen, dtype=torch.float64) * 2
    T = torch.randn(2, 2, generator=gen, dtype=torch.float64)
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    out = run(kind, backend, s.masked_fill(~keep, NEG_INF), T)
    assert (out[~keep] == 0).all()
    torch.testing.assert_close(out[keep], run(kind, backend, s[keep], T), atol=1e-12, rtol=0)
    empty = run(kind, backend, torch.full((3,), NEG_INF, dtype=torch.float64), T)
    assert (empty == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_dim_and_transitions_broadcast(kind, backend):
    gen = torch.Generator().manual_seed(12)
    s = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64)
    T = torch.randn(2, 3, 2, 2, generator=gen, dtype=torch.float64)  # one per (batch, column) row
    out = run(kind, backend, s, T, dim=1)
    for b in range(2):
        for c in range(3):
            torch.testing.assert_close(out[b, :, c], run(kind, backend, s[b, :, c], T[b, c]), atol=1e-12, rtol=0)
    shared = torch.randn(2, 2, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(run(kind, backend, s, shared, dim=1),
                               run(kind, backend, s, shared.expand(2, 3, 2, 2), dim=1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computed_in_float32(kind, dtype, backend):
    s = torch.randn(3, 9).to(dtype)
    T = torch.randn(2, 2).to(dtype)
    out = run(kind, backend, s, T)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference(kind)(s.double(), T.double()).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_or_posinf_gives_a_nan_row(kind, backend):
    s = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    T = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    bad = s.detach().clone()
    bad[0, 2] = float("nan")
    bad[2, 4] = float("inf")
    bad.requires_grad_()
    out = run(kind, backend, bad, T)
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()
    torch.testing.assert_close(out[1], run(kind, backend, s.detach()[1], T.detach()), atol=1e-12, rtol=0)
    out.nan_to_num(0.0).sum().backward()
    # A poisoned row's gradient is NaN (softmax's rule); the other rows' are untouched.
    assert torch.isfinite(bad.grad[1]).all() and torch.isnan(bad.grad[0]).all() and torch.isnan(bad.grad[2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_large_scores_and_transitions(kind, backend):
    s = torch.tensor([[300.0, -400.0, 250.0, 1e4, -1e4, 0.2]], dtype=torch.float64)
    T = torch.tensor([[0.0, -50.0], [-60.0, 40.0]], dtype=torch.float64)
    out = run(kind, backend, s, T)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(kind)(s, T), atol=1e-9, rtol=0)
    s32 = torch.tensor([[3e37, -3e37, 1.0]], dtype=torch.float32)
    out32 = run(kind, backend, s32, torch.zeros(2, 2))
    torch.testing.assert_close(out32, torch.tensor([[1.0, 0.0, 0.7311 if kind == "crf" else 1.0]]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_empty_inputs(kind, backend):
    for shape in ((0, 5), (3, 0)):
        s = torch.randn(shape, requires_grad=True)
        T = torch.randn(2, 2, requires_grad=True)
        out = run(kind, backend, s, T)
        assert out.shape == shape
        out.sum().backward()
        assert s.grad.shape == shape and torch.equal(T.grad, torch.zeros(2, 2))


def test_sparsemap_is_sparse_with_spans():
    gen = torch.Generator().manual_seed(13)
    s = torch.randn(64, 200, generator=gen, dtype=torch.float64)
    attractive = torch.tensor([[0.0, -0.5], [-0.5, 0.5]], dtype=torch.float64)
    out = C.sparsemap_marginals(s, attractive)
    clipped = C.sparsemap_marginals(s, torch.zeros(2, 2, dtype=torch.float64))
    # T = 0 is clip(s, 0, 1): exactly 0 below 0 and exactly 1 above 1, as counted directly.
    exact = lambda mu: ((mu == 0) | (mu == 1)).double().mean()  # noqa: E731
    assert exact(clipped) == ((s <= 0) | (s >= 1)).double().mean()
    # The attractive chain fuses neighbours into groups whose values are means of their
    # inputs: fewer exact 0s and 1s than clip (0.29 of the weights here, against 0.66), still
    # many; and far fewer changes of value along the chain.
    assert 0.2 < exact(out) < exact(clipped)
    changes = lambda mu: (mu[:, 1:] != mu[:, :-1]).double().mean()  # noqa: E731
    assert changes(out) < 0.5 * changes(clipped)


def test_public_names():
    for name in ("crf_marginals", "sparsemap_marginals", "crf_attention", "sparsemap_attention"):
        assert name in entmax_fast.__all__ and callable(getattr(entmax_fast, name))
    assert set(dispatch.registered_ops()["crf"]) >= {"reference"}
    assert set(dispatch.registered_ops()["sparsemap"]) >= {"reference"}


# ---------------------------------------------------------------------------------------
# Bad input.

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_errors(kind, backend):
    fn = public(kind)
    name = f"{kind}_marginals"
    s = torch.randn(2, 4)
    T = torch.zeros(2, 2)
    with dispatch.use_backend(backend):
        with pytest.raises(TypeError, match=f"{name}: scores must have a floating-point dtype"):
            fn(torch.ones(2, 4, dtype=torch.int64), T)
        with pytest.raises(TypeError, match=f"{name}: scores must be a torch.Tensor"):
            fn([1.0, 2.0], T)
        with pytest.raises(ValueError, match=f"{name}: scores must have at least 1 dimension"):
            fn(torch.tensor(1.0), T)
        with pytest.raises(TypeError, match=f"{name}: transitions must be a torch.Tensor"):
            fn(s, [[0.0, 0.0], [0.0, 0.0]])
        with pytest.raises(TypeError, match=f"{name}: transitions must have a floating-point dtype"):
            fn(s, torch.zeros(2, 2, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"transitions must have shape \(2, 2\) or one broadcastable to the rows' "
                                             r"batch shape \+ \(2, 2\) = \(2, 2, 2\), got \(3, 3\)"):
            fn(s, torch.zeros(3, 3))
        with pytest.raises(ValueError, match=r"got \(3, 2, 2\)"):
            fn(s, torch.zeros(3, 2, 2))
        with pytest.raises(ValueError, match=r"got \(1, 2, 2, 2\)"):
            fn(s, torch.zeros(1, 2, 2, 2))
        with pytest.raises(ValueError, match=f"{name}: transitions must be finite"):
            fn(s, torch.tensor([[0.0, float("nan")], [0.0, 0.0]]))
        with pytest.raises(ValueError, match=f"{name}: transitions must be finite"):
            fn(s, torch.tensor([[0.0, 0.0], [float("inf"), 0.0]]))
        with pytest.raises(IndexError, match=r"dim must be in \[-2, 1\]"):
            fn(s, T, dim=2)
        with pytest.raises(TypeError, match="dim must be an int, got float"):
            fn(s, T, dim=1.0)
        with pytest.raises(ValueError, match="transitions must be on the scores' device"):
            fn(s, torch.zeros(2, 2, device="meta"))
