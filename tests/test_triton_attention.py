"""Fused Triton entmax attention (triton_kernels/attention*.py, launched by
entmax_fast/backends/triton/attention.py): compiled on CUDA when there is a GPU, in the
Triton interpreter on CPU tensors otherwise (tests/devices.py). Most tests go through the
public entry points with the Triton backend forced (its autograd is the public layer's);
a few call the backend's contract functions or custom ops directly.

Forward against the float64 dense oracle, gradients against the reference run in float64
(itself checked against the oracle in test_attention_reference.py). Errors are measured
relative to the magnitude of the expected tensor (at least 1).
"""
import math

import pytest
import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

import entmax_fast
from entmax_fast import common, dispatch
from entmax_fast.backends import triton as triton_backend
from entmax_fast.backends.triton import attention as tri
from entmax_fast.reference.attention import entmax_attention as reference_attention
from entmax_fast.reference.mappings import entmax_backward, entmax_forward
from entmax_fast.triton_kernels import attention_common
from devices import DEVICE, LOW_PRECISION, ON_GPU, on_test_device, triton_attention
from oracle import oracle_attention

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def on_device():
    """Every tensor a test makes lives on DEVICE (CUDA when there is one)."""
    with on_test_device():
        yield


def _triton_attention_varlen(*args, **kwargs):
    """entmax_fast.entmax_attention_varlen with the Triton backend forced."""
    with entmax_fast.use_backend("triton"):
        return entmax_fast.entmax_attention_varlen(*args, **kwargs)


def _err(got, expected):
    if expected.numel() == 0:
        return 0.0
    expected = expected.to(torch.float64)
    scale = expected.abs().max().clamp(min=1.0)
    return ((got.to(torch.float64) - expected).abs().max() / scale).item()


def _inputs(b, h, hkv, lq, lk, e, dtype, ev=None):
    q = (torch.randn(b, h, lq, e) * 1.5).to(dtype)
    k = torch.randn(b, hkv, lk, e).to(dtype)
    v = torch.randn(b, hkv, lk, ev or e).to(dtype)
    return q, k, v


def _alpha(spec, heads):
    if spec == "per-head":
        return torch.linspace(1.2, 1.9, heads, dtype=torch.float32)
    return spec


def _mask(spec, b, h, lq, lk):
    if spec is None:
        return None
    if spec == "key-padding":
        # (B, 1, 1, Lk): the second batch element ignores its last 20 keys
        keep = torch.ones(b, 1, 1, lk, dtype=torch.bool)
        keep[-1, ..., lk - 20:] = False
        return keep
    if spec == "bool-empty-rows":
        keep = torch.rand(1, h, lq, lk) > 0.3
        keep[:, :, 3] = False  # fully masked rows
        return keep
    if spec == "additive":
        return torch.randn(1, 1, lq, lk) - 1000.0 * (torch.rand(1, 1, lq, lk) > 0.7)
    raise ValueError(spec)


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


# (B, H, H_kv, Lq, Lk, E, alpha, is_causal, mask): each line adds features to the lengths
# 1 / 63 / 130 / 257 and head dims 16 / 64 / 80 / 128 without multiplying the matrix.
CASES = [
    pytest.param(1, 2, 2, 63, 130, 64, 1.5, False, None, id="Lq63-Lk130-E64-a1.5"),
    pytest.param(1, 4, 2, 130, 63, 80, 2.0, True, None, id="Lq130-Lk63-E80-a2-causal-gqa"),
    pytest.param(2, 2, 1, 1, 1, 16, 1.25, False, None, id="L1-E16-a1.25-mqa"),
    pytest.param(1, 2, 2, 257, 257, 16, "per-head", True, None, id="L257-E16-perhead-causal"),
    pytest.param(2, 2, 2, 63, 63, 128, 1.5, False, "key-padding", id="L63-E128-keypad"),
    pytest.param(1, 2, 2, 70, 130, 16, 1.75, True, "bool-empty-rows",
                 id="Lq70-Lk130-E16-a1.75-bool-emptyrows-causal"),
    pytest.param(1, 2, 2, 63, 63, 64, "per-head", False, "additive", id="L63-E64-additive"),
    pytest.param(1, 1, 1, 20, 33, 256, 1.5, True, None, id="Lq20-Lk33-E256-causal"),
]


@pytest.mark.parametrize("b,h,hkv,lq,lk,e,alpha_spec,is_causal,mask_spec", CASES)
@pytest.mark.parametrize("dtype,fwd_tol,grad_tol", [(torch.float32, 1e-5, 1e-4)])
def test_fp32_forward_and_backward(b, h, hkv, lq, lk, e, alpha_spec, is_causal, mask_spec,
                                   dtype, fwd_tol, grad_tol):
    q, k, v = _inputs(b, h, hkv, lq, lk, e, dtype)
    alpha = _alpha(alpha_spec, h)
    mask = _mask(mask_spec, b, h, lq, lk)
    grad_out = torch.randn(b, h, lq, e)
    learn_alpha = isinstance(alpha, torch.Tensor)
    inputs = [q, k, v] + ([alpha] if learn_alpha else [])

    def kernel(q_, k_, v_, *a):
        return triton_attention(q_, k_, v_, attn_mask=mask, is_causal=is_causal,
                                enable_gqa=True, alpha=a[0] if a else alpha)

    def reference(q_, k_, v_, *a):
        return reference_attention(q_, k_, v_, attn_mask=mask, is_causal=is_causal,
                                   enable_gqa=True, alpha=a[0] if a else alpha)

    out, grads = _grads(kernel, inputs, grad_out)
    expected = oracle_attention(q, k, v, attn_mask=mask, is_causal=is_causal, alpha=alpha)
    assert out.dtype == dtype and out.shape == (b, h, lq, e)
    assert _err(out, expected) <= fwd_tol
    _, ref_grads = _grads(reference, [t.to(torch.float64) for t in inputs], grad_out)
    for name, got, want in zip(("dq", "dk", "dv", "dalpha"), grads, ref_grads):
        assert got.shape == want.shape, name
        assert _err(got, want) <= grad_tol, name
    if mask_spec == "bool-empty-rows":
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
        assert torch.equal(grads[0][:, :, 3], torch.zeros_like(grads[0][:, :, 3]))


SPLIT = (attention_common.PHASE_THRESHOLD, attention_common.PHASE_OUTPUT)


@pytest.mark.parametrize("b,h,hkv,lq,lk,e,alpha_spec,is_causal,mask_spec",
                         [CASES[3], CASES[5], CASES[6], CASES[1]])
def test_split_forward_matches_the_oracle_and_the_fused_one(monkeypatch, b, h, hkv, lq, lk, e,
                                                            alpha_spec, is_causal, mask_spec):
    """The forward as two launches (`forward_phases`: threshold, then output): against the
    float64 oracle, and against the one-launch forward on the same inputs: the same output,
    statistics and tile flags. Those are all the backward reads, so its gradients are the
    one-launch forward's, which test_fp32_forward_and_backward checks against float64 on
    the same cases."""
    q, k, v = _inputs(b, h, hkv, lq, lk, e, torch.float32)
    alpha = _alpha(alpha_spec, h)
    mask = _mask(mask_spec, b, h, lq, lk)

    def forward(phases, q_):
        monkeypatch.setattr(attention_common, "forward_phases", lambda *_: phases)
        out, (stats, dvec, flags, _) = tri.attention_forward(
            q_, k, v, mask, alpha, scale=e ** -0.5, is_causal=is_causal, dropout_p=0.0,
            enable_gqa=True, need_grad=common.GRAD_ALPHA)
        return out, stats, dvec, flags

    q_nan = q.clone()
    q_nan[0, 0, 2, 0] = float("nan")  # a NaN row's rule crosses from one launch to the other
    fused = forward((attention_common.PHASE_FUSED,), q_nan)
    split = forward(SPLIT, q_nan)
    for name, got, want in zip(("out", "stats", "dvec"), split[:3], fused[:3]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, equal_nan=True, msg=name)
    assert torch.isnan(split[0][0, 0, 2]).all()
    assert torch.equal(split[3], fused[3])
    # A NaN query reaches its own row only: every other row is the oracle's on q.
    expected = oracle_attention(q, k, v, attn_mask=mask, is_causal=is_causal, alpha=alpha)
    others = torch.ones(lq, dtype=torch.bool)
    others[2] = False
    assert not torch.isnan(split[0][0, 0, others]).any()
    got = split[0].clone()
    got[0, 0, 2] = expected[0, 0, 2].to(got.dtype)
    assert _err(got, expected) <= 1e-5


