"""Host side of the fused entmax attention: the Triton backend of the ops ``attention``,
``attention_varlen`` and ``attention_support`` (kernels: triton_kernels/attention_fwd.py,
attention_bwd.py, attention_support.py).

Layers (top to bottom):
- `attention_forward` / `attention_backward` and `attention_varlen_forward` /
  `attention_varlen_backward`: the backend contract (entmax_fast/backends/__init__.py).
  They hold no autograd: the public layer's torch.autograd.Function calls them;
- ``torch.ops.entmax_fast.triton_attention_fwd/_bwd``: custom ops with fake
  implementations, so that torch.compile traces them as opaque ops;
- `_launch_forward`, `_launch_backward`, `_launch_support`: the kernel launchers
  (allocation, grid).

Causal masks are top-left aligned, as drawn in entmax_fast/attention.py. A row whose keys
are all masked gets zero output and zero gradients.
"""
import itertools
from typing import Optional

import torch
from torch import Tensor

from ... import common
from ..._validation import ScoreOptions
from ...triton_kernels import attention_bwd, attention_common, attention_fwd, attention_support
from ...triton_kernels.signature import DTYPE_KEYS
from . import _capability, interpreting

__all__ = ["attention_forward", "attention_backward", "attention_varlen_forward",
           "attention_varlen_backward", "attention_support_forward"]


def _block_e(dim):
    # plain integer arithmetic: triton.next_power_of_2 and triton.cdiv are
    # ConstexprFunctions, several µs per call on the host
    return max(16, 1 << max(0, dim - 1).bit_length())


