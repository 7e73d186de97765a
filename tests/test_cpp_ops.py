"""C++ CPU backend (csrc/cpu, entmax_fast.backends.cpp) vs the plain-torch reference vs the
float64 oracle: row-wise α-entmax and entmax attention, forward and backward, ragged shapes,
masks, α float / per row / per head (incl. 1, 1.5, 2, 3 and α < 1), fully masked rows,
torch.library.opcheck. Skipped, with the reason, when the extension is not built."""
import math

import pytest
import torch

import entmax_fast
from entmax_fast import dispatch
from entmax_fast._validation import ScoreOptions
from entmax_fast.attention import AttentionFunction
from entmax_fast.backends.cpp import loader
from entmax_fast.backends.cpp import ops as cpp_ops
from entmax_fast.common import GRAD_ALPHA
from entmax_fast.reference.attention import entmax_attention as reference_attention
from entmax_fast.reference.mappings import entmax_backward as reference_backward
from entmax_fast.reference.mappings import entmax_forward as reference_forward
from oracle import oracle_attention, oracle_entmax

_AVAILABLE, _REASON = dispatch.availability("cpp")
_AVAILABLE = _AVAILABLE and loader.has_entmax_ops()
pytestmark = pytest.mark.skipif(not _AVAILABLE, reason=f"C++ CPU ops unavailable: {_REASON}")

INF = math.inf


def cpp_entmax(x, alpha):
    """Row-wise entmax of x (R, n) on the C++ backend, differentiable (the public layer's
    autograd over the backend's pair); alpha a float or a tensor (R,)."""
    with dispatch.use_backend("cpp"):
        return entmax_fast.entmax_bisect(x, alpha.view(-1, 1) if isinstance(alpha, torch.Tensor) else alpha, dim=-1)


def cpp_attention(query, key, value, attn_mask=None, is_causal=False, enable_gqa=False, alpha=1.5):
    """The C++ backend's attention pair under the public layer's autograd.Function, without the
    public checks, which refuse alpha < 1 (the C++ kernels take any alpha > 0). 3-D inputs are
    one batch."""
    if query.dim() == 3:
        out = cpp_attention(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), attn_mask, is_causal,
                            enable_gqa, alpha)
        return out.squeeze(0)
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 0:
        alpha = alpha.reshape(1).expand(query.shape[1])
    options = {"scale": 1.0 / math.sqrt(query.shape[-1]), "is_causal": is_causal, "dropout_p": 0.0,
               "enable_gqa": enable_gqa, "need_grad": GRAD_ALPHA}
    with dispatch.use_backend("cpp"):
        # no sinks, no ALiBi slopes
        return AttentionFunction.apply(query, key, value, attn_mask, alpha, None, None, ScoreOptions(), options,
                                       {})

ALPHAS = [pytest.param(a, id=f"a{a}") for a in (1.0, 1.5, 2.0, 1.25, 3.0, 0.75)]

# (dtype, atol): an error allowance added to twice the reference's own error vs the oracle.
DTYPES = [
    pytest.param(torch.float64, 1e-12, id="f64"),
    pytest.param(torch.float32, 2e-6, id="f32"),
    pytest.param(torch.float16, 2e-3, id="f16"),
    pytest.param(torch.bfloat16, 1.6e-2, id="bf16"),
]

# Rows shapes chosen ragged; "scale" stretches the scores: large gives one-hot rows, small
# gives (nearly) uniform rows, so every support size is reached.
ROW_SHAPES = [pytest.param(1, 1, id="1x1"), pytest.param(3, 7, id="3x7"), pytest.param(17, 63, id="17x63"),
              pytest.param(6, 1000, id="6x1000")]
SCALES = [pytest.param(0.01, id="flat"), pytest.param(1.0, id="unit"), pytest.param(30.0, id="peaked")]