class _PlainTorchEntmax(torch.autograd.Function):
    """Reference mapping with its exact backward, used inside the plain-torch low-precision run."""

    @staticmethod
    def forward(ctx, scores, alpha):
        p = entmax_forward(scores, alpha)
        ctx.save_for_backward(p)
        ctx.alpha = alpha
        return p

    @staticmethod
    def backward(ctx, grad):
        (p,) = ctx.saved_tensors
        return entmax_backward(p, grad, ctx.alpha, need_alpha_grad=False)[0], None


def _plain_torch_attention(q, k, v, is_causal, alpha, attn_mask=None):
    """What a user gets composing torch ops in q's dtype: low-precision matmuls, the entmax
    mapping in fp32 (the reference upcasts), weights rounded back to q's dtype."""
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if attn_mask is not None:
        scores = scores + attn_mask
    if is_causal:
        lq, lk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), -math.inf)
    p = _PlainTorchEntmax.apply(scores.float(), alpha).to(q.dtype)
    return p @ v


@pytest.mark.parametrize("lq,lk,e,alpha,is_causal", [
    pytest.param(130, 63, 64, 1.5, True, id="Lq130-Lk63-E64-a1.5-causal"),
    pytest.param(63, 257, 80, 1.25, False, id="Lq63-Lk257-E80-a1.25"),
])
@pytest.mark.parametrize("dtype,ratio", [(dtype, 2.0) for dtype in LOW_PRECISION])
def test_low_precision_error_at_most_twice_plain_torch(lq, lk, e, alpha, is_causal, dtype, ratio):
    q, k, v = _inputs(1, 2, 2, lq, lk, e, dtype)
    grad_out = torch.randn(1, 2, lq, e).to(dtype)
    out, grads = _grads(lambda *t: triton_attention(*t, is_causal=is_causal,
                                                    alpha=alpha), [q, k, v], grad_out)
    base_out, base_grads = _grads(lambda *t: _plain_torch_attention(*t, is_causal, alpha),
                                  [q, k, v], grad_out)
    ref_out, ref_grads = _grads(lambda *t: reference_attention(*t, is_causal=is_causal,
                                                               alpha=alpha),
                                [t.to(torch.float64) for t in (q, k, v)], grad_out)
    expected = oracle_attention(q, k, v, is_causal=is_causal, alpha=alpha)
    assert out.dtype == dtype
    assert _err(out, expected) <= ratio * _err(base_out, expected)
    for name, got, base, want in zip(("dq", "dk", "dv"), grads, base_grads, ref_grads):
        assert _err(got, want) <= ratio * _err(base, want), name


@pytest.mark.parametrize("dtype,ratio", [(torch.float16, 2.0), (torch.float32, 2.0)])
def test_huge_and_offset_scores_stay_finite(dtype, ratio):
    q, k, v = _inputs(1, 1, 1, 63, 63, 16, dtype)
    q = (q * 40).to(dtype)  # scores in the hundreds: rounding of the scores dominates
    mask = (torch.full((63, 63), -1000.0).triu(1) + 500.0).to(dtype)
    out, grads = _grads(lambda *t: triton_attention(*t, attn_mask=mask, alpha=1.5),
                        [q, k, v], torch.randn(1, 1, 63, 16))
    expected = oracle_attention(q, k, v, attn_mask=mask, alpha=1.5)
    baseline = _plain_torch_attention(q, k, v, False, 1.5, attn_mask=mask)
    assert all(torch.isfinite(t).all() for t in [out] + grads)
    assert _err(out, expected) <= ratio * _err(baseline, expected)


def test_fully_masked_rows_and_batches_give_zeros():
    q, k, v = _inputs(2, 2, 2, 63, 63, 16, torch.float32)
    keep = torch.ones(2, 1, 1, 63, dtype=torch.bool)
    keep[1] = False  # every key of the second batch element is padding
    out, (dq, dk, dv) = _grads(lambda *t: triton_attention(*t, attn_mask=keep),
                               [q, k, v], torch.randn(2, 2, 63, 16))
    for t in (out[1], dq[1], dk[1], dv[1]):
        assert torch.equal(t, torch.zeros_like(t))
    assert _err(out[0], oracle_attention(q[:1], k[:1], v[:1])[0]) <= 1e-5


@triton.jit
def _dropout_factors_kernel(out_ptr, seed_ptr, n_heads, seqlen_q, seqlen_k, dropout_p,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_bh = tl.program_id(0)
    seed = tl.load(seed_ptr)
    for start_m in range(0, seqlen_q, BLOCK_M):
        o_m = start_m + tl.arange(0, BLOCK_M)
        for start_n in range(0, seqlen_k, BLOCK_N):
            o_n = start_n + tl.arange(0, BLOCK_N)
            b_drop = attention_common.dropout_scale(seed, pid_bh, o_m, o_n, seqlen_q, seqlen_k,
                                                    dropout_p, BLOCK_M, BLOCK_N, True)
            p_out = out_ptr + (pid_bh * seqlen_q + o_m[:, None]) * seqlen_k + o_n[None, :]
            tl.store(p_out, b_drop, mask=(o_m[:, None] < seqlen_q) & (o_n[None, :] < seqlen_k))


@triton.jit
def _listed_tiles_kernel(flags_ptr, stride_flag, first, end, list_ptr, count_ptr):
    count = attention_common.listed_tiles(flags_ptr, stride_flag, first, end, list_ptr)
    tl.store(count_ptr, count)


@pytest.mark.parametrize("n, stride, first, end", [(300, 1, 0, 300), (300, 3, 7, 95),
                                                   (5, 1, 2, 2), (129, 1, 0, 129)])
def test_listed_tiles_lists_the_flagged_indices_in_order(n, stride, first, end):
    """The compaction the kernels' tile loops run over, across several chunks of flags."""
    flags = (torch.rand(n * stride) < 0.4).to(torch.int8)
    tiles = torch.full((n,), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    _listed_tiles_kernel[(1,)](flags, stride, first, end, tiles, count)
    i = torch.arange(first, end)
    expected = i[flags[i * stride] != 0]
    assert int(count) == len(expected)
    assert torch.equal(tiles[:len(expected)].long().cpu(), expected.cpu())


def test_dropout_mask_is_regenerated_in_backward():
    b, h, lq, lk, e, dropout_p = 1, 2, 63, 70, 16, 0.3
    alpha = _alpha("per-head", h)
    q, k, v = _inputs(b, h, h, lq, lk, e, torch.float32)
    grad_out = torch.randn(b, h, lq, e)
    torch.manual_seed(7)
    out, grads = _grads(lambda q_, k_, v_, a_: triton_attention(
        q_, k_, v_, dropout_p=dropout_p, alpha=a_), [q, k, v, alpha], grad_out)
    torch.manual_seed(7)
    seed = tri._seed(dropout_p, q.device)
    factors = torch.zeros(b * h, lq, lk)
    _dropout_factors_kernel[(b * h,)](factors, seed, h, lq, lk, dropout_p, BLOCK_M=32, BLOCK_N=32)
    factors = factors.view(b, h, lq, lk).double()
    assert 0.6 < (factors > 0).double().mean() < 0.8
    # dense float64 composition with the kernel's own mask and the reference mapping
    q64, k64, v64, g64 = (t.double() for t in (q, k, v, grad_out))
    scale = 1 / math.sqrt(e)
    alpha64 = alpha.double().view(1, h, 1, 1)
    p = entmax_forward(q64 @ k64.transpose(-1, -2) * scale, alpha64)
    expected_out = (p * factors) @ v64
    dz, dalpha = entmax_backward(p, (g64 @ v64.transpose(-1, -2)) * factors, alpha64)
    expected = [scale * dz @ k64, scale * dz.transpose(-1, -2) @ q64,
                (p * factors).transpose(-1, -2) @ g64, dalpha.sum((0, 2, 3))]
    assert _err(out, expected_out) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv", "dalpha"), grads, expected):
        assert _err(got, want) <= 1e-4, name


def test_varlen_matches_each_sequence_alone():
    lens_q, lens_k = [5, 63, 70], [7, 63, 40]
    h, hkv, e, alpha = 2, 1, 16, "per-head"
    alpha = _alpha(alpha, h)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, e) * 1.5
    k = torch.randn(sum(lens_k), hkv, e)
    v = torch.randn(sum(lens_k), hkv, e)
    grad_out = torch.randn(sum(lens_q), h, e)
    out, grads = _grads(
        lambda q_, k_, v_, a_: _triton_attention_varlen(
            q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True, alpha=a_),
        [q, k, v, alpha], grad_out)
    expected_grads = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    expected_dalpha = torch.zeros(h, dtype=torch.float64)
    for i in range(len(lens_q)):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        # (L, H, E) -> (1, H, L, E)
        seq = [t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, sq), (k, sk), (v, sk))]
        expected = oracle_attention(*seq, is_causal=True, alpha=alpha)[0].transpose(0, 1)
        assert _err(out[sq], expected) <= 1e-5
        _, ref = _grads(lambda q_, k_, v_, a_: reference_attention(
            q_, k_, v_, is_causal=True, enable_gqa=True, alpha=a_),
            [t.double() for t in seq] + [alpha.double()],
            grad_out[sq].transpose(0, 1).unsqueeze(0))
        for acc, g, s in zip(expected_grads, ref[:3], (sq, sk, sk)):
            acc[s] = g[0].transpose(0, 1)
        expected_dalpha += ref[3]
    for name, got, want in zip(("dq", "dk", "dv", "dalpha"), grads,
                               expected_grads + [expected_dalpha]):
        assert _err(got, want) <= 1e-4, name


