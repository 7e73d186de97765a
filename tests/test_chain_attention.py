"""crf_attention / sparsemap_attention and MultiheadEntmaxAttention(attention="crf" | "sparsemap"):
weights = chain marginals over each query row's attendable keys, masked keys removed from the
chain, against dense computations with the reference mappings."""
import pytest
import torch
from torch import nn

import entmax_fast
from entmax_fast import MultiheadEntmaxAttention, chain, dispatch, replace_attention
from entmax_fast.multihead import SPARSEMAP_INITIAL_W, initial_chain_transitions
from entmax_fast.reference import chain as R

NEG_INF = float("-inf")
KINDS = ["crf", "sparsemap"]


def _has_cpp() -> bool:
    ok, _ = dispatch.availability("cpp")
    return ok and hasattr(torch.ops.entmax_fast, "crf_forward")


BACKENDS = [pytest.param("reference", id="reference"),
            pytest.param("cpp", marks=pytest.mark.skipif(not _has_cpp(), reason="no chain operators"), id="cpp")]


def attention(kind):
    return entmax_fast.crf_attention if kind == "crf" else entmax_fast.sparsemap_attention


def reference_mapping(kind):
    return R.crf_marginals if kind == "crf" else R.sparsemap_marginals


def qkv(B=2, H=3, Lq=5, Lk=7, E=4, Hkv=None, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, E, generator=gen, dtype=dtype) * 1.5
    k = torch.randn(B, Hkv or H, Lk, E, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv or H, Lk, E + 1, generator=gen, dtype=dtype)
    return q, k, v


