"""fusedmax / oscarmax: C++ operators vs the plain-torch reference vs a float64 QP oracle.

The oracle (tests/oracle.py) solves each prox as a bounded least-squares dual by scipy's
BVLS (an active-set method, exact up to rounding), a different algorithm from Condat's / PAV
used by both the C++ operators and the reference.
"""
import math

import numpy as np
import pytest
import torch

import entmax_fast.structured as S
from entmax_fast import dispatch
from entmax_fast.backends.cpp import loader
from entmax_fast.reference import structured as R
from oracle import oracle_oscar_prox, oracle_rows, oracle_sparsemax, oracle_tv_prox

NEG_INF = float("-inf")
HAS_CPP = S.structured_backend(torch.zeros(1))[0] == "cpp"
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="entmax_fast._C structured operators not built")
OPS = torch.ops.entmax_fast

BACKENDS = [pytest.param("cpp", marks=needs_cpp, id="cpp"), pytest.param("reference", id="reference")]
MAPPINGS = [pytest.param("fused", id="fusedmax"), pytest.param("oscar", id="oscarmax")]
# (dtype, atol, rtol) of a backend against the float64 oracle.
DTYPE_TOLS = [
    pytest.param(torch.float64, 1e-9, 1e-9, id="float64"),
    pytest.param(torch.float32, 2e-5, 1e-5, id="float32"),
]


# ---------------------------------------------------------------------------------------
# Helpers.

def mapping(kind: str, backend: str):
    if backend == "reference":
        return R.fusedmax if kind == "fused" else R.oscarmax
    return S.fusedmax if kind == "fused" else S.oscarmax


def prox(kind: str, backend: str, X, reg, lengths=None):
    if backend == "reference":
        return (R.tv1d_prox if kind == "fused" else R.oscar_prox)(X, reg, lengths=lengths)
    return (OPS.tv1d_prox if kind == "fused" else OPS.oscar_prox)(X, reg, lengths)


@pytest.fixture
def force_reference(monkeypatch):
    monkeypatch.setitem(dispatch._AVAILABILITY, "cpp", (False, "forced by test"))


def ragged_scores(rows: int, n: int, dtype, generator_seed: int = 0, scale: float = 1.0):
    """Random scores with a few −inf masks, one fully masked row, and lengths in [0, n]."""
    gen = torch.Generator().manual_seed(generator_seed)
    X = (torch.randn(rows, n, generator=gen, dtype=torch.float64) * scale).to(dtype)
    drop = torch.rand(rows, n, generator=gen) < 0.15
    X = X.masked_fill(drop, NEG_INF)
    X[min(1, rows - 1)] = NEG_INF
    lengths = torch.randint(0, n + 1, (rows,), generator=gen)
    lengths[0] = n
    return X, lengths


# ---------------------------------------------------------------------------------------
# Values from docs/maths.md, "fusedmax and oscarmax".

