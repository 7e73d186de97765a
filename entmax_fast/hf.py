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
Mistral, Qwen, Gemma 2, GPT-OSS, BERT, ... in transformers ≥ 5): masks are built as for
``"sdpa"`` (boolean, True = attend), grouped-query attention runs without repeating K/V,
causal masks are top-left aligned exactly as SDPA's. The attention's own options are
passed on: ``softcap`` (Gemma 2), ``s_aux`` as the sinks (GPT-OSS), ``sliding_window``. A
sliding-window layer gets its window from the mask transformers builds; where that mask
would be the plain causal window (no padding, the last query at the last key) no mask is
built and the layer runs ``window_size=(sliding_window − 1, 0)`` instead. With
``output_attentions=True`` each layer returns its dense weights (B, H, Lq, Lk), computed as
``"eager"`` computes softmax's (:func:`entmax_fast.attention_weights`); the fused path stays
the default.

Decoding with a cache (``generate``, DynamicCache or StaticCache) runs
:func:`entmax_fast.entmax_attention_with_kvcache` on the cache's keys (the cache already
holds the new tokens) instead of a prefill-shaped call with a mask, when every sequence's
valid keys are the positions 0 … n − 1 of the key tensor:

* no mask and one query per sequence (a DynamicCache without padding, or a sliding-window
  layer whose window :func:`entmax_attention_mask` left to the layer): every key, n = Lk;
* a mask that :func:`entmax_attention_mask` built for a step whose queries follow cached
  tokens (q_offset > 0), without padding: plain causal (no chunks or packed sequences) over
  keys from position 0, n = q_offset + Lq (a StaticCache's keys run to its capacity); or the
  plain sliding window with the last query at the last key, n = Lk and the window
  (sliding_window − 1, 0). Decided once per step where the mask is built, from the host's
  offsets and padding as transformers' own mask construction reads them; the per-sequence
  lengths are made on the device.

Anything else takes the masked path: prefill, padded batches (left padding is not a prefix
of the keys), other masks, ``output_attentions``, position biases, context parallelism,
dropout, and inputs that require gradients (the kvcache op is forward-only). The reason is
logged at debug level (``transformers.logging.set_verbosity_debug()``).
``register(..., decode_with_kvcache=False)`` keeps every step on the masked path.
"""
from __future__ import annotations

import math
from functools import partial

import torch
from torch.utils.weak import WeakIdKeyDictionary

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, prepare_padding_mask, sdpa_mask
    from transformers.utils import logging
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("entmax_fast.hf needs the `transformers` package (>= 5): pip install transformers") from error

from .attention import entmax_attention
from .inspection import attention_weights
from .kvcache import entmax_attention_with_kvcache
from .common import NO_WINDOW
from .multihead import active_context_parallel
from .reference.attention import expand_heads

__all__ = ["register", "entmax_attention_forward", "entmax_attention_mask", "DEFAULT_IMPLEMENTATIONS"]

logger = logging.get_logger(__name__)

DEFAULT_IMPLEMENTATIONS = {"entmax": 1.5, "sparsemax": 2.0}

# Masks entmax_attention_mask built for a decoding step whose valid keys are a prefix of the
# keys, with that prefix's length per sequence ((B,) int32) and the window. The route from
# the mask builder to the layers: transformers hands the layers the builder's one output,
# the mask, and nothing else of it, and reading the step off the mask's values would sync
# the device each step. Looked up by identity, so a mask anyone changed on the way takes
# the masked path.
_DECODING_STEP_OF_MASK = WeakIdKeyDictionary()


def _alpha_for(module, default_alpha: float, config_override: bool, query):
    """The module's ``entmax_alpha`` (a tensor moved to the query's device and dtype), else
    ``config.entmax_alpha`` where the implementation allows it, else the default."""
    alpha = getattr(module, "entmax_alpha", None)
    if alpha is None and config_override:
        config_alpha = getattr(getattr(module, "config", None), "entmax_alpha", None)
        alpha = None if config_alpha is None else float(config_alpha)
    if alpha is None:
        alpha = default_alpha
    return alpha.to(device=query.device, dtype=query.dtype) if isinstance(alpha, torch.Tensor) else alpha


def entmax_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, position_bias: torch.Tensor | None = None, *,
                             alpha: float = 1.5, config_override: bool = False, sliding_window: int | None = None,
                             softcap: float | None = None, s_aux: torch.Tensor | None = None,
                             decode_with_kvcache: bool = True, **kwargs):
    """An ``AttentionInterface`` function: query (B, H, Lq, E), key/value (B, Hkv, Lk, E)
    → ((B, Lq, H, E) output, None), or with ``output_attentions`` (output, weights). Mirrors transformers' ``sdpa_attention_forward`` with
    :func:`entmax_fast.entmax_attention` in place of SDPA; ``softcap`` and ``s_aux`` (the
    sinks, (H,)) are entmax_attention's ``softcap`` and ``sinks``. ``sliding_window`` is in
    the mask when there is one (transformers builds it by positions, right for every
    cache); without one (:func:`entmax_attention_mask` left out a plain causal window, the
    last query at the last key) it is the window (sliding_window − 1, 0), bottom-right.
    A decoding step runs :func:`entmax_fast.entmax_attention_with_kvcache` when the module's
    rules allow it (the module docstring), unless ``decode_with_kvcache`` is False."""
    alpha = _alpha_for(module, alpha, config_override, query)
    softcap = 0.0 if softcap is None else softcap
    output_attentions = kwargs.get("output_attentions", False)
    is_causal, window_size = _causal_and_window(module, is_causal, sliding_window, attention_mask)
    if decode_with_kvcache:
        decoding = _decoding_step_of(query, key, value, attention_mask, window_size, dropout, position_bias, alpha,
                                     s_aux, output_attentions)
        if decoding is not None:
            return _decode(query, key, value, decoding, scaling, alpha, softcap, s_aux), None
    # As in SDPA's integration: the flag only replaces a mask that was skipped, and never
    # for a single decoding query, which sees every cached key.
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    key, value, position_bias = _without_empty_static_cache(key, value, position_bias, is_causal, query.shape[2])
    attention_mask, is_causal = _mask_of(attention_mask, position_bias, is_causal, query, key)
    if output_attentions:
        return _with_weights(module, query, key, value, attention_mask, dropout, is_causal, scaling, alpha,
                             window_size, softcap, s_aux)
    return _attend(query, key, value, attention_mask, dropout, is_causal, scaling, alpha, window_size, softcap,
                   s_aux), None


def _causal_and_window(module, is_causal, sliding_window, attention_mask):
    """(is_causal, window_size): the call's flag, else the module's; a sliding window that
    :func:`entmax_attention_mask` left to the layer (no mask) becomes the window, and the
    flag then False."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window is None or attention_mask is not None:
        return is_causal, NO_WINDOW
    # Causal: the window entmax_attention_mask left to the layer, bottom-right. Bidirectional:
    # transformers skips its mask only when the window covers every key; its rule is
    # |i − j| <= sliding_window.
    return False, (sliding_window - 1, 0) if is_causal else (sliding_window, sliding_window)


