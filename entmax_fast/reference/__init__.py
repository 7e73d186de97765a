"""Plain-torch reference implementations: exact, float64-capable, the tests' ground truth.

The reference never imports a kernel or the compiled extension.
"""
from .mappings import entmax_backward, entmax_forward

__all__ = ["entmax_forward", "entmax_backward"]
