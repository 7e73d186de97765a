"""Steps per thread of the CUDA forward's PAV in chunks (block_oscar_pav in
csrc/cuda/structured.cu), counted on the CPU in a Python model of it, against the one-thread
PAV. Counts, not times: a step is one append or one pooling, and the steps of a thread
depend on each other, so the longest thread's count per stage (the chunk pass, then each
level of the join tree), summed over the stages, is the PAV's latency in steps. Each row's
result is checked against the one-thread PAV's (float64, up to rounding).

Rows are randn of the given lengths, their magnitudes sorted decreasingly and scaled as the
kernels do (by 2^-e so that they are below 1; beta with them), threads as the forward's
launch plan picks them (one per 8 entries, a power of two, 32 to 1024).

Usage: python bench/model_oscar_pav.py [--rows 20] [--lengths 512 1024 8192] [--betas 1e-4 1e-3 1e-2]
"""
import argparse
import math

import numpy as np


class Blocks:
    """structured_algos.h's PavBlocks, counting appends and poolings."""

    def __init__(self, m):
        self.sum, self.len = np.zeros(m), np.zeros(m, np.int64)
        self.first, self.is_start = np.zeros(m, np.int64), np.zeros(m, bool)

    def violates(self, left, right):
        return self.sum[left] / self.len[left] <= self.sum[right] / self.len[right]

    def pool(self, left, right):
        self.sum[left] += self.sum[right]
        self.len[left] += self.len[right]
        self.first[left + self.len[left] - 1] = left
        self.is_start[right] = False
        return left

    def settle_left(self, s, floor):
        steps = 0
        while s > floor and self.violates(self.first[s - 1], s):
            s = self.pool(self.first[s - 1], s)
            steps += 1
        return s, steps

    def append(self, r, value, floor):
        self.sum[r], self.len[r], self.first[r], self.is_start[r] = value, 1, r, True
        return 1 + self.settle_left(r, floor)[1]

    def join(self, floor, boundary, end):
        s, nxt, steps = self.first[boundary - 1], boundary, 0
        while nxt < end and self.violates(s, nxt):
            s, settled = self.settle_left(self.pool(s, nxt), floor)
            steps += 1 + settled
            nxt = s + self.len[s]
        return steps

    def levels(self, m):
        out, s = np.zeros(m), 0
        while s < m:
            out[s:s + self.len[s]] = max(self.sum[s] / self.len[s], 0.0)
            s += self.len[s]
        return out


def chunked(values, threads):
    """(levels, steps of the longest thread summed over the stages)."""
    m = len(values)
    chunk = -(-m // threads)
    lanes = -(-m // chunk)
    blocks = Blocks(m)
    critical = max(sum(blocks.append(r, values[r], t * chunk) for r in range(t * chunk, min(m, (t + 1) * chunk)))
                   for t in range(lanes))
    width = 1
    while width < lanes:
        critical += max([blocks.join(t * chunk, (t + width) * chunk, min(m, (t + 2 * width) * chunk))
                         for t in range(0, lanes, 2 * width) if t + width < lanes] or [0])
        width *= 2
    return blocks.levels(m), critical


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 8192])
    parser.add_argument("--betas", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'length':>7} {'threads':>7} {'beta':>6} {'steps/thread':>12} {'one thread':>10} {'ratio':>6}")
    for n in args.lengths:
        threads = min(1024, max(32, 1 << math.ceil(math.log2(-(-n // 8)))))
        rows = args.rows if n <= 4096 else max(1, args.rows // 10)
        for beta in args.betas:
            stats = []
            for _ in range(rows):
                magnitude = np.sort(np.abs(rng.standard_normal(n)))[::-1]
                e = np.frexp(magnitude[0])[1]
                values = magnitude * 2.0 ** -e - beta * 2.0 ** -e * (n - 1 - np.arange(n))
                one = Blocks(n)
                steps = sum(one.append(r, values[r], 0) for r in range(n))
                levels, critical = chunked(values, threads)
                np.testing.assert_allclose(levels, one.levels(n), rtol=1e-12, atol=1e-15)
                stats.append((critical, steps))
            critical, steps = np.mean(stats, axis=0)
            print(f"{n:7d} {threads:7d} {beta:6g} {critical:12.0f} {steps:10.0f} {steps / critical:6.1f}")


if __name__ == "__main__":
    main()
