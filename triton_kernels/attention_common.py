"""What the fused attention's forward (attention_fwd.py) and backward (attention_bwd.py)
kernels share: the tile tables, the layout of the row statistics, the @triton.jit helpers
both directions call, and the AOT signatures and configuration space of their kernels.

The tile tables are shared because the tile flags written by the forward are read by the
backward: both must tile the same way, and the launchers (host code of the Triton backend,
``entmax_fast/backends/triton/attention.py``) read the same tables as the AOT check
(triton_kernels/aot.py), which compiles exactly the configurations they can choose.
"""
import functools
import itertools
from typing import NamedTuple

import triton
import triton.language as tl

from .. import common
from .kinds import (ALPHA_ABOVE_TWO, ALPHA_ENTMAX15, ALPHA_GENERAL, ALPHA_SOFTMAX, ALPHA_SPARSEMAX,
                    MASK_ADDITIVE, MASK_BOOL)
from .signature import DTYPE_KEYS, TENSOR, kernel_signature, pointer_type
from .support import log2_approx

# Threshold passes: a row is done when its tau is certified exact or its Newton step (in
# u = y - max(y), where tau lies in [-1, 0)) is below TAU_STEP_TOL, which leaves an error
# of the order of its square. MAX_TAU_PASSES bounds adversarial rows.
TAU_STEP_TOL = 1e-6
MAX_TAU_PASSES = 24
TAU_STEP_TOL_C = tl.constexpr(TAU_STEP_TOL)
MAX_TAU_PASSES_C = tl.constexpr(MAX_TAU_PASSES)

# Slots per query row for the scores above the lower bound of tau that the threshold passes
# capture (attention_fwd._find_threshold), by alpha kind (`candidate_slots`).
CANDIDATE_SLOTS = 128
# The passes over the captured scores read them in chunks of CANDIDATE_CHUNK and sum each
# chunk's terms entry by entry (four [BLOCK_M, CANDIDATE_CHUNK] accumulators): chunks of 64
# spilled (sm_90, bf16, E 64: the threshold launch's stack 352 -> 616 bytes).
CANDIDATE_CHUNK = 32
CANDIDATE_CHUNK_C = tl.constexpr(CANDIDATE_CHUNK)
# The first threshold pass captures above a lower bound of tau that it raises from what it
# captured (attention_fwd._compact) between segments of COMPACT_SEGMENT listed tiles, when
# a row holds more than COMPACT_FILL of its slots or a segment overflowed them: COMPACT_STEPS
# evaluations over the captured scores (`_candidate_pass`) and their rewrite, at most
# COMPACT_MIN + (listed tiles) / COMPACT_TILES times per block (a compaction costs about as
# much as a few tiles; a block that needs more, as on flat scores, takes the passes over
# the tiles). COMPACT_FILL 3/4 rather than 1/2: alpha 1.5 2.0 instead of 3.5 compactions
# per block (the float32 emulation, tools/attention_passes.py --compact-fill, L 4096,
# N(0, 1) scores; the other figures in docs/performance.md, "Triton kernel decisions").
COMPACT_SEGMENT_C = tl.constexpr(8)
COMPACT_FILL = 0.75
COMPACT_FILL_C = tl.constexpr(COMPACT_FILL)
COMPACT_STEPS = tl.constexpr(2)
# The max pass also keeps each column's largest score over the tiles: a subset of every
# row (attention_fwd._subset_bound), whose threshold, found by SUBSET_STEPS evaluations
# over those BLOCK_N scores, is the lower bound the threshold passes start from instead
# of the bracket's lower end max - 1/(alpha - 1) (docs/attention.md, "A lower bound from
# the max pass").
SUBSET_STEPS_C = tl.constexpr(3)
COMPACT_MIN_C = tl.constexpr(2)
COMPACT_TILES_C = tl.constexpr(8)
# The general kind's blocks capture only where their rows are likely to fit their slots:
# where no open row has more than CAPTURE_MAX_COLUMN_SHARE of the max pass's column maxima
# (`_subset_bound`'s subset) above the lower bound that subset gave (a row with S scores
# above lo occupies about BLOCK_N (1 - exp(-S / BLOCK_N)) of the columns). A block whose
# rows do not fit pays the capture and then the passes over the tiles: every head
# capturing made alpha 1.25 1.30-1.38x slower (H100 and H200, bf16, L 4096, E 64, causal,
# commit 8716bcd). 15/16: in the float32 emulation blocks that overflowed had 57-64 of 64
# columns above lo (the emulation's table: docs/performance.md, "Triton kernel decisions").
CAPTURE_MAX_COLUMN_SHARE = 15 / 16
CAPTURE_MAX_COLUMN_SHARE_C = tl.constexpr(CAPTURE_MAX_COLUMN_SHARE)


def candidate_slots(alpha_kind):
    """CANDIDATES of the forward for `alpha_kind`: the slots per query row for the scores the
    threshold passes capture, 0 for no capture. When every open row of a block fits, the
    later passes run over the captured scores alone (attention_fwd._find_threshold): after
    the first threshold pass, which captures above a lower bound it raises as it goes
    (`_running_capture_pass`), or after the second pass over the tiles. The figures below
    are the second pass's, with no capture in the first pass.

    After the first pass, rows of N(0, 1) scores hold tens of scores above the lower bound
    (hundreds at alpha 1.25 or on flatter scores: those blocks keep the passes over the
    tiles). The capture made the forward 4 % faster at alpha 1.5 (H100 and H200, bf16,
    L 4096, E 64, causal, commit 8716bcd; the other figures in docs/performance.md,
    "Triton kernel decisions"). 128 slots take 512 bytes of scratch per query row for the
    duration of the forward call."""
    return CANDIDATE_SLOTS

# Row statistics stored per query row, stacked along the first dimension of `stats`.
STAT_MAX, STAT_TAU, STAT_SUM, STAT_ENTROPY = 0, 1, 2, 3
NUM_STATS = 4
STAT_MAX_C = tl.constexpr(STAT_MAX)
STAT_TAU_C = tl.constexpr(STAT_TAU)
STAT_SUM_C = tl.constexpr(STAT_SUM)
STAT_ENTROPY_C = tl.constexpr(STAT_ENTROPY)

# What one launch of the forward kernel does (`forward_phases`): everything (the max pass,
# the threshold passes and the output pass), or half of it in each of two launches. The
# threshold launch leaves the raw row maximum (NaN, +-inf included) and the tiles'
# threshold in the statistics and the tile flags behind, for the output launch.
PHASE_FUSED, PHASE_THRESHOLD, PHASE_OUTPUT = 0, 1, 2
PHASE_THRESHOLD_C = tl.constexpr(PHASE_THRESHOLD)
PHASE_OUTPUT_C = tl.constexpr(PHASE_OUTPUT)


# The interpreter's cost is per tile: one fixed, large tiling keeps interpreted runs fast
# (docs/checking.md); GPUs use the per-dtype table of `block_sizes`.
INTERPRETER_BLOCKS = (64, 32)


