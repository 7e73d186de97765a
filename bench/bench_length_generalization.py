"""Length generalisation: train small Transformers at one length, evaluate them at 1×, 2×,
4×, 8×, 16× (and further) that length, for each attention kind: softmax, SSMax (softmax with
Scalable-Softmax's s·log n), sparsemax, 1.5-entmax, learned α, ASEntmax (1.5-entmax with
1 + β(log n)^γ).

Tasks, in the style of the synthetic suite of Vasylenko et al. (arXiv 2506.16640):
  mqar       multi-query associative recall: entmax_fast.train's task and model
             (bidirectional, no positions); the length is the number of pairs;
  copy       x1..xn | x1..xn            (causal; accuracy on the second half)
  sort       x1..xn | sorted(x)         (causal; accuracy on the second half)
  flip-flop  (w|i|r, bit) pairs: a read repeats the bit of the last write (accuracy on reads)
  2-back     x1..xn, each position predicts the token two before it
The causal tasks use a decoder with NAPE positions, as the ASEntmax authors: ALiBi on half
the heads (slopes 1, 1/2, ...), none on the others. Plus a character-level language model on
the Python standard library's own source files (split by file), trained at one context and
scored in bits per character by position up to 8× that context.

    python bench/bench_length_generalization.py --quick      # <= 5 minutes on a 2-core CPU
    python bench/bench_length_generalization.py              # the fuller run (~20 minutes)

Outputs under --out (default bench/out/length_generalization): results.json, tables.md,
accuracy.png and bpc.png (when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import sys
import sysconfig
import time
import zlib

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from entmax_fast.multihead import MultiheadEntmaxAttention  # noqa: E402
from entmax_fast.train import Config as RecallConfig  # noqa: E402
from entmax_fast.train import RecallTransformer, recall_batch  # noqa: E402

# kind -> (attention mapping, length scale)
KINDS = {
    "softmax": ("softmax", None),
    "ssmax": ("softmax", "ssmax"),
    "sparsemax": ("sparsemax", None),
    "entmax15": ("entmax15", None),
    "learned": ("learned", None),
    "asentmax": ("entmax15", "asentmax"),
}
TASKS = ("mqar", "copy", "sort", "flip-flop", "2-back")
IGNORE = -100


@dataclasses.dataclass
class Settings:
    tasks: tuple = TASKS
    kinds: tuple = tuple(KINDS)
    seeds: int = 3
    steps: int = 150
    batch: int = 32
    lr: float = 3e-3
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    train_length: int = 8
    multipliers: tuple = (1, 2, 4, 8, 16, 32)
    eval_batch: int = 64
    stats_batch: int = 4
    vocab: int = 16
    lm_steps: int = 150
    lm_context: int = 32
    lm_multiplier: int = 8
    lm_eval_windows: int = 16
    out: str = "bench/out/length_generalization"


QUICK = dict(tasks=("sort", "flip-flop"), seeds=2, steps=100, multipliers=(1, 2, 4, 8, 16), eval_batch=32,
             stats_batch=2, lm_steps=60, lm_eval_windows=8)


# ---------------------------------------------------------------------------------------
# Models.

def nape_slopes(heads: int) -> torch.Tensor:
    """ALiBi on the first half of the heads with slopes 1, 1/2, 1/3, ... (the ASEntmax
    authors' linear NAPE slopes), no position bias on the others."""
    with_alibi = max(1, heads // 2)
    return torch.cat([1.0 / torch.arange(1, with_alibi + 1, dtype=torch.float32), torch.zeros(heads - with_alibi)])


def attention_module(kind: str, d_model: int, heads: int, positions: bool) -> MultiheadEntmaxAttention:
    attention, length_scale = KINDS[kind]
    module = MultiheadEntmaxAttention(d_model, heads, batch_first=True, attention=attention, alibi=positions,
                                      length_scale=length_scale)
    if positions:
        with torch.no_grad():
            module.alibi_slopes.copy_(nape_slopes(heads))
    return module


class CausalBlock(nn.Module):
    def __init__(self, kind, d_model, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = attention_module(kind, d_model, heads, positions=True)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, causal_mask, need_weights):
        h = self.norm1(x)
        attended, weights = self.attn(h, h, h, attn_mask=causal_mask, is_causal=True, need_weights=need_weights,
                                      average_attn_weights=False)
        x = x + attended
        return x + self.ff(self.norm2(x)), weights


class CausalModel(nn.Module):
    """Token embedding, causal blocks with NAPE positions, a linear read-out."""

    def __init__(self, kind, vocab, d_model, heads, layers):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(CausalBlock(kind, d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.readout = nn.Linear(d_model, vocab)

    def forward(self, tokens, need_weights=False):
        length = tokens.shape[1]
        causal_mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.embedding(tokens)
        all_weights = []
        for block in self.blocks:
            x, weights = block(x, causal_mask, need_weights)
            all_weights.append(weights)
        return self.readout(self.norm(x)), all_weights


# ---------------------------------------------------------------------------------------
# Tasks: each gives (inputs, targets) with IGNORE where nothing is scored.

def separated_task(kind: str, length: int, batch: int, vocab: int, generator):
    """x1..xn SEP y1..yn, teacher-forced: the position before y_j predicts y_j."""
    items = torch.randint(vocab, (batch, length), generator=generator)
    answer = {"copy": items, "sort": items.sort(dim=-1).values}[kind]
    separator = torch.full((batch, 1), vocab)
    tokens = torch.cat([items, separator, answer], dim=1)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, length:2 * length] = answer
    return tokens[:, :-1], targets[:, :-1]


WRITE, IGNORE_OP, READ = 2, 3, 4


def flip_flop(length: int, batch: int, generator, write=0.1, read=0.2):
    """``length`` (instruction, bit) pairs; the first is a write, the last a read. After a
    read the next bit is the bit of the last write; only those bits are scored. Instruction
    probabilities (write 0.1, read 0.2, ignore 0.7) are this benchmark's choice."""
    draw = torch.rand(batch, length, generator=generator)
    ops = torch.where(draw < write, WRITE, torch.where(draw < write + read, READ, IGNORE_OP))
    ops[:, 0] = WRITE
    # Every sequence is scored at least once.
    ops[:, -1] = READ
    bits = torch.randint(2, (batch, length), generator=generator)
    last_write = torch.zeros(batch, dtype=torch.long)
    for i in range(length):
        is_write = ops[:, i] == WRITE
        last_write = torch.where(is_write, bits[:, i], last_write)
        bits[:, i] = torch.where(ops[:, i] == READ, last_write, bits[:, i])
    tokens = torch.stack([ops, bits], dim=-1).view(batch, 2 * length)
    targets = torch.full_like(tokens, IGNORE)
    # The read instruction's position predicts the bit that follows it.
    read_positions = (ops == READ).nonzero()
    targets[read_positions[:, 0], 2 * read_positions[:, 1]] = bits[read_positions[:, 0], read_positions[:, 1]]
    return tokens, targets


def n_back(length: int, batch: int, vocab: int, generator, steps=2):
    tokens = torch.randint(vocab, (batch, length), generator=generator)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, steps:] = tokens[:, :-steps]
    return tokens, targets


def causal_sample(task: str, length: int, batch: int, vocab: int, generator):
    if task in ("copy", "sort"):
        return separated_task(task, length, batch, vocab, generator)
    if task == "flip-flop":
        return flip_flop(length, batch, generator)
    if task == "2-back":
        return n_back(length, batch, vocab, generator)
    raise ValueError(f"unknown task {task!r}")


def causal_vocab(task: str, vocab: int) -> int:
    return 5 if task == "flip-flop" else vocab + 1


# ---------------------------------------------------------------------------------------
# Training and evaluation.

def _optimizer(model, lr, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps)))
    return optimizer, schedule