class _LargestAllocation(TorchDispatchMode):
    """Largest number of elements of any tensor an op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_lq_by_lk_allocation():
    lq = lk = 257
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, 1, lq, lk, 16, torch.float32))
    with _LargestAllocation() as mode:
        out = triton_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
    assert 0 < mode.largest <= lq * 16 < lq * lk // 8


def test_custom_op_opcheck_and_compile():
    """The two custom ops pass opcheck (schema, fake kernels, tracing). They carry no
    autograd (the public layer's torch.autograd.Function differentiates them), so they are
    checked on inputs without requires_grad; the public entry point compiles end to end."""
    q, k, v = _inputs(1, 2, 1, 20, 33, 16, torch.float32)
    alpha = torch.tensor([1.3, 1.6])
    seed = torch.zeros(1, dtype=torch.int64)
    shared = (None, None, 0, 0, 0.0, True, 0.25, common.ALPHA_GENERAL)
    forward_args = (q, k, v, None, alpha, seed) + shared + (common.GRAD_ALPHA,)
    torch.library.opcheck(torch.ops.entmax_fast.triton_attention_fwd.default, forward_args)
    out, stats, dvec, flags = torch.ops.entmax_fast.triton_attention_fwd(*forward_args)
    backward_args = (torch.randn_like(out), q, k, v, out, dvec, stats, flags, None, alpha,
                     seed) + shared + (True,)
    torch.library.opcheck(torch.ops.entmax_fast.triton_attention_bwd.default, backward_args)

    class Block(torch.nn.Module):
        def forward(self, q_, k_, v_):
            return entmax_fast.entmax_attention(q_, k_, v_, is_causal=True, enable_gqa=True,
                                                alpha=1.5)

    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with entmax_fast.use_backend("triton"):
        eager = Block()(q, k, v)
        compiled = torch.compile(Block(), fullgraph=True, backend="aot_eager")(q, k, v)
    # The same kernels run both ways: equal up to rounding, on any CPU.
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype,fwd_tol,grad_tol", [(torch.float32, 1e-5, 1e-4)])
def test_gpu_tiling_table(monkeypatch, dtype, fwd_tol, grad_tol):
    """The interpreter normally runs one large tiling; force the GPU table's small tiles
    (with a custom scale)."""
    monkeypatch.setattr(tri, "interpreting", lambda: False)
    q, k, v = _inputs(1, 2, 1, 40, 33, 16, dtype)
    keep = torch.rand(1, 1, 40, 33) > 0.2
    grad_out = torch.randn(1, 2, 40, 16)
    scale = 0.4

    def run(fn, *t):
        return fn(*t, attn_mask=keep, is_causal=True, scale=scale, enable_gqa=True, alpha=1.5)

    out, grads = _grads(lambda *t: run(triton_attention, *t), [q, k, v], grad_out)
    _, ref_grads = _grads(lambda *t: run(reference_attention, *t),
                          [t.double() for t in (q, k, v)], grad_out)
    expected = oracle_attention(q, k, v, attn_mask=keep, is_causal=True, scale=scale)
    assert _err(out, expected) <= fwd_tol
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= grad_tol, name


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("dtype,fwd_tol,grad_tol", [(torch.float32, 1e-5, 1e-4)])
def test_head_dim_chunks(monkeypatch, chunk, dtype, fwd_tol, grad_tol):
    """Every kernel with its q.k and dO.v products taken in head-dim chunks (as the GPU
    table does for wide fp32 heads), with a value head dim other than the query's, a ragged
    last chunk (E = 80), GQA, a mask and a learned per-head alpha."""
    monkeypatch.setattr(attention_common, "_CHUNKS", {(kernel, "fp32"): {128: chunk}
                                                      for kernel in ("fwd", "dq", "dkdv")})
    b, h, hkv, lq, lk, e, ev = 1, 4, 2, 37, 50, 80, 72
    q, k, v = _inputs(b, h, hkv, lq, lk, e, dtype, ev=ev)
    alpha = _alpha("per-head", h)
    mask = _mask("key-padding", b, h, lq, lk)
    grad_out = torch.randn(b, h, lq, ev)

    def run(fn, q_, k_, v_, a_):
        return fn(q_, k_, v_, attn_mask=mask, enable_gqa=True, alpha=a_)

    out, grads = _grads(lambda *t: run(triton_attention, *t), [q, k, v, alpha],
                        grad_out)
    _, ref_grads = _grads(lambda *t: run(reference_attention, *t),
                          [t.double() for t in (q, k, v, alpha)], grad_out)
    assert tri._Geometry(q, k, v, None, None, 0, 0, False).block_ec == {
        "fwd": chunk, "dq": chunk, "dkdv": chunk}
    assert _err(out, oracle_attention(q, k, v, attn_mask=mask, alpha=alpha)) <= fwd_tol
    for name, got, want in zip(("dq", "dk", "dv", "dalpha"), grads, ref_grads):
        assert _err(got, want) <= grad_tol, name


def test_strided_inputs_and_gradients():
    """(B, L, H, E) storage viewed as (B, H, L, E), and a broadcast upstream gradient."""
    q, k, v = (torch.randn(1, n, 2, 16).transpose(1, 2) for n in (63, 40, 40))
    assert not q.is_contiguous()
    grad_out = torch.randn(1, 1, 1, 16).expand(1, 2, 63, 16)
    out, grads = _grads(lambda *t: triton_attention(*t, alpha=2.0), [q, k, v],
                        grad_out)
    _, ref_grads = _grads(lambda *t: reference_attention(*t, alpha=2.0),
                          [t.double() for t in (q, k, v)], grad_out)
    assert _err(out, oracle_attention(q, k, v, alpha=2.0)) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name


def test_slices_of_a_fused_projection():
    """q, k, v split from one (B, L, 3·H·E) projection, as a self-attention layer makes
    them: views whose strides no fresh tensor can share, so the gradients are written with
    their own strides (writing them with q's ran past dq's end on a GPU)."""
    b, length, h, e = 2, 37, 2, 16

    def split(qkv):
        return [t.view(b, length, h, e).transpose(1, 2) for t in qkv.split(h * e, dim=-1)]

    qkv = torch.randn(b, length, 3 * h * e)
    q = split(qkv)[0]
    assert torch.empty_like(q).stride() != q.stride()
    grad_out = torch.randn(b, h, length, e)
    out, (grad,) = _grads(lambda t: triton_attention(*split(t), is_causal=True, alpha=1.5),
                          [qkv], grad_out)
    _, (ref_grad,) = _grads(lambda t: reference_attention(*split(t), is_causal=True, alpha=1.5),
                            [qkv.double()], grad_out)
    assert _err(out, oracle_attention(*split(qkv), is_causal=True, alpha=1.5)) <= 1e-5
    assert _err(grad, ref_grad) <= 1e-4


def test_varlen_slices_of_a_fused_projection():
    """The packed layout too: q, k, v = qkv.unbind(1) of a (tokens, 3, H, E) tensor."""
    lens, h, e = [9, 30], 2, 16
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    qkv = torch.randn(sum(lens), 3, h, e)
    grad_out = torch.randn(sum(lens), h, e)

    def attend(q, k, v):
        return _triton_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), alpha=2.0)

    _, (grad,) = _grads(lambda t: attend(*t.unbind(1)), [qkv], grad_out)
    _, (dense_grad,) = _grads(lambda t: attend(*(x.contiguous() for x in t.unbind(1))), [qkv],
                              grad_out)
    assert _err(grad, dense_grad) <= 1e-6


def test_mask_requiring_grad_is_rejected():
    """The kernels do not differentiate attn_mask: the backend refuses such calls, and a
    forced Triton backend then raises instead of dropping the mask's gradient."""
    request = dispatch.Request(torch.device(DEVICE), torch.float32,
                               {"alpha": 1.5, "mask_requires_grad": True})
    assert "attn_mask" in triton_backend.supports("attention", request)
    q, k, v = _inputs(1, 1, 1, 5, 5, 16, torch.float32)
    with pytest.raises(dispatch.BackendUnavailableError, match="attn_mask"):
        triton_attention(q, k, v, attn_mask=torch.zeros(5, 5, requires_grad=True))


def test_gpus_before_ampere_are_refused_with_the_reason(monkeypatch):
    """Compute capability below 8.0: the backend declines the fused attention (dispatch
    then falls back, and says why), rather than failing in ptxas."""
    request = dispatch.Request(torch.device("cuda:0"), torch.float16, {"alpha": 1.5})
    monkeypatch.setattr(triton_backend, "_capability", lambda device: (7, 5))
    assert "compute capability 8.0 or newer, got 7.5" in triton_backend.supports("attention",
                                                                               request)
    monkeypatch.setattr(triton_backend, "_capability", lambda device: (9, 0))
    assert triton_backend.supports("attention", request) is None
    assert triton_backend.supports("entmax", request) is None


def test_gqa_without_enable_gqa_is_rejected():
    q, k, v = _inputs(1, 4, 2, 5, 5, 16, torch.float32)
    with pytest.raises(ValueError, match="enable_gqa"):
        triton_attention(q, k, v)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
def test_nan_and_inf_scores_follow_softmax_rule(alpha):
    """torch.softmax's rule: a NaN or +inf score makes its row NaN; -inf entries get no
    weight; other rows are untouched (docs/attention.md, "Bad input")."""
    q, k, v = _inputs(1, 1, 1, 40, 70, 16, torch.float32)
    q[0, 0, 5, 3] = float("nan")               # row 5: every score NaN
    k[0, 0, 60, 0] = float("nan")              # key 60: NaN for every row that sees it
    mask = torch.zeros(1, 1, 40, 70)
    mask[..., 7, 3] = float("inf")             # row 7: one +inf score
    mask[..., 9, :30] = float("-inf")          # row 9: 30 keys masked out
    out = triton_attention(q, k, v, attn_mask=mask, is_causal=True, alpha=alpha)
    nan_rows = torch.isnan(out[0, 0]).all(-1)
    # causal: key 60 is seen by no query (Lq = 40 < 60)
    assert nan_rows.tolist() == [i in (5, 7) for i in range(40)]
    assert torch.isfinite(out[0, 0][~nan_rows]).all()
    keep = torch.ones(40, dtype=torch.bool)
    keep[[5, 7]] = False
    clean_mask = mask.clone()
    clean_mask[..., 7, 3] = 0.0
    expected = oracle_attention(q.nan_to_num(), k.nan_to_num(), v, attn_mask=clean_mask,
                                is_causal=True, alpha=alpha)
    assert _err(out[0, 0][keep], expected[0, 0][keep]) <= 1e-5
    full = triton_attention(q, k, v, alpha=alpha)  # not causal: every row sees key 60
    assert torch.isnan(full).all()


@pytest.mark.parametrize("alpha,is_causal", [(2.0, True), (1.5, True), (2.0, False),
                                             ("per-head", False)])
def test_far_keys_within_the_bracket_keep_their_weight(alpha, is_causal):
    """The max pass leaves unflagged the key tiles with no score within 1/(alpha - 1) of the
    row's running maximum. Each row's maximum sits in the last key tile and a second key in
    the support sits in the first tile, 0.6 / (alpha - 1) below it: whatever order the tiles
    are visited in, the first tile must keep its weight. Scores from an additive mask (q = 0)."""
    lq = lk = 200
    q, k, v = _inputs(1, 2, 2, lq, lk, 16, torch.float32)
    q = torch.zeros_like(q)
    alpha_h = _alpha(alpha, 2)
    width = 1.0 / (torch.as_tensor(alpha_h, dtype=torch.float32).expand(2) - 1.0)
    mask = torch.full((1, 2, lq, lk), -50.0)
    rows = torch.arange(lq)
    last = rows if is_causal else torch.full_like(rows, lk - 1)
    mask[:, :, rows, last] = 0.0
    mask[:, :, rows, 0] = (-0.6 * width).view(-1, 1)
    out = triton_attention(q, k, v, attn_mask=mask, is_causal=is_causal, alpha=alpha_h)
    expected = oracle_attention(q, k, v, attn_mask=mask, is_causal=is_causal, alpha=alpha_h)
    assert _err(out, expected) <= 1e-5


@pytest.mark.parametrize("alpha,offset", [(1.5, 1e4), (2.0, 1e4), (1.5, 1e30), (2.0, 1e30),
                                          ("per-head", 1e30)])
def test_large_score_offsets(alpha, offset):
    """Scores shifted by a large constant give the unshifted result: the kernels subtract
    the row maximum before anything else. The scores (an additive mask, q = 0) lie on a grid
    that float32 represents exactly at the offset and are distinct within a row; at 1e30 the
    grid spacing is 2^76 and the weights are one-hot on the maximum."""
    q, k, v = _inputs(1, 2, 2, 33, 50, 16, torch.float32)
    alpha = _alpha(alpha, 2)
    offset = torch.tensor(offset, dtype=torch.float32)
    step = max(2.0 ** -8, float(torch.finfo(torch.float32).eps * 2.0 ** torch.floor(
        torch.log2(offset))))
    ranks = torch.stack([torch.randperm(64)[:50] for _ in range(33)]).float()
    scores = step * ranks
    out = triton_attention(q * 0, k, v, attn_mask=offset + scores, alpha=alpha)
    expected = oracle_attention(q * 0, k, v, attn_mask=scores, alpha=alpha)
    assert torch.isfinite(out).all()
    assert _err(out, expected) <= 1e-5


@pytest.mark.parametrize("alpha", [1.5, 1.25])
def test_local_scores_skip_tiles_exactly(alpha):
    """Scores peaked near the diagonal: the threshold passes after the first and the output
    pass skip most key tiles, and forward and gradients stay exact (general alpha: its
    flags come from the tiles' row maxima, its sums from a trial point)."""
    lq = lk = 257
    q, k, v = _inputs(1, 1, 1, lq, lk, 16, torch.float32)
    position = torch.arange(lq, dtype=torch.float32)
    bias = -(position[:, None] - position[None, :]).abs() / 2.0   # [Lq, Lk]
    grad_out = torch.randn(1, 1, lq, 16)
    out, grads = _grads(lambda *t: triton_attention(*t, attn_mask=bias, alpha=alpha),
                        [q, k, v], grad_out)
    _, (_, _, flags, _) = tri.attention_forward(
        q, k, v, bias, alpha, scale=0.25, is_causal=False, dropout_p=0.0, enable_gqa=False,
        need_grad=common.GRAD_NONE)
    assert 0 < flags.float().mean() < 0.5
    expected = oracle_attention(q, k, v, attn_mask=bias, alpha=alpha)
    _, ref_grads = _grads(lambda *t: reference_attention(*t, attn_mask=bias.double(), alpha=alpha),
                          [t.double() for t in (q, k, v)], grad_out)
    assert _err(out, expected) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name


def test_captured_scores_are_each_rows_largest_and_hold_its_support(monkeypatch):
    """General alpha (1.3, one value per head): the first threshold pass of a head whose
    rows are likely to fit their slots captures every score above the lower bound of tau;
    every row's fit here, so the later passes ran over them alone. A head of nearly equal
    scores, every column's maximum above its lower bound, captures nothing
    (attention_fwd._capture_fits). Both stay exact. (The sharp head's rows have at most 17
    of 32 columns above their bound, 19 of 64 with a GPU's tiles; the flat head's all.)"""
    lq, heads = 150, 2
    alpha = torch.tensor([1.3, 1.3])
    q, k, v = _inputs(1, heads, heads, lq, lq, 16, torch.float32)
    q[:, 0] *= 0.01
    q[:, 1] *= 2.0
    slots = attention_common.candidate_slots(common.ALPHA_GENERAL)
    assert slots > 0
    scratch = {}

    def recorded(geo, n_slots, device):
        scratch["rows"] = torch.full((geo.batch * geo.n_heads * geo.n_qblocks * geo.block_m,
                                      n_slots), float("nan"), device=device)
        return scratch["rows"]

    monkeypatch.setattr(tri._Geometry, "candidate_scratch", recorded)
    out, (stats, _, _, _) = tri.attention_forward(
        q, k, v, None, alpha, scale=0.25, is_causal=True, dropout_p=0.0, enable_gqa=False,
        need_grad=common.GRAD_NONE)
    for head in range(heads):
        want = oracle_attention(q[:, head:head + 1], k[:, head:head + 1], v[:, head:head + 1],
                                is_causal=True, scale=0.25, alpha=float(alpha[head]))
        assert _err(out[:, head:head + 1], want) <= 1e-5, head
    captured = scratch["rows"].reshape(heads, -1, slots)[:, :lq]        # [H, Lq, slots]
    count = (~captured.isnan()).sum(-1)
    assert int(count[0].max()) == 0
    z = (q[0, 1].double() @ k[0, 1].double().T) * 0.25
    z = z.masked_fill(torch.ones(lq, lq, dtype=torch.bool).triu(1), float("-inf"))
    u = z - z.amax(-1, keepdim=True)                                    # [Lq, Lk]
    tau = stats[attention_common.STAT_TAU, 0, 1].double()               # [Lq], z units
    assert int(count[1].max()) <= slots
    support = (u > tau[:, None] + 1e-6).sum(-1)
    assert bool((count[1] >= support).all())
    largest = u.sort(-1, descending=True).values[:, :slots]
    got = captured[1].double().nan_to_num(float("-inf")).sort(-1, descending=True).values
    kept = torch.arange(slots) < count[1, :, None]
    assert float((got - largest).abs()[kept].max()) <= 1e-5


@pytest.mark.parametrize("slots, alpha, length", [
    (2, 1.6, 90),
    (40, 1.5, 300), (56, 1.5, 300), (40, 2.0, 300), (56, 2.0, 300),
    (40, torch.tensor([1.6, 1.5]), 300), (56, torch.tensor([1.6, 1.5]), 300)])
def test_few_capture_slots_stay_exact(monkeypatch, slots, alpha, length):
    """The first threshold pass raises each row's lower bound from the scores it captured
    and keeps only those above it (attention_fwd._compact). With few slots (not a multiple
    of the compaction's chunk) its blocks compact often and capture segments again after
    overflowing them; with two, every block overflows them and takes the passes over the
    tiles. The forward stays exact; so do the gradients, checked at 2 and 40 slots for each
    alpha kind (the backward reads the forward's statistics and tile flags, not its slots:
    at 56 the exact output is what there is to check)."""
    monkeypatch.setattr(attention_common, "candidate_slots", lambda alpha_kind: slots)
    q, k, v = _inputs(1, 2, 2, length, length, 16, torch.float32)
    expected = oracle_attention(q, k, v, is_causal=True, alpha=alpha)
    if slots == 56:
        assert _err(triton_attention(q, k, v, is_causal=True, alpha=alpha), expected) <= 1e-5
        return
    grad_out = torch.randn(1, 2, length, 16)
    out, grads = _grads(lambda *t: triton_attention(*t, is_causal=True, alpha=alpha),
                        [q, k, v], grad_out)
    _, ref_grads = _grads(lambda *t: reference_attention(*t, is_causal=True, alpha=alpha),
                          [t.double() for t in (q, k, v)], grad_out)
    assert _err(out, expected) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.7])
