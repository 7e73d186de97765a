"""Wide rows with supports of thousands, on every backend: each row sums to one within a few
float32 ulps and each weight matches the float64 oracle.

A threshold rounded to float32 is shared by every entry of the support, so its error adds up
over the support: sparsemax of 10007 zeros summed to 1 + 2.7e-4 when the C++ solver formed p
from a float32 threshold. The backends find the threshold, and form p from it, without that
rounding:

- reference and C++: the threshold and p in float64, rounded once to the output: each entry
  within a relative 1e-6 of the float64 answer.
- Triton: float32 arithmetic with the threshold as a float32 pair and the output normalised
  by its sum; u = x − max(x) is formed in float32, so an entry may also differ by the
  rounding of u (a few ulps of the row's score range: dp/du ≤ 1 for α ≥ 1), which a tiny
  weight at the edge of the support feels relatively.

The fused attention's threshold gets the same check on a key length of 32768 (1024 in the Triton
interpreter) with most keys in the support (a value column of ones makes an output column the
row sum of the weights).
"""
import functools
import os

import pytest
import torch

import entmax_fast
from oracle import oracle_entmax

FLOAT32_EPS = torch.finfo(torch.float32).eps
ROW_SUM_TOL = 2e-6  # a few float32 ulps of 1 (1.2e-7 each)

MAPPINGS = {
    "sparsemax": (lambda x: entmax_fast.sparsemax(x), 2.0),
    "entmax15": (lambda x: entmax_fast.entmax15(x), 1.5),
    "entmax_bisect_1.3": (lambda x: entmax_fast.entmax_bisect(x, alpha=1.3), 1.3),
}


@functools.lru_cache(maxsize=None)
def _rows(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if name.startswith("zeros"):
        return torch.zeros(1, int(name[len("zeros"):]))
    n = int(name[len("randn"):])
    # scores within ±4e-3: sparsemax keeps ~2000 entries, the others the whole row
    return torch.randn(2, n, generator=generator) * 1e-3


def _backends():
    backends = ["reference"]
    if entmax_fast.dispatch.availability("cpp")[0]:
        backends.append("cpp")
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    if entmax_fast.dispatch.availability("triton")[0] and (interpreter or torch.cuda.is_available()):
        backends.append("triton")
    return backends


@functools.lru_cache(maxsize=None)
def _expected_rows(rows: str, alpha: float) -> torch.Tensor:
    return oracle_entmax(_rows(rows), alpha)


# The fused attention's key length: 32768 where the kernels run compiled; the Triton
# interpreter takes about 10 s per 1000 keys of this case, so there it runs 1024. A threshold
# rounded to float32 would still show: over these rows' supports of several hundred keys its
# rounding (6e-8 per key) adds up to ~2e-5 in the row sum, ten times the tolerance.
INTERPRETED_KEYS = 1024


@functools.lru_cache(maxsize=None)
def _attention_case(alpha: float, query_scale: float, k_len: int):
    """q, k, v (its first column ones, so that the output's first column is the row sum of
    the weights), and the float64 oracle's weights (B, H, Lq, Lk) and output."""
    generator = torch.Generator().manual_seed(1)
    batch, heads, q_len, dim = 1, 1, 4, 16
    q = torch.randn(batch, heads, q_len, dim, generator=generator) * query_scale
    k = torch.randn(batch, heads, k_len, dim, generator=generator)
    v = torch.randn(batch, heads, k_len, dim, generator=generator)
    v[..., 0] = 1
    weights = oracle_entmax(q.double() @ k.double().transpose(-1, -2) / dim ** 0.5, alpha)
    return q, k, v, weights, weights @ v.double()


BACKENDS = _backends()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _device(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("rows", ["zeros1372", "zeros10007", "randn30011", "randn65536"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_rows_sum_to_one_and_match_float64(backend, rows):
    x = _rows(rows)
    for name, (mapping, alpha) in MAPPINGS.items():
        with entmax_fast.use_backend(backend):
            p = mapping(x.to(_device(backend))).cpu().double()
        expected = _expected_rows(rows, alpha)
        support = int((expected > 0).sum(-1).min())
        assert support >= 1000, (name, rows, support)
        row_sum_error = (p.sum(-1) - 1).abs().max().item()
        assert row_sum_error <= ROW_SUM_TOL, f"{name} on {rows}: row sum off by {row_sum_error:.2e}"
        u = x.double() - x.double().amax(-1, keepdim=True)
        score_resolution = 0.0 if backend != "triton" else 4 * FLOAT32_EPS * u.abs().max().item()
        bound = 1e-6 * expected + score_resolution + 1e-12
        worst = ((p - expected).abs() / bound).max().item()
        assert worst <= 1, f"{name} on {rows}: an entry off by {worst:.2f}x the bound"


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alpha, query_scale", [(1.5, 1e-2), (2.0, 1e-4)])
def test_attention_over_many_keys_sums_to_one(backend, alpha, query_scale):
    interpreted = backend == "triton" and DEVICE == "cpu"
    q, k, v, weights, expected = _attention_case(alpha, query_scale, INTERPRETED_KEYS if interpreted else 32768)
    support = int((weights > 0).sum(-1).min())
    assert support >= k.shape[-2] // 3, support
    device = _device(backend)
    with entmax_fast.use_backend(backend):
        out = entmax_fast.entmax_attention(*(t.to(device) for t in (q, k, v)), alpha=alpha).cpu().double()
    assert (out[..., 0] - 1).abs().max().item() <= ROW_SUM_TOL
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
