"""fusedmax / oscarmax: CUDA operators (on a GPU) and C++ CPU operators vs torch.softmax.

On a GPU (torch.cuda.is_available() and the extension built with CUDA) it first prints the
GPU table, all in the same run: forward and forward+backward of the CUDA operators, the CPU
operator on the same machine, torch.softmax on the GPU, fp32, fusedmax at lam = 0.1 and
oscarmax at beta = 1e-3, shapes (1024, 512) and (65536, 1024), with three ratios: the
forward against softmax, the CPU operator against the CUDA one (at 1024x512), and
forward+backward against the forward. `--gpu-only` skips the CPU part.

Then, on any machine, the CPU table: median wall times (ms) measured in the same run:
- forward+backward, float32, X = randn(1024, 512): fusedmax at lam = 0.1, oscarmax at
  beta = 1e-3 (at beta >= 0.01 every OWL output of a 512-long randn row is clipped to 0 and
  the weights are uniform, a degenerate case); the reference is timed on a slice of rows
  and scaled, it loops in Python;
- the prox alone (Condat's TV algorithm) on one vector of length 1e6 at lam = 0.1, float64
  and float32;

torchsparseattn 0.2 is not compared: it is an sdist whose setup.py imports numpy and Cython
before pip can read its metadata, so `pip download --no-deps torchsparseattn==0.2` fails
(checked 2026-11-25) and installing it needs build tools the project does not.

Then the chain marginals (entmax_fast.chain): CRF and SparseMAP forward+backward on
4096 rows x 1024, float32, scores randn, one shared transition matrix per case, against
torch.softmax fwd+bwd in the same process, the three interleaved round by round (median of
the rounds), with SparseMAP's share of exact zeros and ones. `--chain-only` prints only this
table.

Usage: python bench/bench_structured.py [--repeat 20] [--threads N] [--gpu-only | --chain-only]
"""
import argparse
import os
import statistics
import time

import torch

import entmax_fast.chain as C
import entmax_fast.structured as S
from common import kernel_times
from entmax_fast.reference import structured as R


def median_ms(fn, repeat: int, warmup: int = 2) -> tuple[float, float]:
    """Median wall time and median CPU time of this process (all threads), in ms. On a
    shared, overloaded machine the CPU time is the steadier figure of the work done."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def fwd_bwd(mapping, X, grad):
    def run():
        x = X.detach().requires_grad_()
        mapping(x).backward(grad)
    return run


def cuda_median_ms(fn, repeat: int, warmup: int = 3) -> float:
    """Median GPU time of fn in ms, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn, repeat: int) -> float:
    """GPU time of fn's kernels per call in ms, without the host's: at 1024x512 a call's
    wall time is mostly its Python layers' (H200, 4642e72: fusedmax's forward 0.073 ms a
    call, 0.023 ms of kernels; docs/performance.md)."""
    return sum(kernel_times(fn, repeat).values())


