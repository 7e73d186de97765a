"""The attention score options (window_size, lower-right causal masks, softcap, ALiBi, sinks):
forward and gradients (q, k, v, sinks, α) against the dense float64 oracle, alone, in pairs
and all together, with masks, GQA, Lq ≠ Lk in both directions, varlen and dropout, on every
CPU backend through dispatch: a backend runs the options it implements
(SCORE_OPTIONS_IMPLEMENTED) and refuses the others, naming them, and the call falls back to
the reference. GPT-OSS's softmax with sinks at α = 1, the softcap's gradient by finite
differences, torch.compile."""
import dataclasses
import importlib
import itertools
import math

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import entmax_fast
from entmax_fast import dispatch
from entmax_fast._validation import ScoreOptions
from entmax_fast.backends import triton as triton_backend
from devices import cpu_backends
from oracle import as_float64, attention_leaves, oracle_attention, oracle_entmax

B, H, HKV, E = 2, 4, 2, 8
# One α per head, none of them 1: the oracle's α = 1 rows are torch.softmax, which has no
# derivative in α.
ALPHA_HEADS = (1.25, 1.5, 1.75, 2.0)
# What a refusal names for each option (backends.SCORE_OPTIONS).
REFUSED_AS = {"window": "window_size",
              "lower_right": "a lower-right causal mask (CausalBias causal_lower_right with Lq != Lk)", "softcap": "softcap",
              "alibi": "alibi_slopes", "sinks": "sinks"}
# float32 against the float64 oracle: a few float32 ulps of O(1) outputs and gradients.
TOL = {torch.float64: {"atol": 1e-12, "rtol": 1e-12}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}
# dα sums a term per row of its head, each the float32 weights' rounding times up to
# 1/(α − 1)² (docs/attention.md, "Gradient of alpha"): the row-wise tests' float32 bound.
ALPHA_TOL = {torch.float64: TOL[torch.float64], torch.float32: {"atol": 1e-4, "rtol": 1e-3}}
# torch warns that SDPA gives NaN rows where a lower-right causal mask leaves a query no key;
# here such rows are zeros, as fully masked rows are (FlashAttention's rule).
pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")


def _option(name, lq, lk, dtype, generator):
    """Keyword arguments of entmax_attention (and of the oracle) that switch ``name`` on."""
    if name == "window":
        return {"window_size": (2, 1)}
    if name == "lower_right":
        return {"attn_mask": causal_lower_right(lq, lk)}
    if name == "softcap":
        return {"softcap": 1.5}
    if name == "alibi":
        return {"alibi_slopes": torch.rand(B, H, generator=generator)}
    return {"sinks": torch.randn(H, generator=generator, dtype=dtype).requires_grad_()}


CASES = [(name,) for name in REFUSED_AS] + list(itertools.combinations(REFUSED_AS, 2)) + [tuple(REFUSED_AS)]


def _inputs(lq, lk, dtype, scale=2.0):
    """q scaled up so that scores reach the softcap and rows are sparse."""
    q = (torch.randn(B, H, lq, E, dtype=dtype) * scale).requires_grad_()
    k = torch.randn(B, HKV, lk, E, dtype=dtype).requires_grad_()
    v = torch.randn(B, HKV, lk, E, dtype=dtype).requires_grad_()
    return q, k, v


def _oracle_and_grads(q, k, v, alpha, options, grad_out, **kwargs):
    """The oracle's output and its gradients with respect to the same leaves, in float64."""
    q64, k64, v64 = as_float64((q, k, v))
    alpha64 = as_float64([alpha])[0] if isinstance(alpha, torch.Tensor) else alpha
    options64 = dict(options)
    if options.get("sinks") is not None:
        options64["sinks"] = as_float64([options["sinks"]])[0]
    out = oracle_attention(q64, k64, v64, alpha=alpha64, **options64, **kwargs)
    grads = torch.autograd.grad(out, attention_leaves(q64, k64, v64, alpha64, options64), grad_out.double())
    return out, grads


def _first_choice(monkeypatch, backend):
    """Dispatch tries ``backend`` first on CPU tensors, then the reference."""
    monkeypatch.setattr(dispatch, "_default_order", lambda device: (backend, "reference"))


