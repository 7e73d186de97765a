"""support_size on the Triton backend (op ``attention_support``: the attention forward's row
statistics, then triton_kernels/attention_support.py counting the keys above each row's
threshold) against the reference backend's counts on the same inputs: compiled on CUDA
when there is a GPU, in the Triton interpreter on CPU tensors otherwise (tests/devices.py).

Shapes cross the interpreter's tiles (attention_common.INTERPRETER_BLOCKS: 64 query rows by
32 keys): Lq 1, 7, 70 against Lk 1, 11, 100; GQA; alpha 1.5, 2 and a tensor mixing 1.25,
1.5 and 2 per head; causal, bool and additive masks (a row with every key masked), a
lower-right causal mask, a window, softcap, ALiBi and sinks together; a NaN query; a
per-head alpha holding 1 (softmax) and values above 2.
"""
import math

import pytest
import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

import entmax_fast
from entmax_fast.reference.attention import expand_heads, masked_scores, with_sink
from devices import on_test_device
from oracle import oracle_entmax

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

E = 16
# general alpha per head (the last H of these), 1.1 on the near-one side of `log2_base`
# (1/(alpha - 1) > 4)
ALPHA_HEADS = (1.25, 1.5, 2.0, 1.1)
# The borderline keys, on which the two backends may disagree, and on no other: a key lies
# within rounding of its row's threshold when its float64 gap (alpha - 1) z - tau (its
# weight is gap^(1/(alpha-1))) is below GAP_BAND in magnitude (float32 scores and thresholds,
# fp16 inputs computed in float32 by both backends, are good to about 1e-6 there), and its
# weight within rounding of zero when its float64 weight is below WEIGHT_FLOOR (alpha near 1
# raises small gaps to large powers, which float32 takes below its smallest normal).
GAP_BAND = 1e-4
WEIGHT_FLOOR = 1e-30


@pytest.fixture(autouse=True)
def on_device():
    with on_test_device():
        yield


