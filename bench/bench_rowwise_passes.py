"""Passes over the row the Triton root-finding forward needs, and the kernels' AOT table.

Question: how many reads of a row does `_entmax_fwd_root_kernel` (triton_kernels/rowwise.py)
make before |Σp − 1| ≤ 1e-6 in fp32, for α ∈ {1.25, 1.5, 2, 3}, n ∈ {1k, 8k, 64k} and
scores N(0, σ²), σ² ∈ {1, 6}? Goal: ≤ 4 in the worst case (entmax 1.3's bisection: 50;
AdaSplash's default: 1 max pass + 10).

Measured with the kernel itself in the Triton interpreter (no emulation): the kernel
reports its pass count per row (max pass + histogram pass + one per evaluation of F; the
output pass is not counted). Each row's stopping point is re-checked in float64: the
threshold c the kernel stopped at, plugged into the exact map, must give |Σp − 1| ≤ 1e-6
(column `max|F64|`).

    python bench/bench_rowwise_passes.py [--rows 16] [--no-aot] [--csv out.csv]

Then prints the AOT register/shared-memory table of every kernel config (triton_kernels/aot.py).
"""
import argparse
import csv
import importlib
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    try:
        return importlib.import_module(f"entmax_fast.triton_kernels.{name}")
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "triton_kernels" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def excess_float64(x: torch.Tensor, c: torch.Tensor, alpha: float) -> torch.Tensor:
    """|Σ_i [c + t·u_i]_+^(1/t) − 1| per row in float64 at the kernel's threshold c."""
    x64 = x.double()
    u = x64 - x64.amax(-1, keepdim=True)
    t = alpha - 1
    p = (c.double().sum(-1, keepdim=True) + t * u).clamp(min=0).pow(1 / t)
    return (p.sum(-1) - 1).abs()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="rows per (alpha, n, sigma^2)")
    parser.add_argument("--tol", type=float, default=1e-6)
    parser.add_argument("--alphas", default="1.25,1.5,2,3")
    parser.add_argument("--nbins", type=int, default=None, help="histogram bins (default: the kernel's)")
    parser.add_argument("--no-aot", action="store_true", help="skip the AOT resource table")
    parser.add_argument("--csv", type=str, default=None)
    args = parser.parse_args(argv)

    rowwise = _load("rowwise")
    results = []
    header = f"{'alpha':>5} {'n':>6} {'sigma2':>6} {'passes max':>10} {'mean':>5} {'max|F64|':>9} {'s':>5}"
    print(header)
    worst = 0
    nbins = args.nbins or rowwise.NBINS  # the kernel's choice for the block sizes of n ≥ 1k
    for alpha in (float(a) for a in args.alphas.split(",")):
        for n in (1024, 8192, 65536):
            for sigma2 in (1.0, 6.0):
                gen = torch.Generator().manual_seed(hash((alpha, n, sigma2)) % 2**31)
                x = torch.randn(args.rows, n, generator=gen) * math.sqrt(sigma2)
                start = time.perf_counter()
                _, c, passes = rowwise._forward(x, alpha, method="root", tol=args.tol, nbins=nbins)
                seconds = time.perf_counter() - start
                excess = excess_float64(x, c, alpha)
                row = {"alpha": alpha, "n": n, "sigma2": sigma2, "passes_max": int(passes.max()),
                       "passes_mean": float(passes.float().mean()), "max_excess_f64": float(excess.max())}
                results.append(row)
                worst = max(worst, row["passes_max"])
                print(f"{alpha:>5} {n:>6} {sigma2:>6} {row['passes_max']:>10} {row['passes_mean']:>5.2f} "
                      f"{row['max_excess_f64']:>9.1e} {seconds:>5.1f}", flush=True)
    print(f"worst case: {worst} passes (goal <= 4); rows per cell: {args.rows}; tol {args.tol}; "
          f"histogram bins {nbins}")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(results[0]))
            writer.writeheader()
            writer.writerows(results)

    if not args.no_aot:
        aot = _load("aot")
        rows = aot.check()
        print()
        print(aot.format_table(rows))
        found = aot.problems(rows)
        print(f"{len(rows)} compiles, {len(found)} problems")
        for line in found:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
