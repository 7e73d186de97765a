"""The kinds of ``entmax_fast.common`` (ALPHA_*, MASK_*, GRAD_*) as ``tl.constexpr`` values.

A @triton.jit body may read a global only when it is a constexpr, so the kernels compare
their kind parameters against these; host code (launchers, AOT tables) uses the plain
integers of ``entmax_fast.common``, which these wrap: the two cannot disagree.
"""
import triton.language as tl

from .. import common

ALPHA_GENERAL = tl.constexpr(common.ALPHA_GENERAL)
ALPHA_SOFTMAX = tl.constexpr(common.ALPHA_SOFTMAX)
ALPHA_ENTMAX15 = tl.constexpr(common.ALPHA_ENTMAX15)
ALPHA_SPARSEMAX = tl.constexpr(common.ALPHA_SPARSEMAX)
# Not a launch's kind: the passes a general-kind attention kernel compiles for a head whose
# alpha is above 2 (triton_kernels/attention_common.py, "A per-head alpha").
ALPHA_ABOVE_TWO = tl.constexpr(-1)

MASK_NONE = tl.constexpr(common.MASK_NONE)
MASK_BOOL = tl.constexpr(common.MASK_BOOL)
MASK_ADDITIVE = tl.constexpr(common.MASK_ADDITIVE)

GRAD_NONE = tl.constexpr(common.GRAD_NONE)
GRAD_INPUTS = tl.constexpr(common.GRAD_INPUTS)
GRAD_ALPHA = tl.constexpr(common.GRAD_ALPHA)
