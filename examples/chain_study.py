"""What the chain prior does to attention maps: models trained with 1.5-entmax attention and
with SparseMAP and CRF attention over the chain of keys (learned transitions), compared on a
task whose relevant keys form one contiguous span; then the same mappings with fixed
transitions on synthetic rows.

**Trained models** (the explanation example's setting, examples/explanation.py: one layer,
one learned [CLS] query, a classifier on its attention output, so the [CLS] row of weights
is the map to read). Each input is 32 tokens: distractors, one span of 5, 7 or 9
consecutive vote tokens (each a vote for class 0 or 1) at a random place, and 6 isolated
vote tokens elsewhere (noise votes: no two adjacent, none next to the span). The label is
the majority of the span's votes. A span vote and a noise vote are the same token, so a
row-wise mapping (1.5-entmax), which scores each key on its own, cannot tell them apart;
the chain's transitions see neighbours. ``MultiheadEntmaxAttention(attention="crf" |
"sparsemap")`` learns a 2x2 transition T per head (``chain_transitions``); the study starts
it at T = (w0/4)·[[1, -1], [-1, 1]] (w = T00 + T11 - T01 - T10 = w0; the module starts the
CRF at w0 = 0 and SparseMAP at w0 = +0.1) and reports the learned w per head (> 0: neighbours
like to agree).

Measured per head on held-out inputs, means over the rows: support (keys with nonzero
weight), runs (separate runs of nonzero keys; 1 = one contiguous span), span
recall / precision (of the span inside the support, of the support inside the span), noise
votes kept (share of the noise votes with nonzero weight), mass on the span (share of the
weight sum), exact 0 / exact 1 (shares of weights). The first table gives per model the
accuracy over the seeds, the dead heads (all-zero weights on every row) and the mean over
the seeds with a live head of the span head's measures and w (a seed's span head: its
live head with the largest mass on the span); its "all votes" line is the rule "majority of every vote
token" applied to the same held-out inputs. The second table gives every head of every
seed.

**Synthetic rows** (no training): 64 keys, a span of 6 to 16 keys scoring +0.5, the rest
-0.5, plus N(0, 1) noise; fixed T = [[c, -c], [-c, c]].

    python examples/chain_study.py            # both parts, about two minutes on a 2-core CPU
    python examples/chain_study.py --quick    # seconds: a smoke run (the tests run it)

Prints the tables; writes chain_study.png (trained maps) and chain_study_rows.png (synthetic
rows) under --out (default docs/, where docs/chain_study.md shows them).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from entmax_fast import MultiheadEntmaxAttention, backend_info, crf_marginals, entmax15, sparsemap_marginals

LENGTH, VOCAB, WIDTH, HEADS = 32, 16, 32, 2
SPAN_LENGTHS = (5, 7, 9)
NOISE_VOTES = 6
VOTE_0, VOTE_1, FIRST_DISTRACTOR = 0, 1, 2
# name: (attention kind, initial w of every head; None: no transitions)
CONFIGS = {
    "1.5-entmax": ("entmax15", None),
    "SparseMAP, w0 = 0": ("sparsemap", 0.0),
    "SparseMAP, w0 = +0.1": ("sparsemap", 0.1),  # the module's default
    "SparseMAP, w0 = +0.2": ("sparsemap", 0.2),
    "SparseMAP, w0 = -0.2": ("sparsemap", -0.2),
    "CRF, w0 = 0": ("crf", 0.0),
}


# ---------------------------------------------------------------------------------------
# Trained models: the span-vote task.

def span_votes(n: int, generator: torch.Generator):
    """(tokens (n, LENGTH), labels (n,), span (n, LENGTH) bool, noise (n, LENGTH) bool): one
    span of consecutive vote tokens, NOISE_VOTES isolated vote tokens away from it, the rest
    distractors; the label is the majority of the span's votes (odd lengths: no ties)."""
    tokens = torch.randint(FIRST_DISTRACTOR, VOCAB, (n, LENGTH), generator=generator)
    span = torch.zeros(n, LENGTH, dtype=torch.bool)
    noise = torch.zeros(n, LENGTH, dtype=torch.bool)
    lengths = torch.tensor(SPAN_LENGTHS)[torch.randint(len(SPAN_LENGTHS), (n,), generator=generator)]
    for row in range(n):
        size = int(lengths[row])
        start = int(torch.randint(LENGTH - size + 1, (1,), generator=generator))
        span[row, start:start + size] = True
        # Noise positions: not in or next to the span, and not next to each other. The span
        # blocks at most 11 of the 32 positions and each noise vote at most 3 more, so the
        # greedy scan always places all NOISE_VOTES.
        blocked = set(range(start - 1, start + size + 1))
        for position in torch.randperm(LENGTH, generator=generator).tolist():
            if position not in blocked:
                noise[row, position] = True
                blocked.update((position - 1, position, position + 1))
                if int(noise[row].sum()) == NOISE_VOTES:
                    break
    votes = torch.randint(2, (n, LENGTH), generator=generator)
    tokens = torch.where(span | noise, VOTE_0 + votes, tokens)
    labels = ((votes * span).sum(1) * 2 > span.sum(1)).long()
    return tokens, labels, span, noise