def _rows(r, n, scale, dtype):
    x = torch.randn(r, n, dtype=torch.float64) * scale
    if r > 1 and n > 2:
        x[0, ::2] = -INF  # some -inf entries
    if r > 2:
        x[2] = -INF  # a fully -inf row
    if r > 3 and n > 4:
        x[3, : n // 2] = x[3, 0]  # ties
    return x.to(dtype)


def _assert_close_as_reference(out, ref, oracle, atol):
    """|out − oracle| ≤ 2 |ref − oracle| + atol elementwise-max (FlashAttention's rule)."""
    assert not torch.isnan(out).any()
    err = (out.double() - oracle).abs().max().item() if out.numel() else 0.0
    ref_err = (ref.double() - oracle).abs().max().item() if ref.numel() else 0.0
    assert err <= 2 * ref_err + atol, f"error {err:.3g} vs reference error {ref_err:.3g} (atol {atol:.1g})"


# ------------------------------------------------------------------ row-wise forward

@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("r,n", ROW_SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_rowwise_forward_matches_oracle(dtype, atol, alpha, r, n, scale):
    x = _rows(r, n, scale, dtype)
    p = cpp_ops.entmax_forward(x, alpha)
    assert p.dtype == dtype and p.shape == x.shape
    oracle = oracle_entmax(x.double(), alpha)
    _assert_close_as_reference(p, reference_forward(x, alpha), oracle, atol)
    if r > 2:
        assert torch.equal(p[2], torch.zeros_like(p[2]))


def _lane_rows(n):
    """Rows for the closed-form threshold's lower bound from the row's 16 lane maxima (the
    entries j = e mod 16 form lane e): the support all in one lane (a loose bound), exactly
    one support entry per lane (a bound equal to the threshold), every entry tied, and
    supports of 1, 15, 16 and 17 entries among -inf and low scores."""
    rows = []
    one_lane = torch.full((n,), -3.0, dtype=torch.float64)
    one_lane[::16] = torch.linspace(2.0, 1.0, len(range(0, n, 16)), dtype=torch.float64)
    rows.append(one_lane)
    per_lane = torch.full((n,), -3.0, dtype=torch.float64)
    per_lane[:16] = 1.0
    rows.append(per_lane)
    rows.append(torch.zeros(n, dtype=torch.float64))
    for support in (1, 15, 16, 17):
        row = torch.full((n,), -INF, dtype=torch.float64)
        row[1::3] = -5.0
        row[torch.randperm(n)[:support]] = torch.rand(support, dtype=torch.float64)
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,atol", DTYPES[:2])
@pytest.mark.parametrize("alpha", [pytest.param(1.5, id="a1.5"), pytest.param(2.0, id="a2")])
@pytest.mark.parametrize("n", [17, 40, 2048])
def test_rowwise_closed_forms_where_lane_maxima_bound_the_threshold(dtype, atol, alpha, n):
    x = _lane_rows(n).to(dtype)
    p = cpp_ops.entmax_forward(x, alpha)
    oracle = oracle_entmax(x.double(), alpha)
    _assert_close_as_reference(p, reference_forward(x, alpha), oracle, atol)
    # The supports exactly: no entry dropped by the bound, none kept beyond the threshold.
    assert torch.equal(p > 0, oracle > 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("alpha", [pytest.param(1.5, id="a1.5"), pytest.param(2.0, id="a2")])
@pytest.mark.parametrize("n", [17, 40, 2048])
def test_rowwise_closed_forms_nan_or_inf_anywhere_gives_a_nan_row(dtype, alpha, n):
    # In the vectorised blocks and in the tail past the last block of 16.
    x = torch.randn(4, n, dtype=dtype)
    x[0, n // 2] = math.nan
    x[1, n // 2] = INF
    x[2, n - 1] = math.nan
    x[3, n - 1] = INF
    assert cpp_ops.entmax_forward(x, alpha).isnan().all()


@pytest.mark.parametrize("dtype,atol", DTYPES[:2])
def test_rowwise_forward_alpha_per_row(dtype, atol):
    alphas = torch.tensor([1.0, 1.5, 2.0, 1.25, 3.0, 0.75, 1.0001, 1.5, 2.0, 1.7], dtype=torch.float32)
    x = _rows(alphas.numel(), 129, 1.0, dtype)
    p = cpp_ops.entmax_forward(x, alphas)
    oracle = oracle_entmax(x.double(), alphas.double().view(-1, 1))
    _assert_close_as_reference(p, reference_forward(x, alphas.view(-1, 1)), oracle, atol)


def test_rowwise_alpha_one_is_exact_softmax():
    x = torch.randn(5, 77, dtype=torch.float64)
    torch.testing.assert_close(cpp_ops.entmax_forward(x, 1.0), torch.softmax(x, -1), atol=1e-15, rtol=0)


def test_rowwise_sparsemax_known_value_and_masking_invariance():
    x = torch.tensor([[1.0, 2.1, 1.9, -INF, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[0.0, 0.6, 0.4, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(cpp_ops.entmax_forward(x, 2.0), expected, atol=1e-15, rtol=0)
    # −inf columns give exactly the result of slicing them away.
    for alpha in (1.5, 1.25, 0.75):
        full = cpp_ops.entmax_forward(x, alpha)
        kept = cpp_ops.entmax_forward(x[:, [0, 1, 2, 4]], alpha)
        torch.testing.assert_close(full[:, [0, 1, 2, 4]], kept, atol=1e-15, rtol=0)
        assert full[0, 3] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_rowwise_huge_offsets_low_precision_no_nan(dtype):
    x = (torch.randn(4, 300) - 1000).to(dtype)
    x[1] = 60000 if dtype == torch.float16 else 1e30
    for alpha in (1.0, 1.5, 2.0, 1.25):
        p = cpp_ops.entmax_forward(x, alpha)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.float().sum(-1), torch.ones(4), atol=2e-2, rtol=0)


# ------------------------------------------------------------------ row-wise backward

@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float64, 1e-12, id="f64"),
                                        pytest.param(torch.float32, 1e-5, id="f32")])
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("r,n", ROW_SHAPES)
def test_rowwise_backward_matches_reference(dtype, atol, alpha, r, n):
    x = _rows(r, n, 1.0, dtype)
    p = cpp_ops.entmax_forward(x, alpha)
    g = torch.randn(r, n, dtype=dtype)
    alpha_t = torch.full((r,), alpha, dtype=torch.float64)
    dx, dalpha = cpp_ops.entmax_backward(p, g, alpha_t, True)
    ref_dx, ref_dalpha = reference_backward(p.double(), g.double(), alpha_t.view(-1, 1))
    torch.testing.assert_close(dx.double(), ref_dx, atol=atol, rtol=0)
    # dalpha is computed in float64 from the row; scale the allowance by its magnitude.
    torch.testing.assert_close(dalpha.double(), ref_dalpha.view(-1), atol=atol * (1 + ref_dalpha.abs().max().item()),
                               rtol=0)
    if r > 2:
        assert torch.equal(dx[2], torch.zeros_like(dx[2])) and dalpha[2] == 0
    dx_only, none = cpp_ops.entmax_backward(p, g, alpha, False)
    assert none is None
    torch.testing.assert_close(dx_only, dx, atol=atol, rtol=0)


def _check_alpha_grad_against_finite_differences(n, n_masked, alpha):
    """dalpha of 4 float64 rows of length n (row 1 with n_masked -inf entries) vs central
    differences of the float64 oracle."""
    x = torch.randn(4, n, dtype=torch.float64)
    x[1, :n_masked] = -INF
    g = torch.randn_like(x)
    p = cpp_ops.entmax_forward(x, alpha)
    _, dalpha = cpp_ops.entmax_backward(p, g, torch.full((4,), alpha, dtype=torch.float64), True)
    eps = 1e-5
    plus = oracle_entmax(x, torch.full((4, 1), alpha + eps, dtype=torch.float64))
    minus = oracle_entmax(x, torch.full((4, 1), alpha - eps, dtype=torch.float64))
    fd = ((plus - minus) / (2 * eps) * g).sum(-1)
    torch.testing.assert_close(dalpha, fd, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_rowwise_alpha_grad_matches_oracle_finite_differences(alpha):
    _check_alpha_grad_against_finite_differences(23, 5, alpha)


@pytest.mark.parametrize("alpha", [pytest.param(a, id=f"a{a}") for a in (1.0, 1.5, 2.0, 1.25, 0.75)])
def test_rowwise_gradcheck_x_and_alpha(alpha):
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    a = torch.full((3,), alpha, dtype=torch.float64, requires_grad=True)
    # eps 1e-5: at alpha = 1 +- 1e-6 the finite differences themselves are noisy (~1e-5).
    torch.autograd.gradcheck(cpp_entmax, (x, a), eps=1e-5, atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------ General kind (α ∉ {1, 1.5, 2})
# Its kernels come in three sets: "avx512" and "avx2-fma" (vectorised exp/log, the best the
# CPU has chosen at run time) and "portable" (std::exp/log); α = 1 + 1/k (k = 3..16) raises to
# the power k by multiplications in all. Every test here runs once per set the CPU has.

INTEGER_EXPONENT_ALPHAS = [pytest.param(1 + 1 / k, id=f"a1+1|{k}") for k in (3, 4, 5, 10, 16)]
GENERAL_ALPHAS = INTEGER_EXPONENT_ALPHAS + [pytest.param(a, id=f"a{a}") for a in (1.3, 1.7, 3.0, 0.5, 0.75)]
# dα's (p − p̃)/(α−1)² term cancels like 1/(α−1)² in float64 too: α near 1 only forward.
# |1/(α−1)| = 50 still takes float-precision steps first on AVX2 (the bracket then moves only
# where f's sign is beyond their rounding), 100 does not.
FORWARD_ALPHAS = GENERAL_ALPHAS + [pytest.param(a, id=f"a{a}") for a in (1.02, 0.98, 1.01)]


@pytest.fixture(params=["auto", "avx2-fma", "portable"])
def kernel_isa(request):
    if request.param == "avx2-fma" and _AUTO_ISA != "avx512":
        pytest.skip("the AVX2 kernels are the automatic choice here, or this CPU lacks them")
    active = torch.ops.entmax_fast.cpu_kernel_isa(request.param)
    assert active == (_AUTO_ISA if request.param == "auto" else request.param)
    yield active
    torch.ops.entmax_fast.cpu_kernel_isa("auto")


_AUTO_ISA = torch.ops.entmax_fast.cpu_kernel_isa("auto") if _AVAILABLE else None


def test_cpu_kernel_isa_reports_and_rejects():
    assert _AUTO_ISA in ("avx512", "avx2-fma", "portable")
    with pytest.raises(RuntimeError, match="request must be 'auto', 'avx2-fma' or 'portable'"):
        torch.ops.entmax_fast.cpu_kernel_isa("sse9")
    assert torch.ops.entmax_fast.cpu_kernel_isa() == _AUTO_ISA
    try:
        if _AUTO_ISA == "portable":
            with pytest.raises(RuntimeError, match="request 'avx2-fma' needs a CPU with AVX2 and FMA"):
                torch.ops.entmax_fast.cpu_kernel_isa("avx2-fma")
        else:
            assert torch.ops.entmax_fast.cpu_kernel_isa("avx2-fma") == "avx2-fma"
        assert torch.ops.entmax_fast.cpu_kernel_isa("portable") == "portable"
    finally:
        torch.ops.entmax_fast.cpu_kernel_isa("auto")
    assert torch.ops.entmax_fast.cpu_kernel_isa() == _AUTO_ISA


@pytest.mark.parametrize("dtype,atol", DTYPES[:2])
@pytest.mark.parametrize("alpha", FORWARD_ALPHAS)
@pytest.mark.parametrize("r,n", ROW_SHAPES[1:])
@pytest.mark.parametrize("scale", SCALES)
def test_general_forward_matches_oracle(kernel_isa, dtype, atol, alpha, r, n, scale):
    # flat rows: every entry a candidate (the passes read the row itself); unit and peaked
    # rows: a gathered subset, compacted as the bracket moves.
    x = _rows(r, n, scale, dtype)
    p = cpp_ops.entmax_forward(x, alpha)
    oracle = oracle_entmax(x.double(), alpha)
    _assert_close_as_reference(p, reference_forward(x, alpha), oracle, atol)
    if r > 2:
        assert torch.equal(p[2], torch.zeros_like(p[2]))


@pytest.mark.parametrize("dtype,atol", DTYPES[:2])
@pytest.mark.parametrize("alpha", [pytest.param(1.25, id="a1.25"), pytest.param(1.3, id="a1.3")])
def test_general_forward_row_then_gathered(kernel_isa, dtype, atol, alpha):
    """Rows that start on the row itself (every finite entry a candidate) and switch to a
    gathered copy once most entries have left the support: 10 % of the entries at the top,
    the rest just above the candidate cut -1/(α-1), out of the support after the first step;
    -inf entries on top in the second row."""
    n = 1000
    cut = -1 / (alpha - 1)
    x = torch.full((2, n), 0.97 * cut, dtype=torch.float64)
    x[:, ::10] = torch.linspace(0, 0.01, 100, dtype=torch.float64)
    x[1, 1::10] = -INF
    x = x.to(dtype)
    p = cpp_ops.entmax_forward(x, alpha)
    oracle = oracle_entmax(x.double(), alpha)
    _assert_close_as_reference(p, reference_forward(x, alpha), oracle, atol)
    assert (p[:, 1::10] == 0).all()


@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float64, 1e-12, id="f64"),
                                        pytest.param(torch.float32, 1e-5, id="f32")])
@pytest.mark.parametrize("alpha", GENERAL_ALPHAS)
@pytest.mark.parametrize("scale", SCALES)
def test_general_backward_matches_reference(kernel_isa, dtype, atol, alpha, scale):
    # flat rows have a dense support (vectorised powers), peaked ones a sparse one (powers
    # on the support only).
    x = _rows(6, 1000, scale, dtype)
    p = cpp_ops.entmax_forward(x, alpha)
    g = torch.randn(6, 1000, dtype=dtype)
    alpha_t = torch.full((6,), alpha, dtype=torch.float64)
    dx, dalpha = cpp_ops.entmax_backward(p, g, alpha_t, True)
    ref_dx, ref_dalpha = reference_backward(p.double(), g.double(), alpha_t.view(-1, 1))
    torch.testing.assert_close(dx.double(), ref_dx, atol=atol * max(1.0, ref_dx.abs().max().item()), rtol=0)
    torch.testing.assert_close(dalpha.double(), ref_dalpha.view(-1), atol=atol * (1 + ref_dalpha.abs().max().item()),
                               rtol=0)
    assert torch.equal(dx[2], torch.zeros_like(dx[2])) and dalpha[2] == 0


@pytest.mark.parametrize("alpha", INTEGER_EXPONENT_ALPHAS + [pytest.param(1.3, id="a1.3")])
def test_general_alpha_grad_matches_oracle_finite_differences(kernel_isa, alpha):
    _check_alpha_grad_against_finite_differences(300, 50, alpha)


@pytest.mark.skipif(_AUTO_ISA == "portable", reason="this CPU runs only the portable kernels")
def test_general_kernel_sets_agree():
    """Every kernel set the CPU has gives the float64 result to within a few ulps of the portable one."""
    x = torch.randn(8, 517, dtype=torch.float64) * 3
    alphas = torch.tensor([1.25, 1.3, 1.7, 3.0, 0.75, 1.1, 1.01, 2.5], dtype=torch.float64)
    results = {}
    try:
        for isa in ("portable", "avx2-fma", "auto"):
            results[torch.ops.entmax_fast.cpu_kernel_isa(isa)] = cpp_ops.entmax_forward(x, alphas)
    finally:
        torch.ops.entmax_fast.cpu_kernel_isa("auto")
    assert set(results) == {"portable", "avx2-fma", _AUTO_ISA}
    for isa, p in results.items():
        torch.testing.assert_close(p, results["portable"], atol=1e-14, rtol=0, msg=isa)


# ------------------------------------------------------------------ attention

ATT_SHAPES = [  # B, H, Hk, Lq, Lk, E, Ev
    pytest.param(1, 1, 1, 1, 1, 8, 8, id="1x1"),
    pytest.param(2, 4, 2, 37, 70, 16, 19, id="gqa-37x70"),
    pytest.param(1, 3, 3, 67, 33, 8, 8, id="67x33"),
]
ATT_ALPHAS = [pytest.param(a, id=f"a{a}") for a in (1.5, 2.0, 1.0, 1.25)] + [pytest.param("per_head", id="per_head")]
MASKS = ["none", "causal", "bool", "float", "bool+causal"]


def _att_alpha(alpha, heads, dtype=torch.float64):
    if alpha == "per_head":
        return torch.tensor([1.0, 1.5, 2.0, 1.25, 3.0, 0.75][:heads], dtype=dtype)
    return alpha


def _att_inputs(b, h, hk, lq, lk, e, ev, mask_kind, dtype):
    q = torch.randn(b, h, lq, e, dtype=torch.float64)
    k = torch.randn(b, hk, lk, e, dtype=torch.float64)
    v = torch.randn(b, hk, lk, ev, dtype=torch.float64)
    mask = None
    if "bool" in mask_kind:
        mask = torch.rand(b, 1, lq, lk) > 0.3
        mask[:, :, 0] = False  # a query with every key masked
    elif mask_kind == "float":
        mask = torch.randn(lq, lk, dtype=torch.float64)
        mask[-1] = -INF
        mask[0, :: 2] = -INF
    return q.to(dtype), k.to(dtype), v.to(dtype), mask, "causal" in mask_kind


# Every α in float64/float32; fp16/bf16 (computed in float32 inside) with α = 1.5 and per head.
ATT_DTYPE_ALPHAS = [pytest.param(d.values[0], d.values[1], a.values[0], id=f"{d.id}-{a.id}")
                    for d in DTYPES for a in ATT_ALPHAS
                    if d.values[0] in (torch.float64, torch.float32) or a.values[0] in (1.5, "per_head")]


@pytest.mark.parametrize("dtype,atol,alpha", ATT_DTYPE_ALPHAS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("b,h,hk,lq,lk,e,ev", ATT_SHAPES)
def test_attention_forward_matches_oracle(dtype, atol, alpha, mask_kind, b, h, hk, lq, lk, e, ev):
    q, k, v, mask, causal = _att_inputs(b, h, hk, lq, lk, e, ev, mask_kind, dtype)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    a = _att_alpha(alpha, h)
    out = cpp_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=hk != h, alpha=a)
    assert out.dtype == dtype and out.shape == (b, h, lq, ev)
    oracle = oracle_attention(q, k, v, attn_mask=mask, is_causal=causal, alpha=a)
    oracle = torch.nan_to_num(oracle, nan=0.0)  # the oracle's fully masked rows are 0/0
    ref = reference_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=hk != h, alpha=a)
    _assert_close_as_reference(out, ref, oracle, atol * max(1.0, oracle.abs().max().item()))
    if "bool" in mask_kind:
        assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))


@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float64, 1e-11, id="f64"),
                                        pytest.param(torch.float32, 2e-4, id="f32")])