def _cdiv(a, b):
    return -(-a // b)


def _arch(device):
    """The sm number the kernels compile for on `device` (90 for compute capability 9.0),
    None for the interpreter's CPU tensors."""
    if device.type != "cuda":
        return None
    major, minor = _capability(device)
    return 10 * major + minor


# (device, dtype) -> a one-element tensor for the pointer arguments a launch does not read
# (the mask without a mask, cu_seqlens without varlen, dQ's sum with the dQ kernel): its
# contents never matter, so one per device serves every call, on any stream, instead of an
# allocation and a fill launch per argument and call.
_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def _placeholder(device, dtype):
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # allocated by the graph's pool, it would not outlive the graph: the call's own
        return torch.empty(1, dtype=dtype, device=device)
    key = (device, dtype)
    placeholder = _PLACEHOLDERS.get(key)
    if placeholder is None:
        placeholder = _PLACEHOLDERS[key] = torch.empty(1, dtype=dtype, device=device)
    return placeholder


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class _Geometry:
    """Shapes, strides and block sizes shared by the forward and backward launchers."""

    def __init__(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout):
        self.varlen = cu_q is not None
        if self.varlen:
            # (total_tokens, H, E): no batch stride, sequences start at cu_seqlens[b]
            self.batch = cu_q.shape[0] - 1
            self.n_heads, self.n_kv_heads = q.shape[1], k.shape[1]
            self.seqlen_q, self.seqlen_k = max_q, max_k
        else:
            self.batch, self.n_heads, self.seqlen_q = q.shape[0], q.shape[1], q.shape[2]
            self.n_kv_heads, self.seqlen_k = k.shape[1], k.shape[2]
        self.q_strides, self.k_strides, self.v_strides = (self.token_strides(t) for t in (q, k, v))
        self.head_e, self.head_ev = q.shape[-1], v.shape[-1]
        self.kv_group = self.n_heads // self.n_kv_heads
        # one padded width for both head dims keeps the compiled configurations few
        self.block_e = self.block_ev = max(_block_e(self.head_e), _block_e(self.head_ev))
        self.dtype_key = DTYPE_KEYS[q.dtype]
        if interpreting():
            self.block_m, self.block_n = attention_common.INTERPRETER_BLOCKS
        else:
            self.block_m, self.block_n = attention_common.block_sizes(self.block_e, self.dtype_key,
                                                                      dropout)
        # the launch keywords of the backward kernels; the forward's depend on the mask
        self.launch = {kernel: attention_common.backward_launch(kernel, self.block_e,
                                                                self.dtype_key)
                       for kernel in ("dq", "dkdv")}
        # head-dim chunks of the q.k and dO.v products, per kernel and architecture (also
        # when interpreting, so that the tests exercise the chunked loops)
        arch = _arch(q.device)
        self.block_ec = {kernel: attention_common.chunk_width(kernel, self.block_e,
                                                              self.dtype_key, arch)
                         for kernel in ("fwd", "dq", "dkdv")}
        self.n_qblocks = _cdiv(max(self.seqlen_q, 1), self.block_m)
        self.n_kblocks = _cdiv(max(self.seqlen_k, 1), self.block_n)
        for name, length, block, blocks in (("query", self.seqlen_q, self.block_m, self.n_qblocks),
                                            ("key", self.seqlen_k, self.block_n, self.n_kblocks)):
            if blocks > attention_common.MAX_GRID_BLOCKS:
                raise ValueError(f"the Triton attention takes at most "
                                 f"{attention_common.MAX_GRID_BLOCKS * block} {name} positions "
                                 f"per sequence ({attention_common.MAX_GRID_BLOCKS} blocks of "
                                 f"{block}, a CUDA grid's limit), got {length}")

    def query_grid(self):
        """The grid of the forward and dQ launches: a program per query block of each head."""
        return attention_common.launch_grid(self.n_qblocks, self.batch * self.n_heads)

    def key_grid(self):
        """The grid of the dK/dV launch: a program per key block of each key/value head."""
        return attention_common.launch_grid(self.n_kblocks, self.batch * self.n_kv_heads)

    def tile_lists(self, device):
        """Scratch of the kernels' lists of flagged tiles (attention_common.listed_tiles):
        one list of key tiles per query block, or (backward) of query tiles per key block."""
        return torch.empty(self.batch * self.n_heads * self.n_qblocks * self.n_kblocks,
                           dtype=torch.int32, device=device)

    def candidate_scratch(self, slots, device):
        """Scratch of the forward's captured scores (attention_fwd._find_threshold): `slots`
        fp32 per row of every query block (attention_common.candidate_slots)."""
        return torch.empty(max(1, self.batch * self.n_heads * self.n_qblocks * self.block_m * slots),
                           dtype=torch.float32, device=device)

    def out_shape(self, q, head_dim):
        if self.varlen:
            return (q.shape[0], self.n_heads, head_dim)
        return (self.batch, self.n_heads, self.seqlen_q, head_dim)

    def token_strides(self, x):
        """(batch, head, position) strides of a (B, H, L, E) tensor, or of a packed
        (tokens, H, E) one, which has no batch stride: sequences start at cu_seqlens[b]."""
        if self.varlen:
            return (0, x.stride(1), x.stride(0))
        return (x.stride(0), x.stride(1), x.stride(2))

    def stats_shape(self, q):
        if self.varlen:
            return (attention_common.NUM_STATS, self.n_heads, q.shape[0])
        return (attention_common.NUM_STATS, self.batch, self.n_heads, self.seqlen_q)

    def stats_strides(self, stats):
        if self.varlen:
            return (0, stats.stride(1), stats.stride(0))
        return (stats.stride(1), stats.stride(2), stats.stride(0))


def _mask_args(attn_mask, geo, q):
    """(kind, tensor, strides) with attn_mask broadcast to (B, H, Lq, Lk) by strides."""
    mask_kind = common.mask_kind(attn_mask)
    if mask_kind == common.MASK_NONE:
        return mask_kind, _placeholder(q.device, torch.int8), (0, 0, 0, 0)
    if mask_kind == common.MASK_BOOL:
        # same bytes, a pointer type every triton version (and the interpreter) loads
        attn_mask = attn_mask.view(torch.int8)
    else:
        # SDPA's rule: a float mask has the query's dtype
        attn_mask = attn_mask.to(q.dtype)
    mask = attn_mask.expand(geo.batch, geo.n_heads, geo.seqlen_q, geo.seqlen_k)
    return mask_kind, mask, tuple(mask.stride())


def _score_option_args(score_options, q):
    """(OPTIONS, kernel arguments, sinks argument) of the score options: their kernel bits,
    the window's bounds, the softcap, and the ALiBi slopes as an fp32 tensor with its strides
    over (batch entry or sequence, head), 0 over the first for (H,) slopes; the sink logits
    (H,) as an fp32 tensor (the forward and dQ kernels' last argument)."""
    window_left, window_right, softcap, alibi_slopes, sinks = score_options.flat()
    if sinks is None:
        sinks_arg = _placeholder(q.device, torch.float32)
    else:
        sinks_arg = sinks.to(torch.float32).contiguous()
    if alibi_slopes is None:
        slopes, strides = _placeholder(q.device, torch.float32), (0, 0)
    else:
        slopes = alibi_slopes.to(torch.float32)
        strides = (0, slopes.stride(0)) if slopes.dim() == 1 else tuple(slopes.stride())
    return (score_options.kernel_bits, (window_left, window_right, softcap, slopes, *strides),
            sinks_arg)


def _launch_forward(q, k, v, attn_mask, alpha, alpha_kind, seed, dropout_p, is_causal, scale,
                    need_grad, cu_q=None, cu_k=None, max_q=0, max_k=0,
                    score_options=ScoreOptions()):
    """Launch the forward kernel. Returns (out, stats, dvec, flags).

    alpha: fp32 tensor (H,); alpha_kind: common.ALPHA_* specialisation;
    seed: int64 tensor (1,) for dropout.
    stats: (4, B, H, Lq) or (4, H, total_q) fp32 row statistics (attention_common.STAT_*);
    need_grad: common.GRAD_* (what the backward will need);
    score_options: a ScoreOptions (`attention_forward`);
    dvec: fp32 like out (the D-vector; a placeholder without gradients);
    flags: (B, H, n_qblocks, n_kblocks) int8, 1 where a tile holds non-zero weight.
    """
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    geo = _Geometry(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p > 0.0)
    out = torch.empty(geo.out_shape(q, geo.head_ev), dtype=q.dtype, device=q.device)
    # without gradients the kernel never touches dvec: a one-element placeholder
    dvec = torch.empty(geo.out_shape(q, geo.head_ev) if need_grad else (1,),
                       dtype=torch.float32, device=q.device)
    stats = torch.zeros(geo.stats_shape(q), dtype=torch.float32, device=q.device)
    flags = torch.zeros((geo.batch, geo.n_heads, geo.n_qblocks, geo.n_kblocks),
                        dtype=torch.int8, device=q.device)
    mask_kind, mask, mask_strides = _mask_args(attn_mask, geo, q)
    cu_dummy = _placeholder(q.device, torch.int32)
    if geo.batch * geo.n_heads == 0 or geo.seqlen_q == 0:
        return out.zero_(), stats, dvec.zero_(), flags
    grid = geo.query_grid()
    tiles = geo.tile_lists(q.device)
    slots = attention_common.candidate_slots(alpha_kind)
    candidates = geo.candidate_scratch(slots, q.device)
    score_bits, option_args, sinks_arg = _score_option_args(score_options, q)
    for launch, heads in itertools.product(
            attention_common.forward_launches(geo.block_e, geo.dtype_key, mask_kind,
                                              int(need_grad)),
            attention_common.head_launches(alpha_kind)):
        options = attention_common.launch_options(launch.maxnreg)
        attention_fwd.entmax_attn_fwd_kernel[grid](
            q, k, v, out, dvec, stats, flags, tiles, candidates, mask, alpha, seed,
            cu_q if geo.varlen else cu_dummy, cu_k if geo.varlen else cu_dummy,
            *geo.q_strides, *geo.k_strides, *geo.v_strides, *geo.token_strides(out),
            *mask_strides, *geo.stats_strides(stats),
            geo.n_heads, geo.kv_group, geo.seqlen_q, geo.seqlen_k, geo.n_qblocks,
            geo.n_kblocks, geo.head_e, geo.head_ev, float(scale), float(dropout_p),
            int(is_causal), *option_args, sinks_arg,
            BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, BLOCK_E=geo.block_e,
            BLOCK_EV=geo.block_ev, BLOCK_EC=geo.block_ec["fwd"], ALPHA_KIND=alpha_kind,
            MASK_KIND=mask_kind, OPTIONS=score_bits, IS_VARLEN=geo.varlen,
            HAS_DROPOUT=dropout_p > 0.0, NEED_GRAD=launch.need_grad, PHASE=launch.phase,
            CANDIDATES=slots, HEADS=heads, num_warps=launch.num_warps,
            num_stages=launch.num_stages, **options,
        )
    return out, stats, dvec, flags


def _dq_mode(geo, need_alpha_grad):
    """attention_common.backward_dq's choice, but the dQ kernel for a learned alpha or
    sinks (it forms the rows' d(alpha) and d(sink) terms; `need_alpha_grad` stands for
    either) and, under torch.use_deterministic_algorithms, instead of unordered atomic
    adds."""
    dq_mode = attention_common.backward_dq(geo.block_e, geo.dtype_key, need_alpha_grad)
    if need_alpha_grad or (dq_mode == attention_common.DQ_ATOMIC
                           and torch.are_deterministic_algorithms_enabled()):
        return attention_common.DQ_KERNEL
    return dq_mode


def _launch_backward(do, q, k, v, o, dvec, stats, flags, attn_mask, alpha, alpha_kind, seed,
                     dropout_p, is_causal, scale, need_alpha_grad, cu_q=None, cu_k=None,
                     max_q=0, max_k=0, score_options=ScoreOptions(), need_sinks_grad=False):
    """Launch the backward kernels. Returns (dq, dk, dv, dalpha (H,) fp32, dsinks (H,)
    fp32), dalpha and dsinks zeros when not needed."""
    q, k, v, o, do = (_last_dim_contiguous(t) for t in (q, k, v, o, do))
    if do.stride() != o.stride():
        # the kernels address o, do and dvec with one set of strides
        do = do.contiguous()
    geo = _Geometry(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p > 0.0)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    rows = torch.zeros((attention_bwd.NUM_ROWS,) + tuple(stats.shape[1:]), dtype=torch.float32,
                       device=q.device)
    mask_kind, mask, mask_strides = _mask_args(attn_mask, geo, q)
    cu_dummy = _placeholder(q.device, torch.int32)
    cu_q_arg = cu_q if geo.varlen else cu_dummy
    cu_k_arg = cu_k if geo.varlen else cu_dummy
    if geo.batch * geo.n_heads == 0 or geo.seqlen_q == 0 or geo.seqlen_k == 0:
        return (dq.zero_(), dk.zero_(), dv.zero_(), torch.zeros_like(alpha),
                torch.zeros_like(alpha))
    sb, sh, sstat = geo.stats_strides(stats)
    tiles = geo.tile_lists(q.device)
    need_sinks_grad = need_sinks_grad and score_options.sinks is not None
    dq_mode = _dq_mode(geo, need_alpha_grad or need_sinks_grad)
    score_bits, option_args, sinks_arg = _score_option_args(score_options, q)
    head_launches = attention_common.head_launches(alpha_kind)
    if dq_mode == attention_common.DQ_KERNEL:
        # dq first: it writes delta = dO . D per row, which the dk/dv kernel reads
        for heads in head_launches:
            _launch_dq(q, k, v, o, do, dq, dvec, stats, rows, flags, tiles, mask, alpha, seed,
                       cu_q_arg, cu_k_arg, geo, mask_strides, sb, sh, sstat, scale, dropout_p,
                       is_causal, option_args, sinks_arg, alpha_kind, mask_kind, score_bits,
                       need_alpha_grad, heads)
        dq_acc = _placeholder(q.device, torch.float32)
        locks = turns = cu_dummy
    else:
        delta = (do * dvec).sum(-1)  # dO . D per row, (B, H, Lq) or (tokens, H)
        rows[attention_bwd.ROW_DELTA] = delta.t() if geo.varlen else delta
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        locks = turns = cu_dummy
        if dq_mode == attention_common.DQ_ORDERED:
            locks = torch.zeros(geo.batch * geo.n_heads * geo.n_qblocks, dtype=torch.int32,
                                device=q.device)
            # a flagged tile's turn: the flagged tiles after it in its query tile's row
            after = flags.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)
            turns = (after - flags).contiguous()
    for heads in head_launches:
        if heads == attention_common.HEADS_OUTSIDE and dq_mode != attention_common.DQ_KERNEL:
            # The dK/dV launch for (1, 2] ran every group of heads (its kernel as it was,
            # triton_kernels/attention_common.py "A per-head alpha"); the next one runs the
            # groups holding a head at 1 or above 2 again: their shares of dQ and their
            # turns so far are dropped first (on the device, no host sync).
            again = _groups_outside(alpha, geo)
            dq_acc = torch.where(again.view((1, -1, 1) if geo.varlen else (1, -1, 1, 1)), 0.0,
                                 dq_acc)
            if dq_mode == attention_common.DQ_ORDERED:
                locks = torch.where(again.view(1, -1, 1), 0,
                                    locks.view(geo.batch, geo.n_heads, -1)).reshape(-1)
        _launch_dkdv(q, k, v, do, dk, dv, stats, rows, flags, tiles, mask, alpha, seed, cu_q_arg,
                     cu_k_arg, dq_acc, locks, turns, geo, o, mask_strides, sb, sh, sstat, scale,
                     dropout_p, is_causal, option_args, alpha_kind, mask_kind, score_bits,
                     dq_mode, heads)
    if dq_mode != attention_common.DQ_KERNEL:
        # a row whose forward was NaN (its stored shift) gets NaN gradients, as in the dQ kernel
        row_max = stats[attention_common.STAT_MAX]
        nan_rows = (row_max.t() if geo.varlen else row_max).isnan().unsqueeze(-1)
        dq.copy_(torch.where(nan_rows, float("nan"), dq_acc * scale))
    dalpha, dsinks = (_per_head(rows[row], geo) if need else torch.zeros_like(alpha)
                      for row, need in ((attention_bwd.ROW_DALPHA, need_alpha_grad),
                                        (attention_bwd.ROW_DSINK, need_sinks_grad)))
    return dq, dk, dv, dalpha, dsinks


