"""Forward and backward of every op in plain torch (contract: ``entmax_fast/backends``).

The row-wise and attention pairs are the reference's explicit formulas. fusedmax,
oscarmax, crf and sparsemap have no hand-written backward here: their gradient is autograd's through the
reference map, recomputed, a route independent of the C++ operators' formula.
"""
from __future__ import annotations

import torch

from ..._validation import ScoreOptions
from ...reference import attention as _attention
from ...reference import chain as _chain
from ...reference import kvcache as _kvcache
from ...reference import normmax_budget as _normmax_budget
from ...reference import structured as _structured
from ...reference.mappings import entmax_rowwise_backward as entmax_backward
from ...reference.mappings import entmax_rowwise_forward as entmax_forward

__all__ = ["entmax_forward", "entmax_backward", "normmax_forward", "normmax_backward", "budget_forward",
           "budget_backward", "fusedmax_forward", "fusedmax_backward", "oscarmax_forward", "oscarmax_backward",
           "attention_forward", "attention_backward", "attention_varlen_forward", "attention_varlen_backward",
           "attention_kvcache_forward", "attention_support_forward", "crf_forward", "crf_backward",
           "sparsemap_forward", "sparsemap_backward"]

normmax_forward = _normmax_budget.normmax_forward
normmax_backward = _normmax_budget.normmax_backward
budget_forward = _normmax_budget.budget_forward
budget_backward = _normmax_budget.budget_backward


def attention_forward(query, key, value, attn_mask, alpha, *, score_options=ScoreOptions(), **options):
    return _attention.attention_forward(query, key, value, attn_mask, alpha, **options,
                                        **score_options.keywords())


def attention_backward(grad_out, query, key, value, attn_mask, alpha, out, saved, *, score_options=ScoreOptions(),
                       **options):
    return _attention.attention_backward(grad_out, query, key, value, attn_mask, alpha, out, saved, **options,
                                         **score_options.keywords())


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alpha, *,
                             score_options=ScoreOptions(), **options):
    return _attention.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alpha,
                                               **options, **score_options.keywords())


def attention_varlen_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alpha, out,
                              saved, *, score_options=ScoreOptions(), **options):
    return _attention.attention_varlen_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k, alpha, out, saved, **options,
                                                **score_options.keywords())


def attention_kvcache_forward(query, k_cache, v_cache, seqlens_k, block_table, alpha, *, scale,
                              score_options=ScoreOptions()):
    return _kvcache.attention_kvcache_forward(query, k_cache, v_cache, seqlens_k, block_table, alpha, scale=scale,
                                              **score_options.keywords())


def attention_support_forward(query, key, attn_mask, alpha, *, score_options=ScoreOptions(), **options):
    return _attention.attention_support_forward(query, key, attn_mask, alpha, **options,
                                                **score_options.keywords())


def _vector_jacobian(mapping, grad, x, lengths, reg):
    """grad·J of ``mapping`` at x, by autograd through the reference map. Under
    create_graph (grad mode on in a backward) the graph is kept, so it differentiates again."""
    create_graph = torch.is_grad_enabled() and x.requires_grad
    with torch.enable_grad():
        z = x if create_graph else x.detach().requires_grad_()
        (dx,) = torch.autograd.grad(mapping(z, reg, dim=-1, lengths=lengths), z, grad, create_graph=create_graph)
    return dx


def fusedmax_forward(x, reg, lengths):
    # The reference's backward recomputes from x: nothing to save.
    return _structured.fusedmax(x, reg, dim=-1, lengths=lengths), x.new_empty(0)


def fusedmax_backward(grad, x, lengths, p, saved, reg):
    return _vector_jacobian(_structured.fusedmax, grad, x, lengths, reg)


def oscarmax_forward(x, reg, lengths):
    return _structured.oscarmax(x, reg, dim=-1, lengths=lengths), x.new_empty(0)


def oscarmax_backward(grad, x, lengths, p, saved, reg):
    return _vector_jacobian(_structured.oscarmax, grad, x, lengths, reg)


def _chain_vector_jacobian(mapping, grad, x, transitions):
    """(grad·J_x, grad·J_T) of a chain mapping at (x, transitions), by autograd through the
    reference map; under create_graph the graph is kept, as in _vector_jacobian."""
    create_graph = torch.is_grad_enabled() and (x.requires_grad or transitions.requires_grad)
    with torch.enable_grad():
        z = x if create_graph else x.detach().requires_grad_()
        t = transitions if create_graph else transitions.detach().requires_grad_()
        dx, dt = torch.autograd.grad(mapping(z, t, dim=-1), (z, t), grad, create_graph=create_graph,
                                     allow_unused=True)
    return (torch.zeros_like(x) if dx is None else dx), (torch.zeros_like(transitions) if dt is None else dt)


def crf_forward(x, transitions):
    # The reference's backward recomputes from x and the transitions: nothing to save.
    return _chain.crf_marginals(x, transitions, dim=-1), x.new_empty(0)


def crf_backward(grad, x, transitions, mu, saved):
    return _chain_vector_jacobian(_chain.crf_marginals, grad, x, transitions)


def sparsemap_forward(x, transitions):
    return _chain.sparsemap_marginals(x, transitions, dim=-1), x.new_empty(0)


def sparsemap_backward(grad, x, transitions, mu, saved):
    return _chain_vector_jacobian(_chain.sparsemap_marginals, grad, x, transitions)
