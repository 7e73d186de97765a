"""Score options of the fused Triton attention (window_size, a lower-right causal mask,
softcap, ALiBi, sinks) in the kernels themselves: compiled on CUDA when there is a GPU, in the
Triton interpreter on CPU tensors otherwise (tests/devices.py).

Shapes cross the interpreter's tiles (attention_common.INTERPRETER_BLOCKS: 64 query rows by
32 keys): ragged lengths, Lq < Lk and Lq > Lk, windows bounded on the left, the right, both,
neither side within the sequence, rows left with no key. Forward and gradients (q, k, v,
a per-head alpha and the sinks) against the float64 oracle; the key and query tiles the
kernels visit against the window's band (a pass visits only tiles that hold a key of some
row's window); fp16 against plain torch in fp16; dropout against the kernel's own mask;
varlen.
"""
import itertools
import math

import numpy as np
import pytest
import torch

import entmax_fast
from entmax_fast import dispatch
from entmax_fast.backends import triton as triton_backend
from entmax_fast.backends.triton import attention as tri
from entmax_fast.reference.attention import with_sink
from entmax_fast.reference.mappings import entmax_backward, entmax_forward
from entmax_fast.triton_kernels import attention_bwd, attention_common, attention_fwd
from devices import LOW_PRECISION, ON_GPU, on_test_device, triton_attention
from oracle import oracle_attention

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

BLOCK_M, BLOCK_N = attention_common.INTERPRETER_BLOCKS
# float32 kernels against the float64 oracle, errors relative to the largest expected
# magnitude (at least 1): tests/test_triton_attention.py's bounds
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def on_device():
    with on_test_device():
        yield


def _err(got, expected):
    if expected.numel() == 0:
        return 0.0
    expected = expected.to(torch.float64)
    scale = expected.abs().max().clamp(min=1.0)
    return ((got.to(torch.float64) - expected).abs().max() / scale).item()


def _inputs(b, h, hkv, lq, lk, e, dtype=torch.float32, scale=1.5):
    q = torch.randn(b, h, lq, e) * scale
    k = torch.randn(b, hkv, lk, e)
    v = torch.randn(b, hkv, lk, e)
    return [t.to(dtype) for t in (q, k, v)]


def _run(fn, inputs, grad_out):
    """fn's output and the gradients of every floating input."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return out.detach(), grads


def _check_against_oracle(q, k, v, alpha, grad_out, sinks=None, **options):
    """The Triton backend ran the call, and its output and gradients (q, k, v, alpha, and
    the sinks when given) are the float64 oracle's."""
    inputs = [q, k, v, alpha] + ([] if sinks is None else [sinks])

    def call(attention, q_, k_, v_, a_, *sinks_, **extra):
        return attention(q_, k_, v_, alpha=a_, **options, **extra,
                         **({"sinks": sinks_[0]} if sinks_ else {}))

    out, grads = _run(lambda *t: call(triton_attention, *t, enable_gqa=True), inputs, grad_out)
    assert dispatch.last_choice("attention").backend == "triton"
    expected, expected_grads = _run(lambda *t: call(oracle_attention, *t),
                                    [t.double() for t in inputs], grad_out.double())
    assert torch.isfinite(out).all()
    assert _err(out, expected) <= OUT_TOL
    for name, got, want in zip(("dq", "dk", "dv", "dalpha", "dsinks"), grads, expected_grads):
        assert _err(got, want) <= GRAD_TOL, name
    return out


def test_the_backend_lists_the_options_it_implements():
    assert triton_backend.SCORE_OPTIONS_IMPLEMENTED == {"window", "lower_right_causal", "softcap",
                                                        "alibi_slopes", "sinks"}
    options = {"alpha": 1.5, "window": True, "softcap": True, "alibi_slopes": True,
               "sinks": True}
    request = dispatch.Request(torch.device("cpu"), torch.float32, options)
    assert triton_backend.supports("attention", request) is None
    assert triton_backend.supports("attention_varlen", request) is None


WINDOWS = {"left": (20, -1), "right": (-1, 20), "both": (21, 6), "lower-right": (-1, 0),
           "wider": (500, 400), "one-key": (0, 0)}