def block_sizes(block_e, dtype_key, dropout=False):
    """(BLOCK_M, BLOCK_N) for a padded head dimension and dtype.

    Shared by forward and backward: the tile flags written by the forward are read by the
    backward, so both tile the same way. fp16/bf16 use the 64x64 tiles measured fastest on
    an H200 (7x faster than the 32x32 tiles with 8 warps and a 255-register cap it
    replaces, same kernel); E = 256 halves BLOCK_N. fp32 runs its products as three
    TF32 products and takes narrower tiles: 64x32 up to E = 64, where 32x32 (chosen by
    spills) cost 1.7-3.3x the instructions per score at the same 255 registers (sm_90
    SASS, triton 3.6: forward passes ~89 -> ~27, dQ 167 -> 73, dK/dV 242 -> 138 at alpha
    1.5; sm_80 1.5-1.9x; commit 89cdb13; not timed), and 16x32 at
    E = 128, where wider tiles spill hundreds of bytes. Dropout's Philox state halves
    BLOCK_M. tools/tune_attention.py re-measures the choice on a GPU.
    """
    if dtype_key == "fp32":
        block_m, block_n = (64, 32) if block_e <= 64 else (16, 32)
    elif block_e <= 128:
        block_m, block_n = 64, 64
    else:
        block_m, block_n = 64, 32
    if dropout:
        block_m = max(16, block_m // 2)
    return block_m, block_n


# A CUDA grid holds at most this many programs along its second dimension (the first:
# 2^31 - 1).
MAX_GRID_BLOCKS = 65535


def launch_grid(n_blocks, n_heads):
    """The grid of an attention launch over `n_blocks` query (or key) blocks of each of
    `n_heads` (batch x heads) sequences: the heads along its first dimension, the blocks
    along its second.

    A GPU starts a grid's programs in the order of their linear index, the first dimension
    fastest. Heads first, one block index starts in every head before the next, and since
    the kernels number a head's blocks longest first (`query_block`; dK/dV's key blocks in
    ascending order), a causal launch ends on every head's shortest programs. Blocks first,
    the heads would start one after another and a launch would end on the last heads' long
    programs while SMs idle: in a list-scheduling
    model (tools/model_launch_order.py; a program's time its tile count, 132 SMs at each
    launch's programs per SM), 7-15 % over an even spread at L 4096 (B 4, H 16) and
    23-63 % at the Llama model's shapes (B 4, L 2048, 4 key/value heads), under 3 % heads
    first. A model of the tail's share, not a timing: a program alone on an SM runs
    faster, which shrinks the tail. The heads' dimension also holds every B x H a tensor
    can have, where 65535 was the limit along the second; the launcher refuses more than
    MAX_GRID_BLOCKS blocks."""
    return (n_heads, n_blocks)


def forward_phases(block_e, dtype_key, mask_kind=common.MASK_NONE):
    """The forward's launches, in order: (PHASE_FUSED,), one kernel for every pass, or
    (PHASE_THRESHOLD, PHASE_OUTPUT), the passes that find the threshold in one launch and
    the output pass in another. A kernel's registers are those of its hungriest pass: fused,
    the output pass's accumulators (two [BM, BEV] fp32 blocks with gradients) set the count
    the threshold passes run at (sm_90, bf16, E 64: 198 registers without gradients, 255
    with: two programs per SM), though those passes hold one score tile and a few row sums.
    Split, the threshold launch runs at 128 (`register_cap`): four programs per SM.

    Split with the cap, the forward without gradients took 3.06 ms against 3.33 fused (H100,
    bf16, L 4096, causal, commit cac942d); a masked one 4.81 against 6.02 (commit 4a08cac).
    Masked at E 128, fp32 and E 256 forwards are not timed split: they stay fused. The
    other figures: docs/performance.md, "Triton kernel decisions".
    """
    if dtype_key != "fp32" and (block_e <= 64 or (block_e <= 128 and mask_kind == common.MASK_NONE)):
        return (PHASE_THRESHOLD, PHASE_OUTPUT)
    return (PHASE_FUSED,)


# The table key (`launch_config`, `register_cap`) of each forward launch.
PHASE_KERNELS = {PHASE_FUSED: "fwd", PHASE_THRESHOLD: "fwd_threshold", PHASE_OUTPUT: "fwd_output"}


def register_cap(kernel, block_e, dtype_key, mask_kind=common.MASK_NONE,
                 need_grad=common.GRAD_NONE):
    """maxnreg of `kernel` (a `launch_config` name) compiled with `need_grad` (the output
    launch's accumulators depend on it), or None for none. A cap below what a kernel wants
    trades spills for programs per SM (65536 registers per SM over registers x threads per
    program). The threshold launch of the split forward: 128 (`forward_phases`; it spills
    4-8 bytes there, and ran faster than without the cap). General alpha spills 304 bytes
    at 128 and still ran 10 % faster than uncapped on an H200 (commit 9aba691: L 4096,
    E 64, causal, 4.84 against 5.37 ms).

    The other launches have no cap: none has been timed with one (`tools/tune_attention.py
    --caps` times them; the candidates' SASS counts are in docs/performance.md, "Triton
    kernel decisions")."""
    if kernel == "fwd_threshold":
        return 128
    return None


def launch_options(maxnreg):
    """The compile options of a launch with register cap `maxnreg` (`register_cap`), as
    keywords of the launch and as the AOT check's "options"."""
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def backward_launch(kernel, block_e, dtype_key):
    """The launch keywords of a backward kernel ("dq" or "dkdv": num_warps, num_stages and
    compile options) from `launch_config` and `register_cap`: what the launcher passes and
    the AOT check compiles."""
    num_warps, num_stages = launch_config(kernel, block_e, dtype_key)
    return {"num_warps": num_warps, "num_stages": num_stages,
            **launch_options(register_cap(kernel, block_e, dtype_key))}


class ForwardLaunch(NamedTuple):
    """One launch of the forward kernel: its PHASE, its table key, the NEED_GRAD it is
    compiled with, and its launch options."""
    phase: int
    kernel: str
    need_grad: int
    num_warps: int
    num_stages: int
    maxnreg: int | None


def forward_launches(block_e, dtype_key, mask_kind, need_grad):
    """The launches of a forward call that needs `need_grad` (common.GRAD_*), in order,
    from `forward_phases`, `launch_config` and `register_cap`. The launcher runs them and
    the AOT check compiles them. The threshold launch computes nothing the gradients need,
    so it is compiled without gradients whatever the call needs: one compile for all."""
    launches = []
    for phase in forward_phases(block_e, dtype_key, mask_kind):
        kernel = PHASE_KERNELS[phase]
        launch_grad = common.GRAD_NONE if phase == PHASE_THRESHOLD else need_grad
        num_warps, num_stages = launch_config(kernel, block_e, dtype_key, mask_kind)
        launches.append(ForwardLaunch(
            phase, kernel, launch_grad, num_warps, num_stages,
            register_cap(kernel, block_e, dtype_key, mask_kind, launch_grad)))
    return launches


def launch_config(kernel, block_e, dtype_key, mask_kind=common.MASK_NONE):
    """(num_warps, num_stages) of `kernel` ("fwd", "fwd_threshold", "fwd_output" (the
    `forward_phases` launches), "dq" or "dkdv").

    4 warps beat 8 in every kernel (a row's reductions would cross warps): the forward at
    E 64 took 3.55 ms with 4 warps and 3 stages against 7.0 with 8 (H100, bf16, L 4096,
    causal, tools/tune_attention.py, commit 9ece455). Not timed: a masked forward at E 128
    (8 warps, one launch), E 256 (8 warps; dK/dV keeps 1 stage, its 2-stage buffers reach
    A100's shared-memory limit), fp32 (2 stages; dK/dV above E 64 keeps 1, 2 add 40-70
    bytes of stack). The other figures: docs/performance.md, "Triton kernel decisions".
    """
    if kernel.startswith("fwd"):
        kernel = "fwd"
    if dtype_key == "fp32":
        return 4, (1 if kernel == "dkdv" and block_e > 64 else 2)
    if block_e <= 128:
        if kernel != "fwd":
            return 4, 2
        if mask_kind == common.MASK_NONE or block_e <= 64:
            return 4, 3
        return 8, 2
    return 8, (1 if kernel == "dkdv" else 2)


# Head-dim chunk (BLOCK_EC) of the q.k and dO.v products, per (kernel, dtype) and padded
# head dim; head dims not listed are not chunked. Chosen by compiling every configuration
# for sm_80/sm_90 (triton_kernels/aot.py): chunk only where the whole head dim leaves a
# stack frame, and no finer than needed, since each chunk reloads its operands from cache.
# This table holds for every architecture that `_ARCH_CHUNKS` does not name.
_CHUNKS = {
    ("fwd", "fp32"): {256: 32},
    ("dq", "fp32"): {32: 16, 64: 32, 128: 32, 256: 32},
    ("dq", "fp16"): {128: 64, 256: 64},
    ("dq", "bf16"): {128: 64, 256: 64},
    ("dkdv", "fp32"): {64: 32, 128: 32, 256: 32},
}
# The entries an architecture compiles otherwise, by sm number. sm_90's warpgroup products
# read both operands from shared memory, so dQ holds a whole 128-wide head dim without a
# stack frame there, where sm_80 spills 368 bytes; chunked, each chunk of a key tile
# reloads its operands and has barriers of its own (sm_90 SASS, triton 3.6, bf16, 4
# warps, 64x64 tiles, the listed-tile loop in instructions per score, chunked -> whole:
# alpha 1.5 21.0 -> 11.1, alpha 2 21.9 -> 12.1, general 26.0 -> 16.1, with d(alpha) 41.6 ->
# 24.9 and 360 -> 144 bytes of stack; barriers per tile 8 -> 2; 255 registers and two
# programs per SM either way, 32 -> 96 KiB of shared memory each; commit e917481). At
# E 256 the whole head dim spills on sm_90 too.
_ARCH_CHUNKS = {
    90: {("dq", "fp16"): {128: 128}, ("dq", "bf16"): {128: 128}},
}


def chunk_width(kernel, block_e, dtype_key, arch=None):
    """BLOCK_EC of `kernel` ("fwd", "dq" or "dkdv") compiled for sm_`arch` (80, 90, ...;
    None where no GPU's architecture applies, as in the interpreter): block_e itself when
    not chunked."""
    for table in (_ARCH_CHUNKS.get(arch, {}), _CHUNKS):
        widths = table.get((kernel, dtype_key), {})
        if block_e in widths:
            return widths[block_e]
    return block_e


def arch_chunks(kernel, block_e, dtype_key):
    """{arch: {"BLOCK_EC": width}} for the architectures whose chunk of `kernel` differs
    from `chunk_width`'s default: what an AOT configuration compiles for sm_<arch>
    (its "arch_constexprs", triton_kernels/aot.py)."""
    default = chunk_width(kernel, block_e, dtype_key)
    return {arch: {"BLOCK_EC": width} for arch in _ARCH_CHUNKS
            if (width := chunk_width(kernel, block_e, dtype_key, arch)) != default}


# Where the backward forms dQ (`backward_dq`): in a kernel of its own, one program per query
# block holding its dQ in registers (DQ_KERNEL), or in the dK/dV kernel, each key block
# adding its share dz k of every query tile it visits to an fp32 sum, in any order
# (DQ_ATOMIC: atomic adds, not deterministic) or in a fixed one (DQ_ORDERED: the key blocks
# of a query tile add in turn, waiting on a counter per query tile; docs/attention.md,
# "dQ in the dK/dV kernel").
DQ_KERNEL, DQ_ATOMIC, DQ_ORDERED = 0, 1, 2
DQ_KERNEL_C = tl.constexpr(DQ_KERNEL)
DQ_ATOMIC_C = tl.constexpr(DQ_ATOMIC)
DQ_ORDERED_C = tl.constexpr(DQ_ORDERED)
DQ_MODES = {"kernel": DQ_KERNEL, "atomic": DQ_ATOMIC, "ordered": DQ_ORDERED}
# A DQ_ORDERED key block waits at most this many polls of the counter (about 1 us each)
# for its turn, then adds anyway: the sum stays right (the adds are atomic), only its order
# is lost. A turn comes unless the GPU runs a program before one launched ahead of it.
DQ_MAX_POLLS_C = tl.constexpr(1 << 20)


def backward_dq(block_e, dtype_key, need_alpha_grad):
    """Where the backward forms dQ: DQ_KERNEL, DQ_ATOMIC or DQ_ORDERED.

    Fusing dQ into the dK/dV kernel spares the dQ kernel's two products (q.k and dO.v
    again) and its weights per score, for a [BLOCK_M, E] tile of fp32 atomic adds per
    visited tile. sm_90 SASS of the listed-tile loops (triton 3.6, bf16, E 64, alpha 1.5,
    64x64 tiles, 4 warps): dK/dV 14.0 + dQ 9.0 instructions per score against 17.7 fused
    with atomic adds, 17.0 ordered; 7 score-sized products against 5. Stacks: 168 bytes
    (dK/dV alone) against 264 / 104 at E 64, but 744 against 1024 (ordered) at E 128, 1640
    on sm_80. Not timed: DQ_KERNEL is the default (`tools/tune_attention.py --dq` times
    the modes). A learned alpha keeps the dQ kernel, which sums the rows'
    d(alpha) terms; so does `torch.use_deterministic_algorithms`, whatever the table says,
    for DQ_ATOMIC."""
    return DQ_KERNEL


@triton.jit
def sequence_bounds(cu_q_ptr, cu_k_ptr, i_b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q_start, q_len, k_start, k_len) of batch entry i_b: from the varlen offsets, or the
    whole padded sequence."""
    if IS_VARLEN:
        q_start = tl.load(cu_q_ptr + i_b).to(tl.int64)
        q_len = tl.load(cu_q_ptr + i_b + 1).to(tl.int32) - q_start.to(tl.int32)
        k_start = tl.load(cu_k_ptr + i_b).to(tl.int64)
        k_len = tl.load(cu_k_ptr + i_b + 1).to(tl.int32) - k_start.to(tl.int32)
    else:
        q_start = i_b * 0
        q_len = seqlen_q
        k_start = i_b * 0
        k_len = seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def program_sequence(pid_head, n_heads, kv_group, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k,
                     IS_VARLEN: tl.constexpr, KEY_BLOCKS: tl.constexpr):
    """The batch entry, heads and sequence bounds of an attention program, from its index
    pid_head along the grid's heads (`launch_grid`): the set-up every attention kernel
    opens with.

    A query-block program (the forward, dQ) works on one (batch entry, query head) pair,
    pid_head = i_b * n_heads + i_h; its keys and values are those of key/value head
    i_h // kv_group (GQA). A key-block program (dK/dV, KEY_BLOCKS) works on one (batch
    entry, key/value head) pair: n_heads counts key/value heads there, and i_h is the first
    query head of the group.

    Returns (i_b, i_h, i_hk, q_start, q_len, k_start, k_len), the bounds those of
    `sequence_bounds`. The kernels take their block's first row, return when it lies past
    the sequence, and only then form their row offsets and pointers. Formed here, before
    that return, those are live from the kernel's start and the register allocation of the
    launches that spill changes (sm_90 SASS, triton 3.6, bf16, E 64, tile loops: with the
    pointers the threshold launch's 1-12 instructions longer or shorter and dQ's varlen
    one by 1, with the row offsets too dK/dV's by 1-4); the block's first row formed here
    reorders the kernel's constants (the same counts in other registers)."""
    i_b = (pid_head // n_heads).to(tl.int64)
    if KEY_BLOCKS:
        i_hk = (pid_head % n_heads).to(tl.int64)
        i_h = i_hk * kv_group
    else:
        i_h = (pid_head % n_heads).to(tl.int64)
        i_hk = i_h // kv_group
    q_start, q_len, k_start, k_len = sequence_bounds(cu_q_ptr, cu_k_ptr, i_b, seqlen_q,
                                                     seqlen_k, IS_VARLEN)
    return i_b, i_h, i_hk, q_start, q_len, k_start, k_len


@triton.jit
def load_rows(p_base, stride, o_rows, n_rows, width, BLOCK_E: tl.constexpr,
              MASK_ROWS: tl.constexpr):
    """Rows o_rows (< n_rows) of a row-major [*, width] matrix, zero-padded to [., BLOCK_E].
    MASK_ROWS False: the caller knows every row is inside (a full tile, `full_tiles_end`),
    which saves a comparison and a select per loaded vector in the passes' loops (sm_90:
    0.6 instructions per score of a threshold pass)."""
    o_e = tl.arange(0, BLOCK_E)
    m_load = o_e[None, :] < width
    if MASK_ROWS:
        m_load = m_load & (o_rows[:, None] < n_rows)
    return tl.load(p_base + o_rows[:, None] * stride + o_e[None, :], mask=m_load, other=0.0)


@triton.jit
def held_rows(p_base, stride, o_rows, n_rows, width, BLOCK_E: tl.constexpr,
              BLOCK_EC: tl.constexpr, MASK_ROWS: tl.constexpr):
    """`load_rows` for an operand of `dot_rows`; nothing (0) when the head dim is
    processed in chunks (BLOCK_EC < BLOCK_E), where `dot_rows` reloads it chunk by chunk."""
    if BLOCK_EC >= BLOCK_E:
        b_rows = load_rows(p_base, stride, o_rows, n_rows, width, BLOCK_E, MASK_ROWS)
    else:
        b_rows = 0.0
    return b_rows


@triton.jit
def held_cols(p_base, stride, o_rows, n_rows, width, BLOCK_E: tl.constexpr,
              BLOCK_EC: tl.constexpr, MASK_ROWS: tl.constexpr):
    """The transpose [BLOCK_E, len(o_rows)] of `held_rows`, loaded as such: the right-hand
    operand of `dot_rows` (a transpose in registers would cost a layout conversion)."""
    if BLOCK_EC >= BLOCK_E:
        o_e = tl.arange(0, BLOCK_E)
        m_load = o_e[:, None] < width
        if MASK_ROWS:
            m_load = m_load & (o_rows[None, :] < n_rows)
        b_cols = tl.load(p_base + o_rows[None, :] * stride + o_e[:, None], mask=m_load,
                         other=0.0)
    else:
        b_cols = 0.0
    return b_cols


@triton.jit
def dot_rows(b_a, b_bt, p_a, stride_a, o_a, n_a, p_b, stride_b, o_b, n_b, width,
             BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr):
    """a_i . b_j over the first `width` columns, for rows o_a of A and rows o_b of B (both
    row-major with unit column stride): [len(o_a), len(o_b)] fp32.

    Whole head dim (BLOCK_EC >= BLOCK_E): from the held blocks b_a [., BE] (`held_rows`)
    and b_bt [BE, .] (`held_cols`). Chunked: both operands are reloaded BLOCK_EC columns at
    a time (from cache). A tensor-core operand A is replicated across the warps that share its rows, so a
    [16, 256] fp32 block alone fills 128 registers per thread (more with tf32x3's split):
    chunks keep the wide-head kernels within 255 registers without spilling.
    """
    if BLOCK_EC >= BLOCK_E:
        b_c = dot(b_a, b_bt)
    else:
        b_c = tl.zeros([o_a.shape[0], o_b.shape[0]], dtype=tl.float32)
        for e0 in tl.range(0, width, BLOCK_EC, loop_unroll_factor=1):
            o_e = e0 + tl.arange(0, BLOCK_EC)
            m_e = o_e < width
            b_ac = tl.load(p_a + o_a[:, None] * stride_a + o_e[None, :],
                           mask=(o_a[:, None] < n_a) & m_e[None, :], other=0.0)
            b_bc = tl.load(p_b + o_b[None, :] * stride_b + o_e[:, None],
                           mask=(o_b[None, :] < n_b) & m_e[:, None], other=0.0)
            b_c += dot(b_ac, b_bc)
    return b_c


# Score options a kernel is compiled with (its OPTIONS, a sum of these; docs/attention.md,
# "Score options"): each adds its per-score work only where set, so that a kernel compiled
# without them is the kernel without options.
SCORE_WINDOW, SCORE_SOFTCAP, SCORE_ALIBI, SCORE_SINK = (common.SCORE_WINDOW, common.SCORE_SOFTCAP,
                                                    common.SCORE_ALIBI, common.SCORE_SINK)
SCORE_WINDOW_C = tl.constexpr(SCORE_WINDOW)
SCORE_SOFTCAP_C = tl.constexpr(SCORE_SOFTCAP)
SCORE_ALIBI_C = tl.constexpr(SCORE_ALIBI)
# The sink is no score of a tile: one more entry per row, with a zero value, that the
# kernels add to each row's sums (`sink_logit`), never per score.
SCORE_SINK_C = tl.constexpr(SCORE_SINK)
# An unbounded side of the window, past every key position (`window_bounds`).
WINDOW_UNBOUNDED_C = tl.constexpr(1 << 30)


@triton.jit
def softcap_tanh(b_x):
    """(tanh x, 1 / cosh^2 x) from one exp2 of -2|x|: with e = e^(-2|x|) in (0, 1],
    tanh |x| = (1 - e) / (1 + e) and 1 / cosh^2 x = 4 e / (1 + e)^2, which overflow at
    neither end and keep the derivative's relative accuracy where tanh rounds to +-1 (where
    1 - tanh^2 would round to 0: docs/attention.md, "Score options"). Near 0, tanh's error
    is absolute, about 1e-7 (1 - e cancels), times the softcap. (libdevice's tanh is not one
    call on every triton this runs on.)"""
    b_e = tl.exp2(tl.abs(b_x) * -2.8853900817779268)
    b_r = 1.0 / (1.0 + b_e)
    b_t = (1.0 - b_e) * b_r
    return tl.where(b_x < 0, -b_t, b_t), 4.0 * b_e * b_r * b_r


@triton.jit
def shifted_scores(b_q, b_kt, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base,
                   stride_mq, stride_mk, o_m, start_n, q_len, k_len, head_e, scale, b_shift,
                   is_causal, pos_shift, win_left, win_right, softcap, slope,
                   BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                   MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, BOUNDARY: tl.constexpr):
    """Scores z of one tile minus the per-row shift b_shift [BM], -inf where masked, and the
    cap's derivative 1 / cosh^2(s / softcap) at the scaled scores s = scale * q k^T where
    OPTIONS caps them (1.0 otherwise), the backward's chain rule through the cap. [BM, BN]

    z is s, capped (softcap tanh(s / softcap)), less ALiBi's slope |pos - j| (the query
    row i at key position pos = i + pos_shift), plus an additive mask (docs/attention.md,
    "Score options"). Without those options the shift comes off after z is formed, in the
    same fused multiply-add where there is no additive mask: scores near 1e30 keep their
    differences. From the held blocks b_q (`held_rows`) and b_kt (`held_cols`), or from
    chunks that `dot_rows` reloads. BOUNDARY: the tile crosses the end of the keys, the
    causal diagonal or an edge of the window (pos - win_left <= j <= pos + win_right) and
    needs their masks; tiles inside all of them skip that per-score work.
    """
    o_n = start_n + tl.arange(0, BLOCK_N)
    b_qk = dot_rows(b_q, b_kt, p_q_base, stride_ql, o_m, q_len, p_k_base, stride_kl, o_n,
                    k_len, head_e, BLOCK_E, BLOCK_EC)
    # rows past q_len are never stored, but a mask row past the end must not be read
    m_load = o_m[:, None] < q_len
    if BOUNDARY:
        m_load = m_load & (o_n[None, :] < k_len)
    b_cap_slope = 1.0
    if ((SCORE_SOFTCAP_C | SCORE_ALIBI_C) & OPTIONS) != 0:
        b_s = b_qk * scale
        if (SCORE_SOFTCAP_C & OPTIONS) != 0:
            b_tanh, b_cap_slope = softcap_tanh(b_s * (1.0 / softcap))
            b_s = softcap * b_tanh
        if (SCORE_ALIBI_C & OPTIONS) != 0:
            b_dist = tl.abs((o_m + pos_shift)[:, None] - o_n[None, :]).to(tl.float32)
            b_s = b_s - slope * b_dist
        if MASK_KIND == MASK_ADDITIVE:
            b_s += tl.load(p_mask_base + o_m[:, None] * stride_mq + o_n[None, :] * stride_mk,
                           mask=m_load, other=0.0).to(tl.float32)
        b_z = b_s - b_shift[:, None]
    elif MASK_KIND == MASK_ADDITIVE:
        b_add = tl.load(p_mask_base + o_m[:, None] * stride_mq + o_n[None, :] * stride_mk,
                        mask=m_load, other=0.0).to(tl.float32)
        b_z = tl.fma(b_qk, scale, b_add) - b_shift[:, None]
    else:
        b_z = tl.fma(b_qk, scale, -b_shift[:, None])
    if MASK_KIND == MASK_BOOL:
        b_keep = tl.load(p_mask_base + o_m[:, None] * stride_mq + o_n[None, :] * stride_mk,
                         mask=m_load, other=0)
        b_z = tl.where(b_keep != 0, b_z, float("-inf"))
    if BOUNDARY:
        # top-left aligned causal mask: query i sees keys j <= i (without is_causal the
        # limit lies past every key; integer arithmetic because the interpreter cannot load
        # under a mask built from a scalar boolean)
        m_valid = (o_n[None, :] < k_len) & (
            o_n[None, :] <= (o_m + (1 - is_causal) * k_len)[:, None])
        if (SCORE_WINDOW_C & OPTIONS) != 0:
            o_pos = o_m + pos_shift
            m_valid = m_valid & (o_n[None, :] >= (o_pos - win_left)[:, None]) & (
                o_n[None, :] <= (o_pos + win_right)[:, None])
        b_z = tl.where(m_valid, b_z, float("-inf"))
    return b_z, b_cap_slope


@triton.jit
def query_block(pid, n_qblocks):
    """The query block a program handles, from its index along the grid's blocks
    (`launch_grid`): the last first. On a causal pattern, the flag's or a mask's (a padded
    batch's causal mask comes as a bool mask), the last blocks see the most keys: launched
    first, in every head before any shorter block, they keep the grid from ending on a few
    long programs (tools/model_launch_order.py). Where every block sees the same keys the
    order costs nothing."""
    return n_qblocks - 1 - pid


@triton.jit
def full_tiles_end(start_m, k_len, is_causal, BLOCK_N: tl.constexpr):
    """End of the key tiles that need neither the key-end nor the causal mask for the query
    block starting at start_m: tile [n, n + BN) is inside when n + BN <= k_len and, causal,
    n + BN <= start_m + 1 (its last key is visible to the block's first query)."""
    n_end = k_len
    if is_causal != 0:
        n_end = tl.minimum(n_end, start_m + 1)
    return (n_end // BLOCK_N) * BLOCK_N



@triton.jit
def score_option_values(i_b, i_h, q_len, k_len, window_left, window_right, alibi_ptr,
                        stride_alibi_b, stride_alibi_h, OPTIONS: tl.constexpr):
    """What `shifted_scores` takes for the score options of sequence i_b, head i_h:
    (pos_shift, win_left, win_right, slope). Query row i sits at key position
    i + pos_shift, pos_shift = k_len - q_len (bottom-right, FlashAttention's alignment);
    the window's bounds are `window_bounds`'; the ALiBi slope is the head's, of the batch
    entry or sequence when the slopes are (B, H) (stride_alibi_b 0 for (H,))."""
    pos_shift = 0
    win_left = 0
    win_right = 0
    slope = 0.0
    if ((SCORE_WINDOW_C | SCORE_ALIBI_C) & OPTIONS) != 0:
        pos_shift = k_len - q_len
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        win_left, win_right = window_bounds(window_left, window_right)
    if (SCORE_ALIBI_C & OPTIONS) != 0:
        slope = tl.load(alibi_ptr + i_b * stride_alibi_b + i_h * stride_alibi_h).to(tl.float32)
    return pos_shift, win_left, win_right, slope


@triton.jit
def sink_logit(sinks_ptr, i_h, OPTIONS: tl.constexpr):
    """Head i_h's sink logit (z units: not scaled, capped or shifted by ALiBi), 0.0 when
    OPTIONS has no sink (then no kernel reads it)."""
    sink = 0.0
    if (SCORE_SINK_C & OPTIONS) != 0:
        sink = tl.load(sinks_ptr + i_h).to(tl.float32)
    return sink


@triton.jit
def window_bounds(window_left, window_right):
    """The window's bounds (left, right) as the kernels take them: an unbounded side (-1)
    as WINDOW_UNBOUNDED, past every key position, so that one comparison per side masks
    (`shifted_scores`) and one formula bounds the tiles (`window_key_tiles`)."""
    win_left = tl.where(window_left < 0, WINDOW_UNBOUNDED_C, window_left)
    win_right = tl.where(window_right < 0, WINDOW_UNBOUNDED_C, window_right)
    return win_left, win_right


@triton.jit
def window_key_tiles(start_m, kv_end, n_full, pos_shift, win_left, win_right,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tiles of the query block at start_m under a window: (kv_begin, full_begin,
    n_full, kv_end), kv_begin <= full_begin <= n_full, from the bounds of the other masks
    (kv_end; n_full, `full_tiles_end`). The block's rows sit at key positions first_pos
    to first_pos + BM - 1 and see keys pos - win_left to pos + win_right: the tiles before
    kv_begin and from kv_end on hold none of them and no pass visits them, so a pass
    costs O(BM x window); [kv_begin, full_begin) and [n_full, kv_end) cross an edge of the
    window (or another mask's) and take the masks (BOUNDARY); [full_begin, n_full) lie
    inside every row's window. The integer divisions see no negative operand (they
    truncate)."""
    first_pos = start_m + pos_shift
    last_pos = first_pos + (BLOCK_M - 1)
    kv_begin = (tl.maximum(first_pos - win_left, 0) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(kv_end, last_pos + win_right + 1)
    begin_inside = tl.cdiv(tl.maximum(last_pos - win_left, 0), BLOCK_N) * BLOCK_N
    end_inside = tl.minimum(n_full, (tl.maximum(first_pos + win_right + 1, 0) // BLOCK_N) * BLOCK_N)
    # no tile inside: [kv_begin, end_inside) and [end_inside, kv_end) take the masks
    full_begin = tl.minimum(begin_inside, tl.maximum(end_inside, kv_begin))
    return kv_begin, full_begin, tl.maximum(end_inside, full_begin), kv_end


@triton.jit
def query_block_key_tiles(i_b, i_h, start_m, q_len, k_len, is_causal, window_left, window_right,
                          alibi_ptr, stride_alibi_b, stride_alibi_h, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, OPTIONS: tl.constexpr):
    """The key tiles the query block at start_m visits when it recomputes its weights from
    the forward's statistics (dQ, the support count), with the score options' values:
    (kv_begin, full_begin, n_full, kv_end, pos_shift, win_left, win_right, slope).
    [full_begin, n_full) need no mask; [n_full, kv_end) cross the key end, the causal
    diagonal or the window's trailing edge and [kv_begin, full_begin) its leading edge
    (`full_tiles_end`, `window_key_tiles`, `score_option_values`)."""
    kv_end = k_len
    if is_causal != 0:
        kv_end = tl.minimum(k_len, start_m + BLOCK_M)
    n_full = full_tiles_end(start_m, k_len, is_causal, BLOCK_N)
    pos_shift, win_left, win_right, slope = score_option_values(
        i_b, i_h, q_len, k_len, window_left, window_right, alibi_ptr, stride_alibi_b,
        stride_alibi_h, OPTIONS)
    kv_begin = 0
    full_begin = 0
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        kv_begin, full_begin, n_full, kv_end = window_key_tiles(
            start_m, kv_end, n_full, pos_shift, win_left, win_right, BLOCK_M, BLOCK_N)
    return kv_begin, full_begin, n_full, kv_end, pos_shift, win_left, win_right, slope


@triton.jit
def window_query_tiles(start_n, q_len, m_begin, m_full, pos_shift, win_left, win_right,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`window_key_tiles` for the key block at start_n (dK/dV): the query rows it visits
    under a window, (m_begin, m_full, m_full_end, m_end) with [m_begin, min(m_full, m_end))
    and [m_full_end, m_end) crossing an edge (the masked tiles) and [m_full, m_full_end)
    inside every row's window, from the bounds of the other masks (m_begin, m_full). Query
    row i (at key position i + pos_shift) sees a key j of the block when
    j - win_right <= i + pos_shift <= j + win_left."""
    m_begin = tl.maximum(m_begin, (tl.maximum(start_n - pos_shift - win_right, 0) // BLOCK_M)
                         * BLOCK_M)
    m_end = tl.minimum(q_len, tl.maximum(start_n + BLOCK_N - pos_shift + win_left, 0))
    begin_inside = tl.maximum(m_full, tl.cdiv(
        tl.maximum(start_n + (BLOCK_N - 1) - pos_shift - win_right, 0), BLOCK_M) * BLOCK_M)
    end_inside = tl.minimum((q_len // BLOCK_M) * BLOCK_M, (tl.maximum(
        start_n - pos_shift + win_left + 1, 0) // BLOCK_M) * BLOCK_M)
    m_full = tl.minimum(begin_inside, tl.maximum(end_inside, m_begin))
    return m_begin, m_full, tl.maximum(end_inside, m_full), m_end

# Flags compacted per call of `listed_tiles`: one vector of this many at a time.
LIST_CHUNK = tl.constexpr(128)


@triton.jit
def listed_tiles(p_flags, stride_flag, first, end, p_list):
    """Writes the indices first <= i < end whose flag p_flags[i * stride_flag] is set to
    p_list[0:count], in increasing order, and returns count.

    A loop that skips unflagged tiles inside an `if` is not software-pipelined (Triton
    overlaps only the loads at a loop's top level with earlier iterations' work), so each
    tile then waits for its own loads. A loop over this list loads every tile it visits
    unconditionally and is pipelined. Several threads write the list: the caller puts a
    barrier between writing and reading it, and between reading it and writing it again.
    """
    count = first * 0
    for start in range(first, end, LIST_CHUNK):
        o_i = start + tl.arange(0, LIST_CHUNK)
        b_set = (tl.load(p_flags + o_i * stride_flag, mask=o_i < end, other=0) != 0).to(tl.int32)
        b_pos = count + tl.cumsum(b_set, 0) - b_set
        tl.store(p_list + b_pos, o_i, mask=b_set != 0)
        count += tl.sum(b_set, 0)
    return count


@triton.jit
def dot(b_a, b_b):
    """Tensor-core matmul with fp32 accumulation; fp32 operands use three TF32 products
    (about fp32 accuracy) instead of the register-hungry FMA path of "ieee"."""
    if b_a.dtype == tl.float32:
        b_c = tl.dot(b_a, b_b, input_precision="tf32x3")
    else:
        b_c = tl.dot(b_a, b_b)
    return b_c


@triton.jit
def gap(b_u, b_thr, inv_am1, ALPHA_KIND: tl.constexpr):
    """Distance of the shifted scores b_u (z units, [BM, BN]) to the row threshold b_thr [BM]
    (`_threshold_in_z`). alpha 2 and 1.5: d = [u - tau_z]_+ in z units. General alpha: w =
    (alpha - 1) u - c with c = tau + 1 (u units), so that the base of the powers is 1 + w:
    for alpha near 1, w is small and known to float precision where 1 + w is not. A head
    above 2 (ALPHA_ABOVE_TWO) takes d as alpha 2 and 1.5 do; softmax (ALPHA_SOFTMAX, a head
    at alpha 1) u - thr, the log of its weight (z units; "A per-head alpha" below)."""
    if ALPHA_KIND == ALPHA_GENERAL:
        b_g = b_u * (1.0 / inv_am1) - b_thr[:, None]
    elif ALPHA_KIND == ALPHA_SOFTMAX:
        b_g = b_u - b_thr[:, None]
    else:
        b_g = tl.maximum(b_u - b_thr[:, None], 0.0)
    return b_g


# Heads with 1/(alpha - 1) above this (alpha < 1.25) take `log2_base`'s log1p form.
NEAR_ONE_INV_AM1 = tl.constexpr(4.0)


# A per-head alpha (the general kind) may hold 1 (softmax) and values above 2. The general
# kind's kernels are launched twice (`head_launches`): HEADS_IN_RANGE, the kernels as they
# are for alpha in (1, 2], whose programs of the other heads return at once, and
# HEADS_OUTSIDE, compiled apart, whose programs of heads in (1, 2] return at once. dK/dV's
# program sums a group of query heads: its HEADS_IN_RANGE launch is the kernel as it was
# (an early return cost its dQ-share loop 140 instructions, sm_90, bf16, E 64) and runs
# every group, and HEADS_OUTSIDE runs the groups holding a head at 1 or above 2 again, all
# their heads, replacing their dK and dV (the launcher drops their dQ shares). Compiled
# into the same kernel (commit b972e37), the other heads' code cost the heads in (1, 2]
# registers and spills in their loops (sm_90, bf16, E 64: dK/dV's stack 264 -> 592 bytes,
# its listed-tile loop 68.9 -> 77.1 instructions per score). HEADS_OUTSIDE branches on its
# program's head once, outside its loops, and runs that head's passes compiled with an
# ALPHA_KIND of their own:
# - alpha = 1 (`am1 == 0`), ALPHA_SOFTMAX: no threshold (1/(alpha - 1) is infinite); the
#   weights are exp(u), u = z - max, and their sensitivities the weights themselves.
# - alpha > 2, ALPHA_ABOVE_TWO: p = (am1 d)^e with d = [u - tau]_+ in z units (the
#   closed forms' gap) and e = 1/(alpha - 1) < 1, whose slope is infinite at d = 0. The
#   general kind's base 1 + (am1 u - c) rounds at 1 (steps of 6e-8, which move such a
#   weight by up to (6e-8)^e: 4e-3 at alpha 4). The forward (`attention_fwd._above_two_
#   threshold`) stores the shift m + tau (rounded) and the small rest of tau instead of m
#   and tau, so that every kernel forms d near 0 with the precision of the scores.


HEADS_ALL, HEADS_IN_RANGE, HEADS_OUTSIDE = 0, 1, 2
HEADS_ALL_C = tl.constexpr(HEADS_ALL)
HEADS_IN_RANGE_C = tl.constexpr(HEADS_IN_RANGE)
HEADS_OUTSIDE_C = tl.constexpr(HEADS_OUTSIDE)


def head_launches(alpha_kind):
    """The HEADS of each launch of an attention kernel compiled for `alpha_kind`, in order
    ("A per-head alpha" above): one launch for alpha 1.5 and 2, two for the general kind."""
    if alpha_kind == common.ALPHA_GENERAL:
        return (HEADS_IN_RANGE, HEADS_OUTSIDE)
    return (HEADS_ALL,)


def head_suffix(heads):
    """The token an AOT configuration's name takes for its HEADS: none for the launch that
    runs the heads in (1, 2] (the kernels as they were), "_outside" for the other."""
    return "_outside" if heads == HEADS_OUTSIDE else ""


@triton.jit
def log2_base(b_g, inv_am1, ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr = None):
    """log2 of the base of the powers p = base^e and s = base^(e-1) from a `gap`; off the
    support 0 for alpha 2 and 1.5 and unspecified (NaN, -inf) for general alpha: callers
    select on the support (g > -1) after it. alpha 2 and 1.5: the base is d (the constant
    factor of z units cancels in the normalised weights). General: 1 + w. Near alpha = 1
    (e = 1/(alpha - 1) > 4; one alpha per head, so the branch is uniform in a program)
    through log1p with the rounding of 1 + w compensated, so that e log(base) stays
    accurate; elsewhere by the hardware's approximation (`support.log2_approx`: p's
    relative error below e 2^-22 ln 2 < 1e-6), which spares libdevice's log2 polynomial and
    a division per score (sm_90, bf16, E 64: a later threshold pass 57-60 -> 18-19
    instructions per score). No select before the branch: a predicate per score live across
    it was kept as a bit of a register, set and cleared around it (about 3.4 instructions
    per score in the threshold pass). NEAR_ONE True or False takes one side at compile time:
    callers that branch on the head's alpha once, outside their loops, compile a loop without
    the other side, whose registers it no longer holds (`attention_fwd._find_threshold`)."""
    if ALPHA_KIND == ALPHA_ABOVE_TWO:
        b_log2 = tl.log2(tl.where(b_g > 0, b_g * (1.0 / inv_am1), 1.0))
    elif ALPHA_KIND == ALPHA_GENERAL:
        b_base = 1.0 + b_g
        near_one = NEAR_ONE
        if NEAR_ONE is None:
            near_one = inv_am1 > NEAR_ONE_INV_AM1
        if near_one:
            b_log2 = tl.log2(b_base) - ((b_base - 1.0) - b_g) / b_base * 1.4426950408889634
        else:
            b_log2 = log2_approx(b_base)
    else:
        b_log2 = tl.log2(tl.where(b_g > 0, b_g, 1.0))
    return b_log2


@triton.jit
def weights(b_g, inv_am1, ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr = None):
    """Unnormalised weights p = base^(1/(alpha-1)) from a `gap`; softmax's exp(g)."""
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        b_p = b_g
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        b_p = b_g * b_g
    elif ALPHA_KIND == ALPHA_SOFTMAX:
        b_p = tl.exp2(b_g * 1.4426950408889634)
    elif ALPHA_KIND == ALPHA_ABOVE_TWO:
        b_p = tl.where(b_g > 0, tl.exp2(inv_am1 * log2_base(b_g, inv_am1, ALPHA_KIND)), 0.0)
    else:
        b_p = tl.where(b_g > -1.0,
                       tl.exp2(inv_am1 * log2_base(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)), 0.0)
    return b_p


@triton.jit
def sensitivity(b_g, inv_am1, ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr = None):
    """dp/dbase = base^(1/(alpha-1) - 1), i.e. p^(2-alpha) before row normalisation (softmax:
    p itself)."""
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        b_s = tl.where(b_g > 0, 1.0, 0.0)
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        b_s = b_g
    elif ALPHA_KIND == ALPHA_SOFTMAX:
        b_s = weights(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
    elif ALPHA_KIND == ALPHA_ABOVE_TWO:
        b_s = tl.where(b_g > 0,
                       tl.exp2((inv_am1 - 1.0) * log2_base(b_g, inv_am1, ALPHA_KIND)), 0.0)
    else:
        b_s = tl.where(b_g > -1.0,
                       tl.exp2((inv_am1 - 1.0) * log2_base(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)),
                       0.0)
    return b_s


@triton.jit
def weights_and_sensitivity(b_g, inv_am1, ALPHA_KIND: tl.constexpr,
                            NEAR_ONE: tl.constexpr = None):
    """(`weights`, `sensitivity`) of one `gap`. General alpha takes p = s * base: a multiply
    instead of a second exp2, which runs on the special-function unit (16 results per clock
    per SM against 128 multiply-adds), and the base's rounding is not amplified by
    1/(alpha - 1) as an error of its log would be. Off the support s is 0 and the base,
    clamped at 0 (masked scores' -inf; a NaN gap, whose s is 0, gives 0 as tl.maximum
    ignores NaN), keeps p at 0."""
    b_s = sensitivity(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
    if ALPHA_KIND == ALPHA_SOFTMAX:
        b_p = b_s
    elif ALPHA_KIND == ALPHA_ABOVE_TWO:
        b_p = b_s * (b_g * (1.0 / inv_am1))
    elif ALPHA_KIND == ALPHA_GENERAL:
        b_p = b_s * tl.maximum(1.0 + b_g, 0.0)
    else:
        b_p = weights(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
    return b_p, b_s


@triton.jit
def dropout_scale(seed, pid_bh, o_m, o_n, seqlen_q, seqlen_k, dropout_p,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """Per-weight factor 0 (dropped) or 1/(1-p) (kept); 1 without dropout. [BM, BN]

    The Philox offset is the weight's global index, so the backward regenerates the mask.
    A compile-time switch: Philox's state costs registers that kernels without dropout
    should not pay for.
    """
    b_drop = tl.full([BLOCK_M, BLOCK_N], 1.0, dtype=tl.float32)
    if HAS_DROPOUT:
        o_rand = (pid_bh.to(tl.int64) * seqlen_q + o_m[:, None]) * seqlen_k + o_n[None, :]
        b_drop = tl.where(tl.rand(seed, o_rand) >= dropout_p, 1.0 / (1.0 - dropout_p), 0.0)
    return b_drop


# ------------------------------------------------------------------------------ AOT

BLOCK_ES = (16, 32, 64, 128, 256)
ALPHA_KINDS = (common.ALPHA_GENERAL, common.ALPHA_ENTMAX15, common.ALPHA_SPARSEMAX)
MASK_KINDS = (common.MASK_NONE, common.MASK_BOOL, common.MASK_ADDITIVE)
# The pointer parameters of the three kernels; mask_ptr's type depends on the mask kind
# (`attention_signature`).
POINTER_TYPES = {"q_ptr": TENSOR, "k_ptr": TENSOR, "v_ptr": TENSOR, "o_ptr": TENSOR,
                 "do_ptr": TENSOR, "dq_ptr": TENSOR, "dk_ptr": TENSOR, "dv_ptr": TENSOR,
                 "dvec_ptr": "*fp32", "stats_ptr": "*fp32", "rows_ptr": "*fp32",
                 "flags_ptr": "*i8", "tiles_ptr": "*i32", "cand_ptr": "*fp32",
                 "alpha_ptr": "*fp32", "seed_ptr": "*i64",
                 "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
                 "dqacc_ptr": "*fp32", "locks_ptr": "*i32", "turns_ptr": "*i32",
                 "alibi_ptr": "*fp32", "sinks_ptr": "*fp32"}
FLOAT_PARAMETERS = ("scale", "dropout_p", "softcap")


def mask_pointer_type(dtype_key, mask_kind):
    """Additive masks have the query's dtype (SDPA's rule); boolean ones are read as int8."""
    if mask_kind == common.MASK_ADDITIVE:
        return pointer_type(dtype_key)
    return "*i8"


def mask_specialisation(mask_kind):
    """Integer parameters the JIT turns into constants for the usual attn_mask: {name: 1}.

    The JIT compiles an integer argument equal to 1 as the constant 1. A mask laid out
    with the keys last (any mask `_mask_args` expands from a (..., Lq, Lk) or (..., 1, Lk)
    tensor) has stride_mk == 1, so that is the kernel that runs: its mask loads are
    contiguous and vectorised. Compiled with a variable stride instead, the masked forward
    loaded one byte per score with 64-bit address arithmetic and spilled (sm_90, bf16, E 64,
    4 warps: a 576-byte stack frame against 24), which is what the AOT table showed."""
    return {"stride_mk": 1} if mask_kind != common.MASK_NONE else {}


def attention_signature(fn, dtype_key, mask_kind):
    """The AOT signature of one of the attention kernels (triton_kernels/signature.py), with
    the `mask_specialisation` parameters as constexprs (the AOT configurations add their
    values). Read once per kernel, dtype and mask kind: the configurations (thousands, one
    per combination of the score options too) share it."""
    return dict(_attention_signature(fn, dtype_key, mask_kind))


@functools.lru_cache(maxsize=None)
def _attention_signature(fn, dtype_key, mask_kind):
    pointers = dict(POINTER_TYPES, mask_ptr=mask_pointer_type(dtype_key, mask_kind))
    signature = kernel_signature(fn, dtype_key, pointers, floats=FLOAT_PARAMETERS)
    for name in mask_specialisation(mask_kind):
        signature[name] = "constexpr"
    return tuple(signature.items())


# The OPTIONS values (sums of SCORE_*) the launchers can choose: every combination.
SCORE_OPTION_SETS = tuple(range(SCORE_WINDOW + SCORE_SOFTCAP + SCORE_ALIBI + SCORE_SINK + 1))
# Each option's token in a configuration's name (`config_suffix`): one per option, so that
# the AOT check's covering sample covers each option as a value of its own.
SCORE_OPTION_TOKENS = ((SCORE_WINDOW, "win"), (SCORE_SOFTCAP, "cap"), (SCORE_ALIBI, "alibi"),
                      (SCORE_SINK, "sink"))


def config_space():
    """(dtype, BLOCK_E, ALPHA_KIND, MASK_KIND, varlen, dropout, OPTIONS) the launchers can
    choose; the packed varlen form takes no attn_mask."""
    for (dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout,
         options) in itertools.product(DTYPE_KEYS.values(), BLOCK_ES, ALPHA_KINDS, MASK_KINDS,
                                       (False, True), (False, True), SCORE_OPTION_SETS):
        if not (varlen and mask_kind != common.MASK_NONE):
            yield dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout, options


def config_suffix(dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout, options):
    return (f"{dtype_key}_e{block_e}_a{alpha_kind}_m{mask_kind}{'_varlen' if varlen else ''}"
            f"{'_dropout' if dropout else ''}"
            + "".join(f"_{token}" for bit, token in SCORE_OPTION_TOKENS if options & bit))