def _groups_outside(alpha, geo):
    """(H,) bool: the query heads whose group of heads (one key/value head) holds a head at
    alpha 1 or above 2, the groups the HEADS_OUTSIDE dK/dV launch runs."""
    outside = (alpha == 1.0) | (alpha > 2.0)
    return outside.view(geo.n_kv_heads, geo.kv_group).any(1).repeat_interleave(geo.kv_group)


def _launch_dq(q, k, v, o, do, dq, dvec, stats, rows, flags, tiles, mask, alpha, seed, cu_q_arg,
               cu_k_arg, geo, mask_strides, sb, sh, sstat, scale, dropout_p, is_causal,
               option_args, sinks_arg, alpha_kind, mask_kind, score_bits, need_alpha_grad,
               heads):
    """One launch of the dQ kernel, for the heads `heads` (attention_common.head_launches)."""
    attention_bwd.entmax_attn_bwd_dq_kernel[geo.query_grid()](
        q, k, v, o, do, dq, dvec, stats, rows, flags, tiles, mask, alpha, seed, cu_q_arg,
        cu_k_arg,
        *geo.q_strides, *geo.k_strides, *geo.v_strides, *geo.token_strides(o),
        *geo.token_strides(dq), *mask_strides, sb, sh, sstat, rows.stride(0),
        geo.n_heads, geo.kv_group, geo.seqlen_q, geo.seqlen_k, geo.n_qblocks, geo.n_kblocks,
        geo.head_e, geo.head_ev, float(scale), float(dropout_p), int(is_causal),
        *option_args, sinks_arg,
        BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, BLOCK_E=geo.block_e,
        BLOCK_EV=geo.block_ev, BLOCK_EC=geo.block_ec["dq"], ALPHA_KIND=alpha_kind,
        MASK_KIND=mask_kind, OPTIONS=score_bits, IS_VARLEN=geo.varlen,
        HAS_DROPOUT=dropout_p > 0.0, NEED_DALPHA=bool(need_alpha_grad),
        HEADS=heads, **geo.launch["dq"],
    )


