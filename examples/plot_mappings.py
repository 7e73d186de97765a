"""The figure in the README: attention weights of one query under softmax, 1.5-entmax and
sparsemax (exact zeros shown as empty bars), and the three mappings of a 2-entry score.

    python examples/plot_mappings.py docs/mappings.png
"""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import entmax_fast  # noqa: E402

scores = torch.tensor([2.1, 1.9, 1.2, 0.6, 0.4, 0.1, -0.3, -0.8, -1.0, -1.6])
mappings = {"softmax (α = 1)": lambda z: torch.softmax(z, -1), "1.5-entmax": entmax_fast.entmax15,
            "sparsemax (α = 2)": entmax_fast.sparsemax}
fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
for ax, (name, fn) in zip(axes, mappings.items()):
    weights = fn(scores)
    ax.bar(range(len(scores)), weights, color=["C0" if w > 0 else "white" for w in weights], edgecolor="C0")
    ax.set_title(f"{name}: {int((weights > 0).sum())} of {len(scores)} non-zero")
    ax.set_ylim(0, 0.75)
    ax.set_xlabel("key")
axes[0].set_ylabel("weight")
t = torch.linspace(-3, 3, 301)
for name, fn in mappings.items():
    axes[3].plot(t, fn(torch.stack([t, torch.zeros_like(t)], -1))[:, 0], label=name)
axes[3].set_title("weight of entry 1 for scores [t, 0]")
axes[3].set_xlabel("t")
axes[3].legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[1] if len(sys.argv) > 1 else "mappings.png", dpi=110)
