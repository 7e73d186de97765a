"""Attention speed and memory: entmax_fast's entmax attention (dispatched backend, and the
plain-torch reference) vs softmax attention (torch's scaled_dot_product_attention), plus
FlashAttention and AdaSplash when importable. Forward, backward and forward+backward time,
peak memory of forward+backward, and the sparsity of the entmax weights.

    python bench/bench_attention.py --quick     # CPU, small lengths, < 2 minutes
    python bench/bench_attention.py             # GPU: lengths 512..16384, bf16
    python bench/bench_attention.py --causal --lengths 1024 4096
    python bench/bench_attention.py --window 512    # sliding window: B1 H8 E64, L 4096..32768

Timing: ``triton.testing.do_bench`` on GPU, ``torch.utils.benchmark`` on CPU (median).
Peak memory: ``torch.cuda.max_memory_allocated`` growth on GPU; on CPU the growth of this
process's peak RSS (VmHWM, reset through /proc/self/clear_refs before each measurement,
with glibc told to return large frees to the OS). Forward times include saving what the
backward needs (inputs require grad); with ``--quick`` the total is forward + backward
rather than a third measurement. Writes bench/out/attention.csv and
bench/out/attention.png (time and memory vs length). With ``--aot`` (and no GPU) it also
compiles the Triton kernels for sm_80/sm_90 and prints their resource table (a covering
sample of the configurations, a few minutes and ~160 lines; ``python -m
entmax_fast.triton_kernels.aot`` compiles every configuration).

With ``--window W`` it times a causal sliding window of W keys per query instead
(``window_size=(W - 1, 0)``): entmax_fast with the window, the same weights through a dense
(L, L) boolean mask, plain causal entmax attention, and SDPA with the dense mask; fwd+bwd
time and peak memory only (a causal call at L = 32768 costs minutes on a CPU), and how the
window's time grows from the shortest length to the longest against linear growth.
Writes bench/out/attention_window.csv.

With ``--sparsity`` (CPU, C++ operator) it times entmax attention against SDPA in the same
process, one call of each back to back per repeat, and reports the median ratio, forward +
backward and forward alone, with the share of weights that are exactly zero, the share of
query tiles the operator runs on its sparse path, and peak memory; on random inputs and on
the attention of a small 1.5-entmax associative-recall model (entmax_fast.train), which it
trains on first use into bench/out/recall_entmax15.pt. Writes bench/out/attention_sparsity.csv
and bench/out/attention_sparsity.png.

    python bench/bench_attention.py --sparsity --threads 2

``--cpu-kernels avx2-fma`` (or ``portable``) times a lower C++ kernel set than the CPU's best,
as a CPU without AVX-512 (or AVX2) would run.

Why ``fwd+bwd`` is not ``fwd + bwd``: the three columns are three separate medians. ``fwd+bwd``
times a forward and its backward together, which is what a training step pays, and is the
figure to compare; ``bwd`` times repeated backward passes through one retained graph
(``retain_graph=True``), ``fwd`` forward passes alone; they show which half dominates. Medians
of separate runs need not add up: on the 2-core CPU, fwd+bwd came out 10-20 % below fwd + bwd
(entmax α=1.5, B=2, H=8, L=1024, two repeats: 804 ms vs 433 + 544, 730 ms vs 295 + 534),
about as much as the repeats moved each part. ``--quick`` prints fwd + bwd as the total.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, measure_peak_rss, print_table, write_csv  # noqa: E402

import entmax_fast  # noqa: E402
from entmax_fast import dispatch  # noqa: E402
from entmax_fast.reference.attention import entmax_attention as reference_entmax_attention  # noqa: E402
from entmax_fast.reference.mappings import entmax_forward  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
ON_GPU = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------
# Methods: name -> (callable(q, k, v, causal) in (B, H, L, E) layout, alpha or None).

def _methods(alpha: float, include_reference: bool) -> dict:
    methods = {
        "softmax (sdpa)": (lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal), None),
        f"entmax_fast α={alpha:g}": (lambda q, k, v, causal: entmax_fast.entmax_attention(
            q, k, v, is_causal=causal, alpha=alpha), alpha),
    }
    if include_reference:
        methods[f"reference α={alpha:g}"] = (lambda q, k, v, causal: reference_entmax_attention(
            q, k, v, is_causal=causal, alpha=alpha), alpha)
    try:
        from flash_attn import flash_attn_func

        methods["flash_attn (softmax)"] = (lambda q, k, v, causal: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal).transpose(1, 2), None)
    except ImportError:
        pass
    try:
        from adasplash import adasplash

        methods[f"adasplash α={alpha:g}"] = (lambda q, k, v, causal: adasplash(
            q, k, v, alpha=alpha, niter=10, is_causal=causal), alpha)
    except ImportError:
        pass
    return methods


def _versions() -> str:
    parts = [f"entmax_fast {entmax_fast.__version__}", f"torch {torch.__version__}"]
    for package in ("triton", "flash_attn", "adasplash"):
        try:
            parts.append(f"{package} {importlib.metadata.version(package.replace('_', '-'))}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package} absent")
    if ON_GPU:
        parts.append(f"CUDA {torch.version.cuda}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------
# Timing and memory.

def _time_ms(fn, min_run_time: float) -> float:
    if ON_GPU:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    import torch.utils.benchmark as benchmark

    # blocked_autorange's first (block-size estimating) call is the warm-up.
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _peak_mib(fn) -> float | None:
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    peak = measure_peak_rss(fn)
    return None if peak is None else peak / 2**20


def _sparsity(q, k, alpha: float, causal: bool, max_rows: int = 512) -> float:
    """Fraction of exactly-zero weights among the allowed (unmasked) entries, over the
    first ``max_rows`` queries of batch 0 (every head), from the reference mapping."""
    rows = min(max_rows, q.shape[2])
    scores = (q[0, :, :rows].float() @ k[0].float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        allowed = torch.ones(rows, k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    else:
        allowed = torch.ones(rows, k.shape[2], dtype=torch.bool, device=q.device)
    weights = entmax_forward(scores, alpha)
    zeros = ((weights == 0) & allowed).sum().item()
    return zeros / (allowed.sum().item() * q.shape[1])


def run(lengths, batch, heads, head_dim, dtype, alpha, causal, min_run_time, include_reference,
        max_reference_length, quick=False) -> list:
    device = "cuda" if ON_GPU else "cpu"
    methods = _methods(alpha, include_reference)
    rows = []
    for length in lengths:
        generator = torch.Generator(device=device).manual_seed(length)
        q, k, v = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, generator=generator)
                   for _ in range(3))
        grad = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, generator=generator)
        sparsity = _sparsity(q, k, alpha, causal)
        for name, (attention, method_alpha) in methods.items():
            if name.startswith("reference") and length > max_reference_length:
                continue
            if name.startswith(("flash_attn", "adasplash")) and not ON_GPU:
                continue
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

            def forward():
                return attention(qg, kg, vg, causal)

            def forward_backward():
                torch.autograd.backward(forward(), grad)

            try:
                fwd_ms = _time_ms(forward, min_run_time)
                out = forward()
                bwd_ms = _time_ms(lambda: torch.autograd.backward(out, grad, retain_graph=True), min_run_time)
                total_ms = fwd_ms + bwd_ms if quick else _time_ms(forward_backward, min_run_time)
                del out
                peak = _peak_mib(forward_backward)
            except (RuntimeError, torch.OutOfMemoryError) as error:
                print(f"{name} at length {length}: {type(error).__name__}: {str(error).splitlines()[0]}")
                continue
            backend = name.split(" ")[0]
            if name.startswith("entmax_fast"):
                choice = dispatch.last_choice("attention")
                backend = choice.backend if choice is not None else "?"
            elif name.startswith("softmax"):
                backend = "torch"
            rows.append({"method": name, "backend": backend, "length": length, "batch": batch, "heads": heads,
                         "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "causal": causal,
                         "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "total_ms": total_ms, "peak_mib": peak,
                         "zero_fraction": sparsity if method_alpha is not None else 0.0})
    return rows


def _band_mask(length: int, window: int, device) -> torch.Tensor:
    """The (L, L) boolean mask of a causal window of ``window`` keys: i - window < j <= i."""
    offsets = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return (offsets >= 0) & (offsets < window)


def run_window(lengths, batch, heads, head_dim, dtype, alpha, window, min_run_time, max_dense_length) -> list:
    """fwd+bwd time and peak memory of a causal sliding window against the same weights
    through a dense mask, plain causal entmax attention and SDPA with the dense mask."""
    device = "cuda" if ON_GPU else "cpu"
    window_size = (window - 1, 0)
    rows = []
    for length in lengths:
        generator = torch.Generator(device=device).manual_seed(length)
        q, k, v, grad = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, generator=generator)
                         for _ in range(4))
        methods = {"entmax_fast window": lambda q, k, v, mask: entmax_fast.entmax_attention(
            q, k, v, alpha=alpha, window_size=window_size)}
        dense = length <= max_dense_length
        if dense:
            methods["entmax_fast dense mask"] = lambda q, k, v, mask: entmax_fast.entmax_attention(
                q, k, v, mask, alpha=alpha)
            methods["softmax (sdpa) dense mask"] = lambda q, k, v, mask: F.scaled_dot_product_attention(
                q, k, v, mask)
        methods["entmax_fast causal"] = lambda q, k, v, mask: entmax_fast.entmax_attention(
            q, k, v, is_causal=True, alpha=alpha)
        mask = _band_mask(length, window, device) if dense else None
        for name, attention in methods.items():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

            def forward_backward():
                torch.autograd.backward(attention(qg, kg, vg, mask), grad)

            try:
                total_ms = _time_ms(forward_backward, min_run_time)
                peak = _peak_mib(forward_backward)
            except (RuntimeError, torch.OutOfMemoryError) as error:
                print(f"{name} at length {length}: {type(error).__name__}: {str(error).splitlines()[0]}")
                continue
            backend = "torch"
            if name.startswith("entmax_fast"):
                choice = dispatch.last_choice("attention")
                backend = choice.backend if choice is not None else "?"
            rows.append({"method": name, "backend": backend, "length": length, "window": window, "batch": batch,
                         "heads": heads, "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""),
                         "alpha": alpha, "total_ms": total_ms, "peak_mib": peak})
        del mask
    return rows


def print_window_results(rows: list) -> None:
    window = {r["length"]: r["total_ms"] for r in rows if r["method"] == "entmax_fast window"}
    causal = {r["length"]: r["total_ms"] for r in rows if r["method"] == "entmax_fast causal"}
    table = [{"L": r["length"], "method": r["method"], "backend": r["backend"], "fwd+bwd ms": r["total_ms"],
              "x window": r["total_ms"] / window[r["length"]] if r["length"] in window else None,
              "peak MiB": r["peak_mib"]} for r in rows]
    print_table(table, f"sliding window of {rows[0]['window'] if rows else '?'} keys: fwd+bwd time (median ms), "
                "peak memory")
    print("x window: fwd+bwd time against entmax_fast's window at the same L; peak MiB: peak memory of fwd+bwd\n"
          "above what was allocated before.")
    lengths = sorted(window)
    if len(lengths) >= 2:
        short, long = lengths[0], lengths[-1]
        growth = (window[long] / window[short]) / (long / short)
        print(f"window time from L={short} to L={long}: {window[long] / window[short]:.2f}x for {long / short:g}x "
              f"the length ({growth:.2f}x linear growth)")
    if lengths and lengths[-1] in causal:
        print(f"plain causal / window at L={lengths[-1]}: {causal[lengths[-1]] / window[lengths[-1]]:.1f}x")


def plot(rows: list, path: str, title: str, max_reference_length: int) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    all_lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        lengths = [r["length"] for r in mine]
        label = method
        if lengths and lengths[-1] < all_lengths[-1]:
            label += f" (not run above L={lengths[-1]})"
        line, = axes[0].plot(lengths, [r["total_ms"] for r in mine], marker="o", label=label)
        if all(r["peak_mib"] is not None for r in mine):
            axes[1].plot(lengths, [r["peak_mib"] for r in mine], marker="o", label=label, color=line.get_color())
        if lengths and lengths[-1] < all_lengths[-1]:
            for ax, key in ((axes[0], "total_ms"), (axes[1], "peak_mib")):
                if mine[-1][key] is not None:
                    ax.annotate(f"{method.split(' ')[0]}: run only up to\nL={max_reference_length} "
                                "(--max-reference-length)", (lengths[-1], mine[-1][key]), textcoords="offset points",
                                xytext=(6, -18), fontsize=7, color=line.get_color())
    for ax, ylabel in zip(axes, ("forward + backward time (ms)", "peak memory, forward + backward (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(all_lengths, [str(length) for length in all_lengths])
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_results(rows: list, quick: bool) -> None:
    """One compact table (the CSV has every column), then what its columns mean."""
    table = [{"L": r["length"], "method": r["method"], "backend": r["backend"], "fwd ms": r["fwd_ms"],
              "bwd ms": r["bwd_ms"], "fwd+bwd ms": r["total_ms"],
              "x sdpa": r["total_vs_softmax"], "peak MiB": r["peak_mib"],
              "zeros": f"{100 * r['zero_fraction']:.1f}%" if r["zero_fraction"] else "-"} for r in rows]
    print_table(table, "attention: time (median ms), peak memory, sparsity")
    if quick:
        print("fwd+bwd ms: fwd + bwd (--quick does not measure it on its own);")
    else:
        print("fwd+bwd ms: a forward and its backward timed together (what a training step pays), a measurement\n"
              "of its own, so not exactly fwd + bwd (see the docstring);")
    print("x sdpa: fwd+bwd against scaled_dot_product_attention at the same L; peak MiB: peak memory of\n"
          "fwd+bwd above what was allocated before; zeros: share of the entmax weights that are exactly 0.")


def resource_table() -> None:
    """The Triton kernels compiled ahead of time for sm_80/sm_90 (registers, spills, shared
    memory): the closest look at GPU behaviour a machine without a GPU has. A pairwise
    covering sample of the configurations (every pair of options once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "entmax_fast.triton_kernels.aot", "--sample"],
                            capture_output=True, text=True, env=env)
    print("\n## Compiled Triton kernels (ahead of time, no GPU here)")
    if result.stdout.strip():
        print(result.stdout.rstrip())
    else:
        lines = result.stderr.strip().splitlines()
        print(f"resource table unavailable (exit {result.returncode}): {lines[-1] if lines else 'no output'}")


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized run: lengths 128 256 512, under 2 minutes")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        default="bfloat16" if ON_GPU else "float32")
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--max-reference-length", type=int, default=2048 if ON_GPU else 1024,
                        help="skip the plain-torch reference above this length")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); on a busy "
                        "machine 1 avoids threads spin-waiting for each other")
    parser.add_argument("--aot", action="store_true",
                        help="without a GPU, also compile the Triton kernels for sm_80/sm_90 and print their "
                             "resource table (registers, spills, shared memory; a few minutes on 2 cores)")
    parser.add_argument("--window", type=int, help="time a causal sliding window of this many keys per query "
                        "(default lengths 4096..32768, B=1, H=8) against a dense mask and plain causal")
    parser.add_argument("--max-dense-length", type=int, default=16384,
                        help="with --window, skip the dense-mask rows above this length (an (L, L) mask)")
    parser.add_argument("--sparsity", action="store_true",
                        help="CPU: the C++ operator against SDPA in one process, interleaved, with the share of zero "
                             "weights and of query tiles on the sparse path, on random inputs and on the attention "
                             "of a small trained model (B=2 H=8 by default; --lengths picks rows)")
    parser.add_argument("--repeats", type=int, default=7, help="with --sparsity, interleaved repeats per row")
    parser.add_argument("--cpu-kernels", choices=["auto", "avx2-fma", "portable"], default="auto",
                        help="with --sparsity, the C++ kernel set to time (torch.ops.entmax_fast.cpu_kernel_isa): "
                             "the CPU's best by default, or a lower one forced")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.window:
        return _main_window(args)
    if args.sparsity:
        return _main_sparsity(args)
    if args.lengths:
        lengths = args.lengths
    elif args.quick:
        lengths = [128, 256, 512]
    else:
        lengths = [512, 1024, 2048, 4096, 8192, 16384] if ON_GPU else [256, 512, 1024, 2048]
    batch = args.batch or (4 if ON_GPU else 1)
    heads = args.heads or (16 if ON_GPU else 4)
    dtype = getattr(torch, args.dtype)
    min_run_time = 0.2 if args.quick else 0.5
    ok, why = dispatch.availability("reference")
    dispatched_reference = not ON_GPU and not dispatch.availability("cpp")[0]
    header = (f"{machine()}\n{_versions()}\nattention B={batch} H={heads} E={args.head_dim} {args.dtype} "
              f"alpha={args.alpha:g} causal={args.causal}")
    print(header)
    if dispatched_reference:
        print("entmax_fast dispatches to the plain-torch reference here (C++ op not built, no GPU): "
              "the separate reference rows are skipped as duplicates")
    rows = run(lengths, batch, heads, args.head_dim, dtype, args.alpha, args.causal, min_run_time,
               include_reference=ok and not dispatched_reference, max_reference_length=args.max_reference_length,
               quick=args.quick)
    softmax = {r["length"]: r["total_ms"] for r in rows if r["method"] == "softmax (sdpa)"}
    for r in rows:
        r["total_vs_softmax"] = r["total_ms"] / softmax[r["length"]] if r["length"] in softmax else None
    print_results(rows, args.quick)
    csv_path = os.path.join(args.out, "attention.csv")
    write_csv(rows, csv_path)
    plot_path = plot(rows, os.path.join(args.out, "attention.png"), header, args.max_reference_length)
    print(f"wrote {csv_path} and {plot_path}")
    if not ON_GPU and args.aot:
        resource_table()
    return rows


