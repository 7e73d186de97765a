"""``MultiheadEntmaxAttention``: a drop-in for ``torch.nn.MultiheadAttention`` whose
attention weights come from softmax, sparsemax, 1.5-entmax, a fixed α, a learned α per
head, or fusedmax; and :func:`replace_attention`, which swaps it into an existing model.

It subclasses ``nn.MultiheadAttention``, so the constructor, the parameters, their
initialisation and the ``state_dict`` keys are torch's own: weights copy both ways (a
learned α, sinks and a length scale add their own keys, which a plain checkpoint leaves at
their initial values). Only ``forward`` is new: projections as torch,
then :func:`entmax_fast.entmax_attention` (dispatched to the fused kernels) or, when the
weights are asked for, the explicit mapping over the score matrix.
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import ScoreOptions, check_is_causal, check_softcap, check_window_size
from .attention import entmax_attention
from .common import NO_WINDOW
from .length_scale import LENGTH_SCALES, attended_keys, length_scaled_query
from .mappings import entmax15, entmax_bisect, sparsemax
from .reference.attention import with_score_options, with_sink

__all__ = ["MultiheadEntmaxAttention", "replace_attention", "alibi_slopes", "ATTENTION_KINDS"]

ATTENTION_KINDS = ("softmax", "sparsemax", "entmax15", "learned", "fusedmax", "crf", "sparsemap")
# The structured kinds over the chain of keys (entmax_fast.chain): a learned 2x2 transition
# matrix per head, the parameter ``chain_transitions`` (H, 2, 2).
CHAIN_KINDS = ("crf", "sparsemap")
# SparseMAP's heads start at T = (w0/4)·[[1, −1], [−1, 1]], w = T00 + T11 − T01 − T10 = w0 > 0: a
# weak pull towards spans. At w = 0 its loss has a kink in w, which gradient descent may not
# leave (docs/maths.md). examples/chain_study.py's training, SparseMAP, 8 seeds, C++ backend
# on a 2-core x86-64 CPU, commit cba8522: starts w0 = 0 / 0.1 / 0.2 / 0.5 / 1.0 solved the task
# (held-out accuracy > 0.95) in 4 / 6 / 6 / 6 / 5 seeds, with 4 / 4 / 6 / 7 / 7 dead heads of 16;
# 0.1 is the weakest of the best starts (docs/chain_study.md). The CRF is smooth at w = 0 and
# learns w from 0 (every seed solved): it starts at T = 0.
SPARSEMAP_INITIAL_W = 0.1

def initial_chain_transitions(attention: str, num_heads: int, device=None, dtype=None) -> torch.Tensor:
    """The module's initial ``chain_transitions`` (H, 2, 2) for ``attention`` "crf" (0) or
    "sparsemap" (w = SPARSEMAP_INITIAL_W, no shift of the scores)."""
    transitions = torch.zeros(num_heads, 2, 2, device=device, dtype=dtype)
    if attention == "sparsemap":
        pattern = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], device=device, dtype=transitions.dtype)
        transitions += SPARSEMAP_INITIAL_W / 4 * pattern
    return transitions


# The state_dict entries nn.MultiheadAttention does not have.
_OWN_STATE = ("alpha_logit", "sinks", "length_scale_s", "length_scale_beta", "length_scale_gamma",
              "chain_transitions")

# A learned α = 1 + sigmoid(w) is kept away from 1, where the closed form of the entmax
# gradient w.r.t. α divides by (α − 1)² (docs/maths.md, "Gradient of alpha").
LEARNED_ALPHA_MIN = 1.01


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's fixed slope per head (Press et al., 2022; BLOOM's rule), float32 (num_heads,):
    the geometric sequence 2^(-8 i / n), i = 1..n, for the power of two n <= num_heads; more
    heads take every other slope of the sequence for 2n, as far as needed.

    Examples:
        >>> import entmax_fast
        >>> entmax_fast.alibi_slopes(8)
        tensor([0.5000, 0.2500, 0.1250, 0.0625, 0.0312, 0.0156, 0.0078, 0.0039])
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / closest) for i in range(1, closest + 1)]
    slopes += [2.0 ** (-4.0 * i / closest) for i in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def active_context_parallel():
    """The attention function of an active ``entmax_fast.distributed.context_parallel`` block,
    or None; the modules and integrations (this module, :mod:`entmax_fast.hf`) ask here.
    Looked up in ``sys.modules``, not imported: no block can be active before that module is
    loaded, and ``import entmax_fast`` does not load it (tests/test_architecture.py counts
    the lookup as an import)."""
    module = sys.modules.get("entmax_fast.distributed")
    return None if module is None else module.current_attention()


def _keep_torch_fast_paths_off(module, args, kwargs):
    """Forward pre-hook whose presence alone matters: ``nn.TransformerEncoderLayer`` skips
    its fused inference kernel (which hard-codes softmax and reads ``in_proj_weight``
    directly) when any submodule has a hook. Returns None: the inputs are unchanged."""
    return None


def _normalise_attention(attention) -> Union[str, float]:
    if isinstance(attention, bool):
        raise TypeError(f"attention must be one of {ATTENTION_KINDS} or a float alpha >= 1, got {attention!r}")
    if isinstance(attention, (int, float)):
        alpha = float(attention)
        if not (math.isfinite(alpha) and alpha >= 1.0):
            raise ValueError(f"attention given as a float alpha must be finite and >= 1, got {attention!r}")
        return alpha
    if isinstance(attention, str) and attention in ATTENTION_KINDS:
        return attention
    raise ValueError(f"attention must be one of {ATTENTION_KINDS} or a float alpha >= 1, got {attention!r}")


def _mask_to_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's convention for MultiheadAttention masks: bool True = masked out."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


class MultiheadEntmaxAttention(nn.MultiheadAttention):
    r"""Multi-head attention with sparse (α-entmax) weights; a drop-in for
    :class:`torch.nn.MultiheadAttention` (same constructor and ``forward`` arguments, same
    return values, same ``state_dict`` keys).

    The arguments besides torch's ``embed_dim, num_heads, dropout, bias, add_bias_kv,
    add_zero_attn, kdim, vdim, batch_first, device, dtype``:

    Args:
        attention: the mapping from scores to weights:
            ``"softmax"`` (identical to ``nn.MultiheadAttention``), ``"sparsemax"`` (α = 2),
            ``"entmax15"`` (α = 1.5, the default), a float α ≥ 1 (fixed α-entmax),
            ``"learned"`` (one α per head, α = 1 + sigmoid(w) clamped to [1.01, 2], trained
            with the rest of the model), ``"fusedmax"`` (sparsemax of the
            total-variation prox of the scores over the key order), or ``"crf"`` /
            ``"sparsemap"`` (the marginals of binary selection variables over the chain
            of keys, :func:`entmax_fast.crf_attention` / :func:`entmax_fast.sparsemap_attention`,
            with a learned 2×2 transition matrix per head, the parameter
            ``chain_transitions`` (H, 2, 2); the weights are marginals, not
            renormalised). The CRF's transitions start at 0 (sigmoid of the scores);
            SparseMAP's at ``(w0/4)·[[1, −1], [−1, 1]]`` with w0 = ``SPARSEMAP_INITIAL_W``
            = 0.1, a weak pull towards spans: at w = T00 + T11 − T01 − T10 = 0 SparseMAP's
            loss has a kink in w that training may never leave (docs/chain_study.md).
        alpha_init: initial α of every head for ``attention="learned"``, in (1.01, 2).
        lam: fusedmax's total-variation strength (``attention="fusedmax"`` only), > 0.
        window_size: a sliding window ``(left, right)``, -1 unbounded, as in
            :func:`entmax_fast.entmax_attention`.
        softcap: a tanh cap of the scores, as in :func:`entmax_fast.entmax_attention`.
        alibi: add ALiBi's distance bias with the fixed slopes of :func:`alibi_slopes`
            (a buffer ``alibi_slopes``, not trained).
        sinks: a learned sink logit per head (a parameter ``sinks``, initialised to 0), a
            virtual key with a zero value that takes part in the threshold (GPT-OSS).
        length_scale: None, ``"ssmax"`` or ``"asentmax"``: multiply query i by a factor of
            n_i, the number of keys it may attend (after the causal mask, padding, window
            and attn_mask): Scalable-Softmax's ``s · log n`` (a parameter
            ``length_scale_s`` per head) or ASEntmax's ``1 + β · (log n)^γ`` (parameters
            ``length_scale_beta``, ``length_scale_gamma`` per head); see
            :mod:`entmax_fast.length_scale` and docs/length_generalization.md.

    The options apply to every mapping but fusedmax, crf and sparsemap, with and without
    ``need_weights`` (``attention="softmax"`` with an option runs entmax attention at α = 1).

    Masks follow ``nn.MultiheadAttention``: bool ``key_padding_mask`` / ``attn_mask`` mark
    the positions to *ignore* with True; float masks are added to the scores. ``is_causal``
    is a hint that ``attn_mask`` is the causal mask (it must be given, as in torch); it
    lets the fused kernels skip the masked tiles. It must be a bool: anything else raises
    TypeError (torch raises one only where it calls SDPA). With ``need_weights=False`` the
    hint runs the top-left causal mask (query i sees keys j ≤ i, as SDPA and torch), for
    Lq ≠ Lk too, and a length scale counts the keys the same way.

    Difference from torch: a query whose keys are all masked gets zero weights and a zero
    output (torch's softmax gives NaN). With ``need_weights=True`` (torch's default) the
    full score matrix is built, as torch does; pass ``need_weights=False`` for the fused
    kernels and O(L) memory.

    Examples:
        >>> import torch, entmax_fast
        >>> mha = entmax_fast.MultiheadEntmaxAttention(64, 4, batch_first=True, attention="sparsemax")
        >>> x = torch.randn(2, 10, 64)
        >>> out, weights = mha(x, x, x)                         # weights averaged over the heads
        >>> out.shape, weights.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 10, 10]))
        >>> out, weights = mha(x, x, x, need_weights=False)     # the fused kernels
        >>> weights is None
        True
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *,
                 attention="entmax15", alpha_init: float = 1.5, lam: float = 1.0, window_size=(-1, -1),
                 softcap: float = 0.0, alibi: bool = False, sinks: bool = False, length_scale=None):
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
                         add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
                         device=device, dtype=dtype)
        self.attention = _normalise_attention(attention)
        self.lam = float(lam)
        if self.attention == "fusedmax" and not (math.isfinite(self.lam) and self.lam > 0):
            raise ValueError(f"lam must be a finite number > 0, got {lam!r}")
        if self.attention == "learned":
            alpha_init = float(alpha_init)
            if not LEARNED_ALPHA_MIN < alpha_init < 2.0:
                raise ValueError(f"alpha_init must be in ({LEARNED_ALPHA_MIN}, 2) for attention='learned', "
                                 f"got {alpha_init}")
            logit = math.log((alpha_init - 1.0) / (2.0 - alpha_init))
            self.alpha_logit = nn.Parameter(torch.full((num_heads,), logit, device=device, dtype=dtype))
        else:
            self.register_parameter("alpha_logit", None)
        self.window_size = check_window_size(window_size)
        self.softcap = check_softcap(softcap)
        for name, flag in (("alibi", alibi), ("sinks", sinks)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        # Fixed by the head count: not saved in the state_dict.
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi else None, persistent=False)
        self.register_parameter("sinks", nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
                                if sinks else None)
        if self.attention == "fusedmax" and self._score_options().in_use:
            raise ValueError("attention='fusedmax' takes none of window_size, softcap, alibi, sinks")
        if self.attention in CHAIN_KINDS and (self._score_options().in_use or length_scale is not None):
            raise ValueError(f"attention={self.attention!r} takes none of window_size, softcap, alibi, sinks, "
                             "length_scale")
        self.register_parameter("chain_transitions",
                                nn.Parameter(initial_chain_transitions(self.attention, num_heads, device, dtype))
                                if self.attention in CHAIN_KINDS else None)
        if length_scale is not None and length_scale not in LENGTH_SCALES:
            raise ValueError(f"length_scale must be None or one of {LENGTH_SCALES}, got {length_scale!r}")
        self.length_scale = length_scale
        # Initialised as in the ASEntmax authors' code (arXiv 2506.16640), which also holds their
        # SSMax baseline: s ~ N(1, 0.01), β ~ U(0.1, 1), γ ~ N(0, 0.1).
        factory = {"device": device, "dtype": dtype}
        self.register_parameter("length_scale_s", nn.Parameter(torch.empty(num_heads, **factory).normal_(1.0, 0.01))
                                if length_scale == "ssmax" else None)
        self.register_parameter("length_scale_beta", nn.Parameter(torch.empty(num_heads, **factory).uniform_(0.1, 1.0))
                                if length_scale == "asentmax" else None)
        self.register_parameter("length_scale_gamma", nn.Parameter(torch.empty(num_heads, **factory).normal_(0.0, 0.1))
                                if length_scale == "asentmax" else None)
        self.register_forward_pre_hook(_keep_torch_fast_paths_off, with_kwargs=True)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, attention="entmax15", alpha_init: float = 1.5,
                   lam: float = 1.0, **score_options) -> "MultiheadEntmaxAttention":
        """A copy of ``module`` (configuration, weights, device, dtype, train/eval mode)
        with the given attention mapping and score options (``window_size``, ``softcap``,
        ``alibi``, ``sinks``: the constructor's)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be an nn.MultiheadAttention, got {type(module).__name__}")
        reference = module.out_proj.weight
        new = cls(module.embed_dim, module.num_heads, dropout=module.dropout,
                  bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
                  add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim,
                  batch_first=module.batch_first, device=reference.device, dtype=reference.dtype,
                  attention=attention, alpha_init=alpha_init, lam=lam, **score_options)
        new.load_state_dict(module.state_dict(), strict=False)
        missing = set(new.state_dict()) - set(module.state_dict()) - set(_OWN_STATE)
        if missing:
            raise RuntimeError(f"cannot copy {type(module).__name__}: its state_dict lacks {sorted(missing)}")
        new.train(module.training)
        return new

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A checkpoint of a plain nn.MultiheadAttention has none of this module's own entries:
        # keep their initial values (α, zero sinks).
        absent = [prefix + name for name in _OWN_STATE if prefix + name not in state_dict]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for key in absent:
            if key in missing_keys:
                missing_keys.remove(key)

    @property
    def alpha(self) -> Optional[Union[float, torch.Tensor]]:
        """The α of the mapping: a float, a tensor (H,) when learned, None for fusedmax, crf and
        sparsemap."""
        if self.attention == "learned":
            return (1.0 + torch.sigmoid(self.alpha_logit)).clamp(LEARNED_ALPHA_MIN, 2.0)
        return {"softmax": 1.0, "sparsemax": 2.0, "entmax15": 1.5, "fusedmax": None, "crf": None,
                "sparsemap": None}.get(self.attention, self.attention)

    def extra_repr(self) -> str:
        extra = f"attention={self.attention!r}"
        if self.attention == "fusedmax":
            extra += f", lam={self.lam}"
        if self.window_size != NO_WINDOW:
            extra += f", window_size={self.window_size}"
        if self.softcap:
            extra += f", softcap={self.softcap}"
        if self.alibi_slopes is not None:
            extra += ", alibi=True"
        if self.sinks is not None:
            extra += ", sinks=True"
        if self.length_scale is not None:
            extra += f", length_scale={self.length_scale!r}"
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, {extra}"

    # ---------------------------------------------------------------------------------
    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """Same arguments and returns as ``nn.MultiheadAttention.forward``:
        ``(attn_output, attn_weights)``; ``attn_weights`` is None unless ``need_weights``,
        else (N, L, S) averaged over heads or (N, H, L, S) with
        ``average_attn_weights=False`` (unbatched inputs drop N)."""
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.is_nested:
                raise ValueError(f"{name} is a nested tensor, which MultiheadEntmaxAttention does not take; "
                                 "build nn.TransformerEncoder with enable_nested_tensor=False (replace_attention "
                                 "does this for you)")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"query, key and value must all be 3-D (batched) or 2-D (unbatched), got shapes "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        check_is_causal(is_causal)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                               "module method `generate_square_subsequent_mask` to create this mask.")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, embed = query.shape
        if embed != self.embed_dim:
            raise ValueError(f"query's embedding size must be embed_dim={self.embed_dim}, got {embed}")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != batch:
            raise ValueError(f"key and value must have query's batch size {batch} and the same length, got "
                             f"shapes {tuple(key.shape)} and {tuple(value.shape)} (batch-first view)")

        q, k, v = self._project(query, key, value)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(batch, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(batch, 1, -1)], dim=1)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        heads, head_dim = self.num_heads, self.head_dim
        q = q.view(batch, tgt_len, heads, head_dim).transpose(1, 2)
        k = k.view(batch, k.shape[1], heads, head_dim).transpose(1, 2)
        v = v.view(batch, v.shape[1], heads, head_dim).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(batch, heads, 1, head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(batch, heads, 1, head_dim)], dim=2)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        src_len = k.shape[2]

        use_causal_kernel = is_causal and not need_weights
        mask = self._merge_masks(None if use_causal_kernel else attn_mask, key_padding_mask, batch, tgt_len,
                                 src_len, q.dtype)
        if self.length_scale is not None:
            q = self._length_scaled(q, mask, use_causal_kernel, tgt_len, src_len)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = self._explicit_attention(q, k, v, mask, dropout_p)
        else:
            out, weights = self._fused_attention(q, k, v, mask, dropout_p, use_causal_kernel), None

        out = self.out_proj(out.transpose(1, 2).reshape(batch, tgt_len, embed))
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _length_scaled(self, q, mask, is_causal, tgt_len, src_len):
        if active_context_parallel() is not None:
            raise ValueError("length_scale counts the keys of the whole sequence, which a rank of "
                             "entmax_fast.distributed.context_parallel does not see")
        n_keys = attended_keys(tgt_len, src_len, is_causal=is_causal, attn_mask=mask, window_size=self.window_size,
                               device=q.device)
        if self.length_scale == "ssmax":
            return length_scaled_query(q, n_keys, "ssmax", s=self.length_scale_s)
        return length_scaled_query(q, n_keys, "asentmax", beta=self.length_scale_beta, gamma=self.length_scale_gamma)

    def _project(self, query, key, value):
        embed = self.embed_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        if self._qkv_same_embed_dim and query is key and key is value:
            # Self-attention: one matmul with the packed weight, as torch does.
            return F.linear(query, self.in_proj_weight, self.in_proj_bias).split(embed, dim=-1)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _merge_masks(self, attn_mask, key_padding_mask, batch, tgt_len, src_len, dtype):
        """One mask broadcastable to (N, H, L, S) in ``entmax_attention``'s convention
        (bool True = attend, float added), or None."""
        heads = self.num_heads
        parts = []
        if attn_mask is not None:
            if attn_mask.dim() == 2 and attn_mask.shape == (tgt_len, src_len):
                parts.append(attn_mask.view(1, 1, tgt_len, src_len))
            elif attn_mask.dim() == 3 and attn_mask.shape == (batch * heads, tgt_len, src_len):
                parts.append(attn_mask.view(batch, heads, tgt_len, src_len))
            elif attn_mask.dim() == 3 and batch == 1 and attn_mask.shape == (heads, tgt_len, src_len):
                parts.append(attn_mask.view(1, heads, tgt_len, src_len))
            else:
                raise ValueError(f"attn_mask must have shape (L, S) = {(tgt_len, src_len)} or (N*num_heads, L, S) = "
                                 f"{(batch * heads, tgt_len, src_len)}, got {tuple(attn_mask.shape)}")
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, src_len):
                raise ValueError(f"key_padding_mask must have shape (N, S) = {(batch, src_len)}, got "
                                 f"{tuple(key_padding_mask.shape)}")
            parts.append(key_padding_mask.view(batch, 1, 1, src_len))
        for part in parts:
            if part.dtype != torch.bool and not part.is_floating_point():
                raise TypeError(f"attn_mask and key_padding_mask must be bool or floating point, got {part.dtype}")
        if not parts:
            return None
        if all(part.dtype == torch.bool for part in parts):
            attend = ~parts[0]
            for part in parts[1:]:
                attend = attend & ~part
            return attend
        merged = _mask_to_float(parts[0], dtype)
        for part in parts[1:]:
            merged = merged + _mask_to_float(part, dtype)
        return merged

    def _score_options(self) -> ScoreOptions:
        """This module's score options (window_size and softcap checked when it was built)."""
        return ScoreOptions(self.window_size, self.softcap, self.alibi_slopes, self.sinks)

    def _fused_attention(self, q, k, v, mask, dropout_p, is_causal):
        score_options = self._score_options()
        options = score_options.keywords()
        parallel = active_context_parallel()
        if parallel is not None:
            if self.attention == "fusedmax" or self.attention in CHAIN_KINDS:
                raise ValueError(f"attention={self.attention!r} does not run under "
                                 "entmax_fast.distributed.context_parallel")
            return parallel(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                            alpha=self._entmax_alpha(q.dtype), **options)
        if self.attention == "softmax" and not score_options.in_use:
            if is_causal and mask is not None:
                # Some SDPA kernels refuse an explicit mask together with is_causal: fold it in.
                causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
                mask = mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, float("-inf"))
                is_causal = False
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        if self.attention in CHAIN_KINDS:
            from .chain import chain_attention

            return chain_attention(self.attention, q, k, v, self.chain_transitions, attn_mask=mask,
                                   is_causal=is_causal, dropout_p=dropout_p)
        if self.attention == "fusedmax":
            from .structured import fusedmax_attention

            return fusedmax_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                      lam=self.lam)
        return entmax_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                alpha=self._entmax_alpha(q.dtype), **options)

    def _entmax_alpha(self, dtype):
        alpha = self.alpha
        return alpha.to(dtype) if isinstance(alpha, torch.Tensor) else alpha

    def _explicit_attention(self, q, k, v, mask, dropout_p):
        """The (N, H, L, S) weights are needed: build the scores, as torch does, with the
        score options in entmax_attention's order (docs/attention.md, "Score options")."""
        if active_context_parallel() is not None:
            raise ValueError("need_weights=True builds this rank's local scores, not the whole sequence's: pass "
                             "need_weights=False under entmax_fast.distributed.context_parallel")
        scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
        if self.softcap:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        tgt_len = scores.shape[-2]
        scores = with_score_options(scores, mask, 0, tgt_len, False, query_length=tgt_len,
                                    window_size=self.window_size, alibi_slopes=self.alibi_slopes)
        if self.sinks is not None:
            weights = self._weights(with_sink(scores, self.sinks))[..., :-1]
        else:
            weights = self._weights(scores)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        return weights @ v, weights

    def _weights(self, scores):
        if self.attention == "softmax":
            # A row whose keys are all masked gets zeros, as on the fused path (torch: NaN).
            alive = (scores != float("-inf")).any(dim=-1, keepdim=True)
            return torch.softmax(scores.masked_fill(~alive, 0.0), dim=-1) * alive
        if self.attention == "sparsemax":
            return sparsemax(scores, dim=-1)
        if self.attention == "entmax15":
            return entmax15(scores, dim=-1)
        if self.attention == "fusedmax":
            from .structured import fusedmax

            return fusedmax(scores, self.lam, dim=-1)
        if self.attention in CHAIN_KINDS:
            from .chain import crf_marginals, sparsemap_marginals

            mapping = crf_marginals if self.attention == "crf" else sparsemap_marginals
            # (H, 2, 2) as (H, 1, 2, 2): one matrix per head over the (N, H, L) rows.
            return mapping(scores, self.chain_transitions.to(scores.dtype).unsqueeze(-3), dim=-1)
        alpha = self.alpha
        if isinstance(alpha, torch.Tensor):
            alpha = alpha.to(scores.dtype).view(1, -1, 1, 1)
        return entmax_bisect(scores, alpha=alpha, dim=-1)


