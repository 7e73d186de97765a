"""Row-wise mappings on a GPU against torch.softmax (and AdaSplash, entmax 1.3): one table,
in one run.

For each shape (16384×1024 and 1024×32768) and dtype (fp32, bf16), times with
`triton.testing.do_bench` (median ms), as called and replayed from a CUDA graph (the GPU's
time without the host's), the forward without autograd and forward + backward (a training
step: autograd forward, then backward of a fixed upstream gradient) of:
- torch.softmax (the baseline of every ratio),
- entmax_fast's sparsemax, entmax15 and entmax_bisect at α = 1.3 (float α) and with a
  per-row α tensor of 1.3 (the learnable-α path, fwd+bwd with dα),
- AdaSplash's `triton_entmax` at α = 1.5 when importable,
- entmax 1.3's entmax15, sparsemax and entmax_bisect α = 1.3 when importable.
GB/s count one read and one write of the rows for the forward, and three reads and two
writes (x, p, grad, dx) for forward + backward. Each entmax_fast row also gets its largest
error against the float64 reference (max |p − p64|) on the same input.

Inputs are N(0, 1) scores. Writes rowwise_gpu.md and
rowwise_gpu.csv into --out. Needs a CUDA device; on a machine without one it says so and
exits with status 0, measuring nothing.

    python bench/bench_rowwise_gpu.py --out bench/out/gpu [--jobs 8]
    python bench/bench_rowwise_gpu.py --sweep      # also time the neighbours of each
                                                   # configuration of triton_kernels/rowwise.tile_config

--jobs N first compiles the table's kernels in N processes at once (`compile_commands`):
in this process Triton compiles each where it is first timed, one after the other, about
2 s each for the table's 32 or so.

Public names (tests/test_triton_rowwise.py uses them): SHAPES, DTYPES, `methods(n_rows,
device)`, `compile_commands()`, `compile_only`, `parse_args(argv)`, `run`, `sweep` and
`main(argv)`.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [(16384, 1024), (1024, 32768)]
DTYPES = [torch.float32, torch.bfloat16]
BISECT_ALPHA = 1.3


def _versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for package in ("triton", "adasplash", "entmax"):
        try:
            parts.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(parts)


def methods(n_rows: int, device) -> dict:
    """name -> (callable(x) -> p, whether it is entmax_fast's, α for the reference)."""
    import entmax_fast

    alpha_rows = torch.full((n_rows, 1), BISECT_ALPHA, device=device, requires_grad=True)
    methods = {
        "softmax": (lambda x: torch.softmax(x, -1), False, None),
        "ef sparsemax": (entmax_fast.sparsemax, True, 2.0),
        "ef entmax15": (entmax_fast.entmax15, True, 1.5),
        f"ef bisect a={BISECT_ALPHA}": (lambda x: entmax_fast.entmax_bisect(x, BISECT_ALPHA), True, BISECT_ALPHA),
        f"ef bisect a-tensor={BISECT_ALPHA}": (lambda x: entmax_fast.entmax_bisect(x, alpha_rows), True,
                                               BISECT_ALPHA),
    }
    try:
        from adasplash import triton_entmax

        def ada(x):
            try:
                return triton_entmax(x, alpha=1.5, n_iter=10)
            except TypeError:
                return triton_entmax(x, alpha=1.5)

        methods["adasplash triton_entmax a=1.5"] = (ada, False, None)
    except ImportError:
        pass
    try:
        import entmax

        methods["entmax1.3 sparsemax"] = (entmax.sparsemax, False, None)
        methods["entmax1.3 entmax15"] = (entmax.entmax15, False, None)
        methods[f"entmax1.3 bisect a={BISECT_ALPHA}"] = (lambda x: entmax.entmax_bisect(x, BISECT_ALPHA), False,
                                                         None)
    except ImportError:
        pass
    return methods




def _max_error(fn, x, alpha) -> float:
    from entmax_fast.reference.mappings import entmax_forward

    with torch.no_grad():
        p = fn(x).double()
        ref = entmax_forward(x.double(), alpha)
    return float((p - ref).abs().max())


def _graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph; NaN when it cannot be captured."""
    import triton

    try:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - an uncapturable baseline is a cell of the table
        print(f"graph capture failed: {type(exc).__name__}")
        return float("nan")


def _times(fn, x, grad):
    """Median ms of the forward and of a training step (forward + backward), each as
    called and replayed from a CUDA graph. The graph's is the GPU's time alone: where the
    kernels take less time than the host needs to make a call through the Python layers
    (and autograd's), `do_bench` times the host (H200, 9aba691: the 16384×1024 fp32
    forwards of sparsemax and entmax15 took 2.3-2.9× longer in one run than in the next,
    softmax's the same, and their training steps 3–6× softmax's; docs/performance.md);
    NaN when the call cannot be captured."""
    import triton

    def forward():
        with torch.no_grad():
            fn(x)

    x_grad = x.detach().clone().requires_grad_(True)

    def training_step():
        fn(x_grad).backward(grad)
        x_grad.grad = None

    fwd_ms = triton.testing.do_bench(forward, return_mode="median")
    step_ms = triton.testing.do_bench(training_step, return_mode="median")
    return fwd_ms, _graph_ms(forward), step_ms, _graph_ms(training_step)


def run(out_dir: str) -> list[dict]:
    rows = []
    for n_rows, n_cols in SHAPES:
        for dtype in DTYPES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(n_rows, n_cols, device="cuda", generator=gen).to(dtype)
            grad = torch.randn(n_rows, n_cols, device="cuda", generator=gen).to(dtype)
            row_bytes = n_rows * n_cols * x.element_size()
            soft_fwd = soft_step = soft_graph = soft_step_graph = None
            for name, (fn, ours, alpha) in methods(n_rows, x.device).items():
                entry = {"shape": f"{n_rows}x{n_cols}", "dtype": str(dtype).replace("torch.", ""), "method": name}
                try:
                    fwd_ms, graph_ms, step_ms, step_graph_ms = _times(fn, x, grad)
                    error = _max_error(fn, x, alpha) if ours else float("nan")
                except Exception as exc:  # noqa: BLE001 - a failing baseline is a cell of the table
                    print(f"{name} {entry['shape']} {entry['dtype']}: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
                    entry.update(fwd_ms=float("nan"), fwd_graph_ms=float("nan"), fwd_graph_vs_softmax=float("nan"),
                                 fwdbwd_ms=float("nan"), fwdbwd_graph_ms=float("nan"),
                                 fwdbwd_graph_vs_softmax=float("nan"), fwd_gbps=float("nan"),
                                 fwdbwd_gbps=float("nan"), fwd_vs_softmax=float("nan"),
                                 fwdbwd_vs_softmax=float("nan"), max_err_vs_f64=float("nan"), error=type(exc).__name__)
                    rows.append(entry)
                    continue
                if name == "softmax":
                    soft_fwd, soft_step, soft_graph, soft_step_graph = fwd_ms, step_ms, graph_ms, step_graph_ms
                entry.update(fwd_ms=fwd_ms, fwd_graph_ms=graph_ms, fwd_graph_vs_softmax=graph_ms / soft_graph,
                             fwdbwd_ms=step_ms, fwdbwd_graph_ms=step_graph_ms,
                             fwdbwd_graph_vs_softmax=step_graph_ms / soft_step_graph,
                             fwd_gbps=2 * row_bytes / fwd_ms / 1e6, fwdbwd_gbps=5 * row_bytes / step_ms / 1e6,
                             fwd_vs_softmax=fwd_ms / soft_fwd, fwdbwd_vs_softmax=step_ms / soft_step,
                             max_err_vs_f64=error, error="")
                rows.append(entry)
                print(f"{entry['shape']:>11} {entry['dtype']:>8} {name:<34} fwd {fwd_ms:8.4f} ms "
                      f"({entry['fwd_gbps']:6.0f} GB/s, {entry['fwd_vs_softmax']:5.2f}x; graph {graph_ms:7.4f} ms "
                      f"{entry['fwd_graph_vs_softmax']:5.2f}x)  fwd+bwd {step_ms:8.4f} ms "
                      f"({entry['fwdbwd_vs_softmax']:5.2f}x; graph {step_graph_ms:7.4f} ms "
                      f"{entry['fwdbwd_graph_vs_softmax']:5.2f}x)  err {error:.1e}", flush=True)
    _write(rows, out_dir)
    return rows


def _write(rows, out_dir):
    from bench.common import write_csv

    os.makedirs(out_dir, exist_ok=True)
    write_csv(rows, os.path.join(out_dir, "rowwise_gpu.csv"))
    lines = [f"# Row-wise mappings, {torch.cuda.get_device_name()}", "", _versions(), "",
             "Median ms (triton.testing.do_bench); ratio to torch.softmax in the same run; GB/s: "
             "fwd one read + one write, fwd+bwd three reads + two writes. graph: the call "
             "replayed from a CUDA graph (do_bench_cudagraph), the GPU's time without the host's.", "",
             "| shape | dtype | method | fwd ms | fwd GB/s | fwd / softmax | fwd graph ms | graph / softmax "
             "| fwd+bwd ms | fwd+bwd / softmax | fwd+bwd graph ms | graph / softmax | max err vs f64 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['method']} | — ({r['error']}) | | | | | | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['method']} | {r['fwd_ms']:.4f} | {r['fwd_gbps']:.0f} | "
                     f"{r['fwd_vs_softmax']:.2f} | {r['fwd_graph_ms']:.4f} | {r['fwd_graph_vs_softmax']:.2f} | "
                     f"{r['fwdbwd_ms']:.4f} | {r['fwdbwd_vs_softmax']:.2f} | "
                     f"{r['fwdbwd_graph_ms']:.4f} | {r['fwdbwd_graph_vs_softmax']:.2f} | "
                     f"{r['max_err_vs_f64']:.1e} |")
    with open(os.path.join(out_dir, "rowwise_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


SWEEP_LENGTHS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_ALPHAS = (1.5, 2.0, 1.3)


def _sweep_candidates(n_cols: int, base: dict) -> list[dict]:
    """The table's entry `base` first, then its neighbours (rows per program ×½, ×2; warps
    ×¼, ×½, ×2; rows ×2 on half the warps, the same threads per row: a program of one
    warp holds one row alone, and an SM holds at most 32 programs) and, where the α kinds' tables differ (rows longer than the shortest
    resident limit), each kind's choice: resident on 16 warps up to the longest resident
    row, chunked on 4 and 8 warps. Warps ×¼: at 1024 entries one warp per row needs no
    barrier in a pass's reductions, and its sm_90 SASS holds 11.5 instructions per entry
    and pass (entmax15) against 24.6 at the table's 4 warps (`tools/kernel_loops.py`).
    Resident tiles hold at most as many entries per thread
    as the table's largest."""
    from entmax_fast.triton_kernels.rowwise import CHUNK_BLOCK, RESIDENT_MAX_COLS, tile_config

    def per_thread(cfg):
        return cfg["ROWS"] * cfg["BLOCK"] // (32 * cfg["num_warps"])

    most_per_thread = max(per_thread(tile_config(limit, kind)) for kind, limit in RESIDENT_MAX_COLS.items())
    candidates = [base]
    if n_cols > min(RESIDENT_MAX_COLS.values()):
        if n_cols <= max(RESIDENT_MAX_COLS.values()):
            block = 1 << (n_cols - 1).bit_length()
            candidates.append({"ROWS": 1, "BLOCK": block, "RESIDENT": True, "num_warps": 16})
        candidates += [{"ROWS": 1, "BLOCK": CHUNK_BLOCK, "RESIDENT": False, "num_warps": warps} for warps in (4, 8)]
    for rows_factor, warps_factor in ((0.5, 1), (2, 1), (1, 0.25), (1, 0.5), (1, 2), (2, 0.5)):
        cand = dict(base, ROWS=int(base["ROWS"] * rows_factor), num_warps=int(base["num_warps"] * warps_factor))
        if cand["ROWS"] >= 1 and 1 <= cand["num_warps"] <= 32 and (cand["RESIDENT"] or cand["ROWS"] == 1):
            candidates.append(cand)
    unique = []
    for cand in candidates:
        if cand not in unique and (not cand["RESIDENT"] or per_thread(cand) <= most_per_thread):
            unique.append(cand)
    return unique


