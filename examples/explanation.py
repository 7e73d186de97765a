"""Is sparse attention a better explanation? A small test on a task whose explanation is known.

Each input is a [CLS] token followed by L tokens: distractors, and three marked tokens, each
voting for class 0 or 1, at random positions; the label is the majority vote. A one-layer,
one-head encoder reads the sequence and classifies from the [CLS] position, so the [CLS]
query's attention over the tokens is the explanation to judge, and the marked positions are
the right one. The same model is trained with softmax, 1.5-entmax, sparsemax and a learned
α (entmax_fast.entmax_attention), then, per kind, on held-out inputs:

- accuracy;
- support precision / recall: of the tokens with nonzero weight, the share that are marked,
  and of the marked tokens, the share with nonzero weight (softmax gives every token weight);
- top-3 hit rate: the share of the three most-attended tokens that are marked;
- accuracy after swapping the mapping at inference (sparse kinds to softmax, softmax to
  1.5-entmax), after shuffling the keys among the positions (the weights then fall on other
  tokens' values), and after erasing (masking out) the most-attended token against erasing
  a random one.

The perturbations follow Drozdyuk et al., "Is Sparse Attention a Better Explanation?": a
larger drop means the prediction leans on what the weights point at. The table and a
heat map of the [CLS] weights for a few inputs are written to --out.

    python examples/explanation.py                 # about 2 minutes on a 2-core CPU
    python examples/explanation.py --quick         # seconds: a smoke run (the tests run it)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import entmax_fast

KINDS = {"softmax": 1.0, "1.5-entmax": 1.5, "sparsemax": 2.0, "learned α": "learned"}
# Swapping the mapping at inference: sparse kinds to softmax, softmax to 1.5-entmax.
SWAPPED = {"softmax": 1.5, "1.5-entmax": 1.0, "sparsemax": 1.0, "learned α": 1.0}
VOTES = 3
CLS, VOTE_0, VOTE_1, FIRST_DISTRACTOR = 0, 1, 2, 3


def make_data(n, length, vocab, generator):
    """(tokens (n, 1 + length), labels (n,), marked (n, 1 + length) bool): three marked
    tokens per input among distractors; the label is their majority vote."""
    tokens = torch.randint(FIRST_DISTRACTOR, vocab, (n, length), generator=generator)
    positions = torch.rand(n, length, generator=generator).argsort(dim=1)[:, :VOTES]
    votes = torch.randint(0, 2, (n, VOTES), generator=generator)
    tokens.scatter_(1, positions, VOTE_0 + votes)
    labels = (votes.sum(1) * 2 > VOTES).long()
    marked = torch.zeros(n, length, dtype=torch.bool).scatter_(1, positions, True)
    tokens = torch.cat([torch.full((n, 1), CLS), tokens], dim=1)
    marked = torch.cat([torch.zeros(n, 1, dtype=torch.bool), marked], dim=1)
    return tokens, labels, marked


class Classifier(nn.Module):
    """Embeddings, one single-head entmax attention layer, a classifier on the [CLS] output."""

    def __init__(self, vocab, length, width, alpha):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(1 + length, width) * 0.02)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Sequential(nn.Linear(2 * width, width), nn.ReLU(), nn.Linear(width, 2))
        self.alpha_logit = nn.Parameter(torch.zeros(1)) if alpha == "learned" else None
        self.alpha = alpha

    def current_alpha(self):
        # 1 + sigmoid(w) kept away from 1 (where dα divides by (α − 1)²), as MultiheadEntmaxAttention does
        if self.alpha_logit is None:
            return self.alpha
        return (1.0 + torch.sigmoid(self.alpha_logit)).clamp(1.01, 2.0)

    def forward(self, tokens, alpha=None, shuffle_keys=None, erase=None, return_weights=False):
        """Logits; with ``return_weights`` also the [CLS] row's weights (n, 1 + length).
        shuffle_keys: a permutation of the positions applied to the keys only; erase: (n,)
        positions masked out of every query's keys."""
        x = self.embed(tokens) + self.position
        q, k, v = (t.unsqueeze(1) for t in self.qkv(x).chunk(3, dim=-1))  # (n, 1, L, E)
        if shuffle_keys is not None:
            k = k[:, :, shuffle_keys]
        mask = None
        if erase is not None:
            mask = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
            mask[torch.arange(len(tokens)), erase] = False
            mask = mask[:, None, None, :]
        alpha = self.current_alpha() if alpha is None else alpha
        if return_weights:
            weights = entmax_fast.attention_weights(q, k, mask, alpha=alpha)
            attended = weights @ v
        else:
            weights = None
            attended = entmax_fast.entmax_attention(q, k, v, mask, alpha=alpha)
        cls = torch.cat([attended[:, 0, 0], x[:, 0]], dim=-1)
        logits = self.head(cls)
        return (logits, weights[:, 0, 0]) if return_weights else logits


