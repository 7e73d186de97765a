"""Train a tiny causal language model with context parallelism: each process holds a shard
of every sequence, and the entmax attention of MultiheadEntmaxAttention runs across the
processes inside ``entmax_fast.distributed.context_parallel`` (the model's code is not
changed).

    torchrun --nproc_per_node 2 examples/context_parallel.py
    torchrun --nproc_per_node <GPUs> examples/context_parallel.py --backend nccl

CPU processes talk over gloo; with ``--backend nccl`` each process runs on its own GPU
(``LOCAL_RANK``), the attention on the fused kernels.
The gradients are summed over the ranks as DDP does (here with an explicit all_reduce),
and the first step's loss is checked against the same model run on the whole sequence in
one process.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from entmax_fast import MultiheadEntmaxAttention
from entmax_fast import distributed as cp


class TinyCausalLM(nn.Module):
    def __init__(self, vocab, embed, heads, max_length):
        super().__init__()
        self.tokens = nn.Embedding(vocab, embed)
        self.positions = nn.Embedding(max_length, embed)
        self.attention = MultiheadEntmaxAttention(embed, heads, batch_first=True, attention="learned")
        self.readout = nn.Linear(embed, vocab)

    def forward(self, ids, positions):
        x = self.tokens(ids) + self.positions(positions)
        # is_causal with need_weights=False runs the fused causal attention; the mask is
        # only torch's required hint (its local shape does not matter here).
        hint = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        out, _ = self.attention(x, x, x, attn_mask=hint, is_causal=True, need_weights=False)
        return self.readout(x + out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=256, help="whole sequence length (divisible by 2P)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layout", default="balanced", choices=cp.LAYOUTS)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="gloo: CPU tensors; nccl: one GPU per process")
    args = parser.parse_args()

    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = TinyCausalLM(vocab=50, embed=32, heads=4, max_length=args.length).to(device)
    # The optimizer before the process group: torch 2.13's torch._dynamo, which the first
    # optimizer imports, keeps references to a group that exists when it is imported, so
    # that destroy_process_group() does not free it; gloo's threads then live into
    # interpreter shutdown, and one that frees a tensor there aborts the rank ("terminate
    # called without an active exception").
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 50, (2, args.length), generator=generator)
        positions = torch.arange(args.length).expand(2, -1)
        # Next-token targets over the whole sequence, so that a shard's last token is scored
        # against the next shard's first; then everything is sharded alike.
        targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
        ids, positions, targets = ids.to(device), positions.to(device), targets.to(device)
        count = (targets != -100).sum()
        local_ids, local_positions, local_targets = (cp.shard(x, seq_dim=1, layout=args.layout)
                                                     for x in (ids, positions, targets))
        with cp.context_parallel(layout=args.layout):
            logits = model(local_ids, local_positions)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), ignore_index=-100,
                                           reduction="sum") / count
        optimizer.zero_grad()
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if step == 0:
            with torch.no_grad():
                whole = nn.functional.cross_entropy(model(ids, positions).flatten(0, 1), targets.flatten(),
                                                    ignore_index=-100)
            torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)
            if rank == 0:
                print(f"step 0: context-parallel loss {total.item():.6f} = single-process loss {whole.item():.6f}")
        optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {total.item():.4f} on {dist.get_world_size()} ranks, layout {args.layout}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