def _main_window(args) -> list:
    lengths = args.lengths or [4096, 8192, 16384, 32768]
    batch, heads = args.batch or 1, args.heads or 8
    print(f"{machine()}\n{_versions()}\nattention, sliding window of {args.window} keys: B={batch} H={heads} "
          f"E={args.head_dim} {args.dtype} alpha={args.alpha:g}")
    rows = run_window(lengths, batch, heads, args.head_dim, getattr(torch, args.dtype), args.alpha, args.window,
                      0.2 if args.quick else 0.5, args.max_dense_length)
    print_window_results(rows)
    csv_path = os.path.join(args.out, "attention_window.csv")
    write_csv(rows, csv_path)
    print(f"wrote {csv_path}")
    return rows


# ---------------------------------------------------------------------------------------
# --sparsity: what the C++ operator's sparse paths buy on CPU, against SDPA in the same
# process, interleaved.

# (label, L, alpha, causal) of the random-input rows; B, H, E from the command line.
SPARSITY_CASES = [("L 256", 256, 1.5, False), ("L 1024", 1024, 1.5, False), ("L 2048", 2048, 1.5, False),
                  ("L 1024, α 2", 1024, 2.0, False), ("L 2048, α 2", 2048, 2.0, False),
                  ("L 1024, causal", 1024, 1.5, True), ("L 2048, causal", 2048, 1.5, True),
                  ("L 1024, α 1.1 (wide support)", 1024, 1.1, False)]