@pytest.mark.parametrize("lq,lk", [(70, 133), (133, 70)], ids=["Lq<Lk", "Lq>Lk"])
@pytest.mark.parametrize("window", list(WINDOWS), ids=list(WINDOWS))
def test_windows_match_the_oracle(window, lq, lk):
    """Windows across query blocks and key tiles, GQA, a per-head alpha; with Lq > Lk the
    bottom-right window leaves the first rows without a key (zero output and gradients)."""
    torch.manual_seed(lq + sum(WINDOWS[window]))
    # One sequence of two heads over one key/value head: GQA, the general α kind and
    # sparsemax's, at a quarter of the interpreter's time of four heads in two sequences.
    q, k, v = _inputs(1, 2, 1, lq, lk, 16)
    alpha = torch.tensor([1.25, 2.0])
    out = _check_against_oracle(q, k, v, alpha, torch.randn(1, 2, lq, 16),
                                window_size=WINDOWS[window])
    if lq > lk and WINDOWS[window][1] == 0:
        assert torch.equal(out[:, :, :lq - lk - 1], torch.zeros_like(out[:, :, :lq - lk - 1]))


@pytest.mark.parametrize("lq,lk,window", [(133, 101, (40, 3)), (101, 133, (7, 50))],
                         ids=["Lq>Lk", "Lq<Lk"])
def test_window_with_the_causal_flag_and_a_bool_mask(lq, lk, window):
    """The window and the top-left is_causal together, and with a bool mask."""
    torch.manual_seed(lq)
    q, k, v = _inputs(1, 2, 2, lq, lk, 16)
    alpha = torch.tensor([1.5, 2.0])
    _check_against_oracle(q, k, v, alpha, torch.randn(1, 2, lq, 16), window_size=window,
                          is_causal=True)
    keep = torch.rand(1, 2, lq, lk) > 0.3
    _check_against_oracle(q, k, v, alpha, torch.randn(1, 2, lq, 16), window_size=window,
                          attn_mask=keep)


def test_lower_right_causal_mask_is_the_window_right_bound():
    from torch.nn.attention.bias import causal_lower_right

    torch.manual_seed(5)
    lq, lk = 70, 133
    q, k, v = _inputs(1, 2, 1, lq, lk, 16)
    _check_against_oracle(q, k, v, torch.tensor([1.5, 1.25]), torch.randn(1, 2, lq, 16),
                          attn_mask=causal_lower_right(lq, lk))


@pytest.mark.parametrize("slopes", ["heads", "batch-heads"])
def test_softcap_and_alibi_alone_and_with_a_window(slopes):
    torch.manual_seed(11)
    lq, lk = 70, 101
    q, k, v = _inputs(2, 2, 1, lq, lk, 16, scale=3.0)
    alpha = torch.tensor([1.5, 1.75])
    alibi = torch.rand(2) if slopes == "heads" else torch.rand(2, 2)
    cases = [{"alibi_slopes": alibi}, {"softcap": 2.0, "alibi_slopes": alibi, "window_size": (30, 10)}]
    if slopes == "heads":
        cases.insert(0, {"softcap": 1.5})  # the slopes' shape plays no part without slopes
    for options in cases:
        _check_against_oracle(q, k, v, alpha, torch.randn(2, 2, lq, 16), **options)


# Sink logits per head (the virtual key's score: not scaled, capped or shifted by ALiBi),
# near the row maxima of `_inputs`' scores at scale 3 (a spread of about 3): with
# test_sinks_match_the_oracle's shapes the first head's sink takes about a fifth of the
# weight, the second's three quarters, and the whole row (zero output) in 7-70 % of the
# second head's rows, by alpha (the float64 reference).
SINKS = (6.0, 9.0)


@pytest.mark.parametrize("options", [{}, {"window_size": (20, 0)}, {"softcap": 1.5}],
                         ids=["alone", "window", "softcap"])
def test_sinks_match_the_oracle(options):
    """Sinks alone and with a window (Lq > Lk: the first rows have no key, only the sink)
    or a softcap, GQA, ragged lengths, a per-head alpha of each kind (general and
    sparsemax, then 1.5 and general): forward and gradients, dsinks included."""
    torch.manual_seed(31 + len(options))
    lq, lk = (133, 70) if options else (70, 101)
    q, k, v = _inputs(1, 2, 1, lq, lk, 16, scale=3.0)
    sinks = torch.tensor(SINKS)
    for alpha in (torch.tensor([1.25, 2.0]), torch.tensor([1.5, 1.75])):
        _check_against_oracle(q, k, v, alpha, torch.randn(1, 2, lq, 16), sinks=sinks,
                              **options)