class SpanClassifier(nn.Module):
    """Token and position embeddings, one MultiheadEntmaxAttention layer read by one learned
    [CLS] query, a classifier on its output."""

    def __init__(self, attention: str, initial_w):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)
        self.query = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.1)
        self.attn = MultiheadEntmaxAttention(WIDTH, HEADS, batch_first=True, attention=attention)
        self.head = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 2))
        if initial_w is not None:
            with torch.no_grad():
                self.attn.chain_transitions.copy_(transition_matrix(initial_w / 4).expand(HEADS, 2, 2))

    def forward(self, tokens, need_weights=False):
        """Logits (n, 2) and, with ``need_weights``, the [CLS] weights (n, HEADS, LENGTH)."""
        x = self.embed(tokens) + self.position
        out, weights = self.attn(self.query.expand(len(tokens), 1, WIDTH), x, x, need_weights=need_weights,
                                 average_attn_weights=False)
        return self.head(out[:, 0]), None if weights is None else weights[:, :, 0]


def transition_matrix(coupling: float, dtype=torch.float32) -> torch.Tensor:
    """T = [[c, -c], [-c, c]]: w = T00 + T11 - T01 - T10 = 4c."""
    return torch.tensor([[coupling, -coupling], [-coupling, coupling]], dtype=dtype)


def transition_w(transitions: torch.Tensor) -> torch.Tensor:
    """w = T00 + T11 - T01 - T10 of (..., 2, 2) transitions."""
    return transitions[..., 0, 0] + transitions[..., 1, 1] - transitions[..., 0, 1] - transitions[..., 1, 0]


