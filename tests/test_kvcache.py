"""entmax_attention_with_kvcache against the float64 oracle run on each sequence's keys alone
(lower-right causal): ragged cache_seqlens (0 included), Lq 1 and > 1, appending new tokens
or not, contiguous and paged caches (shuffled block tables, garbage in unused entries), GQA,
a tensor α and the score options; the in-place writes; bad input; inference_mode."""
import itertools

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import entmax_fast
from entmax_fast import dispatch
from oracle import oracle_attention

B, H, HKV, E, EV = 3, 4, 2, 8, 6
CAPACITY = 64
SEQLENS = (0, 5, 29)  # tokens in the caches before the call
TOL = {torch.float64: {"atol": 1e-12, "rtol": 1e-12}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}
ALPHA_HEADS = (1.25, 1.5, 1.75, 2.0)
OPTIONS = {
    "plain": {},
    "window": {"window_size": (4, 0)},
    "softcap": {"softcap": 1.5},
    "alibi_heads": {"alibi_slopes": torch.rand(H, generator=torch.Generator().manual_seed(1))},
    "alibi_batch": {"alibi_slopes": torch.rand(B, H, generator=torch.Generator().manual_seed(2))},
    "sinks": {"sinks": torch.randn(H, generator=torch.Generator().manual_seed(3))},
}
OPTIONS["all"] = {**OPTIONS["window"], **OPTIONS["softcap"], **OPTIONS["alibi_batch"], **OPTIONS["sinks"]}


