"""Row-wise Triton kernels (triton_kernels/rowwise.py) through their launchers
(entmax_fast/backends/triton/rowwise.py) against the float64 reference.

On a machine with CUDA the compiled kernels run on the GPU; elsewhere they run in the
Triton interpreter on CPU tensors (TRITON_INTERPRET=1, set by conftest.py). The reference
is evaluated in float64 on the very values the kernel read (fp16/bf16 inputs are upcast),
so the tolerances below measure the kernel alone. The kernels cast bf16 to fp32 right
after the load, so bf16 runs in the interpreter as well; its fp32 → bf16 store truncates
(one ulp) where a GPU rounds (half an ulp), hence the bf16 tolerance of one ulp.
"""
import importlib
import math
import os

import pytest
import torch

from entmax_fast import common
from entmax_fast.reference.mappings import entmax_backward, entmax_forward, entmax_threshold_root

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("without CUDA these tests run the kernels in the Triton interpreter", allow_module_level=True)


# imported once triton is known to be importable (the skips above)
rowwise = importlib.import_module("entmax_fast.backends.triton.rowwise")
kernels = importlib.import_module("entmax_fast.triton_kernels.rowwise")

# The interpreter evaluates both sides of tl.where with numpy, which warns about the
# discarded side (0·inf on α = 1 rows, d = 0 divisions outside the support).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

ALPHAS = [1.0, 1.25, 1.5, 2.0, 3.0]
LENGTHS = [1, 2, 63, 1000, 5000]
# Rows longer than RESIDENT_MAX_COLS of their α kind are swept in chunks; a small chunk puts
# short rows through that path as well (several chunks, a ragged last one).
CHUNKED = {"ROWS": 1, "BLOCK": 64, "RESIDENT": False, "num_warps": 4}
# A resident tile too small for the table to start it from a subset (`start_subset`), run with
# one (subset=BLOCK // 4: groups of 4 entries), so that short rows test that start too.
SUBSET_RESIDENT = {"ROWS": 1, "BLOCK": 64, "RESIDENT": True, "num_warps": 1}
BF16_ULP = 2.0 ** -8  # one ulp of bf16 values in [0.5, 1)
# A bf16 weight: the fp32 result's error (the fp32 rows' 2e-6) and one conversion, which the
# Triton interpreter truncates (up to an ulp; a GPU rounds to nearest, half of one). An exact
# weight that is itself a bf16 value, computed a hair low in fp32, lands a whole ulp below
# it: 1 ulp + 1e-16 against the float64 reference was seen (a 63-entry row at α = 3).
BF16_ATOL = BF16_ULP + 2e-6
# (dtype, atol on p, atol on the sum of p). fp32: the threshold is found to |Σp − 1| ≤ 1e-6
# (exactly for α ∈ {1.5, 2}) and then normalised; fp16: one rounding of the output.
FWD_TOLS = [
    pytest.param(torch.float32, 2e-6, 2e-6, id="fp32"),
    pytest.param(torch.float16, 6e-4, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, BF16_ATOL, 0.1, id="bf16"),
]
# (dtype, rtol) of dx and dalpha, relative to the largest reference magnitude of the row
# batch (α = 3 puts weights p^(−1) on tiny p, so absolute errors scale with the row).
BWD_TOLS = [
    pytest.param(torch.float32, 2e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 2e-2, id="bf16"),
]