def _interleaved_ratio(entmax_fn, sdpa_fn, repeats: int) -> tuple:
    """(median entmax ms, median SDPA ms, median of the per-repeat ratios): each repeat times
    one call of each, back to back, so that both see the same load."""
    import time

    entmax_fn(), sdpa_fn()
    entmax_ms, sdpa_ms, ratios = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        entmax_fn()
        middle = time.perf_counter()
        sdpa_fn()
        end = time.perf_counter()
        entmax_ms.append((middle - start) * 1e3)
        sdpa_ms.append((end - middle) * 1e3)
        ratios.append((middle - start) / (end - middle))
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return median(entmax_ms), median(sdpa_ms), median(ratios)


def _support_shares(q, k, v, alpha, causal: bool) -> tuple:
    """(share of the allowed weights that are exactly zero, share of query tiles on the sparse
    path, share of query rows in tiles whose supports the forward keeps for the backward) of the C++
    operator on these inputs, from its own support counts and kept lists."""
    from entmax_fast.backends.cpp import ops as cpp_ops
    from entmax_fast.common import GRAD_INPUTS

    gqa = q.shape[1] != k.shape[1]
    counts = cpp_ops.attention_support_forward(q, k, None, alpha, scale=q.shape[-1] ** -0.5, is_causal=causal,
                                               enable_gqa=gqa)
    lq, lk = q.shape[2], k.shape[2]
    allowed = (torch.arange(lq).clamp(max=lk - 1) + 1).sum().item() if causal else lq * lk
    zeros = 1.0 - counts.sum().item() / (allowed * q.shape[0] * q.shape[1])
    tiles = cpp_ops.attention_sparse_tiles(counts, lk, is_causal=causal)
    _, saved = cpp_ops.attention_forward(q, k, v, None, alpha, scale=q.shape[-1] ** -0.5, is_causal=causal,
                                         dropout_p=0.0, enable_gqa=gqa, need_grad=GRAD_INPUTS)
    ends = saved[-1]
    # A kept tile's rows have ends >= 0, the others' -1.
    kept = (ends >= 0).float().mean().item() if ends.numel() else 0.0
    return zeros, tiles.float().mean().item(), kept