def _tensors(lq, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    return {"q": randn(B, H, lq, E) * 2, "k_cache": randn(B, HKV, CAPACITY, E), "v_cache": randn(B, HKV, CAPACITY, EV),
            "k": randn(B, HKV, lq, E), "v": randn(B, HKV, lq, EV)}


def _paged(cache, block_size, seed=0):
    """The same contents as a paged cache: each sequence's blocks at shuffled places of a pool
    with spare blocks; table entries past the sequence's blocks hold garbage (-1 and too large)."""
    n_blocks = CAPACITY // block_size
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(B * n_blocks + 3, generator=generator)[:B * n_blocks]
    pool = torch.randn(B * n_blocks + 3, cache.shape[1], block_size, cache.shape[3], generator=generator,
                       dtype=torch.float64).to(cache.dtype)
    table = order.view(B, n_blocks).to(torch.int32)
    for b, n in itertools.product(range(B), range(n_blocks)):
        pool[table[b, n]] = cache[b, :, n * block_size:(n + 1) * block_size]
    table = torch.cat([table, torch.tensor([[-1], [10 ** 6], [-7]], dtype=torch.int32)], dim=1)
    return pool, table


def _expected(t, seqlens_k, alpha, options):
    """The oracle on each sequence's first seqlens_k[b] keys, the queries bottom-right."""
    lq = t["q"].shape[2]
    rows = []
    for b, length in enumerate(seqlens_k):
        sequence_options = dict(options)
        if "alibi_slopes" in options and options["alibi_slopes"].dim() == 2:
            sequence_options["alibi_slopes"] = options["alibi_slopes"][b]
        rows.append(oracle_attention(t["q"][b:b + 1], t["k_cache"][b:b + 1, :, :length], t["v_cache"][b:b + 1, :, :length],
                                     attn_mask=causal_lower_right(lq, length), alpha=alpha, **sequence_options))
    return torch.cat(rows)


def _with_new_tokens(t, lq):
    """The caches as they are after appending k and v at SEQLENS."""
    k_cache, v_cache = t["k_cache"].clone(), t["v_cache"].clone()
    for b, start in enumerate(SEQLENS):
        k_cache[b, :, start:start + lq] = t["k"][b]
        v_cache[b, :, start:start + lq] = t["v"][b]
    return {**t, "k_cache": k_cache, "v_cache": v_cache}


def _call(t, lq, append, paged, alpha, options, block_size=16):
    k_cache, v_cache = t["k_cache"].clone(), t["v_cache"].clone()
    table = None
    if paged:
        (k_cache, table), (v_cache, _) = _paged(k_cache, block_size), _paged(v_cache, block_size)
    new = (t["k"], t["v"]) if append else ()
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32) + (0 if append else lq)
    with torch.no_grad():
        out = entmax_fast.entmax_attention_with_kvcache(t["q"], k_cache, v_cache, *new, cache_seqlens=seqlens,
                                                        block_table=table, alpha=alpha, **options)
    return out, k_cache, v_cache, table


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matches_the_oracle_on_each_sequence(name, lq, paged, dtype):
    options = {key: value.to(dtype) if key == "sinks" else value for key, value in OPTIONS[name].items()}
    t = _tensors(lq, dtype)
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype)
    out, *_ = _call(t, lq, append=True, paged=paged, alpha=alpha, options=options)
    after = _with_new_tokens(t, lq)
    expected = _expected(after, [s + lq for s in SEQLENS], alpha, options)
    assert out.dtype == dtype and out.shape == (B, H, lq, EV)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    assert dispatch.last_choice("attention_kvcache").backend in ("cpp", "reference")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_appended_tokens_land_in_place_and_nothing_else_moves(paged, block_size):
    lq = 3
    t = _tensors(lq, torch.float32, seed=4)
    out, k_cache, v_cache, table = _call(t, lq, append=True, paged=paged, alpha=1.5, options={},
                                         block_size=block_size)
    after = _with_new_tokens(t, lq)
    if paged:
        # Read back through the table: a copy is exact, so equality is the check.
        pool_k, _ = _paged(t["k_cache"], block_size)
        untouched = torch.ones(pool_k.shape[0], dtype=torch.bool)
        untouched[table[:, :CAPACITY // block_size].flatten().long()] = False
        assert torch.equal(k_cache[untouched], pool_k[untouched])
        from entmax_fast.reference.kvcache import cache_view

        real = table[:, :CAPACITY // block_size]
        k_cache, v_cache = cache_view(k_cache, real), cache_view(v_cache, real)
    assert torch.equal(k_cache, after["k_cache"])
    assert torch.equal(v_cache, after["v_cache"])


@pytest.mark.parametrize("lq", [1, 4])
def test_without_new_tokens_the_cache_already_holds_them(lq):
    t = _with_new_tokens(_tensors(lq, torch.float64, seed=5), lq)
    out, k_cache, _, _ = _call(t, lq, append=False, paged=False, alpha=1.5, options=OPTIONS["all"])
    assert torch.equal(k_cache, t["k_cache"])
    expected = _expected(t, [s + lq for s in SEQLENS], 1.5, OPTIONS["all"])
    torch.testing.assert_close(out, expected, **TOL[torch.float64])


def test_paged_equals_contiguous_and_decoding_token_by_token_equals_one_prefill():
    """Three decoding steps of one token write the same cache and give the same rows as one
    call with Lq = 3 (chunked prefill)."""
    lq = 3
    t = _tensors(lq, torch.float64, seed=6)
    together, *_ = _call(t, lq, append=True, paged=False, alpha=2.0, options=OPTIONS["window"])
    pool_k, table = _paged(t["k_cache"], 16)
    pool_v, _ = _paged(t["v_cache"], 16)
    rows = []
    with torch.no_grad():
        for i in range(lq):
            seqlens = torch.tensor(SEQLENS, dtype=torch.int32) + i
            rows.append(entmax_fast.entmax_attention_with_kvcache(
                t["q"][:, :, i:i + 1], pool_k, pool_v, t["k"][:, :, i:i + 1], t["v"][:, :, i:i + 1],
                cache_seqlens=seqlens, block_table=table, alpha=2.0, window_size=(4, 0)))
    torch.testing.assert_close(torch.cat(rows, dim=2), together, **TOL[torch.float64])


def test_float16_against_float32():
    lq = 2
    t = _tensors(lq, torch.float16, seed=7)
    out, *_ = _call(t, lq, append=True, paged=True, alpha=1.5, options=OPTIONS["all"])
    t32 = {name: tensor.float() for name, tensor in t.items()}
    expected, *_ = _call(t32, lq, append=True, paged=True, alpha=1.5, options=OPTIONS["all"])
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_inference_mode_and_an_empty_cache():
    t = _tensors(1, torch.float32, seed=8)
    with torch.inference_mode():
        k_cache, v_cache = t["k_cache"].clone(), t["v_cache"].clone()
        out = entmax_fast.entmax_attention_with_kvcache(t["q"], k_cache, v_cache, t["k"], t["v"],
                                                        cache_seqlens=torch.zeros(B, dtype=torch.int32))
    # One key per sequence: its weight is 1 and the output its value.
    torch.testing.assert_close(out, t["v"].repeat_interleave(H // HKV, dim=1), atol=1e-6, rtol=0)
    with torch.no_grad():
        empty = entmax_fast.entmax_attention_with_kvcache(t["q"][:, :, :0], t["k_cache"][:, :, :0],
                                                          t["v_cache"][:, :, :0],
                                                          cache_seqlens=torch.zeros(B, dtype=torch.int32))
    assert empty.shape == (B, H, 0, EV)


def _bad_call(**changes):
    t = _tensors(2, torch.float32, seed=9)
    arguments = {"q": t["q"], "k_cache": t["k_cache"], "v_cache": t["v_cache"], "k": t["k"], "v": t["v"],
                 "cache_seqlens": torch.tensor(SEQLENS, dtype=torch.int32)}
    arguments.update(changes)
    with torch.no_grad():
        entmax_fast.entmax_attention_with_kvcache(**arguments)


BAD = [
    ({"cache_seqlens": torch.tensor([0, 5, 63], dtype=torch.int32)}, ValueError, "cache_seqlens \\+ Lq <= the cache's capacity 64"),
    ({"cache_seqlens": torch.tensor([0, -1, 3], dtype=torch.int32)}, ValueError, "cache_seqlens must be >= 0"),
    ({"k": None, "v": None}, ValueError, "cache_seqlens must hold the new tokens"),
    ({"cache_seqlens": torch.tensor(SEQLENS)}, ValueError, "cache_seqlens must be an int32 tensor"),
    ({"cache_seqlens": torch.tensor(SEQLENS[:2], dtype=torch.int32)}, ValueError, "cache_seqlens must have shape"),
    ({"cache_seqlens": 5}, ValueError, "cache_seqlens must be an int32 tensor of shape \\(B,\\)"),
    ({"v": None}, ValueError, "k and v must be given together"),
    ({"k": torch.randn(B, HKV, 3, E)}, ValueError, "k must have shape"),
    ({"k_cache": torch.randn(B, HKV, CAPACITY, E + 1)}, ValueError, "k_cache must have q's head dim"),
    ({"k_cache": torch.randn(B + 1, HKV, CAPACITY, E)}, ValueError, "k_cache must have q's batch size"),
    ({"v_cache": torch.randn(B, HKV, CAPACITY - 1, EV)}, ValueError, "v_cache must match k_cache"),
    ({"k_cache": torch.randn(B, 3, CAPACITY, E), "v_cache": torch.randn(B, 3, CAPACITY, EV),
      "k": torch.randn(B, 3, 2, E), "v": torch.randn(B, 3, 2, EV)}, ValueError, "must be a multiple of the caches' heads"),
    ({"k_cache": torch.randn(B, HKV, CAPACITY, E, dtype=torch.float64)}, TypeError, "k_cache must have q's dtype"),
    ({"k": torch.randn(B, HKV, 2, E, dtype=torch.float64)}, TypeError, "k must have q's dtype"),
    ({"q": torch.randn(B, H, E)}, ValueError, "q must be 4-D"),
    ({"k_cache": torch.randn(B, HKV, CAPACITY, E, device="meta")}, ValueError, "k_cache must be on q's device"),
]


@pytest.mark.parametrize("changes,error,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_refused_by_name(changes, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**changes)


def test_bad_paged_input_is_refused_by_name():
    t = _tensors(1, torch.float32, seed=10)
    pool_k, table = _paged(t["k_cache"], 16)
    pool_v, _ = _paged(t["v_cache"], 16)
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32)

    def call(k_cache=pool_k, v_cache=pool_v, block_table=table):
        with torch.no_grad():
            entmax_fast.entmax_attention_with_kvcache(t["q"], k_cache, v_cache, t["k"], t["v"], cache_seqlens=seqlens,
                                                      block_table=block_table)

    broken = table.clone()
    broken[2, 1] = pool_k.shape[0]  # sequence 2 uses blocks 0 and 1 after the call (29 + 1 tokens)
    with pytest.raises(ValueError, match="block_table's entries for the blocks a sequence uses must be in"):
        call(block_table=broken)
    with pytest.raises(ValueError, match="block_size .* must be a positive multiple of 16"):
        call(k_cache=pool_k[:, :, :8], v_cache=pool_v[:, :, :8])
    with pytest.raises(ValueError, match="block_table must be an int32 tensor"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match="block_table must have q's batch size"):
        call(block_table=table[:2])


def test_gradients_are_refused_rather_than_dropped():
    t = _tensors(1, torch.float32, seed=11)
    q = t["q"].requires_grad_()
    with pytest.raises(ValueError, match="forward-only"):
        entmax_fast.entmax_attention_with_kvcache(q, t["k_cache"], t["v_cache"], t["k"], t["v"],
                                                  cache_seqlens=torch.tensor(SEQLENS, dtype=torch.int32))
