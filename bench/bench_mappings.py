"""Mappings and attention on this machine, forward+backward, float32, one run:
entmax_fast (each available backend) vs `entmax` 1.3 and torch.softmax; entmax attention
vs torch's scaled_dot_product_attention (time and peak memory).

    python bench/bench_mappings.py [--quick] [--csv bench/out/mappings.csv]

Peak memory is the growth of the peak RSS of a fresh process over its inputs (CPU), or
torch.cuda.max_memory_allocated (GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, measure_peak_rss, print_table, run_in_child, time_call, write_csv  # noqa: E402

import entmax_fast  # noqa: E402
from entmax_fast import dispatch  # noqa: E402

MAPPINGS = {
    "sparsemax": (lambda X: entmax_fast.sparsemax(X), "sparsemax"),
    "entmax15": (lambda X: entmax_fast.entmax15(X), "entmax15"),
    "entmax_bisect(1.25)": (lambda X: entmax_fast.entmax_bisect(X, 1.25), "entmax_bisect"),
}


def _entmax_pkg(name):
    import entmax

    return {"sparsemax": entmax.sparsemax, "entmax15": entmax.entmax15,
            "entmax_bisect": lambda X: entmax.entmax_bisect(X, 1.25)}[name]


def _fwd_bwd(fn, X):
    def run():
        X.grad = None
        fn(X).backward(grad)
    grad = torch.randn_like(X)
    return run


def _backends(op):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = []
    for name in dispatch.registered_ops()[op]:
        if dispatch._runs_on(name, dispatch.Request(device, torch.float32, {})) is None and \
                not (name == "triton" and device.type == "cpu"):
            names.append(name)
    return names


def bench_mappings(shapes, repeats):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in shapes:
        X = torch.randn(shape, device=device, requires_grad=True)
        softmax_t = time_call(_fwd_bwd(lambda x: torch.softmax(x, -1), X), repeats)
        for name, (ours, pkg_name) in MAPPINGS.items():
            theirs_t = time_call(_fwd_bwd(_entmax_pkg(pkg_name), X), repeats)
            for backend in _backends("entmax"):
                with entmax_fast.use_backend(backend):
                    ours_t = time_call(_fwd_bwd(ours, X), repeats)
                rows.append({"op": name, "shape": "x".join(map(str, shape)), "backend": backend,
                             "ours_ms": ours_t * 1e3, "entmax13_ms": theirs_t * 1e3, "softmax_ms": softmax_t * 1e3,
                             "speedup_vs_entmax13": theirs_t / ours_t, "x_softmax": ours_t / softmax_t})
    return rows


def _attention_inputs(b, h, length, e, device):
    torch.manual_seed(0)
    return [torch.randn(b, h, length, e, device=device, requires_grad=True) for _ in range(3)]


def _attention_run(kind, b, h, length, e):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = _attention_inputs(b, h, length, e, device)
    grad = torch.randn_like(q)

    def run():
        for t in (q, k, v):
            t.grad = None
        if kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            with entmax_fast.use_backend(kind):
                out = entmax_fast.entmax_attention(q, k, v, alpha=1.5)
        out.backward(grad)
    return run


def _peak_in_child(kind, b, h, length, e):
    """Re-runs this script as a fresh process measuring one attention kind's peak memory."""
    return run_in_child(os.path.abspath(__file__), "--peak-child", kind, str(b), str(h), str(length), str(e))["peak_bytes"]


def bench_attention(b, h, length, e, repeats):
    rows = []
    sdpa_t = time_call(_attention_run("sdpa", b, h, length, e), repeats)
    sdpa_mem = _peak_in_child("sdpa", b, h, length, e)
    rows.append({"impl": "sdpa (softmax)", "shape": f"B{b} H{h} L{length} E{e}", "fwd_bwd_ms": sdpa_t * 1e3,
                 "peak_MB": sdpa_mem / 2**20, "x_sdpa_time": 1.0, "x_sdpa_mem": 1.0})
    for backend in _backends("attention"):
        t = time_call(_attention_run(backend, b, h, length, e), repeats)
        mem = _peak_in_child(backend, b, h, length, e)
        rows.append({"impl": f"entmax15 attention [{backend}]", "shape": f"B{b} H{h} L{length} E{e}",
                     "fwd_bwd_ms": t * 1e3, "peak_MB": mem / 2**20, "x_sdpa_time": t / sdpa_t,
                     "x_sdpa_mem": mem / max(sdpa_mem, 1)})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--peak-child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peak_child:
        kind, *dims = args.peak_child
        b, h, length, e = map(int, dims)
        # A tiny warm-up loads libraries and thread pools, which must not count as the op's memory.
        _attention_run(kind, 1, 1, 16, e)()
        run = _attention_run(kind, b, h, length, e)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = measure_peak_rss(run)
        print(json.dumps({"peak_bytes": peak}))
        return
    print(f"# machine: {machine()}")
    print(f"# backends: { {k: v['available'] for k, v in entmax_fast.backend_info()['backends'].items()} }")
    shapes = [(512, 256), (64, 1024)] if args.quick else [(4096, 1024), (256, 8192)]
    repeats = 3 if args.quick else 5
    mapping_rows = bench_mappings(shapes, repeats)
    print_table(mapping_rows, "mappings, float32, forward+backward (median ms)")
    b, h, length, e = (1, 2, 256, 64) if args.quick else (2, 8, 2048, 64)
    attention_rows = bench_attention(b, h, length, e, 2 if not args.quick else 3)
    print_table(attention_rows, "attention, float32, forward+backward")
    if args.csv:
        write_csv(mapping_rows, args.csv)
        write_csv(attention_rows, args.csv.replace(".csv", "_attention.csv"))


if __name__ == "__main__":
    main()