@pytest.mark.parametrize("alpha", ATT_ALPHAS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("b,h,hk,lq,lk,e,ev", ATT_SHAPES)
def test_attention_backward_matches_reference(dtype, atol, alpha, mask_kind, b, h, hk, lq, lk, e, ev):
    q, k, v, mask, causal = _att_inputs(b, h, hk, lq, lk, e, ev, mask_kind, dtype)
    grads = []
    for fn in (cpp_attention, reference_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        a = _att_alpha(alpha, h)
        if isinstance(a, torch.Tensor):
            a = a.clone().requires_grad_()
        out = fn(*leaves, attn_mask=mask, is_causal=causal, enable_gqa=hk != h, alpha=a)
        torch.manual_seed(1)
        go = torch.randn_like(out)
        inputs = leaves + ([a] if isinstance(a, torch.Tensor) else [])
        grads.append(torch.autograd.grad(out, inputs, go))
    for name, mine, ref in zip(("dq", "dk", "dv", "dalpha"), *grads):
        assert not torch.isnan(mine).any(), name
        if name == "dalpha":
            continue  # the reference's α gradient is checked against finite differences below
        torch.testing.assert_close(mine, ref, atol=atol * max(1.0, ref.abs().max().item()), rtol=0, msg=name)
    if "bool" in mask_kind:
        assert torch.equal(grads[0][0][:, :, 0], torch.zeros_like(grads[0][0][:, :, 0]))


@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float16, 4e-3, id="f16"),
                                        pytest.param(torch.bfloat16, 3e-2, id="bf16")])