def test_evenly_spread_scores(alpha):
    """Scores spread evenly over the range the support can reach (many near the threshold):
    the threshold passes run until every row of the block is done, and stay exact."""
    lq, lk = 20, 257
    scores = torch.linspace(0.0, 3.0, lk).repeat(lq, 1) + torch.rand(lq, lk) * 1e-3
    q, k, v = _inputs(1, 1, 1, lq, lk, 16, torch.float32)
    out = triton_attention(q * 0, k, v, attn_mask=scores, alpha=alpha)
    assert _err(out, oracle_attention(q * 0, k, v, attn_mask=scores, alpha=alpha)) <= 1e-5


@pytest.mark.parametrize("alpha", [1.0001, 1.001, 1.01])
def test_alpha_near_one(alpha):
    """alpha close to 1 (nearly softmax): the threshold sits near -1 in u units, where
    float32 has few digits left; the kernels keep c = tau + 1 and log1p of the base."""
    q, k, v = _inputs(1, 2, 2, 40, 63, 16, torch.float32)
    grad_out = torch.randn(1, 2, 40, 16)
    out, grads = _grads(lambda *t: triton_attention(*t, is_causal=True, alpha=alpha),
                        [q, k, v], grad_out)
    _, ref_grads = _grads(lambda *t: reference_attention(*t, is_causal=True, alpha=alpha),
                          [t.double() for t in (q, k, v)], grad_out)
    assert _err(out, oracle_attention(q, k, v, is_causal=True, alpha=alpha)) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name


