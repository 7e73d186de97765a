"""Public scaled-dot-product entmax attention, with the signature and layout of
``torch.nn.functional.scaled_dot_product_attention``.

Layers: :func:`entmax_attention` (validates, normalises) → :class:`AttentionFunction`
(autograd) → the forward and backward of the backend ``dispatch`` picks (op
``"attention"``: Triton fused kernels on CUDA, the C++ op on CPU when built, else the
chunked plain-torch reference).

Causal masks are aligned top-left, as in SDPA: query i attends to keys j ≤ i, whatever
Lq and Lk. For Lq = 3, Lk = 5 (``x`` = attended)::

        keys  0 1 2 3 4
    query 0   x . . . .
    query 1   x x . . .
    query 2   x x x . .

and for Lq = 5, Lk = 3 the last queries see every key::

        keys  0 1 2
    query 0   x . .
    query 1   x x .
    query 2   x x x
    query 3   x x x
    query 4   x x x

For bottom-right alignment (decoding with a KV cache) pass
``torch.nn.attention.bias.causal_lower_right(Lq, Lk)`` as ``attn_mask``, or
``window_size=(-1, 0)``.

Score options, keyword-only, with FlashAttention's semantics (docs/attention.md, "Score
options", writes down their order): ``window_size=(left, right)`` lets query i, placed at
key position ``pos = i + Lk − Lq`` (bottom-right), attend key j iff
``pos − left ≤ j ≤ pos + right`` (−1: unbounded). For Lq = 3, Lk = 5 and
``window_size=(1, 0)``::

        keys  0 1 2 3 4
    query 0   . x x . .
    query 1   . . x x .
    query 2   . . . x x

``softcap`` caps the scaled scores (``softcap·tanh(s/softcap)``, Gemma 2); ``alibi_slopes``
adds ``−slope·|pos − j|`` (no gradient); ``sinks`` (H,) is a virtual key per head with that
logit and a zero value, taking part in the threshold (GPT-OSS's rule at α = 1; learnable).
"""
from __future__ import annotations

import math
import sys

import torch

from . import dispatch
from ._validation import (_assert_values, causal_bias, check_backend_dtype,
                          check_dropout_scale_alpha, check_floating, check_gqa_heads, check_is_causal, check_like,
                          check_score_options, once_differentiable_grads)
from .common import GRAD_ALPHA, GRAD_INPUTS, GRAD_NONE, NO_WINDOW, per_head_alpha
from .reference.attention import is_empty_attention, zero_attention

__all__ = ["entmax_attention", "sparsemax_attention", "entmax_attention_varlen", "AttentionFunction",
           "AttentionVarlenFunction"]


def _grad_level(tensors, alpha) -> int:
    """What the forward must keep for the backward (common.GRAD_*), decided before the
    autograd.Function runs (inside it, grad mode is off)."""
    if not torch.is_grad_enabled():
        return GRAD_NONE
    if isinstance(alpha, torch.Tensor) and alpha.requires_grad:
        return GRAD_ALPHA
    if any(t is not None and t.requires_grad for t in tensors):
        return GRAD_INPUTS
    return GRAD_NONE


def _distinct(*tensors):
    """Self-attention passes one tensor as query, key and value; torch.compile cannot trace an
    autograd.Function given the same tensor twice, so repeats become views (free; gradients
    still add up on the one tensor)."""
    out = []
    for tensor in tensors:
        if tensor is not None and any(tensor is other for other in out):
            tensor = tensor.view_as(tensor)
        out.append(tensor)
    return out


