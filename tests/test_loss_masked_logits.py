"""Fenchel–Young losses with −inf logits, the way a masked class is written.

As ``F.cross_entropy`` treats them: the loss, and the gradient on the other classes, are those
of the row with the −inf columns dropped; the −inf logits get gradient 0; a target on a −inf
logit gives +inf. At α = 1 the entmax loss is cross-entropy itself.

Checked against a float64 oracle (tests/oracle.py's mappings on the kept columns, then the
loss's closed form) and against the same loss called on each row with its −inf columns
dropped, on every CPU backend that serves the loss's mapping (the Triton backend runs CPU
tensors in its interpreter, in float32; normmax has only the reference).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import entmax_fast
from entmax_fast import dispatch
from oracle import oracle_entmax, oracle_normmax

INF = math.inf
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (case id, op of the mapping, loss(X, target, alpha), kind, α): α is a float or, for a
# per-row α, the (n, 1) tensor's values.
CASES = [
    ("sparsemax_loss", "entmax", lambda X, y, a: entmax_fast.sparsemax_loss(X, y), "entmax", 2.0),
    ("sparsemax_bisect_loss", "entmax", lambda X, y, a: entmax_fast.sparsemax_bisect_loss(X, y), "entmax", 2.0),
    ("entmax15_loss", "entmax", lambda X, y, a: entmax_fast.entmax15_loss(X, y), "entmax", 1.5),
    ("entmax_bisect_loss_1.3", "entmax", lambda X, y, a: entmax_fast.entmax_bisect_loss(X, y, alpha=a), "entmax",
     1.3),
    ("entmax_bisect_loss_1", "entmax", lambda X, y, a: entmax_fast.entmax_bisect_loss(X, y, alpha=a), "entmax",
     1.0),
    ("entmax_bisect_loss_per_row", "entmax", lambda X, y, a: entmax_fast.entmax_bisect_loss(X, y, alpha=a),
     "entmax", (1.0, 1.3, 2.0, 1.7)),
    ("normmax_bisect_loss_2", "normmax", lambda X, y, a: entmax_fast.normmax_bisect_loss(X, y, alpha=a),
     "normmax", 2.0),
    ("normmax_bisect_loss_3", "normmax", lambda X, y, a: entmax_fast.normmax_bisect_loss(X, y, alpha=a),
     "normmax", 3.0),
]
BACKENDS = {"entmax": ("reference", "cpp", "triton"), "normmax": ("reference",)}


def _params(cases, backends_of=lambda op: BACKENDS[op]):
    return [pytest.param(backend, *case[1:], id=f"{case[0]}-{backend}")
            for case in cases for backend in backends_of(case[1])]


def _device_for(backend):
    ok, why = dispatch.availability(backend)
    if not ok:
        pytest.skip(f"backend {backend} unavailable: {why}")
    return TRITON_DEVICE if backend == "triton" else torch.device("cpu")


def _dtype_for(backend):
    # The Triton row-wise kernels take float32 at most.
    return torch.float32 if backend == "triton" else torch.float64


def _masked_inputs(dtype, device):
    """Rows with −inf at various places (one without), targets on finite logits."""
    X = torch.tensor([[0.3, -INF, 1.2, 0.9, -0.4, 0.1],
                      [-INF, 0.7, 0.2, 1.5, -1.0, -INF],
                      [0.5, -0.2, 0.8, 0.1, 1.1, -0.6],
                      [1.4, 0.2, -INF, -INF, -INF, 0.9]], dtype=dtype, device=device)
    return X, torch.tensor([3, 2, 4, 0], device=device)


def _alpha(alpha, dtype, device, requires_grad=False):
    if isinstance(alpha, tuple):
        return torch.tensor(alpha, dtype=dtype, device=device).view(-1, 1).requires_grad_(requires_grad)
    return alpha


def _row_alpha(alpha, i):
    return alpha[i:i + 1] if isinstance(alpha, torch.Tensor) else alpha


def _kept(x_row):
    kept = ~torch.isneginf(x_row)
    return kept, torch.cumsum(kept, 0) - 1


def _oracle_row(x, y, kind, alpha):
    """(loss, p) of one row of finite float64 scores: the loss's closed form on oracle p."""
    if kind == "normmax":
        p = oracle_normmax(x[None], alpha)[0]
        regulariser = 1 - p.pow(alpha).sum().pow(1 / alpha)
    else:
        p = oracle_entmax(x[None], alpha)[0]
        if alpha == 1.0:
            regulariser = -(p * torch.log(p)).sum()
        else:
            regulariser = (1 - p.pow(alpha).sum()) / (alpha * (alpha - 1))
    return regulariser + p @ x - x[y], p