def sweep(lengths=SWEEP_LENGTHS, alphas=SWEEP_ALPHAS):
    """Forward ms of each `tile_config` entry at 16384×1024-sized problems and of its
    neighbours (`_sweep_candidates`), fp32, for each α (one per α kind: the table keys on
    it). A swept general-kind configuration is timed again without its captured support
    (`candidate_slots`: "capture off"), and one that starts from a subset from c = 1
    (`start_subset`: "subset off"), so that each one's effect is read in one run. Each
    forward is replayed from a CUDA graph (`_graph_ms`): at this size a kernel takes
    about as long as the host needs to make a call, and `do_bench` would time the host
    alike for every configuration."""
    from entmax_fast import common
    from entmax_fast.backends.triton import rowwise
    from entmax_fast.triton_kernels.rowwise import candidate_slots, start_subset, tile_config

    for n_cols in lengths:
        n_rows = max(1, 16384 * 1024 // n_cols)
        x = torch.randn(n_rows, n_cols, device="cuda")
        for alpha in alphas:
            candidates = _sweep_candidates(n_cols, tile_config(n_cols, common.alpha_kind(alpha)))
            for cand in candidates:
                ms = _graph_ms(lambda: rowwise._launch_forward(x, alpha, config=cand))
                mark = "  (table)" if cand is candidates[0] else ""
                print(f"n={n_cols:>6} alpha={alpha} rows={cand['ROWS']:>3} block={cand['BLOCK']:>5} "
                      f"warps={cand['num_warps']:>2} resident={cand['RESIDENT']}: {ms:.4f} ms{mark}", flush=True)
                if candidate_slots(n_cols, cand, common.alpha_kind(alpha)):
                    ms = _graph_ms(lambda: rowwise._launch_forward(x, alpha, config=cand, candidates=0))
                    print(f"{'':>54}capture off: {ms:.4f} ms", flush=True)
                if start_subset(cand, common.alpha_kind(alpha)):
                    ms = _graph_ms(lambda: rowwise._launch_forward(x, alpha, config=cand, subset=0))
                    print(f"{'':>54}subset off: {ms:.4f} ms", flush=True)


def compile_commands() -> list[list[str]]:
    """This script's compile runs of the table: one process per shape, dtype and
    entmax_fast mapping (`compile_only`). The row-wise kernels compile at the timed shape
    itself (one call takes microseconds)."""
    names = [name for name, (_, ours, _) in methods(1, "cpu").items() if ours]
    return [[sys.executable, os.path.abspath(__file__), "--compile-only",
             f"{n_rows}x{n_cols}", "--dtype", str(dtype).replace("torch.", ""), "--method", name]
            for n_rows, n_cols in SHAPES for dtype in DTYPES for name in names]


def compile_only(shape: str, dtype: str, name: str, device="cuda") -> None:
    """Compiles mapping ``name``'s kernels for rows of ``shape`` ("RxC") in ``dtype``: a
    forward without autograd and a training step, nothing timed."""
    n_rows, n_cols = (int(value) for value in shape.split("x"))
    fn = methods(n_rows, device)[name][0]
    x = torch.randn(n_rows, n_cols, device=device).to(getattr(torch, dtype))
    with torch.no_grad():
        fn(x)
    fn(x.detach().clone().requires_grad_(True)).backward(torch.randn_like(x))
    if x.is_cuda:
        torch.cuda.synchronize()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("bench", "out", "gpu"))
    parser.add_argument("--sweep", action="store_true", help="also time neighbours of each table configuration")
    parser.add_argument("--sweep-lengths", type=int, nargs="+", default=list(SWEEP_LENGTHS))
    parser.add_argument("--jobs", type=int, default=0,
                        help="first compile the table's kernels in this many processes at once "
                             "(0: each where it is first timed)")
    parser.add_argument("--compile-only", metavar="RxC", default=None,
                        help="compile --method's kernels for one shape and --dtype, and exit")
    parser.add_argument("--dtype", default="float32", choices=[str(d).replace("torch.", "") for d in DTYPES])
    parser.add_argument("--method", default="ef entmax15")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_rowwise_gpu: needs a CUDA device (none here); nothing measured")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench_rowwise_gpu: TRITON_INTERPRET is set; unset it to time the compiled kernels")
        return 1
    if args.compile_only:
        compile_only(args.compile_only, args.dtype, args.method)
        return 0
    print(f"{torch.cuda.get_device_name()}; {_versions()}")
    if args.jobs > 0:
        from bench.common import precompile

        precompile(compile_commands(), args.jobs, "bench_rowwise_gpu")
    run(args.out)
    if args.sweep:
        sweep(args.sweep_lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
