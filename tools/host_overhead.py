"""Host overhead of the row-wise mappings and the fused attention on the Triton path:
microseconds of Python work per call, forward and forward+backward, with the kernel launches
stubbed out.

Not a GPU timing. On a GPU a small call (16 x 1024 rows, say) runs its kernel in a few
microseconds, so what the host does around the launch (validation, the backend choice,
reshapes, allocations, autograd) decides the call's time; this measures that part on any
machine. CPU tensors take the Triton path as they do in the interpreter (TRITON_INTERPRET=1,
the backend forced with ``use_backend("triton")``), and the launchers' kernels are replaced
by a stub that only counts launches, so no kernel runs and no Triton launcher is timed. A
CUDA call also pays Triton's own launcher (tens of microseconds) and a real allocator, and
its first choice of backend asks torch.cuda.is_available; none of that is in these figures.

Each figure is the least, over ``--repeats`` blocks of ``--calls`` calls, of the thread's CPU
time per call (less disturbed by other processes than wall time; wall time is printed
beside it): many short blocks, so that on a shared machine some of them run undisturbed.
torch.softmax on the same tensor is timed in the same run as a yardstick: the ratio column
compares machines and runs, the microseconds alone do not.

    python tools/host_overhead.py [--shape 16x1024] [--dtype float32] [--calls 500] [--repeats 21]

The attention rows call entmax_attention on (1, 4, 128, 16) queries and (1, 2, 128, 16)
keys and values (causal, grouped-query), the shape of a decoding model's small calls, where
the host's part decides; its yardstick is torch's own SDPA on the same tensors (CPU compute
included).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# The interpreter is what lets CPU tensors take the Triton path; it must be chosen before
# triton is first imported.
if os.environ.setdefault("TRITON_INTERPRET", "1") != "1":
    sys.exit("host_overhead.py needs TRITON_INTERPRET=1 (CPU tensors on the Triton path)")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import entmax_fast  # noqa: E402
from entmax_fast import dispatch  # noqa: E402
from entmax_fast.backends.triton import rowwise as triton_rowwise  # noqa: E402
from entmax_fast.triton_kernels import attention_bwd, attention_fwd  # noqa: E402


class _StubKernel:
    """Takes a launch like a Triton kernel (``kernel[grid](*args, **constexprs)``) and only
    counts it: the arguments are still built, so their cost stays in the figures."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.launches += 1


def _per_call_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    """(thread CPU us, wall us) per call: the least over ``repeats`` blocks of ``calls``."""
    for _ in range(min(calls, 300)):
        fn()
    cpu, wall = [], []
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        cpu.append((time.thread_time() - cpu_start) / calls * 1e6)
        wall.append((time.perf_counter() - wall_start) / calls * 1e6)
    return min(cpu), min(wall)


def _triton_row(label: str, fn, op: str, stub: _StubKernel, calls: int, repeats: int) -> tuple:
    """(label, launches, cpu us, wall us) of ``fn``, which must have taken op's Triton path:
    a figure without a launch would time some other path than the Triton one."""
    stub.launches = 0
    fn()
    if dispatch.last_choice(op).backend != "triton" or stub.launches == 0:
        sys.exit(f"{label} did not launch a Triton kernel: {dispatch.last_choice(op)}")
    return (label, stub.launches, *_per_call_us(fn, calls, repeats))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="16x1024", help="rows x columns (default 16x1024)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="bfloat16 is refused on CPU tensors by the Triton backend")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed block (default 500)")
    parser.add_argument("--repeats", type=int, default=21, help="timed blocks; the least is kept (default 21)")
    args = parser.parse_args(argv)

    # One thread: softmax's CPU compute is the yardstick, and it should not vary with the
    # machine's core count.
    torch.set_num_threads(1)
    n_rows, n_cols = (int(v) for v in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    x = torch.randn(n_rows, n_cols, dtype=dtype)
    x_grad = x.clone().requires_grad_(True)
    grad = torch.randn(n_rows, n_cols, dtype=dtype)
    alpha_rows = torch.full((n_rows, 1), 1.3, dtype=dtype)
    alpha_rows_grad = alpha_rows.clone().requires_grad_(True)

    stub = _StubKernel()
    triton_rowwise.entmax_rowwise_fwd_kernel = stub
    triton_rowwise.entmax_rowwise_bwd_kernel = stub

    mappings = {
        "sparsemax": lambda X, alpha: entmax_fast.sparsemax(X),
        "entmax15": lambda X, alpha: entmax_fast.entmax15(X),
        "entmax_bisect(1.3)": lambda X, alpha: entmax_fast.entmax_bisect(X, 1.3),
        "entmax_bisect(α tensor)": lambda X, alpha: entmax_fast.entmax_bisect(X, alpha),
    }

    rows = []
    with entmax_fast.use_backend("triton"):
        for name, mapping in mappings.items():
            def forward(mapping=mapping):
                mapping(x, alpha_rows)

            def forward_backward(mapping=mapping):
                mapping(x_grad, alpha_rows_grad).backward(grad)
                x_grad.grad = None
                alpha_rows_grad.grad = None

            for label, fn in ((f"{name} forward", forward), (f"{name} forward+backward", forward_backward)):
                rows.append(_triton_row(label, fn, "entmax", stub, args.calls, args.repeats))

    attention_fwd.entmax_attn_fwd_kernel = stub
    attention_bwd.entmax_attn_bwd_dq_kernel = stub
    attention_bwd.entmax_attn_bwd_dkdv_kernel = stub
    q = torch.randn(1, 4, 128, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, 128, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(1, 4, 128, 16, dtype=dtype)

    def attention_forward():
        with torch.no_grad():
            entmax_fast.entmax_attention(q, k, v, is_causal=True, enable_gqa=True)

    def attention_forward_backward(attend=entmax_fast.entmax_attention):
        attend(q, k, v, is_causal=True, enable_gqa=True).backward(grad_out)
        q.grad = k.grad = v.grad = None

    with entmax_fast.use_backend("triton"):
        for label, fn in (("entmax_attention forward", attention_forward),
                          ("entmax_attention forward+backward", attention_forward_backward)):
            rows.append(_triton_row(label, fn, "attention", stub, args.calls, args.repeats))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows.append(("SDPA forward+backward (CPU compute, yardstick)", None,
                 *_per_call_us(lambda: attention_forward_backward(sdpa), args.calls, args.repeats)))

    softmax_cpu, softmax_wall = _per_call_us(lambda: torch.softmax(x, -1), args.calls, args.repeats)
    rows.append(("torch.softmax(x, -1) (CPU compute, yardstick)", None, softmax_cpu, softmax_wall))
    rows.append(("torch.empty_like(x) (one allocation)", None,
                 *_per_call_us(lambda: torch.empty_like(x), args.calls, args.repeats)))

    print(f"## Host work per call, Triton path, kernels stubbed ({args.shape} {args.dtype}, "
          f"torch {torch.__version__}, least of {args.repeats} x {args.calls} calls)")
    print(f"{'call':52s} {'launches':>8s} {'cpu us':>8s} {'wall us':>8s} {'/ softmax':>9s}")
    for label, launches, cpu_us, wall_us in rows:
        print(f"{label:52s} {'' if launches is None else launches:>8} {cpu_us:8.2f} {wall_us:8.2f} "
              f"{cpu_us / softmax_cpu:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