def test_sinks_with_a_float_alpha_and_a_row_of_masked_keys():
    """alpha 1.5 (the closed-form kind) with sinks and a bool mask that hides every key of
    some rows: those rows hold only their sink (zero output and gradients) and must not
    make the others' NaN."""
    torch.manual_seed(33)
    lq, lk = 70, 45
    q, k, v = _inputs(1, 2, 2, lq, lk, 16, scale=3.0)
    keep = torch.rand(1, 1, lq, lk) > 0.5
    keep[..., :5, :] = False
    sinks = torch.tensor([1.0, -1.0])
    grad_out = torch.randn(1, 2, lq, 16)
    out, grads = _run(lambda *t: triton_attention(*t[:3], alpha=1.5, attn_mask=keep,
                                                  sinks=t[3]), [q, k, v, sinks], grad_out)
    assert dispatch.last_choice("attention").backend == "triton"
    expected, expected_grads = _run(
        lambda *t: oracle_attention(*t[:3], alpha=1.5, attn_mask=keep, sinks=t[3]),
        [t.double() for t in (q, k, v, sinks)], grad_out.double())
    assert torch.equal(out[..., :5, :], torch.zeros_like(out[..., :5, :]))
    assert _err(out, expected) <= OUT_TOL
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected_grads):
        assert _err(got, want) <= GRAD_TOL, name


def test_softcap_gradient_where_tanh_rounds_to_one():
    """Scores 10-14 softcaps high: tanh rounds to 1 in float32, where 1 - tanh^2 would be 0;
    the kernels' 1 / cosh^2 keeps dq and dk (of order 1e-9 here) to their relative
    accuracy."""
    torch.manual_seed(13)
    lq, lk = 40, 70
    direction = torch.nn.functional.normalize(torch.randn(16), dim=0)
    q = (40.0 * direction + 0.01 * torch.randn(lq, 16)).view(1, 1, lq, 16)
    k = ((1.0 + 0.4 * torch.rand(lk, 1)) * direction + 0.01 * torch.randn(lk, 16)).view(
        1, 1, lk, 16)
    v = torch.randn(1, 1, lk, 16)
    grad_out = torch.randn(1, 1, lq, 16)
    _, grads = _run(lambda *t: triton_attention(*t, alpha=1.5, softcap=1.0), [q, k, v], grad_out)
    _, expected = _run(lambda *t: oracle_attention(*t, alpha=1.5, softcap=1.0),
                       [t.double() for t in (q, k, v)], grad_out.double())
    for name, got, want in zip(("dq", "dk"), grads[:2], expected[:2]):
        assert 0 < want.abs().max() < 1e-6, name
        assert (got.double() - want).abs().max() <= 1e-3 * want.abs().max(), name


def test_all_options_with_a_float_mask_and_float_alpha():
    torch.manual_seed(12)
    lq, lk = 101, 70
    q, k, v = _inputs(1, 2, 2, lq, lk, 16, scale=3.0)
    mask = torch.randn(lq, lk)
    grad_out = torch.randn(1, 2, lq, 16)
    options = {"softcap": 2.5, "alibi_slopes": torch.rand(2), "window_size": (9, 25),
               "attn_mask": mask}
    for alpha in (1.5, 2.0, 1.3):
        out, grads = _run(lambda *t: triton_attention(*t, alpha=alpha, **options), [q, k, v],
                          grad_out)
        expected, expected_grads = _run(lambda *t: oracle_attention(*t, alpha=alpha, **options),
                                        [t.double() for t in (q, k, v)], grad_out.double())
        assert _err(out, expected) <= OUT_TOL
        for name, got, want in zip(("dq", "dk", "dv"), grads, expected_grads):
            assert _err(got, want) <= GRAD_TOL, name


def _scalar(x):
    """An int from a kernel value: a Python int, or the interpreter's tensor of one."""
    return int(np.asarray(x.handle.data).reshape(-1)[0]) if hasattr(x, "handle") else int(x)


