"""Steps per thread of the CUDA forwards' sequential parts, split over a row's block
(csrc/cuda/structured.cu), counted on the CPU in Python models of the kernels, against one
thread. Counts, not times: a thread's steps depend on each other, so the longest thread's
count (summed over the stages that barriers separate) is the latency in steps.

- tv: Condat's scan in chunks joined where their scans meet (block_tv_prox); a step is one
  iteration of the scan's main loop. The chunked output is checked to equal the
  sequential scan's bit for bit (float64).
- pav: OSCAR's pool-adjacent-violators in chunks joined in a tree (block_oscar_pav); a step
  is one append or one pooling. Checked against the one-thread PAV up to rounding. Also
  the chunk length and the shared-memory passes a warp's access to its threads' i-th
  entries takes (`bank_passes`; the backward's segment_means chunks its rows alike).

Rows are randn of the given lengths, scaled as the kernels do (by 2^-e so that |v| < 1; TV
also shifted by the scaled maximum; the regulariser scaled with them), threads as the
forward's `plan_launch` picks them (one per 16 entries for TV, 8 for OSCAR; a power of two,
32 to 1024).

Usage: python tools/model_structured.py [--op tv pav] [--rows 20] [--lengths 512 1024 65536]
           [--lams 0.01 0.1 1 3 30] [--betas 1e-4 1e-3 1e-2]
"""
import argparse
import copy
import math
import sys

import numpy as np

PAUSED, RESTARTED, DONE = range(3)
MIN_CHUNK = 16


class Scan:
    """Condat's scan as structured_algos.h's TvScan, counting main-loop steps."""

    def __init__(self, w, at, lam):
        self.k = self.k0 = self.kplus = self.kminus = at
        self.umin, self.umax, self.vmin, self.vmax = lam, -lam, w[at] - lam, w[at] + lam
        self.steps = 0

    def _write(self, out, value, last):
        while True:
            out[self.k0] = value
            self.k0 += 1
            if self.k0 > last:
                return

    def run(self, w, out, stop, width, lam, on_restart):
        while True:
            if self.k == stop - 1:
                if stop < width:
                    return PAUSED
                if self.umin < 0:
                    self._write(out, self.vmin, self.kminus)
                    self.k = self.kminus = self.k0
                    self.vmin, self.umin = w[self.k0], lam
                    self.umax = self.vmin + self.umin - self.vmax
                elif self.umax > 0:
                    self._write(out, self.vmax, self.kplus)
                    self.k = self.kplus = self.k0
                    self.vmax, self.umax = w[self.k0], -lam
                    self.umin = self.vmax + self.umax - self.vmin
                else:
                    self.vmin += self.umin / (self.k - self.k0 + 1)
                    self._write(out, self.vmin, self.k)
                    return DONE
                continue
            self.steps += 1
            self.umin += w[self.k + 1] - self.vmin
            if self.umin < -lam:
                self._write(out, self.vmin, self.kminus)
                self.k = self.kplus = self.kminus = self.k0
                self.vmin = w[self.k0]
                self.vmax, self.umin, self.umax = self.vmin + 2 * lam, lam, -lam
                if on_restart(self.k0, 1):
                    return RESTARTED
                continue
            self.umax += w[self.k + 1] - self.vmax
            if self.umax > lam:
                self._write(out, self.vmax, self.kplus)
                self.k = self.kplus = self.kminus = self.k0
                self.vmax = w[self.k0]
                self.vmin, self.umin, self.umax = self.vmax - 2 * lam, lam, -lam
                if on_restart(self.k0, 2):
                    return RESTARTED
                continue
            self.k += 1
            if self.umin >= lam:
                self.kminus = self.k
                self.vmin += (self.umin - lam) / (self.kminus - self.k0 + 1)
                self.umin = lam
            if self.umax <= -lam:
                self.kplus = self.k
                self.vmax += (self.umax + lam) / (self.kplus - self.k0 + 1)
                self.umax = -lam


