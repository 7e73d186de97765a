"""Row-wise mappings, forward+backward, float32, in one run: entmax_fast on each backend
usable here vs `entmax` 1.3's counterpart and torch.softmax.

    python bench/bench_mappings.py [--quick] [--csv bench/out/mappings.csv]
    python bench/bench_mappings.py --only "entmax_bisect(1.25)" --bisect-alpha 1.3 --bisect-alpha 1.7

Attention (time and peak memory vs scaled_dot_product_attention) is bench/bench_attention.py.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_table, time_call, write_csv  # noqa: E402

import entmax_fast  # noqa: E402
from entmax_fast import dispatch  # noqa: E402

def _bisect_mapping(alpha):
    """ours, entmax 1.3's key for entmax_bisect at a given alpha."""
    return (lambda X: entmax_fast.entmax_bisect(X, alpha)), ("entmax_bisect", alpha)


MAPPINGS = {
    "sparsemax": (lambda X: entmax_fast.sparsemax(X), "sparsemax"),
    "entmax15": (lambda X: entmax_fast.entmax15(X), "entmax15"),
    "entmax_bisect (default α=1.5)": (lambda X: entmax_fast.entmax_bisect(X), "entmax_bisect_default"),
    "entmax_bisect(1.25)": _bisect_mapping(1.25),
}


def _entmax_pkg(name):
    import entmax

    if isinstance(name, tuple):
        alpha = name[1]
        return lambda X: entmax.entmax_bisect(X, alpha)
    return {"sparsemax": entmax.sparsemax, "entmax15": entmax.entmax15,
            "entmax_bisect_default": entmax.entmax_bisect}[name]


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


def bench_mappings(shapes, repeats, mappings=None):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for shape in shapes:
        X = torch.randn(shape, device=device, requires_grad=True)
        softmax_t = time_call(_fwd_bwd(lambda x: torch.softmax(x, -1), X), repeats)
        for name, (ours, pkg_name) in (MAPPINGS if mappings is None else mappings).items():
            theirs_t = time_call(_fwd_bwd(_entmax_pkg(pkg_name), X), repeats)
            for backend in _backends("entmax"):
                with entmax_fast.use_backend(backend):
                    ours_t = time_call(_fwd_bwd(ours, X), repeats)
                rows.append({"op": name, "shape": "x".join(map(str, shape)), "backend": backend,
                             "ours_ms": ours_t * 1e3, "entmax13_ms": theirs_t * 1e3, "softmax_ms": softmax_t * 1e3,
                             "speedup_vs_entmax13": theirs_t / ours_t, "x_softmax": ours_t / softmax_t})
    return rows


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def print_results(rows: list) -> None:
    table = [{"op": r["op"], "shape": r["shape"], "backend": r["backend"], "ms": _ms(r["ours_ms"]),
              "entmax 1.3 ms": _ms(r["entmax13_ms"]), "softmax ms": _ms(r["softmax_ms"]),
              "x faster than entmax 1.3": f"{r['speedup_vs_entmax13']:.1f}",
              "x softmax's time": f"{r['x_softmax']:.1f}"} for r in rows]
    print_table(table, "row-wise mappings, float32, forward + backward, median ms (baselines from this run)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help=f"only these mappings (exact names: {', '.join(MAPPINGS)})")
    parser.add_argument("--bisect-alpha", type=float, action="append", default=[], metavar="ALPHA",
                        help="also entmax_bisect at this alpha (repeatable)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.only or [] if name not in MAPPINGS]
    if unknown:
        parser.error(f"--only: unknown mapping(s) {unknown}; choose from {list(MAPPINGS)}")
    mappings = {name: MAPPINGS[name] for name in (args.only if args.only is not None else MAPPINGS)}
    mappings.update({f"entmax_bisect({alpha:g})": _bisect_mapping(alpha) for alpha in args.bisect_alpha})
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# machine: {machine()}")
    shapes = [(512, 256), (64, 1024)] if args.quick else [(4096, 1024), (256, 8192)]
    rows = bench_mappings(shapes, 3 if args.quick else args.repeats, mappings)
    print_results(rows)
    if args.csv:
        write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