def train(kind, data, length, vocab, width, epochs, seed):
    torch.manual_seed(seed)
    model = Classifier(vocab, length, width, KINDS[kind])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens, labels, _ = data
    for _ in range(epochs):
        for batch in torch.randperm(len(tokens)).split(128):
            loss = F.cross_entropy(model(tokens[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def _accuracy(logits, labels):
    return (logits.argmax(-1) == labels).float().mean().item()


@torch.no_grad()
def evaluate(kind, model, data, generator):
    tokens, labels, marked = data
    logits, weights = model(tokens, return_weights=True)
    weights = weights[:, 1:]  # the [CLS] row over the tokens, [CLS] itself left out
    votes = marked[:, 1:]
    support = weights > 0
    top = weights.topk(VOTES, dim=-1).indices
    most = weights.argmax(-1) + 1
    random_position = torch.randint(1, tokens.shape[1], (len(tokens),), generator=generator)
    shuffled = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(tokens.shape[1] - 1,
                                                                                 generator=generator)])
    return {
        "kind": kind,
        "alpha": float(model.current_alpha()) if model.alpha_logit is not None else KINDS[kind],
        "accuracy": _accuracy(logits, labels),
        "support precision": (support & votes).sum().item() / max(1, support.sum().item()),
        "support recall": (support & votes).sum().item() / votes.sum().item(),
        "zero share": 1.0 - support.float().mean().item(),
        "top-3 hits": votes.gather(1, top).float().mean().item(),
        "swapped mapping": _accuracy(model(tokens, alpha=SWAPPED[kind]), labels),
        "shuffled keys": _accuracy(model(tokens, shuffle_keys=shuffled), labels),
        "erase most attended": _accuracy(model(tokens, erase=most), labels),
        "erase random": _accuracy(model(tokens, erase=random_position), labels),
    }, weights


def _table(rows, seeds):
    columns = [c for c in rows[0] if c != "kind"]
    lines = ["| kind | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        cells = []
        for column in columns:
            values = [r[column] for r in mine]
            mean = sum(values) / len(values)
            spread = max(values) - min(values)
            cells.append(f"{mean:.3f}" + (f" ± {spread / 2:.3f}" if seeds > 1 else ""))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _heat_map(examples, marked, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no heat map"
    fig, axes = plt.subplots(len(examples), 1, figsize=(10, 1.1 * len(examples) + 0.6), sharex=True)
    for ax, (kind, weights) in zip(axes, examples.items()):
        ax.imshow(weights.numpy(), aspect="auto", cmap="viridis", vmin=0)
        rows, cols = marked.nonzero(as_tuple=True)
        ax.scatter(cols.numpy(), rows.numpy(), marker="x", color="red", s=12)
        ax.set_yticks([])
        ax.set_ylabel(kind, rotation=0, ha="right", va="center", fontsize=8)
    axes[-1].set_xlabel("token position (red x: a marked token)")
    fig.suptitle("[CLS] attention over the tokens, four held-out inputs per kind", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run in seconds (small data, one epoch)")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = parser.parse_args(argv)
    length, vocab, width = 24, 16, 32
    n_train, n_test, epochs = (512, 256, 1) if args.quick else (4000, 2000, 6)
    seeds = args.seeds or (1 if args.quick else 2)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    train_data = make_data(n_train, length, vocab, generator)
    test_data = make_data(n_test, length, vocab, generator)
    rows, examples = [], {}
    for seed in range(seeds):
        for kind in KINDS:
            model = train(kind, train_data, length, vocab, width, epochs, seed)
            row, weights = evaluate(kind, model, test_data, torch.Generator().manual_seed(seed))
            rows.append(row)
            if seed == 0:
                examples[kind] = weights[:4]
    table = _table(rows, seeds)
    print(f"[CLS] attention as explanation: L={length}, {VOTES} marked tokens, {n_train} training inputs, "
          f"{epochs} epochs, {seeds} seed(s) (mean ± half the range), {time.perf_counter() - started:.0f} s\n")
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "explanation.md"), "w") as f:
        f.write(table + "\n")
    print(_heat_map(examples, test_data[2][:4, 1:], os.path.join(args.out, "explanation.png")))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
