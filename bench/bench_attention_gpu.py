"""Fused entmax attention on a GPU against SDPA (and AdaSplash, FlashAttention): one grid
of shapes, in one run.

For each (L, E, causal) of the grid (bf16, H = 16, B·L = 16384 tokens; and L = 32768 at
B = 1), and a causal sliding window (`WINDOW_GRID`: L = 32768, 512 keys per query, where
"causal" reads "window 512"), times with `triton.testing.do_bench` (median ms) the forward without autograd and a
training step (forward + backward) of:
- softmax attention (`scaled_dot_product_attention`, the baseline of every ratio),
- entmax_fast at α = 1.5 and α = 2, and a learned α (a per-head tensor at 1.5 that the
  training step differentiates: the kernels' general kind),
- AdaSplash at α = 1.5 with its default arguments, when the package is importable
  (--baseline-budget bounds the time spent on it: it autotunes and compiles per shape),
- FlashAttention (softmax), when importable;
(in the window row SDPA runs plain causal attention, having no window: the ratio shows what the
window saves; entmax_fast and FlashAttention run `window_size=(511, 0)`, AdaSplash is not run)
plus a structured input whose weights are local (scores peaked near the diagonal, so most
key tiles hold no weight) at L ≥ 16384, and the peak memory of one training step.

Writes attention_gpu.md (tables with ratios to SDPA), attention_gpu.csv and
attention_gpu.png into --out. Needs a CUDA device; exits with a message otherwise.

    python bench/bench_attention_gpu.py --out bench/out/gpu [--quick] [--jobs 8]

--jobs N first compiles entmax_fast's kernels in N processes at once, one per kernel class
and method (`compile_commands`), so that the grid's time goes to timing: in this process
Triton would compile them one after the other where each is first timed (the quick grid's
take about 270 s so: triton 3.6, an empty cache, a 2-core host, commit 8f7af03).

Public names (tests/test_triton_attention.py uses them): GRID, QUICK_GRID, WINDOW_GRID, HEADS,
ENTMAX_METHODS, `compile_cells`, `compile_commands`, `compile_only`, `parse_args(argv)`,
`is_window`, `parse_cell`, `run` and `main(argv)`.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (L, E, causal); B = 16384 // L. The most telling cells first, so that a
# --baseline-budget spends AdaSplash's compile time where the comparison matters most.
GRID = [(4096, 64, True), (1024, 64, True), (4096, 64, False), (4096, 128, True),
        (16384, 64, True), (1024, 64, False), (16384, 64, False), (16384, 128, True),
        (32768, 64, True)]
# GRID's order: L 1024 causal shares the first cell's kernels (it compiles nothing more)
QUICK_GRID = [(4096, 64, True), (1024, 64, True), (4096, 64, False), (4096, 128, True)]
# (L, E, keys per query) of a causal sliding window, timed after either grid.
WINDOW_GRID = [(32768, 64, 512)]
HEADS = 16
TOKENS = 16384
# the methods whose kernels are Triton's and compile per cell's kernel class (`compile_cells`);
# the baselines compile their own (AdaSplash autotunes per shape), SDPA none
ENTMAX_METHODS = ("entmax_fast a=1.5", "entmax_fast a=2", "entmax_fast a=learned 1.5")


def _versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for package in ("triton", "adasplash", "flash-attn", "transformers"):
        try:
            parts.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(parts)


def is_window(pattern) -> bool:
    """A cell's third entry: True/False (causal or not), or an int, the keys per query of a
    causal sliding window."""
    return not isinstance(pattern, bool)


def _pattern(pattern) -> dict:
    """entmax_attention's arguments for a cell's pattern."""
    if is_window(pattern):
        return {"window_size": (pattern - 1, 0)}
    return {"is_causal": pattern}


def _methods(device="cuda") -> dict:
    """name -> callable(q, k, v, pattern) in (B, H, L, E) layout (`is_window`)."""
    import entmax_fast

    # learned alpha: one per head, a leaf that the training step differentiates (the
    # general kind of the kernels, with d(alpha))
    learned_alpha = torch.full((HEADS,), 1.5, device=device, requires_grad=True)
    alpha_15, alpha_2, alpha_learned = ENTMAX_METHODS
    methods = {
        "sdpa": lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=bool(c)),
        alpha_15: lambda q, k, v, c: entmax_fast.entmax_attention(q, k, v, alpha=1.5, **_pattern(c)),
        alpha_2: lambda q, k, v, c: entmax_fast.entmax_attention(q, k, v, alpha=2.0, **_pattern(c)),
        alpha_learned: lambda q, k, v, c: entmax_fast.entmax_attention(
            q, k, v, alpha=learned_alpha, **_pattern(c)),
    }
    try:
        import adasplash

        # its default arguments (iterations, block masking), as a user calls it
        methods["adasplash a=1.5"] = lambda q, k, v, c: adasplash.adasplash(
            q, k, v, alpha=1.5, is_causal=c)
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_func

        methods["flash_attn"] = lambda q, k, v, c: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=bool(c),
            window_size=(c - 1, 0) if is_window(c) else (-1, -1)).transpose(1, 2)
    except ImportError:
        pass
    return methods


def _inputs(batch, length, head_dim, local, grad, device="cuda"):
    torch.manual_seed(0)
    shape = (batch, HEADS, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3))
    if local:
        # q_i . k_j large only for |i - j| small: smooth random walks along the sequence,
        # scaled so that a query's scores fall by several units within ~100 positions
        walk = torch.randn(batch, HEADS, length, head_dim, device=device).cumsum(2)
        walk = walk / walk.std(dim=2, keepdim=True)
        k = (walk * 3).to(torch.bfloat16)
        q = (walk * 3 + 0.3 * torch.randn_like(walk)).to(torch.bfloat16)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _time(method, batch, length, head_dim, causal, local):
    from triton.testing import do_bench

    q, k, v = _inputs(batch, length, head_dim, local, grad=False)
    with torch.no_grad():
        fwd = do_bench(lambda: method(q, k, v, causal), warmup=5, rep=40)
    q, k, v = _inputs(batch, length, head_dim, local, grad=True)
    grad_out = torch.randn(batch, HEADS, length, head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        method(q, k, v, causal).backward(grad_out)

    fwdbwd = do_bench(step, warmup=3, rep=40)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return fwd, fwdbwd, peak


BASELINES = ("adasplash", "flash_attn")


def run(grid, out_dir, baseline_budget_s=math.inf):
    """Times every method on every case, rewriting the tables after each case (a run cut
    short keeps what it measured). Third-party baselines (AdaSplash autotunes and compiles
    per shape) stop being timed once they have taken baseline_budget_s seconds."""
    methods = _methods()
    rows = []
    baseline_s = 0.0
    cases = [(length, e, causal, False) for length, e, causal in grid if not is_window(causal)]
    cases += [(length, 64, True, True) for length in (16384, 32768)
              if any(g[0] >= 16384 and not is_window(g[2]) for g in grid)]
    cases += [(length, e, window, False) for length, e, window in grid if is_window(window)]
    for length, head_dim, causal, local in cases:
        batch = max(1, TOKENS // length)
        base = None
        for name, method in methods.items():
            is_baseline = name.startswith(BASELINES)
            if is_window(causal) and name.startswith("adasplash"):
                continue  # AdaSplash has no sliding window
            started = time.perf_counter()
            if is_baseline and baseline_s > baseline_budget_s:
                fwd = fwdbwd = peak = math.nan
                error = f"not timed: baselines took their {baseline_budget_s:.0f} s"
            else:
                try:
                    fwd, fwdbwd, peak = _time(method, batch, length, head_dim, causal, local)
                    error = ""
                except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported
                    fwd = fwdbwd = peak = math.nan
                    error = f"{type(exc).__name__}: {str(exc)[:80]}"
            elapsed = time.perf_counter() - started
            if is_baseline:
                baseline_s += elapsed
            if name == "sdpa":
                base = (fwd, fwdbwd)
            row = {"input": "local" if local else "random", "L": length, "B": batch,
                   "E": head_dim, "causal": f"window {causal}" if is_window(causal) else causal,
                   "method": name, "fwd_ms": fwd,
                   "fwdbwd_ms": fwdbwd, "fwd_x_sdpa": fwd / base[0],
                   "fwdbwd_x_sdpa": fwdbwd / base[1], "peak_mib": peak, "error": error}
            rows.append(row)
            print(f"{row['input']:6s} L={length:6d} E={head_dim:3d} causal={row['causal']!s:5s} "
                  f"{name:32s} fwd {fwd:9.3f} ms ({row['fwd_x_sdpa']:6.1f}x)  "
                  f"fwd+bwd {fwdbwd:9.3f} ms ({row['fwdbwd_x_sdpa']:6.1f}x)  "
                  f"peak {peak:7.0f} MiB [{elapsed:.0f} s] {error}", flush=True)
        _write(rows, out_dir, plot=False)
    _write(rows, out_dir)
    return rows


def _write(rows, out_dir, plot=True):
    from bench.common import write_csv

    os.makedirs(out_dir, exist_ok=True)
    write_csv(rows, os.path.join(out_dir, "attention_gpu.csv"))
    header = (f"# Fused attention on {torch.cuda.get_device_name()}\n\n{_versions()}; bf16, "
              f"H = {HEADS}, B·L = {TOKENS} (B = 1 at L = 32768); `triton.testing.do_bench` "
              f"medians. ×SDPA: ratio to scaled_dot_product_attention in the same run.\n\n")
    lines = ["| input | L | E | causal | method | fwd ms | ×SDPA | fwd+bwd ms | ×SDPA | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['input']} | {r['L']} | {r['E']} | {r['causal']} | {r['method']} | "
                     f"{r['fwd_ms']:.3f} | {r['fwd_x_sdpa']:.2f} | {r['fwdbwd_ms']:.3f} | "
                     f"{r['fwdbwd_x_sdpa']:.2f} | {r['peak_mib']:.0f} |"
                     + (f" {r['error']}" if r["error"] else ""))
    with open(os.path.join(out_dir, "attention_gpu.md"), "w") as f:
        f.write(header + "\n".join(lines) + "\n")
    if plot:
        _plot(rows, os.path.join(out_dir, "attention_gpu.png"))


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cases = sorted({(r["input"], r["L"], r["E"], r["causal"]) for r in rows},
                   key=lambda c: (c[0], c[2], c[3], c[1]))
    names = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "sdpa"))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, key, title in ((axes[0], "fwd_x_sdpa", "forward"),
                           (axes[1], "fwdbwd_x_sdpa", "forward + backward")):
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            values = [next((r[key] for r in rows if r["method"] == name and
                            (r["input"], r["L"], r["E"], r["causal"]) == c), math.nan)
                      for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], values, width, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{c[0][:3]} L{c[1]}\nE{c[2]}{' ' + c[3] if isinstance(c[3], str) else ' c' if c[3] else ''}"
                            for c in cases],
                           fontsize=7)
        ax.set_title(f"{title}: time / SDPA time (log scale; 1 = SDPA)")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"entmax attention vs softmax, {torch.cuda.get_device_name()} (bf16, H=16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compile_cells(grid) -> list[tuple[int, int, bool]]:
    """One (L, E, pattern) per kernel class of ``grid``, at the length its kernels compile at.

    A method compiles its kernels per head dim and causal flag (an integer argument equal to
    1 is a compile-time constant to Triton, 0 is not) and per divisibility of the integer
    arguments: the lengths, the tile counts and the strides they enter, which
    `compile_length` keeps (with 64-row tiles L 1024 has the divisibility of every multiple
    of 2048; the batch enters no argument). The local input's cells use the random ones'
    kernels. A window is a kernel class of its own (its size is an argument, not a constant)."""
    from bench.common import compile_length

    cells = {}
    for length, head_dim, causal in grid:
        cells.setdefault((head_dim, causal), compile_length(length))
    return [(length, head_dim, causal) for (head_dim, causal), length in cells.items()]


def compile_commands(grid) -> list[list[str]]:
    """This script's compile runs for ``grid``: one process per kernel class and entmax_fast
    method (`compile_only`)."""
    return [[sys.executable, os.path.abspath(__file__), "--compile-only",
             f"{length}x{head_dim}x{_cell_pattern(causal)}", "--method", name]
            for length, head_dim, causal in compile_cells(grid) for name in ENTMAX_METHODS]


def _cell_pattern(pattern) -> str:
    """A pattern in a compile cell's name: 1 causal, 0 not, wN a causal window of N keys."""
    return f"w{pattern}" if is_window(pattern) else str(int(pattern))