def _launch_dkdv(q, k, v, do, dk, dv, stats, rows, flags, tiles, mask, alpha, seed, cu_q_arg,
                 cu_k_arg, dq_acc, locks, turns, geo, o, mask_strides, sb, sh, sstat, scale,
                 dropout_p, is_causal, option_args, alpha_kind, mask_kind, score_bits,
                 dq_mode, heads):
    """One launch of the dK/dV kernel, for the heads `heads`."""
    attention_bwd.entmax_attn_bwd_dkdv_kernel[geo.key_grid()](
        q, k, v, do, dk, dv, stats, rows, flags, tiles, mask, alpha, seed, cu_q_arg, cu_k_arg,
        dq_acc, locks, turns,
        *geo.q_strides, *geo.k_strides, *geo.v_strides, *geo.token_strides(o),
        *geo.token_strides(dk), *geo.token_strides(dv),
        *(geo.token_strides(dq_acc) if dq_acc.dim() > 1 else (0, 0, 0)),
        *mask_strides, sb, sh, sstat,
        rows.stride(0), geo.n_heads, geo.n_kv_heads, geo.kv_group, geo.seqlen_q, geo.seqlen_k,
        geo.n_qblocks, geo.n_kblocks, geo.head_e, geo.head_ev, float(scale),
        float(dropout_p), int(is_causal), *option_args,
        BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, BLOCK_E=geo.block_e, BLOCK_EV=geo.block_ev,
        BLOCK_EC=geo.block_ec["dkdv"], ALPHA_KIND=alpha_kind, MASK_KIND=mask_kind,
        OPTIONS=score_bits, IS_VARLEN=geo.varlen,
        HAS_DROPOUT=dropout_p > 0.0, DQ_MODE=dq_mode,
        HEADS=heads, **geo.launch["dkdv"],
    )