class AttentionFunction(torch.autograd.Function):
    """Entmax attention with gradients for query, key, value, a float mask, a tensor α and
    the sinks, on the dispatched backend (its ``attention_forward`` / ``attention_backward``).
    Once differentiable: the gradients raise when differentiated again."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, alpha, sinks, alibi_slopes, score_options, options,
                request_options):
        (forward, backward), choice = dispatch.select("attention",
                                                      dispatch.Request(query.device, query.dtype, request_options))
        check_backend_dtype(choice, query)
        # The backend gets the tensors autograd tracks (sinks, alibi_slopes are inputs of their own).
        score_options = score_options.with_tensors(alibi_slopes, sinks)
        out, saved = forward(query, key, value, attn_mask, alpha, score_options=score_options, **options)
        alpha_tensor = alpha if isinstance(alpha, torch.Tensor) else None
        ctx.save_for_backward(query, key, value, attn_mask, alpha_tensor, sinks, alibi_slopes, out, *saved)
        ctx.alpha_float = None if alpha_tensor is not None else alpha
        ctx.backward_impl, ctx.backend = backward, choice.backend
        ctx.options = {name: value for name, value in options.items() if name != "need_grad"}
        ctx.score_options = score_options.with_tensors(None, None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, attn_mask, alpha_tensor, sinks, alibi_slopes, out, *saved = ctx.saved_tensors
        alpha = ctx.alpha_float if alpha_tensor is None else alpha_tensor
        grads = ctx.backward_impl(grad_out, query, key, value, attn_mask, alpha, out, tuple(saved), **ctx.options,
                                  score_options=ctx.score_options.with_tensors(alibi_slopes, sinks),
                                  need_mask_grad=ctx.needs_input_grad[3], need_alpha_grad=ctx.needs_input_grad[4],
                                  need_sinks_grad=ctx.needs_input_grad[5])
        grads = once_differentiable_grads(f"entmax attention ({ctx.backend} backend)", grads,
                                          (query, key, value, attn_mask, alpha_tensor, sinks, grad_out))
        return (*grads, None, None, None, None)


class AttentionVarlenFunction(torch.autograd.Function):
    """:class:`AttentionFunction` for the packed variable-length form (op
    ``"attention_varlen"``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, alpha, sinks, alibi_slopes, score_options, lengths,
                options, request_options):
        (forward, backward), choice = dispatch.select("attention_varlen",
                                                      dispatch.Request(q.device, q.dtype, request_options))
        check_backend_dtype(choice, q)
        score_options = score_options.with_tensors(alibi_slopes, sinks)
        out, saved = forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *lengths, alpha, score_options=score_options,
                             **options)
        alpha_tensor = alpha if isinstance(alpha, torch.Tensor) else None
        ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, alpha_tensor, sinks, alibi_slopes, out, *saved)
        ctx.alpha_float = None if alpha_tensor is not None else alpha
        ctx.backward_impl, ctx.backend, ctx.lengths = backward, choice.backend, lengths
        ctx.options = {name: value for name, value in options.items() if name != "need_grad"}
        ctx.score_options = score_options.with_tensors(None, None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cu_seqlens_q, cu_seqlens_k, alpha_tensor, sinks, alibi_slopes, out, *saved = ctx.saved_tensors
        alpha = ctx.alpha_float if alpha_tensor is None else alpha_tensor
        grads = ctx.backward_impl(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, alpha, out,
                                  tuple(saved), **ctx.options,
                                  score_options=ctx.score_options.with_tensors(alibi_slopes, sinks),
                                  need_alpha_grad=ctx.needs_input_grad[5], need_sinks_grad=ctx.needs_input_grad[6])
        dq, dk, dv, dalpha, dsinks = once_differentiable_grads(f"entmax attention varlen ({ctx.backend} backend)",
                                                               grads, (q, k, v, alpha_tensor, sinks, grad_out))
        return dq, dk, dv, None, None, dalpha, dsinks, None, None, None, None, None


def _resolve_causal_bias(bias, lq, lk, is_causal):
    """A CausalBias as (is_causal, lower_right): upper-left, or lower-right with Lq = Lk (the
    same pattern), is what is_causal means; lower-right otherwise is the window's right bound 0."""
    if (bias.seq_len_q, bias.seq_len_kv) != (lq, lk):
        raise ValueError(f"attn_mask is a CausalBias for (Lq, Lk) = ({bias.seq_len_q}, {bias.seq_len_kv}), but "
                         f"query and key have ({lq}, {lk})")
    upper_left = bias.variant == sys.modules["torch.nn.attention.bias"].CausalVariant.UPPER_LEFT
    if upper_left or lq == lk:
        return True, False
    return is_causal, True


def attention_request(query, value, attn_mask, alpha, dropout_p, is_causal, score_options) -> dict:
    """The dispatch.Request options of an attention call with checked arguments."""
    return {"alpha": alpha if isinstance(alpha, float) else "tensor", "dropout_p": float(dropout_p),
            "head_dim": max(query.shape[-1], value.shape[-1]), "is_causal": bool(is_causal),
            "mask": None if attn_mask is None else attn_mask.dtype,
            "mask_requires_grad": attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled(),
            **score_options.request_flags()}


def check_attention_args(query, key, value, attn_mask, dropout_p, scale, enable_gqa, alpha):
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_floating(name, tensor)
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, E), got shape {tuple(tensor.shape)}")
    check_like(("key", "value"), (key, value), "query", query)
    if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
        raise ValueError(f"query, key and value must have the same batch size, got {query.shape[0]}, "
                         f"{key.shape[0]}, {value.shape[0]}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key's last dim (E) must equal query's {query.shape[-1]}, got {key.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value's length (dim -2) must equal key's {key.shape[-2]}, got {value.shape[-2]}")
    if value.shape[1] != key.shape[1]:
        raise ValueError(f"key and value must have the same number of heads, got {key.shape[1]} and {value.shape[1]}")
    heads = query.shape[1]
    check_gqa_heads(heads, key.shape[1], enable_gqa)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            raise TypeError(f"attn_mask must be bool or have query's dtype {query.dtype}, got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask must be on query's device {query.device}, got {attn_mask.device}")
        target = (query.shape[0], heads, query.shape[2], key.shape[2])
        try:
            if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, target) != target:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(f"attn_mask must be broadcastable to (B, H, Lq, Lk) = {target}, "
                             f"got shape {tuple(attn_mask.shape)}") from None
    return check_dropout_scale_alpha(dropout_p, scale, alpha, heads, query)


