"""Measure the fused attention's tile table on this GPU: for a few shapes, time the forward
and a training step under each candidate (BLOCK_M, BLOCK_N, warps and stages per kernel)
and print the fastest, to replace `attention_common.block_sizes` / `launch_config` where
they lose. Needs a CUDA device.

    python tools/tune_attention.py [--dtype bf16] [--head-dims 64 128] [--length 4096]
        [--tiles 64x64 128x64] [--fwd-launch 4x3 8x2] [--bwd-launch 8x2] [--forward-only]
        [--phases fused split] [--threshold-caps 0 128] [--mask none bool additive]
        [--alpha 1.5] [--alpha-tensor] [--dq kernel atomic ordered]
        [--caps table output=128,output_grad=168,dq=128,dkdv=168] [--chunks table dq=64]

--phases: the forward as one launch or as the threshold and output launches
(`attention_common.forward_phases`); --threshold-caps: maxnreg of the threshold launch
(0: none), tried only with split. --dq: where the backward forms dQ
(`attention_common.backward_dq`: its own kernel, or the dK/dV kernel's atomic adds,
unordered or in key-block order); a learned alpha (--alpha-tensor) always takes the kernel.
--caps: register caps (maxnreg) of the other launches, each candidate "table" or a comma
list of LAUNCH=CAP (0: none) over the table's (`attention_common.register_cap`), LAUNCH one
of output (the output launch without gradients: the timed forward), output_grad (with
them: the training step's), dq, dkdv.
--chunks: head-dim chunks (BLOCK_EC) of the kernels' q.k and dO.v products, each candidate
"table" (this architecture's, `attention_common.chunk_width`) or a comma list of
KERNEL=WIDTH over the table's, KERNEL one of fwd, dq, dkdv (a width at least the head dim:
whole).
--fwd-launch applies to every forward launch. --mask passes the causal mask as an (L, L)
attn_mask instead of is_causal (bool: True attends; additive: 0 / -inf), as transformers'
models do when a batch has padding: the masked kernels (MASK_BOOL, MASK_ADDITIVE), which
read the mask on every tile.

Each candidate is a fresh compile of every kernel it runs (seconds each): narrow the lists
to the time at hand, or pass --jobs N to compile them in N processes first (each runs this
script for one candidate at L 2048, which fills Triton's cache); they are then timed one
after the other in this process, alone on the GPU. --forward-only times the forward
without autograd and compiles no backward kernel.

Public functions (tests/test_tools.py calls them): `parse_args(argv)`, `candidate_table`,
`candidate_argv`, `parse_caps` and `parse_chunks` (one --caps / --chunks candidate),
`chunk_width_over(table, chunks)` (the chunk-width table with those chunks over it),
`measure` and `main(argv)`.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TILES = [(64, 64), (64, 32), (128, 64), (128, 32), (32, 64)]
FWD_LAUNCH = [(4, 2), (4, 3), (8, 2), (8, 3)]
BWD_LAUNCH = [(4, 2), (8, 2), (8, 1)]


def _time(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=3, rep=30)


def _pairs(texts):
    return [tuple(int(x) for x in text.split("x")) for text in texts]


def _phases(name):
    from entmax_fast.triton_kernels import attention_common as tiles

    return {"fused": (tiles.PHASE_FUSED,),
            "split": (tiles.PHASE_THRESHOLD, tiles.PHASE_OUTPUT)}[name]


def _causal_mask(kind, length, dtype):
    """None, or the causal mask as an (L, L) attn_mask of `kind` ("bool" or "additive")."""
    if kind == "none":
        return None
    keep = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()
    if kind == "bool":
        return keep
    return torch.zeros(length, length, dtype=dtype, device="cuda").masked_fill(~keep, float("-inf"))


def _assignments(text, option, names):
    """{names[NAME]: VALUE} of one candidate of `option` ("table", or NAME=VALUE,... with
    integer values): the entries it sets over the table."""
    if text == "table":
        return {}
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in names or not value.isdigit():
            raise SystemExit(f"tune_attention: {option} takes NAME=VALUE with NAME one of "
                             f"{', '.join(names)}, not {item!r}")
        values[names[name]] = int(value)
    return values


# --caps' launch names: (table key, whether the launch is compiled with gradients)
CAP_LAUNCHES = {"output": ("fwd_output", False), "output_grad": ("fwd_output", True),
                "dq": ("dq", False), "dkdv": ("dkdv", False)}


def parse_caps(text):
    """{(table key, with gradients): cap} of one --caps candidate."""
    return _assignments(text, "--caps", CAP_LAUNCHES)


def _register_caps(table, threshold_cap, caps):
    """`attention_common.register_cap` with the threshold launch's cap and `caps` over
    `table` (a cap of 0: none)."""
    def register_cap(kernel, block_e, dtype_key, mask_kind=0, need_grad=0):
        if kernel == "fwd_threshold":
            return threshold_cap or None
        key = (kernel, bool(need_grad) if kernel == "fwd_output" else False)
        if key in caps:
            return caps[key] or None
        return table(kernel, block_e, dtype_key, mask_kind, need_grad)
    return register_cap


# --chunks' kernel names: the table's
CHUNK_KERNELS = {kernel: kernel for kernel in ("fwd", "dq", "dkdv")}


def parse_chunks(text):
    """{kernel: width} of one --chunks candidate."""
    return _assignments(text, "--chunks", CHUNK_KERNELS)


def chunk_width_over(table, chunks):
    """`attention_common.chunk_width` with the widths of `chunks` ({kernel: width}) in
    place of the table's, never wider than the head dim."""
    if not chunks:
        return table

    def chunk_width(kernel, block_e, dtype_key, arch=None):
        if kernel in chunks:
            return min(chunks[kernel], block_e)
        return table(kernel, block_e, dtype_key, arch)
    return chunk_width