def _per_head(row_terms, geo):
    """The sum per head of a row of the backward's per-row buffer: (H,)."""
    return row_terms.sum(1) if geo.varlen else row_terms.sum((0, 2))


def _launch_support(q, k, stats, attn_mask, alpha, alpha_kind, is_causal, scale,
                    score_options=ScoreOptions()):
    """Launch the support kernel on the row statistics of the forward that ran on q and k
    with these arguments. Returns (B, H, Lq) int32 counts."""
    q, k = (_last_dim_contiguous(t) for t in (q, k))
    # the forward's geometry (its value had head dim 1, which pads to no wider BLOCK_E)
    geo = _Geometry(q, k, k[..., :1], None, None, 0, 0, False)
    counts = torch.empty((geo.batch, geo.n_heads, geo.seqlen_q), dtype=torch.int32,
                         device=q.device)
    if counts.numel() == 0:
        return counts
    mask_kind, mask, mask_strides = _mask_args(attn_mask, geo, q)
    score_bits, option_args, _ = _score_option_args(score_options, q)
    num_warps, num_stages, block_ec = attention_support.launch(geo.block_e, geo.dtype_key)
    for heads in attention_common.head_launches(alpha_kind):
        attention_support.entmax_attn_support_kernel[geo.query_grid()](
            q, k, stats, mask, alpha, counts,
            *geo.q_strides, *geo.k_strides, *mask_strides, *geo.stats_strides(stats),
            geo.n_heads, geo.kv_group, geo.seqlen_q, geo.seqlen_k, geo.n_qblocks, geo.head_e,
            float(scale), int(is_causal), *option_args,
            BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, BLOCK_E=geo.block_e, BLOCK_EC=block_ec,
            ALPHA_KIND=alpha_kind, MASK_KIND=mask_kind,
            OPTIONS=attention_support.kernel_options(score_bits),
            HEADS=heads, num_warps=num_warps, num_stages=num_stages,
        )
    return counts