# The dispatch.Request flag (backends.SCORE_OPTIONS) each option of `_option` sets.
REQUEST_FLAG = {"window": "window", "lower_right": "lower_right_causal", "softcap": "softcap",
                "alibi": "alibi_slopes", "sinks": "sinks"}


def _check_fallback(op, first_backend, names):
    """``first_backend`` ran the call if it implements every option in ``names`` (its
    SCORE_OPTIONS_IMPLEMENTED); else the reference did, and the reason names what it lacks."""
    choice = dispatch.last_choice(op)
    if first_backend == "reference":
        assert choice.backend == "reference", choice
        return
    implemented = importlib.import_module(f"entmax_fast.backends.{first_backend}").SCORE_OPTIONS_IMPLEMENTED
    lacking = [name for name in REFUSED_AS if name in names and REQUEST_FLAG[name] not in implemented]
    if not lacking:
        assert choice.backend == first_backend, choice
        return
    assert choice.backend == "reference", choice
    what = "the C++ attention" if first_backend == "cpp" else "the fused attention"
    refused = ", ".join(REFUSED_AS[name] for name in lacking)
    assert f"{first_backend}: {what} does not implement {refused}" in choice.reason, choice.reason
    assert choice.reason.endswith(" yet"), choice.reason


def _dtype_for(backend):
    # The fused kernels take no float64: the Triton backend would refuse a float64 call for its
    # dtype before the option.
    return torch.float32 if backend == "triton" else torch.float64


@pytest.mark.parametrize("first_backend", cpu_backends("attention"))
@pytest.mark.parametrize("names", [pytest.param(case, id="+".join(case)) for case in CASES])
@pytest.mark.parametrize("lq,lk", [(5, 9), (9, 5)], ids=["Lq<Lk", "Lq>Lk"])
def test_options_match_the_oracle_through_dispatch(request, monkeypatch, first_backend, names, lq, lk):
    if first_backend == "triton" and tuple(names) == ("window", "alibi") and lq > lk:
        # A known accuracy defect of the fused kernels, kept visible (strict: it fails once
        # fixed). Row (b0, h2, i6), alpha 1.75, has a key 4e-5 inside the support; the kernels'
        # float32 threshold puts that gap 0.36 % off its float64 value (the scores' rounding,
        # the threshold search's last Newton step, w = u (alpha - 1) - c), and dq there is about
        # 300x as sensitive to the threshold: 4.4e-5 off where 1e-5 is allowed, against 5.2e-6
        # for the plain-torch float32 reference.
        request.applymarker(pytest.mark.xfail(strict=True, reason="fused kernels' float32 threshold at a key "
                                                                  "on the support's edge"))
    _first_choice(monkeypatch, first_backend)
    dtype = _dtype_for(first_backend)
    generator = torch.Generator().manual_seed(len(names) * 100 + lq)
    q, k, v = _inputs(lq, lk, dtype)
    options = {}
    for name in names:
        options.update(_option(name, lq, lk, dtype, generator))
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(B, H, lq, E, dtype=dtype)

    out = entmax_fast.entmax_attention(q, k, v, enable_gqa=True, alpha=alpha, **options)
    _check_fallback("attention", first_backend, names)
    grads = torch.autograd.grad(out, attention_leaves(q, k, v, alpha, options), grad_out)

    expected, expected_grads = _oracle_and_grads(q, k, v, alpha, options, grad_out)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    for leaf, got, want in zip(attention_leaves(q, k, v, alpha, options), grads, expected_grads):
        torch.testing.assert_close(got.double(), want, **(ALPHA_TOL if leaf is alpha else TOL)[dtype])


