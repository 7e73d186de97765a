"""Length-aware query scaling (SSMax, ASEntmax's temperature): the functional form against
scores scaled row by row, the key counts for causal, padded, windowed and masked attention,
the papers' formulas, gradients, the module option and its state_dict."""
import importlib.util
import math
import pathlib
import sys

import pytest
import torch
from torch import nn

from entmax_fast import MultiheadEntmaxAttention, attention_weights, entmax_attention
from entmax_fast.length_scale import attended_keys, length_scale, length_scaled_query
from entmax_fast.mappings import entmax15

TOL = {"atol": 1e-10, "rtol": 1e-10}


def _brute_force_counts(query_length, key_length, is_causal=False, key_padding_mask=None, window_size=(-1, -1),
                        attn_mask=None):
    """Count, for every (batch, query), the keys no rule excludes, one pair at a time:
    is_causal top-left (j ≤ i), the window bottom-right (around i + Lk − Lq), as
    entmax_attention."""
    batch = 1 if key_padding_mask is None else key_padding_mask.shape[0]
    counts = torch.zeros(batch, 1, query_length, dtype=torch.long)
    left, right = window_size
    for b in range(batch):
        for i in range(query_length):
            position = i + key_length - query_length
            for j in range(key_length):
                if is_causal and j > i:
                    continue
                if left >= 0 and position - j > left:
                    continue
                if right >= 0 and j - position > right:
                    continue
                if key_padding_mask is not None and key_padding_mask[b, j]:
                    continue
                if attn_mask is not None and not attn_mask[i, j]:
                    continue
                counts[b, 0, i] += 1
    return counts


PADDING = torch.tensor([[False, False, True, False, False, False, False],
                        [True, True, False, False, False, True, False]])


