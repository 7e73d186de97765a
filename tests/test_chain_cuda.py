"""The CRF / SparseMAP CUDA kernels (csrc/cuda/chain.cu), run on the host with the CUDA
built-ins of tests/test_structured.py's emulation harness, against the float64 reference:
the launch plan, the grid-stride loop over rows, the per-thread scratch of the CRF
(filled with NaN bytes, so a read of an unwritten entry shows), masks and NaN rows. The
kernels hold no barrier, so the harness runs each block's threads one after another."""
import ctypes
import pathlib
import shutil
import subprocess

import pytest
import torch

from entmax_fast.reference import chain as R
from test_structured import EMULATION_HARNESS

HARNESS_MARK = "#define ENTMAX_FAST_HOST_EMULATION"

CHAIN_HARNESS = r"""
#define ENTMAX_FAST_HOST_EMULATION
#include "chain.cu"

using namespace entmax_fast::chain_cuda;

template <typename Kernel>
void run_threads(const ChainLaunchPlan& plan, Kernel kernel) {
  blockDim.x = plan.threads;
  gridDim.x = static_cast<unsigned>(plan.blocks);
  for (int64_t block = 0; block < plan.blocks; ++block) {
    blockIdx.x = static_cast<unsigned>(block);
    for (int t = 0; t < plan.threads; ++t) {
      threadIdx.x = static_cast<unsigned>(t);
      kernel();
    }
  }
}

template <typename T>
void forward(int kind, const T* x, const T* transitions, T* mu, double* saved, int64_t rows, int64_t n,
             int64_t max_threads) {
  if (rows == 0 || n == 0) return;
  const ChainLaunchPlan plan = plan_chain_launch(rows, max_threads);
  std::vector<double> scratch(kind == 0 ? plan.blocks * plan.threads * 3 * n : 0);
  std::memset(static_cast<void*>(scratch.data()), 0xff, scratch.size() * sizeof(double));
  const ChainParams<T> params{kind, nullptr, x, transitions, mu, saved, nullptr, nullptr, scratch.data(), rows, n};
  run_threads(plan, [&params] { chain_forward_kernel<T>(params); });
}

template <typename T>
void backward(int kind, const T* grad, const T* x, const T* transitions, const double* saved, T* dx, T* dt,
              int64_t rows, int64_t n, int64_t max_threads) {
  if (rows == 0 || n == 0) return;
  const ChainLaunchPlan plan = plan_chain_launch(rows, max_threads);
  std::vector<double> scratch(kind == 0 ? plan.blocks * plan.threads * 5 * n : 0);
  std::memset(static_cast<void*>(scratch.data()), 0xff, scratch.size() * sizeof(double));
  const ChainParams<T> params{kind, grad, x, transitions, nullptr, const_cast<double*>(saved), dx, dt,
                              scratch.data(), rows, n};
  run_threads(plan, [&params] { chain_backward_kernel<T>(params); });
}

extern "C" {
void chain_forward_f32(int k, const float* x, const float* t, float* mu, double* saved, int64_t rows, int64_t n,
                       int64_t max_threads) { forward<float>(k, x, t, mu, saved, rows, n, max_threads); }
void chain_forward_f64(int k, const double* x, const double* t, double* mu, double* saved, int64_t rows, int64_t n,
                       int64_t max_threads) { forward<double>(k, x, t, mu, saved, rows, n, max_threads); }
void chain_backward_f32(int k, const float* g, const float* x, const float* t, const double* saved, float* dx,
                        float* dt, int64_t rows, int64_t n, int64_t max_threads) {
  backward<float>(k, g, x, t, saved, dx, dt, rows, n, max_threads);
}
void chain_backward_f64(int k, const double* g, const double* x, const double* t, const double* saved, double* dx,
                        double* dt, int64_t rows, int64_t n, int64_t max_threads) {
  backward<double>(k, g, x, t, saved, dx, dt, rows, n, max_threads);
}
void chain_plan(int64_t rows, int64_t max_threads, int64_t* out) {
  const ChainLaunchPlan plan = plan_chain_launch(rows, max_threads);
  out[0] = plan.threads;
  out[1] = plan.blocks;
}
}
"""


