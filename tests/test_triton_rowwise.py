"""Row-wise Triton kernels (triton_kernels/rowwise.py) against the reference mappings.

Runs the kernels in the Triton interpreter on CPU tensors (TRITON_INTERPRET=1, set by
conftest.py). The reference is evaluated in float64 on the very values the kernel read
(fp16 inputs are upcast), so the tolerances below measure the kernel alone. bf16 is only
compiled (tests/test_aot.py): the interpreter's bf16 arithmetic is wrong (KERNELS.md §1).
"""
import importlib
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

from entmax_fast.reference.mappings import entmax_backward, entmax_forward, entmax_threshold_root

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the kernels in the Triton interpreter", allow_module_level=True)


def _load_rowwise():
    try:
        return importlib.import_module("entmax_fast.triton_kernels.rowwise")
    except ModuleNotFoundError:
        path = Path(__file__).resolve().parent.parent / "triton_kernels" / "rowwise.py"
        spec = importlib.util.spec_from_file_location("entmax_fast_rowwise_under_test", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


rowwise = _load_rowwise()

# The interpreter evaluates both sides of tl.where with numpy, which warns about the
# discarded side (0·inf on α = 1 rows, d = 0 divisions outside the support).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

ALPHAS = [1.0, 1.25, 1.5, 2.0, 3.0]
LENGTHS = [1, 2, 63, 1000, 5000]
# (dtype, atol on p, atol on the sum of p). fp32: the threshold is found to |Σp − 1| ≤ 1e-6
# and then normalised; fp16: one rounding of the output (half an ulp of values ≤ 1).
FWD_TOLS = [
    pytest.param(torch.float32, 2e-6, 2e-6, id="fp32"),
    pytest.param(torch.float16, 6e-4, 2e-3, id="fp16"),
]
# (dtype, rtol) of dx and dalpha, relative to the largest reference magnitude of the row
# batch (α = 3 puts weights p^(−1) on tiny p, so absolute errors scale with the row).
BWD_TOLS = [
    pytest.param(torch.float32, 2e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, id="fp16"),
]


def _rows(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Three rows: one with a third of its entries −inf, a plain one, a fully −inf one."""
    gen = torch.Generator().manual_seed(seed + n)
    x = torch.randn(3, n, generator=gen) * 2
    x[0, ::3] = -math.inf
    x[2] = -math.inf
    return x.to(dtype)


def _reference_p(x: torch.Tensor, alpha) -> torch.Tensor:
    a = alpha.view(-1, 1).double() if isinstance(alpha, torch.Tensor) else alpha
    return entmax_forward(x.double(), a)


@pytest.mark.parametrize("dtype, atol, sum_atol", FWD_TOLS)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_forward_matches_reference(n, alpha, dtype, atol, sum_atol):
    x = _rows(n, dtype)
    p = rowwise.entmax_rowwise_forward(x, alpha)
    assert p.dtype == dtype and p.shape == x.shape
    ref = _reference_p(x, alpha)
    torch.testing.assert_close(p.double(), ref, atol=atol, rtol=0)
    has_finite = torch.isfinite(x).any(-1)
    sums = p.double().sum(-1)[has_finite]
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=sum_atol, rtol=0)
    assert torch.equal(p[2], torch.zeros_like(p[2])), "a fully −inf row must give zeros"


@pytest.mark.parametrize("dtype, atol, sum_atol", FWD_TOLS)
@pytest.mark.parametrize("n", [2, 63, 1000])
def test_forward_per_row_alpha(n, dtype, atol, sum_atol):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(6, n, generator=gen) * 2).to(dtype)
    x[1, ::2] = -math.inf
    x[5] = -math.inf
    alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 3.0, 1.5])
    p = rowwise.entmax_rowwise_forward(x, alpha)
    torch.testing.assert_close(p.double(), _reference_p(x, alpha), atol=atol, rtol=0)
    assert torch.equal(p[5], torch.zeros_like(p[5]))


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_forward_dense_alpha_below_one(alpha):
    x = _rows(63, torch.float32)
    p = rowwise.entmax_rowwise_forward(x, alpha)
    torch.testing.assert_close(p.double(), _reference_p(x, alpha), atol=2e-6, rtol=0)
    assert (p[1] > 0).all(), "α < 1 is dense on finite entries"


@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("n", [1, 2, 63, 300])
def test_sort_and_root_agree(n, alpha):
    x = _rows(n, torch.float32, seed=7)
    p_sort, _, passes_sort = rowwise._forward(x, alpha, method="sort")
    p_root, _, _ = rowwise._forward(x, alpha, method="root")
    ref = _reference_p(x, alpha)
    torch.testing.assert_close(p_sort.double(), ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(p_root.double(), ref, atol=2e-6, rtol=0)
    assert torch.equal(passes_sort, torch.ones_like(passes_sort))


def test_choose_method_rule():
    assert rowwise.choose_method(rowwise.SORT_MAX_COLS, 1.5) == "sort"
    assert rowwise.choose_method(rowwise.SORT_MAX_COLS, 2.0) == "sort"
    assert rowwise.choose_method(rowwise.SORT_MAX_COLS + 1, 2.0) == "root"
    assert rowwise.choose_method(10, 1.25) == "root"
    assert rowwise.choose_method(10, torch.tensor([2.0])) == "root"


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0])
def test_threshold_matches_reference_mu(alpha):
    x = _rows(1000, torch.float32, seed=3)[:2]
    mu, passes = rowwise.entmax_rowwise_threshold(x, alpha)
    x64 = x.double()
    if alpha == 1.0:
        u = x64 - x64.amax(-1, keepdim=True)
        ref_mu = torch.logsumexp(u, -1)
    else:
        ref_mu = entmax_threshold_root(x64, alpha, tol=1e-13)[0].view(-1)
    torch.testing.assert_close(mu.double(), ref_mu, atol=1e-5, rtol=1e-5)
    assert passes.dtype == torch.int32 and bool((passes >= 1).all())


def test_threshold_per_row_alpha():
    x = _rows(200, torch.float32, seed=9)[:2].repeat(2, 1)
    alpha = torch.tensor([1.0, 1.0, 1.75, 1.75])
    mu, _ = rowwise.entmax_rowwise_threshold(x, alpha)
    x64 = x.double()
    ref_soft = torch.logsumexp(x64[:2] - x64[:2].amax(-1, keepdim=True), -1)
    ref_175 = entmax_threshold_root(x64[2:], 1.75, tol=1e-13)[0].view(-1)
    torch.testing.assert_close(mu.double(), torch.cat([ref_soft, ref_175]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
def test_root_passes_on_gaussian_rows(alpha):
    """Max pass + histogram + model/Halley steps reach |Σp − 1| ≤ 1e-6 within 4 passes on
    N(0, σ²) rows (bench/bench_rowwise_passes.py measures the full grid; this keeps a
    regression visible in CI)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 2000, generator=gen) * math.sqrt(6.0)
    _, _, passes = rowwise._forward(x, alpha, method="root")
    assert int(passes.max()) <= 4, passes


def test_masked_columns_are_invisible():
    x = _rows(63, torch.float32, seed=5)[1:2]
    padded = torch.cat([x, torch.full((1, 40), -math.inf)], dim=1)
    for alpha in (1.25, 1.5, 3.0):
        p = rowwise.entmax_rowwise_forward(x, alpha)
        p_padded = rowwise.entmax_rowwise_forward(padded, alpha)
        torch.testing.assert_close(p_padded[:, :63], p, atol=1e-7, rtol=0)
        assert torch.equal(p_padded[:, 63:], torch.zeros(1, 40))


def test_strided_rows():
    base = torch.randn(6, 130)
    x = base[::2, 3:103]  # row stride 260, last stride 1
    assert not x.is_contiguous()
    for alpha in (1.5, 1.25, torch.tensor([1.5, 2.0, 1.0])):
        torch.testing.assert_close(rowwise.entmax_rowwise_forward(x, alpha),
                                   rowwise.entmax_rowwise_forward(x.contiguous(), alpha), atol=0, rtol=0)
    x_t = base[:, :6].t()  # last stride 130: copied by the launcher
    torch.testing.assert_close(rowwise.entmax_rowwise_forward(x_t, 1.5),
                               rowwise.entmax_rowwise_forward(x_t.contiguous(), 1.5), atol=0, rtol=0)


@pytest.mark.parametrize("offset", [-1000.0, 6e4])
def test_fp16_extreme_scores(offset):
    x = (torch.randn(2, 63) * 3 + offset).clamp(-6.5e4, 6.5e4).to(torch.float16)
    for alpha in (1.0, 1.5, 2.0, 3.0):
        p = rowwise.entmax_rowwise_forward(x, alpha)
        assert not p.isnan().any()
        torch.testing.assert_close(p.double(), _reference_p(x, alpha), atol=6e-4, rtol=0)


@pytest.mark.parametrize("dtype, rtol", BWD_TOLS)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_backward_matches_reference(n, alpha, dtype, rtol):
    x = _rows(n, torch.float32, seed=1)
    p = entmax_forward(x, alpha).to(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    dx, dalpha = rowwise.entmax_rowwise_backward(p, g, alpha, True)
    ref_dx, ref_dalpha = entmax_backward(p.double(), g.double(), alpha)
    assert dx.dtype == dtype and dalpha.dtype == torch.float32 and dalpha.shape == (3,)
    scale = ref_dx.abs().max().clamp(min=1.0)
    torch.testing.assert_close(dx.double(), ref_dx, atol=rtol * scale, rtol=0)
    scale_a = ref_dalpha.abs().max().clamp(min=1.0)
    torch.testing.assert_close(dalpha.double(), ref_dalpha.view(-1), atol=rtol * scale_a, rtol=0)
    assert torch.equal(dx[2], torch.zeros_like(dx[2])) and float(dalpha[2]) == 0.0


@pytest.mark.parametrize("dtype, rtol", BWD_TOLS)
@pytest.mark.parametrize("n", [1, 63, 1000])
def test_backward_per_row_alpha(n, dtype, rtol):
    gen = torch.Generator().manual_seed(n)
    alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 3.0, 0.7])
    x = torch.randn(6, n, generator=gen) * 2
    p = entmax_forward(x, alpha.view(-1, 1)).to(dtype)
    g = torch.randn(6, n, generator=gen).to(dtype)
    dx, dalpha = rowwise.entmax_rowwise_backward(p, g, alpha, True)
    ref_dx, ref_dalpha = entmax_backward(p.double(), g.double(), alpha.double().view(-1, 1))
    torch.testing.assert_close(dx.double(), ref_dx, atol=rtol * ref_dx.abs().max().clamp(min=1.0), rtol=0)
    torch.testing.assert_close(dalpha.double(), ref_dalpha.view(-1),
                               atol=rtol * ref_dalpha.abs().max().clamp(min=1.0), rtol=0)
    dx_only, none = rowwise.entmax_rowwise_backward(p, g, alpha, False)
    assert none is None
    torch.testing.assert_close(dx_only, dx, atol=0, rtol=0)


