"""The Triton decoding kernels (triton_kernels/kvcache_decode.py, the triton backend's
attention_kvcache): compiled on CUDA when there is a GPU, in the Triton interpreter on CPU
tensors otherwise (tests/devices.py). The cases of tests/test_cpp_kvcache.py (six query heads
on two kv heads, ragged lengths 0, 1, 37 and the whole cache, garbage in unused block-table
entries): each score option once against the float64 oracle and the plain-torch reference,
with Lq 1 and > 1 (rows without keys where Lq exceeds the keys, and more rows per kv head
than the small row block), contiguous and paged caches, float and per-head α; paged equals
contiguous; one split equals one split per key tile; the public op's in-place cache writes
and its dispatch; fp16 against plain torch in fp16; the backend's refusals."""
import pytest
import torch

import entmax_fast
from entmax_fast import dispatch
from entmax_fast._validation import ScoreOptions
from entmax_fast.backends import triton as triton_backend
from entmax_fast.backends.reference import ops as reference_ops
from entmax_fast.backends.triton import kvcache as triton_kvcache
from entmax_fast.reference.kvcache import cache_view
from entmax_fast.reference.mappings import entmax_forward
from devices import DEVICE, LOW_PRECISION
from test_cpp_kvcache import ALPHA_HEADS, B, CAPACITY, E, EV, H, HKV, SEQLENS, _inputs, _options, _oracle, _paged

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

# float32 against the float64 oracle: the other Triton tests' forward bound
OUT_TOL = 1e-5
SCALE = E ** -0.5
# Splits of a 96-key row in the interpreter's 16-key tiles: uneven, the last one short.
SPLITS = 4


def _alpha(kind):
    return torch.tensor(ALPHA_HEADS, dtype=torch.float32) if kind == "heads" else kind


def _to_device(value):
    if isinstance(value, torch.Tensor):
        return value.to(DEVICE)
    if isinstance(value, dict):
        return {key: _to_device(item) for key, item in value.items()}
    return value


def _decode(q, k_cache, v_cache, seqlens, alpha, options, block_table=None, splits=SPLITS):
    """The backend's launcher on DEVICE with ``splits`` key splits; the output on the CPU."""
    q, k_cache, v_cache, block_table, alpha = (_to_device(t) for t in (q, k_cache, v_cache, block_table, alpha))
    return triton_kvcache.decode(q, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
                                 block_table, alpha, scale=SCALE, splits=splits,
                                 score_options=ScoreOptions(**_to_device(options))).cpu()


def _error(got, expected):
    """Largest error relative to the largest expected magnitude (at least 1)."""
    return ((got.double() - expected).abs().max() / expected.abs().max().clamp(min=1)).item()


@pytest.mark.parametrize("name,lq,paged,alpha", [
    pytest.param("plain", 1, False, 1.5, id="plain-Lq1-contiguous"),
    pytest.param("window", 3, True, "heads", id="window-Lq3-paged-alpha_heads"),
    pytest.param("softcap", 6, False, 1.25, id="softcap-Lq6-contiguous"),
    pytest.param("alibi_heads", 1, True, 2.0, id="alibi_heads-Lq1-paged"),
    pytest.param("alibi_batch", 3, False, "heads", id="alibi_batch-Lq3-contiguous-alpha_heads"),
    pytest.param("sinks", 3, True, 1.75, id="sinks-Lq3-paged"),
    pytest.param("all", 1, False, "heads", id="all-Lq1-contiguous-alpha_heads"),
])
def test_matches_the_oracle_and_the_reference(name, lq, paged, alpha):
    q, k_cache, v_cache = _inputs(lq, torch.float32)
    options = _options(name, torch.float32)
    alpha = _alpha(alpha)
    expected = _oracle(q, k_cache, v_cache, SEQLENS, alpha, options)
    table = None
    if paged:
        k_cache, table = _paged(k_cache)
        v_cache, _ = _paged(v_cache)
    out = _decode(q, k_cache, v_cache, SEQLENS, alpha, options, table)
    reference = reference_ops.attention_kvcache_forward(q, k_cache, v_cache, torch.tensor(SEQLENS, dtype=torch.int32),
                                                        table, alpha, scale=SCALE,
                                                        score_options=ScoreOptions(**options))
    assert out.dtype == torch.float32 and out.shape == (B, H, lq, EV)
    assert _error(out, expected) <= OUT_TOL
    assert _error(reference, expected) <= OUT_TOL