def _record_tiles(monkeypatch, module):
    """Records (first query row, first key) of every tile whose scores `module` forms, by
    wrapping its `shifted_scores` (the interpreter looks the name up at each call)."""
    visited = []
    original = module.shifted_scores

    def recording(*args):
        visited.append((_scalar(args[9]), _scalar(args[10])))
        return original(*args)

    monkeypatch.setattr(module, "shifted_scores", recording)
    return visited


@pytest.mark.skipif(ON_GPU, reason="counts the interpreter's calls")
@pytest.mark.parametrize("lq,lk,window", [(64, 320, (20, 10)), (320, 64, (10, 20)),
                                          (256, 256, (8, 8))], ids=["keys-left", "queries", "band"])
def test_passes_visit_only_the_tiles_of_the_window(monkeypatch, lq, lk, window):
    """Every tile a forward pass, dQ or dK/dV forms scores for holds a key inside some row's
    window (so a pass costs O(L x window), not O(L^2)), and every tile with a key inside a
    row's window is visited. Keys and values no row sees, and queries that see no key, are
    NaN: a skipped tile is never read, and the output and gradients are the oracle's (on
    zeros there, which reach nothing); those tiles lie wholly outside every window."""
    torch.manual_seed(lq)
    q, k, v = _inputs(1, 1, 1, lq, lk, 16)
    left, right = window
    rows = torch.arange(lq).view(-1, 1) + lk - lq
    keys = torch.arange(lk).view(1, -1)
    band = (keys >= rows - left) & (keys <= rows + right)
    # whole tiles (the lengths are multiples of the tiles): a visited tile's keys outside
    # the band are masked, but NaN there would still reach the products (0 x NaN)
    unseen_keys = (~band.view(lq, -1, BLOCK_N).any(2).any(0)).repeat_interleave(BLOCK_N)
    blind_rows = (~band.view(-1, BLOCK_M, lk).any(2).any(1)).repeat_interleave(BLOCK_M)
    assert unseen_keys.any() or blind_rows.any() or lq == lk
    grad_out = torch.randn(1, 1, lq, 16)
    q_nan, k_nan, v_nan, g_nan = q.clone(), k.clone(), v.clone(), grad_out.clone()
    k_nan[..., unseen_keys, :] = float("nan")
    v_nan[..., unseen_keys, :] = float("nan")
    q_nan[..., blind_rows, :] = float("nan")
    g_nan[..., blind_rows, :] = float("nan")
    visited = {name: _record_tiles(monkeypatch, module)
               for name, module in (("forward", attention_fwd), ("backward", attention_bwd))}
    out, grads = _run(lambda *t: triton_attention(*t, alpha=1.5, window_size=window),
                      [q_nan, k_nan, v_nan], g_nan)
    for tiles in visited.values():
        for first_row, first_key in tiles:
            tile = band[first_row:first_row + BLOCK_M, first_key:first_key + BLOCK_N]
            assert tile.any(), (first_row, first_key)
    forward_tiles = set(visited["forward"])
    for first_row in range(0, lq, BLOCK_M):
        for first_key in range(0, lk, BLOCK_N):
            if band[first_row:first_row + BLOCK_M, first_key:first_key + BLOCK_N].any():
                assert (first_row, first_key) in forward_tiles
    for t in (q_nan, k_nan, v_nan, g_nan):
        t.nan_to_num_(0.0)
    expected, expected_grads = _run(
        lambda *t: oracle_attention(*t, alpha=1.5, window_size=window),
        [t.double() for t in (q_nan, k_nan, v_nan)], g_nan.double())
    assert torch.isfinite(out[..., ~blind_rows, :]).all()
    assert _err(out[..., ~blind_rows, :], expected[..., ~blind_rows, :]) <= OUT_TOL
    dq, dk, dv = grads
    assert _err(dq[..., ~blind_rows, :], expected_grads[0][..., ~blind_rows, :]) <= GRAD_TOL
    assert _err(dk, expected_grads[1]) <= GRAD_TOL
    assert _err(dv, expected_grads[2]) <= GRAD_TOL


