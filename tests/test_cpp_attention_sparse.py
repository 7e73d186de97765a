"""The C++ CPU attention's two paths per query tile (csrc/cpu/entmax_attention.cpp): once a
tile's weights are known, P.V and the backward's dP, dQ, dK, dV run either as dense GEMMs or
as sparse products over the supported (query, key) pairs, chosen from the tile's support.
Inputs here give each head tiles of both kinds (one batch entry with sharp scores, one with
near-uniform ones, as entmax_attention_sparse_tiles reports), and the result, forward and
every gradient, must match the float64 oracle with every score option and mask; a call
repeated on the same input gives bitwise the same result. Skipped, with the reason, when the
extension is not built."""
import pytest
import torch
from torch.nn.attention.bias import CausalBias

from entmax_fast import dispatch
from entmax_fast._validation import ScoreOptions
from entmax_fast.backends.cpp import loader
from entmax_fast.backends.cpp import ops as cpp_ops
from test_cpp_attention_options import (ALPHA_HEADS, OPTION_CASES, _attention_on, _check_against_oracle,
                                        _option_case)

_AVAILABLE, _REASON = dispatch.availability("cpp")
_AVAILABLE = _AVAILABLE and loader.has_entmax_ops()
pytestmark = [pytest.mark.skipif(not _AVAILABLE, reason=f"C++ CPU ops unavailable: {_REASON}"),
              pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

B, H, HKV, E, EV = 2, 4, 2, 8, 6
LQ, LK = 140, 300
# Query scale per batch entry: sharp scores (a few keys per row, sparse tiles), and flatter
# ones, per head, that leave more than an eighth of the keys in the support of that head's α
# (ALPHA_HEADS), so that its tiles are dense.
SHARP, FLAT = 3.0, (0.6, 0.3, 0.1, 0.02)
FLAT_OF_ALPHA = dict(zip(ALPHA_HEADS, FLAT))


# Cases whose scores leave every tile sparse on these inputs (ALiBi slopes up to 0.2 per batch
# entry, or every option with the causal limit, confine each row to its nearest keys): they
# check the sparse path alone.
ONLY_SPARSE = {"alibi_batch_heads", "is_causal"}


def _mixed_inputs(dtype, generator, lq=LQ, lk=LK, flat=FLAT):
    scale = torch.tensor([[SHARP] * H, flat], dtype=torch.float64).view(B, H, 1, 1)
    q = (torch.randn(B, H, lq, E, generator=generator, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    k = torch.randn(B, HKV, lk, E, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(B, HKV, lk, EV, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v


def operator_arguments(alpha, attn_mask=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """(attn_mask, alpha, score options) of an entmax_attention call as the C++ operators take
    them: a lower-right causal bias as the window (-1, 0), tensors detached."""
    if isinstance(attn_mask, CausalBias):
        attn_mask, window_size = None, (-1, 0)
    alpha, alibi_slopes, sinks = (t.detach() if isinstance(t, torch.Tensor) else t
                                  for t in (alpha, alibi_slopes, sinks))
    return attn_mask, alpha, ScoreOptions(tuple(window_size), softcap, alibi_slopes, sinks)


def _sparse_tiles(q, k, alpha, *, is_causal=False, **options):
    """(B, H, tiles) bool: which query tiles take the sparse path."""
    attn_mask, alpha, score_options = operator_arguments(alpha, **options)
    counts = cpp_ops.attention_support_forward(q.detach(), k.detach(), attn_mask, alpha, scale=E ** -0.5,
                                               is_causal=is_causal, enable_gqa=True, score_options=score_options)
    return cpp_ops.attention_sparse_tiles(counts, k.shape[2], is_causal=is_causal,
                                          window_size=score_options.window_size)


def _assert_both_paths(tiles, every_head=False):
    assert tiles.any() and not tiles.all(), f"expected sparse and dense tiles, got {tiles.float().mean():.2f} sparse"
    if every_head:
        # Each head has tiles of both kinds: both paths add to the same dK/dV rows.
        assert (tiles.any(dim=(0, 2)) & ~tiles.all(dim=(0, 2))).all(), tiles.any(dim=(0, 2))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", ["none"] + OPTION_CASES)
def test_sparse_and_dense_tiles_match_the_oracle(dtype, case):
    generator = torch.Generator().manual_seed(31 + len(case))
    q, k, v = _mixed_inputs(dtype, generator)
    options = {} if case == "none" else _option_case(case, LQ, LK, dtype, generator)
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype, requires_grad=True)
    if case not in ONLY_SPARSE:
        _assert_both_paths(_sparse_tiles(q, k, alpha, **options), every_head=case == "none")
    _check_against_oracle(q, k, v, alpha, options, dtype)


def mask_case(mask, generator):
    """entmax_attention's mask arguments for `mask`: a boolean mask (row 0 without any key), a
    float mask, or the causal limit."""
    if mask == "bool":
        attn_mask = torch.rand(B, 1, LQ, LK, generator=generator) > 0.3
        attn_mask[:, :, 0] = False
        return {"attn_mask": attn_mask}
    if mask == "float":
        return {"attn_mask": torch.randn(LQ, LK, generator=generator, dtype=torch.float64)}
    return {"is_causal": True}


@pytest.mark.parametrize("mask", ["bool", "float", "is_causal"])
def test_sparse_and_dense_tiles_with_masks_match_the_oracle(mask):
    generator = torch.Generator().manual_seed(7)
    q, k, v = _mixed_inputs(torch.float64, generator)
    options = _option_case("all", LQ, LK, torch.float64, generator)
    masks = mask_case(mask, generator)
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float64, requires_grad=True)
    if mask not in ONLY_SPARSE:
        _assert_both_paths(_sparse_tiles(q, k, alpha, **options, **masks))
    _check_against_oracle(q, k, v, alpha, options, torch.float64, **masks)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
def test_float_alpha_on_both_paths(alpha):
    """A float α (no dα) of each solver kind: 1.5-entmax, sparsemax, the general solver."""
    generator = torch.Generator().manual_seed(int(alpha * 100))
    q, k, v = _mixed_inputs(torch.float64, generator, flat=(FLAT_OF_ALPHA.get(alpha, 0.2),) * H)
    _assert_both_paths(_sparse_tiles(q, k, alpha), every_head=True)
    _check_against_oracle(q, k, v, alpha, {}, torch.float64)


def test_softmax_tiles_stay_dense():
    generator = torch.Generator().manual_seed(2)
    q, k, v = _mixed_inputs(torch.float64, generator)
    _check_against_oracle(q, k, v, 1.0, {}, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_repeated_calls_are_bitwise_equal(dtype):
    """Same input, same thread count: the same output and gradients, bit for bit, on a call
    mixing sparse and dense tiles with GQA, a sink and dα."""
    generator = torch.Generator().manual_seed(9)
    q, k, v = _mixed_inputs(dtype, generator, lq=200, lk=260)
    sinks = torch.randn(H, generator=generator).to(dtype).requires_grad_()
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float32, requires_grad=True)
    grad_out = torch.randn(B, H, 200, EV, generator=generator).to(dtype)
    runs = []
    for _ in range(3):
        out = _attention_on("cpp", q, k, v, alpha=alpha, sinks=sinks, window_size=(150, 40))
        runs.append((out, *torch.autograd.grad(out, (q, k, v, alpha, sinks), grad_out)))
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            assert torch.equal(got, first)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_inputs_in_projection_layout(dtype):
    """Query, key and value with (B, L, H, E) memory seen as (B, H, L, E), as a projection's
    heads are (the operator reads them where they lie): against the oracle on tiles of both
    kinds, and the same as the contiguous inputs' result."""
    generator = torch.Generator().manual_seed(11)
    q, k, v = _mixed_inputs(dtype, generator)
    strided = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    assert not any(t.is_contiguous() for t in strided)
    _assert_both_paths(_sparse_tiles(q, k, 1.5))
    out = _check_against_oracle(*strided, 1.5, {}, dtype)
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(dtype)
    grad_out_strided = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
    results = []
    for inputs, g in ((strided, grad_out_strided), ((q, k, v), grad_out)):
        out = _attention_on("cpp", *inputs, alpha=1.5)
        results.append((out, *torch.autograd.grad(out, inputs, g)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