def checked_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alpha, window_size,
                      softcap, alibi_slopes, sinks):
    """:func:`entmax_attention`'s arguments checked, a CausalBias mask resolved: (attn_mask
    tensor or None, is_causal, alpha, ScoreOptions)."""
    check_is_causal(is_causal)
    bias = causal_bias(attn_mask)
    if bias is not None:
        attn_mask = None
    alpha = check_attention_args(query, key, value, attn_mask, dropout_p, scale, enable_gqa, alpha)
    lower_right = False
    if bias is not None:
        is_causal, lower_right = _resolve_causal_bias(bias, query.shape[2], key.shape[2], bool(is_causal))
    score_options = check_score_options(window_size, softcap, alibi_slopes, sinks, query.shape[0], query.shape[1],
                                        "query", query, lower_right)
    return attn_mask, is_causal, alpha, score_options


def entmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, *, alpha=1.5, window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                     sinks=None):
    """Scaled-dot-product attention with α-entmax weights: ``entmax_α(QKᵀ·scale + mask) V``.

    Args:
        query: (B, H, Lq, E).
        key: (B, Hkv, Lk, E).
        value: (B, Hkv, Lk, Ev).
        attn_mask: bool (True = attend) or float (added to the scores), broadcastable to
            (B, H, Lq, Lk), or a ``torch.nn.attention.bias.CausalBias``
            (``causal_upper_left``: is_causal; ``causal_lower_right``: bottom-right
            causal, never materialised). May be combined with ``is_causal``.
        dropout_p: dropout on the attention weights (training only; pass 0 in eval).
        is_causal: a bool (anything else raises TypeError, as in SDPA): the top-left
            aligned causal mask (module docstring draws it). Unlike flash-attn's
            ``causal=True`` (bottom-right since flash-attn 2.1), ``is_causal`` is aligned
            top-left when Lq ≠ Lk, as in SDPA; flash-attn's ``causal=True`` is
            ``window_size=(-1, 0)`` or ``attn_mask=causal_lower_right(Lq, Lk)`` here.
        scale: score scale, default 1/sqrt(E); any finite number, as in SDPA: 0 scores every
            key alike (uniform weights over the unmasked keys, for every α), a negative scale
            is the positive one with the query negated.
        enable_gqa: allow Hkv < H with H divisible by Hkv (grouped-query attention).
        alpha: float ≥ 1 or tensor of shape (H,) (per head, learnable: it gets a gradient).
            1 is softmax attention, 1.5 is 1.5-entmax, 2 is sparsemax.
        window_size: (left, right) ints ≥ −1 (−1 unbounded): query i, at key position
            pos = i + Lk − Lq, attends keys pos − left ≤ j ≤ pos + right (FlashAttention's).
        softcap: float ≥ 0; > 0 replaces each scaled score s by softcap·tanh(s/softcap).
        alibi_slopes: None, (H,) or (B, H), float32 or query's dtype, not requiring grad:
            adds −slope·|pos − j| to the scores.
        sinks: None or (H,), float32 or query's dtype (learnable): a virtual key per head
            with this logit (not scaled, not capped) and a zero value; the weights are those
            of the row with the sink appended, without its own entry.

    The options enter the scores in the order docs/attention.md ("Score options") gives.

    Returns (B, H, Lq, Ev) in query's dtype. Rows whose keys are all masked give zeros.
    Bad values: a NaN in query, key or a float mask, or a +inf score, makes NaN every output
    row whose scores it reaches (a NaN in value: every row that attends to its key).
    Zero-size dims: Lk = 0 gives zeros; B, H, Lq or Ev = 0 an empty output; E = 0 scores
    every key 0 (uniform weights unless masked). Once differentiable: double backward raises.

    Examples:
        >>> import torch, entmax_fast
        >>> q = torch.tensor([[[[1.0, 0.0]]]])                                # (1, 1, 1, 2)
        >>> k = torch.tensor([[[[2.0, 0.0], [1.6, 0.0], [0.0, 0.0]]]])        # scores 2, 1.6, 0
        >>> v = torch.eye(3)[None, None]                                      # the output is the weights
        >>> entmax_fast.entmax_attention(q, k, v, scale=1.0, alpha=1.5)
        tensor([[[[0.6400, 0.3600, 0.0000]]]])
        >>> q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
        >>> entmax_fast.entmax_attention(q, k, v, is_causal=True).shape
        torch.Size([2, 8, 128, 64])
        >>> alpha = torch.nn.Parameter(torch.full((8,), 1.5))                 # one learned α per head
        >>> entmax_fast.entmax_attention(q, k, v, alpha=alpha).sum().backward()
        >>> alpha.grad.shape
        torch.Size([8])
    """
    attn_mask, is_causal, alpha, score_options = checked_arguments(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alpha, window_size, softcap,
        alibi_slopes, sinks)
    if is_empty_attention(query, key, value):
        return zero_attention(query, key, value, alpha, sinks)
    if query.shape[-1] == 0:
        # The empty dot product scores every key 0: a zero feature gives the same scores on
        # every backend, none of which has kernels for E = 0; the scale multiplies zeros.
        query, key = torch.nn.functional.pad(query, (0, 1)), torch.nn.functional.pad(key, (0, 1))
        scale = 1.0
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    request_options = attention_request(query, value, attn_mask, alpha, dropout_p, is_causal, score_options)
    options = {"scale": float(scale), "is_causal": bool(is_causal), "dropout_p": float(dropout_p),
               "enable_gqa": bool(enable_gqa), "need_grad": _grad_level((query, key, value, attn_mask, sinks), alpha)}
    query, key, value, attn_mask, sinks, alibi_slopes = _distinct(query, key, value, attn_mask, score_options.sinks,
                                                                  score_options.alibi_slopes)
    return AttentionFunction.apply(query, key, value, attn_mask, per_head_alpha(alpha, query.shape[1]), sinks,
                                   alibi_slopes, score_options, options, request_options)