def gpu_table(repeat: int) -> None:
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; CPU threads {torch.get_num_threads()}")
    mappings = (("fusedmax", lambda x: S.fusedmax(x, 0.1)), ("oscarmax", lambda x: S.oscarmax(x, 1e-3)))
    print(f"{'op, shape (fp32)':<28} {'CUDA fwd':>9} {'CUDA f+b':>9} {'CPU fwd':>9} {'softmax':>9} "
          f"{'fwd/softmax':>11} {'CPU/CUDA':>9} {'f+b/fwd':>8} {'kernels fwd':>11} {'kernels f+b':>11} "
          f"{'f+b/fwd':>8}")
    for rows, n in ((1024, 512), (65536, 1024)):
        torch.manual_seed(0)
        X = torch.randn(rows, n, device="cuda")
        grad = torch.randn(rows, n, device="cuda")
        softmax_ms = cuda_median_ms(lambda: torch.softmax(X, -1), repeat)
        for name, fn in mappings:
            forward_ms = cuda_median_ms(lambda: fn(X), repeat)
            both_ms = cuda_median_ms(fwd_bwd(fn, X, grad), repeat)
            assert S.last_backend(name)[0] == "cpp", S.last_backend(name)
            cpu_ms = float("nan")
            if rows * n <= 1024 * 512:  # the CPU op at 65536x1024 takes seconds: not timed
                X_cpu = X.cpu()
                cpu_ms = median_ms(lambda: fn(X_cpu), max(3, repeat // 4))[0]
            kernel_fwd = kernel_ms(lambda: fn(X), repeat)
            kernel_both = kernel_ms(fwd_bwd(fn, X, grad), repeat)
            print(f"{name + f' {rows}x{n}':<28} {forward_ms:9.3f} {both_ms:9.3f} {cpu_ms:9.3f} {softmax_ms:9.4f} "
                  f"{forward_ms / softmax_ms:11.1f} {cpu_ms / forward_ms:9.1f} {both_ms / forward_ms:8.2f} "
                  f"{kernel_fwd:11.3f} {kernel_both:11.3f} {kernel_both / kernel_fwd:8.2f}")
    print("fwd/softmax: the CUDA forward's time over softmax's; CPU/CUDA: the CPU operator's over the "
          "CUDA one's; f+b/fwd: forward+backward over forward. CUDA fwd / f+b: events around a call "
          "(the host's time where it is longer); kernels: the profiler's kernel time per call")


# Transitions of the chain rows, [previous, current]: a CRF that favours agreeing
# neighbours, and SparseMAP with T = 0 (clip(s, 0, 1)), attractive (w = 1: spans) and
# repulsive (w = -1) transitions.
CHAIN_CASES = (
    ("crf", "T = [[0.5, -0.5], [-0.5, 0.5]]", [[0.5, -0.5], [-0.5, 0.5]]),
    ("sparsemap", "T = 0", [[0.0, 0.0], [0.0, 0.0]]),
    ("sparsemap", "T = [[0.5, -0.5], [-0.5, 0.5]]", [[0.5, -0.5], [-0.5, 0.5]]),
    ("sparsemap", "T = [[-0.5, 0.5], [0.5, -0.5]]", [[-0.5, 0.5], [0.5, -0.5]]),
)


def chain_table(repeat: int) -> None:
    """CRF / SparseMAP fwd+bwd on (4096, 1024) float32 against softmax, interleaved."""
    torch.manual_seed(0)
    rows, n = 4096, 1024
    X = torch.randn(rows, n)
    grad = torch.randn(rows, n)
    cases = [("torch.softmax", "", fwd_bwd(lambda x: torch.softmax(x, -1), X, grad))]
    for kind, label, T in CHAIN_CASES:
        mapping = C.crf_marginals if kind == "crf" else C.sparsemap_marginals
        transitions = torch.tensor(T)
        cases.append((kind, label, fwd_bwd(lambda x, m=mapping, t=transitions: m(x, t), X, grad)))
    for _, _, run in cases:  # warm-up
        run()
    wall = {i: [] for i in range(len(cases))}
    for _ in range(repeat):
        for i, (_, _, run) in enumerate(cases):
            start = time.perf_counter()
            run()
            wall[i].append((time.perf_counter() - start) * 1e3)
    medians = [statistics.median(wall[i]) for i in range(len(cases))]
    backend = C.chain_backend(X, "crf")
    print(f"chain marginals, fwd+bwd, ({rows}, {n}) float32, randn scores; backend {backend[0]}; "
          f"{repeat} interleaved rounds, median; threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<48} {'wall ms':>9} {'x softmax':>10} {'exact 0':>8} {'exact 1':>8}")
    for (kind, label, _), ms in zip(cases, medians):
        zeros = ones = ""
        if kind == "sparsemap":
            T = torch.tensor(dict((lab, t) for _, lab, t in CHAIN_CASES)[label])
            mu = C.sparsemap_marginals(X, T)
            zeros, ones = f"{(mu == 0).double().mean():.3f}", f"{(mu == 1).double().mean():.3f}"
        print(f"{(kind + ' ' + label).strip():<48} {ms:9.1f} {ms / medians[0]:10.2f} {zeros:>8} {ones:>8}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gpu-only", action="store_true", help="print only the GPU table")
    parser.add_argument("--chain-only", action="store_true", help="print only the chain (CRF, SparseMAP) table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chain_only:
        chain_table(args.repeat)
        return
    if torch.cuda.is_available() and S.structured_backend(torch.zeros(1, device="cuda"))[0] == "cpp":
        gpu_table(args.repeat)
        if args.gpu_only:
            return
    elif args.gpu_only:
        raise SystemExit("--gpu-only: no GPU, or entmax_fast._C has no CUDA structured kernels")
    backend = S.structured_backend(torch.zeros(1))
    print(f"backend: {backend[0]} ({backend[1]}); torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}")

    torch.manual_seed(0)
    rows, n = 1024, 512
    X = torch.randn(rows, n)
    grad = torch.randn(rows, n)
    results = []
    softmax_ms = median_ms(fwd_bwd(lambda x: torch.softmax(x, -1), X, grad), args.repeat)
    results.append(("torch.softmax fwd+bwd (1024, 512)", softmax_ms))
    ref_rows = 32
    for name, cpp, ref in (("fusedmax", lambda x: S.fusedmax(x, 0.1), lambda x: R.fusedmax(x, 0.1)),
                           ("oscarmax", lambda x: S.oscarmax(x, 1e-3), lambda x: R.oscarmax(x, 1e-3))):
        cpp_fwd = median_ms(lambda: cpp(X), args.repeat)
        cpp_ms = median_ms(fwd_bwd(cpp, X, grad), args.repeat)
        ref_ms = tuple(t * rows / ref_rows for t in median_ms(fwd_bwd(ref, X[:ref_rows], grad[:ref_rows]), 3, warmup=1))
        results.append((f"{name} C++ forward (1024, 512)", cpp_fwd))
        results.append((f"{name} C++ fwd+bwd (1024, 512)", cpp_ms))
        results.append((f"{name} reference fwd+bwd (1024, 512, scaled from {ref_rows} rows)", ref_ms))
        print(f"{name}: C++ is {ref_ms[0] / cpp_ms[0]:.0f}x faster than the reference, "
              f"{cpp_ms[0] / softmax_ms[0]:.1f}x the time of torch.softmax (wall)")

    vector = torch.randn(1, 1_000_000, dtype=torch.float64)
    results.append(("tv1d_prox C++ length 1e6 float64, lam 0.1",
                    median_ms(lambda: torch.ops.entmax_fast.tv1d_prox(vector, 0.1, None), args.repeat)))
    vector32 = vector.float()
    results.append(("tv1d_prox C++ length 1e6 float32, lam 0.1",
                    median_ms(lambda: torch.ops.entmax_fast.tv1d_prox(vector32, 0.1, None), args.repeat)))
    results.append(("oscar_prox C++ length 1e6 float64, beta 1e-6",
                    median_ms(lambda: torch.ops.entmax_fast.oscar_prox(vector, 1e-6, None), 5)))

    width = max(len(name) for name, _ in results)
    print(f"{'case':<{width}}  wall ms   cpu ms")
    for name, (wall, cpu) in results:
        print(f"{name:<{width}}  {wall:8.3f} {cpu:8.3f}")
    print()
    chain_table(max(5, args.repeat // 4))


if __name__ == "__main__":
    main()
