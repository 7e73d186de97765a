"""The public mappings and losses: drop-in compatibility with `entmax` 1.3, gradients through
the dispatched autograd Function (X and α), any dim, α broadcasting."""
import math

import entmax as entmax_pkg
import pytest
import torch

import entmax_fast
from oracle import oracle_entmax

PAIRS = [
    pytest.param(entmax_fast.sparsemax, entmax_pkg.sparsemax, id="sparsemax"),
    pytest.param(entmax_fast.entmax15, entmax_pkg.entmax15, id="entmax15"),
    pytest.param(entmax_fast.sparsemax_bisect, entmax_pkg.sparsemax_bisect, id="sparsemax_bisect"),
    pytest.param(entmax_fast.entmax_bisect, entmax_pkg.entmax_bisect, id="entmax_bisect"),
]


@pytest.mark.parametrize("ours,theirs", PAIRS)
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_same_results_as_entmax_package(ours, theirs, dim):
    X = torch.randn(5, 6, 7) * 2
    expected = theirs(X, dim=dim)
    torch.testing.assert_close(ours(X, dim=dim), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("ours,theirs", [PAIRS[0], PAIRS[1]])
def test_gradients_match_entmax_package(ours, theirs):
    X = (torch.randn(4, 30, dtype=torch.float64) * 2).requires_grad_()
    g = torch.randn(4, 30, dtype=torch.float64)
    (ours(X) * g).sum().backward()
    ours_grad = X.grad.clone()
    X.grad = None
    (theirs(X) * g).sum().backward()
    torch.testing.assert_close(ours_grad, X.grad, atol=1e-10, rtol=0)


def test_k_does_not_change_results():
    X = torch.randn(3, 50)
    torch.testing.assert_close(entmax_fast.sparsemax(X, k=2), entmax_fast.sparsemax(X))
    torch.testing.assert_close(entmax_fast.entmax15(X, k=2), entmax_fast.entmax15(X))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_x_and_alpha_through_public_function(dim):
    X = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    shape = [3, 4, 5]
    shape[dim] = 1
    alpha = (1.1 + torch.rand(shape, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, a: entmax_fast.entmax_bisect(x, a, dim=dim), (X, alpha))


def test_alpha_broadcast_per_head_gets_summed_gradient():
    X = torch.randn(2, 3, 4, 9, dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor([1.2, 1.5, 1.9], dtype=torch.float64).view(3, 1, 1).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, a: entmax_fast.entmax_bisect(x, a), (X, alpha))
    p = entmax_fast.entmax_bisect(X, alpha)
    torch.testing.assert_close(p, oracle_entmax(X, alpha.expand(2, 3, 4, 1)), atol=1e-12, rtol=0)


def test_alpha_one_is_exactly_softmax_including_gradient():
    X = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    with entmax_fast.use_backend("reference"):
        torch.testing.assert_close(entmax_fast.entmax_bisect(X, 1.0), torch.softmax(X, -1), atol=1e-15, rtol=0)
    # Other backends compute the same softmax with their own reductions: equal up to rounding.
    torch.testing.assert_close(entmax_fast.entmax_bisect(X, 1.0), torch.softmax(X, -1), atol=1e-15, rtol=1e-15)
    g = torch.randn(4, 11, dtype=torch.float64)
    (entmax_fast.entmax_bisect(X, 1.0) * g).sum().backward()
    ours = X.grad.clone()
    X.grad = None
    (torch.softmax(X, -1) * g).sum().backward()
    torch.testing.assert_close(ours, X.grad, atol=1e-14, rtol=0)


def test_dense_alpha_below_one_accepted_like_entmax():
    X = torch.randn(3, 8)
    p = entmax_fast.entmax_bisect(X, 0.5)
    assert (p > 0).all()
    torch.testing.assert_close(p, entmax_pkg.entmax_bisect(X, 0.5, n_iter=80), atol=1e-5, rtol=0)


def test_fully_masked_row_and_empty_dim():
    X = torch.randn(3, 5, requires_grad=True)
    masked = X.masked_fill(torch.tensor([False, True, False]).view(3, 1), -math.inf)
    p = entmax_fast.entmax15(masked)
    p.sum().backward()
    assert (p[1] == 0).all() and not X.grad.isnan().any()
    assert entmax_fast.sparsemax(torch.randn(2, 0)).shape == (2, 0)


def test_modules():
    X = torch.randn(4, 7)
    torch.testing.assert_close(entmax_fast.Sparsemax(dim=0)(X), entmax_fast.sparsemax(X, dim=0))
    torch.testing.assert_close(entmax_fast.Entmax15()(X), entmax_fast.entmax15(X))
    torch.testing.assert_close(entmax_fast.SparsemaxBisect()(X), entmax_fast.sparsemax(X))
    learned = entmax_fast.EntmaxBisect(alpha=torch.nn.Parameter(torch.tensor(1.3)))
    learned(X).sum().backward()
    assert learned.alpha.grad is not None


LOSS_PAIRS = [
    pytest.param(entmax_fast.sparsemax_loss, entmax_pkg.sparsemax_loss, {}, id="sparsemax_loss"),
    pytest.param(entmax_fast.entmax15_loss, entmax_pkg.entmax15_loss, {}, id="entmax15_loss"),
    pytest.param(entmax_fast.sparsemax_bisect_loss, entmax_pkg.sparsemax_bisect_loss, {}, id="sparsemax_bisect"),
    pytest.param(entmax_fast.entmax_bisect_loss, entmax_pkg.entmax_bisect_loss, {"alpha": 1.3}, id="entmax_bisect"),
]


@pytest.mark.parametrize("ours,theirs,kwargs", LOSS_PAIRS)
def test_losses_match_entmax_package(ours, theirs, kwargs):
    X = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 10, (6,))
    ours_loss = ours(X, y, **kwargs)
    theirs_loss = theirs(X.detach(), y, **kwargs)
    torch.testing.assert_close(ours_loss, theirs_loss, atol=1e-8, rtol=0)
    ours_loss.sum().backward()
    expected_grad = oracle_entmax(X.detach(), kwargs.get("alpha", 2.0 if "sparsemax" in ours.__name__ else 1.5))
    expected_grad[torch.arange(6), y] -= 1
    torch.testing.assert_close(X.grad, expected_grad, atol=1e-8, rtol=0)


def test_loss_alpha_gradient_matches_finite_differences():
    X = torch.randn(5, 8, dtype=torch.float64)
    y = torch.randint(0, 8, (5,))
    alpha = torch.full((5, 1), 1.4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: entmax_fast.entmax_bisect_loss(X, y, a), (alpha,))


def test_loss_modules_reduction_and_ignore_index():
    X = torch.randn(6, 5)
    y = torch.tensor([0, 1, 2, 3, 4, 1])
    for ours, theirs in ((entmax_fast.SparsemaxLoss, entmax_pkg.SparsemaxLoss),
                         (entmax_fast.Entmax15Loss, entmax_pkg.Entmax15Loss)):
        for reduction in ("elementwise_mean", "sum", "none"):
            torch.testing.assert_close(ours(reduction=reduction, ignore_index=1)(X, y),
                                       theirs(reduction=reduction, ignore_index=1)(X, y), atol=1e-5, rtol=0)
    torch.testing.assert_close(entmax_fast.EntmaxBisectLoss(alpha=1.7)(X, y),
                               entmax_pkg.EntmaxBisectLoss(alpha=1.7)(X, y), atol=1e-5, rtol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0])
