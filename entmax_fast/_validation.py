"""Argument checks shared by the public functions: one message style, argument named,
expected vs got. Value checks on tensors never sync a GPU (``torch._assert_async``)."""
from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from typing import Optional

import torch

from .common import NO_WINDOW, SCORE_ALIBI, SCORE_SINK, SCORE_SOFTCAP, SCORE_WINDOW


def check_floating(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {tensor.dtype}")


def check_dim(name: str, tensor: torch.Tensor, dim: int) -> int:
    if not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"dim must be in [{-tensor.dim()}, {tensor.dim() - 1}] for {name} of shape "
                         f"{tuple(tensor.shape)}, got {dim}")
    return dim % tensor.dim()


def _assert_values(condition: torch.Tensor, message: str, got=None) -> None:
    """Raise ValueError eagerly on CPU; on GPUs and under torch.compile check without a
    host sync (the error then surfaces asynchronously). ``got``: an optional callable whose
    text ends the CPU message (the offending values, read only once the check failed)."""
    if condition.device.type == "meta":
        return
    if condition.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(condition.all()):
            raise ValueError(message if got is None else f"{message}, got {got()}")
    else:
        torch._assert_async(condition.all(), message)


def check_like(names, tensors, ref_name: str, ref: torch.Tensor, prefix: str = "") -> None:
    """Every tensor has ``ref``'s dtype (else TypeError, as a mixed-dtype SDPA call fails)
    and device (else ValueError)."""
    for name, tensor in zip(names, tensors):
        if tensor.dtype != ref.dtype:
            raise TypeError(f"{prefix}{name} must have {ref_name}'s dtype {ref.dtype}, got {tensor.dtype}")
        if tensor.device != ref.device:
            raise ValueError(f"{prefix}{name} must be on {ref_name}'s device {ref.device}, got {tensor.device}")


def check_gqa_heads(heads: int, kv_heads: int, enable_gqa: bool, prefix: str = "") -> None:
    """Query heads against key/value heads: equal, or with ``enable_gqa`` a divisor."""
    if kv_heads == heads:
        return
    if not enable_gqa:
        raise ValueError(f"{prefix}key/value have {kv_heads} heads but query has {heads}; pass enable_gqa=True "
                         "for grouped-query attention")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"{prefix}query heads ({heads}) must be divisible by key/value heads ({kv_heads}) "
                         "for grouped-query attention")


def check_scale(scale, prefix: str = ""):
    """An attention's score scale: None (the caller's default) or a finite real number.
    0 and negative values are accepted, as SDPA accepts them: the scores are scale·QKᵀ (0
    scores every key alike; a negative scale is the positive one with the query negated)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.Tensor)) or (
            isinstance(scale, torch.Tensor) and (scale.numel() != 1 or scale.is_complex())):
        raise TypeError(f"{prefix}scale must be a real number or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"{prefix}scale must be a finite number or None, got {value}")
    return value


def check_is_causal(is_causal, prefix: str = "") -> bool:
    """``is_causal`` must be a Python bool, as SDPA requires: a number in its place is
    usually a scale passed by position (``(q, k, v, None, 0.0, 0.125)``), and a numpy bool or
    a bool tensor is refused there too."""
    if not isinstance(is_causal, bool):
        kind = type(is_causal)
        # numpy's bool is named "bool" too: its module tells it from Python's.
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{prefix}is_causal must be a bool (as in torch.nn.functional.scaled_dot_product_attention), "
                        f"got {name}")
    return is_causal


def check_dropout(dropout_p, prefix: str = "") -> float:
    value = float(dropout_p)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{prefix}dropout_p must be in [0, 1), got {dropout_p}")
    return value


def check_alpha_float(alpha: float, minimum: float, inclusive: bool, what: str = "alpha") -> float:
    alpha = float(alpha)
    bad = not math.isfinite(alpha) or (alpha < minimum if inclusive else alpha <= minimum)
    if bad:
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise ValueError(f"{what} must be finite and {bound}, got {alpha}")
    return alpha


def check_alpha_tensor(alpha: torch.Tensor, minimum: float, inclusive: bool, like: torch.Tensor,
                       what: str = "alpha") -> None:
    if not alpha.is_floating_point():
        raise TypeError(f"{what} must be a float or a floating-point tensor, got dtype {alpha.dtype}")
    if alpha.device != like.device:
        raise ValueError(f"{what} must be on the input's device {like.device}, got {alpha.device}")
    bound = f">= {minimum}" if inclusive else f"> {minimum}"
    # Two comparisons also refuse NaN and ±inf: torch.isfinite is four operations (four
    # kernel launches on a GPU, a third of this check's host time on a CPU).
    ok = (alpha >= minimum) if inclusive else (alpha > minimum)
    _assert_values(ok & (alpha < math.inf), f"{what} must be finite and {bound} everywhere")


def check_dropout_scale_alpha(dropout_p, scale, alpha, heads, like):
    """An attention's dropout_p, scale and α (a float >= 1, or a 0-d or (H,) tensor):
    returns alpha as a float or the tensor."""
    check_dropout(dropout_p)
    check_scale(scale)
    if isinstance(alpha, torch.Tensor):
        if alpha.dim() > 1 or (alpha.dim() == 1 and alpha.shape[0] != heads):
            raise ValueError(f"alpha must be a float, a 0-d tensor or a tensor of shape (H,) = ({heads},), "
                             f"got shape {tuple(alpha.shape)}")
        check_alpha_tensor(alpha, 1.0, inclusive=True, like=like)
        return alpha
    return check_alpha_float(alpha, 1.0, inclusive=True)


def check_window_size(window_size) -> tuple[int, int]:
    """FlashAttention's (left, right): ints >= -1, -1 unbounded."""
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {type(window_size).__name__}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {len(window_size)} values")
    for bound in window_size:
        if isinstance(bound, bool) or not isinstance(bound, numbers.Integral):
            raise TypeError(f"window_size must hold ints (-1 = unbounded), got {type(bound).__name__} "
                            f"in {tuple(window_size)!r}")
        if bound < -1:
            raise ValueError(f"window_size values must be >= -1 (-1 = unbounded), got {tuple(window_size)!r}")
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 = no capping), got {type(softcap).__name__}")
    value = float(softcap)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 = no capping), got {value}")
    return value


