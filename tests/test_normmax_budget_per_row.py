"""normmax's α and budget-sparsemax's budget as ``entmax`` 1.3 takes them: a number, or a
tensor broadcastable to X's shape with size 1 along ``dim`` (one value per row), like
``entmax_bisect``'s α; budget 0 gives all zeros. Neither is differentiated (``entmax``
passes them no gradient): a tensor that requires grad is refused.

Run on every backend that implements the op and runs CPU tensors here (the registry's
list, so that a backend added later is checked too).
"""
import entmax as entmax_pkg
import pytest
import torch

import entmax_fast
from entmax_fast import dispatch
from oracle import oracle_budget, oracle_normmax


def _cpu_backends(op):
    request = dispatch.Request(torch.device("cpu"), torch.float64, {})
    return [name for name in dispatch.registered_ops()[op] if dispatch._refusal(name, op, request) is None]


def _per_row_alpha(shape, dim, low=1.1, high=4.0):
    row_shape = list(shape)
    row_shape[dim] = 1
    return low + (high - low) * torch.rand(row_shape, dtype=torch.float64)


def _per_row_budget(shape, dim):
    row_shape = list(shape)
    row_shape[dim] = 1
    budget = shape[dim] * torch.rand(row_shape, dtype=torch.float64)
    # The bounds themselves: budget 0 (all zeros) and budget n (all ones).
    budget.view(-1)[0] = 0.0
    budget.view(-1)[-1] = float(shape[dim])
    return budget


def _rows_along(X, dim):
    """(index of each row, the row) of X along dim."""
    moved = X.movedim(dim, -1)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in moved.shape[:-1])).view(-1, moved.dim() - 1):
        yield tuple(index.tolist()), moved[tuple(index.tolist())]