@pytest.mark.parametrize("query_length,key_length", [(7, 7), (4, 7), (7, 4)], ids=["self", "Lq<Lk", "Lq>Lk"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("window_size", [(-1, -1), (2, 1), (1, -1)], ids=str)
def test_attended_keys_match_a_pair_by_pair_count(query_length, key_length, is_causal, padded, window_size):
    padding = PADDING[:, :key_length] if padded else None
    counts = attended_keys(query_length, key_length, is_causal=is_causal, key_padding_mask=padding,
                           window_size=window_size)
    expected = _brute_force_counts(query_length, key_length, is_causal, padding, window_size)
    assert torch.equal(counts.expand_as(expected), expected)


def test_attended_keys_causal_and_padding_values():
    assert attended_keys(4, 4, is_causal=True).tolist() == [[[1, 2, 3, 4]]]
    assert attended_keys(3, 5, is_causal=True).tolist() == [[[1, 2, 3]]]
    assert attended_keys(5, 3, is_causal=True).tolist() == [[[1, 2, 3, 3, 3]]]
    assert attended_keys(3, 5, window_size=(-1, 0)).tolist() == [[[3, 4, 5]]]
    assert attended_keys(3, 5).tolist() == [[[5, 5, 5]]]
    padding = torch.tensor([[False, True, False, False]])
    assert attended_keys(4, 4, is_causal=True, key_padding_mask=padding).tolist() == [[[1, 1, 2, 3]]]
    assert attended_keys(4, 4, key_padding_mask=padding).tolist() == [[[3, 3, 3, 3]]]


def test_attended_keys_with_a_full_mask_and_a_float_mask():
    generator = torch.Generator().manual_seed(3)
    allowed = torch.rand(5, 6, generator=generator) > 0.4
    counts = attended_keys(5, 6, attn_mask=allowed, key_padding_mask=PADDING[:, :6], window_size=(3, -1))
    expected = _brute_force_counts(5, 6, False, PADDING[:, :6], (3, -1), allowed)
    assert torch.equal(counts.reshape(expected.shape), expected)
    additive = torch.zeros(5, 6).masked_fill(~allowed, float("-inf"))
    assert torch.equal(attended_keys(5, 6, attn_mask=additive).reshape(1, 5), allowed.sum(-1).view(1, 5))


def test_ssmax_is_the_papers_formula():
    # Nakanishi (arXiv 2501.19399): z_i -> n^(s z_i) / sum_j n^(s z_j), i.e. softmax((s log n) z).
    torch.manual_seed(0)
    batch, heads, length, dim = 2, 3, 6, 4
    q, k, v = (torch.randn(batch, heads, length, dim, dtype=torch.float64) for _ in range(3))
    s = torch.tensor([0.5, 1.0, 1.7], dtype=torch.float64)
    scaled = length_scaled_query(q, attended_keys(length, length, is_causal=True), "ssmax", s=s)
    out = entmax_attention(scaled, k, v, is_causal=True, alpha=1.0)
    scores = q @ k.transpose(-2, -1) / math.sqrt(dim)
    expected = torch.zeros_like(out)
    for i in range(length):
        n = i + 1
        z = scores[..., i, :n]
        powers = torch.tensor(float(n), dtype=torch.float64) ** (s.view(1, -1, 1) * z)
        weights = powers / powers.sum(-1, keepdim=True)
        expected[..., i, :] = (weights.unsqueeze(-2) @ v[..., :n, :]).squeeze(-2)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("kind", ["ssmax", "asentmax"])
def test_scaled_query_equals_scores_scaled_row_by_row(kind):
    torch.manual_seed(1)
    batch, heads, length, dim = 2, 2, 7, 5
    q, k = (torch.randn(batch, heads, length, dim, dtype=torch.float64) for _ in range(2))
    params = ({"s": torch.tensor([0.8, 1.3], dtype=torch.float64)} if kind == "ssmax" else
              {"beta": torch.tensor([0.3, 0.9], dtype=torch.float64),
               "gamma": torch.tensor([-0.2, 0.4], dtype=torch.float64)})
    n_keys = attended_keys(length, length, key_padding_mask=PADDING)
    scaled = length_scaled_query(q, n_keys, kind, **params)
    keep = (~PADDING).view(batch, 1, 1, length)
    weights = entmax15(((scaled @ k.transpose(-2, -1)) / math.sqrt(dim)).masked_fill(~keep, float("-inf")), dim=-1)
    counts = (~PADDING).sum(-1).double().view(batch, 1, 1)
    if kind == "ssmax":
        factor = params["s"].view(1, -1, 1) * counts.log()
    else:
        factor = 1.0 + params["beta"].view(1, -1, 1) * counts.log() ** params["gamma"].view(1, -1, 1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(dim) * factor.unsqueeze(-1)
    expected = entmax15(scores.masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(weights, expected, **TOL)


def test_asentmax_is_the_papers_formula_and_keeps_one_key_finite():
    # Vasylenko et al. (arXiv 2506.16640): scale = delta + beta (log n)^gamma.
    n_keys = torch.tensor([[[1, 2, 10, 1000]]])
    beta = torch.tensor([0.5], dtype=torch.float64)
    gamma = torch.tensor([-0.5], dtype=torch.float64)
    scale = length_scale(n_keys, "asentmax", beta=beta, gamma=gamma, delta=1.0, dtype=torch.float64)
    expected = [1 + 0.5 * math.log(n) ** -0.5 for n in (2, 2, 10, 1000)]
    torch.testing.assert_close(scale.flatten(), torch.tensor(expected, dtype=torch.float64), **TOL)
    assert torch.isfinite(scale).all()


def test_a_query_without_keys_keeps_a_finite_scale():
    scale = length_scale(torch.tensor([[[0, 1, 3]]]), "ssmax", s=torch.ones(1))
    torch.testing.assert_close(scale.flatten(), torch.tensor([0.0, 0.0, math.log(3)]))


@pytest.mark.parametrize("kind", ["ssmax", "asentmax"])
@pytest.mark.parametrize("attention", ["softmax", "entmax15"])
def test_gradients_reach_the_length_parameters(kind, attention):
    torch.manual_seed(2)
    module = MultiheadEntmaxAttention(8, 2, batch_first=True, attention=attention, length_scale=kind)
    x = torch.randn(3, 9, 8)
    causal = nn.Transformer.generate_square_subsequent_mask(9)
    for need_weights in (False, True):
        out, _ = module(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
        names = ["length_scale_s"] if kind == "ssmax" else ["length_scale_beta", "length_scale_gamma"]
        grads = torch.autograd.grad(out.square().sum(), [getattr(module, name) for name in names])
        for grad in grads:
            assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["ssmax", "asentmax"])
@pytest.mark.parametrize("attention", ["softmax", "sparsemax", "learned"])
def test_module_paths_agree_and_match_the_functional_form(kind, attention):
    torch.manual_seed(4)
    module = MultiheadEntmaxAttention(8, 2, batch_first=True, attention=attention, length_scale=kind,
                                      dtype=torch.float64)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    padding = PADDING.clone()
    fused, _ = module(x, x, x, key_padding_mask=padding, need_weights=False)
    explicit, weights = module(x, x, x, key_padding_mask=padding, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(fused, explicit, atol=1e-9, rtol=1e-9)
    q, k, v = nn.functional.linear(x, module.in_proj_weight, module.in_proj_bias).split(8, dim=-1)
    q, k, v = (t.view(2, 7, 2, 4).transpose(1, 2) for t in (q, k, v))
    params = ({"s": module.length_scale_s} if kind == "ssmax" else
              {"beta": module.length_scale_beta, "gamma": module.length_scale_gamma})
    scaled = length_scaled_query(q, attended_keys(7, 7, key_padding_mask=padding), kind, **params)
    alpha = module.alpha
    out = entmax_attention(scaled, k, v, attn_mask=~padding.view(2, 1, 1, 7),
                           alpha=alpha if not isinstance(alpha, torch.Tensor) else alpha.to(torch.float64))
    expected = module.out_proj(out.transpose(1, 2).reshape(2, 7, 8))
    torch.testing.assert_close(fused, expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kind", ["ssmax", "asentmax"])
def test_causal_module_counts_the_keys_up_to_each_query(kind):
    torch.manual_seed(8)
    module = MultiheadEntmaxAttention(8, 2, batch_first=True, attention="entmax15", length_scale=kind,
                                      dtype=torch.float64)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    fused, _ = module(x, x, x, attn_mask=causal, is_causal=True, key_padding_mask=PADDING, need_weights=False)
    explicit, _ = module(x, x, x, attn_mask=causal, is_causal=True, key_padding_mask=PADDING, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-9, rtol=1e-9)
    q, k, v = nn.functional.linear(x, module.in_proj_weight, module.in_proj_bias).split(8, dim=-1)
    q, k, v = (t.view(2, 7, 2, 4).transpose(1, 2) for t in (q, k, v))
    params = ({"s": module.length_scale_s} if kind == "ssmax" else
              {"beta": module.length_scale_beta, "gamma": module.length_scale_gamma})
    n_keys = attended_keys(7, 7, is_causal=True, key_padding_mask=PADDING)
    out = entmax_attention(length_scaled_query(q, n_keys, kind, **params), k, v, is_causal=True,
                           attn_mask=~PADDING.view(2, 1, 1, 7), alpha=1.5)
    torch.testing.assert_close(fused, module.out_proj(out.transpose(1, 2).reshape(2, 7, 8)), atol=1e-9, rtol=1e-9)
    # Scaling by the key count of a non-causal query instead changes the output.
    wrong = entmax_attention(length_scaled_query(q, attended_keys(7, 7, key_padding_mask=PADDING), kind, **params),
                             k, v, is_causal=True, attn_mask=~PADDING.view(2, 1, 1, 7), alpha=1.5)
    assert not torch.allclose(out, wrong, atol=1e-6)


@pytest.mark.parametrize("attention", ["softmax", "entmax15"])
def test_length_scale_none_leaves_the_output_unchanged(attention):
    torch.manual_seed(5)
    plain = MultiheadEntmaxAttention(8, 2, batch_first=True, attention=attention)
    torch.manual_seed(5)
    unscaled = MultiheadEntmaxAttention(8, 2, batch_first=True, attention=attention, length_scale=None)
    assert unscaled.length_scale is None and set(unscaled.state_dict()) == set(plain.state_dict())
    x = torch.randn(2, 6, 8)
    for need_weights in (False, True):
        torch.testing.assert_close(unscaled(x, x, x, need_weights=need_weights)[0],
                                   plain(x, x, x, need_weights=need_weights)[0], atol=1e-6, rtol=1e-5)
    torch.manual_seed(5)
    reference = nn.MultiheadAttention(8, 2, batch_first=True)
    if attention == "softmax":
        torch.testing.assert_close(unscaled(x, x, x)[0], reference(x, x, x)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["ssmax", "asentmax"])
def test_state_dict_round_trip_and_a_plain_checkpoint(kind):
    torch.manual_seed(6)
    module = MultiheadEntmaxAttention(8, 2, batch_first=True, length_scale=kind)
    own = {"ssmax": ["length_scale_s"], "asentmax": ["length_scale_beta", "length_scale_gamma"]}[kind]
    assert set(module.state_dict()) - set(nn.MultiheadAttention(8, 2).state_dict()) == set(own)
    with torch.no_grad():
        for name in own:
            getattr(module, name).copy_(torch.tensor([0.25, 0.75]))
    copy = MultiheadEntmaxAttention(8, 2, batch_first=True, length_scale=kind)
    copy.load_state_dict(module.state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(copy(x, x, x)[0], module(x, x, x)[0])
    plain = nn.MultiheadAttention(8, 2, batch_first=True)
    initial = {name: getattr(copy, name).detach().clone() for name in own}
    result = copy.load_state_dict(plain.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(copy.in_proj_weight, plain.in_proj_weight)
    for name in own:
        torch.testing.assert_close(getattr(copy, name), initial[name])
    converted = MultiheadEntmaxAttention.from_torch(plain, attention="entmax15", length_scale=kind)
    assert converted.length_scale == kind


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="length_scale must be None or one of"):
        MultiheadEntmaxAttention(8, 2, length_scale="log")
    with pytest.raises(ValueError, match="kind must be one of"):
        length_scale(torch.ones(1, 1, 3, dtype=torch.long), "temperature", s=torch.ones(1))
    with pytest.raises(TypeError, match="needs the tensor s"):
        length_scale(torch.ones(1, 1, 3, dtype=torch.long), "ssmax")
    with pytest.raises(TypeError, match="needs the tensor gamma"):
        length_scale(torch.ones(1, 1, 3, dtype=torch.long), "asentmax", beta=torch.ones(1))
    with pytest.raises(ValueError, match="positive int"):
        attended_keys(0, 4)
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
        attended_keys(4, 4, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="window_size"):
        attended_keys(4, 4, window_size=(2,))
    with pytest.raises(ValueError, match="n_keys must have shape"):
        length_scaled_query(torch.randn(1, 1, 4, 2), torch.ones(1, 1, 3, dtype=torch.long), "ssmax", s=torch.ones(1))


# ---------------------------------------------------------------------------------------
# The length-generalisation benchmark (bench/bench_length_generalization.py).

def _bench():
    # Registered in sys.modules before it runs: its dataclass looks its module up there.
    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_length_generalization.py"
    if "bench_length_generalization" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_length_generalization", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_length_generalization"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_length_generalization"]


def test_flip_flop_targets_are_the_last_written_bit():
    bench = _bench()
    tokens, targets = bench.flip_flop(40, 6, torch.Generator().manual_seed(0))
    scored = 0
    for row, target_row in zip(tokens.tolist(), targets.tolist()):
        last_write = None
        for position in range(0, len(row), 2):
            operation, bit = row[position], row[position + 1]
            if operation == bench.WRITE:
                last_write = bit
            if operation == bench.READ:
                assert target_row[position] == last_write == bit
                scored += 1
            else:
                assert target_row[position] == bench.IGNORE
            assert target_row[position + 1] == bench.IGNORE
    assert scored > 0


def test_sort_and_copy_score_the_answer_half():
    bench = _bench()
    generator = torch.Generator().manual_seed(1)
    for task in ("sort", "copy"):
        tokens, targets = bench.separated_task(task, 5, 3, 16, generator)
        items = tokens[:, :5]
        answer = items.sort(dim=-1).values if task == "sort" else items
        assert torch.equal(targets[:, 5:10], answer)
        assert (targets[:, :5] == bench.IGNORE).all()
        assert (tokens[:, 5] == 16).all()
        # Teacher forcing: the input after the separator is the answer shifted by one.
        assert torch.equal(tokens[:, 6:], answer[:, :-1])


def test_benchmark_quick_path_runs_small(tmp_path):
    bench = _bench()
    kinds = ["softmax", "ssmax", "sparsemax", "asentmax"]
    results = bench.main(["--tasks", "mqar", "flip-flop", "--kinds", *kinds, "--seeds", "2", "--steps", "3",
                          "--multipliers", "1", "2", "--lm-steps", "2", "--lm-context", "8", "--lm-multiplier", "2",
                          "--lm-eval-windows", "2", "--d-model", "8", "--heads", "2", "--layers", "1",
                          "--eval-batch", "4", "--stats-batch", "2", "--train-length", "4", "--out", str(tmp_path)])
    assert (tmp_path / "results.json").exists() and (tmp_path / "tables.md").exists()
    tables = (tmp_path / "tables.md").read_text()
    for kind in kinds:
        assert f"| {kind} |" in tables
        for task in ("mqar", "flip-flop"):
            runs = results["tasks"][task][kind]
            assert len(runs) == 2
            for run in runs:
                for multiplier in ("1", "2"):
                    assert 0.0 <= run[multiplier]["accuracy"] <= 1.0
                    assert 0.0 <= run[multiplier]["zero_share"] <= 1.0
                    assert 0.0 < run[multiplier]["first_token_mass"] <= 1.0
        for run in results["language_model"][kind]:
            bits = torch.tensor(run["bpc_by_position"])
            assert bits.shape == (16,) and torch.isfinite(bits).all() and (bits > 0).all()
    # Softmax weights are never exactly zero at these sizes.
    assert all(run[m]["zero_share"] == 0.0 for task in ("mqar", "flip-flop")
               for run in results["tasks"][task]["softmax"] for m in ("1", "2"))


@pytest.mark.parametrize("query_length,key_length", [(3, 6), (6, 3)], ids=["Lq<Lk", "Lq>Lk"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window_size", [(-1, -1), (-1, 0), (1, 1)], ids=str)
def test_attended_keys_count_the_keys_entmax_attention_attends(query_length, key_length, is_causal, window_size):
    """With the same is_causal and window_size, the keys counted are those entmax_attention
    gives a weight (equal scores and α = 1: every attended key has a positive weight)."""
    q, k = torch.zeros(1, 1, query_length, 4), torch.zeros(1, 1, key_length, 4)
    weights = attention_weights(q, k, is_causal=is_causal, window_size=window_size, alpha=1.0)
    counts = attended_keys(query_length, key_length, is_causal=is_causal, window_size=window_size)
    assert counts.tolist() == (weights > 0).sum(-1).tolist()


@pytest.mark.parametrize("query_length,key_length", [(3, 6), (6, 3)], ids=["Lq<Lk", "Lq>Lk"])
def test_cross_attention_module_paths_count_the_same_keys(query_length, key_length):
    """MultiheadEntmaxAttention's is_causal hint with a top-left causal mask (torch's
    convention when Lq ≠ Lk): the fused path counts with attended_keys(is_causal=True), the
    explicit one from the mask; both length-scale each query by the keys it attends."""
    torch.manual_seed(3)
    module = MultiheadEntmaxAttention(8, 2, batch_first=True, attention="entmax15", length_scale="ssmax",
                                      dtype=torch.float64)
    with torch.no_grad():
        module.length_scale_s.fill_(2.0)
    x, memory = torch.randn(2, query_length, 8, dtype=torch.float64), torch.randn(2, key_length, 8, dtype=torch.float64)
    causal = torch.ones(query_length, key_length, dtype=torch.bool).triu(1)
    fused, _ = module(x, memory, memory, attn_mask=causal, is_causal=True, need_weights=False)
    explicit, _ = module(x, memory, memory, attn_mask=causal, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-9, rtol=1e-9)