def dense(kind, q, k, v, T, valid):
    """Row by row: the reference mapping on the valid keys only (the chain over them)."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    B, H, Lq, Lk = scores.shape
    weights = torch.zeros_like(scores)
    for b in range(B):
        for h in range(H):
            Th = T if T.dim() == 2 else T[h]
            for i in range(Lq):
                keep = valid[b, h, i]
                if keep.any():
                    weights[b, h, i, keep] = reference_mapping(kind)(scores[b, h, i, keep], Th)
    return weights @ v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("masking", ["none", "bool", "causal", "both", "additive"])
def test_attention_matches_dense(kind, masking, backend):
    q, k, v = qkv(seed=hash(masking) % 100)
    gen = torch.Generator().manual_seed(3)
    T = torch.randn(3, 2, 2, generator=gen, dtype=torch.float64)
    valid = torch.ones(2, 3, 5, 7, dtype=torch.bool)
    mask = None
    if masking in ("bool", "both"):
        mask = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
        mask[0, 0, 2] = False  # a row with every key masked: zero weights, zero output
        valid = valid & mask
    if masking == "additive":
        keep = torch.rand(2, 3, 5, 7, generator=gen) > 0.3
        mask = torch.zeros(2, 3, 5, 7, dtype=torch.float64).masked_fill(~keep, NEG_INF)
        valid = valid & keep
    causal = masking in ("causal", "both")
    if causal:
        valid = valid & torch.ones(5, 7, dtype=torch.bool).tril()
    with dispatch.use_backend(backend):
        out = attention(kind)(q, k, v, T, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(out, dense(kind, q, k, v, T, valid.expand(2, 3, 5, 7)), atol=1e-9, rtol=0)
    if masking == "both":
        assert (out[0, :, 2] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_causal_row_is_the_chain_over_keys_up_to_i(kind):
    q, k, v = qkv(B=1, H=1, Lq=6, Lk=6, seed=4)
    T = torch.tensor([[0.2, -0.4], [-0.3, 0.9]], dtype=torch.float64)
    scores = q @ k.transpose(-2, -1) / 2.0
    for i in range(6):
        expected = reference_mapping(kind)(scores[0, 0, i, :i + 1], T) @ v[0, 0, :i + 1]
        out = attention(kind)(q, k, v, T, is_causal=True)
        torch.testing.assert_close(out[0, 0, i], expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_per_head_transitions_and_gqa(kind):
    q, k, v = qkv(H=4, Hkv=2, seed=5)
    T = torch.randn(4, 2, 2, dtype=torch.float64)
    out = attention(kind)(q, k, v, T, enable_gqa=True)
    repeated = attention(kind)(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), T)
    torch.testing.assert_close(out, repeated, atol=1e-12, rtol=0)
    for h in range(4):
        one = attention(kind)(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1], T[h])
        torch.testing.assert_close(out[:, h:h + 1], one, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_gradcheck_float64(kind):
    q, k, v = qkv(B=1, H=2, Lq=3, Lk=4, E=2, seed=6)
    T = torch.randn(2, 2, 2, dtype=torch.float64)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v, T))
    mask = torch.tensor([[True, True, False, True]]).expand(3, 4)
    assert torch.autograd.gradcheck(lambda *a: attention(kind)(*a, attn_mask=mask, is_causal=False), inputs)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_bad_input(kind):
    name = f"{kind}_attention"
    q, k, v = qkv()
    T = torch.zeros(2, 2, dtype=torch.float64)
    fn = attention(kind)
    with pytest.raises(TypeError, match=f"{name}: is_causal must be a bool .*, got int"):
        fn(q, k, v, T, is_causal=1)
    with pytest.raises(TypeError, match=f"{name}: is_causal must be a bool .*, got float"):
        fn(q, k, v, T, None, 0.0)  # an SDPA-style positional dropout_p lands on is_causal
    with pytest.raises(ValueError, match=r"transitions must have shape \(2, 2\) or \(H, 2, 2\) with H = query's heads"):
        fn(q, k, v, torch.zeros(2, 2, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match=f"{name}: transitions must be a torch.Tensor"):
        fn(q, k, v, None)
    with pytest.raises(ValueError, match="transitions must be finite"):
        fn(q, k, v, torch.full((2, 2), float("nan"), dtype=torch.float64))
    with pytest.raises(TypeError, match="value must have query's dtype"):
        fn(q, k, v.float(), T)
    with pytest.raises(ValueError, match="attn_mask must be broadcastable"):
        fn(q, k, v, T, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key/value have 2 heads but query has 3"):
        fn(q, k[:, :2], v[:, :2], T)


# ---------------------------------------------------------------------------------------
# nn.

@pytest.mark.parametrize("kind", KINDS)
def test_module_learns_its_transitions(kind):
    torch.manual_seed(0)
    module = MultiheadEntmaxAttention(16, 4, batch_first=True, attention=kind)
    assert module.chain_transitions.shape == (4, 2, 2) and module.alpha is None
    x = torch.randn(2, 6, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad():
        module.chain_transitions.normal_()
    out_weights, weights = module(x, x, x, attn_mask=causal, need_weights=True, average_attn_weights=False)
    out_fused, _ = module(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    torch.testing.assert_close(out_fused, out_weights, atol=1e-5, rtol=1e-5)
    assert (weights.triu(1) == 0).all()
    out_fused.sum().backward()
    assert module.chain_transitions.grad is not None and module.chain_transitions.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_default_transitions_and_their_gradient(kind):
    # The CRF starts at T = 0; SparseMAP at w = T00 + T11 − T01 − T10 = SPARSEMAP_INITIAL_W > 0
    # with no shift of the scores, off the kink of its loss at w = 0: every head's w gets a
    # gradient on a generic batch.
    torch.manual_seed(2)
    module = MultiheadEntmaxAttention(16, 4, batch_first=True, attention=kind)
    T = module.chain_transitions.detach()
    w = T[:, 0, 0] + T[:, 1, 1] - T[:, 0, 1] - T[:, 1, 0]
    expected_w = SPARSEMAP_INITIAL_W if kind == "sparsemap" else 0.0
    assert SPARSEMAP_INITIAL_W > 0
    torch.testing.assert_close(w, torch.full((4,), expected_w), atol=1e-7, rtol=0)
    # (w/4)·[[1, −1], [−1, 1]]: the edge terms that shift the scores are 0.
    torch.testing.assert_close(T, expected_w / 4 * torch.tensor([[1.0, -1.0], [-1.0, 1.0]]).expand(4, 2, 2))
    x = torch.randn(3, 10, 16)
    out, _ = module(x, x, x, need_weights=False)
    (out * torch.randn_like(out)).sum().backward()
    grad = module.chain_transitions.grad
    w_grad = grad[:, 0, 0] + grad[:, 1, 1] - grad[:, 0, 1] - grad[:, 1, 0]
    assert (w_grad.abs() > 1e-6).all(), w_grad


@pytest.mark.parametrize("kind", KINDS)
def test_replace_attention_and_plain_checkpoints(kind):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dropout=0.1)
    plain = nn.MultiheadAttention(16, 2, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    replace_attention(encoder, attention=kind)
    attn = encoder.layers[0].self_attn
    assert isinstance(attn, MultiheadEntmaxAttention) and attn.attention == kind
    encoder.train()
    encoder(torch.randn(2, 5, 16)).sum().backward()  # dropout on the weights in training
    assert attn.chain_transitions.grad is not None
    module = MultiheadEntmaxAttention(16, 2, batch_first=True, attention=kind)
    module.load_state_dict(plain.state_dict(), strict=True)  # the transitions keep their initial value
    assert torch.equal(module.chain_transitions, initial_chain_transitions(kind, 2))
    with pytest.raises(ValueError, match=f"attention='{kind}' takes none of"):
        MultiheadEntmaxAttention(16, 2, attention=kind, softcap=5.0)
