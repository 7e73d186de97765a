"""A Llama-style model trained through ``attn_implementation``: ms per training step with
``"sdpa"`` against ``"entmax"`` (α 1.5) and ``"sparsemax"`` (α 2): the fused attention's
cost in a whole training step.

The default model (docs/performance.md, "Models", has its measured figures): 8 layers,
hidden 1024, 16 query heads and 4 key/value heads (E 64, grouped-query attention), MLP
2816, vocabulary 32000 (about 155M parameters), batch 4 × 2048 tokens, bf16 weights, AdamW,
random tokens. Every implementation gets the same initial weights and batches. No
download: the model is built from its config.

    python bench/bench_hf_training.py                      # on a GPU: the table above
    python bench/bench_hf_training.py --tiny --device cpu  # a dry run of the script

--jobs N compiles each entmax_fast implementation's kernels first, in processes of its own
(N at once), instead of one implementation after the other in the warm-up steps.

Ratios are against SDPA timed in the same process; each implementation's steps are
CUDA-event timed after --warmup steps (Triton's compiles), medians of --steps.

Public names (tests/test_hf.py uses them): `parse_args(argv)`, `compile_commands(args)`,
`llama_config`, `build_model`, `time_training` and `main(argv)`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import machine, print_table, write_csv  # noqa: E402

IMPLEMENTATIONS = ("sdpa", "entmax", "sparsemax")
# attn_implementation names whose attention compiles nothing (transformers' own)
TORCH_IMPLEMENTATIONS = ("sdpa", "eager")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def llama_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.length,
        tie_word_embeddings=False)


def build_model(config, implementation: str, device, dtype):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    model.to(device=device, dtype=dtype).train()
    return model


def _timer(device):
    """(start, stop) of one step's time in ms: CUDA events on a GPU, wall time elsewhere."""
    if device.type == "cuda":
        def start():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def stop(begin):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return begin.elapsed_time(end)
        return start, stop
    return time.perf_counter, lambda begin: (time.perf_counter() - begin) * 1e3


def attention_backend() -> str:
    """The backend entmax_fast chose for the latest attention call (None: no call)."""
    import entmax_fast

    choice = entmax_fast.backend_info()["last_choice"]["attention"]
    return choice["backend"] if choice else "none"


def time_training(config, implementation: str, args, device, dtype) -> dict:
    """ms per step (median and spread), the last loss, peak memory and the attention backend
    of ``implementation`` over args.steps timed steps."""
    model = build_model(config, implementation, device, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.length), generator=generator).to(device)
               for _ in range(2)]
    start, stop = _timer(device)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        step(batches[i % 2])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps):
        begin = start()
        loss = step(batches[i % 2])
        times.append(stop(begin))
    loss = float(loss.detach())
    if not torch.isfinite(torch.tensor(loss)):
        raise RuntimeError(f"{implementation}: the training loss is {loss}")
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    backend = attention_backend() if implementation != "sdpa" else "torch SDPA"
    del model, optimizer
    return {"implementation": implementation, "ms_per_step": statistics.median(times),
            "ms_min": min(times), "ms_max": max(times), "loss": loss, "peak_MiB": peak,
            "attention_backend": backend, "parameters": parameters}


def compile_commands(args) -> list[list[str]]:
    """Compile runs of the implementations that compile kernels: this script with one
    implementation, one layer, a small vocabulary and one warm-up and one timed step.
    The attention launches, and so the kernels, are the full model's: the same heads, head
    dim, grouped-query group, length and dtype in every layer."""
    shared = ["--device", args.device, "--dtype", args.dtype, "--batch", str(args.batch),
              "--length", str(args.length), "--layers", "1", "--hidden", str(args.hidden),
              "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
              "--intermediate", str(args.intermediate), "--vocab", "1024", "--steps", "1",
              "--warmup", "1"]
    return [[sys.executable, os.path.abspath(__file__), "--implementations", name] + shared
            for name in args.implementations if name not in TORCH_IMPLEMENTATIONS]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                        help="attn_implementation names; the first is the ratios' baseline")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer model on 2 x 128 tokens in float32: a dry run of the script")
    parser.add_argument("--out", default=None, help="folder for hf_training.md and .csv")
    parser.add_argument("--jobs", type=int, default=0,
                        help="first compile each implementation's kernels in a process of its own, "
                             "this many at once (0: in the warm-up steps, one after the other)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.length, args.layers, args.hidden = 2, 128, 2, 64
        args.heads, args.kv_heads, args.intermediate, args.vocab = 4, 2, 128, 256
        args.steps, args.warmup, args.dtype = 3, 1, "float32"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_hf_training: transformers is not importable here; nothing timed")
        return 0
    import entmax_fast.hf  # noqa: F401  registers "entmax" and "sparsemax"

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_hf_training: --device cuda, but no CUDA device here")
    config = llama_config(args)
    if args.jobs > 0 and device.type == "cuda":
        from bench.common import precompile

        precompile(compile_commands(args), args.jobs, "bench_hf_training")
    rows = []
    for implementation in args.implementations:
        rows.append(time_training(config, implementation, args, device, dtype))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    title = (f"Llama-style training step ({args.layers} layers, hidden {args.hidden}, {args.heads}/"
             f"{args.kv_heads} heads, {rows[0].pop('parameters') / 1e6:.0f}M parameters; B {args.batch} "
             f"L {args.length} {args.dtype}; AdamW) on {machine()}; transformers {transformers.__version__}")
    for row in rows[1:]:
        row.pop("parameters")
    baseline = rows[0]["ms_per_step"]
    for row in rows:
        row["x_baseline"] = row["ms_per_step"] / baseline
    print_table(rows, title)
    if args.out:
        write_csv(rows, os.path.join(args.out, "hf_training.csv"))
        with open(os.path.join(args.out, "hf_training.md"), "w") as f:
            f.write(f"## {title}\n\n| implementation | ms per step (min–max) | × {rows[0]['implementation']} | "
                    "peak MiB | last loss | attention backend |\n|---|---|---|---|---|---|\n")
            for row in rows:
                f.write(f"| {row['implementation']} | {row['ms_per_step']:.1f} ({row['ms_min']:.1f}–"
                        f"{row['ms_max']:.1f}) | {row['x_baseline']:.2f} | {row['peak_MiB']:.0f} | "
                        f"{row['loss']:.3f} | {row['attention_backend']} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