@pytest.mark.parametrize("mask", ["bool", "float", "is_causal"])
@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_all_options_with_masks_and_a_float_alpha(mask, alpha):
    """Every option together with a bool mask, a float mask (its gradient too) or SDPA's
    top-left causal mask; α = 1 (softmax), 1.5, 2 (sparsemax_attention)."""
    lq, lk = 6, 11
    q, k, v = _inputs(lq, lk, torch.float64)
    generator = torch.Generator().manual_seed(3)
    options = {"window_size": (4, 2), "softcap": 2.5, "alibi_slopes": torch.rand(H, generator=generator),
               "sinks": torch.randn(H, generator=generator, dtype=torch.float64).requires_grad_()}
    leaves = [q, k, v, options["sinks"]]
    masks = {}
    if mask == "bool":
        masks["attn_mask"] = torch.rand(B, 1, lq, lk, generator=generator) > 0.3
    elif mask == "float":
        masks["attn_mask"] = torch.randn(lq, lk, generator=generator, dtype=torch.float64).requires_grad_()
        leaves.append(masks["attn_mask"])
    else:
        masks["is_causal"] = True
    grad_out = torch.randn(B, H, lq, E, dtype=torch.float64)
    if alpha == 2.0:
        out = entmax_fast.sparsemax_attention(q, k, v, enable_gqa=True, **masks, **options)
    else:
        out = entmax_fast.entmax_attention(q, k, v, enable_gqa=True, alpha=alpha, **masks, **options)
    grads = torch.autograd.grad(out, leaves, grad_out)

    leaves64 = as_float64(leaves)
    q64, k64, v64, sinks64 = leaves64[:4]
    masks64 = {"attn_mask": leaves64[4]} if mask == "float" else masks
    expected = oracle_attention(q64, k64, v64, alpha=alpha, **masks64, **{**options, "sinks": sinks64})
    expected_grads = torch.autograd.grad(expected, leaves64, grad_out)
    torch.testing.assert_close(out, expected, **TOL[torch.float64])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOL[torch.float64])


def _gpt_oss_attention(q, k, v, sinks, scale, allowed):
    """GPT-OSS's eager attention: softmax over the scores with each head's sink appended as a
    last column, the sink's column dropped afterwards."""
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed, -math.inf)
    sink_column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], 1)
    combined = torch.cat([logits, sink_column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)
    return probs[..., :-1] @ v


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding"])
def test_alpha_one_with_sinks_is_gpt_oss_softmax_with_sinks(window):
    """At α = 1 the weights are GPT-OSS's: causal (bottom-right for a query block after a
    cache), optionally a sliding window of `window` keys, forward and gradients."""
    lq, lk = 5, 8
    q, k, v = (torch.randn(1, H, length, E, dtype=torch.float64, requires_grad=True) for length in (lq, lk, lk))
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    i, j = torch.arange(lq).view(-1, 1) + lk - lq, torch.arange(lk).view(1, -1)
    allowed = j <= i
    options = {"attn_mask": causal_lower_right(lq, lk)}
    if window is not None:
        allowed &= j > i - window
        options["window_size"] = (window - 1, 0)
    grad_out = torch.randn(1, H, lq, E, dtype=torch.float64)
    out = entmax_fast.entmax_attention(q, k, v, alpha=1.0, sinks=sinks, scale=0.3, **options)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    expected = _gpt_oss_attention(q, k, v, sinks, 0.3, allowed)
    expected_grads = torch.autograd.grad(expected, (q, k, v, sinks), grad_out)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_softcap_gradients_by_finite_differences():
    """gradcheck (float64) through the capping, with the other options and a learned α."""
    q, k, v = (torch.randn(1, 2, length, 3, dtype=torch.float64) * 2 for length in (3, 5, 5))
    sinks = torch.randn(2, dtype=torch.float64)
    alpha = torch.tensor([1.3, 1.8], dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)

    def f(q, k, v, sinks, alpha):
        return entmax_fast.entmax_attention(q, k, v, alpha=alpha, softcap=0.8, sinks=sinks, alibi_slopes=slopes,
                                            window_size=(3, 1))

    assert torch.autograd.gradcheck(f, [t.requires_grad_() for t in (q, k, v, sinks, alpha)])


def test_softcap_bounds_the_scores_and_large_caps_change_nothing():
    q, k, v = _inputs(4, 6, torch.float64, scale=5.0)
    capped = entmax_fast.entmax_attention(q, k, v, enable_gqa=True, softcap=1e9)
    torch.testing.assert_close(capped, entmax_fast.entmax_attention(q, k, v, enable_gqa=True), atol=1e-12, rtol=0)
    # scores capped at ±c: with c tiny every key scores about alike, weights uniform
    flat = entmax_fast.entmax_attention(q, k, v, enable_gqa=True, softcap=1e-9)
    mean_value = v.repeat_interleave(H // HKV, dim=1).mean(-2, keepdim=True).expand(B, H, 4, E)
    torch.testing.assert_close(flat, mean_value, atol=1e-8, rtol=0)


@pytest.mark.parametrize("first_backend", cpu_backends("attention_varlen"))
def test_varlen_options_match_each_sequence_alone(monkeypatch, first_backend):
    """Windows and ALiBi positions bottom-right within each packed sequence, a row of
    (B, H) slopes per sequence, sinks and α with gradients; a sequence without keys."""
    _first_choice(monkeypatch, first_backend)
    dtype = _dtype_for(first_backend)
    cu_q = torch.tensor([0, 3, 4, 11, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 14, 14], dtype=torch.int32)
    q = (torch.randn(13, H, E, dtype=dtype) * 2).requires_grad_()
    k = torch.randn(14, HKV, E, dtype=dtype, requires_grad=True)
    v = torch.randn(14, HKV, E, dtype=dtype, requires_grad=True)
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype, requires_grad=True)
    sinks = torch.randn(H, dtype=dtype, requires_grad=True)
    slopes = torch.rand(4, H)
    options = {"window_size": (3, 0), "softcap": 2.0}
    out = entmax_fast.entmax_attention_varlen(q, k, v, cu_q, cu_k, 7, 7, alpha=alpha, sinks=sinks,
                                              alibi_slopes=slopes, **options)
    _check_fallback("attention_varlen", first_backend, ("window", "softcap", "alibi", "sinks"))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, alpha, sinks), grad_out)

    leaves64 = as_float64((q, k, v, alpha, sinks))
    q64, k64, v64, alpha64, sinks64 = leaves64
    expected = torch.zeros(13, H, E, dtype=torch.float64)
    for b in range(4):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows_k.stop == rows_k.start:
            continue  # no keys: zeros
        sequence = oracle_attention(*(t[rows].transpose(0, 1)[None] for t, rows in
                                      ((q64, rows_q), (k64, rows_k), (v64, rows_k))),
                                    alpha=alpha64, sinks=sinks64, alibi_slopes=slopes[b], **options)
        expected = expected.index_put((torch.arange(rows_q.start, rows_q.stop),), sequence[0].transpose(0, 1))
    expected_grads = torch.autograd.grad(expected, leaves64, grad_out.double())
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    assert (out[11:] == 0).all()
    for leaf, got, want in zip((q, k, v, alpha, sinks), grads, expected_grads):
        torch.testing.assert_close(got.double(), want, **(ALPHA_TOL if leaf is alpha else TOL)[dtype])


