"""Bad input raises the same exception type, with the same message, on every backend that
runs the op on CPU tensors here (reference, cpp; triton in its interpreter, which
conftest.py switches on when there is no GPU): the public layer validates once, before
dispatch, so no backend's own check decides the type.

Each case names the op whose backends are forced (the registry's op: the losses run on
"entmax", the structured attention on "fusedmax"/"oscarmax"). Mismatched devices are not
tested here (one device). Inputs are float32, which every backend takes, so a forced
backend never refuses the call for its own limits before the input is checked.
"""
import re

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import entmax_fast as E
from devices import cpu_backends

X = torch.randn(3, 5)
TARGET = torch.tensor([0, 4, 2])
NAN = float("nan")


def _qkv(h=2, hkv=2, lq=3, lk=4, e=4, dtype=torch.float32):
    return (torch.randn(1, h, lq, e, dtype=dtype), torch.randn(1, hkv, lk, e, dtype=dtype),
            torch.randn(1, hkv, lk, e, dtype=dtype))


Q, K, V = _qkv()


def _varlen(**changes):
    args = dict(q=torch.randn(5, 2, 4), k=torch.randn(6, 2, 4), v=torch.randn(6, 2, 4),
                cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=3)
    args.update(changes)
    return lambda: E.entmax_attention_varlen(**args)


def _varlen_positional(*after_max_seqlens):
    """entmax_attention_varlen called by position past max_seqlen_k."""
    q, k, v = torch.randn(5, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
    return lambda: E.entmax_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, *after_max_seqlens)


def _module(query=None, **forward):
    def call():
        module = E.MultiheadEntmaxAttention(4, 2, batch_first=True, attention="entmax15")
        x = torch.randn(2, 3, 4)
        module(x if query is None else query, x, x, need_weights=False, **forward)
    return call


def _int32(*values):
    return torch.tensor(values, dtype=torch.int32)


# (id, op, call, exception type, message pattern)
MAPPING_CASES = []
for _name in ("sparsemax", "entmax15", "entmax_bisect", "sparsemax_bisect"):
    _fn = getattr(E, _name)
    MAPPING_CASES += [
        (f"{_name}-int-X", "entmax", lambda fn=_fn: fn(torch.arange(5)), TypeError, "X must have a floating-point"),
        (f"{_name}-list-X", "entmax", lambda fn=_fn: fn([1.0, 2.0]), TypeError, "X must be a torch.Tensor"),
        (f"{_name}-0d-X", "entmax", lambda fn=_fn: fn(torch.tensor(1.0)), ValueError, "at least one dimension"),
        (f"{_name}-dim-range", "entmax", lambda fn=_fn: fn(X, dim=2), IndexError, r"dim must be in \[-2, 1\]"),
        (f"{_name}-dim-float", "entmax", lambda fn=_fn: fn(X, dim=1.0), TypeError, "dim must be an int"),
    ]
MAPPING_CASES += [
    ("entmax_bisect-alpha-0", "entmax", lambda: E.entmax_bisect(X, alpha=0.0), ValueError, "alpha must be finite"),
    ("entmax_bisect-alpha-nan", "entmax", lambda: E.entmax_bisect(X, alpha=NAN), ValueError, "alpha must be finite"),
    ("entmax_bisect-alpha-tensor-nan", "entmax", lambda: E.entmax_bisect(X, alpha=torch.tensor([[1.5], [NAN], [2.0]])),
     ValueError, "alpha must be finite"),
    ("entmax_bisect-alpha-tensor-int", "entmax", lambda: E.entmax_bisect(X, alpha=torch.tensor([[2], [2], [2]])),
     TypeError, "alpha must be a float or a floating-point tensor"),
    ("entmax_bisect-alpha-shape", "entmax", lambda: E.entmax_bisect(X, alpha=torch.ones(3, 5)), ValueError,
     "alpha must be broadcastable"),
    ("normmax_bisect-alpha", "normmax", lambda: E.normmax_bisect(X, alpha=1.0), ValueError, "alpha must be > 1"),
    ("normmax_bisect-alpha-grad", "normmax", lambda: E.normmax_bisect(X, alpha=torch.tensor(2.0, requires_grad=True)),
     ValueError, "is not differentiated"),
    ("normmax_bisect-int-X", "normmax", lambda: E.normmax_bisect(torch.arange(5)), TypeError, "floating-point"),
    ("budget_bisect-budget", "budget", lambda: E.budget_bisect(X, budget=-1.0), ValueError, "budget must be"),
    ("budget_bisect-dim", "budget", lambda: E.budget_bisect(X, dim=-3), IndexError, "dim must be in"),
]

