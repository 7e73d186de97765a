"""Host side of the fused entmax attention: launchers, torch.library ops, entry points.

Layers (top to bottom):
- `entmax_attention_triton`, `entmax_attention_varlen`: entry points (SDPA-like);
- `torch.ops.entmax_fast.triton_attention_fwd/_bwd`: custom ops with fake
  implementations and an autograd registration, so torch.compile traces them;
- `attention_forward`, `attention_backward`: kernel launchers (allocation, grid).

Causal masks are top-left aligned, like `scaled_dot_product_attention`: query i sees
keys j <= i, whatever Lq and Lk are. For Lq = 3, Lk = 5 ("x" = attended):

    k:  0 1 2 3 4
    q0  x . . . .
    q1  x x . . .
    q2  x x x . .

and for Lq = 5, Lk = 3 the last queries see every key:

    k:  0 1 2
    q0  x . .
    q1  x x .
    q2  x x x
    q3  x x x
    q4  x x x

A row whose keys are all masked gets zero output and zero gradients.
"""
import math
import os
from typing import Optional

import torch
import triton
from torch import Tensor

from . import attention_bwd as _bwd
from . import attention_fwd as _fwd


# The interpreter's cost is per tile: one fixed, large tiling keeps interpreted runs fast
# (docs/checking.md); GPUs use the per-dtype table of attention_fwd.block_sizes.
INTERPRETER_BLOCKS = (64, 32)
_DTYPE_KEYS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _block_e(dim):
    return max(16, triton.next_power_of_2(dim))


def _alpha_kind(alpha):
    """Specialise the kernel when a python-float alpha is 1.5 or 2."""
    if isinstance(alpha, torch.Tensor):
        return _fwd.ALPHA_GENERAL
    if alpha == 1.5:
        return _fwd.ALPHA_15
    if alpha == 2.0:
        return _fwd.ALPHA_2
    return _fwd.ALPHA_GENERAL


def _alpha_tensor(alpha, n_heads, device):
    """alpha as an fp32 (H,) tensor; differentiable when alpha is a tensor."""
    if isinstance(alpha, torch.Tensor):
        return alpha.to(device=device, dtype=torch.float32).reshape(-1).expand(
            n_heads).contiguous()
    return torch.full((n_heads,), float(alpha), dtype=torch.float32, device=device)


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
            self.q_strides = (0, q.stride(1), q.stride(0))
            self.k_strides = (0, k.stride(1), k.stride(0))
            self.v_strides = (0, v.stride(1), v.stride(0))
        else:
            self.batch, self.n_heads, self.seqlen_q = q.shape[0], q.shape[1], q.shape[2]
            self.n_kv_heads, self.seqlen_k = k.shape[1], k.shape[2]
            self.q_strides = (q.stride(0), q.stride(1), q.stride(2))
            self.k_strides = (k.stride(0), k.stride(1), k.stride(2))
            self.v_strides = (v.stride(0), v.stride(1), v.stride(2))
        self.head_e, self.head_ev = q.shape[-1], v.shape[-1]
        self.kv_group = self.n_heads // self.n_kv_heads
        # one padded width for both head dims keeps the compiled configurations few
        self.block_e = self.block_ev = max(_block_e(self.head_e), _block_e(self.head_ev))
        dtype_key = _DTYPE_KEYS[q.dtype]
        if _interpreting():
            self.block_m, self.block_n = INTERPRETER_BLOCKS
        else:
            self.block_m, self.block_n = _fwd.block_sizes(self.block_e, dtype_key, dropout)
        # (num_warps, num_stages) of the backward kernels; the forward's depends on the mask
        self.launch = {kernel: _fwd.launch_config(kernel, self.block_e, dtype_key)
                       for kernel in ("dq", "dkdv")}
        # head-dim chunks of the q.k and dO.v products, per kernel (also when interpreting,
        # so that the tests exercise the chunked loops)
        self.block_ec = {kernel: _fwd.chunk_width(kernel, self.block_e, dtype_key)
                         for kernel in ("fwd", "dq", "dkdv")}
        self.n_qblocks = triton.cdiv(max(self.seqlen_q, 1), self.block_m)
        self.n_kblocks = triton.cdiv(max(self.seqlen_k, 1), self.block_n)

    def out_shape(self, q, head_dim):
        if self.varlen:
            return (q.shape[0], self.n_heads, head_dim)
        return (self.batch, self.n_heads, self.seqlen_q, head_dim)

    def out_strides(self, o):
        if self.varlen:
            return (0, o.stride(1), o.stride(0))
        return (o.stride(0), o.stride(1), o.stride(2))

    def stats_shape(self, q):
        if self.varlen:
            return (_fwd.NUM_STATS, self.n_heads, q.shape[0])
        return (_fwd.NUM_STATS, self.batch, self.n_heads, self.seqlen_q)

    def stats_strides(self, stats):
        if self.varlen:
            return (0, stats.stride(1), stats.stride(0))
        return (stats.stride(1), stats.stride(2), stats.stride(0))