@pytest.mark.parametrize("backend", _cpu_backends("normmax"))
@pytest.mark.parametrize("shape,dim", [((5, 7), -1), ((5, 7), 0), ((3, 4, 2, 5), 1), ((3, 4, 2, 5), 3)])
def test_normmax_per_row_alpha_is_each_row_with_its_alpha(backend, shape, dim):
    X = 2 * torch.randn(shape, dtype=torch.float64)
    alpha = _per_row_alpha(shape, dim)
    with entmax_fast.use_backend(backend):
        p = entmax_fast.normmax_bisect(X, alpha, dim=dim)
        assert dispatch.last_choice("normmax").backend == backend
    alpha_rows = alpha.movedim(dim, -1)
    p_rows = p.movedim(dim, -1)
    for index, x in _rows_along(X, dim):
        a = float(alpha_rows[index])
        torch.testing.assert_close(p_rows[index], oracle_normmax(x[None], a)[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(p, entmax_pkg.normmax_bisect(X, alpha, dim=dim), atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", _cpu_backends("budget"))
@pytest.mark.parametrize("shape,dim", [((5, 7), -1), ((5, 7), 0), ((3, 4, 2, 5), 1), ((3, 4, 2, 5), 3)])
def test_budget_per_row_is_each_row_with_its_budget(backend, shape, dim):
    X = 2 * torch.randn(shape, dtype=torch.float64)
    budget = _per_row_budget(shape, dim)
    with entmax_fast.use_backend(backend):
        p = entmax_fast.budget_bisect(X, budget, dim=dim)
        assert dispatch.last_choice("budget").backend == backend
    torch.testing.assert_close(p.sum(dim, keepdim=True), budget, atol=1e-12, rtol=0)
    budget_rows = budget.movedim(dim, -1)
    p_rows = p.movedim(dim, -1)
    for index, x in _rows_along(X, dim):
        b = float(budget_rows[index])
        torch.testing.assert_close(p_rows[index], oracle_budget(x[None], b)[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(p, entmax_pkg.budget_bisect(X, budget, dim=dim), atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", _cpu_backends("normmax"))
@pytest.mark.parametrize("alpha_shape", [(4, 1), (1, 1), (1,), ()])
def test_normmax_gradcheck_with_alpha_tensors(backend, alpha_shape):
    X = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    alpha = 1.1 + 3 * torch.rand(alpha_shape, dtype=torch.float64)
    with entmax_fast.use_backend(backend):
        assert torch.autograd.gradcheck(lambda x: entmax_fast.normmax_bisect(x, alpha), (X,))
        assert torch.autograd.gradgradcheck(lambda x: entmax_fast.normmax_bisect(x, alpha), (X,))
        # Along dim 0, α broadcast over the other dim.
        assert torch.autograd.gradcheck(lambda x: entmax_fast.normmax_bisect(x.T, alpha.reshape(-1)[:1], dim=0),
                                        (X,))


@pytest.mark.parametrize("backend", _cpu_backends("budget"))
def test_budget_gradcheck_per_row_and_at_the_bounds(backend):
    X = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    budget = torch.tensor([[0.0], [1.0], [2.5], [6.0], [4.2]], dtype=torch.float64)
    with entmax_fast.use_backend(backend):
        assert torch.autograd.gradcheck(lambda x: entmax_fast.budget_bisect(x, budget), (X,))
        assert torch.autograd.gradgradcheck(lambda x: entmax_fast.budget_bisect(x, budget), (X,))
        p = entmax_fast.budget_bisect(X, budget)
        (grad,) = torch.autograd.grad(p, X, torch.randn_like(p))
    # Budget 0 admits only p = 0, budget n only p = 1: constant rows, zero gradient.
    assert (p[0] == 0).all() and (grad[0] == 0).all()
    torch.testing.assert_close(p[3], torch.ones(6, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (grad[3] == 0).all()


@pytest.mark.parametrize("backend", _cpu_backends("budget"))
@pytest.mark.parametrize("budget", [0, 0.0, torch.tensor(0.0), torch.tensor(0)])
def test_budget_zero_gives_zeros_as_entmax(backend, budget):
    X = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    with entmax_fast.use_backend(backend):
        p = entmax_fast.budget_bisect(X, budget)
        p.backward(torch.randn_like(p))
        assert torch.autograd.gradcheck(lambda x: entmax_fast.budget_bisect(x, budget), (X,))
    assert (p == 0).all() and (X.grad == 0).all()
    # entmax 1.3 stops its bisection a rounding error short of p = 0.
    torch.testing.assert_close(p, entmax_pkg.budget_bisect(X.detach(), budget), atol=1e-12, rtol=0)


def test_modules_and_normmax_loss_take_per_row_tensors():
    X = torch.randn(4, 6, dtype=torch.float64)
    alpha = torch.tensor([[1.5], [2.0], [3.0], [7.5]], dtype=torch.float64)
    budget = torch.tensor([[0.0], [1.0], [2.5], [4.0]], dtype=torch.float64)
    torch.testing.assert_close(entmax_fast.NormmaxBisect(alpha=alpha)(X), entmax_fast.normmax_bisect(X, alpha))
    torch.testing.assert_close(entmax_fast.BudgetBisect(budget=budget)(X), entmax_fast.budget_bisect(X, budget))
    y = torch.tensor([0, 3, 5, 1])
    X.requires_grad_()
    loss = entmax_fast.normmax_bisect_loss(X, y, alpha)
    (grad,) = torch.autograd.grad(loss.sum(), X)
    for i in range(4):
        x_row = X[i:i + 1].detach().clone().requires_grad_()
        expected = entmax_fast.normmax_bisect_loss(x_row, y[i:i + 1], float(alpha[i]))
        torch.testing.assert_close(loss[i:i + 1], expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(grad[i:i + 1], torch.autograd.grad(expected.sum(), x_row)[0], atol=1e-12, rtol=0)
    module = entmax_fast.NormmaxBisectLoss(alpha=alpha, reduction="sum")
    torch.testing.assert_close(module(X, y), loss.sum(), atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda x: entmax_fast.normmax_bisect_loss(x, y, alpha), (X,))


@pytest.mark.parametrize("call,error,match", [
    (lambda X: entmax_fast.normmax_bisect(X, torch.full((3, 1), 2.0, requires_grad=True)), ValueError,
     r"alpha of normmax_bisect is not differentiated; pass a float or a tensor that does not require grad"),
    (lambda X: entmax_fast.budget_bisect(X, torch.full((3, 1), 2.0, requires_grad=True)), ValueError,
     r"budget of budget_bisect is not differentiated"),
    (lambda X: entmax_fast.normmax_bisect_loss(X, torch.tensor([0, 1, 2]), torch.full((3, 1), 2.0,
                                                                                      requires_grad=True)),
     ValueError, r"alpha of normmax_bisect_loss is not differentiated"),
    (lambda X: entmax_fast.normmax_bisect(X, torch.tensor([[2.0], [1.0], [3.0]])), ValueError,
     r"alpha must be > 1 for normmax_bisect \(and finite\) everywhere"),
    (lambda X: entmax_fast.normmax_bisect(X, torch.tensor([[2.0], [float("nan")], [3.0]])), ValueError,
     r"alpha must be > 1 for normmax_bisect \(and finite\) everywhere"),
    (lambda X: entmax_fast.normmax_bisect(X, torch.tensor([[2.0], [float("inf")], [3.0]])), ValueError,
     r"alpha must be > 1 for normmax_bisect \(and finite\) everywhere"),
    (lambda X: entmax_fast.normmax_bisect_loss(X, torch.tensor([0, 1, 2]), torch.tensor([[2.0], [0.5], [3.0]])),
     ValueError, r"alpha must be > 1 for normmax_bisect_loss \(and finite\) everywhere"),
    (lambda X: entmax_fast.budget_bisect(X, torch.tensor([[2.0], [-0.5], [3.0]])), ValueError,
     r"budget must be >= 0 for budget_bisect \(and finite\) everywhere"),
    (lambda X: entmax_fast.budget_bisect(X, torch.tensor([[2.0], [5.5], [3.0]])), ValueError,
     r"budget must be at most the size of dim 1 \(5\) everywhere"),
    (lambda X: entmax_fast.budget_bisect(X, torch.tensor([2.0, 1.0, 3.0])), ValueError,
     r"budget must be a number or a tensor broadcastable to \(3, 1\) \(X's shape with size 1 along dim=1\) for "
     r"budget_bisect, got shape \(3,\)"),
    (lambda X: entmax_fast.normmax_bisect(X, torch.full((1, 3, 1), 2.0)), ValueError,
     r"alpha must be a number or a tensor broadcastable to \(3, 1\)"),
    (lambda X: entmax_fast.normmax_bisect(X, torch.full((3, 1), 2.0), dim=0), ValueError,
     r"alpha must be a number or a tensor broadcastable to \(1, 5\) \(X's shape with size 1 along dim=0\)"),
    (lambda X: entmax_fast.normmax_bisect(X, torch.full((3, 1), 2.0, device="meta")), ValueError,
     r"alpha must be on X's device cpu \(or be a 0-d CPU tensor\), got meta"),
    (lambda X: entmax_fast.budget_bisect(X, torch.ones(3, 1, dtype=torch.bool)), TypeError,
     r"budget must be a real number or tensor for budget_bisect, got dtype torch.bool"),
    (lambda X: entmax_fast.budget_bisect(X, -1), ValueError, r"budget must be >= 0 for budget_bisect, got -1.0"),
    (lambda X: entmax_fast.budget_bisect(X, torch.tensor(float("nan"))), ValueError,
     r"budget must be >= 0 for budget_bisect, got nan"),
])
def test_bad_parameters_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(3, 5))