LOSS_CASES = []
for _name in ("sparsemax_loss", "entmax15_loss", "sparsemax_bisect_loss", "entmax_bisect_loss"):
    _fn = getattr(E, _name)
    LOSS_CASES += [
        (f"{_name}-target-range", "entmax", lambda fn=_fn: fn(X, torch.tensor([0, 5, 1])), ValueError,
         r"target must hold class indices in \[0, 5\)"),
        (f"{_name}-target-negative", "entmax", lambda fn=_fn: fn(X, torch.tensor([0, -1, 1])), ValueError,
         r"target must hold class indices in \[0, 5\)"),
        (f"{_name}-target-float", "entmax", lambda fn=_fn: fn(X, TARGET.float()), TypeError,
         "target must be an integer tensor"),
        (f"{_name}-target-shape", "entmax", lambda fn=_fn: fn(X, TARGET[:2]), ValueError, r"target must have shape"),
        (f"{_name}-3d-X", "entmax", lambda fn=_fn: fn(X[None], TARGET), ValueError, "X must be 2-D"),
        (f"{_name}-int-X", "entmax", lambda fn=_fn: fn(X.long(), TARGET), TypeError, "floating-point"),
    ]
LOSS_CASES += [
    ("entmax_bisect_loss-alpha", "entmax", lambda: E.entmax_bisect_loss(X, TARGET, alpha=-1.0), ValueError,
     "alpha must be finite"),
    ("SparsemaxLoss-target-range", "entmax", lambda: E.SparsemaxLoss()(X, torch.tensor([0, 9, 1])), ValueError,
     "target must hold class indices"),
    ("normmax_bisect_loss-target", "normmax", lambda: E.normmax_bisect_loss(X, torch.tensor([0, 9, 1])), ValueError,
     "target must hold class indices"),
]

# (id, value, its type's name): what SDPA refuses as is_causal (tests/test_errors.py checks that it does).
IS_CAUSAL_NOT_BOOL = [("float", 0.125, "float"), ("int", 1, "int"), ("numpy-bool", np.bool_(True), r"numpy\.bool"),
                      ("tensor", torch.tensor(True), r"torch\.Tensor"), ("none", None, "NoneType")]