def _check_causal_gqa(alpha):
    """Forward and backward of a causal GQA call (B 2, H 4, Hkv 2, Lq 70, Lk 90, E 16: as
    many heads as blocks on neither grid) against float64; returns its launch geometry."""
    q, k, v = _inputs(2, 4, 2, 70, 90, 16, torch.float32)
    grad_out = torch.randn(2, 4, 70, 16)
    out, grads = _grads(lambda *t: triton_attention(*t, is_causal=True, enable_gqa=True,
                                                    alpha=alpha), [q, k, v], grad_out)
    ref_out, ref_grads = _grads(lambda *t: reference_attention(*t, is_causal=True,
                                                               enable_gqa=True, alpha=alpha),
                                [t.double() for t in (q, k, v)], grad_out)
    assert _err(out, ref_out) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name
    return tri._Geometry(q, k, v, None, None, 0, 0, False)


def test_the_grid_compiles_every_cell_it_times_before_timing():
    """bench/bench_attention_gpu.py --jobs compiles each entmax_fast method once per kernel
    class of the grid, in a process of its own at B 1: the class of every timed cell must
    be among them, at a length whose integer arguments Triton specialises as the cell's
    (1, or divisible by 16: the lengths, the tile counts and the strides they enter; the
    batch enters none), or the timed process compiles again. The compile run itself is
    run here on CPU tensors (the cpp backend) for each method."""
    from test_tools import load_script

    grid_bench = load_script("bench/bench_attention_gpu.py")

    def keys(length, head_dim):
        block_m, block_n = attention_common.block_sizes(head_dim, "bf16")
        values = [length, length // block_m, length // block_n, length * head_dim,
                  grid_bench.HEADS * length, grid_bench.HEADS * length * head_dim]
        return [(n == 1, n % 16 == 0) for n in values]

    for grid in (grid_bench.GRID + grid_bench.WINDOW_GRID, grid_bench.QUICK_GRID + grid_bench.WINDOW_GRID):
        runs = [grid_bench.parse_args(command[2:]) for command in grid_bench.compile_commands(grid)]
        compiled = {}
        for run in runs:
            length, head_dim, causal = grid_bench.parse_cell(run.compile_only)
            compiled.setdefault((head_dim, causal), []).append((length, run.method))
        assert {(e, c) for _, e, c in grid} == set(compiled)
        for length, head_dim, causal in grid:
            (compile_length,) = {at for at, _ in compiled[(head_dim, causal)]}
            assert keys(compile_length, head_dim) == keys(length, head_dim), (length, head_dim)
            assert sorted(name for _, name in compiled[(head_dim, causal)]) == sorted(
                grid_bench.ENTMAX_METHODS)
    assert grid_bench.QUICK_GRID[0] == grid_bench.GRID[0]
    for name in grid_bench.ENTMAX_METHODS:
        grid_bench.compile_only("16x8x1", name, device="cpu")
        grid_bench.compile_only("16x8xw4", name, device="cpu")


