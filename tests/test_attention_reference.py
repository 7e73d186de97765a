"""Reference entmax attention: vs the dense float64 composition, gradients, masks, causal
alignment, GQA, dropout, α per head, memory bound."""
import pytest
import torch
import torch.nn.functional as F

import entmax_fast
from entmax_fast.reference.attention import entmax_attention as reference_attention
from oracle import oracle_attention

ALPHAS = [pytest.param(1.25, id="a1.25"), pytest.param(1.5, id="a1.5"), pytest.param(2.0, id="a2"),
          pytest.param("per_head", id="per_head")]


def _alpha(alpha, heads):
    if alpha == "per_head":
        return torch.linspace(1.1, 2.0, heads, dtype=torch.float64)
    return alpha


def _qkv(b, h, lq, lk, e, dtype=torch.float64, hkv=None, ev=None):
    q = torch.randn(b, h, lq, e, dtype=dtype)
    k = torch.randn(b, hkv or h, lk, e, dtype=dtype)
    v = torch.randn(b, hkv or h, lk, ev or e, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (5, 9), (9, 5), (63, 130)])
def test_forward_matches_dense_oracle(alpha, is_causal, lq, lk):
    q, k, v = _qkv(2, 3, lq, lk, 8)
    a = _alpha(alpha, 3)
    out = reference_attention(q, k, v, is_causal=is_causal, alpha=a, chunk_elements=64)
    torch.testing.assert_close(out, oracle_attention(q, k, v, is_causal=is_causal, alpha=a), atol=1e-12, rtol=0)


def test_gradcheck_all_inputs_with_masks_and_per_head_alpha():
    q, k, v = _qkv(1, 2, 4, 6, 3, hkv=1)
    mask = torch.randn(4, 6, dtype=torch.float64)
    alpha = torch.tensor([1.3, 1.8], dtype=torch.float64)
    args = [t.requires_grad_() for t in (q, k, v, mask, alpha)]

    def f(q, k, v, mask, alpha):
        return reference_attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True, alpha=alpha,
                                   chunk_elements=8)

    assert torch.autograd.gradcheck(f, args)


def test_bool_mask_and_fully_masked_rows():
    q, k, v = _qkv(2, 2, 5, 6, 4)
    mask = torch.rand(2, 1, 5, 6) > 0.4
    mask[0, 0, 2] = False
    q.requires_grad_()
    out = reference_attention(q, k, v, attn_mask=mask, alpha=1.5, chunk_elements=16)
    torch.testing.assert_close(out, oracle_attention(q, k, v, attn_mask=mask, alpha=1.5), atol=1e-12, rtol=0)
    assert (out[0, :, 2] == 0).all()
    out.sum().backward()
    assert (q.grad[0, :, 2] == 0).all() and not q.grad.isnan().any()


def test_alpha_one_is_softmax_attention():
    q, k, v = _qkv(2, 2, 9, 11, 8)
    mask = torch.rand(9, 11) > 0.3
    mask[:, 0] = True
    ours = entmax_fast.entmax_attention(q, k, v, attn_mask=mask, is_causal=False, alpha=1.0)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-12, rtol=0)


def test_causal_alignment_matches_sdpa_for_unequal_lengths():
    for lq, lk in ((3, 5), (5, 3)):
        q, k, v = _qkv(1, 1, lq, lk, 4)
        ours = entmax_fast.entmax_attention(q, k, v, is_causal=True, alpha=1.0)
        torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-12, rtol=0)


def test_dropout_is_reproducible_and_backward_uses_the_same_mask():
    q, k, v = _qkv(1, 2, 6, 6, 4)
    q.requires_grad_()

    def f(q):
        torch.manual_seed(7)
        return reference_attention(q, k, v, dropout_p=0.3, alpha=1.5, chunk_elements=12)

    a, b = f(q), f(q)
    assert torch.equal(a, b)
    assert not torch.equal(a, reference_attention(q, k, v, alpha=1.5))
    assert torch.autograd.gradcheck(f, (q,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_huge_and_offset_scores(dtype):
    q, k, v = _qkv(1, 2, 16, 16, 8, dtype=torch.float32)
    for q_case in (q * 100, q - 1000):
        out = entmax_fast.entmax_attention(q_case.to(dtype), k.to(dtype), v.to(dtype), alpha=1.5)
        assert out.dtype == dtype and not out.isnan().any()


def test_scores_are_never_materialised_for_the_whole_batch(monkeypatch):
    """Peak number of score entries alive at once stays at the chunk budget."""
    import entmax_fast.reference.attention as ref

    biggest = []
    original = ref.masked_scores

    def spy(*args, **kwargs):
        scores = original(*args, **kwargs)
        biggest.append(scores.numel())
        return scores

    monkeypatch.setattr(ref, "masked_scores", spy)
    q, k, v = _qkv(2, 2, 64, 64, 4, dtype=torch.float32)
    q.requires_grad_()
    ref.entmax_attention(q, k, v, alpha=1.5, chunk_elements=1024).sum().backward()
    assert max(biggest) <= 1024 < 2 * 2 * 64 * 64


def test_float_mask_gradient_through_public_function():
    """A float mask that requires grad gets one, whichever backend the default picks."""
    q, k, v = _qkv(1, 2, 4, 6, 3)
    mask = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda m: entmax_fast.entmax_attention(q, k, v, attn_mask=m, alpha=1.5), (mask,))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_varlen_matches_each_sequence_alone(backend):
    lengths_q, lengths_k = [3, 1, 7], [5, 2, 7]
    cu_q = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 14], dtype=torch.int32)
    q = torch.randn(11, 4, 16, requires_grad=True)
    k = torch.randn(14, 2, 16, requires_grad=True)
    v = torch.randn(14, 2, 16, requires_grad=True)
    alpha = torch.tensor([1.25, 1.5, 1.75, 2.0])
    with entmax_fast.use_backend(backend):
        out = entmax_fast.entmax_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  is_causal=True, alpha=alpha)
    assert entmax_fast.dispatch.last_choice("attention_varlen").backend == backend
    for b in range(3):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        expected = oracle_attention(q[rows_q].transpose(0, 1)[None], k[rows_k].transpose(0, 1)[None],
                                    v[rows_k].transpose(0, 1)[None], is_causal=True, alpha=alpha.double())
        torch.testing.assert_close(out[rows_q].double(), expected[0].transpose(0, 1), atol=1e-5, rtol=0)
    out.square().sum().backward()
    assert all(t.grad is not None and not t.grad.isnan().any() for t in (q, k, v))


def test_varlen_errors():
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32 tensor"):
        entmax_fast.entmax_attention_varlen(q, k, v, cu.long(), cu, 5, 5)
    with pytest.raises(ValueError, match=r"q must be 3-D \(total_tokens, H, E\)"):
        entmax_fast.entmax_attention_varlen(q[None], k, v, cu, cu, 5, 5)
    with pytest.raises(ValueError, match=r"q heads \(2\) must be divisible by k/v heads \(3\)"):
        entmax_fast.entmax_attention_varlen(q, torch.randn(5, 3, 8), torch.randn(5, 3, 8), cu, cu, 5, 5)
    with pytest.raises(ValueError, match="alpha must be finite and >= 1"):
        entmax_fast.entmax_attention_varlen(q, k, v, cu, cu, 5, 5, alpha=0.5)