# --------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile, no autograd (the public layer's)
# --------------------------------------------------------------------------------------

@torch.library.custom_op("entmax_fast::triton_attention_fwd", mutates_args=())
def _attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                      alpha: Tensor, seed: Tensor, cu_seqlens_q: Optional[Tensor],
                      cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                      dropout_p: float, is_causal: bool, scale: float, alpha_kind: int,
                      need_grad: int, window_left: int = -1, window_right: int = -1,
                      softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _launch_forward(q, k, v, attn_mask, alpha, alpha_kind, seed, dropout_p, is_causal,
                           scale, need_grad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, ScoreOptions.from_flat(window_left, window_right,
                                                                softcap, alibi_slopes, sinks))


@_attention_fwd_op.register_fake
def _(q, k, v, attn_mask, alpha, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, is_causal, scale, alpha_kind, need_grad, window_left=-1, window_right=-1,
      softcap=0.0, alibi_slopes=None, sinks=None):
    geo = _Geometry(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    dropout_p > 0.0)
    out = q.new_empty(geo.out_shape(q, geo.head_ev))
    dvec = q.new_empty(geo.out_shape(q, geo.head_ev) if need_grad else (1,),
                       dtype=torch.float32)
    stats = q.new_empty(geo.stats_shape(q), dtype=torch.float32)
    flags = q.new_empty((geo.batch, geo.n_heads, geo.n_qblocks, geo.n_kblocks),
                        dtype=torch.int8)
    return out, stats, dvec, flags


@torch.library.custom_op("entmax_fast::triton_attention_bwd", mutates_args=())
def _attention_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, dvec: Tensor,
                      stats: Tensor, flags: Tensor, attn_mask: Optional[Tensor], alpha: Tensor,
                      seed: Tensor, cu_seqlens_q: Optional[Tensor],
                      cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                      dropout_p: float, is_causal: bool, scale: float, alpha_kind: int,
                      need_alpha_grad: bool, window_left: int = -1, window_right: int = -1,
                      softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None, need_sinks_grad: bool = False
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _launch_backward(do, q, k, v, o, dvec, stats, flags, attn_mask, alpha, alpha_kind,
                            seed, dropout_p, is_causal, scale, need_alpha_grad,
                            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            ScoreOptions.from_flat(window_left, window_right, softcap,
                                                   alibi_slopes, sinks), need_sinks_grad)


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, dvec, stats, flags, attn_mask, alpha, seed, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, alpha_kind, need_alpha_grad,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
      need_sinks_grad=False):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(alpha), torch.empty_like(alpha))


@torch.library.custom_op("entmax_fast::triton_attention_support", mutates_args=())
def _attention_support_op(q: Tensor, k: Tensor, stats: Tensor, attn_mask: Optional[Tensor],
                          alpha: Tensor, is_causal: bool,
                          scale: float, alpha_kind: int, window_left: int = -1,
                          window_right: int = -1, softcap: float = 0.0,
                          alibi_slopes: Optional[Tensor] = None) -> Tensor:
    return _launch_support(q, k, stats, attn_mask, alpha, alpha_kind, is_causal, scale,
                           ScoreOptions.from_flat(window_left, window_right, softcap,
                                                  alibi_slopes, None))


