"""MultiheadEntmaxAttention vs torch.nn.MultiheadAttention (softmax) and vs the float64
oracle (entmax kinds); masks, causal hint, learned α, state_dict, replace_attention in
nn.TransformerEncoder / nn.Transformer with torch's fast paths in play."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from entmax_fast.multihead import MultiheadEntmaxAttention, replace_attention
from oracle import oracle_attention

EMBED, HEADS = 8, 2
CONFIGS = [pytest.param({}, id="plain"),
           pytest.param({"add_bias_kv": True, "add_zero_attn": True}, id="bias_kv+zero_attn"),
           pytest.param({"kdim": 6, "vdim": 5, "bias": False}, id="kdim_vdim_nobias")]
ENTMAX_KINDS = [pytest.param("sparsemax", 2.0, id="sparsemax"), pytest.param("entmax15", 1.5, id="entmax15"),
                pytest.param(1.25, 1.25, id="alpha1.25"), pytest.param("learned", None, id="learned")]
# Softmax kind vs torch: the same float32 ops up to matmul blocking.
SOFTMAX_TOL = {"atol": 1e-6, "rtol": 1e-5}
# Module in float64 vs the float64 oracle (bisection to 2^-200).
ORACLE_TOL = {"atol": 1e-10, "rtol": 1e-9}


def _pair(batch_first, attention="softmax", **config):
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first, **config)
    ours = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=batch_first, attention=attention, **config)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _inputs(batch_first, n=3, tgt=4, src=5, kdim=EMBED, vdim=EMBED, dtype=torch.float32):
    def make(length, width):
        shape = (n, length, width) if batch_first else (length, n, width)
        return torch.randn(shape, dtype=dtype)
    return make(tgt, EMBED), make(src, kdim), make(src, vdim)


def test_same_parameters_and_init_as_torch():
    torch.manual_seed(3)
    theirs = nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True)
    torch.manual_seed(3)
    ours = MultiheadEntmaxAttention(EMBED, HEADS, add_bias_kv=True, attention="entmax15")
    assert isinstance(ours, nn.MultiheadAttention)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("average", [True, False], ids=["avg", "per_head"])
def test_softmax_equals_torch(config, batch_first, need_weights, average):
    theirs, ours = _pair(batch_first, **config)
    query, key, value = _inputs(batch_first, kdim=config.get("kdim", EMBED), vdim=config.get("vdim", EMBED))
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, -2:] = True
    attn_mask = torch.randn(4, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: mixed bool/float masks are deprecated
        expected = theirs(query, key, value, key_padding_mask=padding, attn_mask=attn_mask,
                          need_weights=need_weights, average_attn_weights=average)
    got = ours(query, key, value, key_padding_mask=padding, attn_mask=attn_mask, need_weights=need_weights,
               average_attn_weights=average)
    torch.testing.assert_close(got[0], expected[0], **SOFTMAX_TOL)
    if need_weights:
        torch.testing.assert_close(got[1], expected[1], **SOFTMAX_TOL)
    else:
        assert got[1] is None and expected[1] is None


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
def test_softmax_equals_torch_bool_masks_3d_causal_hint_and_gradients(need_weights):
    theirs, ours = _pair(True)
    query = torch.randn(2, 5, EMBED, requires_grad=True)
    causal = nn.Transformer.generate_square_subsequent_mask(5).isinf()
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    float_padding = torch.zeros(2, 5).masked_fill(padding, float("-inf"))
    cases = [dict(attn_mask=causal, key_padding_mask=padding, is_causal=True),
             dict(attn_mask=causal, is_causal=True),
             dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(5), key_padding_mask=float_padding,
                  is_causal=True),
             dict(attn_mask=(torch.rand(2 * HEADS, 5, 5) > 0.7) & ~torch.eye(5, dtype=torch.bool))]
    for kwargs in cases:
        expected = theirs(query, query, query, need_weights=need_weights, **kwargs)[0]
        got = ours(query, query, query, need_weights=need_weights, **kwargs)[0]
        torch.testing.assert_close(got, expected, **SOFTMAX_TOL)
        grad_out = torch.randn_like(got)
        expected_grads = torch.autograd.grad(expected, [query, theirs.in_proj_weight], grad_out)
        got_grads = torch.autograd.grad(got, [query, ours.in_proj_weight], grad_out)
        for g, e in zip(got_grads, expected_grads):
            torch.testing.assert_close(g, e, **SOFTMAX_TOL)


def test_softmax_equals_torch_unbatched():
    theirs, ours = _pair(False)
    query, key = torch.randn(4, EMBED), torch.randn(6, EMBED)
    padding = torch.tensor([False, False, True, False, False, True])
    for need_weights in (True, False):
        expected = theirs(query, key, key, key_padding_mask=padding, need_weights=need_weights,
                          average_attn_weights=False)
        got = ours(query, key, key, key_padding_mask=padding, need_weights=need_weights, average_attn_weights=False)
        torch.testing.assert_close(got[0], expected[0], **SOFTMAX_TOL)
        if need_weights:
            assert got[1].shape == (HEADS, 4, 6)
            torch.testing.assert_close(got[1], expected[1], **SOFTMAX_TOL)


def _oracle_module_output(module, query, key, value, alpha, bool_attend=None, is_causal=False):
    """Float64 oracle of the batch-first module output from its own weights."""
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    n, lq, _ = query.shape
    split = lambda x: x.view(n, x.shape[1], HEADS, EMBED // HEADS).transpose(1, 2)  # noqa: E731
    q, k, v = split(F.linear(query, w_q, b_q)), split(F.linear(key, w_k, b_k)), split(F.linear(value, w_v, b_v))
    heads_out = oracle_attention(q, k, v, attn_mask=bool_attend, is_causal=is_causal, alpha=alpha)
    return module.out_proj(heads_out.transpose(1, 2).reshape(n, lq, EMBED))


@pytest.mark.parametrize("attention,alpha", ENTMAX_KINDS)
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
def test_entmax_kinds_vs_oracle(attention, alpha, need_weights):
    torch.manual_seed(2)
    module = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, attention=attention, dtype=torch.float64,
                                      alpha_init=1.7)
    if attention == "learned":
        with torch.no_grad():
            module.alpha_logit.copy_(torch.tensor([-1.0, 1.5], dtype=torch.float64))
        alpha = module.alpha.detach()
        assert torch.allclose(alpha, 1 + torch.sigmoid(module.alpha_logit.detach()))
    query = 3 * torch.randn(2, 7, EMBED, dtype=torch.float64)
    key = 3 * torch.randn(2, 9, EMBED, dtype=torch.float64)
    value = torch.randn(2, 9, EMBED, dtype=torch.float64)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 5:] = True
    got, weights = module(query, key, value, key_padding_mask=padding, need_weights=need_weights,
                          average_attn_weights=False)
    expected = _oracle_module_output(module, query, key, value, alpha, bool_attend=~padding.view(2, 1, 1, 9))
    torch.testing.assert_close(got, expected, **ORACLE_TOL)
    if need_weights:
        assert weights.shape == (2, HEADS, 7, 9)
        assert torch.all(weights[1, :, :, 5:] == 0)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, HEADS, 7, dtype=torch.float64), **ORACLE_TOL)


def test_sparse_kinds_give_exact_zeros():
    torch.manual_seed(4)
    module = MultiheadEntmaxAttention(EMBED, HEADS, attention="sparsemax")
    query = 4 * torch.randn(6, 2, EMBED)
    _, weights = module(query, query, query, average_attn_weights=False)
    assert (weights == 0).float().mean() > 0.2


@pytest.mark.parametrize("attention", ["entmax15", "learned", "softmax", "fusedmax"])
def test_causal_hint_matches_explicit_mask(attention):
    torch.manual_seed(5)
    module = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, attention=attention, dtype=torch.float64)
    x = torch.randn(2, 6, EMBED, dtype=torch.float64)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    with_hint, _ = module(x, x, x, attn_mask=causal, key_padding_mask=padding, is_causal=True, need_weights=False)
    with_mask, _ = module(x, x, x, attn_mask=causal, key_padding_mask=padding, need_weights=False)
    with_weights, weights = module(x, x, x, attn_mask=causal, key_padding_mask=padding, is_causal=True)
    torch.testing.assert_close(with_hint, with_mask, **ORACLE_TOL)
    torch.testing.assert_close(with_weights, with_mask, **ORACLE_TOL)
    assert torch.all(weights.masked_select(causal.view(1, 6, 6).expand_as(weights)) == 0)


def test_fusedmax_encoder_with_causal_mask_hint_and_padding():
    # nn.TransformerEncoder's standard causal call: mask, is_causal=True and a padding mask
    # together (the hint sends fusedmax_attention both the padding mask and is_causal).
    torch.manual_seed(11)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=16, dropout=0.0, batch_first=True,
                                       dtype=torch.float64)
    encoder = replace_attention(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                                attention="fusedmax", lam=0.2)
    x = torch.randn(2, 6, EMBED, dtype=torch.float64, requires_grad=True)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    with_hint = encoder(x, mask=causal, src_key_padding_mask=padding, is_causal=True)
    with_mask = encoder(x, mask=causal, src_key_padding_mask=padding)
    torch.testing.assert_close(with_hint, with_mask, **ORACLE_TOL)
    # Causal and padded: position i of sequence 1 depends only on its own unpadded prefix (a
    # random weighting of the features: their plain sum is constant after the LayerNorm).
    weighting = torch.randn(EMBED, dtype=torch.float64)
    grad, = torch.autograd.grad((with_hint[1, 2] * weighting).sum(), x, retain_graph=True)
    assert torch.all(grad[0] == 0) and torch.all(grad[1, 3:] == 0) and torch.all(grad[1, :3].abs().sum(-1) > 0)
    grad, = torch.autograd.grad((with_hint[1, 5] * weighting).sum(), x)
    assert torch.all(grad[1, 4] == 0) and torch.all(grad[1, :4].abs().sum(-1) > 0)


def test_fully_masked_query_gives_zeros_and_zero_gradients():
    module = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, attention="entmax15", bias=False)
    query = torch.randn(1, 3, EMBED, requires_grad=True)
    mask = torch.tensor([[False, False], [True, True], [False, True]])
    for need_weights in (True, False):
        out, _ = module(query, query[:, :2], query[:, :2], attn_mask=mask, need_weights=need_weights)
        assert torch.isfinite(out).all()
        # bias=False: no out_proj bias, so an all-masked row's output is exactly 0.
        assert torch.all(out[0, 1] == 0)
        grad, = torch.autograd.grad(out[0, 1].sum(), query)
        assert torch.isfinite(grad).all() and torch.all(grad == 0)


def test_learned_alpha_gets_gradient_and_stays_in_range():
    torch.manual_seed(6)
    module = MultiheadEntmaxAttention(EMBED, HEADS, attention="learned", alpha_init=1.5)
    torch.testing.assert_close(module.alpha, torch.full((HEADS,), 1.5))
    x = torch.randn(5, 2, EMBED)
    for need_weights in (True, False):
        module.zero_grad()
        out, _ = module(x, x, x, need_weights=need_weights)
        (out * torch.randn_like(out)).sum().backward()
        assert torch.all(module.alpha_logit.grad.abs() > 0)
    with torch.no_grad():
        module.alpha_logit.copy_(torch.tensor([-50.0, 50.0]))
    assert module.alpha[0].item() == pytest.approx(1.01) and module.alpha[1].item() == pytest.approx(2.0)
    assert torch.isfinite(module(x, x, x, need_weights=False)[0]).all()


def test_state_dict_round_trip_with_torch():
    torch.manual_seed(7)
    theirs = nn.MultiheadAttention(EMBED, HEADS)
    learned = MultiheadEntmaxAttention(EMBED, HEADS, attention="learned", alpha_init=1.3)
    learned.load_state_dict(theirs.state_dict())  # no alpha_logit in torch's checkpoint: α kept
    torch.testing.assert_close(learned.alpha, torch.full((HEADS,), 1.3))
    assert torch.equal(learned.in_proj_weight, theirs.in_proj_weight)
    with pytest.raises(RuntimeError, match="alpha_logit"):
        nn.MultiheadAttention(EMBED, HEADS).load_state_dict(learned.state_dict())
    fixed = MultiheadEntmaxAttention(EMBED, HEADS, attention="sparsemax")
    nn.MultiheadAttention(EMBED, HEADS).load_state_dict(fixed.state_dict())


def test_fusedmax_weights_and_fused_paths_agree():
    from entmax_fast.structured import fusedmax

    torch.manual_seed(8)
    module = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, attention="fusedmax", lam=0.3,
                                      dtype=torch.float64)
    x = 2 * torch.randn(2, 5, EMBED, dtype=torch.float64)
    padding = torch.tensor([[False] * 5, [False, False, False, False, True]])
    fused, _ = module(x, x, x, key_padding_mask=padding, need_weights=False)
    explicit, weights = module(x, x, x, key_padding_mask=padding, average_attn_weights=False)
    torch.testing.assert_close(fused, explicit, **ORACLE_TOL)
    assert torch.all(weights[1, :, :, 4] == 0)
    scores_row = torch.tensor([[1.0, 2.1, 1.9]], dtype=torch.float64)
    torch.testing.assert_close(fusedmax(scores_row, 0.1), torch.tensor([[0.0, 0.5, 0.5]], dtype=torch.float64))


def _encoder(batch_first, dropout=0.0):
    torch.manual_seed(9)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=16, dropout=dropout, batch_first=batch_first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # enable_nested_tensor note when not batch_first
        return nn.TransformerEncoder(layer, num_layers=2)


def _padded_batch(batch_first):
    x = torch.randn(3, 6, EMBED)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, 2:] = True
    return (x if batch_first else x.transpose(0, 1)), padding


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's own model, eval path
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_replace_attention_softmax_keeps_encoder_outputs(batch_first):
    original = _encoder(batch_first)
    swapped = replace_attention(_encoder(batch_first), attention="softmax")
    assert all(isinstance(layer.self_attn, MultiheadEntmaxAttention) for layer in swapped.layers)
    x, padding = _padded_batch(batch_first)
    keep = ~padding if batch_first else ~padding.t()
    torch.testing.assert_close(swapped(x, src_key_padding_mask=padding), original(x, src_key_padding_mask=padding),
                               **SOFTMAX_TOL)
    original.eval()
    swapped.eval()
    with torch.no_grad():  # torch's fused / nested-tensor inference paths; padded rows differ (zeros there)
        expected = original(x, src_key_padding_mask=padding)
        got = swapped(x, src_key_padding_mask=padding)
    torch.testing.assert_close(got[keep], expected[keep], **SOFTMAX_TOL)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("attention", ["entmax15", "learned"])
def test_replace_attention_entmax_is_used_on_every_path(batch_first, attention, monkeypatch):
    swapped = replace_attention(_encoder(batch_first), attention=attention)
    x, padding = _padded_batch(batch_first)
    calls = []
    fused = MultiheadEntmaxAttention._fused_attention

    def counting(module, *args):
        calls.append(module.attention)
        return fused(module, *args)

    # Counted by patching, not with a hook: a hook would itself switch torch's fast path off.
    monkeypatch.setattr(MultiheadEntmaxAttention, "_fused_attention", counting)
    training_out = swapped(x, src_key_padding_mask=padding)
    training_out.sum().backward()
    assert calls == [attention, attention]
    assert all(torch.isfinite(p.grad).all() for p in swapped.parameters() if p.grad is not None)
    swapped.eval()
    with torch.no_grad():
        inference_out = swapped(x, src_key_padding_mask=padding)
    assert calls == [attention] * 4
    torch.testing.assert_close(inference_out, training_out.detach(), **SOFTMAX_TOL)
    softmax_out = replace_attention(_encoder(batch_first), attention="softmax")(x, src_key_padding_mask=padding)
    assert (softmax_out - training_out).abs().max() > 1e-3


def test_hooks_do_not_hide_our_forward_in_a_fresh_encoder_layer():
    # Built directly (no replace_attention): the layer's fused softmax path must stay off.
    torch.manual_seed(10)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=16, dropout=0.0, batch_first=True)
    layer.self_attn = MultiheadEntmaxAttention.from_torch(layer.self_attn, attention="sparsemax")
    x = torch.randn(2, 5, EMBED)
    grad_out = layer(x)
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), grad_out.detach(), **SOFTMAX_TOL)


def test_replace_attention_in_full_transformer():
    torch.manual_seed(11)
    model = nn.Transformer(EMBED, HEADS, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                           dropout=0.0, batch_first=True)
    replace_attention(model, attention=1.3)
    swapped = [m for m in model.modules() if isinstance(m, MultiheadEntmaxAttention)]
    assert len(swapped) == 3 and all(m.attention == 1.3 for m in swapped)
    src, tgt = torch.randn(2, 5, EMBED), torch.randn(2, 4, EMBED)
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    out = model(src, tgt, tgt_mask=causal, tgt_is_causal=True)
    assert out.shape == (2, 4, EMBED) and torch.isfinite(out).all()
    replace_attention(model, attention="sparsemax")
    assert all(m.attention == 1.3 for m in model.modules() if isinstance(m, MultiheadEntmaxAttention))
    replace_attention(model, attention="sparsemax", include_ours=True)
    assert all(m.attention == "sparsemax" for m in model.modules() if isinstance(m, MultiheadEntmaxAttention))


@pytest.mark.parametrize("kwargs,error,match", [
    pytest.param({"attention": "relu"}, ValueError, "attention must be one of", id="unknown_kind"),
    pytest.param({"attention": 0.5}, ValueError, "finite and >= 1", id="alpha_below_1"),
    pytest.param({"attention": True}, TypeError, "attention must be", id="bool"),
    pytest.param({"attention": "learned", "alpha_init": 2.0}, ValueError, "alpha_init", id="alpha_init"),
    pytest.param({"attention": "fusedmax", "lam": 0.0}, ValueError, "lam", id="lam"),
])
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiheadEntmaxAttention(EMBED, HEADS, **kwargs)


def test_forward_errors():
    module = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True)
    x = torch.randn(2, 3, EMBED)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        module(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(L, S\)"):
        module(x, x, x, attn_mask=torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(N, S\)"):
        module(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="embed_dim=8"):
        module(torch.randn(2, 3, 4), x, x)
    nested = torch.nested.nested_tensor([torch.randn(3, EMBED), torch.randn(2, EMBED)])
    with pytest.raises(ValueError, match="nested tensor"):
        module(nested, nested, nested)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        replace_attention("model")
    with pytest.raises(TypeError, match="from_torch"):
        replace_attention(nn.MultiheadAttention(EMBED, HEADS))
