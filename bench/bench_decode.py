"""Decoding speed: one step of entmax attention against a key/value cache
(``entmax_attention_with_kvcache``, contiguous and paged caches) vs softmax attention
(torch's ``scaled_dot_product_attention`` with ``enable_gqa=True``) over the same cache's keys,
and vs today's alternative, a prefill-shaped ``entmax_attention`` call on the cache's slice.

    python bench/bench_decode.py --quick      # CPU, < 2 minutes
    python bench/bench_decode.py              # B 1 at 4k..64k keys, B 4 and 16 at 4k (and 16k for B 4)
    python bench/bench_decode.py --batches 1 --lengths 32768 --block-size 256 --threads 1
    python bench/bench_decode.py --device cuda --dtype float16 --batches 1 4 16 \
        --lengths 1024 8192 32768 131072     # a GPU: the Triton decoding kernels

A step is what a serving loop pays per token: the public call appends the new token's key
and value (idempotently, at the same place each repeat) and attends the sequence's keys, the
new one included; SDPA and the prefill-shaped call get the same keys, already in place.
Every sequence of a batch holds the same number of keys. Shape: H query heads on Hkv cache
heads (GQA), one query per sequence (Lq = 1), E = 128, random normal inputs; the support
column is the share of keys an average row gives a non-zero weight at that α (entmax's
P.V reads only those keys' values, so it depends on the data: random keys give a small
support, a model's attention a different one).

Ratios in the table come from the same run: x sdpa = entmax step / SDPA, paged/contig =
paged step / contiguous step. Timing: ``torch.utils.benchmark`` (median of blocked runs),
under ``torch.inference_mode()``, the methods taking turns (3 rounds with ``--quick``, 5
otherwise) and each reporting its median turn. Writes bench/out/decode.csv.

A paged cache's blocks lie at unrelated addresses, so on CPU its keys cross a 4 KiB page
every few keys and the step waits on address translation: with ``THP_MEM_ALLOC_ENABLE=1``
in the environment (torch's CPU allocator then asks for 2 MiB pages) the paged step took
1.05-1.16x the contiguous one, without it 1.03-1.26x (docs/performance.md). The header
says which.

On a shared machine a parallel region waits for a thread the scheduler has put aside: on the
2-core development machine under a load average of 7, the contiguous step at B 1, 4k keys
took 20 ms on two threads and 7.4 ms with ``--threads 1`` (commit b03ada4); compare runs at
one thread count.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_table, write_csv  # noqa: E402

import entmax_fast  # noqa: E402
from entmax_fast import dispatch  # noqa: E402
from entmax_fast.reference.mappings import entmax_forward  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def _time_ms(fn, min_run_time: float) -> float:
    import torch.utils.benchmark as benchmark

    # blocked_autorange's first (block-size estimating) call is the warm-up.
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _paged(cache: torch.Tensor, block_size: int, generator: torch.Generator):
    """The cache's contents as a paged pool with its blocks shuffled, and the block table."""
    batch, kv_heads, length, width = cache.shape
    n_blocks = length // block_size
    order = torch.randperm(batch * n_blocks, generator=generator).to(cache.device)
    pool = torch.empty(batch * n_blocks, kv_heads, block_size, width, dtype=cache.dtype, device=cache.device)
    pool[order] = cache.view(batch, kv_heads, n_blocks, block_size, width).transpose(1, 2).reshape(
        batch * n_blocks, kv_heads, block_size, width)
    return pool, order.view(batch, n_blocks).to(torch.int32)


