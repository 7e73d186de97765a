"""What one part of the fused attention forward costs on a GPU: times variants of the
forward kernel side by side, each made by one edit of triton_kernels/attention_fwd.py's
source (written to a temporary module), against the kernel as it is. Needs a CUDA device.

The variants are measuring instruments, not alternatives: a cap on the threshold passes
gives wrong thresholds, a forward that writes no tile flags breaks the backward. Timing
them is how the cost of a threshold pass (the difference between two caps) and of the
flag writes (a reduction across the block's warps on every tile) are measured
(docs/performance.md has the figures). An edit whose anchor text is no longer in the
kernel fails with the variant's name: update the anchor with the kernel.

    python tools/attention_variants.py [--length 4096] [--head-dim 64]
        [--alphas 1.5 2] [--variants kernel cap2 cap3 no_reflag] [--backward] [--jobs 8]

Each variant is a fresh compile (about 20 s each). ``--jobs N`` first compiles every
(variant, alpha) in up to N processes at once (each runs this script at a short length,
which fills Triton's cache), then times them one after the other in this process, alone
on the GPU.

Public names (tests/test_tools.py and tools/kernel_loops.py use them): VARIANTS and
BACKWARD_VARIANTS ({name: edits}), GRIDS and SLOTS (the launcher's grid and capture slots a
variant replaces), `variant_module(name, directory, backward=False)`,
`variant_kernel(name, directory)`, `time_variant`, `time_backward_variant` and `main(argv)`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_CAP = "(n_pass < MAX_TAU_PASSES_C)"
# the passes over captured scores (`attention_common.candidate_slots`) share the cap
_CAP_CAPTURED = "(MAX_TAU_PASSES_C > n_pass)"
_MAX_FLAG = "    tl.store(p_flags + start_n // BLOCK_N, tl.max(m_near.to(tl.int8), 0))\n"
# the second pass's three compiles: general alpha's with and without the capture, and
# alpha 2's and 1.5's
_REFLAG = ["m_tight, p_cand, True, CANDIDATES, BLOCK_M,", "m_tight, p_cand, True, 0, BLOCK_M,",
           "m_tight, p_cand, True,\n                CANDIDATES,"]

_ONE_POINT = ("b_t0, b_t0,\n"
              "        _threshold_in_z(b_lo, inv_am1, ALPHA_KIND), m_rows, p_flags, p_tiles, n_listed,\n"
              "        inv_am1, p_cand, False, REFLAG, CANDIDATES, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC,\n"
              "        MASK_KIND, OPTIONS, ALPHA_KIND, NEAR_ONE)\n")
_SUPPORT = "        b_count, b_dmin = count_and_smallest(tl.sum(b_neg, 1), tl.min(b_low, 1), n)\n"
_SUPPORT_BITS = "        b_neg, b_low = support_bits(b_g)\n"
_CAPTURE_GATE = "capture = _capture_fits(b_ysub, b_lo, inv_am1, m_done, BLOCK_N, ALPHA_KIND)"
# The passes after the first evaluate a second trial point just above the first; its sums
# feed the result through a comparison that never holds, so that nothing is optimised away
# and the thresholds (and so the pass count) stay those of the kernel.
_EXTRA_POINT = [
    (_ONE_POINT, _ONE_POINT.replace("b_t0, b_t0,", "b_t0, b_t0 + 1e-3,")
     .replace("inv_am1, p_cand, False, REFLAG,", "inv_am1, p_cand, True, REFLAG,")
     + "    b_a0 += tl.where(b_a1 + b_b1 + b_c1 + b_n1 == -1.2345, 1e-30, 0.0)\n"),
]

# The grid with the blocks along its first dimension and the heads along its second (GRIDS
# gives the launcher's side), the last block first only with the causal flag; the kernels
# take the heads along the first (`attention_common.launch_grid`).
_HEADS_FIRST = ("    pid_bh = tl.program_id(0)\n"
                "    pid_m = query_block(tl.program_id(1), n_qblocks)\n")
_BLOCKS_FIRST = ("    pid_m = tl.program_id(0)\n"
                 "    if is_causal != 0:\n"
                 "        pid_m = n_qblocks - 1 - pid_m\n"
                 "    pid_bh = tl.program_id(1)\n")

# name: [(anchor, replacement[, count])]: count is how often the anchor must occur (1 when
# not given), every occurrence replaced. A cap of 1 folds the pass loop away, which triton
# 3.6 fails to compile: the smallest cap is 2.
VARIANTS = {
    "kernel": [],
    "cap2": [(_CAP, "(n_pass < 2)", 3), (_CAP_CAPTURED, "(2 > n_pass)")],
    "cap3": [(_CAP, "(n_pass < 3)", 3), (_CAP_CAPTURED, "(3 > n_pass)")],
    "cap4": [(_CAP, "(n_pass < 4)", 3), (_CAP_CAPTURED, "(4 > n_pass)")],
    # (nothing captured either: the passes over captured scores would see none)
    "no_reflag": [(anchor, anchor.replace("True", "False").replace("CANDIDATES,", "0,"))
                  for anchor in _REFLAG],
    # every later pass at the lower bound instead of at `_trial_point`: what the trial
    # point near alpha 1.5's tight upper bound saves
    "lower_bound_trials": [("_trial_point(b_lo, b_hi, m_done, m_tight, b_guess, ALPHA_KIND),",
                            "b_lo,")],
    # general alpha's second pass (the one that rewrites the flags) at the lower bound, as
    # alpha 2 and 1.5 keep it: what its trial point there saves
    "reflag_at_lower_bound": [
        ("b_t2 = _trial_point(b_lo, b_hi, m_done, m_tight, b_guess, ALPHA_KIND)", "b_t2 = b_lo")],
    # alpha 1.5's roots certified only when no score lies between t and them, without the
    # near-exact certificate (`_update_threshold`): what that certificate saves
    "exact_certificate_only": [
        ("b_c * b_gap * b_gap <= (b_b - b_c * (b_root - b_t)) * (2.0 * TAU_STEP_TOL_C))",
         "b_gap <= 0.0)")],
    # every tile flagged without the reduction: on random scores, where every tile holds
    # weight anyway, the difference to "kernel" is what the max pass's flags cost
    "max_flags_all": [(_MAX_FLAG, "    tl.store(p_flags + start_n // BLOCK_N, 1)\n")],
    # at a fixed pass count: what a second trial point per later pass costs (against cap3),
    # and what the exactness certificate's min reduction costs (no row is then certified,
    # every block runs to the cap)
    "cap3_extra_point": [(_CAP, "(n_pass < 3)", 3), (_CAP_CAPTURED, "(3 > n_pass)")]
    + _EXTRA_POINT,
    "cap3_no_dmin": [(_CAP, "(n_pass < 3)", 3), (_CAP_CAPTURED, "(3 > n_pass)"),
                     (_SUPPORT, _SUPPORT + "        b_dmin = b_count * 0.0\n")],
    # no capture of the scores above lo in the second pass (`candidate_slots`): what the
    # capture saves (or costs) per alpha kind
    "no_capture": [],
    # the capture kept, the passes after the second over the tiles all the same: against
    # `no_capture` what the capture costs the second pass, against `kernel` what the
    # passes over captured scores save
    "capture_unused": [("        if n_cand <= CANDIDATES:\n", "        if n_cand < 0:\n", 2)],
    "cap2_no_capture": [(_CAP, "(n_pass < 2)", 3), (_CAP_CAPTURED, "(2 > n_pass)")],
    # the first threshold pass without the capture above a rising lower bound: two points
    # over the tiles, then a capture at the lower bound they found: what
    # attention_fwd._running_capture_pass saves per alpha kind
    "no_running_capture": [("    if capture:\n        b_lo, b_ncand = _running_capture_pass(",
                            "    if False:\n        b_lo, b_ncand = _running_capture_pass(")],
    # the capture's indicator converted to fp16 by LLVM (a predicate, a select and a
    # permute per pair) and the row's count by its own sum of the comparisons rather than
    # the rank's row maximum: what `support.positive_f16` and the inclusive rank save
    "capture_cast_sum": [("tl.dot(positive_f16(b_key), b_upto,",
                        "tl.dot((b_key > 0.0).to(tl.float16), b_upto,"),
                       ("    b_count = tl.max(b_rank, 1)\n",
                        "    b_count = tl.sum((b_key > 0.0).to(tl.float32), 1)\n")],
    # compactions when a row holds half its slots rather than
    # attention_common.COMPACT_FILL of them
    "compact_at_half": [("(n_most > CANDIDATES * COMPACT_FILL_C)", "(n_most > CANDIDATES * 0.5)")],
    # the threshold passes from the bracket's lower end: no column maxima in the max pass
    # (one max per score) and no lower bound from them (`_subset_bound`)
    "no_subset_bound": [("    b_ycol = tl.maximum(b_ycol, b_y)\n", ""),
                        ("    b_lo = _subset_bound(b_ysub, am1, inv_am1, b_sink, b_lo, b_hi, m_done, OPTIONS, ALPHA_KIND,\n"
                         "                         NEAR_ONE)\n", "")],
    # the slots read with a masked load per entry rather than as whole chunks
    # (`_candidate_pass`, `_compact`)
    "masked_slot_loads": [
        ("        b_u = tl.load(p_cand + tl.arange(0, BLOCK_M)[:, None] * CANDIDATES + o_c[None, :])\n"
         "        b_u = tl.where(o_c[None, :] < b_ncand[:, None], b_u, float(\"-inf\"))\n",
         "        b_u = tl.load(p_cand + tl.arange(0, BLOCK_M)[:, None] * CANDIDATES + o_c[None, :],\n"
         "                      mask=o_c[None, :] < b_ncand[:, None], other=float(\"-inf\"))\n"),
        ("        b_u = tl.where(o_c[None, :] < b_keep[:, None], tl.load(p_cand + o_rows + o_c[None, :]),\n"
         "                       float(\"-inf\"))\n",
         "        b_u = tl.load(p_cand + o_rows + o_c[None, :], mask=o_c[None, :] < b_keep[:, None],\n"
         "                      other=float(\"-inf\"))\n")],
    # every general-alpha block captures, whether its rows are likely to fit or not
    # (attention_fwd._capture_fits)
    "no_capture_gate": [(_CAPTURE_GATE, "capture = True")],
    # a gate on alpha alone in place of `_capture_fits`: heads from alpha 1.5 up capture,
    # whatever their scores
    "alpha_gate": [(_CAPTURE_GATE, "capture = am1 >= 0.5")],
    # the count and the certificate from the predicate `d > 0` (LLVM packs those
    # predicates into bit masks): what `support.support_bits` saves
    "predicated_moments": [
        (_SUPPORT_BITS, "        b_neg = tl.where(b_g > 0, 0, -1)\n"
                        "        b_low = tl.where(b_g > 0, b_g.to(tl.uint32, bitcast=True) - 1,"
                        " 0xFFFFFFFF)\n")],
    # the heads along the grid's second dimension (`attention_common.launch_grid`): what
    # starting every head's longest causal blocks first saves
    "blocks_first": [(_HEADS_FIRST, _BLOCKS_FIRST)],
}


# Backward variants (--backward: forward and backward timed, the forward as it is): edits
# of triton_kernels/attention_bwd.py.
BACKWARD_VARIANTS = {
    "kernel": [],
    # p and s normalised per score rather than by the row factors of `_row_weights`
    "norm_per_score": [
        (" window_query_tiles)\n", " window_query_tiles, sensitivity, weights)\n"),
        ("    elif ALPHA_KIND == ALPHA_ENTMAX15:\n        b_c = tl.math.rsqrt(b_l)\n",
         "    elif ALPHA_KIND == ALPHA_KIND:\n"
         "        b_g = gap(b_u, b_thr, inv_am1, ALPHA_KIND)\n"
         "        b_p = weights(b_g, inv_am1, ALPHA_KIND) * (1.0 / b_l)[:, None]\n"
         "        b_s = sensitivity(b_g, inv_am1, ALPHA_KIND) * tl.exp2((am1 - 1.0) * "
         "tl.log2(b_l))[:, None]\n"
         "    elif ALPHA_KIND == ALPHA_ENTMAX15:\n        b_c = tl.math.rsqrt(b_l)\n")],
    # every launch with the heads along the grid's second dimension (the forward too: the
    # launcher's grid is one function)
    "blocks_first": [
        (_HEADS_FIRST, _BLOCKS_FIRST),
        ("    pid_bhk = tl.program_id(0)\n    if DQ_MODE == DQ_ORDERED_C:\n"
         "        pid_n = tl.num_programs(1) - 1 - tl.program_id(1)\n    else:\n"
         "        pid_n = tl.program_id(1)\n",
         "    pid_bhk = tl.program_id(1)\n    if DQ_MODE == DQ_ORDERED_C:\n"
         "        pid_n = tl.num_programs(0) - 1 - tl.program_id(0)\n    else:\n"
         "        pid_n = tl.program_id(0)\n")],
}

# variants that also change the launcher's grid (attention_common.launch_grid)
GRIDS = {"blocks_first": lambda n_blocks, n_heads: (n_blocks, n_heads)}


def variant_module(name, directory, backward=False):
    """The forward (or backward) kernel module with `name`'s edits, written under
    `directory`; the module itself for a variant without edits."""
    from entmax_fast.triton_kernels import attention_bwd, attention_fwd

    module = attention_bwd if backward else attention_fwd
    edits = (BACKWARD_VARIANTS if backward else VARIANTS)[name]
    if not edits:
        return module
    with open(module.__file__) as f:
        source = f.read()
    file_name = os.path.basename(module.__file__)
    for anchor, replacement, *count in edits:
        expected = count[0] if count else 1
        if source.count(anchor) != expected:
            raise ValueError(f"variant {name}: {anchor.strip()!r} is not in {file_name} "
                             f"exactly {expected} times")
        source = source.replace(anchor, replacement)
    tag = f"_variant_{'bwd_' if backward else ''}{name}"
    path = os.path.join(directory, f"{tag}.py")
    with open(path, "w") as f:
        f.write(source)
    # a submodule of the package, so that the kernel's relative imports resolve
    module_name = f"entmax_fast.triton_kernels.{tag}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    edited = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = edited
    spec.loader.exec_module(edited)
    return edited


def variant_kernel(name, directory):
    """The forward kernel with `name`'s edits, from a module written under `directory`."""
    return variant_module(name, directory).entmax_attn_fwd_kernel


