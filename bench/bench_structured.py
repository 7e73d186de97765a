"""fusedmax / oscarmax on CPU: C++ operators vs the plain-torch reference vs torch.softmax.

Prints a table of median wall times (ms) measured in the same run:
- forward+backward, float32, X = randn(1024, 512): fusedmax at lam = 0.1, oscarmax at
  beta = 1e-3 (at beta >= 0.01 every OWL output of a 512-long randn row is clipped to 0 and
  the weights are uniform, a degenerate case); the reference is timed on a slice of rows
  and scaled, it loops in Python;
- the prox alone (Condat's TV algorithm) on one vector of length 1e6 at lam = 0.1, float64
  and float32;

torchsparseattn 0.2 is not compared: it is an sdist whose setup.py imports numpy and Cython
before pip can read its metadata, so `pip download --no-deps torchsparseattn==0.2` fails
here (checked 2026-11-25) and installing it would need build tools outside the project.

Usage: python bench/bench_structured.py [--repeat 20] [--threads N]
"""
import argparse
import os
import statistics
import time

import torch

import entmax_fast.structured as S
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