@_attention_support_op.register_fake
def _(q, k, stats, attn_mask, alpha, is_causal, scale, alpha_kind, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.int32)


# --------------------------------------------------------------------------------------
# the backend contract
# --------------------------------------------------------------------------------------

def _seed(dropout_p, device):
    if dropout_p > 0.0:
        # drawn from torch's generator, so torch.manual_seed makes dropout reproducible
        return torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=device)
    return torch.zeros(1, dtype=torch.int64, device=device)


def _alpha_heads(alpha, n_heads, device):
    """alpha as the kernels read it: an fp32 (H,) tensor with its own storage per head."""
    return common.alpha_vector(alpha, n_heads, device, torch.float32).contiguous()


def _alpha_kind(alpha):
    """The kernels' ALPHA_KIND for alpha: the closed forms of 1.5 and 2, the general kind
    (one alpha per head, read from the (H,) tensor) for every other alpha, a python float
    1 included: the fused kernels have no softmax kind of their own, their general kind
    runs a head at alpha 1 as softmax (triton_kernels/attention_common.py, "A per-head
    alpha")."""
    kind = common.alpha_kind(alpha)
    return common.ALPHA_GENERAL if kind == common.ALPHA_SOFTMAX else kind


def _alpha_grad(dalpha_heads, alpha, need_alpha_grad):
    """The (H,) fp32 dα of the kernels as the gradient of ``alpha`` (its shape and dtype);
    None for a python-float alpha or when not asked."""
    if not (need_alpha_grad and isinstance(alpha, torch.Tensor)):
        return None
    return dalpha_heads.sum_to_size(alpha.shape).to(alpha.dtype)


def _forward(q, k, v, attn_mask, alpha, cu_q, cu_k, max_q, max_k, scale, is_causal, dropout_p,
             need_grad, score_options):
    # (B, H, L, E) and the packed (total, H, E) both hold the query heads in dimension 1
    alpha_heads = _alpha_heads(alpha, q.shape[1], q.device)
    seed = _seed(dropout_p, q.device)
    out, stats, dvec, flags = torch.ops.entmax_fast.triton_attention_fwd(
        q, k, v, attn_mask, alpha_heads, seed, cu_q, cu_k, max_q, max_k, float(dropout_p),
        bool(is_causal), float(scale), _alpha_kind(alpha), int(need_grad),
        *score_options.flat())
    return out, (stats, dvec, flags, seed)


def _backward(grad_out, q, k, v, attn_mask, alpha, out, saved, cu_q, cu_k, max_q, max_k, scale,
              is_causal, dropout_p, need_alpha_grad, score_options, need_sinks_grad):
    stats, dvec, flags, seed = saved
    alpha_heads = _alpha_heads(alpha, q.shape[1], q.device)
    need_alpha_grad = bool(need_alpha_grad) and isinstance(alpha, torch.Tensor)
    sinks = score_options.sinks
    need_sinks_grad = bool(need_sinks_grad) and sinks is not None
    dq, dk, dv, dalpha, dsinks = torch.ops.entmax_fast.triton_attention_bwd(
        grad_out, q, k, v, out, dvec, stats, flags, attn_mask, alpha_heads, seed, cu_q, cu_k,
        max_q, max_k, float(dropout_p), bool(is_causal), float(scale), _alpha_kind(alpha),
        need_alpha_grad, *score_options.flat(), need_sinks_grad)
    return (dq, dk, dv, _alpha_grad(dalpha, alpha, need_alpha_grad),
            dsinks.to(sinks.dtype) if need_sinks_grad else None)


def attention_forward(query, key, value, attn_mask, alpha, *, scale, is_causal, dropout_p,
                      enable_gqa, need_grad, score_options=ScoreOptions()):
    """Fused α-entmax attention (SDPA semantics), never materialising Lq x Lk.

    query (B, H, Lq, E), key (B, Hkv, Lk, E), value (B, Hkv, Lk, Ev) -> out (B, H, Lq, Ev);
    H a multiple of Hkv (GQA: the kernels read the group from the shapes, so enable_gqa
    changes nothing here). attn_mask: None, bool (True = attend) or additive, broadcastable
    to (B, H, Lq, Lk). alpha: float >= 1 or (H,) tensor. need_grad: common.GRAD_*,
    what the backward will need (the D-vector; the row entropy as well for dα).

    Returns (out, saved), saved = (stats, dvec, flags, seed): the row statistics, the
    D-vector (a placeholder under GRAD_NONE), the tiles holding non-zero weight, and the
    dropout seed (drawn here from torch's generator), which the backward regenerates the
    dropout mask from. score_options: a ScoreOptions (docs/attention.md, "Score options"):
    the window's bounds, softcap, alibi_slopes ((H,) or (B, H)) and sinks ((H,): each head's
    sink logit, one more entry of every row with a zero value).
    """
    return _forward(query, key, value, attn_mask, alpha, None, None, 0, 0, scale, is_causal,
                    dropout_p, need_grad, score_options)


