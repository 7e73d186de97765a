"""attention_weights and support_size against the float64 oracle (its output with one-hot
values is the weights) on every CPU backend of the mapping, with masks, GQA, a tensor α and
the score options; rows sum to one with exact zeros; weights @ value is entmax_attention;
support_size, counted by each attention backend from its own forward, is the oracle's
support up to keys within float32 rounding of the threshold."""
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import entmax_fast
from entmax_fast.reference import attention as reference_attention
from devices import cpu_backends
from oracle import oracle_attention

B, H, HKV, LQ, LK, E = 2, 4, 2, 7, 11, 8
ALPHA_HEADS = (1.0, 1.5, 2.0, 1.25)
CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool_mask": {"attn_mask": torch.rand(B, 1, LQ, LK, generator=torch.Generator().manual_seed(1)) > 0.3},
    "lower_right": {"attn_mask": causal_lower_right(LQ, LK)},
    "window": {"window_size": (3, 1)},
    "softcap_alibi": {"softcap": 1.5, "alibi_slopes": torch.rand(B, H, generator=torch.Generator().manual_seed(2))},
    "sinks": {"sinks": torch.randn(H, generator=torch.Generator().manual_seed(3))},
}


def _inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, LQ, E, generator=generator, dtype=torch.float64) * 2).to(dtype)
    k = torch.randn(B, HKV, LK, E, generator=generator, dtype=torch.float64).to(dtype)
    return q, k


def _oracle_weights(q, k, alpha, options):
    one_hot = torch.eye(LK, dtype=torch.float64).expand(B, HKV, LK, LK)
    return oracle_attention(q.double(), k.double(), one_hot, alpha=alpha, **options)


def _cast(options, dtype):
    return {name: value.to(dtype) if name == "sinks" else value for name, value in options.items()}


# The scores are backend-independent; the Triton interpreter (seconds per call) maps one case.
PARAMS = [pytest.param(backend, case, id=f"{case}-{backend}") for backend in cpu_backends("entmax")
          for case in (CASES if backend != "triton" else ("softcap_alibi",))]


@pytest.mark.parametrize("backend,case", PARAMS)
def test_weights_match_the_oracle(backend, case):
    dtype = torch.float32
    q, k = _inputs(dtype)
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype)
    options = _cast(CASES[case], dtype)
    with entmax_fast.use_backend(backend):
        weights = entmax_fast.attention_weights(q, k, enable_gqa=True, alpha=alpha, **options)
    expected = _oracle_weights(q, k, alpha.double(), _cast(options, torch.float64))
    assert weights.shape == (B, H, LQ, LK) and weights.dtype == dtype
    torch.testing.assert_close(weights.double(), expected, atol=1e-5, rtol=1e-5)
    # The sparse heads have exact zeros.
    assert (weights[:, 2] == 0).any()
    totals = weights.double().sum(-1)
    alive = expected.sum(-1) > 0
    if "sinks" not in options:
        torch.testing.assert_close(totals[alive], torch.ones_like(totals[alive]), atol=1e-6, rtol=0)
    assert (totals[~alive] == 0).all()


def test_weights_times_value_is_entmax_attention_and_gradients_match_the_oracle():
    q, k = _inputs(torch.float64, seed=4)
    v = torch.randn(B, HKV, LK, 5, dtype=torch.float64)
    alpha = torch.tensor(ALPHA_HEADS[1:] + (1.75,), dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    q.requires_grad_()
    options = {"window_size": (4, 0), "softcap": 2.0}
    weights = entmax_fast.attention_weights(q, k, enable_gqa=True, alpha=alpha, sinks=sinks, **options)
    out = entmax_fast.entmax_attention(q, k, v, enable_gqa=True, alpha=alpha, sinks=sinks, **options)
    torch.testing.assert_close(weights @ v.repeat_interleave(H // HKV, dim=1), out, atol=1e-12, rtol=1e-12)
    probe = torch.randn(B, H, LQ, LK, dtype=torch.float64)
    grads = torch.autograd.grad((weights * probe).sum(), (q, alpha, sinks))
    expected = oracle_attention(q, k, torch.eye(LK, dtype=torch.float64).expand(B, HKV, LK, LK), alpha=alpha,
                                sinks=sinks, **options)
    expected_grads = torch.autograd.grad((expected * probe).sum(), (q, alpha, sinks))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-8, rtol=1e-7)


def test_support_size_works_in_chunks():
    """The reference backend's counts over a few rows at a time equal one dense block's."""
    q, k = _inputs(torch.float32, seed=5)
    dense = (entmax_fast.attention_weights(q, k, enable_gqa=True, alpha=2.0, is_causal=True) > 0).sum(-1)
    counts = reference_attention.attention_support_forward(q, k, None, 2.0, scale=E ** -0.5, is_causal=True,
                                                           enable_gqa=True, chunk_elements=B * H * (LK + 1) * 2)
    torch.testing.assert_close(counts, dense)
    assert (dense[..., 0] == 1).all()  # causal: the first query sees one key


SUPPORT_PARAMS = [pytest.param(backend, case, id=f"{case}-{backend}") for backend in cpu_backends("attention_support")
                  for case in CASES]


@pytest.mark.parametrize("backend,case", SUPPORT_PARAMS)
def test_support_size_of_each_attention_backend_matches_the_oracle(backend, case):
    """Each backend counts from its own float32 forward: every key whose float64 weight p has
    a clear gap p^(α-1) > 1e-5 to the threshold, none the oracle weighs 0; the keys between
    are float32 rounding's to decide."""
    q, k = _inputs(torch.float32, seed=7)
    alpha = torch.tensor(ALPHA_HEADS[1:] + (1.75,), dtype=torch.float32)
    options = _cast(CASES[case], torch.float32)
    with entmax_fast.use_backend(backend):
        counts = entmax_fast.support_size(q, k, enable_gqa=True, alpha=alpha, **options)
    assert entmax_fast.backend_info()["last_choice"]["attention_support"]["backend"] == backend
    expected = _oracle_weights(q, k, alpha.double(), _cast(options, torch.float64))
    assert counts.dtype == torch.int64 and counts.shape == (B, H, LQ)
    gaps = expected ** (alpha.double() - 1).view(1, -1, 1, 1)
    clear, whole = (gaps > 1e-5).sum(-1), (expected > 0).sum(-1)
    assert ((clear <= counts) & (counts <= whole)).all()
    assert (clear == whole).float().mean() > 0.9
    assert ((counts > 0) & (counts < LK)).any()


def test_zero_sizes_and_bad_input():
    q, k = _inputs(torch.float32, seed=6)
    assert entmax_fast.attention_weights(q, k[:, :, :0], enable_gqa=True).shape == (B, H, LQ, 0)
    assert entmax_fast.support_size(q[:, :, :0], k, enable_gqa=True).shape == (B, H, 0)
    uniform = entmax_fast.attention_weights(q[..., :0], k[..., :0], enable_gqa=True)
    torch.testing.assert_close(uniform, torch.full((B, H, LQ, LK), 1 / LK))
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        entmax_fast.attention_weights(q, k)
    with pytest.raises(ValueError, match="window_size"):
        entmax_fast.support_size(q, k, enable_gqa=True, window_size=(-3, 0))