def test_dropout_drops_real_keys_weights_and_the_sink_stays_in_the_threshold():
    """With one-hot values the output rows are the weights: each kept weight is the oracle's
    (the sink's share included in the threshold) divided by 1 − p, each dropped one 0."""
    lq, lk, p = 6, 10, 0.4
    q = torch.randn(1, H, lq, E, dtype=torch.float64) * 2
    k = torch.randn(1, H, lk, E, dtype=torch.float64)
    v = torch.eye(lk, dtype=torch.float64).expand(1, H, lk, lk)
    sinks = torch.randn(H, dtype=torch.float64)
    options = {"sinks": sinks, "window_size": (5, 0), "softcap": 3.0}
    torch.manual_seed(11)
    out = entmax_fast.entmax_attention(q, k, v, dropout_p=p, **options)
    torch.manual_seed(11)
    assert torch.equal(out, entmax_fast.entmax_attention(q, k, v, dropout_p=p, **options))
    weights = oracle_attention(q, k, v, **options)
    kept = out != 0
    assert kept.any() and ((weights > 0) & ~kept).any()
    assert not (kept & (weights == 0)).any()
    torch.testing.assert_close(out[kept] * (1 - p), weights[kept], atol=1e-12, rtol=0)

    def f(q, sinks):
        torch.manual_seed(5)
        return entmax_fast.entmax_attention(q, k, v, dropout_p=p, sinks=sinks, window_size=(5, 0), softcap=3.0)

    small_q = q[..., :3, :].clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (small_q, sinks.clone().requires_grad_()))


