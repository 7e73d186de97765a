"""The supports the C++ attention's forward keeps for its backward (csrc/cpu/entmax_attention.cpp,
SupportLists): a sparsemax or 1.5-entmax tile whose rows' supports fit its pool skips the
backward's score GEMM and takes its support from the forward's columns and scores; a tile that
overflows, holds a NaN row or is capped recomputes its scores. Both kinds of tile, in one call,
must match the float64 oracle with every score option, and give bitwise the results of a call
that keeps nothing. Skipped, with the reason, when the extension is not built."""
import pytest
import torch

import entmax_fast
from entmax_fast import dispatch, entmax15, sparsemax
from entmax_fast.backends.cpp import loader
from entmax_fast.backends.cpp import ops as cpp_ops
from entmax_fast.common import GRAD_INPUTS, GRAD_NONE
from test_cpp_attention_options import (ALPHA_HEADS, OPTION_CASES, _attention_on, _check_against_oracle, _option_case,
                                        assert_compiled_like_eager)
from test_cpp_attention_sparse import EV, LK, LQ, _mixed_inputs, _sparse_tiles, mask_case, operator_arguments

_AVAILABLE, _REASON = dispatch.availability("cpp")
_AVAILABLE = _AVAILABLE and loader.has_entmax_ops()
pytestmark = [pytest.mark.skipif(not _AVAILABLE, reason=f"C++ CPU ops unavailable: {_REASON}"),
              pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

TILE = 64
# Entries per row: enough for every row of LK keys (every compact tile kept, the dense ones
# too), or so few that the sharp tiles' pools overflow in part.
POOLS = {"roomy": LK, "tight": 3}


def _set_capacity(monkeypatch, dtype, entries):
    """Makes kept_support_capacity give `entries` per row for values of EV features in dtype."""
    element = cpp_ops.compute_dtype(dtype).itemsize
    monkeypatch.setattr(cpp_ops, "KEPT_SUPPORT_SHARE", entries * (2 + element) / (EV * dtype.itemsize))
    monkeypatch.setattr(cpp_ops, "MIN_KEPT_SUPPORT", 1)


def _forward(q, k, v, alpha, need_grad=GRAD_INPUTS, is_causal=False, **options):
    attn_mask, alpha, score_options = operator_arguments(alpha, **options)
    return cpp_ops.attention_forward(q.detach(), k.detach(), v.detach(), attn_mask, alpha, scale=q.shape[-1] ** -0.5,
                                     is_causal=is_causal, dropout_p=0.0, enable_gqa=True, need_grad=need_grad,
                                     score_options=score_options)


def _kept_tiles(q, k, v, alpha, **options):
    """(B, H, tiles) bool: which query tiles the forward kept."""
    _, (_, _, _, ends) = _forward(q, k, v, alpha, **options)
    return ends[..., ::TILE] >= 0


def _kept_options(case, dtype, generator):
    """Option case `case` (test_cpp_attention_options), "all" without its softcap: every other
    option together on kept tiles."""
    options = {} if case == "none" else _option_case(case, LQ, LK, dtype, generator)
    if case == "all":
        options.pop("softcap")
    return options


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", ["none"] + OPTION_CASES)
def test_kept_and_recomputed_tiles_match_the_oracle(monkeypatch, pool, dtype, case):
    _set_capacity(monkeypatch, dtype, POOLS[pool])
    generator = torch.Generator().manual_seed(41 + len(case))
    q, k, v = _mixed_inputs(dtype, generator)
    options = _kept_options(case, dtype, generator)
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype, requires_grad=True)
    kept = _kept_tiles(q, k, v, alpha, **options)
    compact_heads = [ALPHA_HEADS.index(1.5), ALPHA_HEADS.index(2.0)]
    if case == "softcap":
        # The backward needs the cap's slope of every score: nothing is kept.
        assert not kept.any()
    else:
        assert kept[:, compact_heads].any()
        if pool == "tight":
            assert not kept[:, compact_heads].all()
        elif case == "none":
            # Dense tiles kept too (the flat batch entry's): their backward writes p over the
            # tile from the kept lists.
            sparse = _sparse_tiles(q, k, alpha, **options)
            assert (kept & ~sparse).any()
    # The general solver's heads never keep their supports.
    assert not kept[:, [ALPHA_HEADS.index(1.25), ALPHA_HEADS.index(1.75)]].any()
    _check_against_oracle(q, k, v, alpha, options, dtype)


