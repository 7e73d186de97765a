"""Train a small Transformer on multi-query associative recall with softmax, sparsemax,
1.5-entmax and learned-α attention side by side; print a comparison table and save
attention heat-maps.

    python -m entmax_fast.train            # defaults: < 5 minutes on a 2-core CPU
    python -m entmax_fast.train --quick    # < 1 minute
    python -m entmax_fast.train --help
    python -m entmax_fast.train --quick --attention entmax15 --save recall_models
                                           # also saves each model (load_model reads it back)

The task (generated on the fly, seeded): a sequence holds ``pairs`` (key, value) tokens —
each the sum of a key embedding and a value embedding, keys distinct — followed by
``queries`` query tokens, each one of the keys. The model must output the value stored
with each queried key. The ideal attention of a query is one-hot on the matching pair,
the case where sparse attention should beat softmax, which always leaks mass to every
distractor. Every kind learns the training length (8 pairs); the test is a second
evaluation on much longer sequences (128 pairs): softmax's leaked mass grows with the
number of distractors, while entmax gives them exactly zero weight.

On a GPU the attention runs on the fused Triton kernels (through the package's dispatch);
on CPU on the C++ op when built, else the plain-torch reference.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .multihead import MultiheadEntmaxAttention

DEFAULT_ATTENTIONS = ("softmax", "sparsemax", "entmax15", "learned")


@dataclass
class Config:
    pairs: int = 8
    queries: int = 4
    keys: int = 128
    values: int = 16
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    batch: int = 32
    steps: int = 400
    lr: float = 1e-2
    eval_batch: int = 256
    long_pairs: int = 128
    seed: int = 0
    device: str = "cpu"
    attentions: tuple = field(default=DEFAULT_ATTENTIONS)


# ---------------------------------------------------------------------------------------
# Task.

def recall_batch(config: Config, batch: int, generator: torch.Generator):
    """(keys (B, P), values (B, P), query_keys (B, Q), targets (B, Q)) on the CPU."""
    keys = torch.rand(batch, config.keys, generator=generator).argsort(dim=-1)[:, :config.pairs]
    values = torch.randint(config.values, (batch, config.pairs), generator=generator)
    slots = torch.rand(batch, config.pairs, generator=generator).argsort(dim=-1)[:, :config.queries]
    return keys, values, keys.gather(1, slots), values.gather(1, slots)


# ---------------------------------------------------------------------------------------
# Model.

class Block(nn.Module):
    def __init__(self, config: Config, attention):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attn = MultiheadEntmaxAttention(config.d_model, config.heads, batch_first=True, attention=attention)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.ff = nn.Sequential(nn.Linear(config.d_model, 2 * config.d_model), nn.GELU(),
                                nn.Linear(2 * config.d_model, config.d_model))

    def forward(self, x, need_weights=False):
        h = self.norm1(x)
        attended, weights = self.attn(h, h, h, need_weights=need_weights, average_attn_weights=False)
        x = x + attended
        return x + self.ff(self.norm2(x)), weights


class RecallTransformer(nn.Module):
    def __init__(self, config: Config, attention):
        super().__init__()
        self.key_embedding = nn.Embedding(config.keys, config.d_model)
        self.value_embedding = nn.Embedding(config.values, config.d_model)
        self.query_marker = nn.Parameter(torch.randn(config.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.readout = nn.Linear(config.d_model, config.values)

    def forward(self, keys, values, query_keys, need_weights=False):
        # No positional encoding: the pairs are a set, and lengths unseen in training stay valid.
        pair_tokens = self.key_embedding(keys) + self.value_embedding(values)
        query_tokens = self.key_embedding(query_keys) + self.query_marker
        x = torch.cat([pair_tokens, query_tokens], dim=1)
        all_weights = []
        for block in self.blocks:
            x, weights = block(x, need_weights)
            all_weights.append(weights)
        logits = self.readout(self.norm(x[:, keys.shape[1]:]))
        return logits, all_weights


# ---------------------------------------------------------------------------------------
# Progress bar: tqdm when installed, else one line every tenth of the run.

class _Progress:
    def __init__(self, total: int, description: str):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        self._bar = tqdm(total=total, desc=description, leave=True, dynamic_ncols=True) if tqdm else None
        self._total, self._done, self._description = total, 0, description
        self._every = max(1, total // 10)

    def update(self, postfix: str):
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(1)
        elif self._done % self._every == 0 or self._done == self._total:
            print(f"{self._description}: {self._done}/{self._total} {postfix}", file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------------------------
# Training and evaluation.

def _label(attention) -> str:
    return f"alpha={attention}" if isinstance(attention, float) else str(attention)


def train_one(config: Config, attention, show_progress: bool = True) -> dict:
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    model = RecallTransformer(config, attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    warmup = max(1, config.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / config.steps)))
    data_generator = torch.Generator().manual_seed(config.seed + 1)
    progress = _Progress(config.steps, _label(attention)) if show_progress else None
    model.train()
    train_seconds = 0.0
    # the first step compiles the Triton kernels (seconds on a GPU): timed steps start after it
    timed_steps = max(1, config.steps - 1)
    for step in range(config.steps):
        keys, values, query_keys, targets = (t.to(device) for t in recall_batch(config, config.batch, data_generator))
        start = time.perf_counter()
        logits, _ = model(keys, values, query_keys)
        loss = F.cross_entropy(logits.reshape(-1, config.values), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0 or config.steps == 1:
            train_seconds += time.perf_counter() - start
        if progress is not None:
            progress.update(f"loss {loss.detach().item():.3f}")
    if progress is not None:
        progress.close()
    long_accuracy = None
    if config.long_pairs:
        long_accuracy = evaluate(dataclasses.replace(config, pairs=config.long_pairs), model)["accuracy"]
    return {"model": model, "seconds_per_step": train_seconds / timed_steps, **evaluate(config, model),
            "long_accuracy": long_accuracy}


@torch.no_grad()
def evaluate(config: Config, model: RecallTransformer) -> dict:
    device = next(model.parameters()).device
    model.eval()
    eval_generator = torch.Generator().manual_seed(config.seed + 2)
    keys, values, query_keys, targets = (t.to(device) for t in recall_batch(config, config.eval_batch,
                                                                               eval_generator))
    logits, weights = model(keys, values, query_keys, need_weights=True)
    loss = F.cross_entropy(logits.reshape(-1, config.values), targets.reshape(-1)).item()
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    # Support size of each attention row, averaged over batch and queries: (layers, heads).
    support = torch.stack([(w > 0).sum(-1).float().mean(dim=(0, 2)) for w in weights]).cpu()
    alphas = []
    for block in model.blocks:
        alpha = block.attn.alpha
        alphas.append(alpha.detach().cpu().tolist() if isinstance(alpha, torch.Tensor) else [alpha] * config.heads)
    first_example = [w[0].cpu() for w in weights]
    return {"accuracy": accuracy, "loss": loss, "support": support, "alpha": alphas, "example_weights": first_example}


def save_model(path: str, model: RecallTransformer, config: Config, attention) -> None:
    """A checkpoint :func:`load_model` reads back: the config, the attention kind, the weights."""
    torch.save({"config": dataclasses.asdict(config), "attention": attention,
                "state_dict": {name: tensor.cpu() for name, tensor in model.state_dict().items()}}, path)


def load_model(path: str, device="cpu") -> tuple:
    """(model in eval mode, config) from a :func:`save_model` checkpoint."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    config = Config(**{**checkpoint["config"], "attentions": tuple(checkpoint["config"]["attentions"]),
                       "device": str(device)})
    model = RecallTransformer(config, checkpoint["attention"])
    model.load_state_dict(checkpoint["state_dict"])
    return model.to(device).eval(), config