def _attention_stats(weights: list, attendable: torch.Tensor) -> dict:
    """Share of exact zeros among the (query, key) pairs a query may attend, and the mean
    weight on the first key over the queries that may attend more than one key, averaged
    over layers and heads."""
    zeros, first = [], []
    many = attendable.sum(-1) > 1
    for w in weights:
        allowed = attendable.expand_as(w)
        zeros.append(((w == 0) & allowed).sum().item() / allowed.sum().item())
        first.append(w[..., 0][many.expand_as(w[..., 0])].mean().item())
    return {"zero_share": statistics.fmean(zeros), "first_token_mass": statistics.fmean(first)}


def run_recall(kind: str, seed: int, settings: Settings) -> dict:
    attention, length_scale = KINDS[kind]
    longest = settings.train_length * max(settings.multipliers)
    config = RecallConfig(pairs=settings.train_length, queries=min(4, settings.train_length), keys=longest,
                          values=settings.vocab, d_model=settings.d_model, heads=settings.heads,
                          layers=settings.layers, batch=settings.batch, seed=seed)
    torch.manual_seed(seed)
    model = RecallTransformer(config, attention)
    for block in model.blocks:
        block.attn = MultiheadEntmaxAttention.from_torch(block.attn, attention=attention, length_scale=length_scale)
    optimizer, schedule = _optimizer(model, settings.lr, settings.steps)
    generator = torch.Generator().manual_seed(seed + 1)
    model.train()
    for _ in range(settings.steps):
        keys, values, query_keys, targets = recall_batch(config, config.batch, generator)
        logits, _ = model(keys, values, query_keys)
        loss = F.cross_entropy(logits.reshape(-1, config.values), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    results = {}
    with torch.no_grad():
        for multiplier in settings.multipliers:
            long_config = dataclasses.replace(config, pairs=settings.train_length * multiplier)
            eval_generator = torch.Generator().manual_seed(10_000 + seed)
            keys, values, query_keys, targets = recall_batch(long_config, settings.eval_batch, eval_generator)
            logits, _ = model(keys, values, query_keys)
            accuracy = (logits.argmax(-1) == targets).float().mean().item()
            _, weights = model(keys[:settings.stats_batch], values[:settings.stats_batch],
                               query_keys[:settings.stats_batch], need_weights=True)
            length = keys.shape[1] + query_keys.shape[1]
            stats = _attention_stats(weights, torch.ones(1, 1, length, length, dtype=torch.bool))
            results[multiplier] = {"accuracy": accuracy, **stats}
    return results


def run_causal(task: str, kind: str, seed: int, settings: Settings) -> dict:
    vocab = causal_vocab(task, settings.vocab)
    torch.manual_seed(seed)
    model = CausalModel(kind, vocab, settings.d_model, settings.heads, settings.layers)
    optimizer, schedule = _optimizer(model, settings.lr, settings.steps)
    generator = torch.Generator().manual_seed(seed + 1)
    model.train()
    for _ in range(settings.steps):
        tokens, targets = causal_sample(task, settings.train_length, settings.batch, settings.vocab, generator)
        logits, _ = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    results = {}
    with torch.no_grad():
        for multiplier in settings.multipliers:
            eval_generator = torch.Generator().manual_seed(10_000 + seed)
            tokens, targets = causal_sample(task, settings.train_length * multiplier, settings.eval_batch,
                                            settings.vocab, eval_generator)
            logits, _ = model(tokens)
            scored = targets != IGNORE
            accuracy = (logits.argmax(-1)[scored] == targets[scored]).float().mean().item()
            _, weights = model(tokens[:settings.stats_batch], need_weights=True)
            length = tokens.shape[1]
            attendable = torch.ones(length, length, dtype=torch.bool).tril().view(1, 1, length, length)
            results[multiplier] = {"accuracy": accuracy, **_attention_stats(weights, attendable)}
    return results


# ---------------------------------------------------------------------------------------
# Character-level language model on the standard library's sources.

def stdlib_text(validation_every: int = 10) -> tuple:
    """(train bytes, validation bytes): the standard library's top-level .py files, each
    wholly in one split (chosen by a hash of its name, one in ``validation_every``)."""
    folder = sysconfig.get_paths()["stdlib"]
    train, validation = [], []
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        with open(path, "rb") as handle:
            data = handle.read()
        name = os.path.basename(path).encode()
        (validation if zlib.crc32(name) % validation_every == 0 else train).append(data)
    return b"\n".join(train), b"\n".join(validation)


def run_language_model(kind: str, seed: int, settings: Settings, text: tuple) -> dict:
    train_bytes, validation_bytes = (torch.frombuffer(bytearray(part), dtype=torch.uint8).long() for part in text)
    context = settings.lm_context
    torch.manual_seed(seed)
    model = CausalModel(kind, 256, settings.d_model, settings.heads, settings.layers)
    optimizer, schedule = _optimizer(model, settings.lr, settings.lm_steps)
    generator = torch.Generator().manual_seed(seed + 1)
    model.train()
    for _ in range(settings.lm_steps):
        starts = torch.randint(len(train_bytes) - context - 1, (settings.batch,), generator=generator)
        window = torch.stack([train_bytes[s:s + context + 1] for s in starts.tolist()])
        logits, _ = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    long_context = context * settings.lm_multiplier
    # Evenly spaced validation windows: the same ones for every kind and seed.
    stride = (len(validation_bytes) - long_context - 1) // settings.lm_eval_windows
    starts = [i * stride for i in range(settings.lm_eval_windows)]
    window = torch.stack([validation_bytes[s:s + long_context + 1] for s in starts])
    with torch.no_grad():
        logits, _ = model(window[:, :-1])
        nats = F.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1), reduction="none")
    bits = (nats / math.log(2)).view(len(starts), long_context).mean(0)
    return {"bpc_by_position": bits.tolist()}