def _support(q, k_cache, length, alpha: float) -> float:
    """Mean share of the keys in a row's support, over sequence 0's heads."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    keys = k_cache[0, :, :length].float().repeat_interleave(heads // kv_heads, dim=0)
    scores = (q[0].float() @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (entmax_forward(scores, alpha) > 0).float().mean().item()


def run(batch: int, length: int, heads: int, kv_heads: int, head_dim: int, dtype, alpha: float, block_size: int,
        min_run_time: float, rounds: int, device: str = "cpu") -> dict:
    # drawn where they are used: a GPU's caches (up to 4 GiB) would take seconds to draw on the CPU
    generator = torch.Generator(device).manual_seed(length + batch)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32, device=device).to(dtype)

    q = randn(batch, heads, 1, head_dim)
    k_cache, v_cache = randn(batch, kv_heads, length, head_dim), randn(batch, kv_heads, length, head_dim)
    k_new, v_new = k_cache[:, :, -1:].clone(), v_cache[:, :, -1:].clone()
    # One seed for both pools: their blocks are shuffled alike, so one table serves both.
    pool_k, table = _paged(k_cache, block_size, torch.Generator().manual_seed(length))
    pool_v, _ = _paged(v_cache, block_size, torch.Generator().manual_seed(length))
    before = torch.full((batch,), length - 1, dtype=torch.int32, device=device)

    def contiguous():
        return entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=before,
                                                         alpha=alpha)

    def paged():
        return entmax_fast.entmax_attention_with_kvcache(q, pool_k, pool_v, k_new, v_new, cache_seqlens=before,
                                                         block_table=table, alpha=alpha)

    def sdpa():
        return F.scaled_dot_product_attention(q, k_cache[:, :, :length], v_cache[:, :, :length], enable_gqa=True)

    def prefill_shaped():
        return entmax_fast.entmax_attention(q, k_cache[:, :, :length], v_cache[:, :, :length], enable_gqa=True,
                                            alpha=alpha)

    methods = {"sdpa": sdpa, "contiguous": contiguous, "paged": paged, "prefill": prefill_shaped}
    with torch.inference_mode():
        torch.testing.assert_close(paged(), contiguous(), atol=1e-5, rtol=1e-5)
        backend = dispatch.last_choice("attention_kvcache").backend
        # The methods take turns, `rounds` times, and each keeps its median turn: on a shared
        # machine the load drifts within seconds, and turns expose every method to the same drift.
        turns = {name: [] for name in methods}
        for _ in range(rounds):
            for name, method in methods.items():
                turns[name].append(_time_ms(method, min_run_time / rounds))
        sdpa_ms, contiguous_ms, paged_ms, prefill_ms = (statistics.median(turns[name]) for name in methods)
        support = _support(q, k_cache, length, alpha)
    return {"batch": batch, "keys": length, "backend": backend, "sdpa_ms": sdpa_ms, "contig_ms": contiguous_ms,
            "paged_ms": paged_ms, "prefill_ms": prefill_ms, "x_sdpa": contiguous_ms / sdpa_ms,
            "paged_x_sdpa": paged_ms / sdpa_ms, "paged/contig": paged_ms / contiguous_ms,
            "prefill_x_sdpa": prefill_ms / sdpa_ms, "support_%": 100 * support}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B 1 at 4k and 16k keys, B 4 at 4k: under 2 minutes")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--lengths", type=int, nargs="+", help="keys per sequence (multiples of --block-size)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--block-size", type=int, default=16, help="the paged cache's block size (a multiple of 16)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice); on a busy "
                        "machine 1 avoids threads waiting for each other")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the Triton kernels; --dtype float16 there)")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batches or args.lengths:
        configs = [(batch, length) for batch in (args.batches or [1]) for length in (args.lengths or [4096])]
    elif args.quick:
        configs = [(1, 4096), (1, 16384), (4, 4096)]
    else:
        configs = [(1, 4096), (1, 16384), (1, 65536), (4, 4096), (4, 16384), (16, 4096)]
    min_run_time = 0.6 if args.quick else 1.5
    rounds = 3 if args.quick else 5
    pages = "2 MiB pages (THP_MEM_ALLOC_ENABLE=1)" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "4 KiB pages"
    print(f"{machine()}\ndecoding step: H={args.heads} Hkv={args.kv_heads} E={args.head_dim} Lq=1 {args.dtype} "
          f"alpha={args.alpha:g}, paged block size {args.block_size}, {args.device}"
          + (f", CPU tensors on {pages}" if args.device == "cpu" else ""))
    rows = [run(batch, length, args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype), args.alpha,
                args.block_size, min_run_time, rounds, args.device) for batch, length in configs]
    print_table(rows, "Decoding step (ms; ratios from the same run)")
    print("x_sdpa: contiguous-cache step / SDPA; paged_x_sdpa: paged step / SDPA; paged/contig: paged step / "
          "contiguous step;\nprefill_x_sdpa: entmax_attention on the cache's slice / SDPA; support_%: keys in an "
          "average row's support")
    csv_path = os.path.join(args.out, "decode.csv" if args.device == "cpu" else f"decode_{args.device}.csv")
    write_csv(rows, csv_path)
    print(f"wrote {csv_path}")
    return rows


if __name__ == "__main__":
    main()