def _mask_args(attn_mask, geo, q):
    """(kind, tensor, strides) with attn_mask broadcast to (B, H, Lq, Lk) by strides."""
    if attn_mask is None:
        return _fwd.MASK_NONE, torch.zeros(1, dtype=torch.int8, device=q.device), (0, 0, 0, 0)
    if attn_mask.dtype == torch.bool:
        kind = _fwd.MASK_BOOL
        # same bytes, a pointer type every triton version (and the interpreter) loads
        attn_mask = attn_mask.view(torch.int8)
    else:
        kind = _fwd.MASK_ADDITIVE
        # SDPA's rule: a float mask has the query's dtype
        attn_mask = attn_mask.to(q.dtype)
    mask = attn_mask.expand(geo.batch, geo.n_heads, geo.seqlen_q, geo.seqlen_k)
    return kind, mask, tuple(mask.stride())


def attention_forward(q, k, v, attn_mask, alpha, alpha_kind, seed, dropout_p, is_causal,
                      scale, need_grad, cu_q=None, cu_k=None, max_q=0, max_k=0):
    """Launch the forward kernel. Returns (out, stats, dvec, flags).

    alpha: fp32 tensor (H,); alpha_kind: attention_fwd.ALPHA_* specialisation;
    seed: int64 tensor (1,) for dropout.
    stats: (4, B, H, Lq) or (4, H, total_q) fp32 row statistics (attention_fwd.STAT_*);
    need_grad: attention_fwd.GRAD_* (what the backward will need);
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
    cu_dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    if geo.batch * geo.n_heads == 0 or geo.seqlen_q == 0:
        return out.zero_(), stats, dvec.zero_(), flags
    grid = (geo.n_qblocks, geo.batch * geo.n_heads)
    fwd_warps, fwd_stages = _fwd.launch_config("fwd", geo.block_e, _DTYPE_KEYS[q.dtype], mask_kind)
    _fwd.entmax_attn_fwd_kernel[grid](
        q, k, v, out, dvec, stats, flags, mask, alpha, seed,
        cu_q if geo.varlen else cu_dummy, cu_k if geo.varlen else cu_dummy,
        *geo.q_strides, *geo.k_strides, *geo.v_strides, *geo.out_strides(out),
        *mask_strides, *geo.stats_strides(stats),
        geo.n_heads, geo.kv_group, geo.seqlen_q, geo.seqlen_k, geo.n_qblocks, geo.n_kblocks,
        geo.head_e, geo.head_ev, float(scale), float(dropout_p), int(is_causal),
        BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, BLOCK_E=geo.block_e, BLOCK_EV=geo.block_ev,
        BLOCK_EC=geo.block_ec["fwd"], ALPHA_KIND=alpha_kind, MASK_KIND=mask_kind,
        IS_VARLEN=geo.varlen, HAS_DROPOUT=dropout_p > 0.0, NEED_GRAD=int(need_grad),
        num_warps=fwd_warps, num_stages=fwd_stages,
    )
    return out, stats, dvec, flags


def attention_backward(do, q, k, v, o, dvec, stats, flags, attn_mask, alpha, alpha_kind, seed,
                       dropout_p, is_causal, scale, need_alpha_grad, cu_q=None, cu_k=None,
                       max_q=0, max_k=0):
    """Launch the backward kernels. Returns (dq, dk, dv, dalpha (H,) fp32)."""
    q, k, v, o, do = (_last_dim_contiguous(t) for t in (q, k, v, o, do))
    if do.stride() != o.stride():
        # the kernels address o, do and dvec with one set of strides
        do = do.contiguous()
    geo = _Geometry(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p > 0.0)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    rows = torch.zeros((_bwd.NUM_ROWS,) + tuple(stats.shape[1:]), dtype=torch.float32,
                       device=q.device)
    mask_kind, mask, mask_strides = _mask_args(attn_mask, geo, q)
    cu_dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q_arg = cu_q if geo.varlen else cu_dummy
    cu_k_arg = cu_k if geo.varlen else cu_dummy
    if geo.batch * geo.n_heads == 0 or geo.seqlen_q == 0 or geo.seqlen_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), torch.zeros_like(alpha)
    sb, sh, sstat = geo.stats_strides(stats)
    # dq first: it writes delta = dO . D per row, which the dk/dv kernel reads
    _bwd.entmax_attn_bwd_dq_kernel[(geo.n_qblocks, geo.batch * geo.n_heads)](
        q, k, v, o, do, dq, dvec, stats, rows, flags, mask, alpha, seed, cu_q_arg, cu_k_arg,
        *geo.q_strides, *geo.k_strides, *geo.v_strides, *geo.out_strides(o),
        *mask_strides, sb, sh, sstat, rows.stride(0),
        geo.n_heads, geo.kv_group, geo.seqlen_q, geo.seqlen_k, geo.n_qblocks, geo.n_kblocks,
        geo.head_e, geo.head_ev, float(scale), float(dropout_p), int(is_causal),
        int(need_alpha_grad),
        BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, BLOCK_E=geo.block_e, BLOCK_EV=geo.block_ev,
        BLOCK_EC=geo.block_ec["dq"], ALPHA_KIND=alpha_kind, MASK_KIND=mask_kind,
        IS_VARLEN=geo.varlen,
        HAS_DROPOUT=dropout_p > 0.0,
        num_warps=geo.launch["dq"][0], num_stages=geo.launch["dq"][1],
    )
    _bwd.entmax_attn_bwd_dkdv_kernel[(geo.n_kblocks, geo.batch * geo.n_kv_heads)](
        q, k, v, do, dk, dv, stats, rows, flags, mask, alpha, seed, cu_q_arg, cu_k_arg,
        *geo.q_strides, *geo.k_strides, *geo.v_strides, *geo.out_strides(o),
        *mask_strides, sb, sh, sstat, rows.stride(0),
        geo.n_heads, geo.n_kv_heads, geo.kv_group, geo.seqlen_q, geo.seqlen_k,
        geo.n_qblocks, geo.n_kblocks, geo.head_e, geo.head_ev, float(scale),
        float(dropout_p), int(is_causal),
        BLOCK_M=geo.block_m, BLOCK_N=geo.block_n, BLOCK_E=geo.block_e, BLOCK_EV=geo.block_ev,
        BLOCK_EC=geo.block_ec["dkdv"], ALPHA_KIND=alpha_kind, MASK_KIND=mask_kind,
        IS_VARLEN=geo.varlen,
        HAS_DROPOUT=dropout_p > 0.0,
        num_warps=geo.launch["dkdv"][0], num_stages=geo.launch["dkdv"][1],
    )
    if need_alpha_grad:
        dalpha_rows = rows[_bwd.ROW_DALPHA]
        dalpha = dalpha_rows.sum(1) if geo.varlen else dalpha_rows.sum((0, 2))
    else:
        dalpha = torch.zeros_like(alpha)
    return dq, dk, dv, dalpha


# --------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------

@torch.library.custom_op("entmax_fast::triton_attention_fwd", mutates_args=())
def _attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                      alpha: Tensor, seed: Tensor, cu_seqlens_q: Optional[Tensor],
                      cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                      dropout_p: float, is_causal: bool, scale: float, alpha_kind: int,
                      need_grad: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return attention_forward(q, k, v, attn_mask, alpha, alpha_kind, seed, dropout_p,
                             is_causal, scale, need_grad, cu_seqlens_q, cu_seqlens_k,
                             max_seqlen_q, max_seqlen_k)


@_attention_fwd_op.register_fake
def _(q, k, v, attn_mask, alpha, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, is_causal, scale, alpha_kind, need_grad):
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
                      need_alpha_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return attention_backward(do, q, k, v, o, dvec, stats, flags, attn_mask, alpha, alpha_kind,
                              seed, dropout_p, is_causal, scale, need_alpha_grad,
                              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, dvec, stats, flags, attn_mask, alpha, seed, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, alpha_kind, need_alpha_grad):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(alpha)


def _setup_context(ctx, inputs, output):
    (q, k, v, attn_mask, alpha, seed, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale,
     alpha_kind, need_grad) = inputs
    out, stats, dvec, flags = output
    ctx.save_for_backward(q, k, v, out, dvec, stats, flags, attn_mask, alpha, seed, cu_q, cu_k)
    ctx.args = (max_q, max_k, dropout_p, is_causal, scale, alpha_kind, need_grad)
    ctx.mark_non_differentiable(stats, dvec, flags)


def _backward(ctx, grad_out, grad_stats, grad_dvec, grad_flags):
    q, k, v, out, dvec, stats, flags, attn_mask, alpha, seed, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, dropout_p, is_causal, scale, alpha_kind, need_grad = ctx.args
    if not need_grad:
        raise RuntimeError("entmax_attention_triton: the forward ran without gradient "
                           "statistics (it ran without gradients enabled) and cannot be differentiated")
    need_alpha_grad = ctx.needs_input_grad[4]
    dq, dk, dv, dalpha = _attention_bwd_op(
        grad_out, q, k, v, out, dvec, stats, flags, attn_mask, alpha, seed, cu_q, cu_k,
        max_q, max_k, dropout_p, is_causal, scale, alpha_kind, need_alpha_grad)
    return (dq, dk, dv, None, dalpha if need_alpha_grad else None, None, None, None, None,
            None, None, None, None, None, None)


torch.library.register_autograd("entmax_fast::triton_attention_fwd", _backward,
                                setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------

def _seed(dropout_p, device):
    if dropout_p > 0.0:
        # drawn from torch's generator, so torch.manual_seed makes dropout reproducible
        return torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64, device=device)
    return torch.zeros(1, dtype=torch.int64, device=device)


def _grad_level(inputs, alpha):
    """attention_fwd.GRAD_*: what the forward must store for the backward of this call."""
    if not torch.is_grad_enabled():
        return _fwd.GRAD_NONE
    if isinstance(alpha, torch.Tensor) and alpha.requires_grad:
        return _fwd.GRAD_ALPHA
    if any(t.requires_grad for t in inputs):
        return _fwd.GRAD_INPUTS
    return _fwd.GRAD_NONE


def entmax_attention_triton(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                            scale=None, enable_gqa=False, alpha=1.5):
    """Fused alpha-entmax attention, SDPA semantics, never materialising Lq x Lk.

    query (B, H, Lq, E), key (B, H_kv, Lk, E), value (B, H_kv, Lk, Ev) -> (B, H, Lq, Ev).
    attn_mask: bool (True = attend) or additive, broadcastable to (B, H, Lq, Lk); a key
    padding mask is attn_mask of shape (B, 1, 1, Lk). is_causal is top-left aligned (see
    the module docstring). H_kv != H needs enable_gqa and H % H_kv == 0.
    alpha: float in (1, 2] or tensor (H,) of values in (1, 2] (differentiable); the
    threshold search relies on convexity, which holds only for alpha <= 2. dropout_p drops
    weights with a Philox mask regenerated in the backward.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    n_heads, n_kv_heads = query.shape[1], key.shape[1]
    if n_heads != n_kv_heads and not (enable_gqa and n_heads % n_kv_heads == 0):
        raise ValueError(f"entmax_attention_triton: query has {n_heads} heads and key "
                         f"{n_kv_heads}; expected equal counts, or enable_gqa=True with the "
                         f"query count divisible by the key count")
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("entmax_attention_triton: attn_mask requires grad, but the Triton "
                         "kernels do not differentiate the mask; expected a mask with "
                         "requires_grad=False (the reference backend differentiates it)")
    alpha_t = _alpha_tensor(alpha, n_heads, query.device)
    need_grad = _grad_level((query, key, value), alpha_t)
    out = torch.ops.entmax_fast.triton_attention_fwd(
        query, key, value, attn_mask, alpha_t, _seed(dropout_p, query.device), None, None,
        0, 0, float(dropout_p), bool(is_causal), float(scale), _alpha_kind(alpha), need_grad)[0]
    return out


