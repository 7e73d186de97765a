"""Greedy ``generate`` on a Llama-style model: ms per new token with the decoding steps on
``entmax_attention_with_kvcache`` (``attn_implementation="entmax"``) against the masked
prefill-shaped call (the same α registered with ``decode_with_kvcache=False``), and
``"sdpa"`` (softmax) for scale, with a DynamicCache and a StaticCache.

    python bench/bench_hf_decode.py            # hidden 256, 4 layers, prompt 512, 64 new tokens
    python bench/bench_hf_decode.py --quick    # prompt 128, 16 new tokens, one round
    python bench/bench_hf_decode.py --threads 1

The model is built from its config (no download): random weights, float32, batch 1, 4 query
heads on 2 key/value heads. A token's time is the median gap between successive new tokens
(a streamer notes when each arrives): a decoding step, the prefill left out, the model's
other layers and the sampling included. The methods take turns for --rounds rounds and each
reports the median of its rounds; ratios come from the same run (x masked = kvcache token /
masked token). The kvcache op's tokens are compared with the masked path's. Writes
bench/out/hf_decode.csv.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import machine, print_table, write_csv  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
MASKED = "entmax_masked_decoding"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="prompt 128, 16 new tokens, one round")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--caches", nargs="+", choices=["dynamic", "static"], default=["dynamic", "static"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt, args.new_tokens, args.rounds = 128, 16, 1
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (a token's time is measured past the first)")
    return args


def build_model(args, implementation: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=args.prompt + args.new_tokens)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(implementation)
    return model


class _StepTimes:
    """A ``generate`` streamer that notes when each token arrives: the prompt, then one token
    per step; the gaps after the first new token are the decoding steps."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def decoding_ms(self) -> list:
        return [1e3 * (later - earlier) for earlier, later in zip(self.times[1:], self.times[2:])]


def _generate(model, ids, new_tokens: int, cache: str):
    """(token ids, ms of each decoding step)."""
    steps = _StepTimes()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, cache_implementation=None if cache == "dynamic" else cache,
                             streamer=steps)
    return out, steps.decoding_ms()


def main(argv=None) -> list:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import entmax_fast.hf

    entmax_fast.hf.register("entmax_decoding", alpha=args.alpha)
    entmax_fast.hf.register(MASKED, alpha=args.alpha, decode_with_kvcache=False)
    methods = {"kvcache op": "entmax_decoding", "masked": MASKED, "sdpa (softmax)": "sdpa"}
    models = {name: build_model(args, implementation) for name, implementation in methods.items()}
    ids = torch.randint(1, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    print(f"{machine()}\nLlama hidden {args.hidden}, {args.layers} layers, H {args.heads}, Hkv {args.kv_heads}, "
          f"prompt {args.prompt}, {args.new_tokens} new tokens, α {args.alpha:g}, float32, batch 1")
    rows = []
    for cache in args.caches:
        token_ms, tokens = {name: [] for name in methods}, {}
        for name, model in models.items():  # warm-up: allocations, the C++ op's first call
            _generate(model, ids, 2, cache)
        for _ in range(args.rounds):
            for name, model in models.items():
                tokens[name], step_ms = _generate(model, ids, args.new_tokens, cache)
                token_ms[name].append(statistics.median(step_ms))
        masked = statistics.median(token_ms["masked"])
        for name in methods:
            ms = statistics.median(token_ms[name])
            rows.append({"cache": cache, "method": name, "ms/token": ms, "x masked": ms / masked,
                         "tokens = masked's": "-" if methods[name] == "sdpa" else
                         str(torch.equal(tokens[name], tokens["masked"]))})
    print_table(rows, "ms per new token (greedy generate, decoding steps only)")
    write_csv(rows, os.path.join(args.out, "hf_decode.csv"))
    return rows


if __name__ == "__main__":
    main()