@pytest.mark.parametrize("mask", ["bool", "float", "is_causal"])
def test_kept_tiles_with_masks_match_the_oracle(monkeypatch, mask):
    _set_capacity(monkeypatch, torch.float64, POOLS["tight"])
    generator = torch.Generator().manual_seed(5)
    q, k, v = _mixed_inputs(torch.float64, generator)
    options = _kept_options("all", torch.float64, generator)
    masks = mask_case(mask, generator)
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float64, requires_grad=True)
    assert _kept_tiles(q, k, v, alpha, **options, **masks).any()
    _check_against_oracle(q, k, v, alpha, options, torch.float64, **masks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
def test_kept_supports_give_the_recomputed_bits(monkeypatch, dtype):
    """The backward finds the same p and weights in the kept scores as in the recomputed ones
    (the same GEMM formed both): a call that keeps and one that keeps nothing agree bit for bit,
    with GQA, a float mask, a sink, a window and dα."""
    generator = torch.Generator().manual_seed(12)
    q, k, v = _mixed_inputs(dtype, generator, lq=200, lk=260)
    mask = torch.randn(200, 260, generator=generator).to(dtype)
    sinks = torch.randn(4, generator=generator).to(dtype).requires_grad_()
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float32, requires_grad=True)
    grad_out = torch.randn(2, 4, 200, EV, generator=generator).to(dtype)
    runs = []
    for entries in (POOLS["roomy"], 0):
        _set_capacity(monkeypatch, dtype, entries)
        if entries:
            assert _kept_tiles(q, k, v, alpha, attn_mask=mask, sinks=sinks, window_size=(150, 40)).any()
        out = _attention_on("cpp", q, k, v, alpha=alpha, attn_mask=mask, sinks=sinks, window_size=(150, 40))
        runs.append((out, *torch.autograd.grad(out, (q, k, v, alpha, sinks), grad_out)))
    for kept, recomputed in zip(*runs):
        assert torch.equal(kept, recomputed)