DQ_FUSED = [pytest.param(attention_common.DQ_ATOMIC, id="atomic"),
            pytest.param(attention_common.DQ_ORDERED, id="ordered")]


def _dq_mode_forced(monkeypatch, mode):
    """The backward forms dQ in `mode` (attention_common.backward_dq), over small tiles in
    the interpreter so that many key blocks add to each query tile."""
    monkeypatch.setattr(attention_common, "backward_dq", lambda *args: mode)
    monkeypatch.setattr(attention_common, "INTERPRETER_BLOCKS", (32, 16))


# (B, H, H_kv, Lq, Lk, E, alpha, is_causal, mask, head-dim chunk or None)
DQ_CASES = [
    pytest.param(1, 4, 2, 100, 70, 80, 2.0, True, None, None, id="causal-gqa-E80-a2"),
    pytest.param(2, 2, 2, 63, 90, 16, 1.25, False, "key-padding", None,
                 id="keypad-E16-a1.25"),
    pytest.param(1, 2, 1, 70, 130, 128, 1.5, True, "bool-empty-rows", 32,
                 id="emptyrows-causal-E128-chunked-a1.5"),
    # a group of heads in (1, 2] and one with heads at 1 and above 2: each dK/dV launch
    # takes its groups (attention_common, "A per-head alpha")
    pytest.param(1, 4, 2, 70, 90, 16, (1.3, 1.7, 1.0, 3.0), True, None, None,
                 id="causal-gqa-E16-perhead-1-and-3"),
]


def test_dq_takes_the_head_dim_chunk_of_its_architecture(monkeypatch):
    """dQ's products at E 128 in fp16/bf16 go whole on sm_90 and in two chunks elsewhere
    (`attention_common._ARCH_CHUNKS`); the launcher chooses for its device what the AOT
    check compiles for that sm, and the whole-width dQ matches float64 as closely as torch
    ops in the same dtype do (without a GPU the launcher is told it runs on sm_90)."""
    from entmax_fast.triton_kernels import aot, attention_bwd

    assert [attention_common.chunk_width("dq", 128, "bf16", arch) for arch in (None, 80, 90)] \
        == [64, 64, 128]
    assert attention_common.chunk_width("dq", 256, "fp16", 90) == 64
    for cfg in attention_bwd.aot_configs():
        kernel, dtype_key = cfg["name"].split("_")[3:5]
        for arch in (80, 90):
            assert aot.arch_constexprs(cfg, arch)["BLOCK_EC"] == attention_common.chunk_width(
                kernel, cfg["constexprs"]["BLOCK_E"], dtype_key, arch), (cfg["name"], arch)
    if not ON_GPU:
        monkeypatch.setattr(tri, "_arch", lambda device: 90)
    dtype = LOW_PRECISION[-1]
    q, k, v = _inputs(1, 2, 2, 40, 40, 128, dtype)
    grad_out = torch.randn(1, 2, 40, 128).to(dtype)
    assert tri._Geometry(q, k, v, None, None, 0, 0, False).block_ec["dq"] == \
        attention_common.chunk_width("dq", 128, tri.DTYPE_KEYS[dtype], tri._arch(q.device))
    _, grads = _grads(lambda *t: triton_attention(*t, is_causal=True, alpha=1.5), [q, k, v],
                      grad_out)
    _, base_grads = _grads(lambda *t: _plain_torch_attention(*t, True, 1.5), [q, k, v],
                           grad_out)
    _, ref_grads = _grads(lambda *t: reference_attention(*t, is_causal=True, alpha=1.5),
                          [t.double() for t in (q, k, v)], grad_out)
    for name, got, base, want in zip(("dq", "dk", "dv"), grads, base_grads, ref_grads):
        assert _err(got, want) <= 2.0 * _err(base, want), name


@pytest.mark.parametrize("dq_mode", DQ_FUSED)
@pytest.mark.parametrize("b,h,hkv,lq,lk,e,alpha,is_causal,mask_spec,chunk", DQ_CASES)
def test_dq_in_the_dkdv_kernel(monkeypatch, dq_mode, b, h, hkv, lq, lk, e, alpha, is_causal,
                               mask_spec, chunk):
    """dQ summed by the dK/dV kernel (atomic adds, unordered or in key-block order) matches
    float64, with the empty rows' zeros; the chunked case loads k's rows for the dQ product
    apart from the chunked score product."""
    _dq_mode_forced(monkeypatch, dq_mode)
    if isinstance(alpha, tuple):
        alpha = torch.tensor(alpha)
    if chunk is not None:
        monkeypatch.setattr(attention_common, "_CHUNKS",
                            {("dkdv", "fp32"): {triton.next_power_of_2(e): chunk}})
    q, k, v = _inputs(b, h, hkv, lq, lk, e, torch.float32)
    mask = _mask(mask_spec, b, h, lq, lk)
    grad_out = torch.randn(b, h, lq, e)

    def run(fn, *t):
        return fn(*t, attn_mask=mask, is_causal=is_causal, enable_gqa=True, alpha=alpha)

    out, grads = _grads(lambda *t: run(triton_attention, *t), [q, k, v], grad_out)
    _, ref_grads = _grads(lambda *t: run(reference_attention, *t),
                          [t.double() for t in (q, k, v)], grad_out)
    assert tri._dq_mode(tri._Geometry(q, k, v, None, None, 0, 0, False), False) == dq_mode
    assert _err(out, oracle_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                      alpha=alpha)) <= 1e-5
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name
    if mask_spec == "bool-empty-rows":
        assert torch.equal(grads[0][:, :, 3], torch.zeros_like(grads[0][:, :, 3]))