def test_window_edges_holding_more_scores_than_the_capture_slots(monkeypatch):
    """The first threshold pass captures the scores of a block's tiles that cross the
    window's edges before its listed tiles; a window wider than a tile on both sides gives a
    row more of them than its slots (32 here). The block must then take the passes over the
    tiles: the scores it could not store are the high ones (keys 0-63, captured last), and
    a threshold found from those it stored would be too low."""
    monkeypatch.setattr(attention_common, "candidate_slots", lambda alpha_kind: 32)
    torch.manual_seed(3)
    lq = lk = 192
    direction = torch.nn.functional.normalize(torch.randn(16), dim=0)
    level = torch.where(torch.arange(lk) < 64, 1.0, 0.8)
    k = (level.view(-1, 1) * direction + 1e-3 * torch.randn(lk, 16)).view(1, 1, lk, 16)
    q = (4.0 * direction + 1e-3 * torch.randn(lq, 16)).view(1, 1, lq, 16).repeat(1, 2, 1, 1)
    v = torch.randn(1, 1, lk, 16)
    grad_out = torch.randn(1, 2, lq, 16)
    # a float alpha of 1.5 or 2: the kinds whose blocks always capture (a learned alpha's
    # capture only where its rows are likely to fit, `attention_fwd._capture_fits`)
    for alpha in (1.5, 2.0):
        out, grads = _run(lambda *t: triton_attention(*t, enable_gqa=True, alpha=alpha,
                                                      window_size=(70, 50)), [q, k, v], grad_out)
        expected, expected_grads = _run(
            lambda *t: oracle_attention(*t, alpha=alpha, window_size=(70, 50)),
            [t.double() for t in (q, k, v)], grad_out.double())
        assert _err(out, expected) <= OUT_TOL
        for name, got, want in zip(("dq", "dk", "dv"), grads, expected_grads):
            assert _err(got, want) <= GRAD_TOL, name


@pytest.mark.parametrize("with_sinks", [False, True], ids=["options", "options-and-sinks"])
def test_varlen_with_options_matches_each_sequence_alone(with_sinks):
    """Packed sequences of ragged lengths (Lq < Lk, Lq > Lk, equal), each with its own
    bottom-right window position and its own row of (B, H) ALiBi slopes; and with sinks,
    whose gradient sums over the sequences."""
    torch.manual_seed(21)
    lens_q, lens_k = [5, 70, 100], [37, 70, 66]
    h, hkv, e = 2, 1, 16
    alpha = torch.tensor([1.5, 1.25])
    slopes = torch.rand(len(lens_q), h)
    options = {"window_size": (12, 30), "softcap": 2.0}
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), h, e) * 2
    k = torch.randn(sum(lens_k), hkv, e)
    v = torch.randn(sum(lens_k), hkv, e)
    grad_out = torch.randn(sum(lens_q), h, e)
    inputs = [q, k, v, alpha] + ([torch.tensor(SINKS)] if with_sinks else [])

    def sink_option(leaves):
        return {"sinks": leaves[4]} if with_sinks else {}

    def packed(*leaves):
        with entmax_fast.use_backend("triton"):
            return entmax_fast.entmax_attention_varlen(
                *leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), alpha=leaves[3],
                alibi_slopes=slopes, **options, **sink_option(leaves))

    out, grads = _run(packed, inputs, grad_out)
    assert dispatch.last_choice("attention_varlen").backend == "triton"
    leaves = [t.double().requires_grad_() for t in inputs]
    outs = []
    for i in range(len(lens_q)):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        outs.append(oracle_attention(
            leaves[0][sq].transpose(0, 1)[None], leaves[1][sk].transpose(0, 1)[None],
            leaves[2][sk].transpose(0, 1)[None], alpha=leaves[3], alibi_slopes=slopes[i],
            **options, **sink_option(leaves))[0].transpose(0, 1))
    expected = torch.cat(outs)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out.double())
    assert _err(out, expected) <= OUT_TOL
    for name, got, want in zip(("dq", "dk", "dv", "dalpha", "dsinks"), grads, expected_grads):
        assert _err(got, want) <= GRAD_TOL, name