def _recall_attention_inputs(out_dir: str, batch: int) -> tuple:
    """(q, k, v, alpha) that the second attention layer of a 1.5-entmax associative-recall
    model (entmax_fast.train) receives on sequences of 128 pairs and 128 queries, 16x the
    pairs it was trained on. The model is trained on first use (150 steps, seconds) and kept
    in out_dir/recall_entmax15.pt."""
    import dataclasses

    from entmax_fast import multihead, train

    path = os.path.join(out_dir, "recall_entmax15.pt")
    if not os.path.exists(path):
        config = train.Config(steps=150, attentions=("entmax15",), long_pairs=0)
        result = train.train_one(config, "entmax15", show_progress=False)
        os.makedirs(out_dir, exist_ok=True)
        train.save_model(path, result["model"], config, "entmax15")
    model, config = train.load_model(path)
    config = dataclasses.replace(config, pairs=128, queries=128)
    keys, values, query_keys, _ = train.recall_batch(config, batch, torch.Generator().manual_seed(0))
    captured = []
    original = multihead.entmax_attention

    def capture(q, k, v, **kwargs):
        captured.append((q.detach().clone(), k.detach().clone(), v.detach().clone(), kwargs))
        return original(q, k, v, **kwargs)

    multihead.entmax_attention = capture
    try:
        with torch.no_grad():
            model(keys, values, query_keys)
    finally:
        multihead.entmax_attention = original
    q, k, v, kwargs = captured[-1]
    if kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
        raise RuntimeError("the recall model's attention is expected without a mask")
    return q, k, v, kwargs["alpha"]


