"""nn modules: the mappings (drop-in for ``entmax``'s modules) and multi-head entmax attention."""
from __future__ import annotations

from torch import nn

from .mappings import budget_bisect, entmax15, entmax_bisect, normmax_bisect, sparsemax, sparsemax_bisect
from .multihead import MultiheadEntmaxAttention, replace_attention

__all__ = ["Sparsemax", "Entmax15", "EntmaxBisect", "SparsemaxBisect", "NormmaxBisect", "BudgetBisect",
           "MultiheadEntmaxAttention", "replace_attention"]


class Sparsemax(nn.Module):
    """:func:`entmax_fast.sparsemax` along ``dim`` as a module (``entmax.Sparsemax``).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.Sparsemax(dim=-1)(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.6000, 0.4000, 0.0000, 0.0000]])
    """

    def __init__(self, dim=-1, k=None):
        super().__init__()
        self.dim = dim
        self.k = k

    def forward(self, X):
        return sparsemax(X, dim=self.dim, k=self.k)


class Entmax15(nn.Module):
    """:func:`entmax_fast.entmax15` along ``dim`` as a module (``entmax.Entmax15``).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.Entmax15(dim=-1)(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.5292, 0.3937, 0.0770, 0.0000]])
    """

    def __init__(self, dim=-1, k=None):
        super().__init__()
        self.dim = dim
        self.k = k

    def forward(self, X):
        return entmax15(X, dim=self.dim, k=self.k)


class EntmaxBisect(nn.Module):
    """α-entmax module; ``alpha`` may be a float, a tensor or an ``nn.Parameter`` (learned).

    Examples:
        >>> import torch, entmax_fast
        >>> mapping = entmax_fast.EntmaxBisect(alpha=torch.nn.Parameter(torch.tensor(1.25)))
        >>> mapping(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.4787, 0.3736, 0.1356, 0.0121]], grad_fn=<EntmaxFunctionBackward>)
    """

    def __init__(self, alpha=1.5, dim=-1, n_iter=50):
        super().__init__()
        self.dim = dim
        self.n_iter = n_iter
        self.alpha = alpha

    def forward(self, X):
        return entmax_bisect(X, alpha=self.alpha, dim=self.dim, n_iter=self.n_iter)


class SparsemaxBisect(nn.Module):
    """:func:`entmax_fast.sparsemax_bisect` along ``dim`` as a module (``entmax.SparsemaxBisect``).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.SparsemaxBisect()(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.6000, 0.4000, 0.0000, 0.0000]])
    """

    def __init__(self, dim=-1, n_iter=None):
        super().__init__()
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X):
        return sparsemax_bisect(X, dim=self.dim)



class NormmaxBisect(nn.Module):
    """:func:`entmax_fast.normmax_bisect` along ``dim`` as a module (``entmax.NormmaxBisect``).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.NormmaxBisect(alpha=2)(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.5714, 0.4286, 0.0000, 0.0000]])
    """

    def __init__(self, alpha=2, dim=-1, n_iter=50):
        super().__init__()
        self.alpha = alpha
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X):
        return normmax_bisect(X, alpha=self.alpha, dim=self.dim)


class BudgetBisect(nn.Module):
    """:func:`entmax_fast.budget_bisect` along ``dim`` as a module (``entmax.BudgetBisect``).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.BudgetBisect(budget=2)(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[1.0000, 0.8500, 0.1500, 0.0000]])
    """

    def __init__(self, budget=2, dim=-1, n_iter=50):
        super().__init__()
        self.budget = budget
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X):
        return budget_bisect(X, budget=self.budget, dim=self.dim)