def _decode(query, key, value, decoding, scaling, alpha, softcap, sinks):
    """The decoding step on the kvcache op: the cache already holds the new tokens."""
    cache_seqlens, window_size = decoding
    output = entmax_attention_with_kvcache(query, key, value, cache_seqlens=cache_seqlens, scale=scaling, alpha=alpha,
                                           window_size=window_size, softcap=softcap, sinks=sinks)
    return output.transpose(1, 2).contiguous()


def _without_empty_static_cache(key, value, position_bias, is_causal, q_length):
    """A causal prefill into an empty static cache: the keys past the queries are all masked,
    and dropped."""
    if is_causal and key.shape[2] > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]
    return key, value, position_bias


def _mask_of(attention_mask, position_bias, is_causal, query, key):
    """(attn_mask, is_causal) for entmax_attention: a position bias folded into a float mask
    (the causal flag with it), a float mask in the query's dtype."""
    if position_bias is not None:
        attention_mask = _with_position_bias(position_bias, attention_mask, is_causal, query.shape[2], key.shape[2])
        is_causal = False
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    return attention_mask, is_causal


def _attend(query, key, value, attention_mask, dropout, is_causal, scaling, alpha, window_size, softcap, sinks):
    """entmax_attention, or the context-parallel attention of an active block; (B, Lq, H, E)."""
    attend = active_context_parallel() or entmax_attention
    output = attend(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                    scale=scaling, enable_gqa=key.shape[1] != query.shape[1], alpha=alpha,
                    window_size=window_size, softcap=softcap, sinks=sinks)
    return output.transpose(1, 2).contiguous()


