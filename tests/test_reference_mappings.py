"""The reference mappings against the float64 oracle, invariants, exact sort vs root finding,
gradients (gradcheck for X and α) and the `entmax` 1.3 package as a second opinion."""
import math

import entmax as entmax_pkg
import pytest
import torch

from entmax_fast.reference.mappings import (entmax15_threshold, entmax_backward, entmax_forward,
                                            entmax_threshold_root, sparsemax_threshold)
from oracle import oracle_entmax

ALPHAS = [pytest.param(a, id=f"alpha={a}") for a in (0.5, 1.0, 1.25, 1.5, 2.0, 3.0)]
SHAPES = [pytest.param(s, id="x".join(map(str, s))) for s in ((1, 1), (3, 2), (7, 63), (4, 1000), (2, 5000))]
# dtype, atol vs the float64 oracle
DTYPES = [pytest.param(torch.float64, 1e-12, id="f64"), pytest.param(torch.float32, 2e-6, id="f32"),
          pytest.param(torch.float16, 2e-6, id="f16"), pytest.param(torch.bfloat16, 2e-6, id="bf16")]


def _scores(shape, scale=2.0, dtype=torch.float64):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_float64_oracle(alpha, shape):
    X = _scores(shape)
    torch.testing.assert_close(entmax_forward(X, alpha), oracle_entmax(X, alpha), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_low_precision_inputs_are_computed_in_fp32(dtype, atol, alpha):
    X = _scores((6, 300), dtype=dtype)
    p = entmax_forward(X, alpha)
    assert p.dtype == dtype
    # The input is rounded to `dtype` first; the oracle sees the same rounded values.
    expected = oracle_entmax(X.to(torch.float64), alpha)
    rounding = 0 if dtype == torch.float64 else torch.finfo(dtype).eps
    torch.testing.assert_close(p.to(torch.float64), expected, atol=atol + rounding, rtol=rounding)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_sums_to_one_nonnegative_and_shift_invariant(alpha):
    X = _scores((5, 77))
    p = entmax_forward(X, alpha)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(entmax_forward(X + 123.25, alpha), p, atol=1e-11, rtol=0)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_neg_inf_columns_equal_slicing_them_off(alpha):
    X = _scores((4, 40))
    masked = torch.zeros(40, dtype=torch.bool)
    masked[::3] = True
    X_masked = X.masked_fill(masked, -math.inf)
    p = entmax_forward(X_masked, alpha)
    assert (p[:, masked] == 0).all()
    torch.testing.assert_close(p[:, ~masked], entmax_forward(X[:, ~masked], alpha), atol=1e-13, rtol=0)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_fully_masked_rows_give_zeros_and_zero_gradients(alpha, dtype):
    X = _scores((3, 9), dtype=dtype)
    X[1] = -math.inf
    p = entmax_forward(X, alpha)
    assert not p.isnan().any()
    assert (p[1] == 0).all()
    dX, dalpha = entmax_backward(p, torch.randn(3, 9, dtype=torch.float64).to(dtype), alpha)
    assert not dX.isnan().any() and not dalpha.isnan().any()
    assert (dX[1] == 0).all() and dalpha[1].item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_extreme_scores_never_nan(dtype, alpha):
    X = _scores((4, 64), dtype=torch.float32)
    cases = [X - 1000, X * 1e4, torch.full_like(X, 6e4 if dtype == torch.float16 else 1e4)]
    for case in cases:
        case = case.to(dtype)
        p = entmax_forward(case, alpha)
        assert not p.isnan().any()
        torch.testing.assert_close(p.float().sum(-1), torch.ones(4), atol=1e-2, rtol=0)


def test_peaked_rows_at_alpha_3():
    X = torch.zeros(2, 50, dtype=torch.float32)
    X[:, 0] = 1e4
    p = entmax_forward(X, 3.0)
    assert not p.isnan().any()
    torch.testing.assert_close(p[:, 0], torch.ones(2))


def test_sort_thresholds_agree_with_root_finding():
    X = _scores((20, 333))
    for alpha, threshold in ((2.0, sparsemax_threshold), (1.5, entmax15_threshold)):
        tau, support = threshold(X)
        mu, u, _ = entmax_threshold_root(X, alpha)
        # Both sort forms return the τ = (α − 1)(max z + μ) − 1 of docs/maths.md.
        tau_from_mu = (alpha - 1) * (X.amax(-1, keepdim=True) + mu) - 1
        torch.testing.assert_close(tau, tau_from_mu, atol=1e-10, rtol=0)
        p = entmax_forward(X, alpha)
        assert torch.equal(support, (p > 0).sum(-1, keepdim=True))


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0, 0.75])
def test_gradcheck_input_and_alpha(alpha):
    X = _scores((3, 6)).requires_grad_()
    A = torch.full((3, 1), alpha, dtype=torch.float64, requires_grad=True)

    class Entmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, X, A):
            p = entmax_forward(X, A)
            ctx.save_for_backward(p, A)
            return p

        @staticmethod
        def backward(ctx, g):
            p, A = ctx.saved_tensors
            return entmax_backward(p, g, A)

    if alpha == 1.0:
        # The α-derivative at 1 is a limit; check it by central differences around 1.
        g = torch.randn(3, 6, dtype=torch.float64)
        _, dalpha = entmax_backward(entmax_forward(X, 1.0), g, A)
        h = 1e-5
        fd = ((entmax_forward(X, 1 + h) - entmax_forward(X, 1 - h)) * g).sum(-1, keepdim=True) / (2 * h)
        torch.testing.assert_close(dalpha, fd, atol=1e-7, rtol=1e-6)
        assert torch.autograd.gradcheck(lambda x: Entmax.apply(x, A.detach()), (X,))
    else:
        assert torch.autograd.gradcheck(Entmax.apply, (X, A))


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
def test_matches_entmax_package(alpha):
    X = _scores((16, 100), dtype=torch.float32)
    if alpha == 2.0:
        theirs = entmax_pkg.sparsemax(X, dim=-1)
    elif alpha == 1.5:
        theirs = entmax_pkg.entmax15(X, dim=-1)
    else:
        theirs = entmax_pkg.entmax_bisect(X, alpha, n_iter=60)
    torch.testing.assert_close(entmax_forward(X, alpha), theirs, atol=1e-5, rtol=0)


def test_per_row_alpha_mixing_values_and_softmax():
    X = _scores((6, 50))
    alpha = torch.tensor([1.0, 1.1, 1.5, 2.0, 2.5, 0.8], dtype=torch.float64).view(6, 1)
    expected = torch.cat([entmax_forward(X[i:i + 1], float(alpha[i])) for i in range(6)])
    torch.testing.assert_close(entmax_forward(X, alpha), expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(entmax_forward(X, 1.0), torch.softmax(X, -1), atol=1e-15, rtol=0)


@pytest.mark.parametrize("alpha", [1.0001, 1.001, 1.01])
def test_alpha_gradient_near_one_is_accurate_from_float32_outputs(alpha):
    """dα from float32 p close to α = 1, where the formula's terms cancel, vs float64."""
    X = _scores((8, 200))
    g = torch.randn(8, 200, dtype=torch.float64)
    _, expected = entmax_backward(entmax_forward(X, alpha), g, alpha)
    _, got = entmax_backward(entmax_forward(X.float(), alpha), g.float(), alpha)
    torch.testing.assert_close(got.double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-3)