@pytest.mark.parametrize("variant", ["upper_left", "lower_right_square"])
def test_causal_bias_that_is_is_causal_runs_on_every_backend(monkeypatch, variant):
    """causal_upper_left, and causal_lower_right with Lq = Lk, are SDPA's is_causal: no
    backend refuses them."""
    lq, lk = (5, 9) if variant == "upper_left" else (7, 7)
    bias = causal_upper_left(lq, lk) if variant == "upper_left" else causal_lower_right(lq, lk)
    q, k, v = _inputs(lq, lk, torch.float32)
    expected = entmax_fast.entmax_attention(q, k, v, is_causal=True, enable_gqa=True)
    for backend in cpu_backends("attention"):
        _first_choice(monkeypatch, backend)
        out = entmax_fast.entmax_attention(q, k, v, bias, enable_gqa=True)
        assert dispatch.last_choice("attention").backend == backend
        torch.testing.assert_close(out.double(), oracle_attention(q, k, v, is_causal=True), **TOL[torch.float32])
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def _implemented(backend):
    return importlib.import_module(f"entmax_fast.backends.{backend}").SCORE_OPTIONS_IMPLEMENTED


def test_a_forced_backend_runs_the_options_it_has_and_names_those_it_lacks():
    q, k, v = _inputs(3, 4, torch.float32)
    for backend in set(cpu_backends("attention")) - {"reference"}:
        lacking = [name for name in ("softcap", "sinks") if name not in _implemented(backend)]
        with entmax_fast.use_backend(backend):
            if lacking:
                with pytest.raises(dispatch.BackendUnavailableError,
                                   match=f"does not implement {', '.join(lacking)} yet"):
                    entmax_fast.entmax_attention(q, k, v, enable_gqa=True, softcap=2.0, sinks=torch.zeros(H))
            else:
                out = entmax_fast.entmax_attention(q, k, v, enable_gqa=True, softcap=2.0, sinks=torch.zeros(H))
                assert dispatch.last_choice("attention").backend == backend
                torch.testing.assert_close(out.double(), oracle_attention(q, k, v, softcap=2.0, sinks=torch.zeros(H)),
                                           **TOL[torch.float32])


def test_refusals_name_exactly_the_options_a_backend_lacks():
    from entmax_fast.backends import refuse_score_options, unimplemented_score_options

    request = dispatch.Request(torch.device("cpu"), torch.float32,
                               {"window": True, "softcap": True, "sinks": True})
    assert unimplemented_score_options(request, "a backend", {"window", "softcap", "sinks"}) is None
    assert unimplemented_score_options(request, "a backend", {"softcap"}) == \
        "a backend does not implement window_size, sinks yet"
    refuse_score_options("a backend", ScoreOptions((2, 0), 1.0), implemented={"window", "softcap"})
    with pytest.raises(RuntimeError, match="a backend has no score option alibi_slopes, sinks; supports"):
        refuse_score_options("a backend", ScoreOptions((2, 0), 0.0, torch.ones(H), torch.zeros(H)),
                             implemented={"window"})
    with pytest.raises(RuntimeError, match="a backend has no score option lower_right_causal; supports"):
        refuse_score_options("a backend", ScoreOptions(lower_right=True), implemented={"window"})


