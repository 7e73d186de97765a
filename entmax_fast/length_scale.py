"""Length-aware scaling of the attention scores, applied on the queries.

Two rules scale query i's scores by a factor that grows with ``n_i``, the number of keys
query i may attend (causal: the keys up to its own position; with padding: the real ones):

* ``"ssmax"``, Scalable-Softmax (Nakanishi, "Scalable-Softmax Is Superior for Attention",
  arXiv 2501.19399): ``z_i ← (s · log n_i) · z_i``, with ``s`` a learnable scalar per head.
* ``"asentmax"``, the length-aware temperature of Adaptive-Scalable Entmax (Vasylenko et
  al., "Long-Context Generalization with Sparse Attention", ICLR 2026, arXiv 2506.16640):
  ``z_i ← (δ + β · (log n_i)^γ) · z_i``, with ``β`` and ``γ`` learnable per head and ``δ``
  fixed (1 in the authors' code), the result fed to α-entmax.

Scores are linear in the query, so scaling row i of the scores equals scaling ``q_i``:
:func:`length_scaled_query` does that, and the attention kernels run unchanged. Scores
added after the dot product (ALiBi's bias, a float mask) are not scaled, as in the authors'
code, which scales the query states.

    n = attended_keys(L, L, is_causal=True)                      # (1, 1, L)
    q = length_scaled_query(q, n, "ssmax", s=s)                  # s: (H,)
    out = entmax_attention(q, k, v, is_causal=True, alpha=1.0)
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ._validation import check_is_causal

__all__ = ["LENGTH_SCALES", "attended_keys", "length_scale", "length_scaled_query"]

LENGTH_SCALES = ("ssmax", "asentmax")

# ASEntmax takes (log n)^γ, which is 0 or ∞ at n = 1 for γ ≠ 0; the authors' code counts
# positions from 2. A query with a single key gives it weight one at any finite scale, so
# computing its scale at n = 2 changes no weight and keeps the gradient finite.
ASENTMAX_MIN_KEYS = 2


def _check_window(window_size) -> tuple:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1: unbounded), got {window_size!r}")
    return tuple(window_size)


def attended_keys(query_length: int, key_length: int, *, is_causal: bool = False,
                  key_padding_mask: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                  window_size=(-1, -1), device=None) -> torch.Tensor:
    """The number of keys each query may attend, as int64 broadcastable to (B, H, Lq):
    shape (B or 1, H or 1, Lq).

    The conventions are ``entmax_attention``'s, so that the count is of the keys it attends
    with the same arguments (``MultiheadEntmaxAttention`` passes its ``is_causal`` to both):
    ``is_causal`` (a bool) is top-left, query i may attend keys j ≤ i, whatever Lq and Lk;
    ``window_size=(left, right)`` is bottom-right, query i sits at key position
    ``pos = i + Lk − Lq`` and may attend keys ``pos − left ≤ j ≤ pos + right`` (-1
    unbounded), so a bottom-right causal count is ``window_size=(-1, 0)``. The two agree
    when Lq = Lk. ``key_padding_mask`` (B, Lk) follows
    ``nn.MultiheadAttention``: True marks a padding key. ``attn_mask`` follows
    ``entmax_attention``: bool True = may attend, float added to the scores (a key with
    -inf is not attended); broadcastable to (B, H, Lq, Lk). A mask with a single query row
    is counted with prefix sums, O(Lk); a full mask is summed row by row.
    """
    for name, length in (("query_length", query_length), ("key_length", key_length)):
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"{name} must be a positive int, got {length!r}")
    check_is_causal(is_causal)
    left, right = _check_window(window_size)
    if key_padding_mask is not None:
        device = key_padding_mask.device
        if key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2 \
                or key_padding_mask.shape[1] != key_length:
            raise ValueError(f"key_padding_mask must be a bool tensor (B, Lk) with Lk = {key_length}, got "
                             f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
    if attn_mask is not None:
        device = attn_mask.device
        if attn_mask.dim() < 2 or attn_mask.shape[-1] != key_length or attn_mask.shape[-2] not in (1, query_length):
            raise ValueError(f"attn_mask must be broadcastable to (B, H, {query_length}, {key_length}), got shape "
                             f"{tuple(attn_mask.shape)}")
    query = torch.arange(query_length, device=device)
    position = query + (key_length - query_length)
    # The interval [first, last] of keys each query may reach, before any mask.
    last = query.clamp(max=key_length - 1) if is_causal else torch.full_like(position, key_length - 1)
    if right >= 0:
        last = torch.minimum(last, position + right)
    first = torch.zeros_like(position)
    if left >= 0:
        first = (position - left).clamp(min=0)
    # Keys that the masks let through, as (B or 1, H or 1, 1, Lk) when no mask varies by query.
    allowed = torch.ones(1, 1, 1, key_length, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.view(-1, 1, 1, key_length)
    if attn_mask is not None and attn_mask.shape[-2] == 1:
        row = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        while row.dim() < 4:
            row = row.unsqueeze(0)
        allowed = allowed & row
        attn_mask = None
    if attn_mask is None:
        # Keys allowed in [first, last]: a difference of prefix sums, one per query.
        lead = allowed.shape[:2]
        flat = allowed.reshape(-1, key_length).long()
        prefix = torch.cat([flat.new_zeros(flat.shape[0], 1), flat.cumsum(-1)], dim=-1)
        hi = (last + 1).clamp(min=0).expand(flat.shape[0], -1)
        lo = first.clamp(max=key_length).expand(flat.shape[0], -1)
        counts = (prefix.gather(1, hi) - prefix.gather(1, lo)).clamp(min=0)
        return counts.view(*lead, query_length)
    keys = torch.arange(key_length, device=device)
    reach = (keys[None, :] >= first[:, None]) & (keys[None, :] <= last[:, None])
    attend = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
    attend = attend & reach
    while attend.dim() < 4:
        attend = attend.unsqueeze(0)
    return (attend & allowed).sum(-1)


def length_scale(n_keys: torch.Tensor, kind: str, *, s: Optional[torch.Tensor] = None,
                 beta: Optional[torch.Tensor] = None, gamma: Optional[torch.Tensor] = None,
                 delta: Union[float, torch.Tensor] = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The factor of each query's scores, (B or 1, H, Lq), from ``n_keys`` (as returned by
    :func:`attended_keys`) and the per-head parameters, each of shape (H,) or broadcastable
    to (B, H, Lq): ``kind="ssmax"``: ``s · log n``; ``kind="asentmax"``:
    ``δ + β · (log max(n, 2))^γ``. A query with no key (n = 0) gets the factor of n = 1:
    its weights are all zero whatever the factor."""
    if kind not in LENGTH_SCALES:
        raise ValueError(f"kind must be one of {LENGTH_SCALES}, got {kind!r}")
    if not isinstance(n_keys, torch.Tensor) or n_keys.dim() != 3:
        raise ValueError("n_keys must be a tensor (B or 1, H or 1, Lq), as attended_keys returns")

    def per_head(name, value):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"kind={kind!r} needs the tensor {name}, got {type(value).__name__}")
        return value.to(dtype).view(1, -1, 1) if value.dim() == 1 else value.to(dtype)

    if kind == "ssmax":
        log_n = n_keys.clamp(min=1).to(dtype).log()
        return per_head("s", s) * log_n
    log_n = n_keys.clamp(min=ASENTMAX_MIN_KEYS).to(dtype).log()
    return delta + per_head("beta", beta) * log_n.pow(per_head("gamma", gamma))


def length_scaled_query(query: torch.Tensor, n_keys: torch.Tensor, kind: str, **params) -> torch.Tensor:
    """``query`` (B, H, Lq, E) with row i multiplied by its length scale (:func:`length_scale`;
    ``params``: ``s`` for ``"ssmax"``, ``beta``, ``gamma`` and optionally ``delta`` for
    ``"asentmax"``). Differentiable in the query and the parameters."""
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        raise ValueError(f"query must be a tensor (B, H, Lq, E), got "
                         f"{tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__}")
    if n_keys.dim() != 3 or n_keys.shape[-1] != query.shape[2]:
        raise ValueError(f"n_keys must have shape (B or 1, H or 1, Lq) with Lq = {query.shape[2]}, got "
                         f"{tuple(n_keys.shape)}")
    scale = length_scale(n_keys, kind, dtype=query.dtype, **params)
    return query * scale.unsqueeze(-1)
