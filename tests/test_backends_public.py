"""The public API forced onto every backend usable here (the Triton one through the
interpreter), forward and backward vs the float64 oracle: each dispatch branch taken once."""
import pytest
import torch

import entmax_fast
from entmax_fast import dispatch
from entmax_fast.reference.attention import entmax_attention as reference_attention
from entmax_fast.reference.mappings import entmax_backward
from oracle import oracle_attention, oracle_entmax


def _usable(backend, op):
    request = dispatch.Request(torch.device("cpu"), torch.float32, {})
    if backend not in dispatch.registered_ops()[op]:
        return False
    return dispatch._runs_on(backend, request) is None


BACKENDS = [pytest.param(b, id=b, marks=pytest.mark.skipif(not _usable(b, "entmax"), reason=f"{b} not usable here"))
            for b in dispatch.BACKENDS]
# dtype, forward atol, gradient atol (vs float64 on the same rounded inputs)
DTYPES = [pytest.param(torch.float32, 1e-5, 1e-4, id="f32"), pytest.param(torch.float16, 2e-3, 1e-2, id="f16")]


def _vjp_oracle(fn64, X, g):
    X = X.detach().double().requires_grad_()
    (fn64(X) * g.double()).sum().backward()
    return X.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,fwd_atol,grad_atol", DTYPES)
@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25, "rows"])
def test_mappings_on_backend(backend, dtype, fwd_atol, grad_atol, alpha):
    X = (torch.randn(5, 67) * 2).to(dtype)
    X[2, 10:20] = float("-inf")
    X[4] = float("-inf")
    a = torch.tensor([1.1, 1.5, 2.0, 3.0, 1.3]).view(5, 1) if alpha == "rows" else alpha
    x = X.clone().requires_grad_()
    g = torch.randn(5, 67).to(dtype)
    with entmax_fast.use_backend(backend):
        p = entmax_fast.entmax_bisect(x, a)
        p.backward(g)
    assert dispatch.last_choice("entmax").backend == backend
    expected = oracle_entmax(X.double(), a if not isinstance(a, torch.Tensor) else a.double())
    torch.testing.assert_close(p.double(), expected, atol=fwd_atol, rtol=0)
    assert (p[4] == 0).all() and (x.grad[4] == 0).all()

    # Gradient oracle: the reference's float64 backward formula applied to the oracle output.
    dx, _ = entmax_backward(expected, g.double(), a if not isinstance(a, torch.Tensor) else a.double())
    finite = torch.isfinite(X)
    torch.testing.assert_close(x.grad.double()[finite], dx[finite], atol=grad_atol, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alpha_gradient_on_backend(backend):
    X = torch.randn(4, 33, dtype=torch.float64) * 2
    a64 = torch.tensor([1.2, 1.5, 2.0, 2.6], dtype=torch.float64).view(4, 1)
    g = torch.randn(4, 33, dtype=torch.float64)
    h = 1e-6
    fd = ((oracle_entmax(X, a64 + h) - oracle_entmax(X, a64 - h)) * g).sum(-1, keepdim=True) / (2 * h)
    a = a64.float().requires_grad_()
    with entmax_fast.use_backend(backend):
        entmax_fast.entmax_bisect(X.float(), a).backward(g.float())
    torch.testing.assert_close(a.grad.double(), fd, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("backend", [pytest.param(b, id=b, marks=pytest.mark.skipif(
    not _usable(b, "attention"), reason=f"{b} not usable here")) for b in dispatch.BACKENDS])
@pytest.mark.parametrize("alpha", [1.5, "heads"])
def test_attention_on_backend(backend, alpha):
    q, k, v = (torch.randn(1, 2, n, 16) for n in (9, 13, 13))
    mask = torch.rand(9, 13) > 0.3
    mask[3] = False
    a = torch.tensor([1.25, 2.0]) if alpha == "heads" else alpha
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn(1, 2, 9, 16)
    with entmax_fast.use_backend(backend):
        out = entmax_fast.entmax_attention(qq, kk, vv, attn_mask=mask, alpha=a)
        out.backward(g)
    assert dispatch.last_choice("attention").backend == backend
    a64 = a.double() if isinstance(a, torch.Tensor) else a
    torch.testing.assert_close(out.double(), oracle_attention(q, k, v, attn_mask=mask, alpha=a64), atol=1e-5, rtol=0)
    assert (out[:, :, 3] == 0).all()
    grad_q = _vjp_oracle(lambda x: reference_attention(x, k.double(), v.double(), attn_mask=mask, alpha=a64), q, g)
    torch.testing.assert_close(qq.grad.double(), grad_q, atol=1e-4, rtol=0)
