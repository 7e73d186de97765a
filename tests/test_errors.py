"""Bad input gives a clear error naming the argument and what was expected."""
import pytest
import torch

import entmax_fast


def _qkv(h=2, hkv=2, dtype=torch.float32):
    return torch.randn(1, h, 4, 8, dtype=dtype), torch.randn(1, hkv, 5, 8, dtype=dtype), torch.randn(1, hkv, 5, 8, dtype=dtype)


@pytest.mark.parametrize("call,error,match", [
    (lambda: entmax_fast.sparsemax(torch.arange(5)), TypeError, "X must have a floating-point dtype"),
    (lambda: entmax_fast.sparsemax([1.0, 2.0]), TypeError, "X must be a torch.Tensor"),
    (lambda: entmax_fast.entmax15(torch.randn(3), dim=2), IndexError, "dim must be in"),
    (lambda: entmax_fast.entmax_bisect(torch.randn(3, 4), alpha=0.0), ValueError, "alpha must be finite and > 0"),
    (lambda: entmax_fast.entmax_bisect(torch.randn(3, 4), alpha=-1.0), ValueError, "alpha must be finite and > 0"),
    (lambda: entmax_fast.entmax_bisect(torch.randn(3, 4), alpha=torch.tensor([[1.5], [0.0], [2.0]])), ValueError,
     "alpha must be finite and > 0"),
    *[(lambda bad=bad: entmax_fast.entmax_bisect(torch.randn(3, 4), alpha=torch.tensor([[1.5], [bad], [2.0]])),
       ValueError, "alpha must be finite and > 0") for bad in (float("nan"), float("inf"), -float("inf"))],
    (lambda: entmax_fast.entmax_bisect(torch.randn(3, 4), alpha=torch.ones(3, 4) * 1.5), ValueError,
     r"alpha must be broadcastable to \(3, 1\)"),
    (lambda: entmax_fast.entmax_bisect(torch.randn(3, 4), alpha=torch.tensor([2, 2, 2]).view(3, 1)), TypeError,
     "alpha must be a float or a floating-point tensor"),
    (lambda: entmax_fast.sparsemax_loss(torch.randn(3, 4), torch.tensor([0, 1])), ValueError,
     r"target must have shape \(3,\)"),
])
def test_mapping_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("make,error,match", [
    (lambda q, k, v: (q.long(), k, v, {}), TypeError, "query must have a floating-point dtype"),
    (lambda q, k, v: (q[0], k, v, {}), ValueError, r"query must be 4-D \(B, H, L, E\)"),
    (lambda q, k, v: (q, k.double(), v, {}), TypeError, "key must have query's dtype"),
    (lambda q, k, v: (q, k, v.to("meta"), {}), ValueError, "value must be on query's device"),
    (lambda q, k, v: (q, k[..., :4], v, {}), ValueError, "key's last dim"),
    (lambda q, k, v: (q, k, v[:, :, :3], {}), ValueError, "value's length"),
    (lambda q, k, v: (q, k, v, {"alpha": 0.5}), ValueError, r"alpha must be finite and >= 1.0"),
    (lambda q, k, v: (q, k, v, {"alpha": torch.tensor([1.5, 0.9])}), ValueError, r"alpha must be finite and >= 1"),
    (lambda q, k, v: (q, k, v, {"alpha": torch.tensor([1.5, float("nan")])}), ValueError,
     r"alpha must be finite and >= 1"),
    (lambda q, k, v: (q, k, v, {"alpha": torch.tensor([float("inf"), 1.5])}), ValueError,
     r"alpha must be finite and >= 1"),
    (lambda q, k, v: (q, k, v, {"alpha": torch.ones(3)}), ValueError, r"shape \(H,\) = \(2,\)"),
    (lambda q, k, v: (q, k, v, {"scale": float("nan")}), ValueError, "scale must be a finite number or None"),
    (lambda q, k, v: (q, k, v, {"scale": -float("inf")}), ValueError, "scale must be a finite number or None"),
    (lambda q, k, v: (q, k, v, {"scale": "0.5"}), TypeError, "scale must be a real number or None"),
    (lambda q, k, v: (q, k, v, {"dropout_p": 1.0}), ValueError, r"dropout_p must be in \[0, 1\)"),
    (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(4, 4, dtype=torch.bool)}), ValueError,
     "attn_mask must be broadcastable"),
    (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(4, 5, dtype=torch.int32)}), TypeError,
     "attn_mask must be bool or have query's dtype"),
])
def test_attention_errors(make, error, match):
    q, k, v, kwargs = make(*_qkv())
    with pytest.raises(error, match=match):
        entmax_fast.entmax_attention(q, k, v, **kwargs)


