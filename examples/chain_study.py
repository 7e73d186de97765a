"""What the chain prior does to attention maps: SparseMAP and CRF over the chain of keys next
to 1.5-entmax, on rows whose relevant keys form one contiguous span.

Each row has 64 keys; a span of 6 to 16 consecutive keys at a random place scores
``+signal`` and the rest ``-signal``, plus Gaussian noise. The row-wise 1.5-entmax reads the
scores one key at a time; SparseMAP and the CRF add a 2x2 transition matrix T over
neighbouring keys, here ``T = [[c, -c], [-c, c]]`` (w = T00 + T11 - T01 - T10 = 4c > 0:
neighbours like to agree), which for SparseMAP fuses neighbours into runs of equal weight.

Printed per mapping, averaged over the rows: the keys with nonzero weight (support), the
number of separate runs of nonzero keys (1 = one contiguous span), the share of the true span
inside the support (recall) and of the support inside the true span (precision), and the
shares of weights exactly 0 and exactly 1. The figure shows the first rows of each map.

Usage: python examples/chain_study.py [--rows 2000] [--noise 1.0] [--out docs]
"""
import argparse
import os

import torch

from entmax_fast import crf_marginals, entmax15, sparsemap_marginals

KEYS = 64


def span_rows(rows: int, noise: float, signal: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 17, (rows,), generator=gen)
    starts = (torch.rand(rows, generator=gen) * (KEYS - lengths + 1)).long()
    index = torch.arange(KEYS)
    span = (index >= starts[:, None]) & (index < (starts + lengths)[:, None])
    scores = torch.where(span, signal, -signal) + noise * torch.randn(rows, KEYS, generator=gen, dtype=torch.float64)
    return scores.double(), span


def runs(selected: torch.Tensor) -> torch.Tensor:
    """Number of maximal runs of True per row."""
    starts = selected[:, 1:] & ~selected[:, :-1]
    return starts.sum(-1) + selected[:, 0].long()


def mappings(coupling: float):
    T = torch.tensor([[coupling, -coupling], [-coupling, coupling]], dtype=torch.float64)
    zero = torch.zeros(2, 2, dtype=torch.float64)
    return [
        ("1.5-entmax", lambda s: entmax15(s, dim=-1)),
        ("SparseMAP, T = 0 (clip)", lambda s: sparsemap_marginals(s, zero)),
        (f"SparseMAP, chain T (c = {coupling})", lambda s: sparsemap_marginals(s, T)),
        (f"CRF, chain T (c = {coupling})", lambda s: crf_marginals(s, T)),
    ]


def study(rows: int, noise: float, signal: float, coupling: float, seed: int = 0):
    scores, span = span_rows(rows, noise, signal, seed)
    results = []
    maps = {}
    for name, mapping in mappings(coupling):
        weights = mapping(scores)
        selected = weights > 0
        support = selected.sum(-1).double()
        recall = (selected & span).sum(-1) / span.sum(-1)
        precision = (selected & span).sum(-1) / support.clamp_min(1)
        results.append({"mapping": name, "support": support.mean().item(), "runs": runs(selected).double().mean().item(),
                        "recall": recall.mean().item(), "precision": precision.mean().item(),
                        "exact 0": (weights == 0).double().mean().item(),
                        "exact 1": (weights == 1).double().mean().item()})
        maps[name] = weights[:12]
    return results, maps, span[:12]


def table(results) -> str:
    columns = ["mapping", "support", "runs", "recall", "precision", "exact 0", "exact 1"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in results:
        lines.append("| " + " | ".join(row["mapping"] if c == "mapping" else f"{row[c]:.3f}" for c in columns) + " |")
    return "\n".join(lines)


def figure(maps, span, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(maps) + 1, 1, figsize=(8, 1.6 * (len(maps) + 1)), sharex=True)
    panels = [("true span", span.double())] + list(maps.items())
    for ax, (name, weights) in zip(axes, panels):
        ax.imshow(weights.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=max(1e-9, float(weights.max())),
                  interpolation="nearest")
        ax.set_ylabel("row")
        ax.set_title(name, fontsize=9)
    axes[-1].set_xlabel("key")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--noise", type=float, default=1.0)
    parser.add_argument("--signal", type=float, default=0.5)
    parser.add_argument("--coupling", type=float, default=0.5, help="c in T = [[c, -c], [-c, c]]")
    parser.add_argument("--out", default="docs")
    args = parser.parse_args(argv)
    results, maps, span = study(args.rows, args.noise, args.signal, args.coupling)
    text = table(results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    figure(maps, span, os.path.join(args.out, "chain_study.png"))
    return results


if __name__ == "__main__":
    main()
