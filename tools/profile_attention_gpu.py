"""Where a training step of the fused attention spends its time on a GPU: per-kernel CUDA
time (torch.profiler) for one shape, SDPA's beside it, and the resources of every compiled
attention kernel (registers, spills, warps, stages, shared memory) read from Triton's cache.
Needs a CUDA device.

    python tools/profile_attention_gpu.py [--length 4096] [--head-dim 64] [--causal]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import kernel_times  # noqa: E402


def _print_times(label, times, top=8):
    total = sum(times.values())
    print(f"{label}: {total:.3f} ms of kernels per step")
    for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:9.3f} ms  {100 * ms / total:5.1f} %  {name[:100]}")


def _compiled_resources():
    from entmax_fast.triton_kernels import attention_bwd, attention_fwd

    kernels = {"fwd": attention_fwd.entmax_attn_fwd_kernel,
               "dq": attention_bwd.entmax_attn_bwd_dq_kernel,
               "dkdv": attention_bwd.entmax_attn_bwd_dkdv_kernel}
    for name, fn in kernels.items():
        for entry in getattr(fn, "device_caches", {}).values():
            for compiled in entry[0].values():
                meta = compiled.metadata
                print(f"  {name}: regs {getattr(compiled, 'n_regs', '?')}, spills "
                      f"{getattr(compiled, 'n_spills', '?')}, warps {meta.num_warps}, stages "
                      f"{meta.num_stages}, shared {meta.shared} B")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.5, 2.0])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_attention_gpu: needs a CUDA device (none here); nothing measured")
        return 0
    import entmax_fast

    batch = max(1, 16384 // args.length)
    shape = (batch, args.heads, args.length, args.head_dim)
    print(f"{torch.cuda.get_device_name()}: bf16 {shape}, causal={args.causal}")
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step_of(attend):
        def step():
            for t in (q, k, v):
                t.grad = None
            attend().backward(grad_out)
        return step

    _print_times("sdpa", kernel_times(step_of(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal))))
    for alpha in args.alphas:
        _print_times(f"entmax_fast alpha={alpha}", kernel_times(step_of(
            lambda alpha=alpha: entmax_fast.entmax_attention(q, k, v, is_causal=args.causal,
                                                             alpha=alpha))))
    print("compiled attention kernels:")
    _compiled_resources()
    return 0


if __name__ == "__main__":
    sys.exit(main())
