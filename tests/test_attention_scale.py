"""The score scale as SDPA takes it: any finite number. scale = 0 scores every key alike,
so the weights are uniform over the unmasked keys for every mapping (softmax, α-entmax,
fusedmax, oscarmax) and the scores carry no gradient to query and key; a negative scale is
the positive one with the query negated. Checked on every backend that runs the op on CPU
tensors here (Triton in its interpreter: α in (1, 2] only, one call per case)."""
import pytest
import torch
import torch.nn.functional as F

import entmax_fast as E
from devices import cpu_backends

LQ, LK = 5, 6


def _inputs(heads=2, kv_heads=2, dtype=torch.float32):
    make = lambda h, length: (torch.randn(2, h, length, 8, dtype=dtype) * 3).requires_grad_()  # noqa: E731
    return make(heads, LQ), make(kv_heads, LK), make(kv_heads, LK)


def _mask(fully_masked_row: bool):
    """A bool mask (True = attend) with every query keeping a key under the causal rule,
    except query 3 when ``fully_masked_row``."""
    mask = torch.rand(2, 1, LQ, LK) > 0.4
    mask[..., 0] = True
    if fully_masked_row:
        mask[1, 0, 3] = False
    return mask


def _uniform(mask, is_causal, value):
    """Uniform weights over the attended keys (zeros for a row without any) times value."""
    keep = mask & torch.ones(LQ, LK, dtype=torch.bool).tril() if is_causal else mask
    keep = keep.to(value.dtype)
    return keep / keep.sum(-1, keepdim=True).clamp_min(1) @ value


def _call(backend, fn, *args, **kwargs):
    with E.use_backend(backend):
        return fn(*args, **kwargs)


def _backends(op, fused_alpha=True):
    # The fused Triton kernels take 1 < alpha <= 2 only: softmax (alpha = 1) runs elsewhere.
    return [b for b in cpu_backends(op) if fused_alpha or b != "triton"]


@pytest.mark.parametrize("backend", _backends("attention", fused_alpha=False))
@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_softmax_matches_sdpa(backend, scale):
    q, k, v = _inputs()
    mask = _mask(fully_masked_row=False)
    out = _call(backend, E.entmax_attention, q, k, v, attn_mask=mask, is_causal=True, scale=scale, alpha=1.0)
    causal = torch.ones(LQ, LK, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & causal, scale=scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    if scale == 0:
        torch.testing.assert_close(out, _uniform(mask, True, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends("attention"))
@pytest.mark.parametrize("op", ["entmax15", "sparsemax"])
def test_scale_zero_gives_uniform_weights(backend, op):
    q, k, v = _inputs()
    mask = _mask(fully_masked_row=True)
    if op == "entmax15":
        out = _call(backend, E.entmax_attention, q, k, v, attn_mask=mask, is_causal=True, scale=0.0, alpha=1.5)
    else:
        out = _call(backend, E.sparsemax_attention, q, k, v, attn_mask=mask, is_causal=True, scale=0.0)
    expected = _uniform(mask, True, v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out[1, :, 3] == 0).all()
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    (dv_expected,) = torch.autograd.grad(expected, v, grad)
    assert (dq == 0).all() and (dk == 0).all()
    torch.testing.assert_close(dv, dv_expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends("attention"))
def test_negative_scale_is_the_negated_query(backend):
    q, k, v = _inputs(heads=4, kv_heads=2)
    mask = _mask(fully_masked_row=True)
    alpha = torch.tensor([1.5, 2.0, 1.25, 1.75])
    out = _call(backend, E.entmax_attention, q, k, v, attn_mask=mask, scale=-0.7, enable_gqa=True, alpha=alpha)
    expected = _call("reference", E.entmax_attention, -q, k, v, attn_mask=mask, scale=0.7, enable_gqa=True,
                     alpha=alpha)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends("attention_varlen"))
def test_varlen_scale_zero_gives_uniform_weights(backend):
    # Two sequences (2 queries / 4 keys, 3 queries / 2 keys), causal within each.
    q = torch.randn(5, 2, 8, requires_grad=True)
    k = torch.randn(6, 2, 8, requires_grad=True)
    v = torch.randn(6, 2, 8, requires_grad=True)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6], dtype=torch.int32)
    out = _call(backend, E.entmax_attention_varlen, q, k, v, cu_q, cu_k, 3, 4, is_causal=True, scale=0.0, alpha=1.5)
    expected = torch.cat([v[:1, :], v[:2].mean(0, keepdim=True), v[4:5], v[4:6].mean(0, keepdim=True),
                          v[4:6].mean(0, keepdim=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    dq, dk = torch.autograd.grad(out, (q, k), torch.randn_like(out))
    assert (dq == 0).all() and (dk == 0).all()


def test_varlen_softmax_matches_sdpa():
    q, k, v = (torch.randn(9, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    for scale in (0.0, -0.7):
        out = E.entmax_attention_varlen(q, k, v, cu, cu, 5, 5, scale=scale, alpha=1.0)
        for start, stop in ((0, 4), (4, 9)):
            piece = [t[start:stop].transpose(0, 1) for t in (q, k, v)]
            expected = F.scaled_dot_product_attention(*piece, scale=scale).transpose(0, 1)
            torch.testing.assert_close(out[start:stop], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["fusedmax", "oscarmax"])
def test_structured_attention_scale(kind):
    attention = getattr(E, f"{kind}_attention")
    reg = {"lam": 0.3} if kind == "fusedmax" else {"beta": 0.05}
    q, k, v = (t.detach().double().requires_grad_() for t in _inputs())
    mask = _mask(fully_masked_row=True)
    for backend in cpu_backends(kind):
        out = _call(backend, attention, q, k, v, attn_mask=mask, is_causal=True, scale=0.0, **reg)
        torch.testing.assert_close(out, _uniform(mask, True, v), atol=1e-12, rtol=0)
        dq, dk = torch.autograd.grad(out, (q, k), torch.randn_like(out))
        assert (dq == 0).all() and (dk == 0).all()
        negative = _call(backend, attention, q, k, v, attn_mask=mask, scale=-0.7, **reg)
        negated = _call(backend, attention, -q, k, v, attn_mask=mask, scale=0.7, **reg)
        torch.testing.assert_close(negative, negated, atol=1e-12, rtol=0)