def test_triton_on_cuda_runs_the_options_it_has_and_names_those_it_lacks(monkeypatch):
    """The CUDA order (triton, cpp, reference) as a GPU machine takes it, without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dispatch._AVAILABILITY, "triton", (True, "pretend GPU"))
    monkeypatch.setattr(triton_backend, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    flags = {"window": True, "lower_right_causal": True, "softcap": True, "alibi_slopes": True, "sinks": True}
    request = dispatch.Request(torch.device("cuda"), torch.float16, {"alpha": 1.5, **flags})
    lacking = [flag for flag in flags if flag not in triton_backend.SCORE_OPTIONS_IMPLEMENTED]
    if not lacking:
        assert dispatch.select("attention", request)[1].backend == "triton"
        return
    with pytest.warns(UserWarning, match="runs the plain-torch reference"):
        choice = dispatch.select("attention", request)[1]
    assert choice.backend == "reference"
    named = ", ".join(REFUSED_AS[name] for name, flag in REQUEST_FLAG.items() if flag in lacking)
    assert f"triton: the fused attention does not implement {named} yet" in choice.reason


def test_backends_raise_if_called_with_an_option_they_lack():
    """supports() keeps these calls away from a backend's functions; called directly they
    raise instead of ignoring the option."""
    from entmax_fast.backends.reference import ops as reference_ops

    q, k, v = _inputs(3, 4, torch.float32)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    options = {"scale": 0.5, "is_causal": False, "dropout_p": 0.0, "enable_gqa": False, "need_grad": 0}
    reference_out, _ = reference_ops.attention_forward(q, k, v, None, 1.5, **options,
                                                       score_options=ScoreOptions(softcap=1.0))
    assert reference_out.isfinite().all()
    calls = {"window": {"window_size": (1, 1)}, "softcap": {"softcap": 1.0},
             "alibi_slopes": {"alibi_slopes": torch.ones(H)}, "sinks": {"sinks": torch.zeros(H)}}
    calls = {name: {"score_options": ScoreOptions(**option)} for name, option in calls.items()}
    for backend in set(cpu_backends("attention")) - {"reference"}:
        ops = importlib.import_module(f"entmax_fast.backends.{backend}.{'ops' if backend == 'cpp' else 'attention'}")
        for name, option in calls.items():
            if name not in _implemented(backend):
                with pytest.raises(RuntimeError, match=f"has no score option {name}"):
                    ops.attention_forward(q, k, v, None, 1.5, **options, **option)


def test_torch_compile_fullgraph_traces_the_options():
    """A float α: the reference's root finding for a tensor α is a loop of 320 steps that
    dynamo unrolls (minutes to trace on a CPU), whatever the options."""
    q, k, v = _inputs(5, 7, torch.float32)
    sinks = torch.randn(H, requires_grad=True)
    slopes = torch.rand(H)
    # Made outside: dynamo does not trace the CausalBias constructor (torch's own limit).
    bias = causal_lower_right(5, 7)

    def model(q, k, v, sinks, bias):
        return entmax_fast.entmax_attention(q, k, v, bias, enable_gqa=True, window_size=(3, -1), softcap=2.0,
                                            alibi_slopes=slopes, sinks=sinks).square().sum()

    inputs = (q, k, v, sinks)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(*inputs, bias)
    compiled_backend = dispatch.last_choice("attention").backend
    got_grads = torch.autograd.grad(got, inputs)
    expected = model(*inputs, bias)
    assert dispatch.last_choice("attention").backend == compiled_backend
    expected_grads = torch.autograd.grad(expected, inputs)
    torch.testing.assert_close(got, expected)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e)


def test_empty_calls_give_zeros_and_zero_sink_gradients():
    """No key: the sink takes the whole row, and its value is zero."""
    q = torch.randn(1, H, 3, E, requires_grad=True)
    k = v = torch.randn(1, H, 0, E)
    sinks = torch.randn(H, requires_grad=True)
    out = entmax_fast.entmax_attention(q, k, v, sinks=sinks, window_size=(1, 1))
    assert out.shape == (1, H, 3, E) and (out == 0).all()
    out.sum().backward()
    assert (sinks.grad == 0).all() and (q.grad == 0).all()


def test_oracle_sink_row_is_the_mapping_of_the_row_with_the_sink_appended():
    """The oracle's own rule, checked on one row by hand: α-entmax over [scores, sink] with
    the sink's entry left out of the weights."""
    q = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    k, v = torch.randn(1, 1, 6, 4, dtype=torch.float64), torch.randn(1, 1, 6, 4, dtype=torch.float64)
    sink = torch.tensor([0.7], dtype=torch.float64)
    row = torch.cat([(q @ k.transpose(-1, -2)).flatten() * 0.5, sink])
    weights = oracle_entmax(row, 1.5)
    assert weights[-1] > 0 and weights[:-1].sum() < 1
    expected = weights[:-1] @ v[0, 0]
    got = oracle_attention(q, k, v, scale=0.5, sinks=sink)
    torch.testing.assert_close(got.flatten(), expected, atol=1e-15, rtol=0)