@pytest.mark.parametrize("dtype, rtol", BWD_TOLS)
def test_alpha_gradient_near_one(dtype, rtol):
    """α → 1: dα's two O(1/t) terms cancel; the kernel's regrouped form keeps full accuracy.

    The reference is evaluated on p renormalised in float64: on p as stored (Σp = 1 only to
    rounding, ~1e-7) its literal formula adds (Σp − 1)·Σgp/t², an O(1) artifact at
    t = 1e-4 that the kernel deliberately drops (see _entmax_bwd_kernel).
    """
    alpha = torch.tensor([1.0001, 1.001, 1.01, 0.999, 0.99, 1.0])
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(8)) * 2
    x[2, ::4] = -math.inf
    p = entmax_forward(x, alpha.view(-1, 1)).to(dtype)
    g = torch.randn(6, 300, generator=torch.Generator().manual_seed(9)).to(dtype)
    _, dalpha = rowwise.entmax_rowwise_backward(p, g, alpha, True)
    p64 = p.double() / p.double().sum(-1, keepdim=True)
    _, ref = entmax_backward(p64, g.double(), alpha.double().view(-1, 1))
    torch.testing.assert_close(dalpha.double(), ref.view(-1), atol=rtol * ref.abs().max().clamp(min=1.0), rtol=0)


