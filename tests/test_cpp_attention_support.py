"""The C++ CPU attention's support sizes (op "attention_support": the forward's row statistics,
then the scores recomputed tile by tile), through the public support_size: against the
reference backend's counts and the reference weights' support in float64 at ragged lengths
across the 64-query tile, with GQA, closed-form and general α and every score option; in
float32 and bf16 against the C++ forward's own zeros (its output for one-hot values is its
weights) and against the float64 support on the rows where no weight is near zero; NaN and
fully masked rows count 0; the operator under opcheck. Skipped, with the reason, when the
extension is not built."""
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import entmax_fast
from entmax_fast import dispatch
from entmax_fast.backends import cpp as cpp_backend
from entmax_fast.backends.cpp import loader

_AVAILABLE, _REASON = dispatch.availability("cpp")
_AVAILABLE = _AVAILABLE and loader.has_support_op()
pytestmark = [pytest.mark.skipif(not _AVAILABLE, reason=f"C++ attention support op unavailable: {_REASON}"),
              # torch warns that SDPA gives NaN rows where a lower-right causal mask leaves a
              # query no key; here such rows are zeros, as fully masked rows are.
              pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs:UserWarning")]

B, H, HKV, E = 2, 4, 2, 8
# 1.5 and 2 take the closed forms, 1.25 the general solver; a per-head tensor mixes them.
ALPHAS = [pytest.param(1.5, id="a1.5"), pytest.param(2.0, id="a2"), pytest.param(1.25, id="a1.25"),
          pytest.param((1.5, 2.0, 1.25, 1.5), id="heads")]
MIXED_ALPHA = (1.25, 1.5, 2.0, 1.25)
# Lengths on both sides of the 64-query tile, neither (beyond 1) a multiple of it.
LENGTHS = [pytest.param(1, 1, id="1x1"), pytest.param(1, 200, id="1x200"), pytest.param(7, 11, id="7x11"),
           pytest.param(37, 64, id="37x64"), pytest.param(130, 200, id="130x200"), pytest.param(130, 11, id="130x11")]
# Crossing the tile (Lq > 64), Lq < Lk, and Lq > Lk.
OPTION_LENGTHS = [pytest.param(70, 133, id="70x133"), pytest.param(37, 11, id="37x11")]
OPTION_CASES = ["causal", "bool_mask", "additive_mask", "window", "lower_right", "softcap", "alibi", "sinks", "all"]
# A row is compared with the float64 support only when no weight, float64 or this backend's,
# lies in (0, ((α − 1) δ)^(1/(α − 1))): the weight of a score within δ of the threshold, far
# more than the float32 scores' rounding.
NEAR_THRESHOLD = 1e-3


def _inputs(lq, lk, dtype, seed):
    """q scaled up so that rows are sparse."""
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, lq, E, generator=generator, dtype=torch.float64) * 2).to(dtype)
    k = torch.randn(B, HKV, lk, E, generator=generator, dtype=torch.float64).to(dtype)
    return q, k


def _alpha(alpha, dtype):
    return torch.tensor(alpha, dtype=dtype) if isinstance(alpha, tuple) else alpha