# variants that change the launcher's capture slots (attention_common.candidate_slots)
# rather than the kernel's source
SLOTS = {"no_capture": lambda alpha_kind: 0, "cap2_no_capture": lambda alpha_kind: 0}


def time_variant(kernel, length, head_dim, alpha, causal=True, heads=16, tokens=16384,
                 alpha_tensor=False, slots=None, score_scale=1.0, grid=None):
    """Median ms of the forward without gradients (bf16) with `kernel` launched in place of
    the forward kernel (and `grid` in place of attention_common.launch_grid). alpha_tensor:
    alpha as a per-head tensor (a learned alpha's kind, the general one, whatever its
    value). score_scale multiplies q: the scores' standard deviation (flatter rows below 1
    hold more scores near their threshold)."""
    import entmax_fast
    from tools.common import replaced
    from entmax_fast.triton_kernels import attention_common, attention_fwd
    from triton.testing import do_bench

    shape = (max(1, tokens // length), heads, length, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q = q * score_scale
    if alpha_tensor:
        alpha = torch.full((heads,), alpha, device="cuda")
    with replaced((attention_fwd, "entmax_attn_fwd_kernel", kernel),
                  (attention_common, "candidate_slots", slots),
                  (attention_common, "launch_grid", grid)):
        with entmax_fast.use_backend("triton"), torch.no_grad():
            return do_bench(lambda: entmax_fast.entmax_attention(q, k, v, is_causal=causal,
                                                                 alpha=alpha),
                            warmup=5, rep=60)


def time_backward_variant(module, length, head_dim, alpha, causal=True, heads=16,
                          tokens=16384, alpha_tensor=False, forward_kernel=None, grid=None):
    """Median ms of forward and backward (bf16) with the backward kernels of `module` (and
    `forward_kernel`, `grid` in place of the forward kernel and of
    attention_common.launch_grid)."""
    import entmax_fast
    from tools.common import replaced
    from entmax_fast.triton_kernels import attention_bwd, attention_common, attention_fwd
    from triton.testing import do_bench

    shape = (max(1, tokens // length), heads, length, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if alpha_tensor:
        alpha = torch.full((heads,), alpha, device="cuda", requires_grad=True)

    def step():
        with entmax_fast.use_backend("triton"):
            out = entmax_fast.entmax_attention(q, k, v, is_causal=causal, alpha=alpha)
        out.backward(grad_out)

    with replaced(*((attention_bwd, name, getattr(module, name))
                    for name in ("entmax_attn_bwd_dq_kernel", "entmax_attn_bwd_dkdv_kernel")),
                  (attention_fwd, "entmax_attn_fwd_kernel", forward_kernel),
                  (attention_common, "launch_grid", grid)):
        return do_bench(step, warmup=5, rep=60, grad_to_none=[q, k, v])


def compile_all(args):
    """Fills Triton's cache with every (variant, alpha) of ``args``: one process each, at
    most ``args.jobs`` at a time, at `compile_length`; their timings are discarded (they
    share the GPU)."""
    from bench.common import compile_length, precompile

    commands = [[sys.executable, os.path.abspath(__file__), "--length",
                 str(compile_length(args.length)),
                 "--head-dim", str(args.head_dim), "--alphas", str(alpha), "--variants", name]
                + (["--backward"] if args.backward else [])
                + (["--not-causal"] if args.not_causal else [])
                + (["--alpha-tensor"] if args.alpha_tensor else [])
                + ["--score-scale", str(args.score_scale)]
                for alpha in args.alphas for name in args.variants]
    precompile(commands, args.jobs, "attention_variants")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--variants", nargs="+", default=None,
                        choices=sorted(set(VARIANTS) | set(BACKWARD_VARIANTS)),
                        help="default: every forward (or, with --backward, backward) variant")
    parser.add_argument("--backward", action="store_true",
                        help="time forward and backward with BACKWARD_VARIANTS' backwards")
    parser.add_argument("--not-causal", action="store_true")
    parser.add_argument("--score-scale", type=float, default=1.0,
                        help="forward variants: q times this (the scores' standard deviation)")
    parser.add_argument("--alpha-tensor", action="store_true",
                        help="alpha as a per-head tensor: the general kind at every value")
    parser.add_argument("--jobs", type=int, default=0,
                        help="compile the variants in this many processes first (0: no)")
    args = parser.parse_args(argv)
    table = BACKWARD_VARIANTS if args.backward else VARIANTS
    args.variants = args.variants or list(table)
    unknown = [name for name in args.variants if name not in table]
    if unknown:
        parser.error(f"--variants: {unknown} are not {'backward' if args.backward else 'forward'}"
                     f" variants ({', '.join(table)})")
    if not torch.cuda.is_available():
        print("attention_variants: needs a CUDA device (none here); nothing measured")
        return 0
    if args.jobs > 0:
        compile_all(args)
    print(f"{torch.cuda.get_device_name()}: bf16 L={args.length} E={args.head_dim} "
          f"causal={not args.not_causal}, scores' sd {args.score_scale}, "
          f"{'forward and backward' if args.backward else 'forward without gradients'}, ms")
    with tempfile.TemporaryDirectory() as directory:
        modules = {name: variant_module(name, directory, args.backward)
                   for name in args.variants}
        # a backward variant that changes the grid needs its forward kernel read it alike
        forwards = {name: variant_kernel(name, directory)
                    for name in args.variants if args.backward and name in GRIDS}
        for alpha in args.alphas:
            base = None
            for name, module in modules.items():
                if args.backward:
                    ms = time_backward_variant(module, args.length, args.head_dim, alpha,
                                               not args.not_causal,
                                               alpha_tensor=args.alpha_tensor,
                                               forward_kernel=forwards.get(name),
                                               grid=GRIDS.get(name))
                else:
                    ms = time_variant(module.entmax_attn_fwd_kernel, args.length,
                                      args.head_dim, alpha, not args.not_causal,
                                      alpha_tensor=args.alpha_tensor, slots=SLOTS.get(name),
                                      score_scale=args.score_scale, grid=GRIDS.get(name))
                base = ms if base is None else base
                print(f"alpha={alpha}{' (tensor)' if args.alpha_tensor else ''} {name:22s} {ms:8.3f} ms ({ms / base:5.2f}x the first)",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
