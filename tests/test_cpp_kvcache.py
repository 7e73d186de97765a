"""The C++ CPU decoding operator (csrc/cpu/entmax_kvcache.cpp, the cpp backend's
attention_kvcache) against the float64 oracle run on each sequence's keys alone (lower-right
causal) and against the plain-torch reference: ragged seqlens_k (0 keys with and without a
sink, 1 key, many), Lq 1 and > 1 (rows without keys where Lq exceeds the keys), contiguous and
paged caches (shuffled block tables, garbage in unused entries) giving the same rows, GQA with
groups that do not fill the kernel's four-row blocks, a tensor α, each score option and all
together, more rows than one row tile, the path that splits one sequence's keys across threads;
fp16/bf16 against the float32 reference; dispatch, inference mode, torch.compile, opcheck and
the operator's own checks of lengths and block tables. Skipped, with the reason, when the
extension is not built."""
import itertools

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import entmax_fast
from entmax_fast import dispatch
from entmax_fast._validation import ScoreOptions
from entmax_fast.backends.cpp import loader
from entmax_fast.backends.cpp import ops as cpp_ops
from entmax_fast.backends.reference import ops as reference_ops
from oracle import oracle_attention

_AVAILABLE, _REASON = dispatch.availability("cpp")
_AVAILABLE = _AVAILABLE and loader.has_kvcache_op()
pytestmark = [pytest.mark.skipif(not _AVAILABLE, reason=f"C++ decoding operator unavailable: {_REASON}"),
              # SDPA's lower-right causal bias warns of NaN rows where Lq exceeds the keys; the
              # oracle builds its own mask from it and gives zero rows there.
              pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

# Six query heads on two kv heads: a group of 3, so a decoding step's rows (3) and a chunk's
# (3·Lq) leave a remainder after the kernel's blocks of four rows. E and EV are not multiples
# of the vector width.
B, H, HKV, E, EV = 4, 6, 2, 20, 12
CAPACITY = 96
BLOCK_SIZE = 16
# Keys in each sequence's cache: none, one, several (not a block multiple), and the whole cache.
SEQLENS = (0, 1, 37, CAPACITY)
ALPHA_HEADS = (1.25, 1.5, 1.75, 2.0, 1.5, 1.25)
TOL = {torch.float64: {"atol": 1e-12, "rtol": 1e-12}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}
# tests/test_cpp_ops.py's forward allowances for fp16/bf16 (computed in float32 inside), relative
# to the largest reference entry.
LOW_PRECISION = [pytest.param(torch.float16, 2e-3, id="f16"), pytest.param(torch.bfloat16, 1.6e-2, id="bf16")]


def _options(name, dtype, heads=H, batch=B, seed=1):
    generator = torch.Generator().manual_seed(seed)
    cases = {
        "plain": {},
        "window": {"window_size": (6, 0)},
        "softcap": {"softcap": 1.5},
        "alibi_heads": {"alibi_slopes": torch.rand(heads, generator=generator) * 0.3},
        "alibi_batch": {"alibi_slopes": torch.rand(batch, heads, generator=generator) * 0.3},
        "sinks": {"sinks": torch.randn(heads, generator=generator, dtype=torch.float64).to(dtype)},
    }
    if name == "all":
        return {**cases["window"], **cases["softcap"], **cases["alibi_batch"], **cases["sinks"]}
    return cases[name]


OPTION_NAMES = ("plain", "window", "softcap", "alibi_heads", "alibi_batch", "sinks", "all")


def _inputs(lq, dtype, batch=B, heads=H, kv_heads=HKV, capacity=CAPACITY, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    return randn(batch, heads, lq, E) * 2, randn(batch, kv_heads, capacity, E), randn(batch, kv_heads, capacity, EV)


def _paged(cache, block_size=BLOCK_SIZE, seed=0):
    """The same contents as a paged cache: each sequence's blocks at shuffled places of a pool
    with spare blocks; table entries past the sequence's blocks hold garbage (-1, too large)."""
    batch, kv_heads, capacity, width = cache.shape
    n_blocks = capacity // block_size
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * n_blocks + 3, generator=generator)[:batch * n_blocks]
    pool = torch.randn(batch * n_blocks + 3, kv_heads, block_size, width, generator=generator,
                       dtype=torch.float64).to(cache.dtype)
    table = order.view(batch, n_blocks).to(torch.int32)
    for b, n in itertools.product(range(batch), range(n_blocks)):
        pool[table[b, n]] = cache[b, :, n * block_size:(n + 1) * block_size]
    garbage = torch.tensor([[-1], [10 ** 6], [-7], [batch * n_blocks + 3]], dtype=torch.int32)[:batch]
    return pool, torch.cat([table, garbage.expand(batch, 2)], dim=1)


def _cpp(q, k_cache, v_cache, seqlens, alpha, options, block_table=None):
    scale = q.shape[-1] ** -0.5
    return cpp_ops.attention_kvcache_forward(q, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32),
                                             block_table, alpha, scale=scale, score_options=ScoreOptions(**options))