def _options(case, lq, lk, dtype):
    """Keyword arguments of support_size for option case ``case``."""
    generator = torch.Generator().manual_seed(11)
    bool_mask = torch.rand(B, 1, lq, lk, generator=generator) > 0.3
    bool_mask[:, :, lq // 2] = False  # a row whose keys are all masked
    additive = torch.randn(B, H, lq, lk, generator=generator, dtype=torch.float64)
    additive[torch.rand(B, H, lq, lk, generator=generator) < 0.2] = float("-inf")
    additive[:, 1, ::3] = float("-inf")  # rows whose keys are all masked
    slopes = torch.rand(B, H, generator=generator) * 0.2
    sinks = torch.randn(H, generator=generator, dtype=torch.float64).to(dtype)
    cases = {
        "causal": {"is_causal": True},
        "bool_mask": {"attn_mask": bool_mask},
        "additive_mask": {"attn_mask": additive.to(dtype)},
        "window": {"window_size": (9, 3)},
        "lower_right": {"attn_mask": causal_lower_right(lq, lk)},
        "softcap": {"softcap": 1.5},
        "alibi": {"alibi_slopes": slopes},
        "sinks": {"sinks": sinks},
        "all": {"window_size": (20, 2), "softcap": 2.0, "alibi_slopes": slopes, "sinks": sinks,
                "attn_mask": additive.to(dtype)},
    }
    return cases[case]


def _as_float64(options):
    """Floating tensors as float64 (a CausalBias, a tensor subclass, stays as it is)."""
    return {name: value.double() if type(value) is torch.Tensor and value.is_floating_point() else value
            for name, value in options.items()}


def cpp_support(q, k, alpha, **options):
    """support_size on the C++ backend, which must count the call itself."""
    with entmax_fast.use_backend("cpp"):
        counts = entmax_fast.support_size(q, k, enable_gqa=True, alpha=alpha, **options)
    assert entmax_fast.backend_info()["last_choice"]["attention_support"]["backend"] == "cpp"
    assert counts.dtype == torch.int64 and counts.shape == q.shape[:3]
    return counts


def reference_support(q, k, alpha, **options):
    """The reference backend's support_size for the same call."""
    with entmax_fast.use_backend("reference"):
        counts = entmax_fast.support_size(q, k, enable_gqa=True, alpha=alpha, **options)
    assert entmax_fast.backend_info()["last_choice"]["attention_support"]["backend"] == "reference"
    return counts


def reference_weights(q, k, alpha, **options):
    """attention_weights on the reference backend."""
    with entmax_fast.use_backend("reference"):
        return entmax_fast.attention_weights(q, k, enable_gqa=True, alpha=alpha, **options)


def cpp_forward_weights(q, k, alpha, **options):
    """The C++ entmax_attention's weights: its output for one-hot values."""
    lk = k.shape[2]
    one_hot = torch.eye(lk, dtype=q.dtype).expand(B, HKV, lk, lk)
    with entmax_fast.use_backend("cpp"):
        weights = entmax_fast.entmax_attention(q, k, one_hot, enable_gqa=True, alpha=alpha, **options)
    assert entmax_fast.backend_info()["last_choice"]["attention"]["backend"] == "cpp"
    return weights


def _clear_rows(alpha, *weights):
    """(B, H, Lq) True where no weight of any of ``weights`` is near the threshold."""
    alphas = torch.tensor(alpha if isinstance(alpha, tuple) else (alpha,) * H, dtype=torch.float64)
    smallest = ((alphas - 1) * NEAR_THRESHOLD) ** (1 / (alphas - 1))
    near = [((w.double() > 0) & (w.double() < smallest.view(1, H, 1, 1))).any(-1) for w in weights]
    return ~torch.stack(near).any(0)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("lq,lk", LENGTHS)
def test_ragged_lengths_match_the_reference(lq, lk, alpha):
    q, k = _inputs(lq, lk, torch.float64, seed=lq * 1000 + lk)
    alpha = _alpha(alpha, torch.float64)
    counts = cpp_support(q, k, alpha)
    torch.testing.assert_close(counts, reference_support(q, k, alpha), rtol=0, atol=0)
    torch.testing.assert_close(counts, (reference_weights(q, k, alpha) > 0).sum(-1), rtol=0, atol=0)
    torch.testing.assert_close(counts, (cpp_forward_weights(q, k, alpha) > 0).sum(-1), rtol=0, atol=0)
    assert (counts >= 1).all()
    if lk > 11:
        assert (counts < lk).any()  # sparse rows: the count is not the key length


@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("lq,lk", OPTION_LENGTHS)
def test_score_options_match_the_reference_in_float64(lq, lk, case):
    q, k = _inputs(lq, lk, torch.float64, seed=3)
    alpha = torch.tensor(MIXED_ALPHA, dtype=torch.float64)
    options = _options(case, lq, lk, torch.float64)
    counts = cpp_support(q, k, alpha, **options)
    torch.testing.assert_close(counts, reference_support(q, k, alpha, **options), rtol=0, atol=0)
    torch.testing.assert_close(counts, (cpp_forward_weights(q, k, alpha, **options) > 0).sum(-1), rtol=0, atol=0)
    if case in ("bool_mask", "additive_mask", "all"):
        assert (counts == 0).any()  # the fully masked rows


# Each option is checked in float64 above; here the plain call, masks, sinks and all at once.
LOW_PRECISION_CASES = [pytest.param(dtype, case, id=f"{name}-{case}")
                       for dtype, name, cases in ((torch.float32, "f32", ("plain", "causal", "additive_mask", "sinks",
                                                                          "all")),
                                                  (torch.bfloat16, "bf16", ("plain", "lower_right", "all")))
                       for case in cases]


@pytest.mark.parametrize("dtype,case", LOW_PRECISION_CASES)
def test_low_precision_counts_the_forwards_zeros(dtype, case):
    """Exactly the C++ forward's nonzero weights; the float64 support of the same (rounded)
    inputs, and in float32 the reference backend's, on the rows where no weight is near zero."""
    lq, lk = 70, 133
    q, k = _inputs(lq, lk, dtype, seed=4)
    options = {} if case == "plain" else _options(case, lq, lk, dtype)
    alpha = torch.tensor(MIXED_ALPHA, dtype=dtype)
    counts = cpp_support(q, k, alpha, **options)
    cpp_weights = cpp_forward_weights(q, k, alpha, **options)
    torch.testing.assert_close(counts, (cpp_weights > 0).sum(-1), rtol=0, atol=0)

    q64, k64, alpha64, options64 = q.double(), k.double(), alpha.double(), _as_float64(options)
    expected64 = reference_support(q64, k64, alpha64, **options64)
    clear = _clear_rows(MIXED_ALPHA, cpp_forward_weights(q64, k64, alpha64, **options64), cpp_weights)
    assert clear.float().mean() > 0.5, "too few rows away from the threshold to compare"
    torch.testing.assert_close(counts[clear], expected64[clear], rtol=0, atol=0)
    if dtype == torch.float32:
        expected32 = reference_support(q, k, alpha, **options)
        torch.testing.assert_close(counts[clear], expected32[clear], rtol=0, atol=0)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sink", "sinks"])
def test_nan_and_fully_masked_rows_count_zero(with_sinks):
    lq, lk = 70, 64
    q, k = _inputs(lq, lk, torch.float32, seed=5)
    q[0, 1, 3, 2] = float("nan")
    q[1, 3, 66, 0] = float("nan")  # in the second query tile
    mask = torch.zeros(B, H, lq, lk)
    mask[:, :, 10] = float("-inf")
    mask[1, 2, 65] = float("-inf")
    options = {"attn_mask": mask}
    if with_sinks:
        options["sinks"] = torch.randn(H, generator=torch.Generator().manual_seed(6))
    alpha = torch.tensor(MIXED_ALPHA)
    counts = cpp_support(q, k, alpha, **options)
    assert counts[0, 1, 3] == 0 and counts[1, 3, 66] == 0
    assert (counts[:, :, 10] == 0).all() and counts[1, 2, 65] == 0
    zero_rows = torch.zeros(B, H, lq, dtype=torch.bool)
    zero_rows[0, 1, 3] = zero_rows[1, 3, 66] = zero_rows[1, 2, 65] = True
    zero_rows[:, :, 10] = True
    assert (counts[~zero_rows] > 0).all()
    torch.testing.assert_close(counts, reference_support(q, k, alpha, **options), rtol=0, atol=0)
    weights = cpp_forward_weights(q, k, alpha, **options)
    assert weights[0, 1, 3].isnan().all()
    torch.testing.assert_close(counts, (weights > 0).sum(-1), rtol=0, atol=0)


def test_refused_without_the_operator(monkeypatch):
    """An extension built before the operator existed: the backend refuses the op, saying why
    (dispatch then leaves the call to the reference backend)."""
    request = dispatch.Request(torch.device("cpu"), torch.float32, {"alpha": 1.5, "dropout_p": 0.0})
    assert cpp_backend.supports("attention_support", request) is None
    monkeypatch.setattr(loader, "has_support_op", lambda: False)
    reason = cpp_backend.supports("attention_support", request)
    assert reason is not None and "no attention support-size operator" in reason
    assert cpp_backend.supports("attention", request) is None


def test_operator_passes_opcheck():
    """The operator's schema and fake kernel (torch.compile) with every option set."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 70, 8, generator=generator)
    k = torch.randn(2, 2, 75, 8, generator=generator)
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25], dtype=torch.float64)
    slopes, sinks = torch.rand(2, 4, generator=generator), torch.randn(4, generator=generator)
    options = ([5, 2], 1.5, slopes, sinks)
    _, stats, *_ = torch.ops.entmax_fast.entmax_attention_fwd(q, k, k.new_zeros(2, 2, 75, 1), None, alpha, 0.3, False,
                                                              *options)
    torch.library.opcheck(torch.ops.entmax_fast.entmax_attention_support,
                          (q, k, None, stats, alpha, 0.3, False, *options))