# ---------------------------------------------------------------------------------------
# Heat-maps: matplotlib when installed, else grey-scale PNGs written with zlib.

def _write_grey_png(path: str, image: torch.Tensor) -> None:
    """8-bit grey PNG of ``image`` (H, W) with values in [0, 1]; black = 0, white = 1."""
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8)
    height, width = pixels.shape
    raw = b"".join(b"\x00" + bytes(pixels[row].tolist()) for row in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def save_heatmaps(results: dict, config: Config, out_dir: str) -> list:
    """One PNG: rows = attention kinds, columns = heads of the last layer, each panel the
    weights of the first evaluation sequence (queries × all positions). Returns paths."""
    os.makedirs(out_dir, exist_ok=True)
    labels = list(results)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        paths = []
        for label in labels:
            weights = results[label]["example_weights"][-1]
            scale = 8  # pixels per weight
            grid = torch.cat([torch.cat([weights[h], torch.ones(weights.shape[1], 1)], dim=1)
                              for h in range(weights.shape[0])], dim=1)
            image = grid.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
            path = os.path.join(out_dir, f"attention_{label.replace('=', '')}.png")
            _write_grey_png(path, 1 - image)
            paths.append(path)
        print(f"matplotlib is not installed: wrote grey-scale heat-maps (dark = high weight) {paths}")
        return paths
    import numpy

    colormap = matplotlib.colormaps["viridis"].with_extremes(bad="white")  # exact zeros, dropped keys
    fig, axes = plt.subplots(len(labels), config.heads, figsize=(2.6 * config.heads + 0.8, 1.5 * len(labels) + 0.9),
                             squeeze=False)
    image = None
    for row, label in enumerate(labels):
        weights = results[label]["example_weights"][-1]
        alphas = results[label]["alpha"][-1]
        for head in range(config.heads):
            ax = axes[row][head]
            panel = weights[head, config.pairs:].numpy()
            image = ax.imshow(numpy.ma.masked_equal(panel, 0.0), aspect="auto", cmap=colormap, vmin=0, vmax=1,
                              interpolation="nearest")
            ax.axvline(config.pairs - 0.5, color="black", linewidth=0.8)
            alpha_text = "" if alphas[head] is None else f" α={alphas[head]:.2f}"
            ax.set_title(f"{label} h{head}{alpha_text}", fontsize=8)
            # Positions: keys 0..pairs-1 are the pair tokens, then the queries.
            ax.set_xticks([0, config.pairs - 1, panel.shape[1] - 1])
            ax.set_yticks([0, panel.shape[0] - 1])
            ax.tick_params(labelsize=6, length=2)
            if row == len(labels) - 1:
                ax.set_xlabel("key position", fontsize=7)
            if head == 0:
                ax.set_ylabel("query", fontsize=7)
    fig.suptitle("Last-layer attention weights of the query tokens (first evaluation sequence); keys left of the "
                 "black line are pair tokens, right of it queries; white = exactly 0", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    colorbar_axes = fig.add_axes((0.94, 0.12, 0.012, 0.72))
    fig.colorbar(image, cax=colorbar_axes).set_label("attention weight", fontsize=7)
    colorbar_axes.tick_params(labelsize=6)
    path = os.path.join(out_dir, "attention_heatmaps.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ---------------------------------------------------------------------------------------

def result_rows(results: dict, config: Config) -> list:
    rows = []
    for label, r in results.items():
        learned = "learned" == label
        rows.append({
            "attention": label,
            "accuracy": f"{100 * r['accuracy']:.1f}%",
            "loss": f"{r['loss']:.3f}",
            f"accuracy @{config.long_pairs} pairs": "-" if r["long_accuracy"] is None else
                f"{100 * r['long_accuracy']:.1f}%",
            "ms/step": f"{1000 * r['seconds_per_step']:.1f}",
            "support/head (last layer, of {})".format(config.pairs + config.queries):
                " ".join(f"{s:.1f}" for s in r["support"][-1].tolist()),
            "mean support": f"{r['support'].mean().item():.1f}",
            "alpha/head (last layer)": " ".join(f"{a:.2f}" for a in r["alpha"][-1]) if learned else
                " ".join(f"{a:g}" for a in sorted(set(r["alpha"][-1])) if a is not None),
        })
    return rows


def _print_table(rows: list) -> None:
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(str(r[c]).ljust(widths[c]) for c in columns))


def _parse_attention(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def parse_args(argv=None) -> tuple:
    parser = argparse.ArgumentParser(prog="python -m entmax_fast.train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Config()
    parser.add_argument("--quick", action="store_true", help="a smaller run, under a minute on a 2-core CPU")
    parser.add_argument("--steps", type=int, help=f"training steps per model (default {defaults.steps}, quick 150)")
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--pairs", type=int, default=defaults.pairs, help="key-value pairs per training sequence")
    parser.add_argument("--queries", type=int, default=defaults.queries)
    parser.add_argument("--keys", type=int, default=defaults.keys, help="key vocabulary (>= pairs)")
    parser.add_argument("--values", type=int, default=defaults.values, help="value vocabulary")
    parser.add_argument("--d-model", type=int, default=defaults.d_model)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--eval-batch", type=int, default=defaults.eval_batch)
    parser.add_argument("--long-pairs", type=int, help="also evaluate on sequences with this many pairs, "
                        f"longer than in training (default {defaults.long_pairs}, quick 64; 0: skip)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: these tensors are too small to split, and extra "
                             "threads spin-wait for each other when the machine is busy)")
    parser.add_argument("--attention", nargs="+", type=_parse_attention, default=list(DEFAULT_ATTENTIONS),
                        help="kinds to compare: softmax sparsemax entmax15 learned fusedmax or a float alpha >= 1")
    parser.add_argument("--out", default="train_out", help="folder for the heat-map PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--save", metavar="DIR", help="save each trained model to DIR/recall_<kind>.pt (load_model)")
    args = parser.parse_args(argv)
    config = Config(pairs=args.pairs, queries=args.queries,
                    keys=args.keys, values=args.values, d_model=args.d_model, heads=args.heads, layers=args.layers,
                    batch=args.batch, steps=args.steps or (150 if args.quick else defaults.steps), lr=args.lr,
                    eval_batch=args.eval_batch, long_pairs=args.long_pairs if args.long_pairs is not None else
                    (64 if args.quick else defaults.long_pairs), seed=args.seed, device=args.device,
                    attentions=tuple(args.attention))
    if config.keys < config.pairs:
        parser.error(f"--keys must be >= --pairs (keys are distinct within a sequence), got {config.keys} < "
                     f"{config.pairs}")
    if config.keys < config.long_pairs:
        parser.error(f"--keys must be >= --long-pairs, got {config.keys} < {config.long_pairs}")
    if config.queries > config.pairs:
        parser.error(f"--queries must be <= --pairs, got {config.queries} > {config.pairs}")
    if config.d_model % config.heads:
        parser.error(f"--d-model must be divisible by --heads, got {config.d_model} and {config.heads}")
    return config, args


def main(argv=None) -> dict:
    config, args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    if config.device == "cpu":
        torch.set_num_threads(args.threads)
    try:
        return _run(config, args)
    finally:
        torch.set_num_threads(previous_threads)


def _run(config: Config, args) -> dict:
    from . import backend_info

    start = time.perf_counter()
    print(f"associative recall: {config.pairs} pairs, {config.queries} queries, {config.steps} steps of batch "
          f"{config.batch}, d_model {config.d_model}, {config.heads} heads, {config.layers} layers, "
          f"device {config.device}, torch threads {torch.get_num_threads()}")
    results = {}
    for attention in config.attentions:
        results[_label(attention)] = train_one(config, attention, show_progress=not args.no_progress)
    choice = backend_info()["last_choice"].get("attention")
    if choice is not None:
        print(f"entmax attention backend: {choice['reason']}")
    rows = result_rows(results, config)
    print()
    _print_table(rows)
    paths = save_heatmaps(results, config, args.out)
    print(f"\nheat-maps: {', '.join(paths)}")
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        for attention in config.attentions:
            path = os.path.join(args.save, f"recall_{_label(attention).replace('=', '')}.pt")
            save_model(path, results[_label(attention)]["model"], config, attention)
            print(f"saved {path}")
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    return {"config": config, "results": results, "rows": rows, "heatmaps": paths}


if __name__ == "__main__":
    main()
