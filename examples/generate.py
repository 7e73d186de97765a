"""Decoding from a paged key/value cache with :func:`entmax_fast.entmax_attention_with_kvcache`,
on the associative-recall model that ``python -m entmax_fast.train`` trains.

    python -m entmax_fast.train --quick --attention entmax15 --save recall_models
    python examples/generate.py --checkpoint recall_models/recall_entmax15.pt
    python examples/generate.py              # without a checkpoint: trains a small one first (seconds)

Each sequence is a set of (key, value) pair tokens, then query tokens, each asking for the
value stored with one key. Here the pairs are the prompt and the queries come one at a
time, as tokens do in decoding:

* the cache is paged: one pool of blocks of 16 positions per layer, (num_blocks, H, 16, E)
  for the keys and for the values, and a block table (B, max_blocks) giving each sequence
  its blocks, handed out in shuffled order (a sequence's blocks are not contiguous);
* prefill: each sequence's pairs attend each other (they are a set, as in training) and
  their keys and values are written into the sequence's blocks; sequences hold different
  numbers of pairs, so the cache lengths are ragged;
* decoding: every sequence's next query token, one batch per step, through every layer:
  its key and value are appended to the cache and it attends the pairs and the queries
  before it (``entmax_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
  block_table)``).

The check: the decoded answers' logits equal the model's full forward of each whole
sequence with the same attention pattern (pairs see the pairs; query i sees the pairs and
queries 0 … i), run through the model's own modules with a mask. The model was trained
with every token seeing every other, so the accuracy of this query-by-query decoding is
printed beside the model's own forward's.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch

from entmax_fast import entmax_attention, entmax_attention_with_kvcache
from entmax_fast.train import Config, RecallTransformer, load_model, recall_batch, train_one

BLOCK_SIZE = 16
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # float32: the same maths in another summation order


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a model saved by `python -m entmax_fast.train --save DIR`")
    parser.add_argument("--train-steps", type=int, default=150, help="steps of the model trained without a checkpoint")
    parser.add_argument("--sequences", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1, as entmax_fast.train: these tensors are too small to split)")
    return parser.parse_args(argv)


def trained_model(args) -> tuple:
    """(model, config): the checkpoint's, or a 1.5-entmax model trained here."""
    if args.checkpoint:
        return load_model(args.checkpoint)
    config = Config(steps=args.train_steps, long_pairs=0, attentions=("entmax15",), seed=args.seed)
    result = train_one(config, "entmax15", show_progress=False)
    return result["model"].eval(), config


def _heads(x, attn):
    """(B, L, d) → (B, H, L, E)."""
    return x.view(x.shape[0], x.shape[1], attn.num_heads, attn.head_dim).transpose(1, 2)


def _qkv(block, x):
    """The block's attention input projected: q, k, v (B, H, L, E)."""
    attn = block.attn
    q, k, v = torch.nn.functional.linear(block.norm1(x), attn.in_proj_weight, attn.in_proj_bias).split(
        attn.embed_dim, dim=-1)
    return _heads(q, attn), _heads(k, attn), _heads(v, attn)


def _finish_block(block, x, attended):
    """The block after its attention: output projection, residuals, feed-forward."""
    batch, _, length, _ = attended.shape
    x = x + block.attn.out_proj(attended.transpose(1, 2).reshape(batch, length, block.attn.embed_dim))
    return x + block.ff(block.norm2(x))


