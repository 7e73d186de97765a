"""nn modules: the mappings (drop-in for ``entmax``'s modules) and multi-head entmax attention."""
from __future__ import annotations

from torch import nn

from .mappings import budget_bisect, entmax15, entmax_bisect, normmax_bisect, sparsemax, sparsemax_bisect
from .multihead import MultiheadEntmaxAttention, replace_attention

__all__ = ["Sparsemax", "Entmax15", "EntmaxBisect", "SparsemaxBisect", "NormmaxBisect", "BudgetBisect",
           "MultiheadEntmaxAttention", "replace_attention"]


class Sparsemax(nn.Module):
    def __init__(self, dim=-1, k=None):
        super().__init__()
        self.dim = dim
        self.k = k

    def forward(self, X):
        return sparsemax(X, dim=self.dim, k=self.k)


class Entmax15(nn.Module):
    def __init__(self, dim=-1, k=None):
        super().__init__()
        self.dim = dim
        self.k = k

    def forward(self, X):
        return entmax15(X, dim=self.dim, k=self.k)


class EntmaxBisect(nn.Module):
    """α-entmax module; ``alpha`` may be a float, a tensor or an ``nn.Parameter`` (learned)."""

    def __init__(self, alpha=1.5, dim=-1, n_iter=50):
        super().__init__()
        self.dim = dim
        self.n_iter = n_iter
        self.alpha = alpha

    def forward(self, X):
        return entmax_bisect(X, alpha=self.alpha, dim=self.dim, n_iter=self.n_iter)


class SparsemaxBisect(nn.Module):
    def __init__(self, dim=-1, n_iter=None):
        super().__init__()
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X):
        return sparsemax_bisect(X, dim=self.dim)



class NormmaxBisect(nn.Module):
    def __init__(self, alpha=2, dim=-1, n_iter=50):
        super().__init__()
        self.alpha = alpha
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X):
        return normmax_bisect(X, alpha=self.alpha, dim=self.dim)


class BudgetBisect(nn.Module):
    def __init__(self, budget=2, dim=-1, n_iter=50):
        super().__init__()
        self.budget = budget
        self.dim = dim
        self.n_iter = n_iter

    def forward(self, X):
        return budget_bisect(X, budget=self.budget, dim=self.dim)