def sparsemax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, *, window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """:func:`entmax_attention` with α = 2 (sparsemax weights).

    Examples:
        >>> import torch, entmax_fast
        >>> q = torch.tensor([[[[1.0, 0.0]]]])
        >>> k = torch.tensor([[[[2.0, 0.0], [1.6, 0.0], [0.0, 0.0]]]])
        >>> entmax_fast.sparsemax_attention(q, k, torch.eye(3)[None, None], scale=1.0)
        tensor([[[[0.7000, 0.3000, 0.0000]]]])
    """
    return entmax_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alpha=2.0,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


def _check_offsets(name, cu, total, max_name, max_seqlen):
    """cu_seqlens must start at 0, never decrease, end at the number of tokens, and no
    sequence may be longer than max_seqlen. Eager on CPU; on a GPU checked on the device
    (``torch._assert_async``: no host sync, the error surfaces at the next synchronisation)."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    lengths = cu[1:] - cu[:-1]
    _assert_values(cu[:1] == 0, f"{name} must start at 0")
    _assert_values(lengths >= 0, f"{name} must be non-decreasing (sequence lengths >= 0)")
    _assert_values(cu[-1:] == total, f"{name} must end at the number of tokens ({total})")
    _assert_values(lengths <= max_seqlen, f"{max_name} ({max_seqlen}) must be at least the longest sequence "
                                          f"length in {name}")


def entmax_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, *,
                            is_causal=False, scale=None, alpha=1.5, window_size=NO_WINDOW, softcap=0.0,
                            alibi_slopes=None, sinks=None):
    """Entmax attention over packed variable-length sequences (flash-attn's varlen layout).

    q (total_q, H, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev) -> (total_q, H, Ev).
    Sequence b holds the queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and attends only to
    the keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (1-D int32 offsets, B + 1 entries);
    ``max_seqlen_q``/``max_seqlen_k`` (python ints) bound every length. H must be divisible by
    Hkv (GQA). ``is_causal`` is top-left aligned within each sequence. ``scale``, ``alpha``,
    ``window_size``, ``softcap`` and ``sinks`` as in :func:`entmax_attention`, the window and
    ALiBi positions bottom-right within each sequence; ``alibi_slopes`` (H,) or (B, H), a
    row per sequence. CUDA tensors run the fused Triton kernel; elsewhere the reference
    loops over the sequences.

    The arguments after ``dropout_p`` are keyword-only. flash-attn's
    ``flash_attn_varlen_func`` takes ``softmax_scale`` then ``causal`` at those positions,
    SDPA's order is ``is_causal`` then ``scale``: a positional call written for either would
    run here with the other's meaning, so both raise a TypeError instead. The names are
    SDPA's (``is_causal``, ``scale``), as in :func:`entmax_attention`.

    ``is_causal`` must be a bool (TypeError otherwise, as in SDPA). Unlike flash-attn's
    ``causal=True`` (bottom-right since flash-attn 2.1), ``is_causal`` is aligned top-left
    when Lq ≠ Lk, as in SDPA; here per sequence: query i sees keys j ≤ i. flash-attn's
    ``causal=True`` is ``window_size=(-1, 0)`` here.

    The offsets are validated: they must start at 0, never decrease, end at total_q
    (total_k), and ``max_seqlen_q``/``max_seqlen_k`` must bound every length. On CPU a
    ValueError is raised at once; on CUDA the check runs on the device without a host sync
    (``torch._assert_async``), so a violation surfaces as a device-side assertion at the
    next synchronisation. A sequence without keys gives zeros.

    Examples:
        >>> import torch, entmax_fast
        >>> cu_seqlens = torch.tensor([0, 5, 8], dtype=torch.int32)          # two sequences: 5 and 3 tokens
        >>> q, k, v = (torch.randn(8, 4, 16) for _ in range(3))              # (total, H, E)
        >>> out = entmax_fast.entmax_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 5, 5, is_causal=True)
        >>> out.shape
        torch.Size([8, 4, 16])
        >>> second = entmax_fast.entmax_attention(*(t[5:].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)
        >>> torch.allclose(out[5:], second[0].transpose(0, 1), atol=1e-6)
        True
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_floating(name, tensor)
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, H, E), got shape {tuple(tensor.shape)}")
    check_like(("k", "v"), (k, v), "q", q)
    if k.shape[-1] != q.shape[-1] or v.shape[0] != k.shape[0] or v.shape[1] != k.shape[1]:
        raise ValueError(f"k must be (total_k, Hkv, {q.shape[-1]}) and v (total_k, Hkv, Ev) with the same "
                         f"total_k and Hkv, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be divisible by k/v heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor with B + 1 >= 2 entries, got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    check_is_causal(is_causal)
    _check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
    _check_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)
    alpha = check_dropout_scale_alpha(dropout_p, scale, alpha, q.shape[1], q)
    score_options = check_score_options(window_size, softcap, alibi_slopes, sinks, cu_seqlens_q.shape[0] - 1,
                                        q.shape[1], "q", q)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    request_options = {"alpha": alpha if isinstance(alpha, float) else "tensor", "dropout_p": float(dropout_p),
                       "head_dim": max(q.shape[-1], v.shape[-1]), "is_causal": bool(is_causal),
                       **score_options.request_flags()}
    options = {"scale": float(scale), "is_causal": bool(is_causal), "dropout_p": float(dropout_p),
               "need_grad": _grad_level((q, k, v, sinks), alpha)}
    q, k, v, sinks, alibi_slopes = _distinct(q, k, v, score_options.sinks, score_options.alibi_slopes)
    return AttentionVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, per_head_alpha(alpha, q.shape[1]), sinks,
                                         alibi_slopes, score_options, (int(max_seqlen_q), int(max_seqlen_k)), options,
                                         request_options)