def test_dq_in_the_dkdv_kernel_varlen_and_dropout(monkeypatch):
    """Packed sequences of other lengths (the counters and turns of a short sequence's
    padding tiles are never waited on) and dropout (the same mask as the dQ kernel's, from
    the same seed): in both fused modes the gradients equal those of the dQ kernel up to
    rounding."""
    lens_q, lens_k = [5, 63, 40], [7, 40, 70]
    h, hkv, e = 2, 1, 16
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    packed = [torch.randn(sum(lens_q), h, e) * 1.5, torch.randn(sum(lens_k), hkv, e),
              torch.randn(sum(lens_k), hkv, e)]
    packed_grad = torch.randn(sum(lens_q), h, e)
    dense = list(_inputs(1, h, hkv, 50, 70, e, torch.float32))
    dense_grad = torch.randn(1, h, 50, e)

    def varlen(*t):
        return _triton_attention_varlen(*t, cu_q, cu_k, max(lens_q), max(lens_k),
                                        is_causal=True, alpha=1.5)

    def dropout(*t):
        torch.manual_seed(11)
        return triton_attention(*t, dropout_p=0.3, enable_gqa=True, alpha=1.25)

    monkeypatch.setattr(attention_common, "INTERPRETER_BLOCKS", (32, 16))
    expected = [_grads(varlen, packed, packed_grad)[1], _grads(dropout, dense, dense_grad)[1]]
    for dq_mode in (param.values[0] for param in DQ_FUSED):
        _dq_mode_forced(monkeypatch, dq_mode)
        got = [_grads(varlen, packed, packed_grad)[1], _grads(dropout, dense, dense_grad)[1]]
        for case, got_grads, want_grads in zip(("varlen", "dropout"), got, expected):
            for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
                assert _err(g, w) <= 1e-5, (dq_mode, case, name)


def test_dq_kernel_kept_for_a_learned_alpha_and_deterministic_algorithms(monkeypatch):
    """A learned alpha needs the dQ kernel's row sums of d(alpha); unordered atomic adds
    give way to it under torch.use_deterministic_algorithms, the ordered ones do not."""
    q, k, v = _inputs(1, 2, 2, 20, 20, 16, torch.float32)
    geo = tri._Geometry(q, k, v, None, None, 0, 0, False)
    for mode in (attention_common.DQ_ATOMIC, attention_common.DQ_ORDERED):
        monkeypatch.setattr(attention_common, "backward_dq", lambda *args: mode)
        assert tri._dq_mode(geo, True) == attention_common.DQ_KERNEL
        assert tri._dq_mode(geo, False) == mode
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(attention_common, "backward_dq",
                        lambda *args: attention_common.DQ_ATOMIC)
    assert tri._dq_mode(geo, False) == attention_common.DQ_KERNEL
    monkeypatch.setattr(attention_common, "backward_dq",
                        lambda *args: attention_common.DQ_ORDERED)
    assert tri._dq_mode(geo, False) == attention_common.DQ_ORDERED


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel: launches it and records each launch's grid and
    maxnreg."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.maxnreg = kernel, [], []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.grids.append(tuple(grid))
            self.maxnreg.append(kwargs.get("maxnreg"))
            return launch(*args, **kwargs)
        return run


def test_launches_put_the_heads_first(monkeypatch):
    """Every attention launch has the (batch x) heads along the grid's first dimension and
    the blocks along its second (`attention_common.launch_grid`: the GPU starts the first
    dimension fastest, so every head's longest causal blocks start first), and the kernels
    read it so: a causal GQA call with as many heads as blocks nowhere matches float64
    forward and backward."""
    from entmax_fast.triton_kernels import attention_bwd, attention_fwd

    recorders = {"fwd": _LaunchRecorder(attention_fwd.entmax_attn_fwd_kernel),
                 "dq": _LaunchRecorder(attention_bwd.entmax_attn_bwd_dq_kernel),
                 "dkdv": _LaunchRecorder(attention_bwd.entmax_attn_bwd_dkdv_kernel)}
    monkeypatch.setattr(attention_fwd, "entmax_attn_fwd_kernel", recorders["fwd"])
    monkeypatch.setattr(attention_bwd, "entmax_attn_bwd_dq_kernel", recorders["dq"])
    monkeypatch.setattr(attention_bwd, "entmax_attn_bwd_dkdv_kernel", recorders["dkdv"])
    geo = _check_causal_gqa(alpha=1.5)
    assert 2 * 4 != geo.n_qblocks and 2 * 2 != geo.n_kblocks
    assert set(recorders["fwd"].grids) == {(2 * 4, geo.n_qblocks)}
    assert recorders["dq"].grids == [(2 * 4, geo.n_qblocks)]
    assert recorders["dkdv"].grids == [(2 * 2, geo.n_kblocks)]


@pytest.mark.parametrize("side", ["query", "key"])
def test_sequences_longer_than_a_grid_holds_are_refused(side):
    """More blocks per sequence than a CUDA grid's second dimension holds (65535) is a
    clear error naming the side and the length, not a failed launch."""
    small = torch.randn(1, 1, 8, 16)
    geo = tri._Geometry(small, small, small, None, None, 0, 0, False)
    block = geo.block_m if side == "query" else geo.block_n
    long = attention_common.MAX_GRID_BLOCKS * block + 1
    lq, lk = (long, 8) if side == "query" else (8, long)
    # expanded: the launcher reads shapes and strides before it allocates anything
    q = torch.randn(1, 1, 1, 16).expand(1, 1, lq, 16)
    k = torch.randn(1, 1, 1, 16).expand(1, 1, lk, 16)
    with pytest.raises(ValueError, match=f"at most {long - 1} {side} positions .* got {long}"):
        triton_attention(q, k, k, alpha=1.5)