def _rows(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Five rows: a third of the entries −inf, a plain one, a fully −inf one, a sharp
    one and a flat one (several rows per program, a ragged last tile)."""
    gen = torch.Generator().manual_seed(seed + n)
    x = torch.randn(5, n, generator=gen) * 2
    x[0, ::3] = -math.inf
    x[2] = -math.inf
    x[3] *= 10
    x[4] *= 0.05
    return x.to(dtype).to(DEVICE)


def _reference_p(x: torch.Tensor, alpha) -> torch.Tensor:
    a = alpha.view(-1, 1).double().cpu() if isinstance(alpha, torch.Tensor) else alpha
    return entmax_forward(x.double().cpu(), a)


def _check_forward(p, x, alpha, atol, sum_atol):
    assert p.dtype == x.dtype and p.shape == x.shape
    torch.testing.assert_close(p.double().cpu(), _reference_p(x, alpha), atol=atol, rtol=0)
    has_finite = torch.isfinite(x).any(-1).cpu()
    sums = p.double().cpu().sum(-1)[has_finite]
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=sum_atol, rtol=0)


@pytest.mark.parametrize("dtype, atol, sum_atol", FWD_TOLS)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_forward_matches_reference(n, alpha, dtype, atol, sum_atol):
    x = _rows(n, dtype)
    p = rowwise.entmax_forward(x, alpha)
    _check_forward(p, x, alpha, atol, sum_atol)
    assert torch.equal(p[2], torch.zeros_like(p[2])), "a fully −inf row must give zeros"


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0, 3.0, 0.7, "per-row"])
@pytest.mark.parametrize("n", [1, 63, 300])
def test_chunked_rows_match_reference(n, alpha):
    x = _rows(n, torch.float32, seed=2)
    if alpha == "per-row":
        alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 3.0], device=DEVICE)
    p, *_ = rowwise._forward(x, alpha, config=CHUNKED)
    _check_forward(p, x, alpha, 2e-6, 2e-6)
    torch.testing.assert_close(p, rowwise.entmax_forward(x, alpha), atol=2e-6, rtol=0)


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0, 3.0, "per-row"])
def test_several_rows_per_program(alpha):
    """The kernels take ROWS rows per program (the table uses one; kept correct for a
    table that uses more): ragged last tile, rows finishing at different passes."""
    x = _rows(63, torch.float32, seed=12)
    if alpha == "per-row":
        alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 3.0], device=DEVICE)
    tiles = {"ROWS": 4, "BLOCK": 64, "RESIDENT": True, "num_warps": 2}
    p, *_ = rowwise._forward(x, alpha, config=tiles)
    _check_forward(p, x, alpha, 2e-6, 2e-6)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    need = isinstance(alpha, torch.Tensor)
    dx, dalpha = rowwise.entmax_backward(p, g, alpha, need, config=tiles)
    dx_one, dalpha_one = rowwise.entmax_backward(p, g, alpha, need)
    torch.testing.assert_close(dx, dx_one, atol=1e-6, rtol=1e-5)
    if need:
        torch.testing.assert_close(dalpha, dalpha_one, atol=1e-6, rtol=1e-5)


def test_plain_alpha_picks_the_launches_compiled_for_plain_rows():
    # python-float α of the general kind with 1.25 <= α <= 2 only; 1.5 and 2 have kinds of
    # their own, and a tensor may hold any values
    assert all(kernels.plain_alpha(a) for a in (1.25, 1.3, 1.7, 1.999))
    assert not any(kernels.plain_alpha(a) for a in (1.0, 1.2, 1.5, 2.0, 2.5, 0.7, torch.tensor(1.3)))


@pytest.mark.parametrize("alpha", [1.25, 1.3, 1.7])
@pytest.mark.parametrize("layout", ["resident", "chunked", "resident-subset"])
def test_plain_launch_matches_the_general_compile(alpha, layout):
    # ALL_PLAIN drops the other rows' passes at compile time; plain rows run the same
    # arithmetic in the compile that decides per program at run time
    x = _rows(60 if layout == "resident-subset" else 300, torch.float32, seed=3)
    options = {"resident": {}, "chunked": {"config": CHUNKED},
               "resident-subset": {"config": SUBSET_RESIDENT, "subset": SUBSET_RESIDENT["BLOCK"] // 4}}[layout]
    p_plain, c_plain, passes_plain, _ = rowwise._forward(x, alpha, all_plain=True, **options)
    p_general, c_general, passes_general, _ = rowwise._forward(x, alpha, all_plain=False, **options)
    torch.testing.assert_close(p_plain, p_general, atol=1e-7, rtol=0)
    torch.testing.assert_close(c_plain, c_general, atol=1e-7, rtol=0)
    assert torch.equal(passes_plain, passes_general)
    _check_forward(p_plain, x, alpha, 2e-6, 2e-6)


@pytest.mark.parametrize("alpha", [1.5, 1.3])
def test_rows_longer_than_resident(alpha):
    kind = common.alpha_kind(alpha)
    n = kernels.RESIDENT_MAX_COLS[kind] + 77
    assert not kernels.tile_config(n, kind)["RESIDENT"]
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x[1, ::5] = -math.inf
    p = rowwise.entmax_forward(x, alpha)
    _check_forward(p, x, alpha, 2e-6, 2e-6)


@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("n", [9000, 20000])
def test_long_resident_rows_of_closed_forms(n, alpha):
    """Sparsemax and entmax15 keep rows of up to 32768 entries resident on 16 warps (the
    general kind chunks them): forward and backward of that tile against float64."""
    _, num_warps, tile = rowwise._launch_config(n, common.alpha_kind(alpha))
    assert tile["RESIDENT"] and num_warps == 16
    x = _rows(n, torch.float32, seed=14)
    _check_forward(rowwise.entmax_forward(x, alpha), x, alpha, 2e-6, 2e-6)
    p, g = _backward_case(n, alpha, seed=15)
    _check_backward(p, g, alpha, 2e-5)


@pytest.mark.parametrize("dtype, atol, sum_atol", FWD_TOLS)
@pytest.mark.parametrize("n", [2, 63, 1000])
def test_forward_per_row_alpha(n, dtype, atol, sum_atol):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(7, n, generator=gen) * 2).to(dtype).to(DEVICE)
    x[1, ::2] = -math.inf
    x[5] = -math.inf
    alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 3.0, 1.5, 0.6], device=DEVICE)
    p = rowwise.entmax_forward(x, alpha)
    torch.testing.assert_close(p.double().cpu(), _reference_p(x, alpha), atol=atol, rtol=0)
    assert torch.equal(p[5], torch.zeros_like(p[5]))


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_forward_dense_alpha_below_one(alpha):
    x = _rows(63, torch.float32)
    p = rowwise.entmax_forward(x, alpha)
    torch.testing.assert_close(p.double().cpu(), _reference_p(x, alpha), atol=2e-6, rtol=0)
    assert (p[1] > 0).all(), "α < 1 is dense on finite entries"


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.3, 3.0, "per-row"])
@pytest.mark.parametrize("resident", [True, False, "subset"], ids=["resident", "chunked", "resident-subset"])
def test_nan_and_inf_follow_softmax_rule(alpha, resident):
    """A row holding NaN or +inf gives NaN, −inf entries weigh 0, an all −inf row gives
    zeros; the other rows of the same program are unaffected."""
    inf, nan = math.inf, math.nan
    x = torch.tensor([[0.5, nan, 1.0, 2.0, -1.0],
                      [0.5, inf, 1.0, 2.0, -1.0],
                      [-inf, -inf, -inf, -inf, -inf],
                      [0.5, -inf, 1.0, 2.0, -1.0],
                      [0.5, 0.3, 1.0, 2.0, -1.0],
                      [-inf, inf, nan, 1.0, 2.0]], device=DEVICE)
    if alpha == "per-row":
        alpha = torch.tensor([1.5, 1.3, 2.0, 3.0, 1.0, 1.25], device=DEVICE)
    if resident == "subset":
        p, *_ = rowwise._forward(x, alpha, config=SUBSET_RESIDENT, subset=SUBSET_RESIDENT["BLOCK"] // 4)
    else:
        p, *_ = rowwise._forward(x, alpha, config=None if resident else CHUNKED)
    assert torch.isnan(p[[0, 1, 5]]).all()
    assert torch.equal(p[2], torch.zeros_like(p[2]))
    assert float(p[3, 1]) == 0.0
    torch.testing.assert_close(p[3:5].double().cpu(), _reference_p(x[3:5], alpha[3:5] if isinstance(
        alpha, torch.Tensor) else alpha), atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype, offset, atol", [
    pytest.param(torch.float32, 1e30, 2e-6, id="fp32-1e30"),
    pytest.param(torch.float32, -1e30, 2e-6, id="fp32-neg1e30"),
    pytest.param(torch.float16, 6e4, 6e-4, id="fp16-6e4"),
    pytest.param(torch.float16, -1000.0, 6e-4, id="fp16-neg1000"),
    pytest.param(torch.bfloat16, 3e38, BF16_ATOL, id="bf16-3e38"),
])
def test_large_finite_scores(dtype, offset, atol):
    """Scores are shifted by the row max first: a common offset changes nothing, and the
    dtype's largest values are ordinary scores."""
    spacing = abs(offset) * 2.0 ** -6 if dtype != torch.float16 else 3.0
    base = torch.randn(3, 63, generator=torch.Generator().manual_seed(6)) * spacing
    x = (base + offset).to(dtype)
    big = torch.finfo(dtype).max
    x[2, :3] = torch.tensor([big, big, -big], dtype=dtype)
    x = x.to(DEVICE)
    for alpha in (1.0, 1.3, 1.5, 2.0, 3.0):
        for p in (rowwise.entmax_forward(x, alpha),
                  rowwise._forward(x, alpha, config=SUBSET_RESIDENT, subset=SUBSET_RESIDENT["BLOCK"] // 4)[0]):
            assert not p.isnan().any()
            torch.testing.assert_close(p.double().cpu(), _reference_p(x, alpha), atol=atol, rtol=0)
            torch.testing.assert_close(p[2, :2].double().cpu(), torch.full((2,), 0.5, dtype=torch.float64),
                                       atol=atol, rtol=0)


def _near_one_rows(offset: float) -> torch.Tensor:
    """fp32 rows offset + small·step (tests/test_reliability.py's large-score rows: the small
    parts are multiples of the spacing at the offset, at least 1/4) and two N(0, 1) rows."""
    step = max(float(torch.finfo(torch.float32).eps) * abs(offset), 0.25)
    small = torch.tensor([[0.0, -1.0, -2.0, -3.0, -7.0, -40.0],
                          [0.0, 0.0, -1.0, -1.0, -2.0, -3.0],
                          [0.0, -0.5, -0.5, -1.5, -9.0, -1e3]], dtype=torch.float64) * step
    large = (torch.tensor(offset, dtype=torch.float64) + small).float()
    large = torch.cat([large, torch.full((3, 94), -math.inf)], dim=1)
    gauss = torch.randn(2, 100, generator=torch.Generator().manual_seed(13))
    return torch.cat([large, gauss]).to(DEVICE)


@pytest.mark.parametrize("alpha", [1.0001, 1.001, 1.01])
@pytest.mark.parametrize("offset", [0.0, 1e4, 1e6, -1e30])
def test_alpha_near_one_against_oracle(alpha, offset):
    """α → 1: p = d^e with e = 1/(α − 1) amplifies d's rounding by e (d ≈ 1 near the top),
    and P − P^(1−t) in the Newton step cancels; the kernel takes log d and that numerator
    from series (`_log2_base`, `_pow_gap`). Against the float64 oracle (bisection on τ), in
    fp32 at the reliability tests' 2e−6, resident and chunked, float and per-row α, and
    in a few passes (the cancelling step fell back to bisection: 25–40 passes)."""
    from oracle import oracle_entmax

    x = _near_one_rows(offset)
    expected = oracle_entmax(x.double().cpu(), alpha)
    per_row = torch.tensor([alpha, 2.0 - alpha, alpha, 1.0, alpha], device=DEVICE)
    expected_per_row = oracle_entmax(x.double().cpu(), per_row.double().cpu().view(-1, 1))
    for config in (None, CHUNKED):
        p, _, passes, _ = rowwise._forward(x, alpha, config=config)
        torch.testing.assert_close(p.double().cpu(), expected, atol=2e-6, rtol=0)
        assert int(passes.max()) <= 6, passes
        p, _, passes, _ = rowwise._forward(x, per_row, config=config)
        torch.testing.assert_close(p.double().cpu(), expected_per_row, atol=2e-6, rtol=0)
        assert int(passes.max()) <= 6, passes


@pytest.mark.parametrize("alpha", [1.5, 2.0])
@pytest.mark.parametrize("n", [1, 2, 63, 300])
def test_exact_support_update(n, alpha):
    """α ∈ {1.5, 2}: the iteration ends on a certified exact threshold: μ as the float64
    root and Σp = 1 before the output's normalisation."""
    x = _rows(n, torch.float32, seed=7)
    mu, passes = rowwise.entmax_threshold(x, alpha)
    finite = torch.isfinite(x).any(-1).cpu()
    x64 = x.double().cpu()[finite]
    ref_mu = entmax_threshold_root(x64, alpha, tol=1e-13)[0].view(-1)
    torch.testing.assert_close(mu.double().cpu()[finite], ref_mu, atol=1e-6, rtol=1e-6)
    u = x64 - x64.amax(-1, keepdim=True)
    t = alpha - 1
    p = ((1 - t * mu.double().cpu()[finite]).unsqueeze(-1) + t * u).clamp(min=0).pow(1 / t)
    torch.testing.assert_close(p.sum(-1), torch.ones(int(finite.sum()), dtype=torch.float64), atol=2e-6, rtol=0)
    assert int(passes.max()) <= 8, passes


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0])
def test_threshold_matches_reference_mu(alpha):
    x = _rows(1000, torch.float32, seed=3)[:2]
    mu, passes = rowwise.entmax_threshold(x, alpha)
    x64 = x.double().cpu()
    if alpha == 1.0:
        u = x64 - x64.amax(-1, keepdim=True)
        ref_mu = torch.logsumexp(u, -1)
    else:
        ref_mu = entmax_threshold_root(x64, alpha, tol=1e-13)[0].view(-1)
    torch.testing.assert_close(mu.double().cpu(), ref_mu, atol=1e-5, rtol=1e-5)
    assert passes.dtype == torch.int32 and bool((passes >= 1).all())


def test_threshold_per_row_alpha():
    x = _rows(200, torch.float32, seed=9)[:2].repeat(2, 1)
    alpha = torch.tensor([1.0, 1.0, 1.75, 1.75], device=DEVICE)
    mu, _ = rowwise.entmax_threshold(x, alpha)
    x64 = x.double().cpu()
    ref_soft = torch.logsumexp(x64[:2] - x64[:2].amax(-1, keepdim=True), -1)
    ref_175 = entmax_threshold_root(x64[2:], 1.75, tol=1e-13)[0].view(-1)
    torch.testing.assert_close(mu.double().cpu(), torch.cat([ref_soft, ref_175]), atol=1e-5, rtol=1e-5)


# Worst passes (max pass + iterations) on N(0, σ²) rows, σ² ∈ {1, 6}, n = 2000, as
# measured by tools/rowwise_passes.py; one more is allowed. α > 2 has kinks of
# infinite slope and falls back to bisection near them.
PASS_LIMITS = {0.7: 6, 1.25: 7, 1.5: 6, 2.0: 7, 3.0: 24}


@pytest.mark.parametrize("alpha", list(PASS_LIMITS))
def test_passes_on_gaussian_rows(alpha):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 2000, generator=gen) * torch.tensor([[1.0], [1.0], [6.0 ** 0.5], [6.0 ** 0.5]])
    _, _, passes, _ = rowwise._forward(x.to(DEVICE), alpha)
    assert int(passes.max()) <= PASS_LIMITS[alpha], passes