def test_gqa_head_errors():
    q, k, v = _qkv(h=3, hkv=2)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be divisible by key/value heads \(2\)"):
        entmax_fast.entmax_attention(q, k, v, enable_gqa=True)
    q, k, v = _qkv(h=4, hkv=2)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        entmax_fast.entmax_attention(q, k, v)
    assert entmax_fast.entmax_attention(q, k, v, enable_gqa=True).shape == (1, 4, 4, 8)


def test_gqa_heads_without_key_heads():
    q, k, v = _qkv(h=4, hkv=0)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be divisible by key/value heads \(0\)"):
        entmax_fast.entmax_attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("attention", [entmax_fast.fusedmax_attention, entmax_fast.oscarmax_attention])
def test_structured_attention_errors(attention):
    # The rules and messages of entmax_attention, prefixed with the op's name.
    name = attention.__name__
    q, k, v = _qkv(h=4, hkv=2)
    with pytest.raises(ValueError, match=f"{name}: key/value have 2 heads but query has 4; pass enable_gqa=True"):
        attention(q, k, v)
    q, k, v = _qkv(h=3, hkv=2)
    with pytest.raises(ValueError, match=rf"{name}: query heads \(3\) must be divisible by key/value heads \(2\)"):
        attention(q, k, v, enable_gqa=True)
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=f"{name}: key must have query's dtype torch.float32, got torch.float64"):
        attention(q, k.double(), v.double())
    with pytest.raises(TypeError, match=f"{name}: value must have query's dtype torch.float32, got torch.float64"):
        attention(q, k, v.double())
    with pytest.raises(ValueError, match=f"{name}: query, key and value must have broadcastable leading dims"):
        attention(torch.cat([q, q]), torch.cat([k, k, k]), torch.cat([v, v, v]))
    with pytest.raises(ValueError, match=f"{name}: scale must be a finite number or None, got nan"):
        attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match=rf"{name}: dropout_p must be in \[0, 1\)"):
        attention(q, k, v, dropout_p=1.0)


@pytest.mark.parametrize("value", [0.125, 1, 0, None, "yes"] + [
    pytest.param(lambda: __import__("numpy").bool_(True), id="numpy-bool"),
    pytest.param(lambda: torch.tensor(True), id="bool-tensor")])
def test_is_causal_other_than_bool_raises_as_in_sdpa(value):
    """What SDPA refuses as is_causal, every function taking it refuses, with a TypeError: the
    positional call SDPA writes (q, k, v, None, 0.0, scale) must not run causal here."""
    value = value() if callable(value) else value
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="is_causal"):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, value)
    calls = [lambda: entmax_fast.entmax_attention(q, k, v, None, 0.0, value),
             lambda: entmax_fast.entmax_attention(q, k, v, is_causal=value),
             lambda: entmax_fast.sparsemax_attention(q, k, v, None, 0.0, value),
             lambda: entmax_fast.attention_weights(q, k, None, value),
             lambda: entmax_fast.support_size(q, k, is_causal=value),
             lambda: entmax_fast.fusedmax_attention(q, k, v, None, 0.0, value),
             lambda: entmax_fast.oscarmax_attention(q, k, v, None, 0.0, value),
             lambda: entmax_fast.length_scale.attended_keys(4, 5, is_causal=value)]
    for call in calls:
        with pytest.raises(TypeError, match="is_causal must be a bool"):
            call()


def test_is_causal_bools_run():
    q, k, v = _qkv()
    for value in (True, False):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, value)
        entmax_fast.entmax_attention(q, k, v, None, 0.0, value)
        entmax_fast.fusedmax_attention(q, k, v, None, 0.0, value)
        entmax_fast.length_scale.attended_keys(4, 5, is_causal=value)
