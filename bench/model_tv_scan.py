"""Steps per thread of the CUDA forward's chunked TV scan (block_tv_prox in
csrc/cuda/structured.cu), counted on the CPU in a Python model of it, against the one-thread
scan. Counts, not times: the scan's steps are sequential and dependent, so the longest
thread's count is the scan's latency in loop iterations. Each row's chunked result is
checked to equal the sequential scan's bit for bit (float64).

Rows are randn of the given lengths, scaled as the kernels do (by 2^-e so |v| < 1, shifted
by the scaled maximum), threads as the forward's launch plan picks them (one per 16 entries,
a power of two, 32 to 1024).

Usage: python bench/model_tv_scan.py [--rows 20] [--lengths 512 1024 65536] [--lams 0.01 0.1 1 3 30]
"""
import argparse
import copy
import math

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


def chunked(w, lam, threads):
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 65536])
    parser.add_argument("--lams", type=float, nargs="+", default=[0.01, 0.1, 1.0, 3.0, 30.0])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'length':>7} {'threads':>7} {'lam':>6} {'rounds':>6} {'steps/thread':>12} {'one thread':>10} {'ratio':>6}")
    for n in args.lengths:
        threads = min(1024, max(32, 1 << math.ceil(math.log2(-(-n // 16)))))
        rows = args.rows if n <= 4096 else max(1, args.rows // 10)
        for lam in args.lams:
            stats = []
            for _ in range(rows):
                x = rng.standard_normal(n)
                e = np.frexp(np.abs(x).max())[1]
                w, lam_w = (x - x.max()) * 2.0 ** -e, lam * 2.0 ** -e
                sequential = Scan(w, 0, lam_w)
                expected = np.full(n, np.nan)
                sequential.run(w, expected, n, n, lam_w, lambda k0, sign: False)
                out, rounds, critical = chunked(w, lam_w, threads)
                assert np.array_equal(out, expected), (n, lam)
                stats.append((rounds, critical, sequential.steps))
            rounds, critical, steps = np.mean(stats, axis=0)
            print(f"{n:7d} {threads:7d} {lam:6g} {rounds:6.1f} {critical:12.0f} {steps:10.0f} {steps / critical:6.1f}")


if __name__ == "__main__":
    main()