def measure(dtype, head_dim, length, causal, tile_shape, fwd_launch, bwd_launch, alpha=1.5,
            forward_only=False, phases="fused", threshold_cap=0, mask="none", alpha_tensor=False,
            dq="kernel", caps=None, chunks=None):
    import entmax_fast
    from tools.common import replaced
    from entmax_fast.triton_kernels import attention_common as tiles

    batch = max(1, 16384 // length)
    shape = (batch, 16, length, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=dtype)
    attn_mask = _causal_mask(mask, length, dtype) if causal else None
    is_causal = causal and attn_mask is None
    if alpha_tensor:
        # a learned alpha: one per head, differentiated in the training step (the general kind)
        alpha = torch.full((16,), alpha, device="cuda", requires_grad=not forward_only)
    edits = ((tiles, "block_sizes", lambda block_e, dtype_key, dropout=False: tile_shape),
             (tiles, "launch_config",
              lambda kernel, *_: fwd_launch if kernel.startswith("fwd") else bwd_launch),
             (tiles, "forward_phases", lambda *_: _phases(phases)),
             (tiles, "register_cap", _register_caps(tiles.register_cap, threshold_cap, caps or {})),
             (tiles, "backward_dq", lambda *_: tiles.DQ_MODES[dq]),
             (tiles, "chunk_width", chunk_width_over(tiles.chunk_width, chunks or {})))
    with replaced(*edits), entmax_fast.use_backend("triton"):
        with torch.no_grad():
            t_fwd = _time(lambda: entmax_fast.entmax_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, alpha=alpha))
        if forward_only:
            return t_fwd, float("nan")

        def step():
            for t in (q, k, v, alpha):
                if isinstance(t, torch.Tensor):
                    t.grad = None
            entmax_fast.entmax_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                         alpha=alpha).backward(grad_out)

        t_step = _time(step)
    return t_fwd, t_step


def candidate_table(args):
    """{head dim: [candidate, ...]} of parsed arguments, each candidate (tiles, forward
    launch, backward launch, (phases, threshold cap), dQ mode, (caps text, caps), (chunks
    text, chunks)), the chunks varying fastest, then the caps."""
    forwards = [(phases, cap) for phases in args.phases
                for cap in (args.threshold_caps if phases == "split" else [0])]
    bwd_launches = [(0, 0)] if args.forward_only else _pairs(args.bwd_launch)
    dq_modes = ["kernel"] if args.forward_only else args.dq
    cap_sets = [(text, parse_caps(text)) for text in args.caps]
    chunk_sets = [(text, parse_chunks(text)) for text in args.chunks]
    return {head_dim: list(itertools.product(_pairs(args.tiles), _pairs(args.fwd_launch),
                                             bwd_launches, forwards, dq_modes, cap_sets,
                                             chunk_sets))
            for head_dim in args.head_dims}


def candidate_argv(args, head_dim, candidate, length):
    """This script's arguments that time `candidate` alone at `length`."""
    tiles, fwd_launch, bwd_launch, (phases, cap), dq, (caps_text, _), (chunks_text, _) = (
        candidate)
    return (["--dtype", args.dtype, "--head-dims", str(head_dim), "--length", str(length),
             "--alpha", str(args.alpha), "--mask", args.mask,
             "--tiles", "x".join(map(str, tiles)), "--fwd-launch", "x".join(map(str, fwd_launch)),
             "--bwd-launch", "x".join(map(str, bwd_launch)), "--phases", phases,
             "--threshold-caps", str(cap), "--dq", dq, "--caps", caps_text,
             "--chunks", chunks_text]
            + [flag for flag, on in (("--causal", args.causal),
                                     ("--forward-only", args.forward_only),
                                     ("--alpha-tensor", args.alpha_tensor)) if on])


