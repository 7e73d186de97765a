"""Hugging Face ``transformers`` integration: entmax attention as an attention
implementation, selected like ``"sdpa"`` or ``"eager"``::

    import entmax_fast.hf  # registers "entmax" (α = 1.5) and "sparsemax" (α = 2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="entmax")
    model.set_attn_implementation("sparsemax")  # switch an existing model

Any α: ``entmax_fast.hf.register("entmax_1.3", alpha=1.3)``. For the ``"entmax"``
implementation, ``config.entmax_alpha`` (a float) overrides the default 1.5, and an
attention module that has an ``entmax_alpha`` attribute (float, or tensor (num_heads,), e.g.
an ``nn.Parameter`` for learned α) uses it instead — for every implementation this module
registers.

Works with every model whose attention goes through ``AttentionInterface`` (Llama,
Mistral, Qwen, Gemma, BERT, ... in transformers ≥ 5): masks are built as for ``"sdpa"``
(boolean, True = attend), grouped-query attention runs without repeating K/V, causal
masks are top-left aligned exactly as SDPA's. Weights are not returned
(``output_attentions`` gives None, as with ``"sdpa"``); ``softcap`` is not supported.
"""
from __future__ import annotations

import math
from functools import partial

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.utils import logging
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("entmax_fast.hf needs the `transformers` package (>= 5): pip install transformers") from error

from .attention import entmax_attention

__all__ = ["register", "entmax_attention_forward", "DEFAULT_IMPLEMENTATIONS"]

logger = logging.get_logger(__name__)

DEFAULT_IMPLEMENTATIONS = {"entmax": 1.5, "sparsemax": 2.0}


def _alpha_for(module, default_alpha: float, config_override: bool):
    alpha = getattr(module, "entmax_alpha", None)
    if alpha is not None:
        return alpha
    if config_override:
        config_alpha = getattr(getattr(module, "config", None), "entmax_alpha", None)
        if config_alpha is not None:
            return float(config_alpha)
    return default_alpha


def entmax_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, position_bias: torch.Tensor | None = None, *,
                             alpha: float = 1.5, config_override: bool = False, **kwargs):
    """An ``AttentionInterface`` function: query (B, H, Lq, E), key/value (B, Hkv, Lk, E)
    → ((B, Lq, H, E) output, None). Mirrors transformers' ``sdpa_attention_forward`` with
    :func:`entmax_fast.entmax_attention` in place of SDPA."""
    if kwargs.get("softcap") is not None:
        raise ValueError("entmax attention does not support `softcap`")
    if kwargs.get("output_attentions", False):
        logger.warning_once("entmax attention does not return attention weights (output_attentions gives None); "
                            "use MultiheadEntmaxAttention(need_weights=True) or the mappings to inspect them")
    alpha = _alpha_for(module, alpha, config_override)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(device=query.device, dtype=query.dtype)
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As in SDPA's integration: the flag only replaces a mask that was skipped, and never
    # for a single decoding query, which sees every cached key.
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and kv_length > q_length:
        # Prefill into an empty static cache: the keys past the queries are all masked.
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]
    if position_bias is not None:
        attention_mask = _with_position_bias(position_bias, attention_mask, is_causal, q_length, key.shape[2])
        is_causal = False
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    output = entmax_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                              scale=scaling, enable_gqa=key.shape[1] != query.shape[1], alpha=alpha)
    return output.transpose(1, 2).contiguous(), None


def _with_position_bias(position_bias, attention_mask, is_causal, q_length, kv_length):
    """A float mask: the bias where attention is allowed, -inf elsewhere."""
    if attention_mask is None:
        if not is_causal:
            return position_bias
        attention_mask = torch.ones(q_length, kv_length, dtype=torch.bool, device=position_bias.device).tril()
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, -math.inf)
    return position_bias + attention_mask


def register(name: str, alpha: float = 1.5) -> None:
    """Register ``name`` as an ``attn_implementation`` running α-entmax attention (α ≥ 1;
    1 is softmax, 2 sparsemax), with SDPA's mask construction. Idempotent."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 1):
        raise ValueError(f"alpha must be a finite float >= 1, got {alpha!r}")
    function = partial(entmax_attention_forward, alpha=float(alpha), config_override=name == "entmax")
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


for _name, _alpha in DEFAULT_IMPLEMENTATIONS.items():
    register(_name, _alpha)