# ---------------------------------------------------------------------------------------
# Reporting.

def _mean_spread(values: list) -> str:
    mean = statistics.fmean(values)
    spread = (max(values) - min(values)) / 2 if len(values) > 1 else 0.0
    return f"{100 * mean:.1f} ± {100 * spread:.1f}"


def task_tables(results: dict, settings: Settings) -> str:
    lines = []
    for task in settings.tasks:
        lines.append(f"\n#### {task}: accuracy (%) by evaluation length (train length {settings.train_length}), "
                     f"mean ± half-range over {settings.seeds} seeds\n")
        header = ["kind"] + [f"{m}×" for m in settings.multipliers]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for kind in settings.kinds:
            runs = results["tasks"][task][kind]
            cells = [_mean_spread([run[str(m)]["accuracy"] for run in runs]) for m in settings.multipliers]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    longest = max(settings.multipliers)
    lines.append(f"\n#### Attention statistics, mean over tasks, seeds, layers and heads: share of exact zeros "
                 f"among the keys a query may attend; mean weight on the first key\n")
    lines.append("| kind | zeros 1× | zeros " + f"{longest}×" + " | first-key mass 1× | first-key mass " + f"{longest}× |")
    lines.append("|---|---|---|---|---|")
    for kind in settings.kinds:
        cells = []
        for stat in ("zero_share", "first_token_mass"):
            for multiplier in (1, longest):
                values = [run[str(multiplier)][stat] for task in settings.tasks for run in results["tasks"][task][kind]]
                cells.append(f"{100 * statistics.fmean(values):.1f}%")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lm_table(results: dict, settings: Settings) -> str:
    context = settings.lm_context
    edges = [0, context]
    while edges[-1] < context * settings.lm_multiplier:
        edges.append(edges[-1] * 2)
    header = ["kind"] + [f"positions {lo + 1}–{hi}" for lo, hi in zip(edges, edges[1:])]
    lines = [f"\n#### Character LM on the standard library's sources: bits per character by position (trained "
             f"at context {context}), mean ± half-range over {settings.seeds} seeds\n",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for kind in settings.kinds:
        runs = results["language_model"][kind]
        cells = []
        for lo, hi in zip(edges, edges[1:]):
            values = [statistics.fmean(run["bpc_by_position"][lo:hi]) for run in runs]
            spread = (max(values) - min(values)) / 2 if len(values) > 1 else 0.0
            cells.append(f"{statistics.fmean(values):.3f} ± {spread:.3f}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_plots(results: dict, settings: Settings) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    paths = []
    if settings.tasks:
        fig, axes = plt.subplots(1, len(settings.tasks), figsize=(3.2 * len(settings.tasks), 3.0), squeeze=False)
        for ax, task in zip(axes[0], settings.tasks):
            for kind in settings.kinds:
                runs = results["tasks"][task][kind]
                means = [statistics.fmean(run[str(m)]["accuracy"] for run in runs) for m in settings.multipliers]
                lows = [min(run[str(m)]["accuracy"] for run in runs) for m in settings.multipliers]
                highs = [max(run[str(m)]["accuracy"] for run in runs) for m in settings.multipliers]
                line, = ax.plot(settings.multipliers, means, marker="o", markersize=3, label=kind)
                ax.fill_between(settings.multipliers, lows, highs, color=line.get_color(), alpha=0.15)
            ax.set_xscale("log", base=2)
            ax.set_title(task, fontsize=9)
            ax.set_xlabel("eval length / train length", fontsize=8)
            ax.set_ylim(0, 1.02)
            ax.tick_params(labelsize=7)
        axes[0][0].set_ylabel("accuracy", fontsize=8)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(settings.out, "accuracy.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if results.get("language_model"):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for kind in settings.kinds:
            runs = results["language_model"][kind]
            curve = torch.tensor([run["bpc_by_position"] for run in runs]).mean(0)
            # A running mean over a tenth of the context: single positions are noisy.
            width = max(1, settings.lm_context // 10)
            smooth = F.avg_pool1d(curve.view(1, 1, -1), width, stride=1).flatten()
            ax.plot(torch.arange(len(smooth)) + width, smooth, label=kind, linewidth=1)
        ax.axvline(settings.lm_context, color="black", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position (dashed: training context)", fontsize=8)
        ax.set_ylabel("bits per character", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(settings.out, "bpc.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> tuple:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small run (<= 5 minutes on a 2-core CPU)")
    parser.add_argument("--tasks", nargs="*", choices=TASKS, help="synthetic tasks (none: only the LM)")
    parser.add_argument("--kinds", nargs="+", choices=tuple(KINDS))
    for name, kind in (("seeds", int), ("steps", int), ("batch", int), ("lr", float), ("d-model", int),
                       ("heads", int), ("layers", int), ("train-length", int), ("eval-batch", int),
                       ("stats-batch", int), ("vocab", int), ("lm-steps", int), ("lm-context", int),
                       ("lm-multiplier", int), ("lm-eval-windows", int)):
        parser.add_argument(f"--{name}", type=kind)
    parser.add_argument("--multipliers", nargs="+", type=int, help="evaluation lengths, in training lengths")
    parser.add_argument("--no-lm", action="store_true", help="skip the character-level language model")
    parser.add_argument("--out", help="output folder")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    values = dict(QUICK) if args.quick else {}
    for field in dataclasses.fields(Settings):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = tuple(given) if isinstance(given, list) else given
    settings = Settings(**values)
    if args.no_lm:
        settings.lm_steps = 0
    if 1 not in settings.multipliers:
        parser.error("--multipliers must include 1 (the training length)")
    if settings.d_model % settings.heads:
        parser.error("--d-model must be divisible by --heads")
    return settings, args


def _save_json(results: dict, settings: Settings) -> None:
    """Written after every (task, kind): a long run that is stopped keeps what it finished."""
    with open(os.path.join(settings.out, "results.json"), "w") as handle:
        json.dump(results, handle, indent=1)


def main(argv=None) -> dict:
    settings, args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(settings)
    finally:
        torch.set_num_threads(previous_threads)


def _run(settings: Settings) -> dict:
    start = time.perf_counter()
    os.makedirs(settings.out, exist_ok=True)
    print(f"length generalisation: tasks {', '.join(settings.tasks) or '-'}; kinds {', '.join(settings.kinds)}; "
          f"{settings.seeds} seeds; {settings.steps} steps of batch {settings.batch}; d_model {settings.d_model}, "
          f"{settings.heads} heads, {settings.layers} layers; train length {settings.train_length}, eval × "
          f"{settings.multipliers}; LM {settings.lm_steps} steps at context {settings.lm_context}; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    results = {"settings": dataclasses.asdict(settings), "tasks": {}, "language_model": {}}
    for task in settings.tasks:
        results["tasks"][task] = {}
        for kind in settings.kinds:
            runs = []
            for seed in range(settings.seeds):
                run = run_recall(kind, seed, settings) if task == "mqar" else run_causal(task, kind, seed, settings)
                runs.append({str(m): value for m, value in run.items()})
            results["tasks"][task][kind] = runs
            accuracy = " ".join(f"{statistics.fmean(r[str(m)]['accuracy'] for r in runs):.2f}"
                                for m in settings.multipliers)
            print(f"  {task:9s} {kind:9s} accuracy by length: {accuracy}  ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            _save_json(results, settings)
    if settings.lm_steps:
        text = stdlib_text()
        print(f"  LM data: {len(text[0])} training and {len(text[1])} validation bytes", flush=True)
        for kind in settings.kinds:
            results["language_model"][kind] = [run_language_model(kind, seed, settings, text)
                                               for seed in range(settings.seeds)]
            print(f"  LM        {kind:9s} done ({time.perf_counter() - start:.0f} s)", flush=True)
            _save_json(results, settings)
    tables = ""
    if settings.tasks:
        tables += task_tables(results, settings)
    if settings.lm_steps:
        tables += "\n" + lm_table(results, settings)
    results["wall_seconds"] = time.perf_counter() - start
    tables += f"\n\nwall time: {results['wall_seconds']:.0f} s\n"
    print(tables)
    with open(os.path.join(settings.out, "tables.md"), "w") as handle:
        handle.write(tables)
    _save_json(results, settings)
    results["plots"] = save_plots(results, settings)
    print(f"outputs: {settings.out} ({', '.join(os.path.basename(p) for p in results['plots']) or 'no plots'})")
    return results


if __name__ == "__main__":
    main()
