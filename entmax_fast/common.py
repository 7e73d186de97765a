"""What every layer shares: the kinds that specialise kernels, the compute dtype and the
per-row / per-head α vector. Defined here once; the Triton kernels read the kinds as
constexprs (``triton_kernels/kinds.py``) and the C++ sources mirror them in
``csrc/common/kinds.h`` (``tests/test_architecture.py`` checks the two agree).

This module imports only torch: every other module of the package may import it.
"""
from __future__ import annotations

import torch

# ALPHA_*: how α enters a kernel. A python-float α of 1, 1.5 or 2 has a closed form and is
# compiled in; any other α, and every α tensor, is read per row (or per head) at run time.
ALPHA_GENERAL = 0
ALPHA_SOFTMAX = 1
ALPHA_ENTMAX15 = 2
ALPHA_SPARSEMAX = 3

# MASK_*: how attn_mask enters the attention scores.
MASK_NONE = 0
MASK_BOOL = 1
MASK_ADDITIVE = 2

# GRAD_*: what an attention forward keeps for the backward: nothing, what q, k, v need, or
# that and what dα needs (the row entropy).
GRAD_NONE = 0
GRAD_INPUTS = 1
GRAD_ALPHA = 2

# window_size (left, right) that bounds nothing: FlashAttention's -1 = unbounded.
NO_WINDOW = (-1, -1)

# SCORE_*: the score options a fused attention kernel is compiled with (its OPTIONS, a sum of
# these; _validation.ScoreOptions.kernel_bits): each adds its work only where set.
SCORE_WINDOW = 1
SCORE_SOFTCAP = 2
SCORE_ALIBI = 4
SCORE_SINK = 8

# PROX_*: the proximal operator of a structured mapping (fusedmax: TV, oscarmax: OSCAR).
PROX_TV = 0
PROX_OSCAR = 1


def alpha_kind(alpha) -> int:
    """The ALPHA_* kind of an α (a python float, or a tensor: always ALPHA_GENERAL)."""
    if isinstance(alpha, torch.Tensor):
        return ALPHA_GENERAL
    return {1.0: ALPHA_SOFTMAX, 1.5: ALPHA_ENTMAX15, 2.0: ALPHA_SPARSEMAX}.get(float(alpha), ALPHA_GENERAL)


def mask_kind(attn_mask) -> int:
    if attn_mask is None:
        return MASK_NONE
    return MASK_BOOL if attn_mask.dtype == torch.bool else MASK_ADDITIVE


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic runs in: float64 for float64 inputs, float32 otherwise
    (float16 and bfloat16 are computed in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def alpha_vector(alpha, count: int, device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """α as a (count,) tensor of ``dtype`` on ``device``, one per row or head: a python float
    is repeated (float64 keeps it exact), a one-element tensor expanded, a (count,) tensor
    converted (differentiably). Shapes are the public layer's to check."""
    if isinstance(alpha, torch.Tensor):
        return alpha.to(device=device, dtype=dtype).reshape(-1).expand(count)
    return torch.full((count,), float(alpha), dtype=dtype, device=device)


def per_head_alpha(alpha, heads: int):
    """A 0-d or one-element α tensor expanded to (H,), a float unchanged: every attention
    backend takes a float or an (H,) tensor."""
    return alpha_vector(alpha, heads, alpha.device, alpha.dtype) if isinstance(alpha, torch.Tensor) else alpha
