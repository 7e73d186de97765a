"""MultiheadEntmaxAttention (learned α) under DistributedDataParallel: two CPU processes
(gloo) training on halves of a batch take the same steps as one process on the whole
batch — the gradients of every parameter, α's included, match at every step."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from entmax_fast.multihead import MultiheadEntmaxAttention

WORLD_SIZE = 2
STEPS = 3
BATCH, LENGTH, EMBED, HEADS = 4, 6, 8, 2
# float64 all-reduce of two half-batch means vs one full-batch mean: rounding only.
GRAD_TOL = {"atol": 1e-12, "rtol": 1e-10}


class _TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = MultiheadEntmaxAttention(EMBED, HEADS, batch_first=True, attention="learned",
                                                  alpha_init=1.4, dtype=torch.float64)
        self.readout = nn.Linear(EMBED, 1, dtype=torch.float64)

    def forward(self, x, padding):
        out, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
        return self.readout(out).squeeze(-1)


def _model_and_data():
    torch.manual_seed(0)
    model = _TinyModel()
    data = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, LENGTH, EMBED, dtype=torch.float64)
        padding = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
        padding[1::2, LENGTH - 2:] = True
        target = torch.randn(BATCH, LENGTH, dtype=torch.float64)
        data.append((x, padding, target))
    return model, data


def _train(model, data, rank_slice=slice(None)):
    """SGD steps; returns every parameter's gradient at every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grads = []
    for x, padding, target in data:
        optimizer.zero_grad()
        loss = ((model(x[rank_slice], padding[rank_slice]) - target[rank_slice]) ** 2).mean()
        loss.backward()
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
    return grads


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        model, data = _model_and_data()
        ddp = nn.parallel.DistributedDataParallel(model)
        per_rank = BATCH // WORLD_SIZE
        grads = _train(ddp, data, slice(rank * per_rank, (rank + 1) * per_rank))
        torch.save({"grads": grads, "alpha": model.attention.alpha.detach()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_ddp_gradients_equal_single_process(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    model, data = _model_and_data()
    expected = _train(model, data)
    assert all(g["attention.alpha_logit"].abs().min() > 0 for g in expected)
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"{rank}.pt")
        for step, (got, want) in enumerate(zip(result["grads"], expected)):
            assert set(got) == {"module." + name for name in want}
            for name, grad in want.items():
                torch.testing.assert_close(got["module." + name], grad, **GRAD_TOL,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        torch.testing.assert_close(result["alpha"], model.attention.alpha.detach(), **GRAD_TOL)
