"""Where the Triton tests run: the compiled kernels on CUDA when there is a GPU, else the
Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 then).

The interpreter computes bf16 arithmetic wrongly, so bf16 cases run only on CUDA.
"""
import contextlib

import torch

import entmax_fast
from entmax_fast import dispatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# dtypes whose kernel arithmetic can be checked here
LOW_PRECISION = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16,)


@contextlib.contextmanager
def on_test_device():
    """Every tensor made inside lives on DEVICE."""
    with torch.device(DEVICE):
        yield


def triton_attention(*args, **kwargs):
    """entmax_fast.entmax_attention with the Triton backend forced."""
    with entmax_fast.use_backend("triton"):
        return entmax_fast.entmax_attention(*args, **kwargs)


def cpu_backends(op):
    """The backends that implement ``op`` and can run it on CPU tensors here (Triton only in
    its interpreter, which conftest.py switches on when there is no GPU)."""
    request = dispatch.Request(torch.device("cpu"), torch.float32, {})
    return [name for name in dispatch.registered_ops()[op] if dispatch._runs_on(name, request) is None]