@pytest.fixture(scope="module")
def emulated_chain(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    assert EMULATION_HARNESS.count(HARNESS_MARK) == 1
    prelude = EMULATION_HARNESS.split(HARNESS_MARK)[0]
    source_dir = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "cuda"
    build = tmp_path_factory.mktemp("chain_cuda_emulation")
    (build / "harness.cpp").write_text(prelude + CHAIN_HARNESS)
    library = build / "harness.so"
    result = subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-I", str(source_dir),
                             str(build / "harness.cpp"), "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-6000:]
    return ctypes.CDLL(str(library))


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def run_emulated(lib, kind: str, x, transitions, grad, max_threads: int = 1 << 16):
    """(mu, dx, dtransitions) of the emulated kernels on (R, n) rows and (R, 2, 2) transitions."""
    rows, n = x.shape
    suffix = "f32" if x.dtype == torch.float32 else "f64"
    kind_id = 0 if kind == "crf" else 1
    mu = torch.full_like(x, 12345.0)
    saved = torch.full(x.shape, 12345.0, dtype=torch.float64)
    getattr(lib, f"chain_forward_{suffix}")(kind_id, ptr(x), ptr(transitions), ptr(mu), ptr(saved),
                                            ctypes.c_int64(rows), ctypes.c_int64(n), ctypes.c_int64(max_threads))
    dx = torch.full_like(x, 12345.0)
    dt = torch.full_like(transitions, 12345.0)
    getattr(lib, f"chain_backward_{suffix}")(kind_id, ptr(grad), ptr(x), ptr(transitions), ptr(saved), ptr(dx),
                                             ptr(dt), ctypes.c_int64(rows), ctypes.c_int64(n),
                                             ctypes.c_int64(max_threads))
    return mu, dx, dt


def ragged(rows, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 2
    x = x.masked_fill(torch.rand(rows, n, generator=gen) < 0.2, float("-inf"))
    x[min(1, rows - 1)] = float("-inf")
    T = torch.randn(rows, 2, 2, generator=gen, dtype=torch.float64) * 1.5
    T[0] = torch.tensor([[0.3, -1.0], [-1.0, 1.5]])
    T[-1] = torch.tensor([[0.0, 1.0], [1.2, -0.5]])
    return x.to(dtype).contiguous(), T.to(dtype).contiguous()


@pytest.mark.parametrize("kind", ["crf", "sparsemap"])
@pytest.mark.parametrize("n,rows,max_threads", [(1, 7, 1 << 16), (2, 7, 1 << 16), (9, 7, 1 << 16), (130, 7, 1 << 16),
                                                 (5, 300, 128)])  # 128 threads over 300 rows: 2-3 rows each
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_emulated_kernels_match_reference(emulated_chain, kind, n, rows, dtype, atol, max_threads):
    x, T = ragged(rows, n, dtype, seed=n + rows)
    grad = torch.randn(rows, n, dtype=dtype)
    mu, dx, dt = run_emulated(emulated_chain, kind, x, T, grad, max_threads)
    x64, T64 = x.double().requires_grad_(), T.double().requires_grad_()
    mapping = R.crf_marginals if kind == "crf" else R.sparsemap_marginals
    expected = mapping(x64, T64)
    expected.backward(grad.double())
    torch.testing.assert_close(mu.double(), expected.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(dx.double(), x64.grad, atol=10 * atol, rtol=1e-4 if dtype == torch.float32 else 0)
    dt_expected = torch.zeros_like(T64) if T64.grad is None else T64.grad  # n = 1: no edge uses T
    torch.testing.assert_close(dt.double(), dt_expected, atol=10 * atol * n, rtol=1e-4 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("kind", ["crf", "sparsemap"])
def test_emulated_nan_rows(emulated_chain, kind):
    x = torch.randn(3, 6, dtype=torch.float64)
    x[0, 1] = float("nan")
    x[2, 5] = float("inf")
    T = torch.randn(3, 2, 2, dtype=torch.float64)
    mu, dx, dt = run_emulated(emulated_chain, kind, x, T, torch.randn(3, 6, dtype=torch.float64))
    for row in (0, 2):
        assert torch.isnan(mu[row]).all() and torch.isnan(dx[row]).all() and torch.isnan(dt[row]).all()
    mapping = R.crf_marginals if kind == "crf" else R.sparsemap_marginals
    torch.testing.assert_close(mu[1], mapping(x[1], T[1]), atol=1e-10, rtol=0)


def test_emulated_launch_plan(emulated_chain):
    out = (ctypes.c_int64 * 2)()
    for rows, cap, blocks in ((1, 1 << 16, 1), (128, 1 << 16, 1), (129, 1 << 16, 2), (4096, 1 << 16, 32),
                              (10 ** 6, 1 << 16, 512), (300, 128, 1)):
        emulated_chain.chain_plan(ctypes.c_int64(rows), ctypes.c_int64(cap), out)
        assert (out[0], out[1]) == (128, blocks)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_emulated_sparsemap_at_zero_w(emulated_chain, dtype, atol):
    # Rows at w = T00 + T11 − T01 − T10 = 0, where the loss has a kink in w: scores on a grid
    # shifted off 0 and 1 (c stays inside the clip's open ends), with exact ties between
    # neighbours and after the flip, masked keys; the gradient in T is the reference's rule.
    gen = torch.Generator().manual_seed(3)
    rows, n = 40, 11
    x = (torch.randint(-16, 81, (rows, n), generator=gen).to(torch.float64) + 0.5) / 64
    x[0, 2:6] = 0.5 + 1 / 128
    x[1, 3], x[1, 4] = 0.25 + 1 / 128, 0.75 - 1 / 128
    x = x.masked_fill(torch.rand(rows, n, generator=gen) < 0.15, float("-inf"))
    zero_w = [[[0.0, 0.0], [0.0, 0.0]], [[0.25, 0.5], [-0.25, 0.0]], [[1.0, 0.75], [0.0, -0.25]]]
    T = torch.tensor([zero_w[r % 3] for r in range(rows)], dtype=torch.float64)
    grad = torch.randint(-4, 5, (rows, n), generator=gen).to(torch.float64)
    x, T, grad = x.to(dtype).contiguous(), T.to(dtype).contiguous(), grad.to(dtype).contiguous()
    mu, dx, dt = run_emulated(emulated_chain, "sparsemap", x, T, grad)
    x64, T64 = x.double().requires_grad_(), T.double().requires_grad_()
    expected = R.sparsemap_marginals(x64, T64)
    expected.backward(grad.double())
    torch.testing.assert_close(mu.double(), expected.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(dx.double(), x64.grad, atol=atol, rtol=0)
    torch.testing.assert_close(dt.double(), T64.grad, atol=atol * n, rtol=0)
    w_part = (dt.double() * torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=torch.float64)).sum((-2, -1)) / 4
    assert (w_part.abs() > 0.1).sum() >= 3 and (w_part == 0).sum() >= 3  # both kinds of rows