def _inputs(batch, heads, kv_heads, lq, lk, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, lq, E, generator=generator, dtype=torch.float64) * 2
    k = torch.randn(batch, kv_heads, lk, E, generator=generator, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


def _borderline_keys(q, k, alpha, attn_mask=None, is_causal=False, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, sinks=None):
    """Per row, the borderline keys (GAP_BAND, WEIGHT_FLOOR) of the float64 weights."""
    heads, lq = q.shape[1], q.shape[2]
    if isinstance(attn_mask, CausalBias):
        # the lower-right causal mask is the window's right bound at the diagonal
        attn_mask, window_size = None, (window_size[0], 0)
    scores = masked_scores(q.double(), expand_heads(k, heads).double(), 1 / math.sqrt(E),
                           attn_mask, 0, lq, is_causal, query_length=lq, window_size=window_size,
                           softcap=softcap,
                           alibi_slopes=None if alibi_slopes is None else alibi_slopes.double())
    row = scores if sinks is None else with_sink(scores, sinks.double())
    alpha_rows = (alpha.double().view(1, -1, 1, 1) if isinstance(alpha, torch.Tensor)
                  else torch.full((1, heads, 1, 1), float(alpha), dtype=torch.float64))
    weights = oracle_entmax(row, alpha_rows)
    # tau from each row's largest weight p: (alpha - 1) z - p^(alpha - 1)
    top = weights.argmax(-1, keepdim=True)
    tau = (alpha_rows - 1) * row.gather(-1, top) - weights.gather(-1, top) ** (alpha_rows - 1)
    gaps = (alpha_rows - 1) * scores - tau
    key_weights = weights[..., :scores.shape[-1]]
    return ((gaps.abs() < GAP_BAND) | ((key_weights > 0) & (key_weights < WEIGHT_FLOOR))).sum(-1)


def _support(backend, q, k, alpha, options):
    with entmax_fast.use_backend(backend):
        counts = entmax_fast.support_size(q, k, enable_gqa=True, alpha=alpha, **options)
    assert entmax_fast.backend_info()["last_choice"]["attention_support"]["backend"] == backend
    return counts


def _check(q, k, alpha, options):
    """Triton's counts are the reference's, but for at most the borderline keys of a row;
    returns them."""
    counts = _support("triton", q, k, alpha, options)
    expected = _support("reference", q, k, alpha, options)
    assert counts.dtype == torch.int64 and counts.shape == expected.shape == q.shape[:3]
    borderline = _borderline_keys(q, k, alpha, **options)
    assert ((counts - expected).abs() <= borderline).all(), (counts - expected).nonzero()
    # the allowance is rare (a few rows of the call): a kernel that counted wrongly would
    # not hide in it
    assert (borderline > 0).sum() <= max(2, 0.02 * borderline.numel())
    return counts


def _additive_mask(batch, lq, lk, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.randn(batch, 1, lq, lk, generator=generator, dtype=torch.float64) * 0.5
    mask[0, 0, 2] = -math.inf  # a row with every key masked
    return mask.to(dtype)


def _bool_mask(batch, lq, lk, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 1, lq, lk, generator=generator) > 0.3


# name: (dtype, (B, H, Hkv, Lq, Lk), alpha, options (from dtype, B, Lq, Lk)); every case is
# GQA. The interpreter takes about half a second per forward program (a block of 64 query
# rows of one head): few heads, few batch entries.
CASES = {
    "fp32-70x100-causal-heads": (torch.float32, (1, 4, 2, 70, 100), "heads",
                                 lambda dt, b, lq, lk: {"is_causal": True}),
    "fp32-1x100-bool-2": (torch.float32, (2, 2, 1, 1, 100), 2.0,
                          lambda dt, b, lq, lk: {"attn_mask": _bool_mask(b, lq, lk, 1)}),
    "fp32-7x11-additive-1.5": (torch.float32, (1, 2, 1, 7, 11), 1.5,
                               lambda dt, b, lq, lk: {"attn_mask": _additive_mask(b, lq, lk, dt, 2)}),
    "fp32-70x1-1.5": (torch.float32, (1, 2, 1, 70, 1), 1.5, lambda dt, b, lq, lk: {}),
    "fp32-7x100-lower_right-2": (torch.float32, (1, 2, 1, 7, 100), 2.0,
                                 lambda dt, b, lq, lk: {"attn_mask": causal_lower_right(lq, lk)}),
    # the score options together, ALiBi slopes per batch entry and head
    "fp32-70x100-options-heads": (
        torch.float32, (2, 2, 1, 70, 100), "heads",
        lambda dt, b, lq, lk: {
            "window_size": (40, 3), "softcap": 4.0,
            "alibi_slopes": torch.rand(b, 2, generator=torch.Generator().manual_seed(3)) * 0.1,
            "sinks": torch.randn(2, generator=torch.Generator().manual_seed(4)).to(dt)}),
    "fp16-70x100-causal-1.5": (torch.float16, (1, 2, 1, 70, 100), 1.5,
                               lambda dt, b, lq, lk: {"is_causal": True}),
    "fp16-7x11-bool-heads": (torch.float16, (1, 4, 2, 7, 11), "heads",
                             lambda dt, b, lq, lk: {"attn_mask": _bool_mask(b, lq, lk, 5)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_support_size_matches_the_reference(case):
    dtype, (batch, heads, kv_heads, lq, lk), alpha_kind, make_options = CASES[case]
    q, k = _inputs(batch, heads, kv_heads, lq, lk, dtype, seed=len(case))
    alpha = torch.tensor(ALPHA_HEADS[-heads:], dtype=dtype) if alpha_kind == "heads" else alpha_kind
    options = make_options(dtype, batch, lq, lk)
    counts = _check(q, k, alpha, options)
    if lk == 1:
        assert (counts == 1).all()
    else:
        # sparse rows: neither every key nor none
        assert ((counts > 0) & (counts < lk)).any()
    mask = options.get("attn_mask")
    if mask is not None and not isinstance(mask, CausalBias) and mask.is_floating_point():
        assert (counts[0, :, 2] == 0).all()  # the row with every key masked


def test_a_nan_query_row_counts_none():
    q, k = _inputs(1, 2, 1, 7, 100, torch.float32, seed=11)
    q[0, 1, 5, 0] = float("nan")
    counts = _check(q, k, torch.tensor([1.5, 2.0]), {"is_causal": True})
    assert counts[0, 1, 5] == 0
    assert (counts[0, 1, :5] > 0).all() and counts[0, 1, 6] > 0


@pytest.mark.parametrize("options", [{"is_causal": True},
                                     {"window_size": (20, 5), "softcap": 3.0, "sinks": "sinks"}],
                         ids=["causal", "window-softcap-sinks"])
def test_a_per_head_alpha_of_one_and_above_two_counts_as_the_reference(options):
    """A head at alpha 1 counts its softmax weights, heads above 2 the keys of their
    entmax (the kernels' passes of those heads, attention_common "A per-head alpha")."""
    q, k = _inputs(1, 4, 2, 70, 100, torch.float32, seed=12)
    if options.get("sinks") == "sinks":
        options = dict(options, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    counts = _check(q, k, torch.tensor([1.0, 2.5, 3.0, 1.2]), options)
    if options.get("is_causal"):
        # softmax weighs every visible key (none underflows at these scores)
        assert (counts[0, 0] == torch.arange(1, 71)).all()