def _check_head_tensor(name, tensor, shapes, like_name, like):
    """alibi_slopes or sinks: a float32 tensor or one of the query's dtype, on its device,
    of one of ``shapes``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32 and tensor.dtype != like.dtype:
        raise TypeError(f"{name} must be float32 or have {like_name}'s dtype {like.dtype}, got {tensor.dtype}")
    if tensor.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device {like.device}, got {tensor.device}")
    if tuple(tensor.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {tuple(tensor.shape)}")


# The score options by their dispatch.Request flag (set only when the option is in use), with
# the name a backend's refusal gives each (backends.unimplemented_score_options).
SCORE_OPTIONS = {
    "window": "window_size",
    "lower_right_causal": "a lower-right causal mask (CausalBias causal_lower_right with Lq != Lk)",
    "softcap": "softcap",
    "alibi_slopes": "alibi_slopes",
    "sinks": "sinks",
}


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreOptions:
    """An attention call's score options (docs/attention.md, "Score options"), checked once
    by :func:`check_score_options`; the one place that says which are in use, what the
    kernels are compiled with, and the window a lower-right causal mask amounts to.

    window_size: (left, right) ints, -1 unbounded; softcap: float, 0 none; alibi_slopes:
    None, (H,) or (B, H); sinks: None or (H,); lower_right: a lower-right causal mask with
    Lq != Lk (the window's right bound 0). Immutable, so torch.compile traces it as a
    constant but for its tensors; custom ops take it flat (:meth:`flat`, :meth:`from_flat`).
    """
    window_size: tuple = NO_WINDOW
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    lower_right: bool = False

    @property
    def window_bounds(self) -> tuple:
        """The (left, right) bounds the scores are masked to: window_size, with the right
        bound 0 under a lower-right causal mask (pos - left <= j <= pos)."""
        return (self.window_size[0], 0) if self.lower_right else self.window_size

    @property
    def in_use(self) -> tuple:
        """The options in use, as their SCORE_OPTIONS flags, in that order."""
        used = {"window": self.window_size != NO_WINDOW, "lower_right_causal": self.lower_right,
                "softcap": self.softcap > 0, "alibi_slopes": self.alibi_slopes is not None,
                "sinks": self.sinks is not None}
        return tuple(flag for flag in SCORE_OPTIONS if used[flag])

    def request_flags(self) -> dict:
        """The dispatch.Request options of the options in use: only those in use are set, so
        that a call without options is memoised under the key it has without them."""
        return {flag: True for flag in self.in_use}

    @property
    def kernel_bits(self) -> int:
        """The fused kernels' OPTIONS (common.SCORE_*): the window when window_bounds bound
        anything (a lower-right causal mask included), the softcap, ALiBi, the sink."""
        return ((SCORE_WINDOW if self.window_bounds != NO_WINDOW else 0) | (SCORE_SOFTCAP if self.softcap > 0 else 0)
                | (SCORE_ALIBI if self.alibi_slopes is not None else 0) | (SCORE_SINK if self.sinks is not None else 0))

    def with_tensors(self, alibi_slopes, sinks) -> "ScoreOptions":
        """The same options holding these tensors (those an autograd.Function received, or
        None while the tensors are saved for the backward)."""
        return ScoreOptions(self.window_size, self.softcap, alibi_slopes, sinks, self.lower_right)

    def keywords(self) -> dict:
        """The options as entmax_attention's keywords (and the reference's), a lower-right
        causal mask as the window's right bound 0."""
        return {"window_size": self.window_bounds, "softcap": self.softcap, "alibi_slopes": self.alibi_slopes,
                "sinks": self.sinks}

    def flat(self) -> tuple:
        """(window_left, window_right, softcap, alibi_slopes, sinks), the lower-right mask as
        the window's right bound: the arguments of a custom op's schema."""
        left, right = self.window_bounds
        return int(left), int(right), float(self.softcap), self.alibi_slopes, self.sinks

    @classmethod
    def from_flat(cls, window_left, window_right, softcap, alibi_slopes, sinks) -> "ScoreOptions":
        """The options a custom op received flat (:meth:`flat`)."""
        return cls((int(window_left), int(window_right)), float(softcap), alibi_slopes, sinks)


