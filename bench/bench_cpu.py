"""CPU figures of the C++ backend (issue 6), ratios measured in one run.

1. Row-wise mappings, float32, forward + backward (gradient w.r.t. x), at (4096, 1024) and
   (256, 8192): the C++ ops vs their `entmax` 1.3 counterparts (sparsemax, entmax15,
   entmax_bisect with one α per row). Target: >= 5x faster (goal 10x).
2. Entmax attention (α = 1.5), float32, B=2, H=8, L=2048, E=64, forward + backward: time and
   peak memory vs torch's scaled_dot_product_attention. Targets: <= 3x its time, <= 2x its
   peak memory. Peak memory is the process's peak resident set above the resident set
   before the call (inputs already allocated), each method in a fresh subprocess with the
   peak counter reset (/proc/self/clear_refs), so no allocation is missed between samples.

Usage: python bench/bench_cpu.py [--repeat N] [--skip-attention] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import entmax as entmax13
from entmax_fast import cpp_ops

ATTENTION_SHAPE = dict(B=2, H=8, L=2048, E=64)


def _median_ms(fn, repeat: int) -> float:
    fn()  # warm-up (thread pool, allocator)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _fwd_bwd(fn, x, grad):
    def run():
        leaf = x.detach().requires_grad_()
        out = fn(leaf)
        torch.autograd.grad(out, leaf, grad)
    return run


def bench_mappings(repeat: int):
    rows = []
    for shape in [(4096, 1024), (256, 8192)]:
        torch.manual_seed(0)
        x = torch.randn(*shape)
        grad = torch.randn(*shape)
        alpha_rows = torch.linspace(1.1, 1.9, shape[0])
        cases = [
            ("sparsemax", lambda t: entmax13.sparsemax(t, dim=-1), lambda t: cpp_ops.entmax_rowwise_forward(t, 2.0)),
            ("entmax15", lambda t: entmax13.entmax15(t, dim=-1), lambda t: cpp_ops.entmax_rowwise_forward(t, 1.5)),
            ("entmax_bisect(alpha per row)", lambda t: entmax13.entmax_bisect(t, alpha_rows.view(-1, 1), dim=-1),
             lambda t: cpp_ops.entmax_rowwise_forward(t, alpha_rows)),
        ]
        for name, baseline, ours in cases:
            base_ms = _median_ms(_fwd_bwd(baseline, x, grad), repeat)
            ours_ms = _median_ms(_fwd_bwd(ours, x, grad), repeat)
            rows.append(dict(figure="mapping", case=f"{name} {shape[0]}x{shape[1]}", baseline="entmax 1.3",
                             baseline_ms=base_ms, ours_ms=ours_ms, speedup=base_ms / ours_ms))
    return rows


def _attention_inputs():
    torch.manual_seed(0)
    s = ATTENTION_SHAPE
    q, k, v = (torch.randn(s["B"], s["H"], s["L"], s["E"]) for _ in range(3))
    grad = torch.randn(s["B"], s["H"], s["L"], s["E"])
    return q, k, v, grad


def _attention_fns():
    return {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "entmax_cpp": lambda q, k, v: cpp_ops.entmax_attention_cpp(q, k, v, alpha=1.5),
    }


def _attention_step(fn, q, k, v, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    torch.autograd.grad(out, leaves, grad)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_worker(method: str) -> None:
    """Runs one forward+backward of `method`; prints its peak RSS above the pre-call RSS."""
    q, k, v, grad = _attention_inputs()
    fn = _attention_fns()[method]
    rss_before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak resident set) to the current resident set
    _attention_step(fn, q, k, v, grad)
    print(json.dumps({"peak_mib": (_status_kib("VmHWM") - rss_before) / 1024}))


def _peak_mib(method: str) -> float:
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-worker", method],
                            check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mib"]


def bench_attention(repeat: int):
    q, k, v, grad = _attention_inputs()
    fns = _attention_fns()
    ms = {name: _median_ms(lambda fn=fn: _attention_step(fn, q, k, v, grad), repeat) for name, fn in fns.items()}
    fwd_ms = {name: _median_ms(lambda fn=fn: fn(q, k, v), repeat) for name, fn in fns.items()}
    mem = {name: _peak_mib(name) for name in fns}
    s = ATTENTION_SHAPE
    case = f"alpha=1.5 B={s['B']} H={s['H']} L={s['L']} E={s['E']}"
    return [
        dict(figure="attention fwd+bwd time", case=case, baseline="sdpa", baseline_ms=ms["sdpa"],
             ours_ms=ms["entmax_cpp"], ratio=ms["entmax_cpp"] / ms["sdpa"]),
        dict(figure="attention fwd time", case=case, baseline="sdpa", baseline_ms=fwd_ms["sdpa"],
             ours_ms=fwd_ms["entmax_cpp"], ratio=fwd_ms["entmax_cpp"] / fwd_ms["sdpa"]),
        dict(figure="attention fwd+bwd peak MiB", case=case, baseline="sdpa", baseline_mib=mem["sdpa"],
             ours_mib=mem["entmax_cpp"], ratio=mem["entmax_cpp"] / mem["sdpa"]),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    available, reason = cpp_ops.is_available()
    if not available:
        sys.exit(f"C++ CPU ops unavailable: {reason}")
    if args.memory_worker:
        memory_worker(args.memory_worker)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    rows = bench_mappings(args.repeat)
    for r in rows:
        print(f"{r['case']:<42} entmax 1.3 {r['baseline_ms']:8.1f} ms   C++ {r['ours_ms']:7.1f} ms   "
              f"speedup {r['speedup']:5.1f}x")
    if not args.skip_attention:
        att = bench_attention(args.repeat)
        for r in att:
            if "baseline_ms" in r:
                print(f"{r['figure']:<28} sdpa {r['baseline_ms']:8.1f} ms   entmax C++ {r['ours_ms']:8.1f} ms   "
                      f"ratio {r['ratio']:4.2f}x")
            else:
                print(f"{r['figure']:<28} sdpa {r['baseline_mib']:8.1f} MiB  entmax C++ {r['ours_mib']:8.1f} MiB  "
                      f"ratio {r['ratio']:4.2f}x")
        rows += att
    if args.csv:
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