class PagedCache:
    """Per layer a pool of key blocks and value blocks, (num_blocks, H, BLOCK_SIZE, E), and
    the block table (B, max_blocks) int32 that maps each sequence's positions to blocks."""

    def __init__(self, layers, heads, head_dim, capacities, generator):
        max_blocks = max(math.ceil(capacity / BLOCK_SIZE) for capacity in capacities)
        num_blocks = len(capacities) * max_blocks
        self.keys = [torch.zeros(num_blocks, heads, BLOCK_SIZE, head_dim) for _ in range(layers)]
        self.values = [torch.zeros(num_blocks, heads, BLOCK_SIZE, head_dim) for _ in range(layers)]
        self.block_table = torch.randperm(num_blocks, generator=generator).view(len(capacities), max_blocks).to(
            torch.int32)
        self.seqlens = torch.zeros(len(capacities), dtype=torch.int32)

    def write_prefill(self, layer, sequence, k, v):
        """k, v (1, H, L, E): positions 0 … L − 1 of one sequence."""
        positions = torch.arange(k.shape[2])
        blocks = self.block_table[sequence].long()[positions // BLOCK_SIZE]
        self.keys[layer][blocks, :, positions % BLOCK_SIZE] = k[0].transpose(0, 1)
        self.values[layer][blocks, :, positions % BLOCK_SIZE] = v[0].transpose(0, 1)


def query_tokens(model, query_keys):
    return model.key_embedding(query_keys) + model.query_marker


def prefill(model, cache, sequence, pair_tokens):
    """One sequence's pairs (1, P, d), attending each other, into the cache."""
    x = pair_tokens
    for layer, block in enumerate(model.blocks):
        q, k, v = _qkv(block, x)
        cache.write_prefill(layer, sequence, k, v)
        x = _finish_block(block, x, entmax_attention(q, k, v, alpha=block.attn.alpha))
    cache.seqlens[sequence] = pair_tokens.shape[1]


def decode_step(model, cache, tokens):
    """Every sequence's next token (B, 1, d) through the layers, appended to the cache; the
    logits (B, values)."""
    x = tokens
    for layer, block in enumerate(model.blocks):
        q, k, v = _qkv(block, x)
        attended = entmax_attention_with_kvcache(q, cache.keys[layer], cache.values[layer], k, v,
                                                 cache_seqlens=cache.seqlens, block_table=cache.block_table,
                                                 alpha=block.attn.alpha)
        x = _finish_block(block, x, attended)
    cache.seqlens += 1
    return model.readout(model.norm(x[:, 0]))


def full_forward(model, pair_tokens, query_tokens_):
    """The logits (Q, values) of one whole sequence through the model's own modules, with the
    decoding's attention pattern as a mask (True = ignore, nn.MultiheadAttention's rule):
    pairs see the pairs, query i the pairs and queries 0 … i."""
    n_pairs, n_queries = pair_tokens.shape[1], query_tokens_.shape[1]
    length = n_pairs + n_queries
    position = torch.arange(length)
    visible = (position.view(1, -1) < n_pairs) | (position.view(1, -1) <= position.view(-1, 1))
    visible[:n_pairs, n_pairs:] = False
    x = torch.cat([pair_tokens, query_tokens_], dim=1)
    for block in model.blocks:
        h = block.norm1(x)
        x = x + block.attn(h, h, h, attn_mask=~visible, need_weights=False)[0]
        x = x + block.ff(block.norm2(x))
    return model.readout(model.norm(x[0, n_pairs:]))


@torch.no_grad()
def run(model: RecallTransformer, config: Config, sequences: int, seed: int) -> dict:
    if any(block.attn.alpha is None for block in model.blocks):
        raise ValueError("the model's attention must be an α-entmax (softmax, sparsemax, entmax15, learned or a "
                         "float α), not fusedmax")
    generator = torch.Generator().manual_seed(seed)
    # Ragged prompts: each sequence holds between `queries` and `pairs` pairs.
    counts = torch.randint(config.queries, config.pairs + 1, (sequences,), generator=generator).tolist()
    data = [recall_batch(dataclasses.replace(config, pairs=count), 1, generator) for count in counts]
    block = model.blocks[0].attn
    cache = PagedCache(len(model.blocks), block.num_heads, block.head_dim,
                       [count + config.queries for count in counts], generator)
    pair_tokens = [model.key_embedding(keys) + model.value_embedding(values) for keys, values, _, _ in data]
    for sequence, tokens in enumerate(pair_tokens):
        prefill(model, cache, sequence, tokens)
    queries = torch.cat([query_tokens(model, query_keys) for _, _, query_keys, _ in data])  # (B, Q, d)
    decoded = torch.stack([decode_step(model, cache, queries[:, step:step + 1]) for step in range(config.queries)],
                          dim=1)  # (B, Q, values)
    expected = torch.stack([full_forward(model, pair_tokens[b], queries[b:b + 1]) for b in range(sequences)])
    torch.testing.assert_close(decoded, expected, **TOLERANCE)
    targets = torch.cat([t for _, _, _, t in data])
    own = torch.cat([model(keys, values, query_keys)[0] for keys, values, query_keys, _ in data])
    return {"pairs": counts, "cache_seqlens": cache.seqlens.tolist(),
            "max_logit_difference": (decoded - expected).abs().max().item(),
            "decoded_accuracy": (decoded.argmax(-1) == targets).float().mean().item(),
            "forward_accuracy": (own.argmax(-1) == targets).float().mean().item()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        model, config = trained_model(args)
        result = run(model, config, args.sequences, args.seed)
    finally:
        torch.set_num_threads(previous_threads)
    print(f"{args.sequences} sequences of {result['pairs']} pairs and {config.queries} queries, decoded query by "
          f"query from a paged cache (blocks of {BLOCK_SIZE}); final cache lengths {result['cache_seqlens']}")
    print(f"logits = the full forward's (largest difference {result['max_logit_difference']:.2e})")
    print(f"accuracy: decoded {100 * result['decoded_accuracy']:.0f}%, the model's own forward (every token sees "
          f"every other) {100 * result['forward_accuracy']:.0f}%")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