def test_backward_launches_take_the_register_caps_the_aot_check_compiles(monkeypatch):
    """A register cap of the table (`attention_common.register_cap`, what
    tools/tune_attention.py --caps tries) reaches the backward's launches and the AOT
    check's configurations alike, and the capped backward still matches float64."""
    from entmax_fast.triton_kernels import attention_bwd

    caps = {"fwd_threshold": 128, "dq": 128, "dkdv": 168}
    monkeypatch.setattr(attention_common, "register_cap", lambda kernel, *_: caps.get(kernel))
    for cfg in attention_bwd.aot_configs():
        kernel = "dq" if "_bwd_dq_" in cfg["name"] else "dkdv"
        assert cfg["options"] == {"maxnreg": caps[kernel]}, cfg["name"]
    recorders = {name: _LaunchRecorder(getattr(attention_bwd, f"entmax_attn_bwd_{name}_kernel"))
                 for name in ("dq", "dkdv")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(attention_bwd, f"entmax_attn_bwd_{name}_kernel", recorder)
    q, k, v = _inputs(1, 2, 2, 70, 70, 16, torch.float32)
    grad_out = torch.randn(1, 2, 70, 16)
    _, grads = _grads(lambda *t: triton_attention(*t, is_causal=True, alpha=1.5), [q, k, v],
                      grad_out)
    _, ref_grads = _grads(lambda *t: reference_attention(*t, is_causal=True, alpha=1.5),
                          [t.double() for t in (q, k, v)], grad_out)
    assert {name: r.maxnreg for name, r in recorders.items()} == {"dq": [128], "dkdv": [168]}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name


@pytest.mark.skipif(not ON_GPU, reason="one program at a time in the interpreter: any order "
                                       "of adds is the same order")
def test_ordered_dq_repeats_bit_for_bit(monkeypatch):
    """DQ_ORDERED adds each query tile's shares in one order whatever the scheduling, so
    two runs give the same bits (the unordered atomic adds need not)."""
    monkeypatch.setattr(attention_common, "backward_dq",
                        lambda *args: attention_common.DQ_ORDERED)
    q, k, v = _inputs(2, 8, 8, 1024, 1024, 64, torch.bfloat16)
    grad_out = torch.randn(2, 8, 1024, 64, dtype=torch.bfloat16)
    first, second = (_grads(lambda *t: triton_attention(*t, is_causal=True, alpha=1.5),
                            [q, k, v], grad_out)[1][0] for _ in range(2))
    assert torch.equal(first, second)


# Per-head alpha tensors holding 1 (that head's softmax) and values above 2, which the
# general kind's kernels branch on per program (attention_common, "A per-head alpha").
PER_HEAD_ALPHAS = [pytest.param((1.0, 1.5, 1.0, 2.0), id="a1-1.5-1-2"),
                   pytest.param((1.2, 2.5, 3.0, 1.0), id="a1.2-2.5-3-1")]


@pytest.mark.parametrize("alpha", PER_HEAD_ALPHAS)
@pytest.mark.parametrize("options", [{"is_causal": True}, {
    "window_size": (20, 5), "softcap": 3.0, "alibi_slopes": "slopes", "sinks": "sinks"}],
    ids=["causal", "window-softcap-alibi-sinks"])
def test_per_head_alpha_of_one_and_above_two(alpha, options):
    """Forward against the float64 oracle, dq, dk, dv, d(alpha) and d(sinks) against the
    reference in float64: d(alpha) of a head at 1 is the exact limit there (the reference's,
    checked against the oracle's finite differences in test_cpp_ops.py's counterpart)."""
    b, h, hkv, lq, lk, e = 1, 4, 2, 70, 100, 16
    q, k, v = _inputs(b, h, hkv, lq, lk, e, torch.float32)
    alpha = torch.tensor(alpha)
    options = dict(options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = torch.rand(h) * 0.2
    inputs = [q, k, v, alpha]
    if "sinks" in options:
        inputs.append(torch.randn(h))
        del options["sinks"]
    grad_out = torch.randn(b, h, lq, e)

    def call(backend):
        def fn(q_, k_, v_, a_, *sinks):
            with entmax_fast.use_backend(backend):
                return entmax_fast.entmax_attention(q_, k_, v_, enable_gqa=True, alpha=a_,
                                                    sinks=sinks[0] if sinks else None, **options)
        return fn

    out, grads = _grads(call("triton"), inputs, grad_out)
    assert dispatch.last_choice("attention").backend == "triton"
    expected = oracle_attention(q, k, v, alpha=alpha, sinks=inputs[4] if len(inputs) > 4 else None,
                                **options)
    assert _err(out, expected) <= 1e-5
    _, ref_grads = _grads(call("reference"), [t.double() for t in inputs], grad_out)
    for name, got, want in zip(("dq", "dk", "dv", "dalpha", "dsinks"), grads, ref_grads):
        assert _err(got, want) <= 1e-4, name


def test_varlen_per_head_alpha_of_one_and_above_two():
    """The varlen launch takes the same per-head branches: each sequence as the padded call
    (itself checked against the oracle above)."""
    lens_q, lens_k = [5, 70], [7, 63]
    h, hkv, e = 4, 2, 16
    alpha = torch.tensor([1.2, 2.5, 3.0, 1.0])
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, e) * 1.5
    k = torch.randn(sum(lens_k), hkv, e)
    v = torch.randn(sum(lens_k), hkv, e)
    grad_out = torch.randn(sum(lens_q), h, e)
    out, grads = _grads(
        lambda q_, k_, v_, a_: _triton_attention_varlen(
            q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k), is_causal=True, alpha=a_),
        [q, k, v, alpha], grad_out)
    dalpha = torch.zeros(h, dtype=torch.float64)
    for i in range(len(lens_q)):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        seq = [t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, sq), (k, sk), (v, sk))]
        assert _err(out[sq], oracle_attention(*seq, is_causal=True, alpha=alpha)[0].transpose(0, 1)) <= 1e-5
        _, ref = _grads(lambda q_, k_, v_, a_: reference_attention(
            q_, k_, v_, is_causal=True, enable_gqa=True, alpha=a_),
            [t.double() for t in seq] + [alpha.double()], grad_out[sq].transpose(0, 1).unsqueeze(0))
        for got, want, s in zip(grads[:3], ref[:3], (sq, sk, sk)):
            assert _err(got[s], want[0].transpose(0, 1)) <= 1e-4
        dalpha += ref[3]
    assert _err(grads[3], dalpha) <= 1e-4


@pytest.mark.parametrize("alpha", [1.0, 3.0])
def test_a_float_alpha_of_one_or_above_two_runs_on_the_fused_kernels(alpha):
    """A python float alpha outside (1, 2] runs on the general kind's kernels, as the same
    value per head does: the Triton backend takes it (it no longer goes to the next
    backend)."""
    q, k, v = _inputs(1, 2, 2, 40, 63, 16, torch.float32)
    grad_out = torch.randn(1, 2, 40, 16)
    out, grads = _grads(lambda *t: triton_attention(*t, is_causal=True, alpha=alpha), [q, k, v],
                        grad_out)
    assert dispatch.last_choice("attention").backend == "triton"
    per_head, head_grads = _grads(
        lambda *t: triton_attention(*t, is_causal=True, alpha=torch.full((2,), alpha)),
        [q, k, v], grad_out)
    assert torch.equal(out, per_head)
    assert _err(out, oracle_attention(q, k, v, is_causal=True, alpha=alpha)) <= 1e-5
    _, ref_grads = _grads(lambda *t: reference_attention(*t, is_causal=True, alpha=alpha),
                          [t.double() for t in (q, k, v)], grad_out)
    for name, got, same, want in zip(("dq", "dk", "dv"), grads, head_grads, ref_grads):
        assert torch.equal(got, same), name
        assert _err(got, want) <= 1e-4, name


def test_alpha_above_two_weighs_a_key_at_the_edge_of_the_support():
    """alpha 4: key 1 sits 1e-9 (z units) inside the support, where its weight
    (3 d)^(1/3) is 1.4e-3 and its slope infinite. Formed as 1 + ((alpha - 1) u - c) the base
    would round in steps of 6e-8 (a weight of 0 or 4e-3); the kernels search the threshold
    again relative to the shift max + tau, where d is a difference near 0."""
    am1, d = 3.0, 1e-9
    tau = -(1 - (am1 * d) ** (1 / am1)) ** am1 / am1
    scores = torch.full((1, 1, 3, 64), -10.0)
    scores[..., 0] = 0.0
    scores[..., 1] = tau + d
    q = torch.zeros(1, 1, 3, 16)
    k = torch.randn(1, 1, 64, 16)
    v = torch.zeros(1, 1, 64, 16)
    v[..., 1, :] = 1.0
    out = triton_attention(q, k, v, attn_mask=scores, alpha=torch.tensor([am1 + 1]))
    expected = oracle_attention(q, k, v, attn_mask=scores, alpha=torch.tensor([am1 + 1]))
    assert expected[0, 0, 0, 0] > 1e-3
    assert _err(out, expected) <= 1e-5
