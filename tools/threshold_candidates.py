"""How many entries of a row the C++ closed-form thresholds (csrc/cpu/row_solvers.h,
closed_form_mu) read after the row's maximum, against the support they look for.

The row's entries are dealt round-robin to 16 lanes and each lane's largest is kept; the
threshold of those 16 entries bounds the row's from below, and only entries above that
bound are gathered. This prints, per row length, the mean share of the row above the bound
from the lane maxima, above the bound y > -1 (any single entry's), and in the support, for
N(0, 1) rows in float64 (1.5-entmax, y = (z - max z) / 2 and p = [y - t]_+^2; sparsemax,
y = z - max z and p = [y - t]_+).

    python tools/threshold_candidates.py --lengths 1024 2048 --rows 50
"""
import argparse

import torch

LANES = 16


def threshold(y: torch.Tensor, alpha: float) -> float:
    """t with sum [y - t]_+^(1/(alpha-1)) = 1 (alpha 1.5 or 2), by sorting."""
    ys, _ = torch.sort(y, descending=True)
    ys = ys[torch.isfinite(ys)]
    for k in range(1, len(ys) + 1):
        top = ys[:k]
        if alpha == 2.0:
            t = (top.sum() - 1) / k
        else:
            mean = top.mean()
            t = mean - torch.sqrt(torch.clamp((1 - ((top - mean) ** 2).sum()) / k, min=0))
        if k == len(ys) or ys[k] <= t:
            return float(t)
    raise AssertionError("unreachable")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(args.seed)
    print("alpha | L    | above lane bound | above y > -1 | support")
    for alpha, factor in ((1.5, 0.5), (2.0, 1.0)):
        for n in args.lengths:
            shares = torch.zeros(3, dtype=torch.float64)
            for _ in range(args.rows):
                z = torch.randn(n, generator=generator, dtype=torch.float64)
                y = factor * (z - z.max())
                lanes = torch.full((LANES,), -torch.inf, dtype=torch.float64)
                for e in range(LANES):
                    lanes[e] = y[e::LANES].max() if e < n else -torch.inf
                t_lanes, t_row = threshold(lanes, alpha), threshold(y, alpha)
                assert t_lanes <= t_row + 1e-12
                shares += torch.tensor([(y > t_lanes).double().mean(), (y > -1).double().mean(),
                                        (y > t_row).double().mean()])
            shares /= args.rows
            print(f"{alpha:<5} | {n:<4} | {100 * shares[0]:15.2f}% | {100 * shares[1]:11.2f}% | {100 * shares[2]:6.2f}%")


if __name__ == "__main__":
    main()