def _capture_rows(n: int) -> torch.Tensor:
    """N(0, σ²) rows, σ ∈ {1, 3, 1e-4} (the last so flat that its support never fits a
    quarter of the row), one with a third of its entries −inf."""
    gen = torch.Generator().manual_seed(21 + n)
    x = torch.randn(4, n, generator=gen) * torch.tensor([[1.0], [3.0], [1e-4], [1.0]])
    x[3, ::3] = -math.inf
    return x.to(DEVICE)


@pytest.mark.parametrize("n", [600, 1024, 5000])
def test_swept_rows_run_later_passes_over_their_support(n):
    """1.25 ≤ α ≤ 2 (float or per row), rows swept in chunks: once a row's support fits its
    slots, the next pass stores it and the later evaluations run over the stored entries
    only (docs/maths.md, "Candidates of the general kind"). From c = 1 (no start from a
    subset, which often converges before a support is stored) the rows that fit capture,
    the flat one does not, resident rows never do, and every output matches the float64
    reference as closely as the passes over the whole row do."""
    x = _capture_rows(n)
    per_row = torch.tensor([1.5, 1.9, 1.3, 2.0], device=DEVICE)
    # The widest rows take the per-row α only: the float values run the same passes at
    # the shorter lengths, and each α costs minutes in the interpreter at n = 5000.
    for alpha in (1.25, 1.7, per_row) if n <= 1024 else (per_row,):
        p, _, passes, captured_at = rowwise._forward(x, alpha, config=CHUNKED, subset=0)
        _check_forward(p, x, alpha, 2e-6, 2e-6)
        assert bool((captured_at[:2] >= 3).all()) and int(captured_at[2]) == 0, captured_at
        assert bool((captured_at <= passes).all()), (captured_at, passes)
        p_whole, _, _, never = rowwise._forward(x, alpha, config=CHUNKED, candidates=0, subset=0)
        assert int(never.max()) == 0
        torch.testing.assert_close(p, p_whole, atol=1e-6, rtol=0)
        if n <= kernels.RESIDENT_MAX_COLS[common.ALPHA_GENERAL]:
            assert int(rowwise._forward(x, alpha)[3].max()) == 0


