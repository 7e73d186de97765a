"""Continuous attention: forward + backward time against a discrete softmax attention
baseline measured in the same run (same query/keys/values, same device).

    python bench/bench_continuous.py [--device cpu] [--threads 1] [--reps 20] [--csv out.csv]

1-D rows: ContinuousAttention (discrete attention for mu/sigma^2 + E_p[psi] + ridge value fit)
vs plain softmax attention softmax(q k^T / sqrt d) v over the same L keys.
2-D rows: E_p[psi] for a batch of (mu, Sigma) on the reference basis of docs/maths.md,
"Continuous attention" (10 x 10 RBFs, Sigma_j = 0.001 I) vs softmax attention of the same
queries over L = 100 grid cells.
"""
import argparse
import csv
import math
import statistics
import time

import torch

from entmax_fast import continuous as C


def timed(fn, reps, sync):
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def discrete_attention_step(query, keys, values):
    def step():
        scores = query[:, None, :] @ keys.transpose(-1, -2) / math.sqrt(keys.shape[-1])
        context = (torch.softmax(scores, -1) @ values)[:, 0]
        context.square().sum().backward()

    return step


def continuous_attention_step(module, query, keys, values, mask):
    def step():
        module(query, keys, values, mask).square().sum().backward()

    return step


def expectation_2d_step(fn, mu, sigma, centers, variances):
    def step():
        fn(mu, sigma, centers, variances).square().sum().backward()

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    rows = []

    for batch, length, dim in [(32, 64, 64), (32, 256, 64), (128, 512, 64)]:
        query = torch.randn(batch, dim, device=device, requires_grad=True)
        keys = torch.randn(batch, length, dim, device=device, requires_grad=True)
        values = torch.randn(batch, length, dim, device=device, requires_grad=True)
        baseline = timed(discrete_attention_step(query, keys, values), args.reps, sync)
        lengths = torch.randint(length // 2, length + 1, (batch,), device=device)
        ragged = torch.arange(length, device=device)[None] < lengths[:, None]
        for density in ("softmax", "sparsemax", "entmax15"):
            module = C.ContinuousAttention(dim, dim, density=density).to(device)
            for mask_name, mask in (("equal", None), ("ragged", ragged)):
                t = timed(continuous_attention_step(module, query, keys, values, mask), args.reps, sync)
                rows.append(("1d", density, mask_name, batch, length, dim, baseline * 1e3, t * 1e3, t / baseline))

    centers = torch.stack(torch.meshgrid(*[torch.linspace(0, 1, 10)] * 2, indexing="ij"), -1).reshape(-1, 2).to(device)
    variances = torch.full((100,), 0.001, device=device)
    for batch in (32, 256):
        query = torch.randn(batch, 64, device=device, requires_grad=True)
        keys = torch.randn(batch, 100, 64, device=device, requires_grad=True)
        values = torch.randn(batch, 100, 64, device=device, requires_grad=True)
        baseline = timed(discrete_attention_step(query, keys, values), args.reps, sync)
        mu = torch.rand(batch, 2, device=device, requires_grad=True)
        sigma = (torch.eye(2, device=device) * 0.01).repeat(batch, 1, 1).requires_grad_()
        variants = [("softmax", C.continuous_softmax_2d)]
        for angles in (32, 128):
            fn = lambda m, s, c, v, k=angles: C.continuous_sparsemax_2d(m, s, c, v, num_angles=k)  # noqa: E731
            variants.append((f"sparsemax K={angles}", fn))
        for name, fn in variants:
            t = timed(expectation_2d_step(fn, mu, sigma, centers, variances), args.reps, sync)
            rows.append(("2d", name, "-", batch, 100, 64, baseline * 1e3, t * 1e3, t / baseline))

    header = ("dims", "density", "lengths", "B", "L", "D", "softmax_attn_ms", "continuous_ms", "ratio")
    print(f"device={device} threads={args.threads} reps={args.reps} (median fwd+bwd)")
    print(" ".join(f"{h:>17}" for h in header))
    for row in rows:
        print(" ".join(f"{x:>17.3f}" if isinstance(x, float) else f"{x!s:>17}" for x in row))
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)


if __name__ == "__main__":
    main()