def test_normmax_matches_oracle_entmax_package_and_gradcheck(alpha):
    from oracle import oracle_normmax

    X = torch.randn(6, 17, dtype=torch.float64) * 2
    p = entmax_fast.normmax_bisect(X, alpha)
    torch.testing.assert_close(p, oracle_normmax(X, alpha), atol=1e-12, rtol=0)
    torch.testing.assert_close(p.float(), entmax_pkg.normmax_bisect(X.float(), alpha), atol=1e-5, rtol=0)
    assert torch.autograd.gradcheck(lambda x: entmax_fast.normmax_bisect(x, alpha, dim=0),
                                    (X[:, :5].clone().requires_grad_(),))
    y = torch.randint(0, 17, (6,))
    torch.testing.assert_close(entmax_fast.NormmaxBisectLoss(alpha=alpha, reduction="none")(X, y),
                               entmax_pkg.NormmaxBisectLoss(alpha=alpha, reduction="none")(X, y), atol=1e-8, rtol=0)


@pytest.mark.parametrize("budget", [1.0, 2.0, 3.5])
def test_budget_matches_oracle_entmax_package_and_gradcheck(budget):
    from oracle import oracle_budget

    X = torch.randn(6, 17, dtype=torch.float64) * 2
    p = entmax_fast.budget_bisect(X, budget)
    torch.testing.assert_close(p, oracle_budget(X, budget), atol=1e-12, rtol=0)
    torch.testing.assert_close(p.sum(-1), torch.full((6,), budget, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(p.float(), entmax_pkg.budget_bisect(X.float(), budget), atol=1e-5, rtol=0)
    assert torch.autograd.gradcheck(lambda x: entmax_fast.budget_bisect(x, budget),
                                    (X.clone().requires_grad_(),))
    torch.testing.assert_close(entmax_fast.BudgetBisect(budget=budget, dim=0)(X.T), p.T)


def test_normmax_and_budget_errors():
    with pytest.raises(ValueError, match="alpha must be > 1 for normmax_bisect"):
        entmax_fast.normmax_bisect(torch.randn(2, 3), alpha=1.0)
    with pytest.raises(ValueError, match="budget must be >= 0 for budget_bisect, got -0.5"):
        entmax_fast.budget_bisect(torch.randn(2, 3), budget=-0.5)
    with pytest.raises(ValueError, match=r"budget must be at most the size of dim 1 \(3\), got 4.0"):
        entmax_fast.budget_bisect(torch.randn(2, 3), budget=4)


def test_strided_and_noncontiguous_inputs():
    base = torch.randn(6, 40, dtype=torch.float64)
    strided = base[:, ::2]
    transposed = base.T
    for X, dim in ((strided, -1), (transposed, 0), (transposed, 1)):
        torch.testing.assert_close(entmax_fast.entmax15(X, dim=dim), oracle_entmax(X, 1.5, dim=dim), atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape,dim", [((7,), 0), ((4, 7), 1), ((4, 7), 0), ((2, 3, 7), 2), ((2, 3, 7), 1),
                                       ((2, 3, 7), 0), ((4, 1), 1), ((1, 7), 1)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_rows_are_unit_stride_and_come_back_unchanged(shape, dim, layout):
    """`_to_rows` gives the (R, n) rows of the movedim/reshape it stands for (without them
    where dim is already last or X already 2-D), with a unit-stride last dim (or a single
    column), and `_from_rows` puts them back to X exactly."""
    from entmax_fast.mappings import _from_rows, _to_rows

    X = torch.randn(shape)
    if layout == "transposed" and X.dim() > 1:
        X = X.transpose(0, -1).contiguous().transpose(0, -1)
    elif layout == "strided":
        X = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    rows, moved_shape = _to_rows(X, dim)
    moved = X.movedim(dim, -1)
    assert moved_shape == moved.shape
    assert rows.dim() == 2 and (rows.stride(-1) == 1 or rows.shape[-1] == 1)
    assert torch.equal(rows, moved.reshape(-1, moved.shape[-1]))
    assert torch.equal(_from_rows(rows, moved_shape, dim), X)
    if dim == X.dim() - 1 and X.dim() == 2 and X.stride(-1) == 1:
        assert rows is X, "rows already in place were copied or viewed"