def parse_cell(cell: str):
    """(L, E, pattern) of a compile cell "LxExC" (`_cell_pattern`)."""
    length, head_dim, pattern = cell.split("x")
    return int(length), int(head_dim), int(pattern[1:]) if pattern.startswith("w") else bool(int(pattern))


def compile_only(cell: str, name: str, device="cuda") -> None:
    """Compiles ``name``'s kernels for the cell "LxExC" (`parse_cell`): a forward without
    autograd and a training step at B = 1, nothing timed."""
    length, head_dim, causal = parse_cell(cell)
    method = _methods(device)[name]
    q, k, v = _inputs(1, length, head_dim, local=False, grad=True, device=device)
    with torch.no_grad():
        method(q, k, v, causal)
    method(q, k, v, causal).backward(torch.randn_like(q))
    if q.is_cuda:
        torch.cuda.synchronize()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("bench", "out", "gpu"))
    parser.add_argument("--quick", action="store_true", help="four cells of the grid only")
    parser.add_argument("--baseline-budget", type=float, default=math.inf, metavar="SECONDS",
                        help="stop timing AdaSplash/FlashAttention after this many seconds")
    parser.add_argument("--jobs", type=int, default=0,
                        help="first compile entmax_fast's kernels in this many processes at once "
                             "(0: each where it is first timed)")
    parser.add_argument("--compile-only", metavar="LxExC", default=None,
                        help="compile --method's kernels for one cell and exit (a --jobs process)")
    parser.add_argument("--method", choices=ENTMAX_METHODS, default=ENTMAX_METHODS[0])
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention_gpu: needs a CUDA device (none here); nothing measured")
        return 0
    if args.compile_only:
        compile_only(args.compile_only, args.method)
        return 0
    print(f"{torch.cuda.get_device_name()}; {_versions()}")
    grid = (QUICK_GRID if args.quick else GRID) + WINDOW_GRID
    if args.jobs > 0:
        from bench.common import precompile

        precompile(compile_commands(grid), args.jobs, "bench_attention_gpu")
    run(grid, args.out, args.baseline_budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