def test_capture_waits_for_a_support_that_fits():
    """A support larger than the slots at the first evaluations: the row is stored only
    after a pass counted a support that fits (α 1.4 with 64 slots, where the supports at
    c = 1 hold 266 and 109 entries and at the root 49 and 20), and rows outside
    1.25 ≤ α ≤ 2 never capture."""
    x = _capture_rows(1024)[[0, 3]]
    p, _, passes, captured_at = rowwise._forward(x, 1.4, config=CHUNKED, candidates=64, subset=0)
    _check_forward(p, x, 1.4, 2e-6, 2e-6)
    assert bool((captured_at >= 4).all()), captured_at
    for alpha in (1.1, 3.0):
        p, _, _, captured_at = rowwise._forward(x, alpha, config=CHUNKED)
        _check_forward(p, x, alpha, 2e-6, 2e-6)
        assert int(captured_at.max()) == 0, (alpha, captured_at)



@pytest.mark.parametrize("n, config", [(300, CHUNKED), (4096, None), (9000, None)],
                         ids=["swept", "resident-4-warps", "resident-16-warps"])
def test_start_from_a_subset(n, config):
    """The iteration starts from the root over a subset of the row (each value the largest
    of a group of entries; docs/maths.md, "A start from a subset"): the same outputs as from
    c = 1, to float64's tolerance, in fewer evaluations over the rows that are not flat, for
    sparsemax, entmax15 and 1.25 ≤ α ≤ 2 (float or per row); other α start from c = 1."""
    kind_config = config or kernels.tile_config(n, common.ALPHA_ENTMAX15)
    assert kernels.start_subset(kind_config, common.ALPHA_ENTMAX15) > 0
    gen = torch.Generator().manual_seed(31 + n)
    x = torch.randn(5, n, generator=gen) * torch.tensor([[1.0], [3.0], [1e-4], [1.0], [0.5]])
    x[3, ::3] = -math.inf
    x = x.to(DEVICE)
    uneven = [0, 1, 3, 4]
    # One value of each kind and branch: sparsemax, 1.5-entmax, 1.25 ≤ α ≤ 2 as a float and
    # per row, and an α outside that range (which starts from c = 1).
    for alpha in (2.0, 1.5, 1.3, torch.tensor([1.5, 1.9, 1.3, 2.0, 1.25], device=DEVICE), 3.0):
        p, _, passes, _ = rowwise._forward(x, alpha, config=config)
        p_one, _, passes_one, _ = rowwise._forward(x, alpha, config=config, subset=0)
        _check_forward(p, x, alpha, 2e-6, 2e-6)
        torch.testing.assert_close(p, p_one, atol=1e-6, rtol=0)
        if isinstance(alpha, float) and not 1.25 <= alpha <= 2.0:
            assert torch.equal(passes, passes_one), (alpha, passes, passes_one)
        else:
            # a row may take one more (a start just above a kink of the iteration's path)
            assert int(passes[uneven].sum()) < int(passes_one[uneven].sum()), (alpha, passes, passes_one)
            assert bool((passes <= passes_one + 1).all()), (alpha, passes, passes_one)