def train(config: str, data, epochs: int, seed: int):
    """The trained model (eval mode) and its w per head after every epoch (epochs + 1, HEADS)."""
    attention, initial_w = CONFIGS[config]
    torch.manual_seed(seed)
    model = SpanClassifier(attention, initial_w)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens, labels, _, _ = data
    history = []

    def record():
        if model.attn.chain_transitions is not None:
            history.append(transition_w(model.attn.chain_transitions.detach()).tolist())

    record()
    for _ in range(epochs):
        for batch in torch.randperm(len(tokens)).split(64):
            loss = F.cross_entropy(model(tokens[batch])[0], labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        record()
    return model.eval(), torch.tensor(history) if history else None


def runs(selected: torch.Tensor) -> torch.Tensor:
    """Number of maximal runs of True along the last dim."""
    starts = selected[..., 1:] & ~selected[..., :-1]
    return starts.sum(-1) + selected[..., 0].long()


def head_measures(weights: torch.Tensor, span: torch.Tensor, noise: torch.Tensor) -> dict:
    """Means over the rows of one head's weights (n, L)."""
    selected = weights > 0
    support = selected.sum(-1).double()
    return {"support": support.mean().item(),
            "runs": runs(selected).double().mean().item(),
            "span recall": ((selected & span).sum(-1) / span.sum(-1)).mean().item(),
            "span precision": ((selected & span).sum(-1) / support.clamp_min(1)).mean().item(),
            "noise votes kept": ((selected & noise).sum(-1) / noise.sum(-1)).mean().item(),
            "mass on span": ((weights * span).sum(-1) / weights.sum(-1).clamp_min(1e-30)).mean().item(),
            "exact 0": (weights == 0).double().mean().item(),
            "exact 1": (weights == 1).double().mean().item()}


@torch.no_grad()
def evaluate(model: SpanClassifier, data) -> tuple:
    """(accuracy, per-head measures (None for a dead head), w per head or None, weights)."""
    tokens, labels, span, noise = data
    logits, weights = model(tokens, need_weights=True)
    heads = [None if not (weights[:, h] > 0).any() else head_measures(weights[:, h].double(), span, noise)
             for h in range(HEADS)]
    transitions = model.attn.chain_transitions
    w = None if transitions is None else transition_w(transitions).tolist()
    return (logits.argmax(-1) == labels).double().mean().item(), heads, w, weights


def all_votes_accuracy(data) -> float:
    """Accuracy of "majority of every vote token" (span and noise votes together)."""
    tokens, labels, span, noise = data
    votes = span | noise
    ones = ((tokens == VOTE_1) & votes).sum(1)
    return ((ones * 2 > votes.sum(1)).long() == labels).double().mean().item()


TRAINED_COLUMNS = ("support", "runs", "span recall", "span precision", "noise votes kept", "mass on span", "exact 0",
                   "exact 1")


def trained_study(n_train: int, n_test: int, epochs: int, seeds: int):
    """Per model: accuracy over the seeds, dead heads, and the mean over the seeds with a
    live head of the span head's measures and w (the span head of a seed: its live head with
    the largest mass on the span); every run's per-head measures under "seeds"."""
    generator = torch.Generator().manual_seed(0)
    train_data = span_votes(n_train, generator)
    test_data = span_votes(n_test, generator)
    results, examples = {}, {}
    for config in CONFIGS:
        seed_runs = []
        for seed in range(seeds):
            model, history = train(config, train_data, epochs, seed)
            accuracy, heads, w, weights = evaluate(model, test_data)
            seed_runs.append({"accuracy": accuracy, "heads": heads, "w": w, "history": history})
            if seed == 0:
                examples[config] = (weights, history)
        span_heads = []
        for run in seed_runs:
            live = [h for h in range(HEADS) if run["heads"][h] is not None]
            if live:
                best = max(live, key=lambda h: run["heads"][h]["mass on span"])
                span_heads.append({**run["heads"][best], "w": None if run["w"] is None else run["w"][best]})
        accuracies = [run["accuracy"] for run in seed_runs]
        results[config] = {
            "accuracy": sum(accuracies) / seeds, "accuracy min": min(accuracies), "accuracy max": max(accuracies),
            "dead heads": sum(h is None for run in seed_runs for h in run["heads"]),
            "span head": {column: _mean([h[column] for h in span_heads]) for column in ("w", *TRAINED_COLUMNS)},
            "seeds": seed_runs}
    return results, examples, test_data


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _number(value):
    return "-" if value is None else f"{value:.3f}"


def _w(value):
    """A learned w: two decimals, or "0 exactly" (a head that never left w0 = 0)."""
    if value is None:
        return "-"
    return "0 exactly" if value == 0 else f"{value:+.2f}"


def trained_tables(results: dict, seeds: int, all_votes: float) -> str:
    """The summary table (span heads) and the table of every head of every seed."""
    columns = ["accuracy", "dead heads", "w", *TRAINED_COLUMNS]
    lines = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for config, r in results.items():
        accuracy = f"{r['accuracy']:.3f}" + (f" ({r['accuracy min']:.3f}-{r['accuracy max']:.3f})" if seeds > 1 else "")
        cells = [accuracy, f"{r['dead heads']} of {seeds * HEADS}", _w(r["span head"]["w"])]
        cells += [_number(r["span head"][c]) for c in TRAINED_COLUMNS]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    lines.append(f"| all votes (rule) | {all_votes:.3f} |" + " |" * (len(columns) - 1))
    every = ["w", "support", "runs", "span recall", "noise votes kept", "mass on span", "exact 0"]
    lines += ["", "| model | seed | head | accuracy | " + " | ".join(every) + " |", "|---" * (len(every) + 4) + "|"]
    for config, r in results.items():
        for seed, run in enumerate(r["seeds"]):
            for head, measures in enumerate(run["heads"]):
                w = _w(None if run["w"] is None else run["w"][head])
                cells = [w] + (["dead"] + [""] * (len(every) - 2) if measures is None else
                               [_number(measures[c]) for c in every[1:]])
                lines.append(f"| {config} | {seed} | {head} | {run['accuracy']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def trained_figure(examples: dict, data, path: str, inputs: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy

    _, _, span, noise = data
    colormap = matplotlib.colormaps["viridis"].with_extremes(bad="white")  # white: exactly 0
    fig, axes = plt.subplots(len(examples), HEADS + 1, figsize=(11, 1.55 * len(examples) + 0.8),
                             gridspec_kw={"width_ratios": [3] * HEADS + [1.4]}, squeeze=False)
    span_rows, span_cols = span[:inputs].nonzero(as_tuple=True)
    noise_rows, noise_cols = noise[:inputs].nonzero(as_tuple=True)
    for row, (config, (weights, history)) in enumerate(examples.items()):
        for head in range(HEADS):
            ax = axes[row][head]
            panel = weights[:inputs, head].double().numpy()
            ax.imshow(numpy.ma.masked_equal(panel, 0.0), aspect="auto", cmap=colormap, vmin=0,
                      vmax=max(1e-9, float(panel.max())), interpolation="nearest")
            ax.scatter(span_cols.numpy(), span_rows.numpy(), marker="s", s=5, facecolors="none", edgecolors="red",
                       linewidths=0.5)
            ax.scatter(noise_cols.numpy(), noise_rows.numpy(), marker="x", s=8, color="orange", linewidths=0.7)
            ax.set_yticks([])
            ax.set_xticks([0, LENGTH - 1])
            ax.tick_params(labelsize=6, length=2)
            ax.set_title(f"{config}, head {head}", fontsize=8)
        ax = axes[row][HEADS]
        if history is None:
            ax.axis("off")
        else:
            for head in range(HEADS):
                ax.plot(history[:, head].numpy(), label=f"head {head}", linewidth=1)
            ax.axhline(0, color="grey", linewidth=0.5)
            ax.set_title("w per epoch", fontsize=8)
            ax.tick_params(labelsize=6, length=2)
            ax.legend(fontsize=6)
    for head in range(HEADS):
        axes[-1][head].set_xlabel("token position", fontsize=7)
    fig.suptitle(f"[CLS] weights of the first {inputs} held-out inputs (seed 0); red squares: the span, orange x: "
                 "noise votes, white: exactly 0; each panel on its own colour scale", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Synthetic rows, fixed transitions.

ROW_KEYS = 64


def span_rows(rows: int, noise: float, signal: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 17, (rows,), generator=gen)
    starts = (torch.rand(rows, generator=gen) * (ROW_KEYS - lengths + 1)).long()
    index = torch.arange(ROW_KEYS)
    span = (index >= starts[:, None]) & (index < (starts + lengths)[:, None])
    scores = torch.where(span, signal, -signal) + noise * torch.randn(rows, ROW_KEYS, generator=gen,
                                                                      dtype=torch.float64)
    return scores.double(), span


def mappings(coupling: float):
    T = transition_matrix(coupling, torch.float64)
    zero = torch.zeros(2, 2, dtype=torch.float64)
    return [
        ("1.5-entmax", lambda s: entmax15(s, dim=-1)),
        ("SparseMAP, T = 0 (clip)", lambda s: sparsemap_marginals(s, zero)),
        (f"SparseMAP, chain T (c = {coupling})", lambda s: sparsemap_marginals(s, T)),
        (f"CRF, chain T (c = {coupling})", lambda s: crf_marginals(s, T)),
    ]


def rows_study(rows: int, noise: float, signal: float, coupling: float, seed: int = 0):
    scores, span = span_rows(rows, noise, signal, seed)
    results = []
    maps = {}
    for name, mapping in mappings(coupling):
        weights = mapping(scores)
        selected = weights > 0
        support = selected.sum(-1).double()
        recall = (selected & span).sum(-1) / span.sum(-1)
        precision = (selected & span).sum(-1) / support.clamp_min(1)
        results.append({"mapping": name, "support": support.mean().item(),
                        "runs": runs(selected).double().mean().item(),
                        "recall": recall.mean().item(), "precision": precision.mean().item(),
                        "exact 0": (weights == 0).double().mean().item(),
                        "exact 1": (weights == 1).double().mean().item()})
        maps[name] = weights[:12]
    return results, maps, span[:12]


def rows_table(results) -> str:
    columns = ["mapping", "support", "runs", "recall", "precision", "exact 0", "exact 1"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in results:
        lines.append("| " + " | ".join(row["mapping"] if c == "mapping" else f"{row[c]:.3f}" for c in columns) + " |")
    return "\n".join(lines)


def rows_figure(maps, span, path: str) -> None:
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


# ---------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run in seconds (small data, one seed)")
    parser.add_argument("--seeds", type=int, help="training seeds per model (default 8, quick 1)")
    parser.add_argument("--epochs", type=int, help="training epochs (default 8, quick 2)")
    parser.add_argument("--rows", type=int, help="synthetic rows (default 2000, quick 150)")
    parser.add_argument("--noise", type=float, default=1.0, help="synthetic rows: score noise")
    parser.add_argument("--signal", type=float, default=0.5, help="synthetic rows: +-signal of span / other keys")
    parser.add_argument("--coupling", type=float, default=0.5, help="synthetic rows: c in T = [[c, -c], [-c, c]]")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", default="docs", help="folder for the two figures")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 8)
    epochs = args.epochs or (2 if args.quick else 8)
    n_train, n_test = (512, 256) if args.quick else (4000, 1000)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        started = time.perf_counter()
        trained, examples, test_data = trained_study(n_train, n_test, epochs, seeds)
        all_votes = all_votes_accuracy(test_data)
        trained_text = trained_tables(trained, seeds, all_votes)
        trained_seconds = time.perf_counter() - started
        rows, maps, span = rows_study(args.rows or (150 if args.quick else 2000), args.noise, args.signal,
                                      args.coupling)
        rows_text = rows_table(rows)
    finally:
        torch.set_num_threads(previous_threads)
    print(f"Trained: {LENGTH} tokens, spans of {SPAN_LENGTHS} votes, {NOISE_VOTES} noise votes, {HEADS} heads, "
          f"{n_train} training / {n_test} held-out inputs, {epochs} epochs, {seeds} seed(s) (mean, min-max), "
          f"{trained_seconds:.0f} s")
    for op, choice in backend_info()["last_choice"].items():
        if op in ("attention", "crf", "sparsemap") and choice is not None:
            print(f"{op} backend: {choice['reason']}")
    print()
    print(trained_text)
    print(f"\nSynthetic rows, fixed T (c = {args.coupling}):\n")
    print(rows_text)
    os.makedirs(args.out, exist_ok=True)
    trained_figure(examples, test_data, os.path.join(args.out, "chain_study.png"))
    rows_figure(maps, span, os.path.join(args.out, "chain_study_rows.png"))
    return {"trained": trained, "all votes": all_votes, "rows": rows}


if __name__ == "__main__":
    main()