def run_sparsity(batch, heads, head_dim, repeats: int, out_dir: str, lengths=None) -> list:
    cases = [c for c in SPARSITY_CASES if lengths is None or c[1] in lengths]
    inputs = []
    for label, length, alpha, causal in cases:
        generator = torch.Generator().manual_seed(length)
        q, k, v, grad = (torch.randn(batch, heads, length, head_dim, generator=generator) for _ in range(4))
        inputs.append((f"random N(0,1), {label}", q, k, v, grad, alpha, causal))
    q, k, v, alpha = _recall_attention_inputs(out_dir, batch=64)
    inputs.append((f"recall model, layer 2 (B {q.shape[0]}, H {q.shape[1]}, L {q.shape[2]}, E {q.shape[3]})", q, k, v,
                   torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(1)), alpha,
                   False))
    rows = []
    for label, q, k, v, grad, alpha, causal in inputs:
        zeros, sparse_tiles, kept_tiles = _support_shares(q, k, v, alpha, causal)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def entmax_step():
            torch.autograd.backward(entmax_fast.entmax_attention(qg, kg, vg, is_causal=causal, alpha=alpha), grad)

        def sdpa_step():
            torch.autograd.backward(F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal), grad)

        def entmax_forward_only():
            entmax_fast.entmax_attention(qg, kg, vg, is_causal=causal, alpha=alpha)

        def sdpa_forward_only():
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

        entmax_ms, sdpa_ms, ratio = _interleaved_ratio(entmax_step, sdpa_step, repeats)
        forward_ms, sdpa_forward_ms, forward_ratio = _interleaved_ratio(entmax_forward_only, sdpa_forward_only,
                                                                        repeats)
        entmax_peak, sdpa_peak = _peak_mib(entmax_step), _peak_mib(sdpa_step)
        backend = dispatch.last_choice("attention")
        rows.append({"case": label, "alpha": alpha, "causal": causal, "backend": backend.backend if backend else "?",
                     "zeros": zeros, "sparse_tiles": sparse_tiles, "kept_tiles": kept_tiles, "fwd_bwd_ms": entmax_ms,
                     "sdpa_fwd_bwd_ms": sdpa_ms,
                     "fwd_bwd_vs_sdpa": ratio, "fwd_ms": forward_ms, "sdpa_fwd_ms": sdpa_forward_ms,
                     "fwd_vs_sdpa": forward_ratio, "peak_mib": entmax_peak, "sdpa_peak_mib": sdpa_peak})
        print(f"{label}: fwd+bwd {ratio:.2f}x SDPA, fwd {forward_ratio:.2f}x, zeros {100 * zeros:.1f}%, "
              f"sparse tiles {100 * sparse_tiles:.0f}%, kept tiles {100 * kept_tiles:.0f}%", flush=True)
    return rows