def test_paged_equals_contiguous_and_splits_change_nothing():
    q, k_cache, v_cache = _inputs(3, torch.float32, seed=3)
    options = {"window_size": (20, 0), "alibi_slopes": _options("alibi_heads", torch.float32)["alibi_slopes"]}
    alpha = _alpha("heads")
    contiguous = _decode(q, k_cache, v_cache, SEQLENS, alpha, options)
    k_pool, table = _paged(k_cache, seed=5)
    v_pool, _ = _paged(v_cache, seed=5)
    paged = _decode(q, k_pool, v_pool, SEQLENS, alpha, options, table)
    torch.testing.assert_close(paged, contiguous, atol=1e-6, rtol=1e-6)
    # one split per 16-key tile of the interpreter (CAPACITY / 16) and a single split
    for splits in (CAPACITY // 16, 1):
        torch.testing.assert_close(_decode(q, k_cache, v_cache, SEQLENS, alpha, options, splits=splits),
                                   contiguous, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_public_op_writes_the_cache_in_place_and_runs_the_kernels(paged):
    lq = 2
    q, k_cache, v_cache = _inputs(lq, torch.float32, seed=4)
    _, k_new, v_new = _inputs(lq, torch.float32, capacity=lq, seed=6)
    cache_seqlens = torch.tensor([0, 5, 40, CAPACITY - lq], dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(cache_seqlens.tolist()):
        expected_k[b, :, start:start + lq] = k_new[b]
        expected_v[b, :, start:start + lq] = v_new[b]
    table = None
    if paged:
        k_cache, table = _paged(k_cache, seed=7)
        v_cache, _ = _paged(v_cache, seed=7)
    q, k_cache, v_cache, k_new, v_new, table, seqlens_d = (_to_device(t) for t in (q, k_cache, v_cache, k_new, v_new,
                                                                                 table, cache_seqlens))
    with torch.no_grad(), entmax_fast.use_backend("triton"):
        out = entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens_d,
                                                        block_table=table, alpha=1.5)
    assert dispatch.last_choice("attention_kvcache").backend == "triton"
    lengths = (cache_seqlens + lq).tolist()
    # the append is a copy of the new tokens; the positions before them are left as they were
    for cache, want in ((k_cache, expected_k), (v_cache, expected_v)):
        view = cache_view(cache, table, seqlens_d + lq).cpu()
        for b, length in enumerate(lengths):
            torch.testing.assert_close(view[b, :, :length], want[b, :, :length], atol=0, rtol=0)
    expected = _oracle(q.cpu(), expected_k, expected_v, lengths, 1.5, {})
    assert _error(out.cpu(), expected) <= OUT_TOL


def _plain_torch(q, k_cache, v_cache, seqlens, alpha):
    """Each sequence in q's dtype: scores, weights rounded to it, weights @ values."""
    lq = q.shape[2]
    rows = []
    for b, length in enumerate(seqlens):
        k = k_cache[b:b + 1, :, :length].repeat_interleave(H // HKV, dim=1)
        v = v_cache[b:b + 1, :, :length].repeat_interleave(H // HKV, dim=1)
        scores = ((q[b:b + 1] @ k.transpose(-1, -2)) * SCALE).float()
        positions = torch.arange(lq).view(-1, 1) + length - lq
        scores = scores.masked_fill(torch.arange(length).view(1, -1) > positions, float("-inf"))
        weights = entmax_forward(scores, alpha, dim=-1).nan_to_num(0.0).to(q.dtype)
        rows.append(weights @ v)
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_error_at_most_twice_plain_torch(dtype):
    seqlens = [1, 37, 64, CAPACITY]
    q, k_cache, v_cache = (t.to(dtype) for t in _inputs(3, torch.float32, seed=8))
    out = _decode(q, k_cache, v_cache, seqlens, 1.5, {})
    expected = _oracle(q, k_cache, v_cache, seqlens, 1.5, {})
    assert out.dtype == dtype
    assert _error(out, expected) <= 2.0 * _error(_plain_torch(q, k_cache, v_cache, seqlens, 1.5), expected)


def test_supports_names_what_it_refuses():
    options = {"alpha": 1.5, "paged": True, "head_dim": 64, "window": True, "softcap": True,
               "alibi_slopes": True, "sinks": True}
    request = dispatch.Request(DEVICE, torch.float32, options)
    assert triton_backend.supports("attention_kvcache", request) is None
    reason = triton_backend.supports("attention_kvcache", dispatch.Request(DEVICE, torch.float64, options))
    assert "float32/float16/bfloat16" in reason and "float64" in reason
    reason = triton_backend.supports("attention_kvcache",
                                     dispatch.Request(DEVICE, torch.float32, {**options, "head_dim": 320}))
    assert "256" in reason and "320" in reason


def test_torch_compile_fullgraph_runs_the_kernels():
    q, k_cache, v_cache = (t.to(DEVICE) for t in _inputs(1, torch.float32, seed=11))
    k, v = k_cache[:, :, :1].clone(), v_cache[:, :, :1].clone()
    options = _to_device(_options("all", torch.float32))
    seqlens = torch.tensor((3, 0, 17, 50), dtype=torch.int32, device=DEVICE)

    def decode_step(q, k_cache, v_cache, k, v, seqlens):
        return entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **options)

    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), entmax_fast.use_backend("triton"):
        got = compiled(q, k_cache.clone(), v_cache.clone(), k, v, seqlens)
        assert dispatch.last_choice("attention_kvcache").backend == "triton"
        expected = decode_step(q, k_cache.clone(), v_cache.clone(), k, v, seqlens)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
