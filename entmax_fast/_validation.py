"""Argument checks shared by the public functions: one message style, argument named,
expected vs got. Value checks on tensors never sync a GPU (``torch._assert_async``)."""
from __future__ import annotations

import math

import torch


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


def _assert_values(condition: torch.Tensor, message: str) -> None:
    """Raise ValueError eagerly on CPU; on GPUs and under torch.compile check without a
    host sync (the error then surfaces asynchronously)."""
    if condition.device.type == "meta":
        return
    if condition.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(condition.all()):
            raise ValueError(message)
    else:
        torch._assert_async(condition.all(), message)


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
    ok = (alpha >= minimum) if inclusive else (alpha > minimum)
    _assert_values(ok & torch.isfinite(alpha), f"{what} must be finite and {bound} everywhere")


def mapping_alpha(alpha, X: torch.Tensor, dim: int):
    """Validate α of a row-wise mapping: a float > 0, or a tensor broadcastable to X with
    size 1 along ``dim``; returns a float or a tensor expanded to that keepdim shape."""
    if not isinstance(alpha, torch.Tensor):
        return check_alpha_float(alpha, 0.0, inclusive=False)
    check_alpha_tensor(alpha, 0.0, inclusive=False, like=X)
    row_shape = list(X.shape)
    row_shape[dim] = 1
    if alpha.dim() > X.dim():
        raise ValueError(f"alpha must be broadcastable to {tuple(row_shape)} (X's shape with size 1 "
                         f"along dim={dim}), got shape {tuple(alpha.shape)}")
    padded = [1] * (X.dim() - alpha.dim()) + list(alpha.shape)
    if any(a not in (1, r) for a, r in zip(padded, row_shape)):
        raise ValueError(f"alpha must be broadcastable to {tuple(row_shape)} (X's shape with size 1 "
                         f"along dim={dim}), got shape {tuple(alpha.shape)}")
    return alpha.reshape(padded).expand(row_shape)