def _tolerance(dtype):
    # float64: the reference's thresholds are exact or solved to a few ulps; float32: the
    # Triton kernels' threshold is found to |Σp − 1| ≤ 1e-6.
    return 1e-10 if dtype == torch.float64 else 2e-5


@pytest.mark.parametrize("backend,op,loss,kind,alpha", _params(CASES))
def test_loss_ignores_negative_infinite_logits(backend, op, loss, kind, alpha):
    device = _device_for(backend)
    dtype = _dtype_for(backend)
    X, y = _masked_inputs(dtype, device)
    X.requires_grad_()
    a = _alpha(alpha, dtype, device, requires_grad=True)
    with entmax_fast.use_backend(backend):
        value = loss(X, y, a)
        value.backward(torch.tensor([1.0, -0.5, 2.0, 0.75], dtype=dtype, device=device))
        assert dispatch.last_choice(op).backend == backend
        for i in range(X.shape[0]):
            kept, new_index = _kept(X[i].detach())
            x_kept = X[i].detach()[kept].clone().requires_grad_()
            a_row = _row_alpha(a, i).detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a
            dropped = loss(x_kept[None], new_index[y[i]].view(1), a_row)
            dropped.backward(torch.tensor([1.0, -0.5, 2.0, 0.75], dtype=dtype, device=device)[i:i + 1])

            tol = _tolerance(dtype)
            torch.testing.assert_close(value[i], dropped[0], atol=tol, rtol=0)
            torch.testing.assert_close(X.grad[i, kept], x_kept.grad, atol=tol, rtol=0)
            assert (X.grad[i, ~kept] == 0).all()
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a.grad[i], a_row.grad[0], atol=tol, rtol=0)

            row_alpha = float(_row_alpha(a, i).detach()) if isinstance(a, torch.Tensor) else alpha
            expected, p = _oracle_row(x_kept.detach().cpu().double(), int(new_index[y[i]]), kind, row_alpha)
            torch.testing.assert_close(value[i].detach().cpu().double(), expected, atol=10 * tol, rtol=0)
            upstream = [1.0, -0.5, 2.0, 0.75][i]
            expected_grad = upstream * (p - F.one_hot(new_index[y[i]].cpu(), int(kept.sum())).double())
            torch.testing.assert_close(X.grad[i, kept].cpu().double(), expected_grad, atol=10 * tol, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "cpp", "triton"])
def test_entmax_loss_at_alpha_1_is_cross_entropy_with_masked_logits(backend):
    device = _device_for(backend)
    dtype = _dtype_for(backend)
    X = torch.tensor([[0.5, -INF, 1.0, 2.0]], dtype=dtype, device=device, requires_grad=True)
    y = torch.tensor([2], device=device)
    reference = X.detach().clone().requires_grad_()
    with entmax_fast.use_backend(backend):
        value = entmax_fast.entmax_bisect_loss(X, y, alpha=1.0)
        value.sum().backward()
    expected = F.cross_entropy(reference, y, reduction="none")
    expected.sum().backward()
    tol = _tolerance(dtype)
    torch.testing.assert_close(value, expected.detach(), atol=tol, rtol=0)
    # The same number by hand: log Σ exp over the finite logits, minus the target's.
    torch.testing.assert_close(value.detach().cpu().double(),
                               torch.tensor([math.log(math.exp(0.5) + math.exp(1.0) + math.exp(2.0)) - 1.0],
                                            dtype=torch.float64), atol=tol, rtol=0)
    torch.testing.assert_close(X.grad, reference.grad, atol=tol, rtol=0)

    X, y = _masked_inputs(dtype, device)
    X.requires_grad_()
    reference = X.detach().clone().requires_grad_()
    with entmax_fast.use_backend(backend):
        value = entmax_fast.entmax_bisect_loss(X, y, alpha=1.0)
        value.sum().backward()
    expected = F.cross_entropy(reference, y, reduction="none")
    expected.sum().backward()
    torch.testing.assert_close(value, expected.detach(), atol=tol, rtol=0)
    torch.testing.assert_close(X.grad, reference.grad, atol=tol, rtol=0)


@pytest.mark.parametrize("backend,op,loss,kind,alpha", _params(CASES))
def test_target_on_a_negative_infinite_logit_gives_inf(backend, op, loss, kind, alpha):
    device = _device_for(backend)
    dtype = _dtype_for(backend)
    X, _ = _masked_inputs(dtype, device)
    X.requires_grad_()
    y = torch.tensor([1, 5, 4, 3], device=device)  # rows 0, 1, 3 point at a −inf logit
    with entmax_fast.use_backend(backend):
        value = loss(X, y, _alpha(alpha, dtype, device))
        value.sum().backward()
        p = (entmax_fast.normmax_bisect(X.detach(), alpha) if kind == "normmax"
             else entmax_fast.entmax_bisect(X.detach(), _alpha(alpha, dtype, device)))
    assert torch.isposinf(value[[0, 1, 3]]).all()
    assert torch.isfinite(value[2])
    # The gradient stays p − e_y, as cross-entropy's does.
    torch.testing.assert_close(X.grad, p - F.one_hot(y, X.shape[1]).to(dtype), atol=_tolerance(dtype), rtol=0)