def _decoding_step_of(query, key, value, attention_mask, window_size, dropout, position_bias, alpha, sinks,
                      output_attentions):
    """(cache_seqlens (B,) int32 valid keys of each sequence, window_size) when this call is a
    decoding step the kvcache op computes exactly (the module docstring's rules), else None
    (the reason logged when the step is a decoding one)."""
    batch, _, q_length, _ = query.shape
    if attention_mask is None:
        if q_length != 1:
            return None  # a prefill: causal among all its tokens
        decoding = None
    else:
        decoding = _DECODING_STEP_OF_MASK.get(attention_mask)
        if decoding is None or attention_mask.shape[-2:] != (q_length, key.shape[2]):
            return None  # prefill, padding or another mask: entmax_attention_mask logged why
    reason = None
    if output_attentions:
        reason = "output_attentions=True returns dense weights"
    elif position_bias is not None:
        reason = "a position bias is added to the scores"
    elif active_context_parallel() is not None:
        reason = "context parallelism shards the sequence"
    elif dropout:
        reason = "dropout on the weights"
    elif torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                         for t in (query, key, value, sinks, alpha)):
        reason = "inputs require gradients and the kvcache op is forward-only"
    if reason is not None:
        logger.debug("entmax attention: decoding step on the masked path: %s", reason)
        return None
    if decoding is None:
        return torch.full((batch,), key.shape[2], dtype=torch.int32, device=query.device), window_size
    return decoding


def _with_weights(module, query, key, value, attention_mask, dropout, is_causal, scaling, alpha, window_size, softcap,
                  sinks):
    """The output and the dense (B, H, Lq, Lk) weights, computed as ``"eager"`` does (weights,
    dropout on them in training, then weights @ value): for ``output_attentions`` only."""
    if active_context_parallel() is not None:
        raise ValueError("output_attentions=True is not supported under entmax_fast.distributed.context_parallel "
                         "(each rank holds a shard of the rows)")
    weights = attention_weights(query, key, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
                                enable_gqa=key.shape[1] != query.shape[1], alpha=alpha, window_size=window_size,
                                softcap=0.0 if softcap is None else softcap, sinks=sinks)
    dropped = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return (dropped @ expand_heads(value, query.shape[1])).transpose(1, 2).contiguous(), weights


def _is_causal_sliding_window(mask_function, window: int) -> bool:
    """Whether ``mask_function`` (transformers' index-based form) is the plain causal sliding
    window of ``window`` keys, ``i − window < j <= i``, read off a few of its rows (O(window)
    work): a chunked or otherwise composed mask differs on them."""
    queries = torch.tensor([0, window - 1, window + 1, 2 * window + 3]).view(-1, 1)
    keys = torch.arange(2 * window + 5).view(1, -1)
    expected = (keys > queries - window) & (keys <= queries)
    try:
        got = mask_function(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), queries, keys)
    except (IndexError, RuntimeError, TypeError):
        return False  # not index-based at these positions: not the plain window
    return isinstance(got, torch.Tensor) and got.shape == expected.shape and bool((got == expected).all())


def entmax_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                          mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
                          local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs):
    """The ``AttentionMaskInterface`` function of the implementations registered here:
    transformers' ``sdpa_mask``, except for a sliding-window layer (``local_size``). There a
    plain causal window without padding whose last query sits at the last key gives None,
    and :func:`entmax_attention_forward` runs the window itself (no (B, 1, Lq, Lk) mask);
    any other sliding-window mask is built, never skipped for ``is_causal``, which could not
    carry the window. A mask built for a decoding step whose valid keys are a prefix of the
    keys (the module docstring) is noted, for the layers to run the kvcache op instead.

    Under ``entmax_fast.distributed.context_parallel`` the inputs are shards of one
    sequence, so a mask built from their local positions would be wrong (the balanced
    layout's positions even look like packed sequences): none is built and the layer runs
    the whole sequence's causal (or bidirectional) attention. Padding is refused there."""
    if active_context_parallel() is not None:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask with padding is not supported under "
                             "entmax_fast.distributed.context_parallel: pass unpadded sequences and no mask")
        return None
    compiling = torch.compiler.is_compiling()
    if isinstance(q_offset, torch.Tensor) and q_offset.dim() == 0 and not compiling:
        q_offset = int(q_offset)  # a StaticCache's: read once per step, as transformers' mask construction does
    if local_size is None:
        mask = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
        plain = mask_function is causal_mask_function
    else:
        plain = not compiling and isinstance(q_offset, int) and isinstance(kv_offset, int) \
            and q_offset + q_length == kv_offset + kv_length \
            and _unpadded(attention_mask, kv_length, kv_offset, kv_offset, kv_offset + kv_length) \
            and _is_causal_sliding_window(mask_function, local_size)
        if plain and allow_is_causal_skip:
            return None
        mask = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         local_size=local_size, allow_is_causal_skip=False, **kwargs)
    if mask is not None and not compiling and isinstance(q_offset, int) and q_offset > 0:
        decoding = _decoding_step(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, local_size,
                                  plain, mask.device)
        if decoding is not None:
            _DECODING_STEP_OF_MASK[mask] = decoding
    return mask