def _plain_torch_attention(q, k, v, alpha, window_size, softcap, alibi_slopes, sinks=None):
    """What a user gets composing torch ops in q's dtype: low-precision products, the options
    and the entmax mapping in fp32, weights rounded back to q's dtype."""
    scores = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))).float()
    scores = softcap * torch.tanh(scores / softcap)
    lq, lk = scores.shape[-2:]
    pos = torch.arange(lq).view(-1, 1) + lk - lq
    j = torch.arange(lk).view(1, -1)
    scores = scores - alibi_slopes.view(1, -1, 1, 1) * (pos - j).abs()
    left, right = window_size
    scores = scores.masked_fill((j < pos - left) | (j > pos + right), -math.inf)
    if sinks is not None:
        scores = with_sink(scores, sinks.float())
    weights = entmax_forward(scores, alpha)[..., :lk].to(q.dtype)
    return weights @ v


@pytest.mark.parametrize("with_sinks", [False, True], ids=["options", "options-and-sinks"])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_error_at_most_twice_plain_torch(dtype, with_sinks):
    torch.manual_seed(8)
    lq, lk = 70, 133
    q, k, v = _inputs(1, 2, 2, lq, lk, 64, dtype)
    options = {"window_size": (40, 20), "softcap": 3.0, "alibi_slopes": torch.rand(2)}
    if with_sinks:
        # the sinks take about half of the weight here (0.41 and 0.54 of it on average,
        # the float64 reference at alpha 1.5)
        options["sinks"] = torch.tensor([1.0, 2.0], dtype=dtype)
    out = triton_attention(q, k, v, alpha=1.5, **options)
    base = _plain_torch_attention(q, k, v, 1.5, **options)
    expected = oracle_attention(q, k, v, alpha=1.5, **options)
    assert out.dtype == dtype

    assert _err(out, expected) <= 2.0 * _err(base, expected)


def test_dropout_in_a_window_uses_the_kernels_mask():
    """Dropout's factors per weight are the kernel's (attention_common.dropout_scale, drawn
    by a kernel of test_triton_attention.py), the weights those of the window."""
    from test_triton_attention import _dropout_factors_kernel

    b, h, lq, lk, e, dropout_p, window = 1, 2, 70, 101, 16, 0.3, (25, 4)
    torch.manual_seed(2)
    q, k, v = _inputs(b, h, h, lq, lk, e)
    alpha = torch.tensor([1.25, 1.75])
    grad_out = torch.randn(b, h, lq, e)
    torch.manual_seed(7)
    out, grads = _run(lambda q_, k_, v_, a_: triton_attention(
        q_, k_, v_, dropout_p=dropout_p, alpha=a_, window_size=window), [q, k, v, alpha], grad_out)
    torch.manual_seed(7)
    seed = tri._seed(dropout_p, q.device)
    factors = torch.zeros(b * h, lq, lk)
    _dropout_factors_kernel[(b * h,)](factors, seed, h, lq, lk, dropout_p, BLOCK_M=32, BLOCK_N=32)
    factors = factors.view(b, h, lq, lk).double()
    q64, k64, v64, g64 = (t.double() for t in (q, k, v, grad_out))
    scale = 1 / math.sqrt(e)
    pos = torch.arange(lq).view(-1, 1) + lk - lq
    j = torch.arange(lk).view(1, -1)
    outside = (j < pos - window[0]) | (j > pos + window[1])
    scores = (q64 @ k64.transpose(-1, -2) * scale).masked_fill(outside, -math.inf)
    alpha64 = alpha.double().view(1, h, 1, 1)
    p = entmax_forward(scores, alpha64)
    dz, dalpha = entmax_backward(p, (g64 @ v64.transpose(-1, -2)) * factors, alpha64)
    expected = [scale * dz @ k64, scale * dz.transpose(-1, -2) @ q64,
                (p * factors).transpose(-1, -2) @ g64, dalpha.sum((0, 2, 3))]
    assert _err(out, (p * factors) @ v64) <= OUT_TOL
    for name, got, want in zip(("dq", "dk", "dv", "dalpha"), grads, expected):
        assert _err(got, want) <= GRAD_TOL, name