def test_start_subset_table():
    """Swept rows start from 4 values per thread (from their lanes), resident rows from 8
    where a thread holds 32 entries or more, softmax rows never; the AOT list compiles each."""
    def table(n, kind):
        return kernels.start_subset(kernels.tile_config(n, kind), kind)

    assert table(1024, common.ALPHA_ENTMAX15) == 0 and table(8192, common.ALPHA_SPARSEMAX) == 0
    assert table(4096, common.ALPHA_GENERAL) == 1024
    assert table(32768, common.ALPHA_ENTMAX15) == 4096 and table(16384, common.ALPHA_SPARSEMAX) == 4096
    assert table(10 ** 5, common.ALPHA_ENTMAX15) == 4 * 32 * 4
    assert table(10 ** 5, common.ALPHA_GENERAL) == 4 * 32 * 8
    assert table(10 ** 5, common.ALPHA_SOFTMAX) == 0
    assert kernels.start_subset(CHUNKED, common.ALPHA_GENERAL) == CHUNKED["BLOCK"]
    listed = {(c["constexprs"]["ALPHA_KIND"], c["constexprs"]["BLOCK"], c["constexprs"]["RESIDENT"],
               c["constexprs"]["SUBSET"])
              for c in kernels.aot_configs() if c["fn"] is kernels.entmax_rowwise_fwd_kernel}
    for n in TABLE_LENGTHS:
        for kind in KINDS:
            cfg = kernels.tile_config(n, kind)
            assert (kind, cfg["BLOCK"], cfg["RESIDENT"], kernels.start_subset(cfg, kind)) in listed

def test_candidate_slots():
    """Swept general-kind rows only: a quarter of the row's next power of two, a power of
    two from 128 to CHUNK_BLOCK; the AOT list compiles the forward with its slots."""
    for n in TABLE_LENGTHS:
        for kind in KINDS:
            cfg = kernels.tile_config(n, kind)
            slots = kernels.candidate_slots(n, cfg, kind)
            if kind != common.ALPHA_GENERAL or cfg["RESIDENT"]:
                assert slots == 0
                continue
            assert slots & (slots - 1) == 0 and 128 <= slots <= min(kernels.CHUNK_BLOCK, 256 * cfg["num_warps"])
    assert kernels.candidate_slots(1000, CHUNKED, common.ALPHA_GENERAL) == 256
    assert kernels.candidate_slots(200, CHUNKED, common.ALPHA_GENERAL) == 0
    listed = {(c["constexprs"]["BLOCK"], c["constexprs"]["RESIDENT"], c["constexprs"]["CANDIDATES"])
              for c in kernels.aot_configs()
              if c["fn"] is kernels.entmax_rowwise_fwd_kernel and c["constexprs"]["ALPHA_KIND"] == common.ALPHA_GENERAL}
    for n in TABLE_LENGTHS:
        cfg = kernels.tile_config(n, common.ALPHA_GENERAL)
        assert (cfg["BLOCK"], cfg["RESIDENT"], kernels.candidate_slots(n, cfg, common.ALPHA_GENERAL)) in listed


def test_masked_columns_are_invisible():
    x = _rows(63, torch.float32, seed=5)[1:2]
    padded = torch.cat([x, torch.full((1, 40), -math.inf, device=DEVICE)], dim=1)
    for alpha in (1.25, 1.5, 2.0, 3.0):
        p = rowwise.entmax_forward(x, alpha)
        p_padded = rowwise.entmax_forward(padded, alpha)
        torch.testing.assert_close(p_padded[:, :63], p, atol=1e-7, rtol=0)
        assert torch.equal(p_padded[:, 63:], torch.zeros(1, 40, device=DEVICE))


def test_strided_rows():
    base = torch.randn(6, 130, device=DEVICE)
    x = base[::2, 3:103]  # row stride 260, last stride 1
    assert not x.is_contiguous()
    for alpha in (1.5, 1.25, torch.tensor([1.5, 2.0, 1.0], device=DEVICE)):
        torch.testing.assert_close(rowwise.entmax_forward(x, alpha),
                                   rowwise.entmax_forward(x.contiguous(), alpha), atol=0, rtol=0)
    x_t = base[:, :6].t()  # last stride 130: copied by the launcher
    torch.testing.assert_close(rowwise.entmax_forward(x_t, 1.5),
                               rowwise.entmax_forward(x_t.contiguous(), 1.5), atol=0, rtol=0)


