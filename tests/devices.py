"""Where the Triton tests run: the compiled kernels on CUDA when there is a GPU, else the
Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 then).

The interpreter computes bf16 arithmetic wrongly, so bf16 cases run only on CUDA.
"""
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# dtypes whose kernel arithmetic can be checked here
LOW_PRECISION = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16,)