@pytest.mark.parametrize("backend", BACKENDS)
def test_fusedmax_check_value(backend):
    x = torch.tensor([1.0, 2.1, 1.9], dtype=torch.float64)
    p = mapping("fused", backend)(x, 0.1)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64), atol=1e-12, rtol=0)
    y = prox("fused", backend, x.unsqueeze(0), 0.1)[0]
    torch.testing.assert_close(y, torch.tensor([1.1, 1.95, 1.95], dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_zero_regularisation_is_sparsemax(kind, backend):
    from entmax import sparsemax

    X = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    X_ref = X.detach().clone().requires_grad_()
    p = mapping(kind, backend)(X, 0.0)
    expected = sparsemax(X_ref, dim=-1)
    torch.testing.assert_close(p, expected, atol=1e-12, rtol=0)
    grad = torch.randn_like(p)
    p.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(X.grad, X_ref.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_large_regularisation_is_uniform_over_valid(kind, backend):
    X, lengths = ragged_scores(5, 9, torch.float64)
    p = mapping(kind, backend)(X, 1e4, lengths=lengths)
    valid = torch.isfinite(X) & (torch.arange(9) < lengths.unsqueeze(-1))
    count = valid.sum(-1, keepdim=True).double()
    expected = torch.where(valid, 1.0 / count.clamp_min(1), torch.zeros_like(X))
    torch.testing.assert_close(p, expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------
# Against the oracle.

def test_oracle_is_sound():
    # Hand-solved cases: the fused lasso prox of test_fusedmax_check_value; OSCAR z = [3, 1],
    # beta = 1: v = |z| − w = [2, 1] is already non-increasing, y = [2, 1]; z = [3, −1],
    # beta = 2: v = [1, 1] pools to 1.
    np.testing.assert_allclose(oracle_tv_prox(np.array([1.0, 2.1, 1.9]), 0.1), [1.1, 1.95, 1.95], atol=1e-12)
    np.testing.assert_allclose(oracle_oscar_prox(np.array([3.0, 1.0]), 1.0), [2.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(oracle_oscar_prox(np.array([3.0, -1.0]), 2.0), [1.0, -1.0], atol=1e-12)
    np.testing.assert_allclose(oracle_sparsemax(np.array([1.1, 1.95, 1.95])), [0.0, 0.5, 0.5], atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 7, 33])
@pytest.mark.parametrize("lam", [0.03, 0.3, 1.5])
def test_tv_prox_matches_oracle(backend, n, lam):
    X = torch.randn(4, n, dtype=torch.float64) * 2
    y = prox("fused", backend, X, lam)
    _, expected = oracle_rows(X, lam, "fused")
    torch.testing.assert_close(y, expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 5, 7])
@pytest.mark.parametrize("beta", [0.05, 0.3, 2.0])
def test_oscar_prox_matches_oracle(backend, n, beta):
    X = torch.randn(4, n, dtype=torch.float64) * 2
    y = prox("oscar", backend, X, beta)
    _, expected = oracle_rows(X, beta, "oscar")
    torch.testing.assert_close(y, expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,reg,n", [
    pytest.param("fused", 0.1, 23, id="fused-0.1"),
    pytest.param("fused", 0.7, 40, id="fused-0.7"),
    pytest.param("oscar", 0.05, 7, id="oscar-0.05"),
    pytest.param("oscar", 0.4, 6, id="oscar-0.4"),
])
def test_mapping_matches_oracle_on_ragged_rows(kind, reg, n, backend, dtype, atol, rtol):
    X, lengths = ragged_scores(7, n, dtype, scale=2.0)
    p = mapping(kind, backend)(X, reg, lengths=lengths)
    expected, _ = oracle_rows(X, reg, kind, lengths)
    assert p.dtype == dtype
    torch.testing.assert_close(p.double(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------
# C++ vs reference (forward, prox and backward).

@needs_cpp
@pytest.mark.parametrize("dtype,atol,rtol", [
    pytest.param(torch.float64, 1e-12, 1e-12, id="float64"),
    pytest.param(torch.float32, 2e-6, 1e-5, id="float32"),
])
@pytest.mark.parametrize("kind,reg", [("fused", 0.05), ("fused", 0.5), ("oscar", 0.02), ("oscar", 0.2)])
@pytest.mark.parametrize("n", [1, 63, 129])
def test_cpp_matches_reference_forward_backward(kind, reg, n, dtype, atol, rtol):
    X, lengths = ragged_scores(9, n, dtype, generator_seed=n, scale=3.0)
    X_cpp = X.clone().requires_grad_()
    X_ref = X.clone().requires_grad_()
    p_cpp = mapping(kind, "cpp")(X_cpp, reg, lengths=lengths)
    p_ref = mapping(kind, "reference")(X_ref, reg, lengths=lengths)
    torch.testing.assert_close(p_cpp, p_ref, atol=atol, rtol=rtol)
    grad = torch.randn(X.shape, dtype=dtype)
    p_cpp.backward(grad)
    p_ref.backward(grad)
    torch.testing.assert_close(X_cpp.grad, X_ref.grad, atol=10 * atol, rtol=10 * rtol)
    assert torch.isfinite(X_cpp.grad).all()
    assert (X_cpp.grad[1] == 0).all()  # the fully masked row


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,reg", [("fused", 0.2), ("oscar", 0.1)])
def test_gradcheck_float64(kind, reg, backend):
    gen = torch.Generator().manual_seed(3)
    X = (torch.randn(3, 8, generator=gen, dtype=torch.float64) * 3)
    X[2, 4] = NEG_INF
    lengths = torch.tensor([8, 5, 8])
    X.requires_grad_()
    fn = mapping(kind, backend)
    assert torch.autograd.gradcheck(lambda x: fn(x, reg, lengths=lengths), (X,), eps=1e-7, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_masked_columns_equal_slicing(kind, backend):
    # A −inf column is sliced away: the fused chain links its two valid neighbours.
    X = torch.randn(4, 10, dtype=torch.float64) * 2
    keep = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    X_masked = X.masked_fill(~keep, NEG_INF).requires_grad_()
    X_sliced = X[:, keep].clone().requires_grad_()
    fn = mapping(kind, backend)
    p_masked = fn(X_masked, 0.3)
    p_sliced = fn(X_sliced, 0.3)
    torch.testing.assert_close(p_masked[:, keep], p_sliced, atol=1e-12, rtol=0)
    assert (p_masked[:, ~keep] == 0).all()
    grad = torch.randn(4, 10, dtype=torch.float64)
    p_masked.backward(grad)
    p_sliced.backward(grad[:, keep])
    torch.testing.assert_close(X_masked.grad[:, keep], X_sliced.grad, atol=1e-12, rtol=0)
    assert (X_masked.grad[:, ~keep] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_lengths_equal_trailing_masks_and_empty_rows(kind, backend):
    X = torch.randn(3, 6, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 0], dtype=torch.int32)
    X_len = X.clone().requires_grad_()
    X_inf = X.masked_fill(torch.arange(6) >= lengths.unsqueeze(-1), NEG_INF).requires_grad_()
    fn = mapping(kind, backend)
    p_len = fn(X_len, 0.3, lengths=lengths)
    p_inf = fn(X_inf, 0.3)
    torch.testing.assert_close(p_len, p_inf, atol=1e-12, rtol=0)
    assert (p_len[2] == 0).all() and (p_len[1, 2:] == 0).all()
    grad = torch.randn(3, 6, dtype=torch.float64)
    p_len.backward(grad)
    p_inf.backward(grad)
    torch.testing.assert_close(X_len.grad, X_inf.grad, atol=1e-12, rtol=0)
    assert (X_len.grad[2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_dim_argument(kind, backend):
    X = torch.randn(5, 3, 4, dtype=torch.float64)
    lengths = torch.tensor([[5, 3, 1, 0]] * 3)
    fn = mapping(kind, backend)
    p = fn(X, 0.2, dim=0, lengths=lengths.T.contiguous().T)
    expected = fn(X.movedim(0, -1), 0.2, dim=-1, lengths=lengths).movedim(-1, 0)
    torch.testing.assert_close(p, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", MAPPINGS)
def test_half_precision_computed_in_float32(kind, dtype, backend):
    X = (torch.randn(4, 12) * 3).to(dtype)
    X[0, 0] = -1000.0
    X[1] = X[1] + 1000.0
    p = mapping(kind, backend)(X, 0.1)
    assert p.dtype == dtype and torch.isfinite(p).all()
    expected = mapping(kind, backend)(X.float(), 0.1).to(dtype)
    torch.testing.assert_close(p, expected, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------
# torch.library registration.

@needs_cpp
@pytest.mark.parametrize("name", ["fusedmax", "oscarmax"])
def test_opcheck(name):
    X, lengths = ragged_scores(4, 13, torch.float64, scale=2.0)
    forward = getattr(OPS, f"{name}_forward")
    backward = getattr(OPS, f"{name}_backward")
    # The operators carry no autograd: the public layer's StructuredFunction calls both.
    torch.library.opcheck(forward, (X.clone(), 0.3, lengths))
    torch.library.opcheck(forward, (X.clone(), 0.3, None))
    p, y = forward(X, 0.3, lengths)
    torch.library.opcheck(backward, (torch.randn_like(p), p, y, 0.3))


@needs_cpp
def test_torch_compile_sees_the_op():
    X = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda x: S.fusedmax(x, 0.2) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(X), S.fusedmax(X, 0.2) * 2)


# ---------------------------------------------------------------------------------------
# Backend choice.

@needs_cpp
def test_backend_choice_cpp_on_cpu():
    X = torch.randn(2, 5)
    assert S.structured_backend(X)[0] == "cpp"
    S.fusedmax(X, 0.1)
    assert S.last_backend("fusedmax")[0] == "cpp"


def test_backend_falls_back_to_reference(force_reference):
    X = torch.randn(2, 5, dtype=torch.float64)
    backend, reason = S.structured_backend(X)
    assert backend == "reference" and "forced by test" in reason
    p = S.oscarmax(X, 0.1)
    backend, reason = S.last_backend("oscarmax")
    assert backend == "reference" and "cpp: forced by test" in reason
    torch.testing.assert_close(p, R.oscarmax(X, 0.1), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------
# Bad input.

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,reg_name", [("fused", "lam"), ("oscar", "beta")])
def test_bad_input_errors(kind, reg_name, backend):
    fn = mapping(kind, backend)
    X = torch.randn(2, 4)
    with pytest.raises(ValueError, match=f"{reg_name} must be finite and >= 0, got -0.1"):
        fn(X, -0.1)
    with pytest.raises(ValueError, match=reg_name):
        fn(X, float("nan"))
    with pytest.raises(TypeError, match=reg_name):
        fn(X, torch.tensor(0.1))
    with pytest.raises(ValueError, match=r"lengths must have shape \(2,\) .* got \(2, 1\)"):
        fn(X, 0.1, lengths=torch.tensor([[1], [2]]))
    # One type on every backend: the C++ operators' own check (a RuntimeError) is not reached.
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\] \(the size of dim -1\), got values in \[1, 5\]"):
        fn(X, 0.1, lengths=torch.tensor([1, 5]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\] \(the size of dim -1\), got values in \[-1, 2\]"):
        fn(X, 0.1, lengths=torch.tensor([2, -1], dtype=torch.int32))
    with pytest.raises(IndexError, match=r"dim must be in \[-2, 1\]"):
        fn(X, 0.1, dim=2)
    with pytest.raises(TypeError, match="dim must be an int, got float"):
        fn(X, 0.1, dim=1.0)
    with pytest.raises(TypeError, match="lengths must have an integer dtype"):
        fn(X, 0.1, lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="X must have a floating dtype"):
        fn(torch.ones(2, 4, dtype=torch.int64), 0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_posinf_gives_a_nan_row_like_softmax(kind, bad, backend):
    # torch.softmax's rule: a row holding NaN or +inf gives NaN weights (and gradient);
    # other rows, -inf entries and a NaN beyond the row's length are unaffected.
    X = torch.randn(4, 6, dtype=torch.float64) * 2
    X[0, 2] = bad
    X[1, 1] = NEG_INF
    X[2, 5] = bad  # beyond lengths[2] = 5: not a valid position
    X[3] = NEG_INF
    lengths = torch.tensor([6, 6, 5, 6])
    softmax = torch.softmax(X, -1)
    assert torch.isnan(softmax[0]).all() and torch.isnan(softmax[3]).all()  # the rule (and softmax's all -inf row)
    X_grad = X.clone().requires_grad_()
    p = mapping(kind, backend)(X_grad, 0.2, lengths=lengths)
    assert torch.isnan(p[0]).all()
    clean = mapping(kind, "reference")(X[1:3].masked_fill(torch.arange(6) >= lengths[1:3, None], NEG_INF), 0.2)
    torch.testing.assert_close(p[1:3], clean, atol=1e-12, rtol=0)
    assert (p[1, 1] == 0) and (p[3] == 0).all()
    p.backward(torch.randn(4, 6, dtype=torch.float64))
    assert torch.isnan(X_grad.grad[0]).all() and torch.isfinite(X_grad.grad[1:]).all()
    y = prox(kind, backend, X, 0.2, lengths=lengths)
    assert torch.isnan(y[0]).all() and not torch.isnan(y[1:]).any()


# ---------------------------------------------------------------------------------------
# Large scores: finite inputs give finite weights in fp32 and fp64.

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [3e7, 1e18, 1e30, 3e38])
def test_large_scores_give_the_limit_weights(kind, scale, dtype, backend):
    # At |x| >> reg the prox is x up to O(reg) and sparsemax puts all mass on the maximum;
    # today's code gave +inf (cpp, 3e7), NaN (cpp oscarmax, 3e38) or zeros (reference, 1e18).
    X = torch.tensor([[1.0, -1.0, 0.5, 0.0], [-0.25, 0.75, -1.0, 0.5]], dtype=dtype) * scale
    p = mapping(kind, backend)(X, 0.3)
    expected = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]], dtype=dtype)
    torch.testing.assert_close(p, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
@pytest.mark.parametrize("dtype,exponent", [(torch.float32, 127), (torch.float32, -120), (torch.float64, 1023)])
def test_prox_is_homogeneous_up_to_the_float_maximum(kind, dtype, exponent, backend):
    # prox(2^k x; 2^k reg) = 2^k prox(x; reg), exactly in exact arithmetic. At 2^127 (fp32) and
    # 2^1023 (fp64) |x| reaches ~0.95 of the float maximum: the TV scan's differences and
    # PAV's pooled sums overflowed before the rows were scaled.
    gen = torch.Generator().manual_seed(5)
    X = (torch.rand(3, 9, generator=gen, dtype=torch.float64) * 0.2 + 1.7) * torch.tensor([1.0, -1.0] * 4 + [1.0])
    X = X.to(dtype)
    X[1, 3] = NEG_INF
    c = 2.0 ** exponent
    y = prox(kind, backend, X * c, 0.3 * c)
    expected = prox(kind, backend, X, 0.3)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y / c, expected, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0)
    p = mapping(kind, backend)(X * c, c)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=dtype), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [1e4, 1e9, 1e12])
def test_fusedmax_is_shift_invariant_at_large_offsets(offset, backend):
    # prox_TV commutes with shifts and sparsemax ignores them: fusedmax(x + c) = fusedmax(x).
    # The shift by the row max keeps float64 accurate; unshifted, the cpp op was off by 2e-7
    # at 1e9 and 9e-5 at 1e12 (the scan and the threshold's sums ran at the offset's scale).
    shifted = torch.randn(5, 17, dtype=torch.float64) + offset
    unshifted = shifted - offset  # exact (Sterbenz), so both see the same scores
    p = mapping("fused", backend)(shifted, 0.2)
    torch.testing.assert_close(p, mapping("fused", backend)(unshifted, 0.2), atol=1e-9, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
def test_huge_regularisation_on_tiny_scores(kind, backend):
    # reg / max|x| overflows float32 (1e30 / 1e-30): capped in the row's work units where a
    # larger value changes nothing, so the limit (uniform weights) comes out, not NaN.
    X = torch.tensor([[1e-30, -2e-30, 3e-30, 0.0]], dtype=torch.float32)
    p = mapping(kind, backend)(X, 1e30)
    torch.testing.assert_close(p, torch.full((1, 4), 0.25), atol=1e-6, rtol=0)


@needs_cpp
def test_cpp_op_argument_errors():
    with pytest.raises(RuntimeError, match="lam must be finite and >= 0"):
        OPS.fusedmax_forward(torch.randn(2, 3), -1.0, None)
    with pytest.raises(RuntimeError, match=r"lengths must have shape \[2\]"):
        OPS.oscarmax_forward(torch.randn(2, 3), 0.1, torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="X must be float32 or float64"):
        OPS.fusedmax_forward(torch.randn(2, 3).half(), 0.1, None)
    with pytest.raises(RuntimeError, match="same shape"):
        OPS.fusedmax_backward(torch.randn(2, 3), torch.rand(2, 3), torch.rand(2, 4), 0.1)


# ---------------------------------------------------------------------------------------
# Attention forms and modules.

def dense_attention(kind, q, k, v, reg, mask=None, is_causal=False, scale=None):
    """Unchunked attention with the reference mapping (a check of the chunking and masks)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else scores + mask
    if is_causal:
        scores = scores.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1), NEG_INF)
    return mapping(kind, "reference")(scores, reg) @ v


def _matches_dense(kind, q, k, v, mask, is_causal, dense_mask=None):
    """The structured attention of ``kind`` against :func:`dense_attention` (given the mask
    as ``dense_mask`` when it is written out there), output and gradients; returns the output."""
    attention = S.fusedmax_attention if kind == "fused" else S.oscarmax_attention
    reg_kw = {"lam": 0.3} if kind == "fused" else {"beta": 0.05}
    out = attention(q, k, v, attn_mask=mask, is_causal=is_causal, **reg_kw)
    if dense_mask is None:
        expected = dense_attention(kind, q, k, v, next(iter(reg_kw.values())), mask, is_causal)
    else:
        expected = dense_attention(kind, q, k, v, next(iter(reg_kw.values())), dense_mask)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
@pytest.mark.parametrize("masking", ["none", "bool", "float", "causal"])
def test_attention_matches_dense(kind, masking, backend, request):
    if backend == "reference":
        request.getfixturevalue("force_reference")
    q = torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    mask = None
    if masking == "bool":
        mask = torch.rand(5, 7) > 0.3
        mask[2] = False  # a fully masked query row
    elif masking == "float":
        mask = torch.randn(2, 1, 5, 7, dtype=torch.float64)
    out = _matches_dense(kind, q, k, v, mask, masking == "causal")
    if masking == "bool":
        assert (out[:, :, 2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
@pytest.mark.parametrize("masking", ["bool", "float"])
def test_attention_mask_and_causal_together(kind, masking, backend, request):
    # As entmax_attention and SDPA: a key is attended when the mask and the causal rule both
    # allow it (a float mask is added, then the causal keys are -inf).
    if backend == "reference":
        request.getfixturevalue("force_reference")
    q = torch.randn(2, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    if masking == "bool":
        mask = torch.rand(2, 1, 6, 5) > 0.3
        mask[0, 0, 3] = False  # a query row the mask empties
        mask[1, 0, 2, :3] = False  # a row whose causal keys the mask all removes
    else:
        mask = torch.randn(1, 2, 6, 5, dtype=torch.float64)
    causal = torch.ones(6, 5, dtype=torch.bool).tril()
    explicit = mask & causal if masking == "bool" else mask.masked_fill(~causal, NEG_INF)
    out = _matches_dense(kind, q, k, v, mask, True, dense_mask=explicit)
    if masking == "bool":
        assert (out[0, :, 3] == 0).all() and (out[1, :, 2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MAPPINGS)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_attention_gqa_equals_repeated_heads(kind, kv_heads, backend, request):
    # enable_gqa as in entmax_attention: key/value head g serves query heads
    # g·H/Hkv ... (g+1)·H/Hkv − 1; the gradients of a shared head add up over its group.
    if backend == "reference":
        request.getfixturevalue("force_reference")
    attention = S.fusedmax_attention if kind == "fused" else S.oscarmax_attention
    reg_kw = {"lam": 0.2} if kind == "fused" else {"beta": 0.05}
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, 6, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 6) > 0.3
    out = attention(q, k, v, attn_mask=mask, enable_gqa=True, **reg_kw)
    group = 4 // kv_heads
    expected = attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, **reg_kw)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    dense = dense_attention(kind, q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                            next(iter(reg_kw.values())), mask)
    torch.testing.assert_close(out, dense, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(dense.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    if kv_heads == 1:
        # One key/value head broadcasts over the query heads without enable_gqa, as in SDPA.
        torch.testing.assert_close(attention(q, k, v, attn_mask=mask, **reg_kw), dense, atol=1e-12, rtol=0)
    else:
        with pytest.raises(ValueError, match="key/value have 2 heads but query has 4; pass enable_gqa=True"):
            attention(q, k, v, attn_mask=mask, **reg_kw)


@pytest.mark.parametrize("kind", MAPPINGS)
def test_attention_empty_head_dim_scores_every_key_alike(kind):
    # E = 0: the empty dot product scores every key 0, as entmax_attention has it (the
    # default scale 1/sqrt(E) is then 1, not a division by zero).
    attention = S.fusedmax_attention if kind == "fused" else S.oscarmax_attention
    q, k = torch.randn(1, 2, 3, 0, dtype=torch.float64), torch.randn(1, 2, 4, 0, dtype=torch.float64)
    v = torch.randn(1, 2, 4, 5, dtype=torch.float64)
    out = attention(q, k, v, is_causal=True)
    counts = torch.arange(1, 4, dtype=torch.float64).view(3, 1)
    expected = v.cumsum(-2)[..., :3, :] / counts
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_attention_chunks_gqa_and_dropout():
    q = torch.randn(1, 4, 9, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 6, 5, dtype=torch.float64)
    whole = R.structured_attention(lambda s: S.fusedmax(s, 0.2), q, k, v, enable_gqa=True)
    chunked = R.structured_attention(lambda s: S.fusedmax(s, 0.2), q, k, v, enable_gqa=True, chunk_elements=13)
    torch.testing.assert_close(chunked, whole, atol=1e-12, rtol=0)
    expected = dense_attention("fused", q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 0.2)
    torch.testing.assert_close(S.fusedmax_attention(q, k, v, enable_gqa=True, lam=0.2), expected, atol=1e-12, rtol=0)
    dropped = S.oscarmax_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), dropout_p=0.5, beta=0.1)
    assert dropped.shape == (1, 4, 9, 5) and torch.isfinite(dropped).all()
    with pytest.raises(ValueError, match="lam must be finite and >= 0"):
        S.fusedmax_attention(q, k, v, enable_gqa=True, lam=-1.0)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be divisible by key/value heads \(3\)"):
        S.fusedmax_attention(q, torch.randn(1, 3, 6, 8, dtype=torch.float64),
                             torch.randn(1, 3, 6, 5, dtype=torch.float64), enable_gqa=True)


def test_modules():
    X = torch.randn(3, 6, 5)
    lengths = torch.tensor([[6, 3, 0, 1, 2]] * 3)
    torch.testing.assert_close(S.Fusedmax(0.3, dim=1)(X, lengths), S.fusedmax(X, 0.3, dim=1, lengths=lengths))
    torch.testing.assert_close(S.Oscarmax(0.1)(X), S.oscarmax(X, 0.1))
    assert "lam=0.3" in repr(S.Fusedmax(0.3))
    with pytest.raises(ValueError, match="beta must be finite and >= 0"):
        S.Oscarmax(-2.0)


# ---------------------------------------------------------------------------------------
# The CUDA operators on a GPU (skipped without one) against the float64 reference.

HAS_CUDA_OPS = HAS_CPP and torch.cuda.is_available() and "cuda" in loader.structured_devices()
needs_cuda_ops = pytest.mark.skipif(not HAS_CUDA_OPS, reason="no GPU, or entmax_fast._C built without CUDA")


@needs_cuda_ops
@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float64, 1e-10, id="float64"),
                                        pytest.param(torch.float32, 2e-5, id="float32")])
@pytest.mark.parametrize("kind,reg", [("fused", 0.0), ("fused", 0.1), ("fused", 3.0), ("oscar", 0.0), ("oscar", 1e-3)])
@pytest.mark.parametrize("n", [1, 33, 1000, 70000])
def test_cuda_ops_match_float64_reference(kind, reg, n, dtype, atol):
    # fused 3.0: the TV scan's chunks mostly fail to meet, later rounds (block_tv_prox).
    rows = 3 if n == 70000 else 6
    # oscarmax: scores shrunk so that beta (n - i) leaves a support on the long rows.
    X, lengths = ragged_scores(rows, n, dtype, generator_seed=n, scale=3.0 if kind == "fused" else 3.0 / max(1, n // 100))
    check_cuda_against_reference(kind, X, reg, lengths, atol)
    y = prox(kind, "cpp", X.cuda(), reg, lengths.cuda())
    torch.testing.assert_close(y.double().cpu(), prox(kind, "reference", X.double(), reg, lengths=lengths),
                               atol=atol, rtol=10 * atol)


def check_cuda_against_reference(kind, X, reg, lengths, atol):
    """The CUDA op's weights and gradient against the float64 reference's."""
    grad = torch.randn(X.shape, dtype=torch.float64)
    X_cuda = X.cuda().requires_grad_()
    p = mapping(kind, "cpp")(X_cuda, reg, lengths=lengths.cuda())
    assert S.last_backend("fusedmax" if kind == "fused" else "oscarmax")[0] == "cpp"
    p.backward(grad.to(X.dtype).cuda())
    X_ref = X.double().requires_grad_()
    p_ref = mapping(kind, "reference")(X_ref, reg, lengths=lengths)
    p_ref.backward(grad)
    torch.testing.assert_close(p.double().cpu(), p_ref.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(X_cuda.grad.double().cpu(), X_ref.grad, atol=20 * atol, rtol=0)


def prefix_rows(dtype, n: int = 200):
    """Rows valid on a prefix (trailing -inf, lengths, both, none, an empty row) and one row
    with an interior mask."""
    X = torch.randn(6, n, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(dtype)
    for i, valid in enumerate((n, n - 30, 1, 0, n - 80)):
        X[i, valid:] = float("-inf")
    X[5, n // 3] = float("-inf")
    lengths = torch.tensor([n, n - 50, n, n, n - 110, n])
    return X, lengths


@needs_cuda_ops
@pytest.mark.parametrize("dtype,atol", [pytest.param(torch.float64, 1e-10, id="float64"),
                                        pytest.param(torch.float32, 2e-5, id="float32")])
@pytest.mark.parametrize("kind,reg", [("fused", 0.3), ("oscar", 0.01)])
def test_cuda_ops_rows_valid_on_a_prefix(kind, reg, dtype, atol):
    X, lengths = prefix_rows(dtype)
    check_cuda_against_reference(kind, X, reg, lengths, atol)


@needs_cuda_ops
@pytest.mark.parametrize("kind", MAPPINGS)
def test_cuda_ops_nan_rows_large_scores_and_clamped_lengths(kind):
    X = torch.tensor([[1.0, -1.0, 0.5, 0.0], [-0.25, 0.75, -1.0, 0.5], [1.0, float("nan"), 0.0, 2.0]]).cuda()
    X[:2] *= 3e38
    p = mapping(kind, "cpp")(X, 0.3)
    torch.testing.assert_close(p[:2].cpu(), torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]), atol=1e-6, rtol=0)
    assert torch.isnan(p[2]).all()
    forward = OPS.fusedmax_forward if kind == "fused" else OPS.oscarmax_forward
    p, _ = forward(torch.randn(2, 5, dtype=torch.float64).cuda(), 0.2, torch.tensor([-3, 9]).cuda())
    assert (p[0] == 0).all()
    torch.testing.assert_close(p[1].sum().cpu(), torch.tensor(1.0, dtype=torch.float64))


# ---------------------------------------------------------------------------------------
# The CUDA kernels, run on the host: csrc/cuda/structured.cu compiled by g++ with the CUDA
# built-ins it uses defined by the harness below (ENTMAX_FAST_HOST_EMULATION): each block's
# threads are contexts (ucontext) on one host thread, each run until it waits at a barrier or
# returns, __syncthreads a barrier, the warp intrinsics exchanges through memory with a warp
# barrier; blocks run one after another. A synchronisation that not every thread reaches
# aborts (a hang on the GPU). Shared memory and scratch start filled with NaN
# bytes, so a read of an unwritten entry shows. This runs the device code itself: the
# launch plan (threads by length, shared or global row arrays, the grid-stride loop), the
# ballot compaction, the bitonic sort, the block reductions and segmented scans, and the
# shared algorithms of csrc/common/structured_algos.h.

EMULATION_HARNESS = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
using std::max;
using std::min;

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(threads)

struct EmulatedIndex { unsigned x = 0, y = 0, z = 0; };
static EmulatedIndex blockIdx, blockDim, gridDim;
// The running thread's index, set before the scheduler resumes it. External linkage, so that
// the compiler reloads it after a switch (an external call).
EmulatedIndex threadIdx;

// A thread of the block: a context with its own stack, below a guard page.
struct Fiber {
  ucontext_t context;
  bool done = false;
};
constexpr size_t kFiberStackBytes = 256 * 1024, kGuardBytes = 4096;
static std::vector<Fiber> fibers;
static std::vector<char*> fiber_stacks;
static ucontext_t scheduler_context;
static const std::function<void()>* fiber_body = nullptr;
static int running_fiber = -1;
static long progress = 0;  // barrier arrivals and finished threads

inline void yield_to_scheduler() { swapcontext(&fibers[running_fiber].context, &scheduler_context); }

class Barrier {
 public:
  void reset(int count) { count_ = count; waiting_ = 0; }
  void wait() {
    ++progress;
    const long generation = generation_;
    if (++waiting_ == count_) {
      waiting_ = 0;
      ++generation_;
      return;
    }
    while (generation_ == generation) yield_to_scheduler();
  }
 private:
  int count_ = 0, waiting_ = 0;
  long generation_ = 0;
};

static Barrier block_barrier;
static Barrier warp_barrier[32];
static uint64_t warp_slots[32][32];
static std::vector<unsigned char> shared_buffer;

inline void __syncthreads() { block_barrier.wait(); }
inline int emulated_lane() { return static_cast<int>(threadIdx.x) & 31; }
inline int emulated_warp() { return static_cast<int>(threadIdx.x) >> 5; }

template <typename U>
U warp_exchange(U value, int source_lane) {
  static_assert(sizeof(U) <= sizeof(uint64_t), "a shuffle moves at most 64 bits (shuffle a struct field by field)");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(U));
  warp_slots[emulated_warp()][emulated_lane()] = bits;
  warp_barrier[emulated_warp()].wait();
  const uint64_t received = warp_slots[emulated_warp()][source_lane];
  warp_barrier[emulated_warp()].wait();
  U out;
  std::memcpy(&out, &received, sizeof(U));
  return out;
}
template <typename U>
U __shfl_xor_sync(unsigned, U value, int offset) { return warp_exchange(value, emulated_lane() ^ offset); }
template <typename U>
U __shfl_up_sync(unsigned, U value, int delta) {
  return warp_exchange(value, emulated_lane() >= delta ? emulated_lane() - delta : emulated_lane());
}
inline unsigned __ballot_sync(unsigned, bool flag) {
  unsigned ballot = 0;
  for (int lane = 0; lane < 32; ++lane)
    if (warp_exchange<int>(flag ? 1 : 0, lane)) ballot |= 1u << lane;
  return ballot;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline void __syncwarp(unsigned = 0xffffffffu) { warp_barrier[emulated_warp()].wait(); }

#define ENTMAX_FAST_HOST_EMULATION
#include "structured.cu"

namespace entmax_fast {
namespace structured_cuda {
unsigned char* dynamic_shared_memory() { return shared_buffer.data(); }
}  // namespace structured_cuda
}  // namespace entmax_fast

using namespace entmax_fast::structured_cuda;
using entmax_fast::structured::Prox;

static void fiber_entry() {
  (*fiber_body)();
  fibers[running_fiber].done = true;
  ++progress;
}

// Runs the block's threads round-robin on this host thread until every one has returned; a
// round in which no thread arrived at a barrier or returned while some still wait is a
// synchronisation that not every thread reaches (a hang on the GPU): it aborts.
template <typename Kernel>
void run_grid(const LaunchPlan& plan, Kernel kernel) {
  shared_buffer.assign(plan.shared_bytes + 16, 0xff);
  blockDim.x = plan.threads;
  gridDim.x = static_cast<unsigned>(plan.blocks);
  block_barrier.reset(plan.threads);
  for (int w = 0; w < plan.threads / 32; ++w) warp_barrier[w].reset(32);
  while (static_cast<int>(fiber_stacks.size()) < plan.threads) {
    void* memory = mmap(nullptr, kFiberStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (memory == MAP_FAILED || mprotect(memory, kGuardBytes, PROT_NONE) != 0) {
      std::fprintf(stderr, "emulated CUDA: no memory for a thread's stack\n");
      std::abort();
    }
    fiber_stacks.push_back(static_cast<char*>(memory));
  }
  const std::function<void()> body = [&kernel] { kernel(); };
  fiber_body = &body;
  fibers.assign(plan.threads, Fiber{});
  for (int64_t block = 0; block < plan.blocks; ++block) {
    blockIdx.x = static_cast<unsigned>(block);
    for (int t = 0; t < plan.threads; ++t) {
      Fiber& fiber = fibers[t];
      fiber.done = false;
      getcontext(&fiber.context);
      fiber.context.uc_stack.ss_sp = fiber_stacks[t] + kGuardBytes;
      fiber.context.uc_stack.ss_size = kFiberStackBytes;
      fiber.context.uc_link = &scheduler_context;
      makecontext(&fiber.context, fiber_entry, 0);
    }
    for (int live = plan.threads; live > 0;) {
      const long before = progress;
      for (int t = 0; t < plan.threads; ++t) {
        if (fibers[t].done) continue;
        running_fiber = t;
        threadIdx.x = static_cast<unsigned>(t);
        swapcontext(&scheduler_context, &fibers[t].context);
        live -= fibers[t].done;
      }
      if (live > 0 && progress == before) {
        std::fprintf(stderr, "emulated CUDA: threads wait at a synchronisation that not every thread reaches\n");
        std::abort();
      }
    }
  }
}

template <typename T>
void forward(int kind, int project, const T* x, const int64_t* lengths, T* p, T* y, int64_t rows, int64_t n,
             double reg, int64_t shared_limit, int sm_count) {
  if (rows == 0 || n == 0) return;
  const LaunchPlan plan = plan_launch<T>(false, Prox(kind), true, rows, n, sm_count, shared_limit);
  std::vector<unsigned char> scratch(plan.scratch_bytes, 0xff);
  const ForwardParams<T> params{x, lengths, project ? p : nullptr, y, rows, static_cast<int>(n), reg, Prox(kind),
                                plan.rows_in_shared, scratch.data(), plan.row_bytes};
  run_grid(plan, [&params] { forward_kernel<T>(params); });
}

template <typename T>
void backward(int kind, int grouped, const T* g, const T* p, const T* y, T* dz, int64_t rows, int64_t n,
              int64_t shared_limit, int sm_count) {
  if (rows == 0 || n == 0) return;
  const LaunchPlan plan = plan_launch<T>(true, Prox(kind), grouped != 0, rows, n, sm_count, shared_limit);
  std::vector<unsigned char> scratch(plan.scratch_bytes, 0xff);
  const BackwardParams<T> params{g, p, y, dz, rows, static_cast<int>(n), Prox(kind), grouped != 0,
                                 plan.rows_in_shared, scratch.data(), plan.row_bytes};
  run_grid(plan, [&params] { backward_kernel<T>(params); });
}

// One block of `threads` running body(slots), its reduction slots in shared memory.
template <typename T, typename Body>
void run_block(int threads, Body body) {
  Carver count{nullptr, 0};
  carve_reductions<T>(count);
  run_grid(LaunchPlan{threads, true, 0, count.size(), 1, 0}, [&] {
    Carver shared{dynamic_shared_memory(), 0};
    body(carve_reductions<T>(shared));
  });
}

// block_tv_prox alone, on a row of m entries.
template <typename T>
void tv_prox_block(const T* in, T* out, int m, double lambda, int threads) {
  std::vector<uint8_t> restart(m, 0xff);
  entmax_fast::structured::TvScan<T, int> carried;
  run_block<T>(threads, [&](const Reductions<T>& slots) {
    block_tv_prox(in, out, restart.data(), &carried, m, static_cast<T>(lambda), slots);
  });
}

// block_oscar_pav alone, on m magnitudes sorted decreasingly, replaced by the levels.
template <typename T>
void oscar_pav_block(T* magnitude, int m, double beta, int threads) {
  std::vector<T> sum(m);
  std::vector<int> len(m), first(m);
  const entmax_fast::structured::PavBlocks<T, int> blocks{sum.data(), len.data(), first.data()};
  run_block<T>(threads, [&](const Reductions<T>& slots) {
    block_oscar_pav(
        m, static_cast<T>(beta), blocks, [&](int rank) { return magnitude[rank]; },
        [&](int rank, T level) { magnitude[rank] = level; }, slots.i);
  });
}

// block_sort_by_magnitude alone: count values on `threads` threads; the keys and indices of
// ranks [0, count) as the backward gets them (whole entries, in place) and the indices as the
// forward gets them (SortedIndices, beside the exchange). The buffers start filled with 0xff.
template <typename T>
void sort_by_magnitude(const T* values, int count, int threads, uint64_t* keys, int* indices, int* order) {
  const int padded = next_pow2(count);
  std::vector<SortEntry<T>> sorted(padded), exchange(padded);
  std::memset(static_cast<void*>(sorted.data()), 0xff, sorted.size() * sizeof(SortEntry<T>));
  std::memset(static_cast<void*>(exchange.data()), 0xff, exchange.size() * sizeof(SortEntry<T>));
  run_block<T>(threads, [&](const Reductions<T>&) {
    block_sort_by_magnitude(values, count, sorted.data(), SortedEntries<T>{sorted.data()});
  });
  run_block<T>(threads, [&](const Reductions<T>&) {
    block_sort_by_magnitude(values, count, exchange.data(), SortedIndices<T>{order});
  });
  for (int i = 0; i < count; ++i) {
    keys[i] = sorted[i].key();
    indices[i] = sorted[i].index();
  }
}

extern "C" {
// One block whose threads all meet at __syncthreads, or all but thread 0, which returns first.
void synchronise_block(int threads, int thread_zero_returns) {
  run_grid(LaunchPlan{threads, true, 0, 0, 1, 0}, [thread_zero_returns] {
    if (thread_zero_returns && threadIdx.x == 0) return;
    __syncthreads();
  });
}
void sort_by_magnitude_f32(const float* values, int count, int threads, uint64_t* keys, int* indices, int* order) {
  sort_by_magnitude<float>(values, count, threads, keys, indices, order);
}
void sort_by_magnitude_f64(const double* values, int count, int threads, uint64_t* keys, int* indices, int* order) {
  sort_by_magnitude<double>(values, count, threads, keys, indices, order);
}
void oscar_pav_block_f64(double* magnitude, int m, double beta, int threads) {
  oscar_pav_block<double>(magnitude, m, beta, threads);
}
void tv_prox_block_f64(const double* in, double* out, int m, double lambda, int threads) {
  tv_prox_block<double>(in, out, m, lambda, threads);
}
void forward_f32(int k, int pr, const float* x, const int64_t* l, float* p, float* y, int64_t r, int64_t n,
                 double reg, int64_t limit, int sms) { forward<float>(k, pr, x, l, p, y, r, n, reg, limit, sms); }
void forward_f64(int k, int pr, const double* x, const int64_t* l, double* p, double* y, int64_t r, int64_t n,
                 double reg, int64_t limit, int sms) { forward<double>(k, pr, x, l, p, y, r, n, reg, limit, sms); }
void backward_f32(int k, int gr, const float* g, const float* p, const float* y, float* dz, int64_t r, int64_t n,
                  int64_t limit, int sms) { backward<float>(k, gr, g, p, y, dz, r, n, limit, sms); }
void backward_f64(int k, int gr, const double* g, const double* p, const double* y, double* dz, int64_t r,
                  int64_t n, int64_t limit, int sms) { backward<double>(k, gr, g, p, y, dz, r, n, limit, sms); }
// threads, rows in shared memory (0/1), blocks and shared bytes of a launch, for the tests to check
// the path taken.
void plan_info(int backward_pass, int kind, int grouped, int64_t rows, int64_t n, int fp64, int64_t limit, int sms,
               int64_t* out) {
  const LaunchPlan plan = fp64 ? plan_launch<double>(backward_pass, Prox(kind), grouped, rows, n, sms, limit)
                               : plan_launch<float>(backward_pass, Prox(kind), grouped, rows, n, sms, limit);
  out[0] = plan.threads;
  out[1] = plan.rows_in_shared;
  out[2] = plan.blocks;
  out[3] = static_cast<int64_t>(plan.shared_bytes);
}
}
"""

SHARED_LIMIT = 48 * 1024


@pytest.fixture(scope="module")
def emulated_cuda(tmp_path_factory):
    import ctypes
    import pathlib
    import shutil
    import subprocess

    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    source_dir = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "cuda"
    build = tmp_path_factory.mktemp("cuda_emulation")
    (build / "harness.cpp").write_text(EMULATION_HARNESS)
    library = build / "harness.so"
    result = subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-I", str(source_dir),
                             str(build / "harness.cpp"), "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-6000:]
    return ctypes.CDLL(str(library))


def emulated_plan(lib, backward: bool, kind: str, n: int, dtype, rows: int = 8, grouped: bool = True,
                  shared_limit: int = SHARED_LIMIT, sm_count: int = 132):
    import ctypes

    out = (ctypes.c_int64 * 4)()
    lib.plan_info(int(backward), 0 if kind == "fused" else 1, int(grouped), ctypes.c_int64(rows), ctypes.c_int64(n),
                  int(dtype == torch.float64), ctypes.c_int64(shared_limit), sm_count, out)
    return {"threads": out[0], "in_shared": bool(out[1]), "blocks": out[2], "shared_bytes": out[3]}


def run_emulated(lib, kind: str, X: torch.Tensor, reg: float, lengths=None, grad=None, project: bool = True,
                 shared_limit: int = SHARED_LIMIT, sm_count: int = 132):
    """(p, y, dz) of the emulated CUDA kernels on a 2-D contiguous float tensor."""
    import ctypes

    rows, n = X.shape
    suffix = "f32" if X.dtype == torch.float32 else "f64"
    kind_id = 0 if kind == "fused" else 1
    p, y = torch.full_like(X, 12345.0), torch.full_like(X, 12345.0)
    lengths64 = None if lengths is None else lengths.to(torch.int64).contiguous()
    ptr = lambda t: ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(0)  # noqa: E731
    getattr(lib, f"forward_{suffix}")(kind_id, int(project), ptr(X), ptr(lengths64), ptr(p), ptr(y),
                                      ctypes.c_int64(rows), ctypes.c_int64(n), ctypes.c_double(reg),
                                      ctypes.c_int64(shared_limit), sm_count)
    dz = None
    if grad is not None:
        dz = torch.full_like(X, 12345.0)
        getattr(lib, f"backward_{suffix}")(kind_id, int(reg > 0), ptr(grad), ptr(p), ptr(y), ptr(dz),
                                           ctypes.c_int64(rows), ctypes.c_int64(n), ctypes.c_int64(shared_limit),
                                           sm_count)
    return p, y, dz


def check_emulated_against_reference(lib, kind, X, reg, lengths, atol, rtol, **launch):
    grad = torch.randn(X.shape, dtype=X.dtype)
    p, y, dz = run_emulated(lib, kind, X, reg, lengths, grad, **launch)
    X_ref = X.clone().requires_grad_()
    p_ref = mapping(kind, "reference")(X_ref, reg, lengths=lengths)
    p_ref.backward(grad)
    torch.testing.assert_close(p, p_ref.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(y, prox(kind, "reference", X, reg, lengths=lengths), atol=atol, rtol=rtol)
    torch.testing.assert_close(dz, X_ref.grad, atol=10 * atol, rtol=10 * rtol)


EMULATION_TOLS = [
    pytest.param(torch.float64, 1e-12, 1e-12, id="float64"),
    pytest.param(torch.float32, 2e-6, 1e-5, id="float32"),
]


@pytest.mark.parametrize("dtype,atol,rtol", EMULATION_TOLS)
@pytest.mark.parametrize("kind,reg", [("fused", 0.0), ("fused", 0.3), ("oscar", 0.0), ("oscar", 0.02), ("oscar", 0.5)])
@pytest.mark.parametrize("n", [1, 33, 129, 1000])
def test_emulated_cuda_kernels_match_reference(emulated_cuda, kind, reg, n, dtype, atol, rtol):
    X, lengths = ragged_scores(5, n, dtype, generator_seed=n + 1, scale=3.0)
    if kind == "oscar" and n == 1000:
        X = X / 30  # keep some groups: at beta 0.02 a 1000-long row of randn * 3 clips to all 0
    check_emulated_against_reference(emulated_cuda, kind, X, reg, lengths, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", EMULATION_TOLS)
@pytest.mark.parametrize("kind,reg", [("fused", 0.2), ("oscar", 0.01)])
def test_emulated_cuda_long_row_path(emulated_cuda, kind, reg, dtype, atol, rtol):
    # The global-memory path of long rows (taken beyond 48 KiB of row arrays, ~2k-6k entries
    # in fp32), forced here at n = 300 by a lower shared-memory limit; with 1 SM the grid has
    # 2 blocks, so each block loops over several rows (the grid-stride loop).
    n = 300
    limit = 2048
    for backward in (False, True):
        plan = emulated_plan(emulated_cuda, backward, kind, n, dtype, rows=5, shared_limit=limit, sm_count=1)
        assert not plan["in_shared"] and plan["blocks"] == 2
    assert emulated_plan(emulated_cuda, False, kind, n, dtype)["in_shared"]
    X, lengths = ragged_scores(5, n, dtype, generator_seed=7, scale=0.1 if kind == "oscar" else 3.0)
    check_emulated_against_reference(emulated_cuda, kind, X, reg, lengths, atol, rtol, shared_limit=limit, sm_count=1)


@pytest.mark.parametrize("lam", [0.03, 0.3, 3.0, 30.0])
@pytest.mark.parametrize("threads", [32, 64])
@pytest.mark.parametrize("m", [1, 2, 17, 100, 513, 1000, 2500])
def test_emulated_cuda_tv_scan_in_chunks(emulated_cuda, lam, threads, m):
    # block_tv_prox: each thread scans a chunk of the row and the scans are joined where they
    # meet. On randn rows lam 0.03-0.3 ends in one round; at lam 3 segments outgrow the
    # 16-entry chunks, chunks fail to meet and later rounds run with longer chunks; lam 30
    # fuses most of the row (the rounds' worst case). Rows longer than 16 entries per thread
    # (2500 on 32 or 64 threads; 64k rows on 1024 in the kernels) get longer chunks at once.
    import ctypes

    x = torch.randn(m, dtype=torch.float64, generator=torch.Generator().manual_seed(m + threads))
    out = torch.full_like(x, 12345.0)
    emulated_cuda.tv_prox_block_f64(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), m,
                                    ctypes.c_double(lam), threads)
    torch.testing.assert_close(out, prox("fused", "reference", x.unsqueeze(0), lam)[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("beta", [1e-4, 1e-3, 1e-2, 0.1])
@pytest.mark.parametrize("threads", [32, 128])
@pytest.mark.parametrize("m", [1, 2, 9, 100, 1000, 3000])
def test_emulated_cuda_oscar_pav_in_chunks(emulated_cuda, beta, threads, m):
    # block_oscar_pav: chunks pooled on their own, then joined in a tree (20 chunks of 5 at
    # m = 100 on 32 threads: a tree that is not a power of two). Against the reference prox,
    # whose magnitudes keep the order of |x|: from few pooled blocks (beta 1e-4) to rows
    # pooled and clipped to 0 entirely (beta 0.1 beyond a few hundred entries).
    import ctypes

    x = torch.randn(m, dtype=torch.float64, generator=torch.Generator().manual_seed(m + threads))
    magnitude = x.abs().sort(descending=True).values.contiguous()
    emulated_cuda.oscar_pav_block_f64(ctypes.c_void_p(magnitude.data_ptr()), m, ctypes.c_double(beta), threads)
    expected = prox("oscar", "reference", x.unsqueeze(0), beta)[0].abs().sort(descending=True).values
    torch.testing.assert_close(magnitude, expected, atol=1e-12, rtol=1e-12)


def sort_threads(count: int) -> int:
    """The block plan_launch gives an OSCAR row of `count` entries (8 per thread)."""
    threads = 32
    while threads * 8 < count and threads < 1024:
        threads *= 2
    return threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count,threads", [
    # in registers: the launch plan's block (shuffle stages only up to 256 entries, block
    # stages beyond), and blocks larger than the row (threads past the network idle)
    *[(count, sort_threads(count)) for count in (1, 2, 7, 8, 9, 33, 256, 257, 512, 1000, 1024, 3000)],
    (5, 64), (100, 128), (500, 128), (1025, 1024),
    # the fallback in `sorted`: more entries than the block holds in registers
    (300, 32), (1000, 64), (3000, 32),
])
def test_emulated_cuda_sort_by_magnitude(emulated_cuda, count, threads, dtype):
    # block_sort_by_magnitude's order: by decreasing |v| (the key ~bits(|v|) ascending), ties
    # (equal |v|, either sign, -0 and 0) by index, keys and indices exact; the padding up to
    # the next power of two sorts after every entry; the indices alone (the forward's output)
    # the same.
    import ctypes

    gen = torch.Generator().manual_seed(count + threads)
    levels = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.25, -3.0, 3.0, 1e-30], dtype=torch.float64)
    values = torch.where(torch.rand(count, generator=gen) < 0.5, levels[torch.randint(0, 8, (count,), generator=gen)],
                         torch.randn(count, generator=gen, dtype=torch.float64)).to(dtype)
    keys = torch.zeros(count, dtype=torch.int64)
    indices = torch.zeros(count, dtype=torch.int32)
    order_only = torch.full((count,), -7, dtype=torch.int32)
    suffix = "f32" if dtype == torch.float32 else "f64"
    getattr(emulated_cuda, f"sort_by_magnitude_{suffix}")(
        ctypes.c_void_p(values.data_ptr()), count, threads, ctypes.c_void_p(keys.data_ptr()),
        ctypes.c_void_p(indices.data_ptr()), ctypes.c_void_p(order_only.data_ptr()))

    unsigned = np.uint32 if dtype == torch.float32 else np.uint64
    key = ~values.abs().numpy().view(unsigned)
    order = np.lexsort((np.arange(count), key))
    assert (indices.numpy() == order).all()
    assert (order_only.numpy() == order).all()
    assert (keys.numpy().view(np.uint64) == key[order].astype(np.uint64)).all()


@pytest.mark.parametrize("dtype,atol,rtol", EMULATION_TOLS)
@pytest.mark.parametrize("n", [7, 512, 1024, 3000])
def test_emulated_cuda_oscarmax_sort_sizes(emulated_cuda, n, dtype, atol, rtol):
    # oscarmax forward and backward around the register sort: a warp (7), block stages (512,
    # 1024 on 64 / 128 threads), rows in the global scratch (3000 on 512 threads, stages up
    # to 2048 apart through global memory); the ragged rows' shorter
    # lengths and masks leave fewer entries than the block holds (idle threads). Scores
    # shrunk so that beta (n - i) leaves a support on the long rows.
    X, lengths = ragged_scores(4, n, dtype, generator_seed=n + 2, scale=3.0 / max(1, n // 100))
    in_shared = n <= 1024
    assert emulated_plan(emulated_cuda, False, "oscar", n, dtype)["in_shared"] == in_shared
    check_emulated_against_reference(emulated_cuda, "oscar", X, 1e-3, lengths, atol, rtol)


def test_emulated_cuda_oscarmax_beyond_the_register_sort(emulated_cuda):
    # A row of 9000 entries pads to 16384, more than 1024 threads hold in registers: the
    # sort falls back to the network in the global scratch, forward and backward (row 1 is
    # fully masked). About 20 s emulated: fp32 only.
    n = 9000
    for backward in (False, True):
        plan = emulated_plan(emulated_cuda, backward, "oscar", n, torch.float32, rows=2)
        assert plan["threads"] == 1024 and not plan["in_shared"]
    X, lengths = ragged_scores(2, n, torch.float32, generator_seed=5, scale=3.0 / 90)
    check_emulated_against_reference(emulated_cuda, "oscar", X, 1e-3, lengths, 2e-6, 1e-5)


@pytest.mark.parametrize("dtype,atol,rtol", EMULATION_TOLS)
@pytest.mark.parametrize("lam", [0.3, 3.0])
def test_emulated_cuda_fusedmax_in_chunks(emulated_cuda, lam, dtype, atol, rtol):
    # The chunked scan inside the forward kernel (64 threads at 1000 entries), in one round
    # (lam 0.3) and in several (lam 3), on ragged rows, then the backward's groups.
    X, lengths = ragged_scores(4, 1000, dtype, generator_seed=3, scale=1.0)
    check_emulated_against_reference(emulated_cuda, "fused", X, lam, lengths, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", EMULATION_TOLS)
@pytest.mark.parametrize("kind,reg", [("fused", 0.3), ("oscar", 0.01)])
def test_emulated_cuda_rows_valid_on_a_prefix(emulated_cuda, kind, reg, dtype, atol, rtol):
    # Rows whose valid entries are a prefix (trailing -inf as in causal attention, lengths,
    # both, none) are used where they lie, without packing (pack_members); a row with one
    # interior mask is packed. The backward packs OSCAR's non-zero entries either way.
    X, lengths = prefix_rows(dtype)
    check_emulated_against_reference(emulated_cuda, kind, X, reg, lengths, atol, rtol)


def test_emulated_cuda_aborts_at_a_synchronisation_not_every_thread_reaches(emulated_cuda):
    import subprocess
    import sys

    script = (f"import ctypes\nlib = ctypes.CDLL({emulated_cuda._name!r})\nlib.synchronise_block(64, 0)\n"
              "print('all threads met', flush=True)\nlib.synchronise_block(64, 1)\nprint('not reached')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout == "all threads met\n", result.stdout + result.stderr
    assert result.returncode != 0 and "not every thread reaches" in result.stderr


def test_emulated_cuda_launch_plan(emulated_cuda):
    # A warp per row for short rows, larger blocks as rows grow, 1024 threads at 64k; row
    # arrays in shared memory at the benchmark's lengths, in global scratch at 64k.
    tv = [emulated_plan(emulated_cuda, False, "fused", n, torch.float32)["threads"] for n in (1, 512, 1024, 65536)]
    assert tv == [32, 32, 64, 1024]
    oscar = [emulated_plan(emulated_cuda, False, "oscar", n, torch.float32)["threads"] for n in (1, 256, 1024, 65536)]
    assert oscar == [32, 32, 128, 1024]
    for backward in (False, True):
        for kind in ("fused", "oscar"):
            assert emulated_plan(emulated_cuda, backward, kind, 1024, torch.float32)["in_shared"]
            long_row = emulated_plan(emulated_cuda, backward, kind, 65536, torch.float32, rows=1000, sm_count=132)
            assert not long_row["in_shared"] and long_row["blocks"] == 264


def test_emulated_cuda_oscar_forward_residency(emulated_cuda):
    # The OSCAR forward at 1024 entries is latency-bound: its shared memory per
    # block decides how many blocks an SM holds. sm_90 has 228 KiB per SM and reserves 1 KiB
    # per block: 8 blocks (the most its 64 registers a thread allow at 128 threads), where the
    # magnitudes in rank order, PAV's start flags and the sort's entries beside PAV's blocks
    # made 6.
    plan = emulated_plan(emulated_cuda, False, "oscar", 1024, torch.float32)
    assert plan["in_shared"] and (228 * 1024) // (plan["shared_bytes"] + 1024) >= 8, plan


def test_emulated_cuda_clamps_lengths_and_poisons_bad_rows(emulated_cuda):
    X = torch.randn(4, 5, dtype=torch.float64)
    X[2, 1] = float("nan")
    X[3, 4] = float("inf")
    grad = torch.randn(4, 5, dtype=torch.float64)
    for kind in ("fused", "oscar"):
        p, y, dz = run_emulated(emulated_cuda, kind, X, 0.2, lengths=torch.tensor([-3, 9, 5, 5]), grad=grad)
        assert (p[0] == 0).all() and torch.isneginf(y[0]).all() and (dz[0] == 0).all()
        torch.testing.assert_close(p[1], mapping(kind, "reference")(X[1], 0.2), atol=1e-12, rtol=0)
        assert torch.isnan(p[2:]).all() and torch.isnan(y[2:]).all() and torch.isnan(dz[2:]).all()


@pytest.mark.parametrize("kind", MAPPINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_emulated_cuda_large_scores(emulated_cuda, kind, dtype):
    X = torch.tensor([[1.0, -1.0, 0.5, 0.0], [-0.25, 0.75, -1.0, 0.5]], dtype=dtype)
    for scale in (3e7, 1e30, 3e38):
        p, _, _ = run_emulated(emulated_cuda, kind, X * scale, 0.3)
        torch.testing.assert_close(p, torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]], dtype=dtype), atol=1e-6, rtol=0)
    c = 2.0 ** 126
    _, y, _ = run_emulated(emulated_cuda, kind, X * c, 0.3 * c, project=False)
    torch.testing.assert_close(y / c, prox(kind, "reference", X, 0.3), atol=1e-6, rtol=0)


@needs_cpp
@pytest.mark.parametrize("kind,reg", [("fused", 0.1), ("oscar", 1e-3)])
def test_emulated_cuda_matches_cpu_op_on_the_benchmark_shape(emulated_cuda, kind, reg):
    # The benchmark's row length (512), float32, a few rows: kernels and CPU op share the
    # algorithms, so they agree to rounding.
    X = torch.randn(3, 512)
    grad = torch.randn(3, 512)
    p, y, dz = run_emulated(emulated_cuda, kind, X, reg, grad=grad)
    forward = OPS.fusedmax_forward if kind == "fused" else OPS.oscarmax_forward
    backward = OPS.fusedmax_backward if kind == "fused" else OPS.oscarmax_backward
    p_cpu, y_cpu = forward(X, reg, None)
    torch.testing.assert_close(p, p_cpu, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y, y_cpu, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dz, backward(grad, p_cpu, y_cpu, reg), atol=1e-5, rtol=1e-5)