def test_attention_backward_low_precision_vs_reference_float32(dtype, atol):
    """fp16/bf16 are computed in float32 inside: gradients match the float32 reference run on
    the same rounded inputs up to the output rounding of the dtype."""
    q, k, v, mask, causal = _att_inputs(2, 4, 2, 37, 70, 16, 19, "bool+causal", dtype)
    go = torch.randn(2, 4, 37, 19).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mine = torch.autograd.grad(cpp_attention(*leaves, attn_mask=mask, is_causal=causal,
                                                            enable_gqa=True), leaves, go)
    leaves32 = [t.float().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(reference_attention(*leaves32, attn_mask=mask, is_causal=causal, enable_gqa=True),
                              leaves32, go.float())
    for name, a, b in zip(("dq", "dk", "dv"), mine, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, atol=atol * max(1.0, b.abs().max().item()), rtol=0, msg=name)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool"])
def test_attention_gradcheck_all_inputs_per_head_alpha(mask_kind):
    q, k, v, mask, causal = _att_inputs(1, 4, 2, 5, 6, 3, 2, mask_kind, torch.float64)
    a = torch.tensor([1.0, 1.5, 2.0, 1.3], dtype=torch.float64, requires_grad=True)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def fn(q, k, v, a):
        return cpp_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, alpha=a)

    torch.autograd.gradcheck(fn, (*leaves, a), eps=1e-5, atol=1e-6, rtol=1e-4)


