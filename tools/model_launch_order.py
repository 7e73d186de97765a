"""How much of a causal attention launch the GPU spends on its tail, by the order in which
its programs start: a list-scheduling model, not a timing.

A GPU starts a grid's programs in the order of their linear index (the first grid
dimension fastest), each as soon as an SM has room for one. On a causal pattern the
programs differ in length: query block i of the forward and of dQ visits i + 1 key tiles,
key block j of dK/dV visits n - j query tiles. The kernels start each head's longest
blocks first (`attention_common.query_block`, for the causal flag and a causal mask
alike; dK/dV's key blocks ascending) and put the heads along the grid's first dimension
(`attention_common.launch_grid`): every head's longest programs start before anyone's
shorter ones, so a launch ends on short ones. With the blocks along the first dimension
the programs start head after head, and a launch ends on the last heads' long programs
while the other slots idle.

The model: `slots` programs run at once (SMs x programs per SM, from each launch's
registers), a program takes its tile count plus `--fixed` tiles' worth of set-up, and a
free slot takes the next program in launch order. It prints each launch's time over the
ideal (the work spread evenly over the slots) for both layouts, blocks first and heads
first. It ignores that a program runs faster on an emptier SM (which shrinks the cost of a
tail), L2 effects, and the tiles a sparse pattern skips: an upper bound on what the order
buys, to be measured on a GPU.

    python tools/model_launch_order.py [--sms 132] [--fixed 0.5]

Public functions: `makespan(durations, slots)`, `launch_orders` and `main(argv)`.
"""
from __future__ import annotations

import argparse
import heapq
import sys

# (label, blocks per head, heads of the grid, programs per SM, the tiles of block b, whether
# the blocks-first layout starts each head's blocks longest first) at B 4 H 16 (the grid of
# bench/bench_attention_gpu.py at L 4096), B 1 H 16 (L 16384), B 16 H 16 (L 1024) and the
# Llama-style model of bench/bench_hf_training.py (B 4, L 2048, 16 query and 4 key/value
# heads: a dK/dV program sums its 4 query heads). In the blocks-first layout only the
# causal flag reversed the query blocks: a causal mask given as a bool attn_mask (a padded
# batch's, in transformers) takes them in ascending order there. Its tiles here are the
# causal flag's, an upper bound, since the max pass reads every tile of a masked row.
CASES = [
    ("L 4096 B 4 H 16, forward threshold launch", 64, 64, 4, lambda b, n: b + 1, True),
    ("L 4096 B 4 H 16, forward output launch", 64, 64, 3, lambda b, n: b + 1, True),
    ("L 4096 B 4 H 16, dQ", 64, 64, 3, lambda b, n: b + 1, True),
    ("L 4096 B 4 H 16, dK/dV", 64, 64, 2, lambda b, n: n - b, True),
    ("L 16384 B 1 H 16, forward threshold launch", 256, 16, 4, lambda b, n: b + 1, True),
    ("L 16384 B 1 H 16, dK/dV", 256, 16, 2, lambda b, n: n - b, True),
    ("L 1024 B 16 H 16, forward threshold launch", 16, 256, 4, lambda b, n: b + 1, True),
    ("L 1024 B 16 H 16, dK/dV", 16, 256, 2, lambda b, n: n - b, True),
    ("Llama L 2048 B 4 H 16, forward threshold launch", 32, 64, 4, lambda b, n: b + 1, True),
    ("Llama L 2048 B 4 H 16, forward output launch", 32, 64, 3, lambda b, n: b + 1, True),
    ("Llama L 2048 B 4 H 16, dQ", 32, 64, 3, lambda b, n: b + 1, True),
    ("Llama L 2048 B 4 Hkv 4, dK/dV", 32, 16, 2, lambda b, n: 4 * (n - b), True),
    ("Llama L 2048 B 4 H 16, causal bool mask, forward threshold launch", 32, 64, 4,
     lambda b, n: b + 1, False),
    ("Llama L 2048 B 4 H 16, causal bool mask, dQ", 32, 64, 3, lambda b, n: b + 1, False),
]


def makespan(durations, slots: int) -> float:
    """When the last program ends if each starts, in order, on the first free slot."""
    free_at = [0.0] * slots
    for duration in durations:
        heapq.heappush(free_at, heapq.heappop(free_at) + duration)
    return max(free_at)


def launch_orders(n_blocks: int, n_heads: int, tiles, fixed: float, blocks_longest_first: bool):
    """The programs' durations in launch order: blocks first (head after head, each head's
    blocks longest first or in ascending order) and heads first (longest first, as the
    kernels number them)."""
    longest_first = sorted(range(n_blocks), key=lambda b: -tiles(b, n_blocks))
    block_order = longest_first if blocks_longest_first else range(n_blocks)
    blocks_first = [tiles(b, n_blocks) + fixed for _ in range(n_heads) for b in block_order]
    heads_first = [tiles(b, n_blocks) + fixed for b in longest_first for _ in range(n_heads)]
    return blocks_first, heads_first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132, help="SMs (H100 / H200: 132)")
    parser.add_argument("--fixed", type=float, default=0.5, help="a program's set-up, in tiles")
    args = parser.parse_args(argv)
    print(f"launch (causal), {args.sms} SMs | programs | slots | over ideal, blocks first | "
          "over ideal, heads first (longest first) | time saved")
    for label, n_blocks, n_heads, per_sm, tiles, blocks_longest_first in CASES:
        slots = per_sm * args.sms
        blocks_first, heads_first = launch_orders(n_blocks, n_heads, tiles, args.fixed,
                                                  blocks_longest_first)
        ideal = sum(blocks_first) / slots
        blocks_time, heads_time = makespan(blocks_first, slots), makespan(heads_first, slots)
        print(f"{label} | {len(blocks_first)} | {slots} | {blocks_time / ideal - 1:+.1%} | "
              f"{heads_time / ideal - 1:+.1%} | {1 - heads_time / blocks_time:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