def _reference(q, k_cache, v_cache, seqlens, alpha, options, block_table=None):
    scale = q.shape[-1] ** -0.5
    return reference_ops.attention_kvcache_forward(q, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32),
                                                   block_table, alpha, scale=scale,
                                                   score_options=ScoreOptions(**options))


def _oracle(q, k_cache, v_cache, seqlens, alpha, options):
    """The oracle on each sequence's first seqlens[b] keys, the queries bottom-right; a
    sequence without keys has zero rows (its sink, if any, takes the weight and has no value)."""
    lq = q.shape[2]
    rows = []
    for b, length in enumerate(seqlens):
        if length == 0:
            rows.append(torch.zeros(1, q.shape[1], lq, v_cache.shape[-1], dtype=torch.float64))
            continue
        sequence_options = dict(options)
        if "alibi_slopes" in options and options["alibi_slopes"].dim() == 2:
            sequence_options["alibi_slopes"] = options["alibi_slopes"][b]
        rows.append(oracle_attention(q[b:b + 1], k_cache[b:b + 1, :, :length], v_cache[b:b + 1, :, :length],
                                     attn_mask=causal_lower_right(lq, length), alpha=alpha, **sequence_options))
    return torch.cat(rows)


@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("lq", [1, 5])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matches_the_oracle_and_the_reference(name, lq, paged, dtype):
    q, k_cache, v_cache = _inputs(lq, dtype)
    options = _options(name, dtype)
    alpha = torch.tensor(ALPHA_HEADS, dtype=dtype)
    expected = _oracle(q, k_cache, v_cache, SEQLENS, alpha, options)
    table = None
    if paged:
        (k_cache, table), (v_cache, _) = _paged(k_cache), _paged(v_cache)
    out = _cpp(q, k_cache, v_cache, SEQLENS, alpha, options, table)
    assert out.dtype == dtype and out.shape == (B, H, lq, EV)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    reference = _reference(q, k_cache, v_cache, SEQLENS, alpha, options, table)
    torch.testing.assert_close(reference.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.25, 3.0], ids=lambda a: f"a{a}")
def test_float_alpha_of_each_solver(alpha):
    q, k_cache, v_cache = _inputs(2, torch.float64, seed=2)
    options = _options("sinks", torch.float64)
    out = _cpp(q, k_cache, v_cache, SEQLENS, alpha, options)
    torch.testing.assert_close(out, _oracle(q, k_cache, v_cache, SEQLENS, alpha, options), **TOL[torch.float64])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", ["plain", "all"])