def compile_all(args, candidates):
    """Fills Triton's cache with every candidate's kernels: one process each, at most
    ``args.jobs`` at a time, at `compile_length`; their timings are discarded."""
    from bench.common import compile_length, precompile

    length = compile_length(args.length)
    commands = [[sys.executable, os.path.abspath(__file__)]
                + candidate_argv(args, head_dim, candidate, length)
                for head_dim, listed in candidates.items() for candidate in listed]
    precompile(commands, args.jobs, "tune_attention")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--tiles", nargs="+", default=[f"{m}x{n}" for m, n in TILES],
                        help="BLOCK_MxBLOCK_N candidates")
    parser.add_argument("--fwd-launch", nargs="+", default=[f"{w}x{s}" for w, s in FWD_LAUNCH],
                        help="forward (warps)x(stages) candidates")
    parser.add_argument("--bwd-launch", nargs="+", default=[f"{w}x{s}" for w, s in BWD_LAUNCH],
                        help="backward (warps)x(stages) candidates")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--phases", nargs="+", default=["fused"], choices=["fused", "split"])
    parser.add_argument("--threshold-caps", type=int, nargs="+", default=[0],
                        help="maxnreg of the split forward's threshold launch (0: none)")
    parser.add_argument("--alpha-tensor", action="store_true",
                        help="alpha as a per-head tensor (a learned alpha: the general kind)")
    parser.add_argument("--mask", default="none", choices=["none", "bool", "additive"],
                        help="with --causal: the causal mask as an attn_mask of this kind")
    parser.add_argument("--dq", nargs="+", default=["kernel"],
                        choices=["kernel", "atomic", "ordered"],
                        help="where the backward forms dQ (attention_common.backward_dq)")
    parser.add_argument("--caps", nargs="+", default=["table"],
                        help='register caps of the other launches: "table" or '
                             'LAUNCH=CAP,... (output, output_grad, dq, dkdv; 0: none)')
    parser.add_argument("--chunks", nargs="+", default=["table"],
                        help='head-dim chunks of the products: "table" or KERNEL=WIDTH,... '
                             '(fwd, dq, dkdv)')
    parser.add_argument("--jobs", type=int, default=0,
                        help="compile every candidate in this many processes first (0: no)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    candidates = candidate_table(args)
    if not torch.cuda.is_available():
        print("tune_attention: needs a CUDA device (none here); nothing measured")
        return 0
    if args.jobs > 0:
        compile_all(args, candidates)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, L={args.length}, causal={args.causal}, "
          f"alpha={args.alpha}{' (per-head tensor)' if args.alpha_tensor else ''}, mask={args.mask}")
    for head_dim in args.head_dims:
        rows = []
        for (tiles, fwd_launch, bwd_launch, (phases, cap), dq, (caps_text, caps),
             (chunks_text, chunks)) in candidates[head_dim]:
            label = f"{phases}" + (f" cap {cap}" if cap else "") + (
                f" dq {dq}" if not args.forward_only else "") + (
                f" caps {caps_text}" if caps else "") + (
                f" chunks {chunks_text}" if chunks else "")
            try:
                t_fwd, t_step = measure(DTYPES[args.dtype], head_dim, args.length, args.causal,
                                        tiles, fwd_launch, bwd_launch, args.alpha,
                                        args.forward_only, phases, cap, args.mask, args.alpha_tensor,
                                        dq, caps, chunks)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                print(f"E={head_dim} {tiles} fwd{fwd_launch} {label} bwd{bwd_launch}: "
                      f"{type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows.append((t_fwd if args.forward_only else t_step, t_fwd, tiles, fwd_launch, label,
                         bwd_launch))
            print(f"E={head_dim} tiles {tiles} fwd (warps, stages) {fwd_launch} {label} "
                  f"bwd {bwd_launch}: fwd {t_fwd:.3f} ms, fwd+bwd {t_step:.3f} ms", flush=True)
        rows.sort()
        if rows:
            _, t_fwd, tiles, fwd_launch, label, bwd_launch = rows[0]
            t_step = rows[0][0] if not args.forward_only else float("nan")
            print(f"best for E={head_dim}: tiles {tiles}, fwd {fwd_launch} {label}, "
                  f"bwd {bwd_launch} (fwd {t_fwd:.3f} ms, fwd+bwd {t_step:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