def test_a_nan_row_leaves_its_tile_recomputed(monkeypatch):
    """A query row holding NaN makes its tile's weights NaN (dense): the forward keeps the other
    tiles only, and the gradients are those of a call keeping nothing, NaN where they were."""
    generator = torch.Generator().manual_seed(13)
    q, k, v = _mixed_inputs(torch.float32, generator)
    with torch.no_grad():
        q[0, 1, 70, 3] = float("nan")
    grad_out = torch.randn(2, 4, LQ, EV, generator=generator)
    runs = []
    for entries in (POOLS["roomy"], 0):
        _set_capacity(monkeypatch, torch.float32, entries)
        if entries:
            kept = _kept_tiles(q, k, v, 1.5)
            assert not kept[0, 1, 1] and kept[0, 1, 0] and kept[0, 1, 2]
        out = _attention_on("cpp", q, k, v, alpha=1.5)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    assert runs[0][1].isnan().any()
    for kept, recomputed in zip(*runs):
        torch.testing.assert_close(kept, recomputed, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_kept_columns_are_the_support(monkeypatch, alpha):
    """Each kept row's columns are the keys with a nonzero weight (integers, exactly), its scores
    those keys' scores, and the pool past a tile's last row is zero."""
    _set_capacity(monkeypatch, torch.float64, 40)
    generator = torch.Generator().manual_seed(3)
    q, k, v = _mixed_inputs(torch.float64, generator, lq=150, lk=90)
    k = k.repeat_interleave(2, dim=1)
    v = v.repeat_interleave(2, dim=1)
    _, (stats, columns, scores, ends) = _forward(q, k, v, alpha, is_causal=True)
    raw_scores = q.detach() @ k.detach().transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    mapping = entmax15 if alpha == 1.5 else sparsemax
    weights = mapping(raw_scores.masked_fill(~causal, float("-inf")), dim=-1)
    capacity = columns.shape[-1]
    kept_rows = 0
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for t0 in range(0, q.shape[2], TILE):
                tile_ends = ends[b, h, t0:t0 + TILE].tolist()
                if tile_ends[0] < 0:
                    assert all(end == -1 for end in tile_ends)
                    continue
                # Causal rows: the tile's keys start at key 0.
                pool = slice(t0 * capacity, (t0 + len(tile_ends)) * capacity)
                flat_columns = columns[b, h].reshape(-1)[pool]
                flat_scores = scores[b, h].reshape(-1)[pool]
                first = 0
                for i, end in enumerate(tile_ends):
                    support = torch.nonzero(weights[b, h, t0 + i] > 0).flatten()
                    assert flat_columns[first:end].tolist() == support.tolist()
                    torch.testing.assert_close(flat_scores[first:end], raw_scores[b, h, t0 + i, support])
                    first = end
                    kept_rows += 1
                assert not flat_columns[first:].any() and not flat_scores[first:].any()
    assert kept_rows > 0


@pytest.mark.parametrize("keys", [32768, 32769])
def test_kept_columns_hold_16_bits(monkeypatch, keys):
    """A tile's kept columns are int16: a tile over 32768 keys is not kept; one of 32768 keeps
    its last key's column, 32767, and both give the oracle's gradients."""
    _set_capacity(monkeypatch, torch.float64, 16)
    generator = torch.Generator().manual_seed(keys)
    q = torch.randn(1, 1, 3, 4, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 1, keys, 4, generator=generator, dtype=torch.float64)
    v = torch.randn(1, 1, keys, EV, generator=generator, dtype=torch.float64)
    # The last key aligned with every query: in every row's support.
    k[0, 0, -1] = q[0, 0].sum(0) * 3
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _, (_, columns, _, ends) = _forward(q, k, v, 1.5)
    if keys > 32768:
        assert (ends == -1).all()
    else:
        assert (ends >= 0).all()
        first = torch.cat([ends.new_zeros(1), ends[0, 0, :-1]])
        last_columns = columns[0, 0].reshape(-1)[ends[0, 0] - 1]
        assert (ends[0, 0] > first).all() and (last_columns == keys - 1).all()
    _check_against_oracle(q, k, v, 1.5, {}, torch.float64)


def test_what_is_kept_follows_the_call(monkeypatch):
    """Nothing kept without a gradient, for a float α other than 1.5 and 2, with a softcap, or
    below MIN_KEPT_SUPPORT entries; the kept lists' bytes stay within the share of the output's."""
    generator = torch.Generator().manual_seed(8)
    q, k, v = _mixed_inputs(torch.float32, generator)
    _set_capacity(monkeypatch, torch.float32, 8)
    assert _forward(q, k, v, 1.5)[1][1].shape[-1] == 8
    for alpha, options in ((1.5, {"need_grad": GRAD_NONE}), (1.3, {}), (1.0, {}), (1.5, {"softcap": 2.0})):
        _, (_, columns, scores, ends) = _forward(q, k, v, alpha, **options)
        assert columns.numel() == scores.numel() == ends.numel() == 0, (alpha, options)
    monkeypatch.setattr(cpp_ops, "MIN_KEPT_SUPPORT", 9)
    assert _forward(q, k, v, 1.5)[1][1].numel() == 0
    monkeypatch.undo()
    wide_v = torch.randn(2, 2, LK, 64)
    capacity = cpp_ops.kept_support_capacity(wide_v, 1.5, 0.0)
    assert capacity > 0
    assert capacity * (2 + 4) <= cpp_ops.KEPT_SUPPORT_SHARE * 64 * 4


def test_backward_checks_the_kept_lists():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (t.detach() for t in _mixed_inputs(torch.float32, generator, lq=70, lk=80))
    alpha = torch.full((4,), 1.5, dtype=torch.float64)
    out, stats, columns, scores, ends = torch.ops.entmax_fast.entmax_attention_fwd(
        q, k, v, None, alpha, 0.3, False, [-1, -1], 0.0, None, None, 5)
    grad = torch.ones_like(out)

    def backward(*kept):
        return torch.ops.entmax_fast.entmax_attention_bwd(grad, q, k, v, None, stats, alpha, 0.3, False, False,
                                                          [-1, -1], 0.0, None, None, False, *kept)

    backward(columns, scores, ends)
    with pytest.raises(RuntimeError, match="come together"):
        backward(columns, scores, None)
    with pytest.raises(RuntimeError, match="support_columns must be int16"):
        backward(columns.int(), scores, ends)
    with pytest.raises(RuntimeError, match="support_scores must be"):
        backward(columns, scores.double(), ends)
    with pytest.raises(RuntimeError, match="support_ends must be int32"):
        backward(columns, scores, ends[:, :, :-1])
    with pytest.raises(RuntimeError, match="support_capacity must be >= 0"):
        torch.ops.entmax_fast.entmax_attention_fwd(q, k, v, None, alpha, 0.3, False, [-1, -1], 0.0, None, None, -1)


def test_operators_with_kept_lists_pass_opcheck():
    generator = torch.Generator().manual_seed(2)
    q, k, v = (t.detach() for t in _mixed_inputs(torch.float32, generator, lq=70, lk=80))
    alpha = torch.full((4,), 1.5, dtype=torch.float64)
    forward_args = (q, k, v, None, alpha, 0.3, False, [-1, -1], 0.0, None, None, 6)
    torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_fwd, forward_args)
    out, stats, *kept = torch.ops.entmax_fast.entmax_attention_fwd(*forward_args)
    assert (kept[2] >= 0).any()
    torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_bwd,
                          (torch.randn_like(out), q, k, v, None, stats, alpha, 0.3, False, False, [-1, -1], 0.0,
                           None, None, False, *kept))


def test_torch_compile_fullgraph_keeps_and_uses_the_supports(monkeypatch):
    """Traced (fake kernels: the kept lists' shapes follow the capacity), the call keeps its
    supports and gives the eager call's output and gradients."""
    _set_capacity(monkeypatch, torch.float32, 16)
    generator = torch.Generator().manual_seed(6)
    q, k, v = _mixed_inputs(torch.float32, generator, lq=100, lk=120)
    alpha = torch.tensor(ALPHA_HEADS, requires_grad=True)
    assert _kept_tiles(q, k, v, alpha, window_size=(30, -1)).any()

    def model(q, k, v, alpha):
        with dispatch.use_backend("cpp"):
            return entmax_fast.entmax_attention(q, k, v, enable_gqa=True, alpha=alpha,
                                                window_size=(30, -1)).square().sum()

    assert_compiled_like_eager(model, (q, k, v, alpha))