def test_reference_chunks_keep_each_query_at_its_position():
    """The reference's query chunks (two rows each here) place their rows at their own key
    positions for the window, ALiBi and lower-right mask: forward and gradients as the oracle's."""
    from entmax_fast.reference import attention as reference

    lq, lk = 7, 10
    q, k, v = (t.detach() for t in _inputs(lq, lk, torch.float64))
    sinks = torch.randn(H, dtype=torch.float64)
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float64)
    slopes = torch.rand(B, H)
    options = {"scale": 0.4, "is_causal": False, "dropout_p": 0.0, "enable_gqa": True, "window_size": (3, 0),
               "softcap": 2.0, "alibi_slopes": slopes, "sinks": sinks, "chunk_elements": B * H * (lk + 1) * 2}
    out, saved = reference.attention_forward(q, k, v, None, alpha, need_grad=2, **options)
    grad_out = torch.randn_like(out)
    dq, dk, dv, _, dalpha, dsinks = reference.attention_backward(grad_out, q, k, v, None, alpha, out, saved,
                                                                 need_alpha_grad=True, need_sinks_grad=True,
                                                                 **options)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, sinks)]
    expected = oracle_attention(*leaves[:3], scale=0.4, alpha=leaves[3], sinks=leaves[4], window_size=(3, 0),
                                softcap=2.0, alibi_slopes=slopes)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    torch.testing.assert_close(out, expected, **TOL[torch.float64])
    for got, want in zip((dq, dk, dv, dalpha, dsinks), expected_grads):
        torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_score_options_value_says_what_is_in_use_its_kernel_bits_and_its_flat_form():
    """One value derives the options in use (the dispatch flags), the kernels' OPTIONS bits and
    the window a lower-right causal mask amounts to; flat and back keeps the bits."""
    from entmax_fast.backends import SCORE_OPTIONS
    from entmax_fast.common import SCORE_ALIBI, SCORE_SINK, SCORE_SOFTCAP, SCORE_WINDOW

    slopes, sinks = torch.rand(H), torch.zeros(H)
    plain = ScoreOptions()
    assert plain.in_use == () and plain.request_flags() == {} and plain.kernel_bits == 0
    assert plain.flat() == (-1, -1, 0.0, None, None)
    every = ScoreOptions((3, -1), 1.5, slopes, sinks, lower_right=True)
    assert every.in_use == tuple(SCORE_OPTIONS)
    assert every.request_flags() == {flag: True for flag in SCORE_OPTIONS}
    assert every.window_bounds == (3, 0)
    assert every.kernel_bits == SCORE_WINDOW | SCORE_SOFTCAP | SCORE_ALIBI | SCORE_SINK
    assert every.keywords() == {"window_size": (3, 0), "softcap": 1.5, "alibi_slopes": slopes, "sinks": sinks}
    left, right, softcap, flat_slopes, flat_sinks = every.flat()
    assert (left, right, softcap) == (3, 0, 1.5) and flat_slopes is slopes and flat_sinks is sinks
    assert ScoreOptions.from_flat(*every.flat()).kernel_bits == every.kernel_bits
    # A lower-right causal mask alone is a window for the kernels, but its own flag for dispatch.
    lower_right = ScoreOptions(lower_right=True)
    assert lower_right.in_use == ("lower_right_causal",) and lower_right.kernel_bits == SCORE_WINDOW
    assert lower_right.with_tensors(slopes, None).in_use == ("lower_right_causal", "alibi_slopes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.softcap = 1.0


def test_checked_score_options_are_one_value(monkeypatch):
    """The public layer checks the options once into a ScoreOptions, which reaches the backend
    whole (a CausalBias lower-right mask resolved into it)."""
    q, k, v = _inputs(3, 5, torch.float64)
    seen = []
    with entmax_fast.use_backend("reference"):
        entmax_fast.entmax_attention(q, k, v, enable_gqa=True)
        forward, backward = dispatch._LOADED[("attention", "reference")]

        def recording(*args, score_options, **kwargs):
            seen.append(score_options)
            return forward(*args, score_options=score_options, **kwargs)

        monkeypatch.setitem(dispatch._LOADED, ("attention", "reference"), (recording, backward))
        entmax_fast.entmax_attention(q, k, v, causal_lower_right(3, 5), enable_gqa=True, softcap=2.0)
    (score_options,) = seen
    assert isinstance(score_options, ScoreOptions)
    assert score_options.in_use == ("lower_right_causal", "softcap") and score_options.window_bounds == (-1, 0)