def attention_backward(grad_out, query, key, value, attn_mask, alpha, out, saved, *, scale,
                       is_causal, dropout_p, enable_gqa, need_mask_grad, need_alpha_grad,
                       score_options=ScoreOptions(), need_sinks_grad=False):
    """Gradients of `attention_forward` (which ran with need_grad GRAD_INPUTS, or
    GRAD_ALPHA when need_alpha_grad): (dq, dk, dv, None, dalpha or None, dsinks or None),
    dalpha in alpha's shape and dtype, dsinks in sinks' (when need_sinks_grad). The kernels
    do not differentiate attn_mask: ``supports`` refuses the calls that would need it."""
    if need_mask_grad:
        raise RuntimeError("the Triton attention does not differentiate attn_mask "
                           "(supports() refuses a mask that requires grad)")
    dq, dk, dv, dalpha, dsinks = _backward(
        grad_out, query, key, value, attn_mask, alpha, out, saved, None, None, 0, 0, scale,
        is_causal, dropout_p, need_alpha_grad, score_options, need_sinks_grad)
    return dq, dk, dv, None, dalpha, dsinks


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             alpha, *, scale, is_causal, dropout_p, need_grad,
                             score_options=ScoreOptions()):
    """`attention_forward` over packed variable-length sequences (flash-attn layout).

    q (total_q, H, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev) -> out (total_q, H, Ev);
    sequence b holds tokens cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32, length B + 1) and
    attends only to its own keys cu_seqlens_k[b]:cu_seqlens_k[b+1]; max_seqlen_q/_k bound
    every sequence length. is_causal is top-left aligned per sequence, the window
    bottom-right; alibi_slopes (B, H) hold a row per sequence. Returns (out, saved) as
    `attention_forward`.
    """
    return _forward(q, k, v, None, alpha, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                    int(max_seqlen_k), scale, is_causal, dropout_p, need_grad, score_options)


def attention_varlen_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, alpha, out, saved, *, scale, is_causal, dropout_p,
                              need_alpha_grad, score_options=ScoreOptions(),
                              need_sinks_grad=False):
    """Gradients of `attention_varlen_forward`: (dq, dk, dv, dalpha or None, dsinks or
    None)."""
    dq, dk, dv, dalpha, dsinks = _backward(
        grad_out, q, k, v, None, alpha, out, saved, cu_seqlens_q, cu_seqlens_k,
        int(max_seqlen_q), int(max_seqlen_k), scale, is_causal, dropout_p, need_alpha_grad,
        score_options, need_sinks_grad)
    return dq, dk, dv, dalpha, dsinks


def attention_support_forward(query, key, attn_mask, alpha, *, scale, is_causal, enable_gqa,
                              score_options=ScoreOptions()):
    """(B, H, Lq) int64: how many keys each query row gives a nonzero weight in
    `attention_forward` with the same arguments (the sink not counted, a NaN row none).

    Runs that forward without gradients on a value of head dim 1 (zeros: only its row
    statistics are kept, which the value does not change), then the support kernel, which
    recomputes the scores tile by tile and counts the keys above each row's stored
    threshold: no (Lq, Lk) block per head (triton_kernels/attention_support.py)."""
    value = torch.zeros(key.shape[:-1] + (1,), dtype=key.dtype, device=key.device)
    _, (stats, _, _, _) = _forward(query, key, value, attn_mask, alpha, None, None, 0, 0, scale,
                                   is_causal, 0.0, common.GRAD_NONE, score_options)
    # the sink changes no key's weight beyond the stored statistics: the count takes none
    counts = torch.ops.entmax_fast.triton_attention_support(
        query, key, stats, attn_mask, _alpha_heads(alpha, query.shape[1], query.device),
        bool(is_causal), float(scale), _alpha_kind(alpha), *score_options.flat()[:4])
    return counts.to(torch.int64)
