"""MultiheadEntmaxAttention's score options (window_size, softcap, alibi, sinks): the explicit
path (need_weights=True, its own score code) and the fused path (entmax_attention) give the
same outputs and gradients; softmax with a window equals nn.MultiheadAttention with the
equivalent mask; ALiBi slopes are BLOOM's; sinks are a parameter that checkpoints of a plain
nn.MultiheadAttention load into; fusedmax refuses the options."""
import math

import pytest
import torch
from torch import nn

from entmax_fast.multihead import MultiheadEntmaxAttention, alibi_slopes, replace_attention

EMBED, HEADS = 12, 3
OPTIONS = [pytest.param({"window_size": (2, 0)}, id="window"),
           pytest.param({"window_size": (1, 2)}, id="window_both_sides"),
           pytest.param({"softcap": 0.7}, id="softcap"),
           pytest.param({"alibi": True}, id="alibi"),
           pytest.param({"sinks": True}, id="sinks"),
           pytest.param({"window_size": (3, 0), "softcap": 1.5, "alibi": True, "sinks": True}, id="all")]
KINDS = ["softmax", "sparsemax", "entmax15", 1.3, "learned"]
# float64 module: the two paths differ only by the float64 rounding of their threshold searches.
TOL = {"atol": 1e-9, "rtol": 1e-9}


def _module(attention, options, seed=0):
    torch.manual_seed(seed)
    module = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, attention=attention, dtype=torch.float64,
                                      **options)
    if module.sinks is not None:
        with torch.no_grad():
            module.sinks.copy_(torch.randn(HEADS, dtype=torch.float64))
    return module


def _inputs(tgt=6, src=6, batch=2):
    torch.manual_seed(7)
    query = (torch.randn(batch, tgt, EMBED, dtype=torch.float64) * 2).requires_grad_()
    memory = torch.randn(batch, src, EMBED, dtype=torch.float64, requires_grad=True)
    return query, memory


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("attention", KINDS, ids=str)
@pytest.mark.parametrize("tgt,src", [(6, 6), (4, 7)], ids=["self", "cross_Lq<Lk"])
def test_explicit_and_fused_paths_agree(options, attention, tgt, src):
    module = _module(attention, options)
    query, memory = _inputs(tgt, src)
    key_padding = torch.zeros(2, src, dtype=torch.bool)
    key_padding[1, 0] = True
    outs, grads = [], []
    for need_weights in (True, False):
        out, weights = module(query, memory, memory, key_padding_mask=key_padding, need_weights=need_weights,
                              average_attn_weights=False)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [query, memory] + list(module.parameters())))
        if need_weights:
            total = weights.sum(-1)
            # With a sink, a row's weights over the real keys sum to less than one.
            assert (total <= 1 + 1e-12).all()
            if "sinks" not in options:
                torch.testing.assert_close(total[total > 0], torch.ones_like(total[total > 0]), **TOL)
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for explicit, fused in zip(*grads):
        torch.testing.assert_close(explicit, fused, **TOL)


def test_the_options_change_the_output():
    """Each option moves the output (a test above that agreed with options silently dropped
    on both paths would pass too)."""
    query, memory = _inputs()
    plain = _module("entmax15", {})(query, memory, memory, need_weights=False)[0]
    for options in OPTIONS:
        out = _module("entmax15", options.values[0])(query, memory, memory, need_weights=False)[0]
        assert (out - plain).abs().max() > 1e-3, options.id


@pytest.mark.parametrize("need_weights", [True, False])
def test_softmax_window_equals_torch_with_the_band_mask(need_weights):
    torch.manual_seed(2)
    theirs = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
    ours = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, attention="softmax", window_size=(2, 1))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 7, EMBED)
    offset = torch.arange(7)[:, None] - torch.arange(7)[None, :]
    ignored = (offset > 2) | (offset < -1)  # torch's bool masks mark what to ignore
    expected, expected_weights = theirs(x, x, x, attn_mask=ignored, need_weights=True)
    out, weights = ours(x, x, x, need_weights=need_weights)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_heads", [1, 4, 8, 12, 20])
def test_alibi_slopes_are_blooms(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # BLOOM's alibi at position 1 of a 2-token sequence is the slope itself.
    bloom = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(alibi_slopes(num_heads), bloom, atol=0, rtol=1e-6)
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]


def test_alibi_adds_minus_slope_times_distance():
    """Against the same module without ALiBi and the bias given as a float mask."""
    module = _module("entmax15", {"alibi": True})
    plain = _module("entmax15", {})
    query, memory = _inputs(4, 6)
    distance = (torch.arange(4)[:, None] + 2 - torch.arange(6)[None, :]).abs().double()
    bias = -(alibi_slopes(HEADS).double().view(HEADS, 1, 1) * distance).repeat(2, 1, 1)
    expected = plain(query, memory, memory, attn_mask=bias, need_weights=False)[0]
    torch.testing.assert_close(module(query, memory, memory, need_weights=False)[0], expected, **TOL)


def test_sinks_are_a_parameter_and_plain_checkpoints_load():
    theirs = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
    ours = MultiheadEntmaxAttention.from_torch(theirs, attention="entmax15", sinks=True, alibi=True)
    assert torch.equal(ours.sinks, torch.zeros(HEADS))
    assert "sinks" in dict(ours.named_parameters())
    assert "alibi_slopes" not in ours.state_dict()
    assert set(ours.state_dict()) == set(theirs.state_dict()) | {"sinks"}
    ours.load_state_dict(theirs.state_dict())  # strict: the sinks keep their initial value
    again = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, sinks=True, alibi=True)
    again.load_state_dict(ours.state_dict())
    x = torch.randn(1, 5, EMBED, requires_grad=True)
    ours(x, x, x, need_weights=False)[0].sum().backward()
    assert ours.sinks.grad is not None and ours.sinks.grad.abs().sum() > 0
    assert "window_size" not in repr(ours) and "sinks=True" in repr(ours) and "alibi=True" in repr(ours)


def test_replace_attention_passes_the_options():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(EMBED, HEADS, batch_first=True), 2,
                                  enable_nested_tensor=False)
    replace_attention(model, attention="sparsemax", window_size=(4, 0), softcap=30.0)
    layers = [layer.self_attn for layer in model.layers]
    assert all(isinstance(m, MultiheadEntmaxAttention) and m.window_size == (4, 0) and m.softcap == 30.0
               for m in layers)
    assert model(torch.randn(2, 6, EMBED)).isfinite().all()


@pytest.mark.parametrize("bad,error,match", [
    ({"window_size": (-2, 0)}, ValueError, "window_size"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"softcap": math.inf}, ValueError, "softcap"),
    ({"alibi": 1}, TypeError, "alibi must be a bool"),
    ({"sinks": "yes"}, TypeError, "sinks must be a bool"),
])
def test_bad_options_are_refused(bad, error, match):
    with pytest.raises(error, match=match):
        MultiheadEntmaxAttention(EMBED, HEADS, **bad)


def test_fusedmax_refuses_the_options():
    with pytest.raises(ValueError, match="fusedmax"):
        MultiheadEntmaxAttention(EMBED, HEADS, attention="fusedmax", softcap=2.0)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        alibi_slopes(0)