def _unpadded(attention_mask, kv_length, kv_offset, start, stop) -> bool:
    """Whether the 2-D padding mask holds no padding at positions start … stop − 1."""
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    return padding is None or bool(padding[:, start:stop].all())


def _decoding_step(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, local_size, plain, device):
    """For a decoding step (the queries follow cached tokens) whose mask is
    :func:`entmax_attention_with_kvcache`'s: (cache_seqlens (B,) int32, window_size). Full
    attention: plain causal, no padding among the keys 0 … q_offset + Lq − 1 of keys starting
    at position 0 → q_offset + Lq. A sliding window: the plain window (``plain``) → every key,
    window (local_size − 1, 0). Else None, the reason logged at debug level."""
    reason = None
    if not plain:
        reason = "the mask is not a plain causal one or window, or there is padding"
    elif local_size is not None:
        return torch.full((batch_size,), kv_length, dtype=torch.int32, device=device), (local_size - 1, 0)
    elif kv_offset != 0 or q_offset + q_length > kv_length:
        reason = f"the keys are not positions 0 … {q_offset + q_length - 1} (kv_offset {kv_offset})"
    elif not _unpadded(attention_mask, kv_length, kv_offset, 0, q_offset + q_length):
        reason = "padding: the valid keys are not a prefix of the cache"
    if reason is not None:
        logger.debug("entmax attention: decoding step on the masked path: %s", reason)
        return None
    return torch.full((batch_size,), q_offset + q_length, dtype=torch.int32, device=device), NO_WINDOW


def _with_position_bias(position_bias, attention_mask, is_causal, q_length, kv_length):
    """A float mask: the bias where attention is allowed, -inf elsewhere."""
    if attention_mask is None:
        if not is_causal:
            return position_bias
        attention_mask = torch.ones(q_length, kv_length, dtype=torch.bool, device=position_bias.device).tril()
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, -math.inf)
    return position_bias + attention_mask


def register(name: str, alpha: float = 1.5, *, decode_with_kvcache: bool = True) -> None:
    """Register ``name`` as an ``attn_implementation`` running α-entmax attention (α ≥ 1;
    1 is softmax, 2 sparsemax), with SDPA's mask construction (:func:`entmax_attention_mask`).
    ``decode_with_kvcache=False`` keeps decoding steps on the masked prefill-shaped call
    instead of :func:`entmax_fast.entmax_attention_with_kvcache`. Idempotent.

    Examples:
        >>> import torch, transformers, entmax_fast.hf
        >>> entmax_fast.hf.register("entmax_1.3", alpha=1.3)
        >>> config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
        ...                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="entmax_1.3")
        >>> model(torch.tensor([[1, 5, 7]])).logits.shape
        torch.Size([1, 3, 100])
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 1):
        raise ValueError(f"alpha must be a finite float >= 1, got {alpha!r}")
    if not isinstance(decode_with_kvcache, bool):
        raise TypeError(f"decode_with_kvcache must be a bool, got {decode_with_kvcache!r}")
    function = partial(entmax_attention_forward, alpha=float(alpha), config_override=name == "entmax",
                       decode_with_kvcache=decode_with_kvcache)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, entmax_attention_mask)


for _name, _alpha in DEFAULT_IMPLEMENTATIONS.items():
    register(_name, _alpha)
