"""Context-parallel entmax attention on CPU processes (gloo, one torch thread per rank):
forward + backward time and peak memory per rank against the single-process op, and the
bytes each rank receives per layer next to the model's prediction.

    python bench/bench_context_parallel.py              # L 4096, 8192, 16384; P 1, 2
    python bench/bench_context_parallel.py --quick      # small L, under two minutes
    python bench/bench_context_parallel.py --world-sizes 1 2 4 --lengths 4096

Each P runs in its own spawned group of P processes; P = 1 is the plain entmax_attention.
Causal, B = 1, H = Hkv = 8, E = 64, float32 by default. Time: the slowest rank's median
wall time of one forward + backward (collectives included), and its CPU time (the rank's
own work, without the waits). Memory: the largest rank's
peak resident set above its size before the inputs were made (inputs, activations,
gradients and communication buffers of one step).
Bytes: what one rank receives from the others in one layer's forward + backward, counted
on the collectives entmax_fast.distributed calls; the model (docs/context_parallel.md) is
4·(H + Hkv)·(P−1)/P·B·(L/P)·E elements for the all-to-all and 4·Hkv·(P−1)·B·(L/P)·E for
the all-gather.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, measure_peak_rss, print_table, write_csv  # noqa: E402


def predicted_bytes(method, batch, heads, kv_heads, length, dim, world_size, element_size):
    """Bytes one rank receives per layer (forward + backward) by the model."""
    if world_size == 1:
        return 0
    local = batch * (length // world_size) * dim * element_size
    if method == "all_to_all":
        # q, k, v and the output out and back, their gradients the other way.
        return 4 * (heads + kv_heads) * local * (world_size - 1) // world_size
    # K and V gathered, dK and dV reduce-scattered.
    return 4 * kv_heads * local * (world_size - 1)


class _CountingCollectives:
    """torch.distributed with the bytes each collective brings to this rank from the others
    added up (all_to_all_single: (P−1)/P of its input; all_gather: P−1 copies of the
    input; reduce_scatter: P−1 partial sums of the output's size)."""

    def __init__(self, real):
        self._real = real
        self.received = 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_to_all_single(self, output, input, group=None):
        world_size = self._real.get_world_size(group)
        self.received += input.numel() * input.element_size() * (world_size - 1) // world_size
        return self._real.all_to_all_single(output, input, group=group)

    def all_gather(self, tensor_list, tensor, group=None):
        self.received += tensor.numel() * tensor.element_size() * (len(tensor_list) - 1)
        return self._real.all_gather(tensor_list, tensor, group=group)

    def reduce_scatter(self, output, input_list, group=None):
        self.received += output.numel() * output.element_size() * (len(input_list) - 1)
        return self._real.reduce_scatter(output, input_list, group=group)


def _median_times(step, repeats):
    """Median wall and CPU seconds (this process, every thread: gloo's included) of step().
    The CPU time is the rank's own work, not the waits on other ranks or other processes."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]


def _configs(world_size, methods):
    if world_size == 1:
        return [("single", "-")]
    configs = [(method, "balanced") for method in methods]
    if "all_gather" in methods:
        configs.append(("all_gather", "contiguous"))
    return configs


def _worker(rank, world_size, port, args, out_dir):
    torch.set_num_threads(1)
    import entmax_fast
    from entmax_fast import distributed as cp

    counter = None
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        counter = _CountingCollectives(dist)
        cp.dist = counter
    dtype = getattr(torch, args.dtype)
    rows = []
    # A first step at a small length, so that one-time allocations (thread pools, kernel
    # workspaces, gloo buffers) are not counted in the first measured peak.
    for warmup, length in [(True, 2 * world_size * 64), *((False, length) for length in args.lengths)]:
        local = length // world_size

        def inputs():
            generator = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(args.batch, heads, local, args.dim, generator=generator, dtype=dtype)
                       .requires_grad_() for heads in (args.heads, args.kv_heads, args.kv_heads))
            return q, k, v, torch.randn(args.batch, args.heads, local, args.dim, generator=generator, dtype=dtype)

        for method, layout in _configs(world_size, args.methods):
            def step(q, k, v, grad_out, method=method, layout=layout):
                if world_size == 1:
                    out = entmax_fast.entmax_attention(q, k, v, is_causal=True, enable_gqa=True, alpha=args.alpha)
                else:
                    out = cp.context_parallel_attention(q, k, v, is_causal=True, enable_gqa=True, alpha=args.alpha,
                                                        layout=layout, method=method)
                out.backward(grad_out)

            # The peak counts the inputs and their gradients: the shards at P > 1.
            peak = measure_peak_rss(lambda: step(*inputs()))
            tensors = inputs()
            if counter is not None:
                dist.barrier()
                counter.received = 0
            step(*tensors)
            received = 0 if counter is None else counter.received
            seconds, cpu_seconds = _median_times(lambda: step(*tensors), args.repeats)
            if warmup:
                continue
            rows.append({"L": length, "P": world_size, "method": method, "layout": layout, "rank": rank,
                         "seconds": seconds, "cpu_seconds": cpu_seconds, "peak_bytes": peak,
                         "received_bytes": received})
    with open(os.path.join(out_dir, f"{world_size}-{rank}.json"), "w") as file:
        json.dump(rows, file)
    if world_size > 1:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--methods", nargs="+", default=["all_to_all", "all_gather"],
                        choices=["all_to_all", "all_gather"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="L 1024 and 2048, P 1 and 2, one timed repeat")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.world_sizes, args.repeats = [1024, 2048], [1, 2], 1
    for world_size in args.world_sizes:
        for length in args.lengths:
            if length % (2 * world_size):
                parser.error(f"--lengths: {length} is not divisible by 2P = {2 * world_size}")
    print(f"machine: {machine()}; {args.batch=} {args.heads=} {args.kv_heads=} {args.dim=} {args.alpha=} "
          f"{args.dtype} causal, one torch thread per rank, gloo")
    element_size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    results = []
    with tempfile.TemporaryDirectory() as out_dir:
        for world_size in args.world_sizes:
            mp.spawn(_worker, args=(world_size, _free_port(), args, out_dir), nprocs=world_size, join=True)
            for rank in range(world_size):
                with open(os.path.join(out_dir, f"{world_size}-{rank}.json")) as file:
                    results.extend(json.load(file))
    single = {row["L"]: row for row in results if row["P"] == 1}
    table = []
    keys = sorted({(row["L"], row["P"], row["method"], row["layout"]) for row in results})
    for length, world_size, method, layout in keys:
        ranks = [row for row in results
                 if (row["L"], row["P"], row["method"], row["layout"]) == (length, world_size, method, layout)]
        seconds = max(row["seconds"] for row in ranks)
        peak = max(row["peak_bytes"] or 0 for row in ranks)
        base = single.get(length)
        model = predicted_bytes(method, args.batch, args.heads, args.kv_heads, length, args.dim, world_size,
                                element_size)
        table.append({"L": length, "P": world_size, "method": method, "layout": layout,
                      "fwd+bwd s (slowest rank)": seconds,
                      "x single": seconds / base["seconds"] if base else None,
                      "rank times s": " / ".join(f"{row['seconds']:.2f}" for row in ranks),
                      "cpu s (max rank)": max(row["cpu_seconds"] for row in ranks),
                      "x single cpu": (max(row["cpu_seconds"] for row in ranks) / base["cpu_seconds"]
                                       if base else None),
                      "peak MiB/rank": peak / 2 ** 20,
                      "x single mem": peak / base["peak_bytes"] if base and base["peak_bytes"] else None,
                      "received MiB/rank": max(row["received_bytes"] for row in ranks) / 2 ** 20,
                      "model MiB": model / 2 ** 20})
    print_table(table, "context-parallel entmax attention, fwd+bwd per layer")
    if args.csv:
        write_csv(table, args.csv)


if __name__ == "__main__":
    main()