def replace_attention(model: nn.Module, attention="entmax15", *, alpha_init: float = 1.5, lam: float = 1.0,
                      include_ours: bool = False, **score_options) -> nn.Module:
    """Swap every ``nn.MultiheadAttention`` inside ``model`` (in place) for a
    :class:`MultiheadEntmaxAttention` with the same configuration and weights; returns
    ``model``.

    Works for ``nn.Transformer``, ``nn.TransformerEncoder``/``Decoder`` and their layers:
    the encoder's nested-tensor fast path (which would hand nested tensors to the
    attention) is switched off, and each layer's fused softmax kernel is bypassed.
    ``include_ours=True`` also re-creates modules that are already entmax attention
    (to change their mapping); otherwise they are left as they are. ``score_options``
    (``window_size``, ``softcap``, ``alibi``, ``sinks``) go to every new module.

    Examples:
        >>> import torch, entmax_fast
        >>> layer = torch.nn.TransformerEncoderLayer(64, 4, batch_first=True)
        >>> encoder = entmax_fast.replace_attention(torch.nn.TransformerEncoder(layer, 2), attention="learned")
        >>> type(encoder.layers[0].self_attn).__name__
        'MultiheadEntmaxAttention'
        >>> encoder(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.MultiheadAttention):
        raise TypeError("model is itself an nn.MultiheadAttention: use MultiheadEntmaxAttention.from_torch(model)")
    _normalise_attention(attention)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.MultiheadAttention):
                continue
            if isinstance(child, MultiheadEntmaxAttention) and not include_ours:
                continue
            setattr(parent, name, MultiheadEntmaxAttention.from_torch(child, attention=attention,
                                                                      alpha_init=alpha_init, lam=lam,
                                                                      **score_options))
        if isinstance(parent, nn.TransformerEncoder):
            parent.use_nested_tensor = False
    return model