def _backward_case(n: int, alpha, seed: int = 1):
    gen = torch.Generator().manual_seed(seed + n)
    x = torch.randn(5, n, generator=gen) * 2
    x[0, ::3] = -math.inf
    x[2] = -math.inf
    x[3] *= 10
    a = alpha.view(-1, 1) if isinstance(alpha, torch.Tensor) else alpha
    p = entmax_forward(x, a)
    g = torch.randn(x.shape, generator=gen)
    return p, g


def _check_backward(p, g, alpha, rtol, config=None):
    a_dev = alpha.to(DEVICE) if isinstance(alpha, torch.Tensor) else alpha
    dx, dalpha = rowwise.entmax_backward(p.to(DEVICE), g.to(DEVICE), a_dev, True, config=config)
    a_ref = alpha.double().view(-1, 1) if isinstance(alpha, torch.Tensor) else alpha
    ref_dx, ref_dalpha = entmax_backward(p.double(), g.double(), a_ref)
    assert dx.dtype == g.dtype and dalpha.dtype == torch.float32 and dalpha.shape == (p.shape[0],)
    scale = ref_dx.abs().max().clamp(min=1.0)
    torch.testing.assert_close(dx.double().cpu(), ref_dx, atol=rtol * scale, rtol=0)
    if p.dtype == torch.float32:
        scale_a = ref_dalpha.abs().max().clamp(min=1.0)
        torch.testing.assert_close(dalpha.double().cpu(), ref_dalpha.view(-1), atol=rtol * scale_a, rtol=0)
    else:
        # p stored in fp16/bf16 is off the simplex by ~1e-3 and dα carries that as
        # (Σp − 1)·Σgp/t² (where the kernel uses the direct form) or drops it (the
        # regrouped form near α = 1), so the float64 formula is no reference here. The
        # kernel reads fp16/bf16 into fp32 exactly: dα must be the fp32 run's.
        _, dalpha32 = rowwise.entmax_backward(p.float().to(DEVICE), g.float().to(DEVICE), a_dev, True,
                                                      config=config)
        torch.testing.assert_close(dalpha, dalpha32, atol=1e-6, rtol=1e-5)
    return dx, dalpha


@pytest.mark.parametrize("dtype, rtol", BWD_TOLS)
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_backward_matches_reference(n, alpha, dtype, rtol):
    p, g = _backward_case(n, alpha)
    dx, dalpha = _check_backward(p.to(dtype), g.to(dtype), alpha, rtol)
    assert torch.equal(dx[2], torch.zeros_like(dx[2])) and float(dalpha[2]) == 0.0


@pytest.mark.parametrize("alpha", [1.0, 1.3, 1.5, 2.0, 3.0, "per-row"])
def test_backward_chunked(alpha):
    if alpha == "per-row":
        alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 0.7])
    p, g = _backward_case(300, alpha, seed=4)
    dx, dalpha = _check_backward(p, g, alpha, 2e-5, config=CHUNKED)
    a_dev = alpha.to(DEVICE) if isinstance(alpha, torch.Tensor) else alpha
    dx_res, dalpha_res = rowwise.entmax_backward(p.to(DEVICE), g.to(DEVICE), a_dev, True)
    torch.testing.assert_close(dx, dx_res, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dalpha, dalpha_res, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype, rtol", BWD_TOLS)
@pytest.mark.parametrize("n", [1, 63, 1000])
def test_backward_per_row_alpha(n, dtype, rtol):
    gen = torch.Generator().manual_seed(n)
    alpha = torch.tensor([1.0, 1.25, 1.5, 2.0, 3.0, 0.7])
    x = torch.randn(6, n, generator=gen) * 2
    p = entmax_forward(x, alpha.view(-1, 1)).to(dtype)
    g = torch.randn(6, n, generator=gen).to(dtype)
    dx, _ = _check_backward(p, g, alpha, rtol)
    dx_only, none = rowwise.entmax_backward(p.to(DEVICE), g.to(DEVICE), alpha.to(DEVICE), False)
    assert none is None
    torch.testing.assert_close(dx_only, dx, atol=0, rtol=0)


def test_backward_nan_rows_stay_in_their_row():
    x = torch.randn(4, 9)
    p = entmax_forward(x, 1.5)
    p[1, 3] = math.nan
    g = torch.randn(4, 9)
    for alpha in (1.5, 1.3, torch.tensor([1.5, 1.3, 2.0, 1.0])):
        a = alpha.to(DEVICE) if isinstance(alpha, torch.Tensor) else alpha
        dx, dalpha = rowwise.entmax_backward(p.to(DEVICE), g.to(DEVICE), a, True)
        assert torch.isnan(dx[1]).all() and bool(torch.isnan(dalpha[1]))
        assert not torch.isnan(dx[[0, 2, 3]]).any() and not torch.isnan(dalpha[[0, 2, 3]]).any()


@pytest.mark.parametrize("dtype, rtol", BWD_TOLS[:2])
def test_alpha_gradient_near_one(dtype, rtol):
    """α → 1: dα's two O(1/t) terms cancel; the kernel's regrouped form keeps full accuracy.

    The reference is evaluated on p renormalised in float64: on p as stored (Σp = 1 only to
    rounding, ~1e-7) its literal formula adds (Σp − 1)·Σgp/t², an O(1) artifact at
    t = 1e-4 that the kernel deliberately drops (see entmax_rowwise_bwd_kernel).
    """
    alpha = torch.tensor([1.0001, 1.001, 1.01, 0.999, 0.99, 1.0])
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(8)) * 2
    x[2, ::4] = -math.inf
    p = entmax_forward(x, alpha.view(-1, 1)).to(dtype)
    g = torch.randn(6, 300, generator=torch.Generator().manual_seed(9)).to(dtype)
    _, dalpha = rowwise.entmax_backward(p.to(DEVICE), g.to(DEVICE), alpha.to(DEVICE), True)
    p64 = p.double() / p.double().sum(-1, keepdim=True)
    _, ref = entmax_backward(p64, g.double(), alpha.double().view(-1, 1))
    torch.testing.assert_close(dalpha.double().cpu(), ref.view(-1), atol=rtol * ref.abs().max().clamp(min=1.0),
                               rtol=0)