def test_paged_equals_contiguous(block_size, name):
    q, k_cache, v_cache = _inputs(3, torch.float32, seed=3)
    options = _options(name, torch.float32)
    alpha = torch.tensor(ALPHA_HEADS)
    contiguous = _cpp(q, k_cache, v_cache, SEQLENS, alpha, options)
    (pool_k, table), (pool_v, _) = _paged(k_cache, block_size, seed=5), _paged(v_cache, block_size, seed=5)
    paged = _cpp(q, pool_k, pool_v, SEQLENS, alpha, options, table)
    # The same dot products in the same order per key; only a key's place in a pair of the
    # kernel's blocking can differ.
    torch.testing.assert_close(paged, contiguous, atol=1e-6, rtol=1e-6)


def test_more_rows_than_a_row_tile():
    """Lq = 25 in a group of 3: 75 rows per (sequence, kv head), two row tiles of at most 64,
    each with its own key range under the window."""
    lq = 25
    q, k_cache, v_cache = _inputs(lq, torch.float64, seed=6)
    seqlens = (25, 40, 70, CAPACITY)
    options = _options("all", torch.float64)
    alpha = torch.tensor(ALPHA_HEADS, dtype=torch.float64)
    expected = _oracle(q, k_cache, v_cache, seqlens, alpha, options)
    (pool_k, table), (pool_v, _) = _paged(k_cache), _paged(v_cache)
    torch.testing.assert_close(_cpp(q, pool_k, pool_v, seqlens, alpha, options, table), expected,
                               **TOL[torch.float64])


@pytest.mark.parametrize("window_size", [(-1, -1), (40, 0)], ids=["all_keys", "window"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lq", [1, 4])
def test_keys_split_across_threads_when_tasks_are_fewer(paged, lq, window_size):
    """One sequence and one kv head (one task) on two threads: the operator splits the keys
    across the threads (dot products, thresholds, P.V into partial outputs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k_cache, v_cache = _inputs(lq, torch.float64, batch=1, heads=3, kv_heads=1, capacity=160, seed=7)
        options = {**_options("all", torch.float64, heads=3, batch=1), "window_size": window_size}
        alpha = torch.tensor([1.25, 1.5, 2.0], dtype=torch.float64)
        expected = _oracle(q, k_cache, v_cache, (151,), alpha, options)
        table = None
        if paged:
            (k_cache, table), (v_cache, _) = _paged(k_cache), _paged(v_cache)
        out = _cpp(q, k_cache, v_cache, (151,), alpha, options, table)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, expected, **TOL[torch.float64])


@pytest.mark.parametrize("dtype,atol", LOW_PRECISION)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_low_precision_matches_the_float32_reference(dtype, atol, paged):
    """fp16/bf16 caches are read in their dtype and computed in float32: the output matches the
    float32 reference on the same rounded inputs up to the dtype's rounding."""
    q, k_cache, v_cache = _inputs(3, dtype, seed=8)
    options = _options("all", torch.float32)
    alpha = torch.tensor(ALPHA_HEADS)
    table = None
    if paged:
        (k_cache, table), (v_cache, _) = _paged(k_cache), _paged(v_cache)
    out = _cpp(q, k_cache, v_cache, SEQLENS, alpha, {**options, "sinks": options["sinks"].to(dtype)}, table)
    expected = _reference(q.float(), k_cache.float(), v_cache.float(), SEQLENS, alpha, options, table)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=atol * max(1.0, expected.abs().max().item()), rtol=0)


def _public_call(q, k_cache, v_cache, k, v, seqlens, **options):
    return entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k, v,
                                                     cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                                                     **options)


def test_dispatch_picks_cpp_for_cpu_tensors():
    q, k_cache, v_cache = _inputs(1, torch.float32, seed=9)
    k, v = k_cache[:, :, :1].clone(), v_cache[:, :, :1].clone()
    seqlens = (0, 5, 20, 40)
    with torch.no_grad():
        out = _public_call(q, k_cache.clone(), v_cache.clone(), k, v, seqlens, alpha=1.5, softcap=2.0)
        assert dispatch.last_choice("attention_kvcache").backend == "cpp"
        with dispatch.use_backend("reference"):
            expected = _public_call(q, k_cache.clone(), v_cache.clone(), k, v, seqlens, alpha=1.5, softcap=2.0)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("batch,kv_heads", [(B, HKV), (1, 1)], ids=["tasks", "split_keys"])