def check_score_options(window_size, softcap, alibi_slopes, sinks, batch, heads, like_name, like,
                        lower_right=False) -> ScoreOptions:
    """The score options shared by the attention forms, checked, as a :class:`ScoreOptions`
    (``lower_right``: a lower-right causal mask with Lq != Lk, already resolved)."""
    window_size = check_window_size(window_size)
    softcap = check_softcap(softcap)
    if alibi_slopes is not None:
        _check_head_tensor("alibi_slopes", alibi_slopes, ((heads,), (batch, heads)), like_name, like)
        if alibi_slopes.requires_grad:
            # FlashAttention gives the slopes no gradient either: refused rather than silently left without one.
            raise ValueError("alibi_slopes are not differentiated; pass a tensor that does not require grad "
                             "(e.g. alibi_slopes.detach())")
    if sinks is not None:
        _check_head_tensor("sinks", sinks, ((heads,),), like_name, like)
    return ScoreOptions(window_size, softcap, alibi_slopes, sinks, bool(lower_right))


def causal_bias(attn_mask):
    """The ``torch.nn.attention.bias.CausalBias`` passed as attn_mask, else None. Looked up,
    not imported: that module imports torch._dynamo (seconds), and a CausalBias exists only
    once it is imported."""
    if attn_mask is None or type(attn_mask) is torch.Tensor:
        return None
    bias_module = sys.modules.get("torch.nn.attention.bias")
    if bias_module is not None and isinstance(attn_mask, bias_module.CausalBias):
        return attn_mask
    return None


def mapping_alpha(alpha, X: torch.Tensor, dim: int):
    """Validate α of a row-wise mapping: a float > 0, or a tensor broadcastable to X with
    size 1 along ``dim``; returns a float or a tensor expanded to that keepdim shape."""
    if not isinstance(alpha, torch.Tensor):
        return check_alpha_float(alpha, 0.0, inclusive=False)
    check_alpha_tensor(alpha, 0.0, inclusive=False, like=X)
    return expand_to_rows(alpha, X, dim, "alpha must be")


def expand_to_rows(tensor: torch.Tensor, X: torch.Tensor, dim: int, subject: str, suffix: str = ""):
    """A per-row parameter (α, budget) expanded to X's shape with size 1 along ``dim``, or a
    ValueError "<subject> broadcastable to ...<suffix>" when it does not broadcast there."""
    row_shape = list(X.shape)
    row_shape[dim] = 1
    if list(tensor.shape) == row_shape:
        return tensor  # a view would change nothing and costs µs of host time per call
    padded = [1] * (X.dim() - tensor.dim()) + list(tensor.shape)
    if tensor.dim() > X.dim() or any(a not in (1, r) for a, r in zip(padded, row_shape)):
        raise ValueError(f"{subject} broadcastable to {tuple(row_shape)} (X's shape with size 1 along dim={dim})"
                         f"{suffix}, got shape {tuple(tensor.shape)}")
    return tensor.reshape(padded).expand(row_shape)


def check_backend_dtype(choice, tensor: torch.Tensor) -> None:
    """Refuse the combinations a backend would answer wrongly instead of failing: bf16 in the
    Triton interpreter (its bf16 ``tl.dot`` is off by orders of magnitude in triton 3.9)."""
    if choice.backend == "triton" and tensor.device.type == "cpu" and tensor.dtype == torch.bfloat16:
        raise TypeError(f"{choice.op}: the Triton backend on CPU tensors (the interpreter) gives wrong bfloat16 "
                        "results; use float32/float16, or the cpp/reference backend for bfloat16 on CPU")


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on the first-order gradients whose own backward raises: differentiating them
    again fails loudly instead of silently dropping a term."""

    @staticmethod
    def forward(ctx, what, n_grads, *tensors):
        ctx.what = what
        return tuple(t.clone() for t in tensors[:n_grads])

    @staticmethod
    def backward(ctx, *grads_of_grads):
        raise RuntimeError(f"{ctx.what} is only once differentiable: double backward (create_graph=True through "
                           "its backward, gradgradcheck, Hessian-vector products) is not supported")


def once_differentiable_grads(what: str, grads, inputs):
    """A backward's outputs ``grads``, unchanged; under ``create_graph=True`` they hang on a
    graph node that raises a clear error when anything differentiates them again.

    ``inputs`` are the forward's saved inputs: the gradients depend on them, so the node is
    attached to them even when the incoming gradient is a constant (torch's
    ``once_differentiable`` misses that case, e.g. the Hessian of ``v·f(x)``). None entries
    stay None.
    """
    if not torch.is_grad_enabled():
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    sources = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not present:
        return grads
    wrapped = _NoDoubleBackward.apply(what, len(present), *(grads[i] for i in present), *sources)
    out = list(grads)
    for i, g in zip(present, wrapped):
        out[i] = g
    return tuple(out)