def test_backward_matches_finite_differences():
    """dx of the kernel equals central differences of the float64 reference forward."""
    x = torch.randn(2, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    g = torch.randn(2, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for alpha in (1.25, 1.5, 2.0):
        p = rowwise.entmax_forward(x.float().to(DEVICE), alpha)
        dx, _ = rowwise.entmax_backward(p, g.float().to(DEVICE), alpha, False)
        eps = 1e-6
        fd = torch.zeros_like(x)
        for j in range(17):
            e = torch.zeros_like(x)
            e[:, j] = eps
            fd[:, j] = ((entmax_forward(x + e, alpha) - entmax_forward(x - e, alpha)) * g).sum(-1) / (2 * eps)
        torch.testing.assert_close(dx.double().cpu(), fd, atol=1e-4, rtol=0)


KINDS = [common.ALPHA_GENERAL, common.ALPHA_SOFTMAX, common.ALPHA_ENTMAX15, common.ALPHA_SPARSEMAX]
CLOSED_FORM_KINDS = [common.ALPHA_ENTMAX15, common.ALPHA_SPARSEMAX]
TABLE_LENGTHS = [1, 2, 15, 16, 17, 100, 1024, 1025, 2048, 5000, 8192, 8193, 16384, 16385, 32768, 32769, 10 ** 6]


@pytest.mark.parametrize("kind", KINDS)
def test_config_table(kind):
    """Every length gets a tile that holds the row (resident) or a chunked sweep, with at
    most 32 fp32 entries per thread (64 for the closed forms' rows above 8192); every
    configuration is in the AOT list of its kind, under the kernel's α kind."""
    listed = {(c["constexprs"]["ROWS"], c["constexprs"]["BLOCK"], c["constexprs"]["RESIDENT"], c["num_warps"])
              for c in kernels.aot_configs() if c["constexprs"]["ALPHA_KIND"] == kind}
    for n in TABLE_LENGTHS:
        cfg = kernels.tile_config(n, kind)
        assert (cfg["ROWS"], cfg["BLOCK"], cfg["RESIDENT"], cfg["num_warps"]) in listed
        if cfg["RESIDENT"]:
            assert cfg["BLOCK"] >= n and cfg["BLOCK"] < max(32, 2 * n)
            per_thread = cfg["ROWS"] * cfg["BLOCK"] // (32 * cfg["num_warps"])
            assert per_thread <= (64 if kind in CLOSED_FORM_KINDS and n > 8192 else 32)
        else:
            assert n > kernels.RESIDENT_MAX_COLS[kind]


def test_config_table_by_kind():
    """Up to 8192 entries every kind takes one configuration. Above, sparsemax and entmax15
    rows stay resident on 16 warps up to 32768 entries and are chunked by 4 warps beyond;
    general-kind rows are chunked by 4 warps up to WIDE_CHUNK_COLS and by 8 beyond, softmax
    rows by 4 (`rowwise.tile_config`: the H200 sweeps at 16384 and 32768 entries)."""
    for n in range(1, 8193):
        assert all(kernels.tile_config(n, kind) == kernels.tile_config(n, common.ALPHA_GENERAL) for kind in KINDS)
    chunked = {"ROWS": 1, "BLOCK": kernels.CHUNK_BLOCK, "RESIDENT": False}
    for n in (8193, 16384, 32768):
        for kind in CLOSED_FORM_KINDS:
            assert kernels.tile_config(n, kind) == {"ROWS": 1, "BLOCK": 1 << (n - 1).bit_length(), "RESIDENT": True,
                                                    "num_warps": 16}
        assert kernels.tile_config(n, common.ALPHA_GENERAL) == dict(
            chunked, num_warps=8 if n > kernels.WIDE_CHUNK_COLS else 4)
        assert kernels.tile_config(n, common.ALPHA_SOFTMAX) == dict(chunked, num_warps=4)
    for kind in CLOSED_FORM_KINDS:
        assert kernels.tile_config(32769, kind) == dict(chunked, num_warps=4)
    assert kernels.tile_config(16384, common.ALPHA_GENERAL)["num_warps"] == 4
    assert kernels.tile_config(16385, common.ALPHA_GENERAL)["num_warps"] == 8


def test_bad_tuning_arguments_are_named():
    """The launcher's own knobs; the public arguments are checked once, by the public layer
    (tests/test_errors.py)."""
    x = torch.randn(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="max_passes must be >= 2"):
        rowwise._forward(x, 1.25, max_passes=1)
    with pytest.raises(ValueError, match="tol must be > 0"):
        rowwise._forward(x, 1.25, tol=0.0)


def test_empty_shapes():
    assert rowwise.entmax_forward(torch.randn(0, 7, device=DEVICE), 1.5).shape == (0, 7)
    assert rowwise.entmax_forward(torch.randn(3, 0, device=DEVICE), 1.25).shape == (3, 0)
    dx, dalpha = rowwise.entmax_backward(torch.zeros(3, 0, device=DEVICE), torch.zeros(3, 0, device=DEVICE),
                                                 1.5, True)
    assert dx.shape == (3, 0) and torch.equal(dalpha, torch.zeros(3, device=DEVICE))


def test_float_alpha_tensor_is_shared_per_device_and_value():
    """A python-float α is handed to the kernels in one (1,) tensor per (device, value),
    filled once; a tensor α is the caller's, never kept."""
    device = torch.device(DEVICE)
    kind, alpha_t, stride = rowwise._alpha_args(1.3, device)
    assert kind == common.ALPHA_GENERAL and stride == 0 and alpha_t.dtype == torch.float32 and alpha_t.shape == (1,)
    assert alpha_t.item() == torch.tensor(1.3, dtype=torch.float32).item()
    assert rowwise._alpha_args(1.3, device)[1] is alpha_t
    assert rowwise._alpha_args(1.7, device)[1] is not alpha_t
    kind, alpha_two, _ = rowwise._alpha_args(2.0, device)
    assert kind == common.ALPHA_SPARSEMAX and alpha_two.item() == 2.0
    elsewhere = rowwise._alpha_args(1.3, torch.device("meta"))[1]
    assert elsewhere.device.type == "meta" and elsewhere is not alpha_t
    alpha_rows = torch.full((4,), 1.3, device=device)
    assert rowwise._alpha_args(alpha_rows, device)[1] is alpha_rows
    assert not any(kept is alpha_rows for _, kept, _ in rowwise._FLOAT_ALPHA_ARGS.values())


def test_shared_alpha_tensor_is_left_as_filled():
    """The kernels only read α: after forwards and backwards at a general float α (with and
    without dα), the shared tensor still holds it."""
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    g = torch.randn(3, 40, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    p = rowwise.entmax_forward(x, 1.3)
    rowwise.entmax_backward(p, g, 1.3, False)
    rowwise.entmax_backward(p, g, torch.full((3,), 1.3, device=DEVICE), True)
    assert rowwise._alpha_args(1.3, x.device)[1].item() == torch.tensor(1.3).item()
    torch.testing.assert_close(rowwise.entmax_forward(x, 1.3), p, atol=0, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_launch_config_is_the_tile_table_read_only(kind):
    for n in TABLE_LENGTHS:
        cfg = dict(kernels.tile_config(n, kind))
        rows, num_warps, tile = rowwise._launch_config(n, kind)
        assert rows == cfg["ROWS"] and num_warps == cfg.pop("num_warps") and dict(tile) == cfg
        with pytest.raises(TypeError):
            tile["BLOCK"] = 1
    # The block is the next power of two, as triton.next_power_of_2 gives it.
    for n in range(1, 4097):
        assert kernels.tile_config(n, kind)["BLOCK"] == max(16, triton.next_power_of_2(n))


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.3, 1.0, "per-row"])
def test_backward_launches_the_forward_tiling(monkeypatch, alpha):
    """The backward of a row takes the configuration its forward took (same length, same α
    kind), at lengths where the kinds' tables differ."""
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(
                (self.kernel, grid, kwargs["num_warps"], {k: kwargs[k] for k in ("ROWS", "BLOCK", "RESIDENT")}))

    monkeypatch.setattr(rowwise, "entmax_rowwise_fwd_kernel", Recorder("fwd"))
    monkeypatch.setattr(rowwise, "entmax_rowwise_bwd_kernel", Recorder("bwd"))
    if alpha == "per-row":
        alpha = torch.full((2,), 1.5, device=DEVICE)
    for n in (100, 16384, 32768, 40000):
        x = torch.randn(2, n, device=DEVICE)
        rowwise._forward(x, alpha)
        rowwise.entmax_backward(x, x, alpha, isinstance(alpha, torch.Tensor))
        (fwd, *forward), (bwd, *backward) = launches[-2:]
        assert (fwd, bwd) == ("fwd", "bwd") and forward == backward


@pytest.mark.parametrize("n_rows", [1, 2, 3, 4, 5, 8, 9, 1000])
def test_grid_covers_every_row(monkeypatch, n_rows):
    """The launch grid (integer arithmetic on the host) is triton.cdiv(rows, ROWS)."""
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(rowwise, "entmax_rowwise_fwd_kernel", Recorder())
    monkeypatch.setattr(rowwise, "entmax_rowwise_bwd_kernel", Recorder())
    x = torch.randn(n_rows, 7, device=DEVICE)
    for config in (None, {"ROWS": 4, "BLOCK": 16, "RESIDENT": True, "num_warps": 1}):
        rowwise._forward(x, 1.3, config=config)
        rowwise.entmax_backward(x, x, 1.3, False, config=config)
        rows = 1 if config is None else 4
        assert grids[-2:] == [(triton.cdiv(n_rows, rows),)] * 2


def test_the_rowwise_table_compiles_every_cell_it_times_before_timing():
    """bench/bench_rowwise_gpu.py --jobs compiles each entmax_fast mapping's kernels for
    every shape and dtype of the table, each in a process of its own at the timed shape:
    every timed cell of entmax_fast's must be among them, once. The compile run itself is
    run here on CPU tensors for each mapping."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "bench_rowwise_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_rowwise_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ours = [name for name, (_, is_ours, _) in bench.methods(1, "cpu").items() if is_ours]
    assert len(ours) == 4
    runs = [bench.parse_args(command[2:]) for command in bench.compile_commands()]
    cells = [(run.compile_only, run.dtype, run.method) for run in runs]
    assert sorted(cells) == sorted((f"{n_rows}x{n_cols}", str(dtype).replace("torch.", ""), name)
                                   for n_rows, n_cols in bench.SHAPES for dtype in bench.DTYPES
                                   for name in ours)
    for name in ours:
        bench.compile_only("4x40", "bfloat16", name, device="cpu")