def test_window_tile_bounds_cover_every_pair_of_the_band():
    """`window_key_tiles` and `window_query_tiles`, run as Python: the masked and full ranges
    are ordered, the full tiles lie inside every row's window, and the ranges hold every
    (row, key) pair of the band, for random block positions, windows, lengths and the
    causal flag."""
    key_tiles = _python(attention_common.window_key_tiles)
    query_tiles = _python(attention_common.window_query_tiles)
    rng = np.random.default_rng(0)
    for _ in range(300):
        lq, lk = (int(x) for x in rng.integers(1, 300, 2))
        left, right = (int(x) if x < 300 else attention_common.WINDOW_UNBOUNDED_C.value
                       for x in rng.integers(0, 340, 2))
        causal = bool(rng.integers(0, 2))
        rows = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        band = (j >= rows + lk - lq - left) & (j <= rows + lk - lq + right)
        if causal:
            band &= j <= rows
        for start_m in range(0, lq, BLOCK_M):
            kv_end = min(lk, start_m + BLOCK_M) if causal else lk
            full_end = ((min(lk, start_m + 1) if causal else lk) // BLOCK_N) * BLOCK_N
            kv_begin, full_begin, n_full, kv_end = key_tiles(
                start_m, kv_end, full_end, lk - lq, left, right, BLOCK_M, BLOCK_N)
            assert kv_begin <= full_begin <= n_full and kv_begin % BLOCK_N == 0
            keys = np.nonzero(band[start_m:start_m + BLOCK_M].any(0))[0]
            if len(keys):
                assert kv_begin <= keys.min() and keys.max() < kv_end
            block = np.arange(start_m, start_m + BLOCK_M)[:, None]
            inside = (j >= block + lk - lq - left) & (j <= block + lk - lq + right) & (j < lk)
            if causal:
                inside &= j <= block
            assert inside[:, full_begin:n_full].all()
        for start_n in range(0, lk, BLOCK_N):
            m_begin, m_full = 0, 0
            if causal:
                m_begin = (start_n // BLOCK_M) * BLOCK_M
                m_full = -(-(start_n + BLOCK_N - 1) // BLOCK_M) * BLOCK_M
            if start_n + BLOCK_N > lk:
                m_full = lq
            m_full = min(m_full, lq)
            m_begin, m_full, m_full_end, m_end = query_tiles(
                start_n, lq, m_begin, m_full, lk - lq, left, right, BLOCK_M, BLOCK_N)
            assert m_full <= m_full_end and (m_begin <= m_full or m_begin >= m_end)
            seen = np.nonzero(band[:, start_n:start_n + BLOCK_N].any(1))[0]
            if len(seen):
                assert m_begin <= seen.min() and seen.max() < m_end
            cols = np.arange(start_n, start_n + BLOCK_N)[None, :]
            inside = (cols >= rows + lk - lq - left) & (cols <= rows + lk - lq + right)
            if causal:
                inside &= cols <= rows
            # the listed (unmasked) query tiles: whole tiles from m_full to m_full_end
            listed = slice(-(-m_full // BLOCK_M) * BLOCK_M, (m_full_end // BLOCK_M) * BLOCK_M)
            assert inside[listed].all()
            assert listed.start >= listed.stop or listed.stop <= (lq // BLOCK_M) * BLOCK_M


def _python(fn):
    """A @triton.jit helper of scalars run as Python: tl's where, minimum, maximum and cdiv
    on ints."""
    import inspect
    import textwrap

    import triton.language as tl

    functions = {"where": lambda c, a, b: a if c else b, "minimum": min, "maximum": max,
                 "cdiv": lambda a, b: -(-a // b)}

    class Lang:
        def __getattr__(self, name):
            return functions.get(name) or getattr(tl, name)

    source_fn = fn.fn if hasattr(fn, "fn") else fn
    namespace = dict(source_fn.__globals__, tl=Lang())
    source = textwrap.dedent(inspect.getsource(source_fn))
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    exec(compile(source, "<python>", "exec"), namespace)
    return namespace[source_fn.__name__]


class _Launched(Exception):
    """Raised by a recorded kernel launch: the launch's arguments are all a test reads."""


def _record_launch(monkeypatch, module, name, raising=True):
    """Replace ``module.name`` (a @triton.jit kernel) with a recorder whose launch stores
    (args, kwargs) and raises _Launched, or (``raising`` False) returns having run nothing."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((args, kwargs))
                if raising:
                    raise _Launched
            return launch

    monkeypatch.setattr(module, name, Recorder())
    return launches


def _kernel_bits_before(window_bounds, softcap, alibi_slopes, sinks):
    """The fused kernels' OPTIONS as the launcher formed them before the score options became
    one value: the window bit for any bound, then the softcap, ALiBi and sink bits (1, 2, 4, 8)."""
    return ((1 if tuple(window_bounds) != (-1, -1) else 0) | (2 if softcap > 0 else 0)
            | (4 if alibi_slopes is not None else 0) | (8 if sinks is not None else 0))


@pytest.mark.skipif(ON_GPU, reason="records the launches instead of running them")
def test_kernel_bits_and_option_arguments_of_every_combination_are_unchanged(monkeypatch):
    """Every combination of the score options (no window, a window, flash-attn's causal
    window, a lower-right causal mask; softcap; ALiBi; sinks) launches the forward, backward,
    support and decoding kernels with the OPTIONS and option arguments they had before the
    options became one value (launches recorded, not run): with the options off the kernels
    are the same specialisations."""
    from torch.nn.attention.bias import causal_lower_right

    from entmax_fast.backends.triton import kvcache as triton_kvcache
    from entmax_fast.triton_kernels import attention_support

    assert (attention_common.SCORE_WINDOW, attention_common.SCORE_SOFTCAP, attention_common.SCORE_ALIBI,
            attention_common.SCORE_SINK) == (1, 2, 4, 8)
    forward = _record_launch(monkeypatch, attention_fwd, "entmax_attn_fwd_kernel", raising=False)
    backward_dq = _record_launch(monkeypatch, attention_bwd, "entmax_attn_bwd_dq_kernel", raising=False)
    backward_dkdv = _record_launch(monkeypatch, attention_bwd, "entmax_attn_bwd_dkdv_kernel", raising=False)
    support = _record_launch(monkeypatch, attention_support, "entmax_attn_support_kernel")
    decode = _record_launch(monkeypatch, triton_kvcache, "kvcache_scores_kernel")
    heads, lq, lk = 2, 3, 5
    q, k, v = _inputs(1, heads, heads, lq, lk, 16)
    combinations = 0
    for window, lower_right, softcap, alibi, sinks in itertools.product(
            [(-1, -1), (2, 1), (-1, 0)], [False, True], [0.0, 1.5], [None, torch.rand(heads)],
            [None, torch.randn(heads)]):
        options = {"window_size": window, "softcap": softcap, "alibi_slopes": alibi, "sinks": sinks}
        mask = causal_lower_right(lq, lk) if lower_right else None
        bounds = (window[0], 0) if lower_right else window
        bits = _kernel_bits_before(bounds, softcap, alibi, sinks)
        leaf = q.clone().requires_grad_()
        triton_attention(leaf, k, v, mask, **options).sum().backward()
        for args, kwargs in forward + backward_dq:
            assert kwargs["OPTIONS"] == bits
            assert args[-7:-4] == bounds + (softcap,) and [type(a) for a in args[-7:-4]] == [int, int, float]
            assert args[-3:-1] == ((0, 0) if alibi is None else (0, 1))
        (args, kwargs), = backward_dkdv
        assert kwargs["OPTIONS"] == bits and args[-6:-3] == bounds + (softcap,)
        assert forward
        forward.clear(), backward_dq.clear(), backward_dkdv.clear()
        with pytest.raises(_Launched), entmax_fast.use_backend("triton"):
            entmax_fast.support_size(q, k, mask, **options)
        assert forward and all(kwargs["OPTIONS"] == bits for _, kwargs in forward)
        forward.clear()
        args, kwargs = support.pop()
        assert kwargs["OPTIONS"] == bits & ~8
        assert args[-6:-3] == bounds + (softcap,)
        if not lower_right:
            k_cache, v_cache = torch.zeros(1, heads, 32, 16), torch.zeros(1, heads, 32, 16)
            with pytest.raises(_Launched), entmax_fast.use_backend("triton"), torch.no_grad():
                entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k[:, :, :lq], v[:, :, :lq],
                                                          cache_seqlens=torch.tensor([4], dtype=torch.int32),
                                                          **options)
            args, kwargs = decode.pop()
            assert kwargs["OPTIONS"] == (2 if softcap > 0 else 0) | (4 if alibi is not None else 0)
            assert args[-3:] == (softcap, window[0], int(sinks is not None))
        combinations += 1
    assert combinations == 48