def test_attention_alpha_grad_matches_oracle_finite_differences():
    q, k, v, _, _ = _att_inputs(2, 3, 3, 33, 40, 8, 8, "none", torch.float64)
    a = torch.tensor([1.0, 1.5, 0.75], dtype=torch.float64, requires_grad=True)
    out = cpp_attention(q, k, v, is_causal=True, alpha=a)
    go = torch.randn_like(out)
    (dalpha,) = torch.autograd.grad(out, (a,), go)
    eps = 1e-5
    fd = []
    for head in range(3):
        shift = torch.zeros(3, dtype=torch.float64)
        shift[head] = eps
        plus = oracle_attention(q, k, v, is_causal=True, alpha=a.detach() + shift)
        minus = oracle_attention(q, k, v, is_causal=True, alpha=a.detach() - shift)
        fd.append(((plus - minus) / (2 * eps) * go).sum())
    torch.testing.assert_close(dalpha, torch.stack(fd), atol=1e-6, rtol=1e-5)


# General α per head: α = 1 + 1/k (multiplications), 1.3 and 1.7 (vector exp/log or std::),
# α > 2 and α < 1 (dense).
ATT_GENERAL_ALPHAS = [1.25, 1.3, 1.7, 3.0, 0.75, 1.1]


@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float64, 1e-11, id="f64"),
                                        pytest.param(torch.float32, 2e-4, id="f32")])