def test_inference_mode_with_inference_tensors(batch, kv_heads):
    """Under inference mode the operator's outputs and the caches it reads are inference
    tensors, in both the task-parallel path and the path that splits keys across threads."""
    heads = 3 * kv_heads
    q, k_cache, v_cache = _inputs(1, torch.float32, batch=batch, heads=heads, kv_heads=kv_heads, seed=10)
    seqlens = tuple(range(30, 30 + batch))
    with torch.no_grad():
        expected = _public_call(q, k_cache.clone(), v_cache.clone(), None, None, seqlens)
    with torch.inference_mode():
        inference_inputs = [t.clone() for t in (q, k_cache, v_cache)]
        out = _public_call(*inference_inputs, None, None, seqlens)
    assert out.is_inference()
    assert dispatch.last_choice("attention_kvcache").backend == "cpp"
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_torch_compile_fullgraph_runs_the_operator():
    q, k_cache, v_cache = _inputs(1, torch.float32, seed=11)
    k, v = k_cache[:, :, :1].clone(), v_cache[:, :, :1].clone()
    options = _options("all", torch.float32)
    seqlens = torch.tensor((3, 0, 17, 50), dtype=torch.int32)

    def decode_step(q, k_cache, v_cache, k, v, seqlens):
        return entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **options)

    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(q, k_cache.clone(), v_cache.clone(), k, v, seqlens)
        assert dispatch.last_choice("attention_kvcache").backend == "cpp"
        expected = decode_step(q, k_cache.clone(), v_cache.clone(), k, v, seqlens)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_opcheck(paged):
    q, k_cache, v_cache = _inputs(2, torch.float32, seed=12)
    options = _options("all", torch.float32)
    table = None
    if paged:
        (k_cache, table), (v_cache, _) = _paged(k_cache), _paged(v_cache)
    args = (q, k_cache, v_cache, torch.tensor(SEQLENS, dtype=torch.int32), table,
            torch.tensor(ALPHA_HEADS, dtype=torch.float64), 0.3, list(options["window_size"]), options["softcap"],
            options["alibi_slopes"], options["sinks"])
    torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_kvcache_fwd, args)


def test_the_operator_refuses_lengths_and_blocks_it_cannot_read():
    """The operator reads the caches through seqlens_k and the block table without bounds
    checks per key, so it checks them once itself (the public layer checks them first)."""
    q, k_cache, v_cache = _inputs(1, torch.float32, seed=13)
    alpha = torch.full((H,), 1.5)
    with pytest.raises(RuntimeError, match="is outside \\[0, the cache's capacity 96\\]"):
        _cpp(q, k_cache, v_cache, (0, 1, 2, CAPACITY + 1), alpha, {})
    (pool_k, table), (pool_v, _) = _paged(k_cache), _paged(v_cache)
    broken = table.clone()
    broken[2, 2] = pool_k.shape[0]  # sequence 2 uses blocks 0..2 (37 keys)
    with pytest.raises(RuntimeError, match="block_table\\[2, 2\\] = 27 is outside \\[0, num_blocks = 27\\)"):
        _cpp(q, pool_k, pool_v, SEQLENS, alpha, {}, broken)
    # The garbage past a sequence's blocks is never read: the same table without it gives the same rows.
    torch.testing.assert_close(_cpp(q, pool_k, pool_v, SEQLENS, alpha, {}, table),
                               _cpp(q, pool_k, pool_v, SEQLENS, alpha, {}, table[:, :CAPACITY // BLOCK_SIZE]),
                               atol=0, rtol=0)