ATTENTION_CASES = []
for _name in ("entmax_attention", "sparsemax_attention"):
    _fn = getattr(E, _name)
    ATTENTION_CASES += [
        (f"{_name}-int-query", "attention", lambda fn=_fn: fn(Q.long(), K, V), TypeError, "query must have a floating"),
        (f"{_name}-3d-query", "attention", lambda fn=_fn: fn(Q[0], K, V), ValueError, r"query must be 4-D"),
        (f"{_name}-dtypes", "attention", lambda fn=_fn: fn(Q, K.double(), V.double()), TypeError,
         "key must have query's dtype"),
        (f"{_name}-value-dtype", "attention", lambda fn=_fn: fn(Q, K, V.half()), TypeError,
         "value must have query's dtype"),
        (f"{_name}-head-dim", "attention", lambda fn=_fn: fn(Q, K[..., :2], V), ValueError, r"key's last dim \(E\)"),
        (f"{_name}-value-length", "attention", lambda fn=_fn: fn(Q, K, V[:, :, :2]), ValueError, "value's length"),
        (f"{_name}-batch", "attention", lambda fn=_fn: fn(Q, torch.cat([K, K]), torch.cat([V, V])), ValueError,
         "same batch size"),
        (f"{_name}-kv-heads", "attention", lambda fn=_fn: fn(Q, K, V[:, :1], enable_gqa=True), ValueError,
         "key and value must have the same number of heads"),
        (f"{_name}-heads", "attention", lambda fn=_fn: fn(*_qkv(h=4, hkv=2)), ValueError, "pass enable_gqa=True"),
        (f"{_name}-gqa-divisible", "attention", lambda fn=_fn: fn(*_qkv(h=3, hkv=2), enable_gqa=True), ValueError,
         r"query heads \(3\) must be divisible by key/value heads \(2\)"),
        (f"{_name}-gqa-no-kv-heads", "attention", lambda fn=_fn: fn(*_qkv(h=2, hkv=0), enable_gqa=True), ValueError,
         r"query heads \(2\) must be divisible by key/value heads \(0\)"),
        (f"{_name}-scale-nan", "attention", lambda fn=_fn: fn(Q, K, V, scale=NAN), ValueError,
         "scale must be a finite number"),
        (f"{_name}-scale-inf", "attention", lambda fn=_fn: fn(Q, K, V, scale=float("inf")), ValueError,
         "scale must be a finite number"),
        (f"{_name}-scale-str", "attention", lambda fn=_fn: fn(Q, K, V, scale="1"), TypeError,
         "scale must be a real number"),
        (f"{_name}-dropout", "attention", lambda fn=_fn: fn(Q, K, V, dropout_p=1.0), ValueError, "dropout_p"),
        (f"{_name}-mask-shape", "attention", lambda fn=_fn: fn(Q, K, V, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
         ValueError, "attn_mask must be broadcastable"),
        (f"{_name}-mask-5d", "attention",
         lambda fn=_fn: fn(Q, K, V, attn_mask=torch.ones(1, 1, 1, 3, 4, dtype=torch.bool)), ValueError,
         "attn_mask must be broadcastable"),
        (f"{_name}-mask-int", "attention", lambda fn=_fn: fn(Q, K, V, attn_mask=torch.ones(3, 4, dtype=torch.int32)),
         TypeError, "attn_mask must be bool or have query's dtype"),
        (f"{_name}-mask-dtype", "attention", lambda fn=_fn: fn(Q, K, V, attn_mask=torch.zeros(3, 4).double()),
         TypeError, "attn_mask must be bool or have query's dtype"),
        (f"{_name}-mask-list", "attention", lambda fn=_fn: fn(Q, K, V, attn_mask=[[True]]), TypeError,
         "attn_mask must be a tensor"),
        (f"{_name}-causal-bias-lengths", "attention", lambda fn=_fn: fn(Q, K, V, attn_mask=causal_lower_right(4, 4)),
         ValueError, r"attn_mask is a CausalBias for \(Lq, Lk\) = \(4, 4\)"),
        (f"{_name}-window-below", "attention", lambda fn=_fn: fn(Q, K, V, window_size=(-2, 0)), ValueError,
         r"window_size values must be >= -1"),
        (f"{_name}-window-float", "attention", lambda fn=_fn: fn(Q, K, V, window_size=(1.0, 0)), TypeError,
         "window_size must hold ints"),
        (f"{_name}-window-bool", "attention", lambda fn=_fn: fn(Q, K, V, window_size=(True, 0)), TypeError,
         "window_size must hold ints"),
        (f"{_name}-window-int", "attention", lambda fn=_fn: fn(Q, K, V, window_size=3), TypeError,
         r"window_size must be a pair \(left, right\)"),
        (f"{_name}-window-length", "attention", lambda fn=_fn: fn(Q, K, V, window_size=(1, 2, 3)), ValueError,
         r"window_size must be a pair \(left, right\) of ints, got 3 values"),
        (f"{_name}-softcap-negative", "attention", lambda fn=_fn: fn(Q, K, V, softcap=-1.0), ValueError,
         "softcap must be finite and >= 0"),
        (f"{_name}-softcap-nan", "attention", lambda fn=_fn: fn(Q, K, V, softcap=NAN), ValueError,
         "softcap must be finite and >= 0"),
        (f"{_name}-softcap-inf", "attention", lambda fn=_fn: fn(Q, K, V, softcap=float("inf")), ValueError,
         "softcap must be finite and >= 0"),
        (f"{_name}-softcap-str", "attention", lambda fn=_fn: fn(Q, K, V, softcap="1"), TypeError,
         "softcap must be a real number"),
        (f"{_name}-alibi-shape", "attention", lambda fn=_fn: fn(Q, K, V, alibi_slopes=torch.rand(3)), ValueError,
         r"alibi_slopes must have shape \(2,\) or \(1, 2\), got \(3,\)"),
        (f"{_name}-alibi-dtype", "attention", lambda fn=_fn: fn(Q, K, V, alibi_slopes=torch.rand(2).half()), TypeError,
         "alibi_slopes must be float32 or have query's dtype"),
        (f"{_name}-alibi-int", "attention", lambda fn=_fn: fn(Q, K, V, alibi_slopes=torch.ones(2, dtype=torch.int64)),
         TypeError, "alibi_slopes must be float32 or have query's dtype"),
        (f"{_name}-alibi-list", "attention", lambda fn=_fn: fn(Q, K, V, alibi_slopes=[0.5, 0.25]), TypeError,
         "alibi_slopes must be a tensor"),
        (f"{_name}-alibi-grad", "attention", lambda fn=_fn: fn(Q, K, V, alibi_slopes=torch.rand(2, requires_grad=True)),
         ValueError, "alibi_slopes are not differentiated"),
        (f"{_name}-sinks-shape", "attention", lambda fn=_fn: fn(Q, K, V, sinks=torch.zeros(1, 2)), ValueError,
         r"sinks must have shape \(2,\), got \(1, 2\)"),
        (f"{_name}-sinks-dtype", "attention", lambda fn=_fn: fn(Q, K, V, sinks=torch.zeros(2, dtype=torch.int32)),
         TypeError, "sinks must be float32 or have query's dtype"),
        (f"{_name}-sinks-list", "attention", lambda fn=_fn: fn(Q, K, V, sinks=[0.0, 0.0]), TypeError,
         "sinks must be a tensor"),
    ]
    # SDPA refuses every is_causal but a Python bool; a float there is usually a scale passed by position.
    ATTENTION_CASES += [(f"{_name}-is-causal-{kind}", "attention", lambda fn=_fn, bad=bad: fn(Q, K, V, None, 0.0, bad),
                         TypeError, f"is_causal must be a bool .* got {got}")
                        for kind, bad, got in IS_CAUSAL_NOT_BOOL]
ATTENTION_CASES += [
    ("entmax_attention-alpha", "attention", lambda: E.entmax_attention(Q, K, V, alpha=0.5), ValueError,
     r"alpha must be finite and >= 1"),
    ("entmax_attention-alpha-nan", "attention", lambda: E.entmax_attention(Q, K, V, alpha=NAN), ValueError,
     r"alpha must be finite and >= 1"),
    ("entmax_attention-alpha-tensor", "attention", lambda: E.entmax_attention(Q, K, V, alpha=torch.tensor([1.5, 0.9])),
     ValueError, r"alpha must be finite and >= 1"),
    ("entmax_attention-alpha-tensor-inf", "attention",
     lambda: E.entmax_attention(Q, K, V, alpha=torch.tensor([float("inf"), 1.5])), ValueError,
     r"alpha must be finite and >= 1"),
    ("entmax_attention-alpha-shape", "attention", lambda: E.entmax_attention(Q, K, V, alpha=torch.ones(3)), ValueError,
     r"shape \(H,\) = \(2,\)"),
    ("entmax_attention-alpha-int", "attention", lambda: E.entmax_attention(Q, K, V, alpha=torch.tensor([2, 2])),
     TypeError, "alpha must be a float or a floating-point tensor"),
    ("MultiheadEntmaxAttention-padding-shape", "attention", _module(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
     ValueError, r"key_padding_mask must have shape \(N, S\)"),
    ("MultiheadEntmaxAttention-mask-shape", "attention", _module(attn_mask=torch.zeros(4, 4, dtype=torch.bool)),
     ValueError, r"attn_mask must have shape \(L, S\)"),
    ("MultiheadEntmaxAttention-mask-int", "attention", _module(attn_mask=torch.zeros(3, 3, dtype=torch.int64)),
     TypeError, "must be bool or floating point"),
    ("MultiheadEntmaxAttention-4d-query", "attention", _module(query=torch.randn(1, 2, 3, 4)), ValueError,
     "must all be 3-D"),
    ("MultiheadEntmaxAttention-embed", "attention", _module(query=torch.randn(2, 3, 5)), ValueError,
     "embed_dim=4"),
    ("MultiheadEntmaxAttention-causal-without-mask", "attention", _module(is_causal=True), RuntimeError,
     "Need attn_mask"),
    ("MultiheadEntmaxAttention-is-causal-int", "attention", _module(attn_mask=torch.ones(3, 3).triu(1).bool(),
                                                                    is_causal=1), TypeError, "is_causal must be a bool"),
]
ATTENTION_CASES += [(f"{_name}-is-causal-{kind}", op, lambda fn=_fn, bad=bad: fn(Q, K, None, bad), TypeError,
                     f"is_causal must be a bool .* got {got}")
                    for _name, op in (("attention_weights", "attention"), ("support_size", "attention_support"))
                    for _fn in [getattr(E, _name)] for kind, bad, got in IS_CAUSAL_NOT_BOOL]

VARLEN_CASES = [
    ("varlen-cu-dtype", _varlen(cu_seqlens_q=torch.tensor([0, 2, 5])), ValueError, "1-D int32 tensor"),
    ("varlen-cu-2d", _varlen(cu_seqlens_q=_int32(0, 2, 5)[None]), ValueError, "1-D int32 tensor"),
    ("varlen-cu-start", _varlen(cu_seqlens_q=_int32(1, 2, 5)), ValueError, "cu_seqlens_q must start at 0"),
    ("varlen-cu-decreasing", _varlen(cu_seqlens_q=_int32(0, 3, 2, 5), cu_seqlens_k=_int32(0, 3, 3, 6)), ValueError,
     "cu_seqlens_q must be non-decreasing"),
    ("varlen-cu-end", _varlen(cu_seqlens_k=_int32(0, 3, 5)), ValueError, r"cu_seqlens_k must end at the number of tokens"),
    ("varlen-cu-lengths", _varlen(cu_seqlens_k=_int32(0, 6)), ValueError, "must have the same length"),
    ("varlen-max-seqlen", _varlen(max_seqlen_q=2), ValueError, r"max_seqlen_q \(2\) must be at least"),
    ("varlen-max-seqlen-negative", _varlen(max_seqlen_k=-1), ValueError, "max_seqlen_k must be an int >= 0"),
    ("varlen-4d-q", _varlen(q=torch.randn(1, 5, 2, 4)), ValueError, r"q must be 3-D"),
    ("varlen-int-q", _varlen(q=torch.ones(5, 2, 4, dtype=torch.int64)), TypeError, "q must have a floating"),
    ("varlen-heads", _varlen(q=torch.randn(5, 3, 4)), ValueError, r"q heads \(3\) must be divisible"),
    ("varlen-no-kv-heads", _varlen(k=torch.randn(6, 0, 4), v=torch.randn(6, 0, 4)), ValueError,
     r"q heads \(2\) must be divisible by k/v heads \(0\)"),
    ("varlen-dtypes", _varlen(k=torch.randn(6, 2, 4).double()), TypeError, "k must have q's dtype"),
    ("varlen-kv-shape", _varlen(v=torch.randn(5, 2, 4)), ValueError, "same total_k"),
    ("varlen-alpha", _varlen(alpha=0.5), ValueError, r"alpha must be finite and >= 1"),
    ("varlen-scale-nan", _varlen(scale=NAN), ValueError, "scale must be a finite number"),
    ("varlen-dropout", _varlen(dropout_p=-0.5), ValueError, "dropout_p"),
    ("varlen-window-below", _varlen(window_size=(0, -3)), ValueError, r"window_size values must be >= -1"),
    ("varlen-window-float", _varlen(window_size=(0, 0.5)), TypeError, "window_size must hold ints"),
    ("varlen-softcap-negative", _varlen(softcap=-0.5), ValueError, "softcap must be finite and >= 0"),
    ("varlen-alibi-shape", _varlen(alibi_slopes=torch.rand(3, 2)), ValueError,
     r"alibi_slopes must have shape \(2,\) or \(2, 2\), got \(3, 2\)"),
    ("varlen-alibi-dtype", _varlen(alibi_slopes=torch.rand(2).double()), TypeError,
     "alibi_slopes must be float32 or have q's dtype"),
    ("varlen-sinks-shape", _varlen(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(2,\)"),
    ("varlen-sinks-dtype", _varlen(sinks=torch.zeros(2, dtype=torch.float16)), TypeError,
     "sinks must be float32 or have q's dtype"),
    *[(f"varlen-is-causal-{kind}", _varlen(is_causal=bad), TypeError, f"is_causal must be a bool .* got {got}")
      for kind, bad, got in IS_CAUSAL_NOT_BOOL],
    # flash_attn_varlen_func's order (…, dropout_p, softmax_scale, causal): not another meaning here.
    ("varlen-flash-attn-positional-scale", _varlen_positional(0.0, 0.125), TypeError, "positional argument"),
    ("varlen-flash-attn-positional-scale-causal", _varlen_positional(0.0, 0.125, True), TypeError,
     "positional argument"),
    ("varlen-sdpa-positional-causal", _varlen_positional(0.0, True), TypeError, "positional argument"),
]
VARLEN_CASES = [(name, "attention_varlen", call, error, match) for name, call, error, match in VARLEN_CASES]

STRUCTURED_CASES = []
for _name, _reg in (("fusedmax", "lam"), ("oscarmax", "beta")):
    _fn = getattr(E, _name)
    _attention = getattr(E, f"{_name}_attention")
    _module_class = E.Fusedmax if _name == "fusedmax" else E.Oscarmax
    STRUCTURED_CASES += [(f"{_name}-{case}", _name, call, error, match) for case, call, error, match in [
        ("lengths-above", lambda fn=_fn: fn(X, 0.1, lengths=torch.tensor([1, 6, 2])), ValueError,
         r"lengths must lie in \[0, 5\] \(the size of dim -1\), got values in \[1, 6\]"),
        ("lengths-negative", lambda fn=_fn: fn(X, 0.1, lengths=_int32(1, -1, 2)), ValueError,
         r"lengths must lie in \[0, 5\]"),
        ("lengths-other-dim", lambda fn=_fn: fn(X, 0.1, dim=0, lengths=torch.tensor([0, 1, 2, 3, 4])), ValueError,
         r"lengths must lie in \[0, 3\] \(the size of dim 0\)"),
        ("lengths-module", lambda cls=_module_class: cls(0.1)(X, lengths=torch.tensor([1, 6, 2])), ValueError,
         r"lengths must lie in \[0, 5\]"),
        ("lengths-float", lambda fn=_fn: fn(X, 0.1, lengths=torch.tensor([1.0, 2, 2])), TypeError,
         "lengths must have an integer dtype"),
        ("lengths-bool", lambda fn=_fn: fn(X, 0.1, lengths=torch.tensor([True, True, False])), TypeError,
         "lengths must have an integer dtype"),
        ("lengths-shape", lambda fn=_fn: fn(X, 0.1, lengths=torch.tensor([1, 2])), ValueError,
         r"lengths must have shape \(3,\)"),
        ("lengths-list", lambda fn=_fn: fn(X, 0.1, lengths=[1, 2, 3]), TypeError, "lengths must be an integer tensor"),
        ("dim-range", lambda fn=_fn: fn(X, 0.1, dim=2), IndexError, r"dim must be in \[-2, 1\]"),
        ("dim-float", lambda fn=_fn: fn(X, 0.1, dim=1.0), TypeError, "dim must be an int"),
        ("int-X", lambda fn=_fn: fn(torch.arange(5), 0.1), TypeError, "X must have a floating dtype"),
        ("list-X", lambda fn=_fn: fn([1.0, 2.0], 0.1), TypeError, "X must be a torch.Tensor"),
        ("0d-X", lambda fn=_fn: fn(torch.tensor(1.0), 0.1), ValueError, "at least 1 dimension"),
        ("reg-negative", lambda fn=_fn: fn(X, -0.1), ValueError, f"{_reg} must be finite and >= 0"),
        ("reg-nan", lambda fn=_fn: fn(X, NAN), ValueError, f"{_reg} must be finite and >= 0"),
        ("reg-tensor", lambda fn=_fn: fn(X, torch.tensor(0.1)), TypeError, f"{_reg} must be a Python float"),
        ("attention-reg", lambda fn=_attention, reg=_reg: fn(Q, K, V, **{reg: -1.0}), ValueError,
         f"{_reg} must be finite and >= 0"),
        ("attention-int-query", lambda fn=_attention: fn(Q.long(), K, V), TypeError, "query must have a floating"),
        ("attention-1d-query", lambda fn=_attention: fn(Q[0, 0, 0], K, V), ValueError, "query must have at least 2"),
        ("attention-dtypes", lambda fn=_attention: fn(Q, K.double(), V.double()), TypeError,
         "key must have query's dtype"),
        ("attention-head-dim", lambda fn=_attention: fn(Q, K[..., :2], V), ValueError, r"key's last dim \(E\)"),
        ("attention-value-length", lambda fn=_attention: fn(Q, K, V[:, :, :2]), ValueError, "value's length"),
        ("attention-heads", lambda fn=_attention: fn(*_qkv(h=4, hkv=2)), ValueError, "pass enable_gqa=True"),
        ("attention-gqa-divisible", lambda fn=_attention: fn(*_qkv(h=3, hkv=2), enable_gqa=True), ValueError,
         r"query heads \(3\) must be divisible by key/value heads \(2\)"),
        ("attention-batch", lambda fn=_attention: fn(torch.cat([Q, Q]), torch.cat([K, K, K]), torch.cat([V, V, V])),
         ValueError, "broadcastable leading dims"),
        ("attention-scale-nan", lambda fn=_attention: fn(Q, K, V, scale=NAN), ValueError,
         "scale must be a finite number"),
        ("attention-dropout", lambda fn=_attention: fn(Q, K, V, dropout_p=1.0), ValueError, "dropout_p"),
        ("attention-mask-shape", lambda fn=_attention: fn(Q, K, V, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
         ValueError, "attn_mask must be broadcastable"),
        ("attention-mask-int", lambda fn=_attention: fn(Q, K, V, attn_mask=torch.ones(3, 4, dtype=torch.int32)),
         TypeError, "attn_mask must be bool or floating point"),
        ("attention-mask-list", lambda fn=_attention: fn(Q, K, V, attn_mask=[[True]]), TypeError,
         "attn_mask must be a tensor"),
        *[(f"attention-is-causal-{kind}", lambda fn=_attention, bad=bad: fn(Q, K, V, None, 0.0, bad), TypeError,
           f"is_causal must be a bool .* got {got}") for kind, bad, got in IS_CAUSAL_NOT_BOOL],
    ]]

CASES = MAPPING_CASES + LOSS_CASES + ATTENTION_CASES + VARLEN_CASES + STRUCTURED_CASES


@pytest.mark.parametrize("op,call,error,match", [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_bad_input_raises_one_error_on_every_backend(op, call, error, match):
    backends = cpu_backends(op)
    assert "reference" in backends
    raised = {}
    for backend in backends:
        with E.use_backend(backend):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the type is what is checked
                raised[backend] = exc
            else:
                raised[backend] = None
    assert all(exc is not None for exc in raised.values()), f"no error on {[b for b, e in raised.items() if e is None]}"
    types = {backend: type(exc) for backend, exc in raised.items()}
    assert set(types.values()) == {error}, f"{op}: {types} (messages: {raised})"
    for backend, exc in raised.items():
        assert re.search(match, str(exc)), f"{backend}: {exc}"
    assert len({str(exc) for exc in raised.values()}) == 1, raised


def test_cases_reach_more_than_one_backend():
    # The parity above means something only where an op has several CPU backends here.
    if "cpp" not in cpu_backends("fusedmax"):
        pytest.skip("entmax_fast._C is not built: only the reference runs fusedmax on CPU")
    assert {"reference", "cpp"} <= set(cpu_backends("entmax")) and {"reference", "cpp"} <= set(cpu_backends("attention"))