def test_backward_matches_finite_differences():
    """dx of the kernel equals central differences of the float64 reference forward."""
    x = torch.randn(2, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g = torch.randn(2, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for alpha in (1.25, 1.5, 2.0):
        p = rowwise.entmax_rowwise_forward(x.float(), alpha)
        dx, _ = rowwise.entmax_rowwise_backward(p, g.float(), alpha, False)
        eps = 1e-6
        fd = torch.zeros_like(x)
        for j in range(17):
            e = torch.zeros_like(x)
            e[:, j] = eps
            fd[:, j] = ((entmax_forward(x + e, alpha) - entmax_forward(x - e, alpha)) * g).sum(-1) / (2 * eps)
        torch.testing.assert_close(dx.double(), fd, atol=1e-4, rtol=0)


def test_bad_arguments_are_named():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        rowwise.entmax_rowwise_forward(torch.randn(5), 1.5)
    with pytest.raises(ValueError, match="x dtype"):
        rowwise.entmax_rowwise_forward(x.double(), 1.5)
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        rowwise.entmax_rowwise_forward(x, 0.0)
    with pytest.raises(ValueError, match=r"alpha tensor must have shape \(2,\)"):
        rowwise.entmax_rowwise_forward(x, torch.tensor([1.5]))
    with pytest.raises(ValueError, match="method 'sort' needs alpha 2.0 or 1.5"):
        rowwise._forward(x, 1.25, method="sort")
    with pytest.raises(ValueError, match="max_passes must be >= 3"):
        rowwise._forward(x, 1.25, max_passes=2)
    with pytest.raises(ValueError, match="grad must have p's shape"):
        rowwise.entmax_rowwise_backward(x, torch.randn(2, 4), 1.5, True)


def test_empty_shapes():
    assert rowwise.entmax_rowwise_forward(torch.randn(0, 7), 1.5).shape == (0, 7)
    assert rowwise.entmax_rowwise_forward(torch.randn(3, 0), 1.25).shape == (3, 0)
    dx, dalpha = rowwise.entmax_rowwise_backward(torch.zeros(3, 0), torch.zeros(3, 0), 1.5, True)
    assert dx.shape == (3, 0) and torch.equal(dalpha, torch.zeros(3))