@pytest.mark.parametrize("mask_kind", ["none", "bool+causal", "float"])
@pytest.mark.parametrize("scale", [pytest.param(0.05, id="flat"), pytest.param(1.0, id="unit"),
                                   pytest.param(8.0, id="peaked")])
def test_attention_backward_general_alpha_matches_reference(kernel_isa, dtype, atol, mask_kind, scale):
    """The backward's p for general α, recomputed from (max, mu) by either kernel set: dense
    and sparse supports, masked entries and a fully masked query; dV = P^T dO checks p itself.
    The reference runs in float64 on the same rounded inputs: in float32 near-uniform rows
    cost it ~1e-2 of dK (the cpp op works in double there)."""
    h = len(ATT_GENERAL_ALPHAS)
    q, k, v, mask, causal = _att_inputs(2, h, h // 2, 70, 300, 16, 9, mask_kind, dtype)
    q = q * scale
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    go = torch.randn(2, h, 70, 9, dtype=dtype)
    alpha = torch.tensor(ATT_GENERAL_ALPHAS, dtype=dtype)
    grads = []
    for fn, run_dtype in ((cpp_attention, dtype), (reference_attention, torch.float64)):
        leaves = [t.to(run_dtype).requires_grad_() for t in (q, k, v, alpha)]
        run_mask = mask.to(run_dtype) if mask is not None and mask.is_floating_point() else mask
        out = fn(*leaves[:3], attn_mask=run_mask, is_causal=causal, enable_gqa=True, alpha=leaves[3])
        grads.append(torch.autograd.grad(out, leaves, go.to(run_dtype)))
    for name, mine, ref in zip(("dq", "dk", "dv", "dalpha"), *grads):
        assert mine.dtype == dtype and not torch.isnan(mine).any(), name
        torch.testing.assert_close(mine.double(), ref, atol=atol * max(1.0, ref.abs().max().item()), rtol=0, msg=name)
    if "bool" in mask_kind:
        assert torch.equal(grads[0][0][:, :, 0], torch.zeros_like(grads[0][0][:, :, 0]))


@pytest.mark.parametrize("alpha", [1.25, 1.3, 1.75, 3.0])
@pytest.mark.parametrize("scale", [pytest.param(0.4, id="flat"), pytest.param(8.0, id="peaked")])
def test_attention_saved_threshold_is_the_root(kernel_isa, alpha, scale):
    """The forward's saved mu of general-α rows lies within the solver's resolution, 4 eps
    max(1, |mu|) (q = 1 + (α-1)(u - mu) carries an absolute rounding), of the root of sum p = 1
    found in 40 digits for the scores the kernel saw: one query, E = 1 and scale 1, so that the
    scores are the keys themselves, each row a random subset of them. Near-uniform rows at α 3
    end the solver's steps up to 11 eps off, and the backward's weights at the support's edge
    amplify that; the saved threshold takes one more Newton step there."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    generator = torch.Generator().manual_seed(3)
    rows, keys = 20, 300
    key = torch.randn(1, 1, keys, 1, generator=generator, dtype=torch.float64) * scale
    query = torch.ones(1, 1, rows, 1, dtype=torch.float64)
    keep = torch.rand(1, 1, rows, keys, generator=generator) < 0.9
    _, saved = cpp_ops.attention_forward(query, key, key.clone(), keep, torch.tensor([alpha], dtype=torch.float64),
                                         scale=1.0, is_causal=False, dropout_p=0.0, enable_gqa=False,
                                         need_grad=GRAD_ALPHA, score_options=ScoreOptions())
    am1 = mpmath.mpf(alpha) - 1
    for i in range(rows):
        z = key[0, 0, :, 0][keep[0, 0, i]]
        u = [mpmath.mpf(float(x)) for x in z - z.max()]
        mu = saved[0][0, 0, i, 1].item()

        def mass_minus_one(m):
            return sum(max(1 + am1 * (x - m), 0) ** (1 / am1) for x in u) - 1

        root = mpmath.findroot(mass_minus_one, (mpmath.mpf(mu) - 1e-9, mpmath.mpf(mu) + 1e-9), solver="anderson")
        assert abs(mpmath.mpf(mu) - root) <= 4 * torch.finfo(torch.float64).eps * max(1.0, abs(mu)), (i, mu, root)


def test_attention_3d_inputs_and_masked_keys_invariance():
    q, k, v = torch.randn(3, 10, 8), torch.randn(3, 12, 8), torch.randn(3, 12, 5)
    keep = torch.ones(12, dtype=torch.bool)
    keep[[1, 4, 11]] = False
    full = cpp_attention(q, k, v, attn_mask=keep, alpha=1.5)
    sliced = cpp_attention(q, k[:, keep], v[:, keep], alpha=1.5)
    assert full.shape == (3, 10, 5)
    torch.testing.assert_close(full, sliced, atol=1e-6, rtol=0)


def test_attention_huge_scores_low_precision_no_nan():
    q = torch.randn(1, 2, 40, 16).to(torch.float16) * 100
    k = torch.randn(1, 2, 40, 16).to(torch.float16) * 100
    v = torch.randn(1, 2, 40, 16).to(torch.float16)
    mask = torch.full((40, 40), -1000.0, dtype=torch.float16).triu(1)
    for alpha in (1.0, 1.5, 2.0, 1.25):
        out = cpp_attention(q, k, v, attn_mask=mask, alpha=alpha)
        assert torch.isfinite(out).all()


# ------------------------------------------------------------------ errors

def test_errors_name_the_argument():
    """The public layer checks the arguments once; a forced C++ backend refuses what it cannot
    run, saying why; the operators themselves check what would corrupt memory."""
    q = torch.randn(1, 2, 4, 8)
    with dispatch.use_backend("cpp"):
        with pytest.raises(dispatch.BackendUnavailableError, match="no dropout"):
            entmax_fast.entmax_attention(q, q, q, dropout_p=0.1)
        with pytest.raises(ValueError, match="enable_gqa"):
            entmax_fast.entmax_attention(q, q[:, :1], q[:, :1])
        with pytest.raises(ValueError, match="attn_mask"):
            entmax_fast.entmax_attention(q, q, q, attn_mask=torch.ones(3, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"alpha must be a float, a 0-d tensor or a tensor of shape \(H,\)"):
            entmax_fast.entmax_attention(q, q, q, alpha=torch.ones(3))
        with pytest.raises(ValueError, match="alpha must be finite and > 0"):
            entmax_fast.entmax_bisect(torch.randn(2, 3), -1.0)
    with pytest.raises(RuntimeError, match="alpha must have shape"):
        torch.ops.entmax_fast.entmax_rowwise_fwd(torch.randn(2, 3), torch.ones(5))


# ------------------------------------------------------------------ torch.library

def test_opcheck_rowwise_ops():
    x = torch.randn(5, 17)
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25, 0.75], requires_grad=True)
    # No autograd on the operators: the public layer's autograd.Function calls forward and backward.
    torch.library.opcheck(torch.ops.entmax_fast.entmax_rowwise_fwd, (x, alpha.detach()))
    p = cpp_ops.entmax_forward(x.detach(), alpha.detach())
    for need in (True, False):
        torch.library.opcheck(torch.ops.entmax_fast.entmax_rowwise_bwd, (p, torch.randn(5, 17), alpha.detach(), need))


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_opcheck_attention_ops(masked):
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 5)
    mask = torch.rand(9, 11) > 0.5 if masked else None
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25], requires_grad=True)
    args = (q, k, v, mask, alpha.detach(), 0.3, not masked)
    torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_fwd, args)
    _, stats, *_ = torch.ops.entmax_fast.entmax_attention_fwd(*(t.detach() if isinstance(t, torch.Tensor) else t
                                                                for t in args))
    torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_bwd,
                          (torch.randn(2, 4, 9, 5), q.detach(), k.detach(), v.detach(), mask, stats, alpha.detach(),
                           0.3, not masked, True))


# ------------------------------------------------------------------ dispatch

def test_public_api_forced_to_cpp_backend():
    x = torch.randn(6, 40, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 20, 8, requires_grad=True) for _ in range(3))
    with dispatch.use_backend("cpp"):
        p = entmax_fast.entmax15(x, dim=-1)
        assert dispatch.last_choice("entmax").backend == "cpp"
        out = entmax_fast.entmax_attention(q, k, v, is_causal=True, alpha=1.5)
        assert dispatch.last_choice("attention").backend == "cpp"
    (p.sum() + out.sum()).backward()
    torch.testing.assert_close(p, reference_forward(x.detach(), 1.5), atol=1e-6, rtol=0)
    torch.testing.assert_close(out, reference_attention(q.detach(), k.detach(), v.detach(), is_causal=True),
                               atol=1e-5, rtol=0)
