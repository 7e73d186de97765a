"""entmax_fast: sparse (α-entmax) mappings and attention for PyTorch.

Drop-in for the ``entmax`` package (same names, arguments and defaults) plus
scaled-dot-product entmax attention with ``torch.nn.functional.scaled_dot_product_attention``'s
signature. Every op dispatches between Triton kernels, the C++ extension and the exact
plain-torch reference; :func:`backend_info` says which exist here and which each op used.
"""
from . import dispatch
from .attention import entmax_attention, entmax_attention_varlen, sparsemax_attention
from .chain import crf_attention, crf_marginals, sparsemap_attention, sparsemap_marginals
from .continuous import (ContinuousAttention, GaussianBasis1d, continuous_entmax15, continuous_softmax,
                         continuous_softmax_2d, continuous_sparsemax, continuous_sparsemax_2d)
from .dispatch import use_backend
from .inspection import attention_weights, support_size
from .kvcache import entmax_attention_with_kvcache
from .losses import (Entmax15Loss, EntmaxBisectLoss, NormmaxBisectLoss, SparsemaxBisectLoss, SparsemaxLoss,
                     entmax15_loss, entmax_bisect_loss, normmax_bisect_loss, sparsemax_bisect_loss, sparsemax_loss)
from .mappings import budget_bisect, entmax15, entmax_bisect, normmax_bisect, sparsemax, sparsemax_bisect
from .multihead import MultiheadEntmaxAttention, alibi_slopes, replace_attention
from .nn import BudgetBisect, Entmax15, EntmaxBisect, NormmaxBisect, Sparsemax, SparsemaxBisect
from .structured import Fusedmax, Oscarmax, fusedmax, fusedmax_attention, oscarmax, oscarmax_attention

__version__ = "0.1.0"

__all__ = [
    "sparsemax", "entmax15", "entmax_bisect", "sparsemax_bisect", "normmax_bisect", "budget_bisect",
    "Sparsemax", "Entmax15", "EntmaxBisect", "SparsemaxBisect", "NormmaxBisect", "BudgetBisect",
    "sparsemax_loss", "entmax15_loss", "sparsemax_bisect_loss", "entmax_bisect_loss", "normmax_bisect_loss",
    "SparsemaxLoss", "Entmax15Loss", "SparsemaxBisectLoss", "EntmaxBisectLoss", "NormmaxBisectLoss",
    "entmax_attention", "sparsemax_attention", "entmax_attention_varlen", "entmax_attention_with_kvcache",
    "attention_weights", "support_size", "MultiheadEntmaxAttention", "replace_attention",
    "alibi_slopes",
    "fusedmax", "oscarmax", "fusedmax_attention", "oscarmax_attention", "Fusedmax", "Oscarmax",
    "crf_marginals", "sparsemap_marginals", "crf_attention", "sparsemap_attention",
    "ContinuousAttention", "GaussianBasis1d", "continuous_softmax", "continuous_sparsemax", "continuous_entmax15",
    "continuous_softmax_2d", "continuous_sparsemax_2d",
    "backend_info", "use_backend",
]


def backend_info() -> dict:
    """Which backends exist on this machine (and why not), whether each will be used for
    CPU and for CUDA tensors, what is forced, and which backend every op used on this
    thread's last call of it, with the reason in words.

    Examples:
        >>> import torch, entmax_fast
        >>> p = entmax_fast.entmax15(torch.tensor([[3.0, 1.0, -2.0]]))
        >>> info = entmax_fast.backend_info()
        >>> sorted(info["backends"])
        ['cpp', 'reference', 'triton']
        >>> info["backends"]["reference"]["reason"]
        'plain torch, always available'
        >>> info["last_choice"]["entmax"]  # doctest: +SKIP
        {'backend': 'cpp', 'reason': 'cpp: C++ extension, avx512 CPU kernels (first choice for CPU tensors)'}
        >>> info["last_choice"]["entmax"]["backend"] in ("cpp", "reference")
        True
    """
    backends = {}
    for name in dispatch.BACKENDS:
        ok, why = dispatch.availability(name)
        backends[name] = {"available": ok, "reason": why,
                          "cpu": dispatch.device_usage(name, "cpu"), "cuda": dispatch.device_usage(name, "cuda")}
    last = {}
    for op in dispatch.registered_ops():
        choice = dispatch.last_choice(op)
        last[op] = None if choice is None else {"backend": choice.backend, "reason": choice.reason}
    return {"backends": backends, "forced": dispatch.forced_backend(), "ops": dispatch.registered_ops(),
            "last_choice": last}