def tv_chunked(w, lam, threads):
    """block_tv_prox's rounds: (output, rounds, steps of the longest thread summed over rounds)."""
    m = len(w)
    out, restart = np.full(m, np.nan), np.zeros(m, np.int8)
    round_begin, chunk, carried, rounds, critical = 0, max(MIN_CHUNK, -(-m // threads)), None, 0, 0
    while True:
        rounds += 1
        left = m - round_begin
        spread = min(threads, -(-left // chunk))
        chunk = -(-left // spread) | 1
        lanes = -(-left // chunk)
        begins = [round_begin + c * chunk for c in range(lanes)]
        ends = [min(m, b + chunk) for b in begins]
        scans = [carried if c == 0 and carried else Scan(w, begins[c], lam) for c in range(lanes)]
        before = [s.steps for s in scans]
        for c in range(lanes):
            restart[begins[c]:ends[c]] = 0

        def record(k0, sign):
            restart[k0] = sign
            return False

        for c in range(lanes):
            scans[c].run(w, out, ends[c], m, lam, record)
        at_chunk_end = [copy.copy(s) for s in scans]
        failed = None
        for c in range(lanes - 1):
            end = ends[c]
            stop = scans[c].run(w, out, min(m, end + chunk), m, lam,
                                lambda k0, sign: k0 >= end and restart[k0] == sign)
            if stop == PAUSED and failed is None:
                failed = c
        critical += max(s.steps - b for s, b in zip(scans, before))
        if failed is None:
            return out, rounds, critical
        carried = at_chunk_end[failed]
        round_begin = ends[failed]
        chunk *= 2

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


def odd_chunk(m, threads):
    """structured.cu's odd_chunk: the chunk length of m entries over `threads` threads."""
    return -(-m // threads) | 1


def bank_passes(chunk):
    """Shared-memory passes of one warp-wide access in a chunked loop over 4-byte entries:
    thread t reads entry t * chunk + i; 32 banks of 4 bytes; the most threads on one bank
    is the number of passes (1 when every thread has a bank of its own)."""
    return max(np.bincount([(t * chunk) % 32 for t in range(32)]))


def pav_chunked(values, threads):
    """(levels, steps of the longest thread summed over the stages)."""
    m = len(values)
    chunk = odd_chunk(m, threads)
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


def launch_threads(n, per_thread):
    return min(1024, max(32, 1 << math.ceil(math.log2(-(-n // per_thread)))))


def tv_row(rng, n, lam, threads):
    """(rounds, steps of the longest thread, steps of one thread) of one randn row."""
    x = rng.standard_normal(n)
    e = np.frexp(np.abs(x).max())[1]
    w, lam_w = (x - x.max()) * 2.0 ** -e, lam * 2.0 ** -e
    sequential = Scan(w, 0, lam_w)
    expected = np.full(n, np.nan)
    sequential.run(w, expected, n, n, lam_w, lambda k0, sign: False)
    out, rounds, critical = tv_chunked(w, lam_w, threads)
    assert np.array_equal(out, expected), (n, lam)
    return rounds, critical, sequential.steps


def pav_row(rng, n, beta, threads):
    """(steps of the longest thread, steps of one thread) of one row's randn magnitudes."""
    magnitude = np.sort(np.abs(rng.standard_normal(n)))[::-1]
    e = np.frexp(magnitude[0])[1]
    values = magnitude * 2.0 ** -e - beta * 2.0 ** -e * (n - 1 - np.arange(n))
    one = Blocks(n)
    steps = sum(one.append(r, values[r], 0) for r in range(n))
    levels, critical = pav_chunked(values, threads)
    np.testing.assert_allclose(levels, one.levels(n), rtol=1e-12, atol=1e-15)
    return critical, steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", nargs="+", choices=["tv", "pav"], default=["tv", "pav"])
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 65536])
    parser.add_argument("--lams", type=float, nargs="+", default=[0.01, 0.1, 1.0, 3.0, 30.0])
    parser.add_argument("--betas", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    for op in args.op:
        per_thread, regs, name = (16, args.lams, "lam") if op == "tv" else (8, args.betas, "beta")
        columns = ["length", "threads", name] + (["rounds"] if op == "tv" else ["chunk", "bank passes"]) + [
            "steps/thread", "one thread", "ratio"]
        print(f"{op}: " + " ".join(f"{c:>12}" for c in columns))
        for n in args.lengths:
            threads = launch_threads(n, per_thread)
            rows = args.rows if n <= 4096 else max(1, args.rows // 10)
            for reg in regs:
                if op == "tv":
                    rounds, critical, steps = np.mean([tv_row(rng, n, reg, threads) for _ in range(rows)], axis=0)
                    counts = [f"{rounds:12.1f}"]
                else:
                    critical, steps = np.mean([pav_row(rng, n, reg, threads) for _ in range(rows)], axis=0)
                    chunk = odd_chunk(n, threads)
                    counts = [f"{chunk:12d}", f"{bank_passes(chunk):12d}"]
                cells = [f"{n:12d}", f"{threads:12d}", f"{reg:12g}"] + counts + [
                    f"{critical:12.0f}", f"{steps:12.0f}", f"{steps / critical:12.1f}"]
                print(f"{op}: " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