def print_sparsity_results(rows: list) -> None:
    table = [{"case": r["case"], "zeros": f"{100 * r['zeros']:.1f}%", "sparse tiles": f"{100 * r['sparse_tiles']:.0f}%",
              "kept tiles": f"{100 * r['kept_tiles']:.0f}%", "fwd+bwd ms": r["fwd_bwd_ms"], "x sdpa": r["fwd_bwd_vs_sdpa"], "fwd ms": r["fwd_ms"],
              "fwd x sdpa": r["fwd_vs_sdpa"], "peak MiB": r["peak_mib"], "sdpa peak MiB": r["sdpa_peak_mib"]}
             for r in rows]
    print_table(table, "entmax attention (C++) against SDPA, same process, interleaved")
    print("zeros: share of the allowed weights that are exactly 0; sparse tiles: share of 64-query tiles whose\n"
          "P.V and backward run as sparse products; kept tiles: share of query rows in tiles whose supports\n"
          "the forward keeps, so that the backward skips their score GEMM; x sdpa: median over repeats of\n"
          "(entmax time / SDPA time), each repeat timing one call of each back to back; peak MiB: peak memory\n"
          "of fwd+bwd above the inputs.")


def plot_sparsity(rows: list, path: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.8))
    positions = range(len(rows))
    ax.barh([p + 0.2 for p in positions], [r["fwd_bwd_vs_sdpa"] for r in rows], height=0.4, label="forward + backward")
    ax.barh([p - 0.2 for p in positions], [r["fwd_vs_sdpa"] for r in rows], height=0.4, label="forward")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(positions), [f"{r['case']} ({100 * r['zeros']:.1f}% zeros)" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("entmax attention time / SDPA time (same process, interleaved, median)")
    ax.legend(fontsize=7)
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _main_sparsity(args) -> list:
    if ON_GPU or not dispatch.availability("cpp")[0]:
        raise SystemExit("--sparsity times the C++ CPU operator: it needs the built extension and no GPU")
    batch, heads = args.batch or 2, args.heads or 8
    kernels = torch.ops.entmax_fast.cpu_kernel_isa(args.cpu_kernels)
    header = (f"{machine()}\n{_versions()}\nC++ entmax attention vs SDPA: B={batch} H={heads} E={args.head_dim} "
              f"float32, {kernels} kernels, threads {torch.get_num_threads()}, {args.repeats} interleaved repeats; "
              f"load {_load()}")
    print(header)
    rows = run_sparsity(batch, heads, args.head_dim, args.repeats, args.out, args.lengths)
    print_sparsity_results(rows)
    print(f"load after the run: {_load()}")
    csv_path = os.path.join(args.out, "attention_sparsity.csv")
    write_csv(rows, csv_path)
    plot_path = plot_sparsity(rows, os.path.join(args.out, "attention_sparsity.png"), header)
    print(f"wrote {csv_path} and {plot_path}")
    return rows


def _load() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