MODULES = [
    pytest.param(lambda **kw: entmax_fast.SparsemaxLoss(**kw), "entmax", 2.0, id="SparsemaxLoss"),
    pytest.param(lambda **kw: entmax_fast.SparsemaxBisectLoss(**kw), "entmax", 2.0, id="SparsemaxBisectLoss"),
    pytest.param(lambda **kw: entmax_fast.Entmax15Loss(**kw), "entmax", 1.5, id="Entmax15Loss"),
    pytest.param(lambda **kw: entmax_fast.EntmaxBisectLoss(alpha=1.2, **kw), "entmax", 1.2, id="EntmaxBisectLoss"),
    pytest.param(lambda **kw: entmax_fast.NormmaxBisectLoss(alpha=2.5, **kw), "normmax", 2.5,
                 id="NormmaxBisectLoss"),
]


@pytest.mark.parametrize("make,kind,alpha", MODULES)
@pytest.mark.parametrize("reduction", ["elementwise_mean", "sum"])
def test_loss_modules_ignore_negative_infinite_logits(make, kind, alpha, reduction):
    X, _ = _masked_inputs(torch.float64, torch.device("cpu"))
    X.requires_grad_()
    # Row 1 is ignored; the position its target is replaced by internally is a −inf logit.
    y = torch.tensor([3, -100, 4, 0])
    value = make(reduction=reduction)(X, y)
    value.backward()
    expected, expected_grad = [], torch.zeros_like(X)
    for i in (0, 2, 3):
        kept, new_index = _kept(X[i].detach())
        loss, p = _oracle_row(X[i].detach()[kept], int(new_index[y[i]]), kind, alpha)
        expected.append(loss)
        expected_grad[i, kept] = p - F.one_hot(new_index[y[i]], int(kept.sum())).double()
    expected = torch.stack(expected).sum()
    if reduction == "elementwise_mean":
        expected, expected_grad = expected / 3, expected_grad / 3
    torch.testing.assert_close(value.detach(), expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(X.grad, expected_grad, atol=1e-9, rtol=0)


DOUBLE_BACKWARD_CASES = [case for case in CASES if case[0] != "entmax_bisect_loss_per_row"]


@pytest.mark.parametrize("backend,op,loss,kind,alpha",
                         _params(DOUBLE_BACKWARD_CASES, lambda op: [b for b in BACKENDS[op] if b != "triton"]))
def test_double_backward_with_negative_infinite_logits(backend, op, loss, kind, alpha):
    """gradcheck/gradgradcheck hold with −inf entries (a −inf moved by ±eps stays −inf: a
    zero derivative), and a Hessian-vector product equals the column-dropped one, with zeros
    on the −inf logits."""
    _device_for(backend)
    X, y = _masked_inputs(torch.float64, torch.device("cpu"))
    X, y = X[:3, :5].contiguous().requires_grad_(), torch.tensor([3, 2, 4])
    v = torch.tensor([[0.5, -1.0, 0.25, 2.0, -0.75],
                      [1.5, 0.5, -0.5, 1.0, 0.25],
                      [-1.0, 0.75, 0.5, -0.25, 1.25]], dtype=torch.float64)
    with entmax_fast.use_backend(backend):
        assert torch.autograd.gradcheck(lambda x: loss(x, y, alpha), (X,))
        assert torch.autograd.gradgradcheck(lambda x: loss(x, y, alpha), (X,))
        (grad,) = torch.autograd.grad(loss(X, y, alpha).sum(), X, create_graph=True)
        (hvp,) = torch.autograd.grad((grad * v).sum(), X)
        assert torch.isfinite(hvp).all()
        for i in range(X.shape[0]):
            kept, new_index = _kept(X[i].detach())
            x_kept = X[i].detach()[kept].clone().requires_grad_()
            (row_grad,) = torch.autograd.grad(loss(x_kept[None], new_index[y[i]].view(1), alpha).sum(), x_kept,
                                              create_graph=True)
            (row_hvp,) = torch.autograd.grad((row_grad * v[i, kept]).sum(), x_kept)
            torch.testing.assert_close(hvp[i, kept], row_hvp, atol=1e-10, rtol=0)
            assert (hvp[i, ~kept] == 0).all()