def entmax_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p=0.0, is_causal=False, scale=None, alpha=1.5):
    """Fused alpha-entmax attention over packed variable-length sequences (flash-attn layout).

    q (total_q, H, E), k (total_k, H_kv, E), v (total_k, H_kv, Ev) -> (total_q, H, Ev);
    sequence b holds tokens cu_seqlens_q[b]:cu_seqlens_q[b+1] (int32, length B + 1) and
    attends only to its own keys cu_seqlens_k[b]:cu_seqlens_k[b+1]. max_seqlen_q/_k bound
    every sequence length (python ints). H % H_kv == 0 (GQA/MQA). is_causal is top-left
    aligned per sequence. alpha: float in (1, 2] or tensor (H,).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads % n_kv_heads != 0:
        raise ValueError(f"entmax_attention_varlen: q has {n_heads} heads, k has {n_kv_heads}; "
                         f"expected the q head count to be a multiple of the k head count")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise ValueError(f"entmax_attention_varlen: {name} must be a 1-D int32 tensor, "
                             f"got {cu.dtype} with shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"entmax_attention_varlen: cu_seqlens_q and cu_seqlens_k must have the "
                         f"same length, got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    alpha_t = _alpha_tensor(alpha, n_heads, q.device)
    need_grad = _grad_level((q, k, v), alpha_t)
    out = torch.ops.entmax_fast.triton_attention_fwd(
        q, k, v, None, alpha_t, _seed(dropout_p, q.device), cu_seqlens_q, cu_seqlens_k,
        int(max_seqlen_q), int(max_seqlen_k), float(dropout_p), bool(is_causal), float(scale),
        _alpha_kind(alpha), need_grad)[0]
    return out
