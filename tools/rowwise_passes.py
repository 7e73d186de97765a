"""Passes over the row the Triton forward needs, and the kernels' AOT table.

Question: how many evaluations over the row does `entmax_rowwise_fwd_kernel`
(triton_kernels/rowwise.py) make before it stops (certified exact support for α ∈ {1.5, 2},
|Σp − 1| ≤ 1e-6 in fp32 otherwise), for α ∈ {0.7, 1.25, 1.3, 1.5, 2, 3},
n ∈ {1k, 8k, 64k} and scores N(0, σ²), σ² ∈ {1, 6}? Rows of ≤ RESIDENT_MAX_COLS entries
make these passes over registers (a few operations per entry each); longer rows read the
row again per pass. (entmax 1.3's bisection: 50 passes; AdaSplash's default: 1 max pass +
10.)

Measured with the kernel itself in the Triton interpreter (no emulation): the kernel
reports its pass count per row (the max pass + one per evaluation; the output pass is not
counted). Each row's stopping point is re-checked in float64: the threshold c the kernel
stopped at, plugged into the exact map, must give |Σp − 1| ≤ 1e-6 (column `max|F64|`).

    python tools/rowwise_passes.py [--rows 8] [--no-aot] [--csv out.csv]

Then prints the AOT register/shared-memory table of every kernel config (triton_kernels/aot.py;
--aot-modules to add the attention kernels).

    python tools/rowwise_passes.py --gpu

(on a machine with a CUDA GPU) instead times the compiled forward: resident rows vs the
chunked sweep per row length (the evidence for RESIDENT_MAX_COLS), against torch.softmax
and entmax 1.3. Run as a script without --gpu, it sets TRITON_INTERPRET=1 first.
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

if __name__ == "__main__" and "--gpu" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    try:
        return importlib.import_module(f"entmax_fast.triton_kernels.{name}")
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(f"_tools_{name}", ROOT / "triton_kernels" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def _launchers():
    """The Triton backend's row-wise launchers (`_forward` returns the threshold and passes)."""
    return importlib.import_module("entmax_fast.backends.triton.rowwise")


def excess_float64(x: torch.Tensor, c: torch.Tensor, alpha: float) -> torch.Tensor:
    """|Σ_i [c + t·u_i]_+^(1/t) − 1| per row in float64 at the kernel's threshold c."""
    x64 = x.double()
    u = x64 - x64.amax(-1, keepdim=True)
    t = alpha - 1
    p = (c.double().sum(-1, keepdim=True) + t * u).clamp(min=0).pow(1 / t)
    return (p.sum(-1) - 1).abs()


def _cuda_ms(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gpu_timing(rows: int = 4096) -> int:
    """ms per call on (rows·1024/n, n) fp32 N(0, 1) scores: the table's configuration, the
    chunked sweep forced, torch.softmax and entmax 1.3."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("--gpu needs a CUDA device and TRITON_INTERPRET unset")
        return 1
    import entmax

    rowwise = _launchers()
    chunk_block = importlib.import_module("entmax_fast.triton_kernels.rowwise").CHUNK_BLOCK
    chunked = {"ROWS": 1, "BLOCK": chunk_block, "RESIDENT": False, "num_warps": 4}
    baselines = {1.5: entmax.entmax15, 2.0: entmax.sparsemax,
                 1.3: lambda z: entmax.entmax_bisect(z, 1.3), 3.0: lambda z: entmax.entmax_bisect(z, 3.0)}
    print(f"{'alpha':>5} {'n':>6} {'softmax':>8} {'table':>8} {'chunked':>8} {'entmax1.3':>9}  (ms; rows={rows}·1024/n)")
    for alpha in (1.5, 2.0, 1.3, 3.0):
        for n in (128, 1024, 4096, 8192, 16384, 65536):
            x = torch.randn(max(1, rows * 1024 // n), n, device="cuda")
            soft = _cuda_ms(lambda: torch.softmax(x, -1))
            table = _cuda_ms(lambda: rowwise._forward(x, alpha))
            swept = _cuda_ms(lambda: rowwise._forward(x, alpha, config=chunked))
            ref = _cuda_ms(lambda: baselines[alpha](x), reps=5)
            print(f"{alpha:>5} {n:>6} {soft:>8.3f} {table:>8.3f} {swept:>8.3f} {ref:>9.3f}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows per (alpha, n, sigma^2)")
    parser.add_argument("--tol", type=float, default=1e-6)
    parser.add_argument("--alphas", default="0.7,1.25,1.3,1.5,2,3")
    parser.add_argument("--no-aot", action="store_true", help="skip the AOT resource table")
    parser.add_argument("--aot-modules", default="rowwise", help="comma list of kernel modules")
    parser.add_argument("--csv", type=str, default=None)
    parser.add_argument("--gpu", action="store_true", help="time the compiled kernels on a CUDA GPU")
    args = parser.parse_args(argv)
    if args.gpu:
        return gpu_timing()

    rowwise = _launchers()
    results = []
    header = f"{'alpha':>5} {'n':>6} {'sigma2':>6} {'passes max':>10} {'mean':>5} {'max|F64|':>9} {'s':>5}"
    print(header)
    worst = {}
    for alpha in (float(a) for a in args.alphas.split(",")):
        for n in (1024, 8192, 65536):
            for sigma2 in (1.0, 6.0):
                gen = torch.Generator().manual_seed(hash((alpha, n, sigma2)) % 2**31)
                x = torch.randn(args.rows, n, generator=gen) * math.sqrt(sigma2)
                start = time.perf_counter()
                _, c, passes, _ = rowwise._forward(x, alpha, tol=args.tol)
                seconds = time.perf_counter() - start
                excess = excess_float64(x, c, alpha)
                row = {"alpha": alpha, "n": n, "sigma2": sigma2, "passes_max": int(passes.max()),
                       "passes_mean": float(passes.float().mean()), "max_excess_f64": float(excess.max())}
                results.append(row)
                worst[alpha] = max(worst.get(alpha, 0), row["passes_max"])
                print(f"{alpha:>5} {n:>6} {sigma2:>6} {row['passes_max']:>10} {row['passes_mean']:>5.2f} "
                      f"{row['max_excess_f64']:>9.1e} {seconds:>5.1f}", flush=True)
    print("worst case per alpha: " + ", ".join(f"{a:g}: {w}" for a, w in worst.items())
          + f" passes; rows per cell: {args.rows}; tol {args.tol}")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(results[0]))
            writer.writeheader()
            writer.writerows(results)

    if not args.no_aot:
        aot = _load("aot")
        rows = aot.check(modules=tuple(args.aot_modules.split(",")))
        print()
        print(aot.format_table(rows))
        found = aot.problems(rows)
        print(f"{len(rows)} compiles, {len(found)} problems")
        for line in found:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
